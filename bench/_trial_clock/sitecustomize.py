"""A clock on the trials of a search, for bench/trial_overhead.py; no part of mbtune.

Where MBTUNE_TRIAL_CLOCK names a file, each call of
``mbtune.trial.launch.measure_in_subprocess`` in this process (a search's trial actor)
appends one JSON line to it: the process, when the call began and ended (``time.time()``),
and what the result says of its compile and steps. Python imports this module at start-up
where its directory is on PYTHONPATH, so the same clock times any version of mbtune (the
code before a change, in a git worktree, and after it) without a line of mbtune changed.
"""

from __future__ import annotations

import os
import sys

_PATH = os.environ.get("MBTUNE_TRIAL_CLOCK")
_TARGET = "mbtune.trial.launch"


def _clocked(measure):  # type: ignore[no-untyped-def]
    import functools
    import json
    import time

    @functools.wraps(measure)
    def timed(request, **kwargs):  # type: ignore[no-untyped-def]
        start = time.time()
        result = measure(request, **kwargs)
        end = time.time()
        line = {
            "pid": os.getpid(),
            "code": measure.__code__.co_filename,  # which mbtune the actor ran
            "start": start,
            "end": end,
            "config": [
                request.config.batch_size,
                request.config.num_devices,
                request.config.micro_batch_size,
            ],  # fmt: skip
            "warmup_steps": request.experiment.trial.warmup_steps,
            **{
                k: result.get(k)
                for k in ("status", "wall_s", "compile_s", "step_time_ms_median", "step_times_ms")
            },  # fmt: skip
        }
        with open(_PATH, "a") as f:  # type: ignore[arg-type]
            f.write(json.dumps(line) + "\n")
        return result

    return timed


if _PATH:
    import importlib.abc
    import importlib.util

    class _Finder(importlib.abc.MetaPathFinder):
        """Finds mbtune.trial.launch as Python would, and clocks it once it is loaded."""

        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name != _TARGET:
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
                module.measure_in_subprocess = _clocked(module.measure_in_subprocess)

            spec.loader.exec_module = exec_module  # type: ignore[method-assign]
            return spec

    sys.meta_path.insert(0, _Finder())
