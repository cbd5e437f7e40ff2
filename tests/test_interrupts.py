"""Interrupts: SIGINT/SIGTERM stop `mbtune run` cleanly, SIGKILL loses nothing finished,
and `mbtune run --resume` completes the search with no trial lost or repeated."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import yaml
from test_search import TABLE
from trial_gate import TrialGate

from mbtune.search._signals import STOPPING

if TYPE_CHECKING:
    from conftest import SharedRay

MBTUNE = Path(sys.executable).with_name("mbtune")


def experiment(tmp_path: Path, **search) -> Path:
    (tmp_path / "t.csv").write_text(TABLE)
    spec = {
        "name": "sig",
        "model": "mlp",
        "train_input": {"batch_size": 32, "micro_batch_size": "auto"},
        # every configuration once, no stop on confidence: 11 trials unless interrupted
        "search": {"space": {"num_devices": [1, 2]}, "sampler": "grid",
                   "confidence_target": 100, "max_repeats": 1, **search},
        "trial": {"backend": "replay", "table": str(tmp_path / "t.csv")},
        "output_dir": str(tmp_path / "runs"),
    }  # fmt: skip
    path = tmp_path / "sig.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def start_and_signal(
    tmp_path: Path, sig: int, after_rows: int = 3, ray: SharedRay | None = None, **search
):
    """Start `mbtune run`, send ``sig`` once ``after_rows`` trials are in trials.csv and
    the next one holds at the gate (0: as soon as the run directory exists, during
    start-up): the first ``after_rows`` trials pass it, so that the search cannot have
    moved on, or finished, between the poll and the signal. ``ray``: the session's Ray,
    which the search joins, else it starts an embedded Ray of its own."""
    gate = TrialGate(ray.gate if ray else tmp_path / "gate", passes=after_rows)
    proc = subprocess.Popen(
        [MBTUNE, "run", str(experiment(tmp_path, **search)), *joining(ray)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=gate.env(),
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            runs = [d / "trials.csv" for d in (tmp_path / "runs").glob("sig-*")]
            if runs and after_rows == 0:
                break
            finished = len(rows(runs[0].parent)) if runs and runs[0].exists() else 0
            if finished >= after_rows and gate.held():
                assert finished == after_rows  # no trial past the gate
                break
            time.sleep(0.05)
        else:
            proc.kill()
            pytest.fail(f"the search never held after {after_rows} trials\n{proc.stderr.read()}")
        os.kill(proc.pid, sig)
        said = []
        if sig != signal.SIGKILL:
            # the driver answers at once; then the trial held at the gate ends, as a trial
            # in flight does, rather than wait out Ray Tune's 10 s for it
            for line in proc.stdout:
                said.append(line)
                if line == STOPPING:
                    break
            gate.release()
        out, err = proc.communicate(timeout=120)
    finally:
        gate.release()  # what the signal left holding goes on (and ends)
    return proc.returncode, "".join(said) + out, err, runs[0].parent


def joining(ray: SharedRay | None) -> list[str]:
    """The arguments of a command that joins the session's Ray (none: an embedded Ray)."""
    return ["--address", ray.address] if ray else []


def rows(run: Path) -> list[dict]:
    from mbtune.runs.rundir import RunDir

    return RunDir(run).trials()


def clean(output: str) -> None:
    """What a user reads: mbtune's lines, no traceback and no Ray Tune ERROR line."""
    assert "Traceback" not in output and " ERROR " not in output, output[-3000:]


