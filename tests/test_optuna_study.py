"""The run's Optuna study as optuna-dashboard shows it, whatever the sampler: the user's
sizes and what each trial measured as user attributes, predictions as pruned trials, no
trial left running, the recommendation as the note; the study and trials.csv agreeing."""

from __future__ import annotations

import signal
import subprocess
import sys

import optuna
import pytest
from test_interrupts import (
    MBTUNE,
    clean,
    joining,
    resumed_from,
    start_and_signal,
    study_agrees_with_rows,
)
from test_search import replay_experiment

from mbtune.lattice import BatchConfig
from mbtune.runs.record import TrialRecord
from mbtune.runs.rundir import RunDir
from mbtune.search import OptunaSpace, make_searcher, run_search, search_points
from mbtune.search._study import STUDY_NAME, SearchStudy, record_attrs, records_of

POINTS = [BatchConfig(32, n, m) for n in (1, 2) for m in (1, 2, 4, 8)]
OK, FAIL, PRUNED = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL,
                    optuna.trial.TrialState.PRUNED)  # fmt: skip


def sqlite(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'optuna.db'}"


def ledger(tmp_path) -> SearchStudy:
    """The run's study as its trial log writes it (mbtune.search._ledger)."""
    return SearchStudy.at(sqlite(tmp_path), OptunaSpace(POINTS))


def study(tmp_path) -> optuna.Study:
    return optuna.load_study(study_name=STUDY_NAME, storage=sqlite(tmp_path))


def record(config: BatchConfig, samples_per_s: float | None, status: str = "ok",
           trial: int = 1, **more) -> TrialRecord:  # fmt: skip
    return TrialRecord(
        trial=trial, status=status, **config.sizes(), grad_accum_steps=config.grad_accum_steps,
        samples_per_s=samples_per_s, objective=samples_per_s or 0.0, peak_memory_bytes=2**20,
        **more,
    )  # fmt: skip


def test_an_asked_trial_carries_its_proposal_then_what_it_measured(tmp_path):
    s = make_searcher("tpe", POINTS, seed=0, url=sqlite(tmp_path))
    proposed = BatchConfig.from_mapping(s.suggest("t1"))
    asked = study(tmp_path).trials[0]
    assert asked.state == optuna.trial.TrialState.RUNNING
    assert asked.user_attrs == {
        "batch_size": proposed.batch_size, "num_devices": proposed.num_devices,
        "micro_batch_size": proposed.micro_batch_size, "activation_checkpointing": False,
        "reshard_after_forward": True, "grad_sync": "last", "tensor_parallel": 1,
        "pipeline_parallel": 1, "pipeline_schedule": "1f1b",
        "grad_accum_steps": proposed.grad_accum_steps, "trial_id": "t1", "repeat": 0,
    }  # fmt: skip
    # measured at half the proposed micro-batch (halved on out of memory); the trial log
    # tells the study, after trials.csv's row
    ran = BatchConfig(proposed.batch_size, proposed.num_devices, 1)
    s.on_trial_complete("t1", {"objective": 123.0})
    ledger(tmp_path).tell(record(ran, 123.0, trial_id="t1", step_times_ms=(26.0, 26.1)))
    told = study(tmp_path).trials[0]
    assert told.state == OK and told.value == 123.0
    assert told.user_attrs == {
        "trial": 1, "trial_id": "t1", "status": "ok", "batch_size": 32,
        "num_devices": ran.num_devices, "micro_batch_size": 1,
        "activation_checkpointing": False, "reshard_after_forward": True, "grad_sync": "last",
        "tensor_parallel": 1, "pipeline_parallel": 1, "pipeline_schedule": "1f1b",
        "repeat": 0, "grad_accum_steps": ran.grad_accum_steps, "samples_per_s": 123.0,
        "peak_memory_bytes": 2**20, "objective": 123.0, "step_times_ms": [26.0, 26.1],
    }  # fmt: skip
    # the study holds the record whole: read back, it is trials.csv's
    assert ledger(tmp_path).records() == [record(ran, 123.0, trial_id="t1",
                                                 step_times_ms=(26.0, 26.1))]  # fmt: skip


