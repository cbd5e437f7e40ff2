"""The trial's process boundary: how a search's trial actor has one configuration measured.

With ``trial.parallel: simulate`` (and replay) the trial runs in a process of its own, a
child that reads a :class:`~mbtune.trial.trial.TrialRequest` (the validated
``Experiment`` itself, never a dict to parse again) and prints its result as one JSON line:
an out-of-memory, a crash, a hang or a poisoned CUDA context stays in that process, and is
recorded as a result. On Linux the child is forked from the actor's warm parent
(mbtune.trial.warm: torch and the trial's code already imported, one per actor, kept
between its trials); elsewhere, or where the warm parent cannot fork safely, it is a fresh
``python -m mbtune.trial``. With ``ddp`` the actor fits a Ray Train run instead, whose
workers are the trial's own processes (mbtune.trial.ddp says why).

:func:`trial_actor` is what the search's trial actor runs (Ray Tune's function trainable):
here, not in mbtune.search, so that a trial actor imports what a trial needs and not the
search's samplers, model and study (about 1 CPU-s less for each actor Tune starts). Nothing
here imports torch: it runs in the trial actor.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any

from mbtune import progress
from mbtune.config.experiment import Experiment
from mbtune.lattice import BatchConfig
from mbtune.progress import PhaseHook
from mbtune.trial.trial import TrialRequest, trial_metrics
from mbtune.trial.warm import AHEAD_FLAG, Ended, WarmParent, spawn

__all__ = [
    "KILL_GRACE_S",
    "MEASURED",
    "METRIC",
    "WarmAhead",
    "measure_in_subprocess",
    "measure_with_ray_train",
    "offer_ahead",
    "pack_result",
    "preload_modules",
    "trial_actor",
    "unpack_result",
    "warm_trials",
]

KILL_GRACE_S = 60.0
"""How long past ``trial.timeout_s`` a trial process that did not stop itself (stuck in C
code, its alarm blocked) runs before the search kills it."""


METRIC = "objective"
"""The value every searcher maximises: the experiment's objective, 0 for a failed trial."""

MEASURED = "measured"
"""The key under which a trial reports everything it measured, as one JSON string."""


def trial_actor(
    config: dict[str, Any], *, experiment: Experiment, cwd: str, warm_ahead: str | None = None
) -> None:
    """In a search's trial actor: run one trial in a fresh process (ddp: a fresh Ray Train
    run) and report what it measured, and where, to Tune; the search learns where before
    the trial measures. ``config["repeat"]``: which measurement of the configuration this
    is (0: its first). ``warm_ahead``: the warm parent the driver started for the first
    trial here, if any."""
    import ray
    from ray import tune

    if warm_ahead is not None:
        offer_ahead(warm_ahead)
    request = TrialRequest(
        experiment=experiment,
        config=BatchConfig.from_mapping(config),
        repeat=int(config.get("repeat", 0)),
    )
    node_id = ray.get_runtime_context().get_node_id()
    # the board learns the node now: a trial whose node is lost never reports
    on_phase = progress.forwarder(node_id)  # the driver's line
    ddp = experiment.trial.parallel == "ddp"
    measure = measure_with_ray_train if ddp else measure_in_subprocess
    result = measure(request, cwd=cwd, on_phase=on_phase)
    tune.report(pack_result({**result, "node_id": node_id}))


def pack_result(result: dict[str, Any]) -> dict[str, Any]:
    """What a trial reports to Tune: the objective, and the rest as one string.

    Tune keeps running statistics for every numeric key of every result of every trial
    for the whole search; one numeric key instead of thirty keeps the driver small.
    """
    return {METRIC: float(result.get(METRIC) or 0.0), MEASURED: json.dumps(result)}


def unpack_result(result: dict[str, Any] | None) -> dict[str, Any] | None:
    """The trial's own result from what Tune hands back (a plain result passes through)."""
    if result is None or MEASURED not in result:
        return result
    return json.loads(result[MEASURED])


def measure_with_ray_train(
    request: TrialRequest, *, cwd: str, on_phase: PhaseHook | None = None
) -> dict[str, Any]:
    """Measure a ``parallel: ddp`` trial: here, in the trial actor, which fits a Ray Train
    run and runs no model code itself (mbtune.trial.ddp says why). ``cwd``: where the workers
    import a user model from."""
    return trial_metrics(
        request.experiment, request.config, cwd=cwd, repeat=request.repeat, on_phase=on_phase
    )


