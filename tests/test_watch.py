"""`mbtune watch RUN_DIR`: a run directory followed as it is written, row by row; the end
of a live replay search (whose piped output has no progress line); a bad path."""

from __future__ import annotations

import io
import json
import re
import subprocess
import time
import types
from pathlib import Path

import pytest
from rundirs import make_run, recommendation_record, trial_row
from test_interrupts import MBTUNE, experiment, joining
from test_progress import STAMP
from trial_gate import TrialGate

from mbtune.analysis import watch as watch_module
from mbtune.analysis.watch import Watcher, watch
from mbtune.cli import main
from mbtune.runs.rundir import RunDir


def test_a_path_that_is_not_a_run_directory_exits_2_with_one_line(tmp_path, capsys):
    for path in (tmp_path / "missing", tmp_path):
        assert main(["watch", str(path)]) == 2
        err = capsys.readouterr().err
        assert err == (
            f"mbtune: error: RUN_DIR: {path} is not an mbtune run directory (it has no "
            "experiment.yaml)\n"
        )


def test_the_interval_reaches_watch(tmp_path, monkeypatch):
    seen = {}
    monkeypatch.setattr(watch_module, "watch", lambda run, **kw: seen.update(run=run, **kw) or 0)
    assert main(["watch", str(tmp_path), "--interval", "0.25"]) == 0
    assert seen == {"run": str(tmp_path), "interval_s": 0.25}
    with pytest.raises(Exception, match=r"--interval: must be a number of seconds above 0"):
        watch(tmp_path, interval_s=0)


def empty_run(tmp_path: Path) -> RunDir:
    return RunDir(make_run(tmp_path, []))


def test_each_appended_row_is_an_update_and_a_torn_one_is_none(tmp_path):
    run = empty_run(tmp_path)
    w = Watcher(run.path)
    assert w.poll() == [
        f"mbtune watch: handmade in {run.path}",
        "no recommendation yet: no trial has run successfully",
        "trials      [..............................] 0 of 20",
        "confidence  [..............................] 0 of target 90",
    ]
    assert w.poll() is None  # nothing changed: nothing to show
    run.append_trial({"trial": 1, "trial_id": "t1", **trial_row(32, 1, 4, 300.0)})
    assert w.poll()[2:] == [  # no table of the best before the model ranks them
        "trials      [##............................] 1 of 20",
        "confidence  [..............................] 0 of target 90",
    ]
    ranking = [  # the stream's order of "best", which need not follow the raw throughput
        {"batch_size": 32, "num_devices": 1, "micro_batch_size": 4,
         "estimated_samples_per_s": 290.5, "samples_per_s": 300.0, "measurements": 2},
        {"batch_size": 32, "num_devices": 2, "micro_batch_size": 8,
         "estimated_samples_per_s": 280.0, "samples_per_s": 310.0, "measurements": 1},
    ]  # fmt: skip
    run.append_recommendation({**recommendation_record(1, 1, 4, 32, 300.0, 10),
                               "ranking": ranking})  # fmt: skip
    view = w.poll()
    assert view[1] == (
        "mbtune 19:41:11  recommended micro_batch_size: 4 (num_devices: 1, batch_size: 32), "
        "estimated performance: 3.00x base, confidence score: 10 (out of 100)"
    )
    assert view[4:] == [
        "best configurations:",
        "  rank  num_devices  batch_size  micro_batch_size  grad_accum  est. samples/s  looks",
        "     1            1          32                 4           8           290.5      2",
        "     2            2          32                 8           2           280.0      1",
    ]
    tie = {"members": [{"batch_size": 32, "num_devices": 1, "micro_batch_size": m}
                       for m in (4, 8)], "width": 0.012, "probability": 0.93,
           "rule": "the rule", "sure": []}  # fmt: skip
    run.append_recommendation({**recommendation_record(1, 1, 4, 32, 300.0, 10), "tie": tie})
    assert w.poll()[2] == (  # a tie is shown below the recommendation, as the stream has it
        "a tie within 1.2% on this machine: micro_batch_size 4, 8 at 1 device (batch_size 32);"
        " recommended: micro_batch_size 4 (the rule)"
    )
    with run.trials_file.open("a") as f:  # a driver killed while writing a row
        f.write("2,t2,ok,32,2,8")
    assert w.poll() is None  # the one reader never reads a torn row
    run.append_trial({"trial": 2, "trial_id": "t2", **trial_row(32, 2, 8, status="oom")})
    assert w.poll()[3] == "trials      [###...........................] 2 of 20 (1 not ok)"
    assert not w.ended
    run.write_json("summary.json", {"status": "finished"})
    assert w.poll()[-1] == f"the run has ended (finished): {run.path / 'summary.json'}"
    assert w.ended


def follow(tmp_path, monkeypatch, steps, *, tty=False):
    """watch() on a run directory that each poll's sleep writes one step further."""
    run = empty_run(tmp_path)
    todo = [lambda: None, *steps(run)]

    def sleep(seconds):
        assert seconds == 0.5
        todo.pop(0)()

    monkeypatch.setattr(watch_module, "time", types.SimpleNamespace(sleep=sleep))
    out = io.StringIO()
    out.isatty = lambda: tty  # type: ignore[method-assign]
    code = watch(run.path, interval_s=0.5, out=out)
    return code, out.getvalue(), todo


