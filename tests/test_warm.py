"""Warm trial processes (mbtune.trial.warm): each trial of a search is a child forked from
its actor's warm parent, a process of its own as before, without a fresh Python and
torch's import. The faults a trial process may meet (an error, an out-of-memory, a hang, a
kill, an exit, output after the result) are tests/test_faults.py's and tests/test_search.py's,
which now run through the warm parent; here, what is new: who forks whom, what the parent
holds, and that it falls back to a fresh process where it may not fork."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from mbtune.config.load import parse_experiment
from mbtune.lattice import BatchConfig
from mbtune.trial import launch
from mbtune.trial.launch import measure_in_subprocess, preload_modules
from mbtune.trial.trial import TrialRequest
from mbtune.trial.warm import WarmParent, fork_problem

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="warm parents fork on Linux")

# A user model that says, each time it is imported and built, in which process, and how
# many times this process has built it (a leak would carry over to the next trial).
WHERE = """
import json, os, time
import torch
import torch.nn as nn

with open("imported.jsonl", "a") as f:
    f.write(json.dumps([os.getpid(), os.getppid()]) + "\\n")
BUILT = []

class Sleepy(nn.Linear):
    def forward(self, x):
        if self.sleep:
            time.sleep(600)
        return super().forward(x)

def build(sleep=False):
    BUILT.append(1)
    with open("built.jsonl", "a") as f:
        f.write(json.dumps([os.getpid(), os.getppid(), len(BUILT)]) + "\\n")
    module = Sleepy(2, 1)
    module.sleep = sleep
    return (module, lambda n, device: (torch.randn(n, 2, device=device),),
            lambda m, batch: m(batch[0]).pow(2).mean())