def measure_in_subprocess(
    request: TrialRequest, *, cwd: str, on_phase: PhaseHook | None = None
) -> dict[str, Any]:
    """Measure a trial in a child process started in ``cwd``; a crash, a kill or a hang is
    a result too. ``on_phase`` hears each phase of the trial as it happens. The result's
    ``wall_s`` is the trial as this process saw it, the child's start included."""
    timeout_s = request.experiment.trial.timeout_s
    started = time.perf_counter()
    base = {**request.config.as_dict(), "objective": 0.0, "reason": None}

    def failed(status: str, reason: str) -> dict[str, Any]:
        return {**base, "status": status, "reason": reason,
                "wall_s": time.perf_counter() - started}  # fmt: skip

    kill_after = timeout_s + KILL_GRACE_S  # the child stops itself at timeout_s: a backstop
    try:
        if not os.path.isdir(cwd):  # on a cluster: the driver's directory is missing here
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), cwd)
        with (
            progress.phase_pipe(on_phase) as (phase_args, phase_fds),
            tempfile.TemporaryFile() as out,
            tempfile.TemporaryFile() as err,
        ):
            ended = _run(request, cwd, out, err, phase_args, phase_fds, kill_after)
            stdout, stderr = _read(out), _read(err)
    except OSError as e:
        return failed(
            "error", f"cannot start the trial process in {cwd} on {socket.gethostname()}: {e}"
        )
    if ended.killed:
        return failed(
            "timeout", f"killed after {kill_after:g} s: it did not stop itself at {timeout_s:g} s"
        )
    returncode = ended.returncode
    if returncode is None:
        return failed("error", ended.reason or "the trial process ended unseen")
    result = _last_json_object(stdout) if returncode == 0 else None
    if result is not None:
        return {**result, "wall_s": time.perf_counter() - started}
    if returncode == -9:
        reason = "the trial process was killed (SIGKILL: the kernel's out-of-memory killer?)"
    elif returncode < 0:
        reason = f"the trial process was killed by signal {-returncode}"
    elif returncode == 0:
        reason = "the trial process printed no result"
    else:
        tail = [line for line in stderr.strip().splitlines() if line.strip()]
        reason = tail[-1] if tail else f"the trial process exited with {returncode}"
    return failed("error", reason)


def _read(file: IO[bytes]) -> str:
    """What the trial process wrote to ``file`` (a user model may print anything, in any
    encoding)."""
    file.seek(0)
    return file.read().decode(errors="replace")


def _run(
    request: TrialRequest,
    cwd: str,
    out: IO[bytes],
    err: IO[bytes],
    phase_args: list[str],
    phase_fds: tuple[int, ...],
    kill_after: float,
) -> Ended:
    """Run the trial in a child forked by the warm parent, or else in a fresh process."""
    pickled = pickle.dumps(request)
    parent = _warm_parent(request.experiment, cwd)
    if parent is not None:
        fds = [out.fileno(), err.fileno(), *phase_fds]
        ended = parent.run(pickled, cwd=cwd, fds=fds, kill_after=kill_after)
        _give_back(parent)
        if ended is not None:
            return ended
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "mbtune.trial", *phase_args],
            input=pickled, stdout=out, stderr=err, cwd=cwd, timeout=kill_after,
            pass_fds=phase_fds,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        return Ended(None, killed=True)
    return Ended(proc.returncode)


# ---------------------------------------------------------------------------
# the warm parents of this process (a trial actor has one; a test or a bench may hold more)


def warm_trials() -> bool:
    """Whether trials here fork from a warm parent: on Linux, unless ``MBTUNE_COLD_TRIALS``
    is set (a fresh process per trial, as before warm parents)."""
    return sys.platform == "linux" and not os.environ.get("MBTUNE_COLD_TRIALS")


def preload_modules(exp: Experiment) -> tuple[str, ...]:
    """What a warm parent imports for ``exp``'s trials: the trial's code, torch and what
    the trial would import next (dynamo, which the FLOP count's dispatch mode imports on
    its first operation, compiled or not: 1.2 of a small model's 1.35 CPU-s a trial when
    each child imported it; compiling: inductor too, and what inductor probes once per
    process; sharding: FSDP2; an ``hf:`` model: transformers). A user model's module is
    never among them: its code runs in the child only."""
    if exp.trial.backend == "replay":
        return ("mbtune.trial.trial",)
    modules = ["torch", "torch._dynamo", "mbtune.trial.trial", "mbtune.models.build"]
    if exp.trial.compile:
        modules += ["torch._inductor.compile_fx"]
        modules += ["mbtune.trial.compiling:warm_compiler"]
    if exp.trial.sharding == "fsdp":
        modules += ["torch.distributed.fsdp"]
    if exp.model.name.startswith("hf:"):
        modules += ["transformers", "transformers.modeling_utils", "mbtune.models.hf"]
    return tuple(modules)