def writes(run):
    return [
        lambda: run.append_trial({"trial": 1, "trial_id": "t1", **trial_row(32, 1, 4, 300.0)}),
        lambda: run.append_recommendation(recommendation_record(1, 1, 4, 32, 300.0, 10)),
        lambda: run.trials_file.open("a").close(),  # touched, nothing new
        lambda: run.write_json("summary.json", {"status": "confident"}),
    ]


def test_the_best_table_names_a_layout_where_one_splits_the_model():
    ranking = [
        {"batch_size": 16, "num_devices": 2, "micro_batch_size": 2, "pipeline_parallel": 2,
         "pipeline_schedule": "gpipe", "estimated_samples_per_s": 30.0, "measurements": 2},
        {"batch_size": 16, "num_devices": 2, "micro_batch_size": 4,
         "estimated_samples_per_s": 29.0},
    ]  # fmt: skip
    head, first, second = watch_module._best_table(ranking)[1:]
    assert head.split() == ["rank", "num_devices", "batch_size", "micro_batch_size", "p",
                            "schedule", "grad_accum", "est.", "samples/s", "looks"]  # fmt: skip
    assert first.split() == ["1", "2", "16", "2", "2", "gpipe", "8", "30.0", "2"]
    assert second.split() == ["2", "2", "16", "4", "1", "1f1b", "2", "29.0", "1"]


def test_off_a_terminal_a_plain_update_is_printed_only_when_something_changed(
    tmp_path, monkeypatch
):
    code, out, todo = follow(tmp_path, monkeypatch, writes)
    assert code == 0 and todo == []  # ended once summary.json was written
    views = out.split("\n\n")
    assert views[-1] == "" and len(views) == 5  # first view, row, recommendation, the end
    assert [v.splitlines()[2][-7:] for v in views[:-1]] == ["0 of 20", "1 of 20", "1 of 20",
                                                            "1 of 20"]  # fmt: skip
    assert "\x1b" not in out
    assert views[-2].endswith("the run has ended (confident): " + str(
        next(tmp_path.glob("*/summary.json"))))  # fmt: skip


def test_on_a_terminal_the_view_is_redrawn_in_place(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # no line wraps
    code, out, _ = follow(tmp_path, monkeypatch, writes, tty=True)
    assert code == 0
    draws = out.split("\x1b[")
    assert len(draws) == 1 + 2 * 3  # three redraws, each: up to the first row, clear
    first = draws[0].splitlines()
    assert draws[1] == f"{len(first)}F" and draws[2].startswith("J")


def test_ctrl_c_ends_it_with_0_and_nothing_more(tmp_path, monkeypatch):
    def interrupt(run):
        def press():
            raise KeyboardInterrupt

        return [press]

    code, out, _ = follow(tmp_path, monkeypatch, interrupt)
    assert code == 0 and out.count("mbtune watch: ") == 1 and out.endswith("\n\n")


@pytest.mark.ray
@pytest.mark.slow
def test_watch_follows_a_live_replay_search_to_its_end(tmp_path, capsys, monkeypatch, shared_ray):
    # two trials pass the gate, the third holds until watch has shown the run once; the
    # search joins the session's Ray (watch is the subject, not an embedded Ray's start-up)
    gate = TrialGate(shared_ray.gate, passes=2)
    shown = Watcher.poll

    def poll(self):
        view = shown(self)
        if view is not None:
            gate.release()
        return view

    monkeypatch.setattr(Watcher, "poll", poll)
    search = subprocess.Popen(
        [MBTUNE, "run", str(experiment(tmp_path)), *joining(shared_ray)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not gate.held():
            assert time.monotonic() < deadline and search.poll() is None, "no trial held"
            time.sleep(0.05)
        run = next((tmp_path / "runs").glob("sig-*"))
        assert not (run / "summary.json").exists()  # it follows a live run
        assert main(["watch", str(run), "--interval", "0.1"]) == 0
        out = capsys.readouterr().out
        stream, err = search.communicate(timeout=120)
    finally:
        gate.release()
        search.kill()
    assert search.returncode == 0, err[-2000:]
    # piped, the search prints no progress line (its running trials held at the gate and
    # telling their phase; on a terminal: tests/test_progress.py), only each trial's line
    assert "\r" not in stream and "\x1b" not in stream
    assert "starting" not in stream and "replaying" not in stream, stream
    assert re.search(STAMP + r"trial   1  num_devices 1, .*samples/s  ok\n", stream), stream
    streamed = [x for x in stream.splitlines() if "recommended micro_batch_size:" in x]
    views = [v.splitlines() for v in out.split("\n\n") if v]
    assert views[-1][1] == streamed[-1]  # the final recommendation, as the stream said it
    assert views[-1][2].endswith("] 11 of 20 (2 not ok)")  # every configuration once
    summary = json.loads((run / "summary.json").read_text())
    assert views[-1][-1].startswith(f"the run has ended ({summary['status']})")
    assert len(views) > 1  # it showed the run before it ended
    # one "best": summary.json, watch's table and analyze's first row name one configuration
    first = views[-1][views[-1].index("best configurations:") + 2].split()
    recommended = summary["recommended"]
    sizes = [recommended[k] for k in ("num_devices", "batch_size", "micro_batch_size")]
    assert [int(x) for x in first[1:4]] == sizes
    assert main(["analyze", str(run), "--format", "json", "--no-plots"]) == 0
    top = json.loads(capsys.readouterr().out)[0]
    assert [top[k] for k in ("num_devices", "batch_size", "micro_batch_size")] == sizes
    assert top["model_rank"] == 1 and top["estimated_samples_per_s"] > 0
