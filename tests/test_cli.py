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