def resume_and_check(run: Path, before: list[dict], ray: SharedRay | None = None) -> str:
    """``mbtune run --resume`` completes the search: nothing finished lost or rewritten,
    every configuration once. What it printed."""
    done = subprocess.run([MBTUNE, "run", "--resume", str(run), *joining(ray)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    clean(done.stdout + done.stderr)
    after = rows(run)
    assert after[: len(before)] == before  # nothing finished is lost or rewritten
    configs = [(r["num_devices"], r["micro_batch_size"]) for r in after]
    assert len(configs) == len(set(configs)) == 11  # nothing repeated, nothing missing
    assert len({r["trial_id"] for r in after}) == 11
    assert json.loads((run / "summary.json").read_text())["status"] == "finished"
    return done.stdout


def resumed_from(stdout: str, before: list[dict]) -> None:
    """A resume says once what it kept: the rows that were on disk, and the trials a kill
    caught in flight, measured again."""
    resumed = [x for x in stdout.splitlines() if x.startswith("mbtune: resuming: ")]
    assert resumed == [f"mbtune: resuming: {len(before)} trials finished"] or (
        len(resumed) == 1 and resumed[0].endswith("interrupted, measured again")
    ), stdout


def study_agrees_with_rows(run: Path) -> None:
    """The run's Optuna study (what a resumed search reads: the sampler's state, the budget,
    what was measured) after a stop or a kill and the resume: nothing in it left running,
    every row of trials.csv a told trial, once, as trials.csv writes it."""
    import optuna

    from mbtune.runs.load import load_run_experiment
    from mbtune.runs.rundir import RunDir
    from mbtune.search import OptunaSpace, search_points
    from mbtune.search._study import STUDY_NAME, records_of

    url = f"sqlite:///{run / 'optuna.db'}"
    trials = optuna.load_study(study_name=STUDY_NAME, storage=url).trials
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    assert all("status" in t.user_attrs for t in trials)
    # a trial the kill caught between Optuna's ask and its configuration has no sizes
    sized = [t for t in trials if t.user_attrs["status"] != "interrupted"]
    assert all("batch_size" in t.user_attrs for t in sized)
    interrupted = [t for t in trials if t.user_attrs["status"] == "interrupted"]
    assert all(t.state == optuna.trial.TrialState.FAIL for t in interrupted)
    rows = RunDir(run).records()  # every row of trials.csv is a told trial, once
    # a trial the kill caught between its attributes and its tell is interrupted, and its
    # row is learnt again as a trial of its own: count the others
    told_trials = [t for t in sized if "trial" in t.user_attrs]
    told = [t.user_attrs["trial"] for t in told_trials]
    assert sorted(told) == [r.trial for r in rows]
    assert {t.user_attrs["trial_id"] for t in told_trials} == {r.trial_id for r in rows}
    # one record of what was measured: the study's, written as trials.csv writes it
    exp = load_run_experiment(run)
    measured = records_of(trials, OptunaSpace(search_points(exp)))
    assert [r.to_row() for r in measured] == [r.to_row() for r in rows]


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_resume_completes_the_search(tmp_path):
    code, out, err, run = start_and_signal(tmp_path, signal.SIGTERM)
    assert code == 130, err[-2000:]
    assert "Traceback" not in err
    assert "mbtune: interrupted; every finished trial is in" in out
    assert out.splitlines(keepends=True).count(STOPPING) == 1  # said as the signal came
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    before = rows(run)
    assert 3 <= len(before) < 11 and summary["trials"] == len(before)
    study_agrees_with_rows(run)  # the run ended itself: nothing left running already
    resume_and_check(run, before)
    study_agrees_with_rows(run)


def second_writer_is_refused(run: Path) -> None:
    """A second writer of a run directory (a resume while another holds it) exits 2 naming
    the first, before it writes anything."""
    state = sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file())
    # the first writer: a resume holds the lock for its whole run (held here, so that the
    # second surely comes while it runs, however fast the replayed trials are)
    hold = ("import sys, time; from mbtune.runs.lock import RunLock; "
            "lock = RunLock.take(sys.argv[1], command='mbtune run --resume'); "
            "print('held', flush=True); time.sleep(120)")  # fmt: skip
    first = subprocess.Popen([sys.executable, "-c", hold, str(run)], stdout=subprocess.PIPE,
                             text=True)  # fmt: skip
    try:
        assert first.stdout.readline().strip() == "held"
        second = subprocess.run([MBTUNE, "run", "--resume", str(run)], capture_output=True,
                                text=True, timeout=60)  # fmt: skip
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 2
    refused = [line for line in second.stderr.splitlines() if " is in use by " in line]
    assert len(refused) == 1 and f"(process {first.pid} on " in refused[0], second.stderr
    clean(second.stdout + second.stderr)
    # refused before it wrote anything: the lock aside, the run directory is as it was
    after = sorted((p, p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file())
    assert [x for x in after if x[0].name != ".lock"] == [x for x in state if x[0].name != ".lock"]


def test_sigint_and_sigterm_ask_tune_for_its_graceful_stop():
    from mbtune.search import graceful_stop

    asked = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: asked.append(s))
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal
    try:
        with graceful_stop() as received:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            assert received == [signal.SIGINT] and asked == [signal.SIGUSR1]
            with pytest.raises(KeyboardInterrupt):  # a second signal stops at once
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.1)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        # started in the background, a process ignores SIGINT: so does the search
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        with graceful_stop() as received:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            assert received == [] and asked == [signal.SIGUSR1]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR1, previous)
        signal.signal(signal.SIGINT, interrupt)