def test_a_told_trial_is_written_only_the_attributes_it_was_not_asked_with(tmp_path, monkeypatch):
    s = make_searcher("grid", POINTS, seed=0, url=sqlite(tmp_path))
    proposed = BatchConfig.from_mapping(s.suggest("t1"))
    asked = dict(study(tmp_path).trials[0].user_attrs)
    written: list[str] = []
    log = ledger(tmp_path)
    set_attr = log.storage.set_trial_user_attr

    def counted(trial_id, key, value):
        written.append(key)
        set_attr(trial_id, key, value)

    monkeypatch.setattr(log.storage, "set_trial_user_attr", counted)
    measured = record(proposed, 123.0, trial_id="t1", step_times_ms=(26.0, 26.1))
    log.tell(measured)
    # each attribute a commit of its own: the sizes and the trial's id it had are not again
    assert sorted(written) == sorted(k for k, v in record_attrs(measured).items()
                                     if asked.get(k, object()) != v)  # fmt: skip
    assert {"batch_size", "micro_batch_size", "trial_id"}.isdisjoint(written)
    assert study(tmp_path).trials[0].user_attrs == {**asked, **record_attrs(measured)}


def test_a_damaged_study_is_set_aside_and_rebuilt_from_trials_csv(tmp_path, capsys):
    damaged = b"not a database " * 300  # what a crash mid-write may leave
    (tmp_path / "optuna.db").write_bytes(damaged)
    rows = [record(BatchConfig(32, 1, 4), 300.0, trial=1, trial_id="a"),
            record(BatchConfig(32, 2, 8), None, status="oom", trial=2, trial_id="b")]  # fmt: skip
    assert ledger(tmp_path).catch_up(rows) == 2
    assert ledger(tmp_path).records() == rows
    assert (tmp_path / "optuna.db.damaged").read_bytes() == damaged
    assert capsys.readouterr().err == (
        f"mbtune: {tmp_path / 'optuna.db'} is damaged (file is not a database): set aside as "
        "optuna.db.damaged; the study is rebuilt from trials.csv\n"
    )


def test_predictions_and_a_warm_start_are_trials_with_the_users_sizes(tmp_path):
    s = make_searcher("tpe", POINTS, seed=0, url=sqlite(tmp_path))
    predicted = record(BatchConfig(32, 2, 8), None, status="oom",
                       reason="predicted: 9.1 GiB over 8.0 GiB")  # fmt: skip
    s.add_predicted([predicted])
    s.add_predicted([predicted])  # once each
    s.teach(record(BatchConfig(32, 1, 8), 300.0, trial=4, trial_id="old"), "earlier, trial 4")
    oom, warm = study(tmp_path).trials
    assert oom.state == PRUNED and oom.value is None
    assert (oom.user_attrs["status"], oom.user_attrs["micro_batch_size"]) == ("oom", 8)
    assert oom.user_attrs["reason"] == "predicted: 9.1 GiB over 8.0 GiB"
    assert "samples_per_s" not in oom.user_attrs  # not measured: left out, not null
    assert warm.state == OK and warm.value == 300.0
    assert warm.user_attrs["warm_start"] == "earlier, trial 4"
    assert "trial" not in warm.user_attrs and "trial_id" not in warm.user_attrs  # not a row here
    assert ledger(tmp_path).records() == [predicted]  # this run's: the prediction alone


def test_the_study_catches_up_with_the_rows_a_killed_driver_could_not_tell_it(tmp_path):
    s = make_searcher("grid", POINTS, seed=0, url=sqlite(tmp_path))
    first = BatchConfig.from_mapping(s.suggest("t1"))
    s.suggest("t2")  # in flight when the driver was killed
    rows = [record(first, 50.0, trial_id="t1")]  # written to trials.csv, then the kill
    # ...that caught the trial log between the trial's attributes and its tell
    ledger(tmp_path).set_attrs(0, record_attrs(rows[0]))
    assert ledger(tmp_path).catch_up(rows) == 1
    assert ledger(tmp_path).catch_up(rows) == 0  # once
    states = [(t.state, t.user_attrs["status"]) for t in study(tmp_path).trials]
    assert states == [(FAIL, "interrupted"), (FAIL, "interrupted"), (OK, "ok")]
    assert ledger(tmp_path).records() == rows  # the study and the ledger agree


