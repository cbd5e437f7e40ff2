"""Safety: YAML builds no objects, the dashboard stays on loopback, the docs warn that a
user model's code runs, and no file of a run directory is ever left half-written."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from mbtune.config.load import load_experiment, parse_experiment
from mbtune.errors import MbtuneError
from mbtune.runs.rundir import TRIAL_COLUMNS, RunDir

ROOT = Path(__file__).resolve().parent.parent
VALID = "name: x\nmodel: mlp\ntrain_input: {batch_size: 8}\n"

# -- YAML: the safe loader only ----------------------------------------------------------

UNSAFE_YAML = re.compile(
    r"yaml\.(load|load_all|full_load|full_load_all|unsafe_load|unsafe_load_all)\s*\("
    r"|yaml\.(Loader|FullLoader|UnsafeLoader|CLoader|CFullLoader|CUnsafeLoader)\b"
    r"|from\s+yaml\s+import\s+.*\b(load|full_load|unsafe_load|Loader|FullLoader|UnsafeLoader)\b"
)


def test_yaml_is_only_parsed_with_the_safe_loader():
    sources = sorted([*ROOT.glob("mbtune/**/*.py"), *ROOT.glob("bench/**/*.py")])
    offenders = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sources
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if UNSAFE_YAML.search(line)
    ]
    assert offenders == []
    assert "yaml.safe_load(" in (ROOT / "mbtune" / "config" / "load.py").read_text()  # not vacuous
    assert UNSAFE_YAML.search("data = yaml.load(text, Loader=yaml.Loader)")  # the net holds


@pytest.mark.parametrize("where", ["file", "--set", "space file"])
def test_a_python_tag_is_an_error_and_runs_nothing(tmp_path, where):
    marker = tmp_path / "pwned"
    payload = f"!!python/object/apply:os.system ['touch {marker}']"
    path, overrides = tmp_path / "e.yaml", []
    if where == "file":
        path.write_text(f"{VALID}output_dir: {payload}\n")
    elif where == "--set":
        path.write_text(VALID)
        overrides = [f"output_dir={payload}"]
    else:
        (tmp_path / "space.yaml").write_text(f"num_devices: {payload}\n")
        path.write_text(f"{VALID}search: {{space: space.yaml}}\n")
    tag = "tag:yaml.org,2002:python/object/apply:os.system"
    with pytest.raises(MbtuneError, match=f"could not determine a constructor for the tag '{tag}'"):
        load_experiment(path, overrides)
    assert not marker.exists()


# -- the dashboard -----------------------------------------------------------------------


@pytest.fixture
def ray_init(monkeypatch):
    """ray.init replaced by a recorder, as if no Ray were running yet. Like Ray's, it
    returns a context whose address_info holds the dashboard's host:port (the host it was
    asked to bind), and none without a dashboard."""
    import ray

    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        url = f"{kwargs['dashboard_host']}:8265" if kwargs.get("include_dashboard") else None
        return SimpleNamespace(address_info={"webui_url": url})

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.setenv("RAY_AIR_NEW_OUTPUT", "0")
    return calls


def test_the_dashboard_binds_to_loopback(ray_init, monkeypatch):
    from mbtune.cluster import init_ray
    from mbtune.search import start_ray

    init_ray(None, True, False)
    assert ray_init[-1]["include_dashboard"] is True
    assert ray_init[-1]["dashboard_host"] == "127.0.0.1"
    init_ray(None, False, False)
    assert ray_init[-1]["include_dashboard"] is False
    # ray.dashboard: true in the experiment (as --dashboard) starts it on loopback too
    exp = parse_experiment({**yaml.safe_load(VALID), "ray": {"dashboard": True}})
    lines = []
    start_ray(exp, None, None, False, lines.append)
    assert ray_init[-1]["include_dashboard"] is True
    assert ray_init[-1]["dashboard_host"] == "127.0.0.1"
    assert lines == ["mbtune dashboard: http://127.0.0.1:8265"]
    # a Ray with token authentication (its default for the local Ray it starts): say how
    # to open the dashboard
    lines.clear()
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # as ray.init sets it
    start_ray(exp, None, None, False, lines.append)
    assert lines == [
        "mbtune dashboard: http://127.0.0.1:8265 (it asks for Ray's token: "
        "`ray get-auth-token` prints it)"
    ]


def test_a_cluster_keeps_its_own_dashboard_settings(ray_init, monkeypatch):
    import ray

    from mbtune.cluster import init_ray

    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="h:1"))
    # joining a cluster (--address) opens nothing: its dashboard is the cluster's own
    init_ray("auto", True, False)
    assert ray_init[-1]["address"] == "auto"
    assert "include_dashboard" not in ray_init[-1] and "dashboard_host" not in ray_init[-1]


# -- the docs ----------------------------------------------------------------------------


def test_the_docs_say_that_a_user_model_runs_its_code():
    page = " ".join((ROOT / "docs" / "trial.md").read_text().split())  # its Models section
    assert "**Importing a user model runs its code**: only name modules you trust." in page
    assert "on someone else's experiment run code of their choosing" in page


# -- the run directory: never a half-written file ----------------------------------------


def run_dir(tmp_path) -> RunDir:
    run = RunDir.create(tmp_path, "x")
    run.write_experiment({"name": "old"})
    run.write_json("summary.json", {"status": "old"})
    return run


def row(trial: int, **values):
    return {"trial": trial, "trial_id": f"t{trial}", "status": "ok", "batch_size": 8,
            "num_devices": 1, "micro_batch_size": 4, "samples_per_s": 100.0 + trial,
            **values}  # fmt: skip


@pytest.mark.parametrize("failure", ["disk full mid-write", "interrupt before the rename"])
def test_a_failed_write_leaves_the_old_file_whole_and_no_partial_file(
    tmp_path, monkeypatch, failure
):
    run = run_dir(tmp_path)
    before = {p.name: p.read_bytes() for p in run.path.iterdir()}
    if failure == "disk full mid-write":
        real_open = Path.open

        def open_then_fill_the_disk(self, *args, **kwargs):
            f = real_open(self, *args, **kwargs)
            if self.name.endswith(".tmp"):
                real_write = f.write

                def write(text):
                    real_write(text[: len(text) // 2])
                    f.flush()
                    raise OSError(errno.ENOSPC, "No space left on device")

                f.write = write
            return f

        monkeypatch.setattr(Path, "open", open_then_fill_the_disk)
        error = OSError
    else:

        def interrupted(src, dst):
            raise KeyboardInterrupt

        monkeypatch.setattr(os, "replace", interrupted)
        error = KeyboardInterrupt
    with pytest.raises(error):
        run.write_experiment({"name": "new", "model": {"name": "mlp"}})
    with pytest.raises(error):
        run.write_json("summary.json", {"status": "new"})
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in run.path.iterdir()} == before
    assert yaml.safe_load(run.experiment_file.read_text()) == {"name": "old"}


def test_a_write_that_succeeds_replaces_the_file_whole(tmp_path):
    run = run_dir(tmp_path)
    run.write_json("summary.json", {"status": "new"})
    assert (run.path / "summary.json").read_text() == '{\n  "status": "new"\n}\n'
    assert sorted(p.name for p in run.path.iterdir()) == ["experiment.yaml", "summary.json"]


def test_every_trial_row_is_on_disk_before_append_returns(tmp_path, monkeypatch):
    run = run_dir(tmp_path)
    synced = []
    real_fsync = os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    for trial in (1, 2, 3):
        synced.clear()
        run.append_trial(row(trial))
        assert str(run.trials_file.resolve()) in synced
        # what another process reads now: every row so far, whole
        lines = run.trials_file.read_bytes().split(b"\r\n")
        assert len(lines) == trial + 2 and lines[-1] == b""
    assert [r["trial"] for r in run.trials()] == ["1", "2", "3"]
    assert list(run.trials()[0]) == list(TRIAL_COLUMNS)


def test_a_torn_last_row_is_never_read_and_never_corrupts_the_next(tmp_path):
    run = run_dir(tmp_path)
    run.append_trial(row(1))
    with run.trials_file.open("a", newline="") as f:  # the machine died mid-write
        f.write("2,t2,ok,8,1,4")
    assert [r["trial"] for r in run.trials()] == ["1"]
    run.append_trial(row(2, samples_per_s=55.5))
    rows = run.trials()
    assert [(r["trial"], r["trial_id"], r["samples_per_s"]) for r in rows] == [
        ("1", "t1", "101.0"),
        ("2", "t2", "55.5"),
    ]
    assert run.trials_file.read_bytes().count(b"\r\n") == 3
