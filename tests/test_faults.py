"""Trial faults: a trial that raises, runs out of memory, hangs or is killed is a recorded
result, the search goes on, and every other trial's result is kept.

tests/test_trial.py covers the faults inside one trial (run_trial: an error, a CUDA OOM, a
memory budget, the timeout alarm) and tests/test_search.py a trial process that dies (SIGKILL,
an exit). Here: the same faults through the trial process a search runs, its kill backstop,
the callback that records a failed trial actor, and a whole search with every fault at once.
"""

from __future__ import annotations

import csv
import textwrap
import time
from types import SimpleNamespace

import pytest

from mbtune.config.load import parse_experiment
from mbtune.lattice import BatchConfig
from mbtune.recommend.reporter import Reporter
from mbtune.runs.rundir import RunDir
from mbtune.search import TrialLog, run_search
from mbtune.trial import launch
from mbtune.trial.launch import measure_in_subprocess
from mbtune.trial.trial import TrialRequest

# A user model whose forward pass fails in a different way at each micro-batch size.
FAULTY = """
import atexit, os, signal, time
import torch
import torch.nn as nn

class Faulty(nn.Module):
    def __init__(self, block_alarm):
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.block_alarm = block_alarm

    def forward(self, x):
        m = x.shape[0]
        if m == 2:
            raise ValueError("bad shape")
        if m == 4:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        if m == 8:
            if self.block_alarm:  # as if stuck in C code: the trial's alarm never arrives
                signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])
            time.sleep(600)
        if m == 16:
            os.kill(os.getpid(), signal.SIGKILL)  # as the kernel's OOM killer does
        return self.lin(x)

def build(block_alarm=False, chatty=False):
    if chatty:  # prints after the result line, from an exit handler
        atexit.register(print, "goodbye from the user model")
    return (Faulty(block_alarm), lambda n, device: (torch.randn(n, 4, device=device),),
            lambda module, batch: module(batch[0]).pow(2).mean())
"""

REASONS = {
    1: ("ok", None),
    2: ("error", "ValueError: bad shape"),
    4: ("oom", "CUDA out of memory. Tried to allocate 2.00 GiB"),
    8: ("timeout", "still running after trial.timeout_s = "),
    16: ("error", "the trial process was killed (SIGKILL: the kernel's out-of-memory killer?)"),
    32: ("ok", None),
}


def faulty_experiment(tmp_path, monkeypatch, *, trial=None, search=None, **options):
    (tmp_path / "faulty.py").write_text(textwrap.dedent(FAULTY))
    monkeypatch.chdir(tmp_path)  # the trial process imports the user model from here
    return parse_experiment(
        {
            "name": "faults",
            "model": {"name": "faulty:build", **options},
            "train_input": {"batch_size": 32, "micro_batch_size": "auto"},
            "search": search or {},
            "trial": {"compile": False, "warmup_steps": 1, "measure_steps": 2, **(trial or {})},
            "output_dir": str(tmp_path / "runs"),
        }
    )


def measure(exp, m):
    return measure_in_subprocess(
        TrialRequest(experiment=exp, config=BatchConfig(32, 1, m)), cwd="."
    )


# -- the trial process a search runs -------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("m", [2, 4])
def test_a_trial_that_raises_or_runs_out_of_memory_is_a_result(tmp_path, monkeypatch, m):
    result = measure(faulty_experiment(tmp_path, monkeypatch), m)
    status, reason = REASONS[m]
    assert (result["status"], result["micro_batch_size"], result["objective"]) == (status, m, 0)
    assert reason in result["reason"]


@pytest.mark.slow
def test_a_trial_past_its_timeout_stops_itself(tmp_path, monkeypatch):
    exp = faulty_experiment(tmp_path, monkeypatch, trial={"timeout_s": 2})
    result = measure(exp, 8)
    assert result["status"] == "timeout" and result["objective"] == 0
    # it stopped itself: the backstop (62 s) would say "killed after 62 s: it did not stop"
    assert result["reason"] == "still running after trial.timeout_s = 2 s"


@pytest.mark.slow
def test_a_trial_that_does_not_stop_itself_is_killed(tmp_path, monkeypatch):
    exp = faulty_experiment(tmp_path, monkeypatch, trial={"timeout_s": 2}, block_alarm=True)
    monkeypatch.setattr(launch, "KILL_GRACE_S", 1.0)
    started = time.perf_counter()
    result = measure(exp, 8)
    assert (result["status"], result["micro_batch_size"], result["objective"]) == (
        "timeout", 8, 0
    )  # fmt: skip
    # killed by the search, not ended by its 600 s sleep: it waited the grace, no less
    assert result["reason"] == "killed after 3 s: it did not stop itself at 2 s"
    assert time.perf_counter() - started >= 3