def test_an_interrupted_trial_is_failed_and_its_later_result_learnt(tmp_path):
    s = make_searcher("tpe", POINTS, seed=0, url=sqlite(tmp_path))
    params = s.suggest("t1")
    assert ledger(tmp_path).fail_interrupted() == 1  # the driver stopped with t1 in flight
    assert ledger(tmp_path).fail_interrupted() == 0
    # the resumed run measures it: learnt as a trial of its own, the failed one kept
    config = BatchConfig.from_mapping(params)
    ledger(tmp_path).tell(record(config, 77.0, trial_id="t1"))
    trials = study(tmp_path).trials
    assert [t.state for t in trials] == [FAIL, OK]
    assert trials[1].value == 77.0 and trials[1].user_attrs["samples_per_s"] == 77.0


def test_a_warm_start_reads_the_earlier_runs_study_and_a_run_without_one_its_rows(tmp_path):
    from mbtune.search._run import measured

    space = OptunaSpace(POINTS)
    run = RunDir.create(tmp_path, "earlier")
    rows = [record(BatchConfig(32, 1, 4), 300.0, trial=1, trial_id="a"),
            record(BatchConfig(32, 2, 8), None, status="oom", trial=2, trial_id="b")]  # fmt: skip
    for r in rows:
        run.append_trial(r)
    assert measured(run, space) == run.records()  # a run from before every run kept a study
    assert not (run.path / "optuna.db").exists()  # read, not written: the run may be another's
    study = SearchStudy.at(run.optuna_url, space)
    for r in rows:
        study.tell(r)
    run.trials_file.write_text("")  # the study is what is read
    assert measured(run, space) == rows


def test_without_optuna_dashboard_the_recommendation_is_a_study_attribute(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "optuna_dashboard", None)  # not installed
    ledger(tmp_path).publish("mbtune 12:00:00  recommended micro_batch_size: 4",
                             confidence=42, target=90, trials=3)  # fmt: skip
    attrs = study(tmp_path).user_attrs
    assert attrs == {"recommendation": "mbtune 12:00:00  recommended micro_batch_size: 4",
                     "confidence": 42, "trials": 3}  # fmt: skip


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("sampler", ["model", "halving", "tpe"])
def test_every_run_leaves_a_study_of_every_trial_its_attributes_and_its_recommendation(
    ray_session, tmp_path, monkeypatch, sampler
):
    """Each way the searcher asks a sampler (mbtune/search/_searcher.py): the model's own
    (_from_model), a lattice baseline's (_from_sampler's LatticeSampler branch: halving;
    the grid takes the same branch, and its study is checked after SIGTERM and the resume
    in tests/test_interrupts.py), Optuna's (tpe: asked, and answered from the cache)."""
    from mbtune.search import _run

    # the quickstart's lattice, replayed; m = 32 on one device predicted out of memory
    def predict(exp, points, run, say, screening=None):
        oom = TrialRecord(trial=1, status="oom", batch_size=32, num_devices=1,
                          micro_batch_size=32, reason="predicted: over the budget",
                          objective=0.0)  # fmt: skip
        run.append_trial(oom)
        return [oom]

    monkeypatch.setattr(_run, "predict_out_of_memory", predict)
    lines: list[str] = []
    exp = replay_experiment(tmp_path, sampler=sampler, num_samples=8)
    outcome = run_search(exp, echo=lines.append)
    saved = optuna.load_study(study_name=STUDY_NAME, storage=outcome.run.optuna_url)
    assert optuna.get_all_study_names(outcome.run.optuna_url) == [STUDY_NAME]
    trials = saved.get_trials(deepcopy=False)
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    for t in trials:
        assert {"batch_size", "num_devices", "micro_batch_size", "status"} <= set(t.user_attrs)
    (oom,) = [t for t in trials if t.state == PRUNED]
    assert oom.user_attrs["reason"] == "predicted: over the budget"
    rows = {t.user_attrs["trial"]: t for t in trials if "trial" in t.user_attrs}
    assert sorted(rows) == [r.trial for r in outcome.records]  # every row once, repeats too
    # each the same trial, as trials.csv writes it (the study keeps each figure whole)
    told = records_of(trials, OptunaSpace(search_points(exp)))
    assert [r.to_row() for r in told] == [r.to_row() for r in outcome.records]
    for r in outcome.records:
        assert rows[r.trial].value == (None if r.predicted else r.objective)
    final = [line for line in lines if "recommended micro_batch_size:" in line][-1]
    assert saved.user_attrs["recommendation"] == final
    assert saved.user_attrs["confidence"] == outcome.summary["confidence"]
    from optuna_dashboard import get_note

    assert final in get_note(saved)


