"""A clock on the trials of a search, for bench/trial_overhead.py; no part of mbtune.

Where MBTUNE_TRIAL_CLOCK names a file, each call of

- ``mbtune.trial.launch.measure_in_subprocess`` in this process (a search's trial actor)
  appends one JSON line to it (``kind`` ``trial``): the process, when the call began and
  ended (``time.time()``), and what the result says of its compile and steps;
- ``mbtune.search._ledger.TrialLog._finish`` (the driver's record of a finished trial: its
  row, the study told, the recommendation) a line of ``kind`` ``finish``;
- ``mbtune.search._searcher.MbtuneSearcher.suggest`` (the driver's proposal of the next
  trial) a line of ``kind`` ``suggest``, with what it answered (``proposed``).

Python imports this module at start-up where its directory is on PYTHONPATH, so the same
clock times any version of mbtune (the code before a change, in a git worktree, and after
it) without a line of mbtune changed.
"""

from __future__ import annotations

import os
import sys

_PATH = os.environ.get("MBTUNE_TRIAL_CLOCK")


def _write(line: dict) -> None:  # type: ignore[type-arg]
    import json

    with open(_PATH, "a") as f:  # type: ignore[arg-type]
        f.write(json.dumps(line) + "\n")


def _clocked_trial(measure):  # type: ignore[no-untyped-def]
    import functools
    import time

    @functools.wraps(measure)
    def timed(request, **kwargs):  # type: ignore[no-untyped-def]
        start = time.time()
        result = measure(request, **kwargs)
        end = time.time()
        _write({
            "kind": "trial",
            "pid": os.getpid(),
            "code": measure.__code__.co_filename,  # which mbtune the actor ran
            "start": start,
            "end": end,
            "config": [
                request.config.batch_size,
                request.config.num_devices,
                request.config.micro_batch_size,
            ],
            "warmup_steps": request.experiment.trial.warmup_steps,
            **{
                k: result.get(k)
                for k in ("status", "wall_s", "compile_s", "step_time_ms_median", "step_times_ms")
            },
        })  # fmt: skip
        return result

    return timed


def _clocked_call(kind, method):  # type: ignore[no-untyped-def]
    """``method`` (of the driver) timed: a line of ``kind`` per call."""
    import functools
    import time

    @functools.wraps(method)
    def timed(*args, **kwargs):  # type: ignore[no-untyped-def]
        start = time.time()
        answer = method(*args, **kwargs)
        line = {"kind": kind, "pid": os.getpid(), "start": start, "end": time.time()}
        if kind == "suggest":
            line["proposed"] = answer if isinstance(answer, (dict, str)) else None
        _write(line)
        return answer

    return timed


def _clock_trial(module):  # type: ignore[no-untyped-def]
    module.measure_in_subprocess = _clocked_trial(module.measure_in_subprocess)


def _clock_ledger(module):  # type: ignore[no-untyped-def]
    log = module.TrialLog
    log._finish = _clocked_call("finish", log._finish)


def _clock_searcher(module):  # type: ignore[no-untyped-def]
    searcher = module.MbtuneSearcher
    searcher.suggest = _clocked_call("suggest", searcher.suggest)


_TARGETS = {
    "mbtune.trial.launch": _clock_trial,
    "mbtune.search._ledger": _clock_ledger,
    "mbtune.search._searcher": _clock_searcher,
}


if _PATH:
    import importlib.abc
    import importlib.util

    class _Finder(importlib.abc.MetaPathFinder):
        """Finds each module of _TARGETS as Python would, and clocks it once it is loaded."""

        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name not in _TARGETS:
                return None
            sys.meta_path.remove(self)
            try:
                spec = importlib.util.find_spec(name)
            finally:
                sys.meta_path.insert(0, self)
            if spec is None or spec.loader is None:
                return spec
            load = spec.loader.exec_module

            def exec_module(module):  # type: ignore[no-untyped-def]
                load(module)
                _TARGETS[name](module)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _Finder())
