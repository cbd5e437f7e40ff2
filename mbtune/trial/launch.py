"""The trial's process boundary: how a search's trial actor has one configuration measured.

With ``trial.parallel: simulate`` (and replay) the trial runs in a child process of its
own, ``python -m mbtune.trial``, which reads a pickled :class:`~mbtune.trial.trial.TrialRequest`
(the validated ``Experiment`` itself, never a dict to parse again) on its stdin and prints
its result as one JSON line: an out-of-memory, a crash, a hang or a poisoned CUDA context
stays in that process, and is recorded as a result. With ``ddp`` the actor fits a Ray
Train run instead, whose workers are the trial's own processes (mbtune.trial.ddp says why).

Neither function imports torch: they run in the search's trial actor.
"""

from __future__ import annotations

import json
import pickle
import socket
import subprocess
import sys
import time
from typing import Any

from mbtune import progress
from mbtune.progress import PhaseHook
from mbtune.trial.trial import TrialRequest, trial_metrics

__all__ = ["KILL_GRACE_S", "measure_in_subprocess", "measure_with_ray_train"]

KILL_GRACE_S = 60.0
"""How long past ``trial.timeout_s`` a trial process that did not stop itself (stuck in C
code, its alarm blocked) runs before the search kills it."""


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
    a result too. ``on_phase`` hears each phase of the trial as it happens."""
    timeout_s = request.experiment.trial.timeout_s
    started = time.perf_counter()
    base = {**request.config.as_dict(), "objective": 0.0, "reason": None}

    def failed(status: str, reason: str) -> dict[str, Any]:
        return {**base, "status": status, "reason": reason,
                "wall_s": time.perf_counter() - started}  # fmt: skip

    kill_after = timeout_s + KILL_GRACE_S  # the child stops itself at timeout_s: a backstop
    try:
        with progress.phase_pipe(on_phase) as (phase_args, phase_fds):
            proc = subprocess.run(
                [sys.executable, "-m", "mbtune.trial", *phase_args],
                input=pickle.dumps(request),
                capture_output=True,
                cwd=cwd,
                timeout=kill_after,
                pass_fds=phase_fds,
            )
    except subprocess.TimeoutExpired:
        return failed(
            "timeout", f"killed after {kill_after:g} s: it did not stop itself at {timeout_s:g} s"
        )
    except OSError as e:  # on a cluster: the driver's directory is missing on this node
        return failed(
            "error", f"cannot start the trial process in {cwd} on {socket.gethostname()}: {e}"
        )
    # a user model may print anything, in any encoding
    stdout = proc.stdout.decode(errors="replace")
    result = _last_json_object(stdout) if proc.returncode == 0 else None
    if result is not None:
        return result
    if proc.returncode == -9:
        reason = "the trial process was killed (SIGKILL: the kernel's out-of-memory killer?)"
    elif proc.returncode < 0:
        reason = f"the trial process was killed by signal {-proc.returncode}"
    elif proc.returncode == 0:
        reason = "the trial process printed no result"
    else:
        stderr = proc.stderr.decode(errors="replace")
        tail = [line for line in stderr.strip().splitlines() if line.strip()]
        reason = tail[-1] if tail else f"the trial process exited with {proc.returncode}"
    return failed("error", reason)


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