"""


def where_experiment(
    tmp_path: Path, compile: bool = False, model: str = "where:build", **options
) -> TrialRequest:
    (tmp_path / "where.py").write_text(WHERE)
    exp = parse_experiment(
        {
            "name": "warm",
            "model": {"name": model, **options},
            "train_input": {"batch_size": 4, "micro_batch_size": 2},
            "trial": {"compile": compile, "warmup_steps": 1, "measure_steps": 2, "timeout_s": 60},
        }
    )
    return TrialRequest(experiment=exp, config=BatchConfig(4, 1, 2))


def lines(path: Path) -> list[list[int]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_cold_trials_are_fresh_processes_of_their_own(tmp_path, monkeypatch):
    monkeypatch.setenv("MBTUNE_COLD_TRIALS", "1")
    result = measure_in_subprocess(where_experiment(tmp_path), cwd=str(tmp_path))
    assert result["status"] == "ok", result["reason"]
    ((_, parent, _),) = lines(tmp_path / "built.jsonl")
    assert parent == os.getpid()


@pytest.mark.slow
def test_the_compiling_warm_parent_runs_one_thread_and_hands_its_probes_to_the_child(
    tmp_path, monkeypatch
):
    # one compiling warm parent for two claims (each used to start its own, 5-6 CPU-s):
    # its preload is any compiling experiment's but an hf: model's, the model's name aside
    # (mbtune.trial.launch.preload_modules), so a user model's parent is the gpt's
    request = where_experiment(tmp_path, compile=True, model="probed:build")
    gpt = parse_experiment({"name": "x", "model": {"name": "gpt"}, "trial": {"compile": True},
                            "train_input": {"batch_size": 4}})  # fmt: skip
    assert preload_modules(request.experiment) == preload_modules(gpt)
    parent = WarmParent.start(preload_modules(gpt), cwd=str(tmp_path))
    try:
        assert parent.problem is None
        assert os.listdir(f"/proc/{parent.process.pid}/task") == [str(parent.process.pid)]
        maps = Path(f"/proc/{parent.process.pid}/maps").read_text()
        assert "libtorch" in maps  # torch imported, compile's modules too, yet one thread
        # the CPU's vector instructions, which inductor probes by building and loading a
        # test kernel in subprocesses (about 1 s), are known before the fork: the child's
        # cache of them is full as it builds its model, before it compiles anything
        (tmp_path / "probed.py").write_text(
            "from torch._inductor import cpu_vec_isa\n"
            "from where import build as where\n"
            "def build():\n"
            "    with open('probed.txt', 'w') as f:\n"
            "        f.write(str(cpu_vec_isa.valid_vec_isa_list.cache_info().currsize))\n"
            "    return where()\n"
        )
        monkeypatch.setattr(launch, "_IDLE", [parent])  # the next trial forks from it
        assert measure_in_subprocess(request, cwd=str(tmp_path))["status"] == "ok"
        ((_, forked_by, _),) = lines(tmp_path / "built.jsonl")
        assert forked_by == parent.process.pid
        assert (tmp_path / "probed.txt").read_text() == "1"
    finally:
        parent.close()
    assert parent.process.poll() is not None  # it ends once its socket closes


def test_a_process_with_threads_may_not_fork():
    done = threading.Event()
    thread = threading.Thread(target=done.wait, name="busy")
    thread.start()
    try:
        assert "threads (" in (fork_problem() or "") and ", not one" in fork_problem()
    finally:
        done.set()
        thread.join()


@pytest.mark.slow
def test_a_parent_that_may_not_fork_leaves_the_trials_cold(tmp_path, monkeypatch, capsys):
    (tmp_path / "threaded.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()\n"
    )
    # a parent that imports that module alone: whether it may fork is a count of its threads,
    # whatever else it imported (torch's import would cost its start, not change its answer)
    monkeypatch.setattr(launch, "preload_modules", lambda exp: ("threaded",))
    monkeypatch.setattr(launch, "_COLD", {})
    request = where_experiment(tmp_path)
    for _ in range(2):
        assert measure_in_subprocess(request, cwd=str(tmp_path))["status"] == "ok"
    assert [parent for _, parent, _ in lines(tmp_path / "built.jsonl")] == [os.getpid()] * 2
    err = capsys.readouterr().err
    assert err.count("mbtune: trials run in fresh processes here: the warm parent runs 2") == 1


HOLDER = """
import sys, threading, time
from mbtune.trial.launch import measure_in_subprocess
sys.path.insert(0, ".")
from test_warm_request import request
threading.Thread(target=measure_in_subprocess, args=(request,), kwargs={"cwd": "."}).start()
time.sleep(600)
"""


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")  # a zombie no one reaps here is gone too


@pytest.mark.slow
def test_a_trial_and_its_warm_parent_end_with_the_process_that_holds_them(tmp_path):
    """As when Ray ends a trial actor: its warm parent and the trial in flight end too."""
    request = where_experiment(tmp_path, sleep=True)
    (tmp_path / "test_warm_request.py").write_text(
        textwrap.dedent(f"""
        import pickle
        request = pickle.loads({__import__("pickle").dumps(request)!r})
        """)
    )
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not lines(tmp_path / "built.jsonl") and time.monotonic() < deadline:
            time.sleep(0.2)
        ((child, parent, _),) = lines(tmp_path / "built.jsonl")
        assert parent != holder.pid and not gone(parent) and not gone(child)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    deadline = time.monotonic() + 30
    while not (gone(parent) and gone(child)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert gone(parent) and gone(child)


# The warm parent started ahead by the search's driver (mbtune.trial.launch.WarmAhead).


@pytest.mark.slow
def test_a_parent_started_ahead_serves_the_first_actor_that_fits_it(tmp_path, monkeypatch):
    request = where_experiment(tmp_path)
    monkeypatch.setattr(launch, "_IDLE", [])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as Ray sets it in a one-CPU trial actor
    ahead = launch.WarmAhead.start(request.experiment, str(tmp_path))
    try:
        launch.offer_ahead(ahead.name)
        for _ in range(2):
            assert measure_in_subprocess(request, cwd=str(tmp_path))["status"] == "ok"
        parents = [parent for _, parent, _ in lines(tmp_path / "built.jsonl")]
        assert parents == [ahead.process.pid] * 2  # taken once, and kept
        launch.offer_ahead(ahead.name)  # offered again (another trial): not tried again
        assert launch._AHEAD == []
    finally:
        for parent in launch._IDLE:
            parent.close()
        ahead.close()


@pytest.mark.slow
def test_an_actor_in_another_environment_starts_its_own_parent_whose_trials_are_fresh_children(
    tmp_path, monkeypatch
):
    request = where_experiment(tmp_path)
    monkeypatch.setattr(launch, "_IDLE", [])
    ahead = launch.WarmAhead.start(request.experiment, str(tmp_path))
    try:
        monkeypatch.setenv("TORCHINDUCTOR_MAX_AUTOTUNE", "1")  # read as inductor loads
        launch.offer_ahead(ahead.name)
        for _ in range(2):
            result = measure_in_subprocess(request, cwd=str(tmp_path))
            assert result["status"] == "ok", result["reason"]
        built, imported = lines(tmp_path / "built.jsonl"), lines(tmp_path / "imported.jsonl")
        (first, parent, _), (second, parent_again, _) = built
        assert parent not in (ahead.process.pid, os.getpid())  # one of its own, warm
        assert ahead.process.wait(timeout=30) == 0  # turned away, it ended
        # each trial a fresh child of that one warm parent, started for them here
        assert first != second and parent == parent_again
        # the user's module is imported in each child, never in the parent, and nothing
        # one trial built is left in the next
        assert [pid for pid, _ in imported] == [first, second]
        assert [count for *_, count in built] == [1, 1]
    finally:
        for parent in launch._IDLE:
            parent.close()
        ahead.close()