# -- faults injected on a seeded schedule ------------------------------------------------

KILL_SCHEDULE = sorted(random.Random(20261125).sample(range(0, 11), 2))
"""After how many finished trials the driver is SIGKILLed (0: during start-up, before the
first trial's row), drawn once from a fixed seed: the same points every run, spread over
the whole search."""


def recomputed(run: Path) -> dict | None:
    """The recommendation as trials.csv alone gives it: the run's own search model (as
    the search builds it) over the records read back, not what summary.json says."""
    from mbtune.recommend.confidence import SearchModel
    from mbtune.recommend.reporter import Reporter
    from mbtune.runs.load import load_run_experiment
    from mbtune.runs.rundir import RunDir
    from mbtune.search import search_points

    exp = load_run_experiment(run)
    s = exp.search
    model = SearchModel(tuple(search_points(exp)), exp.noise_floor,
                        s.objective == "samples_per_s", s.seed)  # fmt: skip
    return Reporter(model).summary(RunDir(run).records(), "finished")["recommended"]


def killed_at(tmp_path: Path, after_rows: int, ray: SharedRay | None = None) -> None:
    """A driver SIGKILLed after ``after_rows`` trials loses no finished trial and leaves no
    summary; while another process holds the run directory a second writer is refused; the
    resume completes the search, to the answer its trials give, and its Optuna study agrees
    with trials.csv. The search model's sampler (mbtune's default) proposes: after a kill, its
    study is ahead of what Ray saved, and the model reads it to propose (the grid's and
    Optuna's samplers: the SIGTERM test, tests/test_optuna_study.py's killed tpe run)."""
    code, _, _, run = start_and_signal(
        tmp_path, signal.SIGKILL, after_rows=after_rows, ray=ray, sampler="model"
    )
    assert code == -signal.SIGKILL
    before = rows(run)
    assert len(before) == after_rows  # what had finished was on disk when the kill came
    assert not (run / "summary.json").exists()
    if not (run / "ray").exists():  # killed before Ray saved anything: nothing to resume
        assert before == []
        done = subprocess.run([MBTUNE, "run", "--resume", str(run), *joining(ray)],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        # killed before experiment.yaml or before Ray's state: one line says which
        errors = [line for line in done.stderr.splitlines() if line.startswith("mbtune: error:")]
        assert done.returncode == 2 and len(errors) == 1, done.stderr
        clean(done.stdout + done.stderr)
        return
    second_writer_is_refused(run)
    # the holder was SIGKILLed: its lock is gone, and the resume completes the search
    # nothing lost, nothing measured twice, no traceback
    resumed_from(resume_and_check(run, before, ray), before)
    summary = json.loads((run / "summary.json").read_text())
    assert recomputed(run) == summary["recommended"]
    study_agrees_with_rows(run)  # told of rows Ray never saved, never told them twice


@pytest.mark.slow
@pytest.mark.skipif(0 not in KILL_SCHEDULE, reason="the schedule has no kill during start-up")
def test_a_driver_killed_during_start_up_at_its_scheduled_point_leaves_a_resumable_run(tmp_path):
    """The schedule's point 0: killed during start-up, its embedded Ray's included."""
    killed_at(tmp_path, 0)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("after_rows", [p for p in KILL_SCHEDULE if p > 0])
def test_a_driver_killed_at_a_scheduled_point_resumes_to_the_same_answer(
    shared_ray, tmp_path, after_rows
):
    """The schedule's points past start-up, on the session's Ray (the kill and the resume
    are the subject, not an embedded Ray's start-up: the SIGTERM test and point 0 have
    that)."""
    killed_at(tmp_path, after_rows, shared_ray)