@pytest.mark.ray
@pytest.mark.slow
def test_a_killed_run_leaves_no_trial_running_and_its_study_agrees_with_its_rows(
    tmp_path, shared_ray
):
    """The study is what a resumed search reads (the sampler's state, the budget, what was
    measured): after a kill and the resume, it agrees with trials.csv, row for row, and
    nothing in it is left running. Optuna's own sampler (tpe) proposes here, each trial
    asked of the study and answered from what was measured where it proposes a
    configuration again (MbtuneSearcher._from_sampler, its pickled TPE restored); the
    search model's sampler, which proposes from the study itself (_from_model), is killed
    and resumed the same way in tests/test_interrupts.py's scheduled kill, which checks its
    study as this does, and a search stopped by SIGTERM and resumed in its SIGTERM test."""
    # on the session's Ray: the study is the subject (tests/test_interrupts.py stops and
    # kills searches on an embedded Ray too)
    code, _, _, run = start_and_signal(
        tmp_path, signal.SIGKILL, sampler="tpe", num_samples=8, ray=shared_ray
    )
    assert code == -signal.SIGKILL
    before = RunDir(run).trials()
    done = subprocess.run([MBTUNE, "run", "--resume", str(run), *joining(shared_ray)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    # Optuna's study (optuna.db) outlives a kill, told of trials Ray never saved: the
    # resumed searcher must not tell it again ("Cannot tell a COMPLETE trial")
    clean(done.stdout + done.stderr)
    resumed_from(done.stdout, before)
    after = RunDir(run).trials()
    assert after[: len(before)] == before
    first = [(r["num_devices"], r["micro_batch_size"]) for r in after if r["repeat"] == "0"]
    assert len(first) == len(set(first))  # no configuration first-measured twice
    assert len(after) <= 8  # the budget, though Ray's saved state knew fewer trials
    study_agrees_with_rows(run)


@pytest.mark.ray
@pytest.mark.slow
def test_the_model_sampler_in_a_study_of_your_own_recommends_what_mbtune_run_does(
    ray_session, tmp_path
):
    """docs/search.md's example: a plain Optuna study, the model sampler, your own
    objective (here the replay table, measured with the trial's Python API)."""
    from mbtune.search import ModelSampler, RecommendAndStop
    from mbtune.trial.trial import trial_metrics

    exp = replay_experiment(tmp_path)  # the default sampler, model
    outcome = run_search(exp, echo=lambda line: None)

    sampler = ModelSampler.for_experiment(exp)
    study = optuna.create_study(direction="maximize", sampler=sampler)

    def objective(trial: optuna.Trial) -> float:
        config = sampler.configuration(trial)
        result = trial_metrics(exp, config, repeat=trial.user_attrs["repeat"])
        for key in ("status", "samples_per_s", "step_times_ms", "micro_batch_sizes_tried"):
            trial.set_user_attr(key, result[key])
        return result["objective"]

    study.optimize(objective, n_trials=exp.search.num_samples,
                   callbacks=[RecommendAndStop(sampler)])  # fmt: skip
    ran = [BatchConfig.from_mapping(t.user_attrs) for t in study.trials]
    assert ran == [r.config for r in outcome.records]  # the same trials, in the same order
    recommended = outcome.summary["recommended"]
    line = study.user_attrs["recommendation"]
    assert line.endswith(f"confidence score: {outcome.summary['confidence']} (out of 100)")
    assert (
        f"micro_batch_size: {recommended['micro_batch_size']} (num_devices: "
        f"{recommended['num_devices']}, batch_size: {recommended['batch_size']}" in line
    )