# -- the callback that records every finished trial ----------------------------------


def test_a_failed_trial_actor_is_recorded_once(tmp_path):
    run = RunDir.create(tmp_path, "x")
    lines = []
    log = TrialLog(run, lines.append, Reporter([BatchConfig(32, 1, 4)]))
    trial = SimpleNamespace(trial_id="abc_00001", config={"batch_size": 32, "num_devices": 1,
                                                          "micro_batch_size": 4})  # fmt: skip
    log.on_trial_error(0, [], trial)
    log.on_trial_error(0, [], trial)  # Ray reports it again (after a restore): no new row
    rows = run.trials()
    assert [(r["trial"], r["trial_id"], r["status"], r["reason"]) for r in rows] == [
        ("1", "abc_00001", "error", "the trial actor failed")
    ]
    assert len(lines) == 1 and "error (the trial actor failed)" in lines[0]


# -- a whole search -------------------------------------------------------------------


@pytest.mark.ray
@pytest.mark.slow
def test_a_search_records_every_fault_and_keeps_every_other_result(
    ray_session, tmp_path, monkeypatch
):
    # chatty: each trial prints after its result line (an exit handler), which is still read
    exp = faulty_experiment(
        tmp_path,
        monkeypatch,
        chatty=True,
        trial={"timeout_s": 10},
        search={
            "space": {"num_devices": [1]},
            "sampler": "grid",
            "num_samples": 20,
            "confidence_target": 100,
            "max_repeats": 1,
        },  # every configuration once, whatever the score says
    )
    # one trial at a time: one trial actor and its warm parent (reused: a fault ends the
    # trial's process, never its actor), where two cost another 4-5 CPU-s
    exp = parse_experiment({**exp.to_dict(), "ray": {"max_concurrent_trials": 1}})
    lines = []
    outcome = run_search(exp, echo=lines.append)
    with outcome.run.trials_file.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted(int(r["micro_batch_size"]) for r in rows) == [1, 2, 4, 8, 16, 32]  # once each
    assert sorted(int(r["trial"]) for r in rows) == [1, 2, 3, 4, 5, 6]
    assert len({r["trial_id"] for r in rows}) == 6
    for r in rows:
        status, reason = REASONS[int(r["micro_batch_size"])]
        assert r["status"] == status, r
        if reason:
            assert reason in r["reason"] and float(r["objective"]) == 0, r
        else:  # the result line read, whatever the model printed after it
            assert float(r["samples_per_s"]) > 0 and float(r["objective"]) > 0, r
    assert sorted(int(r["micro_batch_size"]) for r in outcome.best()) == [1, 32]
    assert sum(" trial " in line for line in lines) == 6
    assert any("6 trials finished (4 not ok)" in line for line in lines)


def test_a_lost_trial_actor_is_recorded_with_rays_reason(tmp_path):
    error = tmp_path / "error.txt"  # as Tune writes it: a header per failure, then Ray's text
    error.write_text(
        "Failure # 1 (occurred at 2026-11-21_08-07-01)\nan earlier failure\n"
        "Failure # 2 (occurred at 2026-11-21_08-07-03)\n"
        "The actor 8ac02ba9aef765879adb380b01000000 is unavailable: The actor is temporarily\n"
        "\tunavailable: RpcError: Socket closed rpc_code: 14.\n"
    )
    run = RunDir.create(tmp_path, "x")
    lines = []
    log = TrialLog(run, lines.append, Reporter([BatchConfig(32, 1, 4)]))
    config = {"batch_size": 32, "num_devices": 1, "micro_batch_size": 4}
    trial = SimpleNamespace(trial_id="abc_00001", error_file=str(error), config=config)
    log.on_trial_error(0, [], trial)
    [row] = run.trials()
    assert (row["status"], row["reason"]) == (
        "error",
        "the trial actor failed: The actor 8ac02ba9aef765879adb380b01000000 is unavailable: "
        "The actor is temporarily unavailable: RpcError: Socket closed rpc_code: 14.",
    )
    assert row["node_id"] == ""  # no Ray here to ask where the actor ran