_IDLE: list[WarmParent] = []
_COLD: dict[tuple[str, ...], str] = {}
"""Preloads whose warm parent could not fork trials, and why: their trials run cold."""
_AHEAD: list[str] = []
"""The name of a warm parent started ahead for this process's trials, until it is tried."""
_TRIED: set[str] = set()
_LOCK = threading.Lock()


def offer_ahead(name: str) -> None:
    """A warm parent was started ahead under ``name`` (:class:`WarmAhead`): the next trial
    that needs a warm parent here tries it first, once."""
    with _LOCK:
        if name not in _TRIED:
            _TRIED.add(name)
            _AHEAD.append(name)


def _warm_parent(exp: Experiment, cwd: str) -> WarmParent | None:
    """An idle warm parent for ``exp``'s trials (the one started ahead, or one started
    now, where none is idle); None where trials here run cold."""
    if not warm_trials():
        return None
    preload = preload_modules(exp)
    with _LOCK:
        if preload in _COLD:
            return None
        env = dict(os.environ)
        mine = [p for p in _IDLE if p.preload == preload and p.env == env and p.alive()]
        if mine:
            _IDLE.remove(mine[0])
            return mine[0]
        stale = list(_IDLE)  # another experiment's, or another environment's: ended
        _IDLE.clear()
        ahead = list(_AHEAD)
        _AHEAD.clear()
    for p in stale:
        p.close()
    for name in ahead:
        parent = WarmParent.adopt(name, preload)
        if parent is not None:
            return parent
    parent = WarmParent.start(preload, cwd=cwd)
    if parent.problem is not None:
        _gone_cold(parent)
        return None
    return parent


class WarmAhead:
    """A warm parent for a search's trials started by its driver, beside Ray's start, so
    that the first trial's actor finds torch and the trial's code imported (about 4 s of a
    2-core machine): ``python -m mbtune.trial --warm-ahead FD PID``, listening under
    ``name`` in Linux's abstract namespace. Its environment is the
    driver's with the ``OMP_NUM_THREADS`` Ray gives a trial actor; an actor in another
    environment, or on another host, does not take it, and starts its own as before. It
    ends with the driver, or at :meth:`close`."""

    def __init__(self, exp: Experiment, cwd: str) -> None:
        self.name = f"mbtune-warm-{os.getpid()}-{os.urandom(6).hex()}"
        env = dict(os.environ)
        # what Ray sets in a worker that holds ray.cpus_per_trial CPUs, unless already set
        env.setdefault("OMP_NUM_THREADS", str(max(1, int(exp.ray.cpus_per_trial))))
        # listening from now on (Linux's abstract namespace: nothing on disk), so that an
        # actor that asks while the parent still imports waits for it; the parent holds it
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind("\0" + self.name)
            listener.listen(8)
            self.process = spawn(AHEAD_FLAG, listener, [str(os.getpid()), *preload_modules(exp)],
                                 cwd=cwd, env=env)  # fmt: skip
        finally:
            listener.close()

    @classmethod
    def start(cls, exp: Experiment, cwd: str) -> WarmAhead | None:
        """One for ``exp``'s trials, where they fork from warm parents in processes of their
        own (not ddp's workers, nor replayed trials, whose parent imports no torch)."""
        tr = exp.trial
        if not warm_trials() or tr.parallel == "ddp" or tr.backend == "replay":
            return None
        return cls(exp, cwd)

    def close(self) -> None:
        """End it (and a trial it forked, which ends with it)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def _give_back(parent: WarmParent) -> None:
    """``parent`` idle again, or gone: ended (the next trial starts another) or unable to
    fork (this process's trials of its kind run cold)."""
    if parent.alive():
        with _LOCK:
            _IDLE.append(parent)
    elif parent.problem is not None:
        _gone_cold(parent)
    else:
        parent.close()


def _gone_cold(parent: WarmParent) -> None:
    """A warm parent that cannot fork trials: this process's trials of its kind run cold,
    and its log says why, once."""
    with _LOCK:
        first = parent.preload not in _COLD
        _COLD[parent.preload] = str(parent.problem)
    parent.close()
    if first:
        print(f"mbtune: trials run in fresh processes here: {parent.problem}", file=sys.stderr)


def _last_json_object(stdout: str) -> dict[str, Any] | None:
    """The trial's result: the last line of its stdout that is a JSON object (a user model
    may print, even after the result, from an exit handler)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None
