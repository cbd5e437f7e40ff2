"""The command line: exit codes, what it prints, one-line errors for bad input."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mbtune.cli import main

ROOT = Path(__file__).resolve().parent.parent
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def write(tmp_path, raw, name="e.yaml"):
    path = tmp_path / name
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return path


def base(**train_input):
    return {
        "name": "t",
        "model": {"name": "mlp"},
        "train_input": {"batch_size": 64, "micro_batch_size": "auto", **train_input},
    }


def test_validate_prints_a_summary(capsys):
    code, out, err = run(capsys, "validate", QUICKSTART)
    assert code == 0 and err == ""
    assert f"{QUICKSTART}: valid" in out
    assert "11 configurations (11 distinct measurements)" in out
    assert "micro_batch_size auto" in out


def test_validate_shows_how_the_users_own_config_runs(capsys, tmp_path):
    path = write(tmp_path, base(micro_batch_size=8, num_devices=2))
    code, out, _ = run(capsys, "validate", path)
    assert code == 0
    assert "yours runs 2 devices x 4 micro-batches of 8" in out


@pytest.mark.parametrize(
    ("target", "says"),
    [
        (99, "stop at confidence 99, seed"),
        (100, "never stops on confidence (runs to num_samples or the time budget), seed"),
    ],
)
def test_validate_says_when_the_search_stops_on_confidence(capsys, tmp_path, target, says):
    # the score is 0..99: a target of 100 was shown as "stop at confidence 100"
    path = write(tmp_path, {**base(), "search": {"confidence_target": target}})
    code, out, _ = run(capsys, "validate", path)
    assert code == 0
    assert [line for line in out.splitlines() if "objective" in line] == [
        f"  search       sampler model, objective samples_per_s, up to 20 trials, {says} 0"
    ]


def test_space_json_lists_every_configuration(capsys):
    code, out, _ = run(capsys, "space", QUICKSTART, "--format", "json")
    data = json.loads(out)
    assert code == 0 and data["count"] == 11 and data["distinct"] == 11
    assert [(c["num_devices"], c["micro_batch_size"]) for c in data["configurations"]] == [
        (1, 1), (1, 2), (1, 4), (1, 8), (1, 16), (1, 32),
        (2, 1), (2, 2), (2, 4), (2, 8), (2, 16),
    ]  # fmt: skip
    first = data["configurations"][0]
    assert first == {
        "batch_size": 32, "num_devices": 1, "micro_batch_size": 1, "per_device_batch": 32,
        "grad_accum_steps": 32, "micro_batches": "32x1", "strict": True, "runs_as": 1,
    }  # fmt: skip


def test_space_counts_distinct_measurements_in_explore_mode(capsys, tmp_path):
    raw = base(micro_batch_size="explore", batch_size=8)
    path = write(tmp_path, raw)
    code, out, _ = run(capsys, "space", path, "--format", "csv")
    lines = out.strip().splitlines()
    assert code == 0 and len(lines) == 1 + 8
    assert lines[0] == (
        "batch_size,num_devices,micro_batch_size,per_device_batch,grad_accum_steps,"
        "micro_batches,strict,runs_as"
    )
    assert lines[5] == "8,1,5,8,2,2x4,False,4"  # m = 5 runs two micro-batches of 4
    code, out, _ = run(capsys, "space", path)
    assert out.strip().splitlines()[-1] == (
        "8 configurations, 5 distinct measurements (mode explore, space 'default')"
    )


def test_validate_and_space_name_a_device_count_that_leaves_nothing(capsys):
    said = ("num_devices 3: batch_size 32 does not split evenly over 3 devices; valid "
            "num_devices for batch_size 32: 1, 2, 4, 8, 16, 32")  # fmt: skip
    three = ("--set", "search.space.num_devices=[1,3]")
    code, out, _ = run(capsys, "validate", QUICKSTART, *three)
    assert code == 0 and f"\n  not searched {said}\n" in out
    code, out, _ = run(capsys, "space", QUICKSTART, *three)
    assert code == 0 and out.splitlines()[-1] == f"not searched: {said}"
    code, out, _ = run(capsys, "space", QUICKSTART, *three, "--format", "json")
    assert code == 0 and json.loads(out)["not_searched"] == [said]
    code, out, err = run(capsys, "space", QUICKSTART, *three, "--format", "csv")
    assert code == 0 and "3" not in {line.split(",")[1] for line in out.splitlines()}
    assert err == f"mbtune: not searched: {said}\n"
    code, out, _ = run(capsys, "validate", QUICKSTART)  # nothing left out: nothing said
    assert code == 0 and "not searched" not in out


def test_space_keeps_megatrons_rules_for_the_models_shape(capsys):
    """The quickstart's GPT has 2 layers and 4 heads: t 3 and the 2-stage-per-rank
    schedules at p 2 cannot split it, nor can a device count that t x p does not divide."""
    sets = ("--set", "search.space.num_devices=[1,2,3,4]",
            "--set", "search.space.tensor_parallel=[1,2,3]",
            "--set", "search.space.pipeline_parallel=[1,2]",
            "--set", "search.space.pipeline_schedule=[1f1b,interleaved_1f1b]")  # fmt: skip
    code, out, _ = run(capsys, "space", QUICKSTART, *sets, "--format", "json")
    assert code == 0
    shown = json.loads(out)
    layouts = {(c["num_devices"], c["tensor_parallel"], c["pipeline_parallel"],
                c.get("pipeline_schedule", "1f1b")) for c in shown["configurations"]}  # fmt: skip
    assert layouts == {(1, 1, 1, "1f1b"), (2, 1, 1, "1f1b"), (2, 2, 1, "1f1b"),
                       (2, 1, 2, "1f1b"), (4, 1, 1, "1f1b"),
                       (4, 2, 1, "1f1b"), (4, 1, 2, "1f1b"), (4, 2, 2, "1f1b")}  # fmt: skip
    for c in shown["configurations"]:  # 1f1b: at least p micro-batches of each replica
        assert c["grad_accum_steps"] >= c["pipeline_parallel"]
        assert (
            c["data_parallel"] * c["tensor_parallel"] * c["pipeline_parallel"] == c["num_devices"]
        )
    assert shown["not_searched"] == [
        "pipeline_parallel 2 with interleaved_1f1b: pipeline_parallel 2 x 2 stages per rank "
        "(interleaved_1f1b) = 4 stages does not divide the model's 2 layers",
        "tensor_parallel 3: tensor_parallel 3 does not divide the model's 4 attention heads",
        "num_devices 3: batch_size 32 does not split evenly over 3 devices; valid num_devices "
        "for batch_size 32: 1, 2, 4, 8, 16, 32",
    ]


@pytest.mark.parametrize(
    ("sets", "line"),
    [
        (["train_input.num_devices=3", "train_input.tensor_parallel=3"],
         "train_input.tensor_parallel: tensor_parallel 3 does not divide the model's 4 "
         "attention heads; valid tensor_parallel for this model: 1, 2, 4"),
        (["train_input.num_devices=2", "train_input.pipeline_parallel=2",
          "trial.pipeline_schedule=zbv"],
         "train_input.pipeline_parallel: pipeline_parallel 2 x 2 stages per rank (zbv) = 4 "
         "stages does not divide the model's 2 layers; valid pipeline_parallel for this "
         "model: 1"),
        (["train_input.num_devices=2", "train_input.pipeline_parallel=2",
          "train_input.micro_batch_size=16", "trial.pipeline_schedule=dualpipev"],
         "trial.pipeline_schedule: dualpipev with pipeline_parallel 2 needs at least 4 "
         "micro-batches per step, and this configuration has 2"),
    ],
)  # fmt: skip
def test_a_layout_the_model_cannot_take_exits_2_naming_the_field(capsys, sets, line):
    code, out, err = run(capsys, "validate", QUICKSTART, *(a for s in sets for a in ("--set", s)))
    assert code == 2 and out == "" and err == f"mbtune: error: {line}\n"


def test_a_space_whose_every_layout_fails_blames_the_layouts_alone(capsys):
    # micro_batch_size 1, 2, 4 divide the per-device batch: no clause may say otherwise
    code, _, err = run(capsys, "validate", QUICKSTART, "--set", "search.space.num_devices=[4]",
                       "--set", "search.space.tensor_parallel=[3]")  # fmt: skip
    assert code == 2 and err.endswith(
        "; tensor_parallel 3: tensor_parallel 3 does not divide the model's 4 attention heads\n"
    )


def test_set_overrides_work_on_every_command(capsys):
    code, out, _ = run(
        capsys, "space", QUICKSTART, "--format", "json",
        "--set", "train_input.batch_size=8", "--set", "search.space.num_devices=[1]",
    )  # fmt: skip
    assert code == 0 and json.loads(out)["count"] == 4  # divisors of 8
    code, out, _ = run(capsys, "validate", QUICKSTART, "--set", "name=renamed")
    assert code == 0 and "renamed" in out


# -- bad input: exit 2, one line naming the field, no traceback ------------------

BAD = {
    "yaml syntax": ("model: [mlp\n", r"invalid YAML at line \d+, column \d+"),
    "unknown key": ({**base(), "serch": {}}, r"serch: unknown key; .*did you mean 'search'"),
    "wrong type": (base(batch_size="sixty"), r"train_input\.batch_size: expected a whole number"),
    "zero size": (base(batch_size=0), r"train_input\.batch_size: 0 is out of range"),
    "negative size": (base(num_devices=-2), r"train_input\.num_devices: -2 is out of range"),
    "batch below devices": (base(batch_size=2, num_devices=4), r"batch_size 2 is smaller "
                            r"than num_devices 4"),
    "not divisible": (base(micro_batch_size=5), r"train_input\.micro_batch_size: "
                      r"micro_batch_size 5 does not divide the per-device batch 64 .*60 \(below\)"
                      r" or 65 \(above\); valid micro_batch_size for batch_size 64: 1, 2, 4, 8, "
                      r"16, 32, 64"),
    "both aliases": (base(num_csx=2, num_devices=2), r"train_input\.num_csx: give num_devices "
                     r"or its Cerebras alias num_csx, not both"),
    "unknown mode": (base(micro_batch_size="fastest"), r"train_input\.micro_batch_size: .*"
                     r"'auto', 'explore' or 'none', got 'fastest'"),
    "unknown sampler": ({**base(), "search": {"sampler": "bayes"}}, r"search\.sampler: 'bayes' "
                        r"is not one of: tpe, gp, random, model, grid, halving, doubling"),
    "unknown backend": ({**base(), "trial": {"backend": "tf"}}, r"trial\.backend: 'tf' is not "
                        r"one of: torch, replay"),
    "unknown model": ({**base(), "model": {"name": "resnet"}}, r"model\.name: unknown model "
                      r"'resnet'; valid: gpt, mlp, cnn_bn, or package\.module:function"),
    "empty space": ({**base(), "search": {"space": {"micro_batch_size": [128]}}},
                    r"search\.space: no valid configuration"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD))
@pytest.mark.parametrize("command", ["validate", "space"])
def test_bad_input_exits_2_with_one_line(capsys, tmp_path, case, command):
    raw, message = BAD[case]
    code, out, err = run(capsys, command, write(tmp_path, raw))
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("mbtune: error: ")
    assert re.search(message, err), err


def test_validate_imports_a_user_model_and_checks_its_contract(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    code, out, _ = run(capsys, "validate", ROOT / "experiments" / "user_model.yaml")
    assert code == 0 and "experiments.user_model:build" in out
    path = write(tmp_path, {**base(), "model": {"name": "nowhere.to_be:found"}})
    code, out, err = run(capsys, "validate", path)
    assert code == 2 and out == ""
    assert err.startswith("mbtune: error: model.name: cannot import 'nowhere.to_be'")


def test_missing_file_and_bad_override(capsys, tmp_path):
    code, _, err = run(capsys, "validate", tmp_path / "missing.yaml")
    missing = tmp_path / "missing.yaml"
    assert code == 2 and err == f"mbtune: error: experiment file not found: {missing}\n"
    code, _, err = run(capsys, "validate", QUICKSTART, "--set", "oops")
    assert code == 2 and "--set: expected KEY.PATH=VALUE" in err


def test_usage_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as info:
        main(["space", QUICKSTART.as_posix(), "--format", "xml"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1
    assert "invalid choice: 'xml'" in err


def test_console_script_help():
    exe = Path(sys.executable).with_name("mbtune")
    for argv in (["--help"], ["validate", "--help"], ["space", "--help"]):
        out = subprocess.run([exe, *argv], capture_output=True, text=True, check=True).stdout
        assert out.startswith("usage: mbtune")
    result = subprocess.run([exe, "validate", "/nonexistent.yaml"], capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr


# -- analyze -------------------------------------------------------------------


def test_analyze_prints_the_ranked_trials_the_failed_ones_and_the_pivot(capsys, tmp_path):
    from rundirs import PNG_MAGIC, finished_run

    path = finished_run(tmp_path)
    code, out, err = run(capsys, "analyze", path)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"{path}: 'handmade', 6 trials (4 ok, 1 error, 1 oom); status confident"
    assert lines[1] == (
        "recommended (summary.json, confidence 92): num_devices 2, batch_size 32, "
        "micro_batch_size 8 (2 micro-batches per device, fp32): 630.0 samples/s"
    )
    ranked = lines[lines.index("trials, best first by samples_per_s:") + 2 :][:4]
    assert [row.split()[:5] for row in ranked] == [
        ["1", "2", "32", "2", "8"], ["2", "5", "32", "2", "4"],
        ["3", "4", "32", "1", "8"], ["4", "1", "32", "1", "4"],
    ]  # fmt: skip
    failed = lines[lines.index("failed trials:") + 1 :][:3]
    assert failed[1].split()[:6] == ["3", "32", "2", "16", "oom", "oom"]
    assert failed[2].split()[:5] == ["6", "32", "1", "32", "error"]
    pivot = lines[lines.index("samples/s by micro_batch_size x num_devices (a configuration's "
                              "fastest measurement):") + 1 :][:5]  # fmt: skip
    assert pivot[0].split() == ["micro_batch_size", "num_devices", "1", "num_devices", "2"]
    assert pivot[3].split() == ["16", "oom"] and pivot[4].split() == ["32", "error"]
    assert lines[-1].startswith(f"plots: {path / 'plot-throughput.png'}, ")
    for name in ("throughput", "memory", "step-time", "confidence"):
        assert (path / f"plot-{name}.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize("fmt", ["csv", "json", "markdown"])
def test_analyze_formats(capsys, tmp_path, fmt):
    import pandas as pd
    from rundirs import finished_run

    path = finished_run(tmp_path)
    code, out, err = run(capsys, "analyze", path, "--format", fmt, "--no-plots")
    assert code == 0 and err == ""
    if fmt == "csv":
        table = pd.read_csv(__import__("io").StringIO(out))
        assert table["trial"].tolist() == [2, 5, 4, 1, 3, 6] and "reason" in table
    elif fmt == "json":
        records = json.loads(out)
        assert [r["rank"] for r in records] == [1, 2, 3, 4, None, None]
        assert records[0]["step_times_ms"] and records[-1]["status"] == "error"
    else:
        assert "**trials, best first by samples_per_s**" in out
        assert "| rank | trial | batch_size | num_devices | micro_batch_size |" in out
        assert "| 16 | | oom |" in out.replace("|  |", "| |")
    assert not list(path.glob("*.png"))  # --no-plots


def test_analyze_machine_formats_keep_stdout_clean(capsys, tmp_path):
    from rundirs import FINISHED_ROWS, make_run

    path = make_run(tmp_path, FINISHED_ROWS)  # no recommendations.jsonl: confidence skipped
    code, out, err = run(capsys, "analyze", path, "--format", "json")
    assert code == 0 and len(json.loads(out)) == 6
    assert err.splitlines() == [
        f"plots: {path / 'plot-throughput.png'}, {path / 'plot-memory.png'}, "
        f"{path / 'plot-step-time.png'}",
        "plot-confidence.png not written: the run has no recommendations.jsonl (older run?)",
    ]


def test_analyze_compares_two_runs(capsys, tmp_path):
    from rundirs import FINISHED_ROWS, PNG_MAGIC, make_run, trial_row

    a = make_run(tmp_path, FINISHED_ROWS, name="before")
    b = make_run(tmp_path, [trial_row(32, 2, 8, 693.0), trial_row(32, 2, 4, 295.0)], name="after")
    code, out, err = run(capsys, "analyze", a, b)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith(f"a: {a} ('handmade', 6 trials: 4 ok, 1 error, 1 oom); best: ")
    assert lines[1].endswith("micro_batch_size 8: 693.0 samples/s")
    assert lines[2] == "best of b / best of a: 1.10x"
    rows = {tuple(r.split()[:3]): r.split() for r in lines[5:]}
    assert rows[("32", "2", "8")][-1] == "1.10" and rows[("32", "2", "4")][-1] == "0.50"
    assert rows[("32", "2", "16")][-1] == "oom"  # measured in a only: no ratio
    assert lines[-1] == f"plot: {a / 'compare-after.png'}"
    assert (a / "compare-after.png").read_bytes().startswith(PNG_MAGIC)
    code, out, _ = run(capsys, "analyze", a, b, "--format", "csv", "--no-plots")
    assert out.splitlines()[0] == (
        "batch_size,num_devices,micro_batch_size,grad_accum_steps,samples_per_s_a,status_a,"
        "samples_per_s_b,status_b,ratio"
    )


@pytest.mark.parametrize("framework", ["accelerate", "cerebras", "composer", "deepspeed", "hf",
                                       "lightning", "megatron", "nemo", "torchtitan"])  # fmt: skip
def test_analyze_exports_the_recommendation(capsys, tmp_path, framework):
    from rundirs import finished_run
    from test_export import READ_BACK  # each framework's snippet read back, its rule checked

    path = finished_run(tmp_path)
    code, out, err = run(capsys, "analyze", path, "--export", framework)
    written = next(path.glob(f"export-{framework}.*"))
    assert code == 0 and out == written.read_text()
    assert err.splitlines()[-1] == f"mbtune: wrote {written}"
    assert "launch on 2 data-parallel devices" in err
    assert READ_BACK[framework](out, 2) == {"batch_size": 32, "micro_batch_size": 8}
    assert not list(path.glob("*.png"))  # an export draws nothing


def test_analyze_export_says_what_changed_for_an_uneven_recommendation(capsys, tmp_path):
    from rundirs import make_run, trial_row

    path = make_run(tmp_path, [trial_row(30, 2, 4, 500.0), trial_row(30, 2, 8, 400.0)])
    code, out, err = run(capsys, "analyze", path, "--export", "deepspeed")
    assert code == 0 and json.loads(out) == {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 4,
    }  # fmt: skip
    assert "batch_size 30 on 2 devices with micro_batch_size 4 splits unevenly" in err
    assert "exported the nearest batch_size it can express, 32" in err


def _bad_analyze_cases():
    from rundirs import FINISHED_ROWS, finished_run, make_run, trial_row

    def only_failed(tmp):
        return make_run(tmp, [trial_row(32, 1, 32, status="oom"),
                              trial_row(32, 2, 16, status="timeout")])  # fmt: skip

    def header_only(tmp):
        path = make_run(tmp, [], name="header-only")
        (path / "trials.csv").write_text("trial,status,batch_size,num_devices,micro_batch_size\n")
        return path

    def unwritable(tmp, name):
        path = finished_run(tmp)
        (path / name).mkdir()  # a directory where the file should go
        return path

    def bad_summary(tmp):
        path = make_run(tmp, FINISHED_ROWS)
        (path / "summary.json").write_text('{"status": "fini')
        return path

    return {
        "not a run": (lambda tmp: [tmp], r"RUN_DIR: .* is not an mbtune run directory \(it "
                      r"has no experiment\.yaml\)"),
        "no trials.csv": (lambda tmp: [make_run(tmp, [])], r"has no trials\.csv yet: no trial "
                          r"of this run has finished"),
        "no finished row": (lambda tmp: [header_only(tmp)], r"RUN_DIR: .* has no finished trial"),
        "only failed trials": (lambda tmp: [only_failed(tmp)], r"RUN_DIR: no trial of .* ran "
                               r"successfully \(2 trials: oom 1, timeout 1; first reason: oom "
                               r"for the test\); nothing to rank, plot or export"),
        "export of only failed trials": (lambda tmp: [only_failed(tmp), "--export", "hf"],
                                         r"no trial of .* ran successfully"),
        "unknown framework": (lambda tmp: [finished_run(tmp), "--export", "keras"],
                              r"--export: unknown framework 'keras'; valid: accelerate, "
                              r"cerebras, composer, deepspeed, hf, lightning, megatron, "
                              r"nemo, torchtitan"),
        "export of two runs": (lambda tmp: [finished_run(tmp), finished_run(tmp, name="b"),
                                            "--export", "hf"], r"--export: give one run"),
        "compare with an empty run": (lambda tmp: [finished_run(tmp), header_only(tmp)],
                                      r"RUN_DIR: .* has no finished trial yet"),
        "three runs": (lambda tmp: [tmp, tmp, tmp], r"analyze: give one run directory, or two "
                       r"to compare; got 3"),
        "bad summary.json": (lambda tmp: [bad_summary(tmp)], r"summary\.json is not valid JSON"),
        "plot not writable": (lambda tmp: [unwritable(tmp, "plot-memory.png")],
                              r"cannot write the plot .*plot-memory\.png: Is a directory"),
        "export not writable": (lambda tmp: [unwritable(tmp, "export-hf.json"), "--export", "hf"],
                                r"--export: cannot write .*export-hf\.json: Is a directory"),
    }  # fmt: skip


@pytest.mark.parametrize("case", sorted(_bad_analyze_cases()))
def test_analyze_bad_input_exits_2_with_one_line(capsys, tmp_path, case):
    argv, message = _bad_analyze_cases()[case]
    code, out, err = run(capsys, "analyze", *argv(tmp_path))
    assert code == 2 and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("mbtune: error: ")
    assert re.search(message, err), err
    if case == "only failed trials":  # the failures are shown before the one-line error
        assert "failed trials:" in out and "timeout for the test" in out
        assert not list(argv(tmp_path / "again")[0].glob("*.png"))


def test_analyze_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["analyze", "--help"])
    out = capsys.readouterr().out
    assert info.value.code == 0 and out.startswith("usage: mbtune analyze")
    for option in ("--format", "--export", "--no-plots", "RUN_DIR"):
        assert option in out


def test_analyze_exports_the_precision_and_checkpointing_measured(capsys, tmp_path):
    from rundirs import make_run, trial_row

    path = make_run(
        tmp_path,
        [
            trial_row(32, 2, 8, 500.0, precision="bf16", activation_checkpointing=True),
            trial_row(32, 2, 4, 400.0, precision="bf16"),
        ],
    )
    code, out, err = run(capsys, "analyze", path, "--export", "deepspeed")
    assert code == 0
    snippet = json.loads(out)
    assert snippet["bf16"] == {"enabled": True}
    assert snippet["train_micro_batch_size_per_gpu"] == 8
    code, out, _ = run(capsys, "analyze", path, "--no-plots")
    assert "micro_batch_size 8 (2 micro-batches per device, bf16, with activation " in out


def test_analyze_is_a_thin_shell_over_one_function(capsys, monkeypatch):
    seen = []
    monkeypatch.setattr(
        "mbtune.analysis.analyze.analyze", lambda runs, **kw: seen.append((runs, kw))
    )
    assert run(capsys, "analyze", "a", "b", "--format", "csv", "--no-plots")[0] == 0
    assert run(capsys, "analyze", "a", "--export", "hf")[0] == 0
    plan = ["--set", "plan.steps=9", "--set", "plan.num_devices=[8]"]
    assert run(capsys, "analyze", "a", *plan)[0] == 0
    assert seen == [
        (["a", "b"], {"fmt": "csv", "export": None, "plots": False, "plan_overrides": []}),
        (["a"], {"fmt": "table", "export": "hf", "plots": True, "plan_overrides": []}),
        (["a"], {"fmt": "table", "export": None, "plots": True,
                 "plan_overrides": ["plan.steps=9", "plan.num_devices=[8]"]}),
    ]  # fmt: skip


def test_a_reader_that_stops_early_gets_no_traceback():
    # `mbtune plan RUN --json | head`: the pipe closes while mbtune still writes
    code = "from mbtune import cli; cli.main = lambda: print('x' * 10**6) or 0; cli.console()"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # fmt: skip
    assert proc.stdout.read(10) == b"x" * 10
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 0 and "Traceback" not in err, err
