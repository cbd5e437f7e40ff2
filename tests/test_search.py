"""The search end to end on an embedded Ray, and the per-trial process it runs."""

import csv
import textwrap

import pytest

from mbtune.config.load import parse_experiment
from mbtune.lattice import BatchConfig
from mbtune.search import run_search
from mbtune.trial.launch import measure_in_subprocess
from mbtune.trial.trial import TrialRequest

TABLE = """batch_size,num_devices,micro_batch_size,samples_per_s,status
32,1,1,100,ok
32,1,2,180,ok
32,1,4,300,ok
32,1,8,320,ok
32,1,16,310,ok
32,1,32,,oom
32,2,1,190,ok
32,2,2,350,ok
32,2,4,590,ok
32,2,8,630,ok
32,2,16,,oom
"""


def replay_experiment(tmp_path, **search):
    (tmp_path / "t.csv").write_text(TABLE)
    return parse_experiment(
        {
            "name": "e2e",
            "model": "mlp",
            "train_input": {"batch_size": 32, "micro_batch_size": "auto"},
            "search": {"space": {"num_devices": [1, 2]}, **search},
            "trial": {"backend": "replay", "table": str(tmp_path / "t.csv")},
            "output_dir": str(tmp_path / "runs"),
        }
    )


@pytest.mark.ray
@pytest.mark.slow
def test_a_grid_search_measures_every_configuration_once(ray_session, tmp_path):
    lines = []
    outcome = run_search(replay_experiment(tmp_path, sampler="grid"), echo=lines.append)
    run = outcome.run
    assert (run.path / "experiment.yaml").is_file() and (run.path / "optuna.db").is_file()
    assert (run.path / "ray").is_dir()
    with run.trials_file.open() as f:
        rows = list(csv.DictReader(f))
    measured = [(int(r["num_devices"]), int(r["micro_batch_size"])) for r in rows]
    assert sorted(measured) == [(1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (1, 32),
                                (2, 1), (2, 2), (2, 4), (2, 8), (2, 16)]  # fmt: skip
    assert sum(r["status"] == "oom" for r in rows) == 2
    best = outcome.best(1)[0]
    assert (best["num_devices"], best["micro_batch_size"], float(best["samples_per_s"])) == (
        "2", "8", 630.0
    )  # fmt: skip
    assert sum(line.startswith("mbtune ") and " trial " in line for line in lines) == 11
    assert any("best configurations:" in line for line in lines)
    # Tune keeps running statistics of every numeric key a trial reports, for the whole
    # search: a trial reports its objective and the rest as one string
    import json

    results = [json.loads(p.read_text()) for p in (run.path / "ray").glob("*/result.json")]
    assert len(results) == 11
    for result in results:
        assert isinstance(result["objective"], float) and isinstance(result["measured"], str)
        assert "samples_per_s" not in result and "step_times_ms" not in result


@pytest.mark.ray
@pytest.mark.slow
def test_the_search_streams_recommendations_and_stops_when_confident(ray_session, tmp_path):
    import json

    lines = []
    exp = replay_experiment(tmp_path, sampler="model", confidence_target=50)
    outcome = run_search(exp, echo=lines.append)
    rows, run = outcome.rows, outcome.run
    assert len(rows) < 11  # stopped before the space was measured
    assert any(line == "mbtune: stopping: the confidence score reached its target 50"
               for line in lines)  # fmt: skip
    records = [json.loads(x) for x in run.recommendations_file.read_text().splitlines()]
    assert records and records[-1]["confidence"] >= 50
    assert records[-1]["trials"] == len(rows)
    assert sum("recommended micro_batch_size:" in line for line in lines) == len(records)
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary == outcome.summary and summary["status"] == "confident"
    assert summary["confidence"] == records[-1]["confidence"]
    assert summary["recommended"]["micro_batch_size"] == records[-1]["micro_batch_size"]


CRASHING = """
import os, signal, torch, torch.nn as nn
def build(how="kill"):
    def loss(module, batch):
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise SystemExit(3)
    return nn.Linear(2, 1), lambda n, device: (torch.randn(n, 2, device=device),), loss
"""


@pytest.mark.parametrize(
    ("how", "reason"),
    [("kill", "the trial process was killed (SIGKILL"), ("exit", "exited with 3")],
)
@pytest.mark.slow
def test_a_trial_process_that_dies_is_a_recorded_error(tmp_path, how, reason):
    (tmp_path / "crashing.py").write_text(textwrap.dedent(CRASHING))
    exp = parse_experiment(
        {
            "name": "x",
            "model": {"name": "crashing:build", "how": how},
            "train_input": {"batch_size": 4, "micro_batch_size": 2},
            "trial": {"compile": False},
        }
    )
    request = TrialRequest(experiment=exp, config=BatchConfig(4, 1, 2))
    result = measure_in_subprocess(request, cwd=str(tmp_path))
    assert result["status"] == "error" and reason in result["reason"]
    assert result["objective"] == 0.0 and result["micro_batch_size"] == 2


@pytest.mark.slow
def test_the_trial_process_reports_json(tmp_path):
    exp = replay_experiment(tmp_path)
    request = TrialRequest(experiment=exp, config=BatchConfig(32, 2, 8))
    result = measure_in_subprocess(request, cwd=str(tmp_path))
    assert result["status"] == "ok" and result["samples_per_s"] == 630.0
    assert result["objective"] == 630.0


@pytest.mark.ray
@pytest.mark.slow
def test_a_tpe_search_respects_num_samples_and_objective_then_resumes_and_warm_starts(
    ray_session, tmp_path, monkeypatch
):
    """One tpe search (of 5) for its budget and objective, and as what a resume keeps and a
    warm start teaches: each used to run a search of its own."""
    from mbtune.search import resume_search

    per_device = {"sampler": "tpe", "objective": "samples_per_s_per_device"}
    lines = []
    first = run_search(replay_experiment(tmp_path, **per_device, num_samples=5),
                       echo=lines.append)  # fmt: skip
    rows = first.rows
    assert len(rows) == 5
    assert len({(r["num_devices"], r["micro_batch_size"]) for r in rows}) == 5
    # a search that ends on its budget says so, in the stream and in summary.json
    reason = first.summary["reason"]
    assert reason.startswith("the trial budget (search.num_samples 5) ran out at confidence ")
    assert f"mbtune: stopping: {reason}" in lines
    for r in rows:
        if r["status"] == "ok":
            assert float(r["objective"]) == pytest.approx(
                float(r["samples_per_s"]) / int(r["num_devices"])
            )
    # resume the same run: nothing finished is repeated or lost; the run directory given
    # as the search printed it, relative to the working directory
    monkeypatch.chdir(tmp_path)
    resumed = resume_search(first.run.path.relative_to(tmp_path))
    assert [r["trial_id"] for r in resumed.rows[:5]] == [r["trial_id"] for r in rows]
    assert len({r["trial_id"] for r in resumed.rows}) == len(resumed.rows)
    lines = []
    warm = run_search(
        replay_experiment(tmp_path, **per_device, num_samples=2),
        warm_start=first.run.path,
        echo=lines.append,
    )
    assert any("the sampler learnt 5 results" in line for line in lines)
    assert warm.run.path != first.run.path and len(warm.rows) == 2


def test_run_refuses_bad_directories_and_addresses(tmp_path, capsys):
    from mbtune.cli import main

    code = main(["run", "--resume", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and "--resume: " in err and "is not an mbtune run directory" in err
    code = main(["run"])
    assert code == 2 and "give EXPERIMENT.yaml, or --resume RUN_DIR" in capsys.readouterr().err
    exp = replay_experiment(tmp_path)
    (tmp_path / "e.yaml").write_text(__import__("yaml").safe_dump(exp.to_dict()))
    code = main(["run", str(tmp_path / "e.yaml"), "--address", "127.0.0.1:9"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("mbtune: error: --address: nothing answers at 127.0.0.1:9")
    assert not (tmp_path / "runs").exists()  # nothing written


def test_a_row_cut_short_by_a_killed_driver_is_skipped_and_not_glued_to_the_next(tmp_path):
    from mbtune.runs.rundir import RunDir

    run = RunDir.create(tmp_path, "cut")
    row = {"trial": 1, "trial_id": "a", "status": "ok", "batch_size": 32, "num_devices": 1,
           "micro_batch_size": 4, "samples_per_s": 100.0}  # fmt: skip
    run.append_trial(row)
    with run.trials_file.open("a") as f:
        f.write("2,b,ok,32,1")  # the driver died here
    assert [r["trial_id"] for r in run.trials()] == ["a"]
    run.append_trial({**row, "trial": 2, "trial_id": "c"})
    assert [r["trial_id"] for r in run.trials()] == ["a", "c"]


def test_a_run_begun_by_an_older_mbtune_keeps_its_columns(tmp_path):
    from mbtune.runs.rundir import TRIAL_COLUMNS, RunDir

    run = RunDir.create(tmp_path, "old")
    older = [c for c in TRIAL_COLUMNS if c != "node_id"]  # before trials recorded their node
    first = {"trial": "1", "trial_id": "a", "status": "ok", "batch_size": "32",
             "num_devices": "1", "micro_batch_size": "4"}  # fmt: skip
    run.trials_file.write_text(
        ",".join(older) + "\r\n" + ",".join(first.get(c, "") for c in older) + "\r\n"
    )
    run.append_trial({**first, "trial": 2, "trial_id": "b", "node_id": "f" * 56})  # resumed
    rows = run.trials()
    assert [r["trial_id"] for r in rows] == ["a", "b"]  # the new row is read, not dropped
    assert list(rows[1]) == older


def test_a_trial_whose_directory_is_missing_on_its_node_is_a_recorded_error(tmp_path):
    exp = replay_experiment(tmp_path)
    missing = tmp_path / "not-on-this-node"
    request = TrialRequest(experiment=exp, config=BatchConfig(32, 2, 8))
    result = measure_in_subprocess(request, cwd=str(missing))
    assert result["status"] == "error" and result["objective"] == 0.0
    assert result["reason"].startswith(f"cannot start the trial process in {missing} on ")


def test_the_callbacks_still_pickle_once_ray_has_replaced_print(tmp_path, monkeypatch):
    """Tune pickles its callbacks with the experiment state; Ray replaces builtins.print to
    show worker output (on a cluster, with --verbose). The search's own echo still pickles."""
    import builtins
    import pickle

    from ray import cloudpickle

    from mbtune.recommend.reporter import Reporter
    from mbtune.runs.rundir import RunDir
    from mbtune.search import ConfidenceStop, TrialLog, print_line

    original = builtins.print
    monkeypatch.setattr(builtins, "print", lambda *args, **kwargs: None)  # as Ray's tqdm does
    log = TrialLog(RunDir.create(tmp_path, "x"), print_line, Reporter([BatchConfig(32, 1, 4)]))
    restored = cloudpickle.loads(cloudpickle.dumps(ConfidenceStop(log)))
    assert restored.log.echo is print_line and restored.log.target == 90
    with pytest.raises(pickle.PicklingError, match="not the same object as builtins.print"):
        cloudpickle.dumps(original)  # what the search held before: its state was not saved


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["model", "grid"])
def test_a_search_over_activation_checkpointing_recommends_one_setting(
    ray_session, tmp_path, sampler
):
    # without checkpointing m >= 16 runs out of memory; with it m = 32 fits and is fastest
    from pathlib import Path

    table = Path(__file__).parent.parent / "experiments" / "tables" / "checkpointing.csv"
    exp = parse_experiment(
        {
            "name": "ac",
            "model": "mlp",
            "train_input": {"batch_size": 32, "micro_batch_size": "auto"},
            "search": {"space": {"activation_checkpointing": [False, True]}, "sampler": sampler,
                       "confidence_target": 100},
            "trial": {"backend": "replay", "table": str(table)},
            "output_dir": str(tmp_path / "runs"),
        }
    )  # fmt: skip
    assert len(exp.configs()) == 12
    lines: list[str] = []
    outcome = run_search(exp, echo=lines.append)
    rows = outcome.rows
    measured = {BatchConfig.from_mapping(r) for r in rows}
    assert len(measured) == len(rows)  # no configuration measured twice
    assert any(c.activation_checkpointing for c in measured)
    best = outcome.summary["recommended"]
    assert (best["micro_batch_size"], best.get("activation_checkpointing")) == (32, True)
    assert any("with activation checkpointing" in line for line in lines)
    assert {r["activation_checkpointing"] for r in rows} <= {"True", "False"}
