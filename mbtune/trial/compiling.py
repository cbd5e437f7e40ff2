"""``torch.compile`` as a trial uses it (``trial.compile``, ``trial.compile_mode``,
``trial.dynamic``): the model compiled, the batch dimension of its micro-batches marked
dynamic, and a watch of the compiles, which the trial reports: torch's silent fallback to
eager at a recompile limit (``compile_fallback``), and whether every graph came from
torch's on-disk compile cache (``compile_from_cache``).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from typing import Any

from mbtune.models.batch import batch_tensors

__all__ = [
    "CompileWatch",
    "compile_model",
    "compile_watch",
    "mark_batch_dynamic",
    "warm_compiler",
]


def compile_model(module: Any, tr: Any) -> Any:
    # trial.dynamic marks only the batch dimension dynamic (see mark_batch_dynamic), which
    # compiles one graph for every micro-batch size; dynamic=True would also make every
    # other size symbolic and merge equal ones ("duck sizing"), so a micro-batch size that
    # happens to equal seq_len would get a graph of its own
    import torch

    return torch.compile(module, mode=tr.compile_mode, dynamic=None if tr.dynamic else False)


def warm_compiler() -> None:
    """What inductor works out once per process before it compiles for the CPU, worked out
    in a warm parent (mbtune.trial.warm) so that every trial forked from it inherits it:
    which vector instructions this CPU runs (it builds and loads a test kernel for each in
    subprocesses: about 1.2 s of a 2 s compile on the quickstart's trials) and the hash of
    torch's own code that keys its caches. Neither starts a thread or touches a device."""
    from torch._inductor import codecache, cpu_vec_isa

    cpu_vec_isa.valid_vec_isa_list()
    codecache.torch_key()


def mark_batch_dynamic(batches: list[Any]) -> None:
    """Mark the sample dimension of every tensor of every micro-batch dynamic, whatever the
    batch's form (a tensor, a sequence or a mapping of tensors)."""
    import torch

    for batch in batches:
        for t in batch_tensors(batch):
            torch._dynamo.mark_dynamic(t, 0)


_CACHE_COUNTERS = ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")
"""Inductor's counters (torch._dynamo.utils.counters["inductor"]) of its on-disk graph
cache: a graph loaded, compiled and written, or compiled without it."""


class CompileWatch(logging.Handler):
    """What the compiles did while it watched: torch._dynamo's warning that it hit the
    recompile limit and ran eager (``reason``), and inductor's graph cache (``from_cache``:
    every graph loaded from torch's on-disk cache, none compiled by inductor: a shape an
    earlier trial of the same run compiled, or a run before it; the trial's compile time is
    then less than a cold compile, though dynamo's tracing is still in it)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reason: str | None = None
        self.from_cache = False
        self._cache: dict[str, int] = {}

    def _counts(self) -> dict[str, int]:
        import sys

        utils = sys.modules.get("torch._dynamo.utils")  # not imported: nothing compiled
        counters = utils.counters["inductor"] if utils is not None else {}
        return {k: counters.get(k, 0) for k in _CACHE_COUNTERS}

    def start(self) -> None:
        self._cache = self._counts()

    def stop(self) -> None:
        hit, miss, bypass = (n - self._cache[k] for k, n in self._counts().items())
        self.from_cache = hit > 0 and miss == 0 and bypass == 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "hit config." in message and self.reason is None:
            limit = re.search(r"hit config\.(\w+) \((\d+)\)", message)
            what = f"{limit[1]} ({limit[2]})" if limit else "a recompile limit"
            self.reason = (
                f"torch.compile hit {what} and ran the model eagerly; set trial.dynamic: true "
                "to compile once for every micro-batch size"
            )


@contextlib.contextmanager
def compile_watch() -> Iterator[CompileWatch]:
    watch = CompileWatch()
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(watch)
    watch.start()
    try:
        yield watch
    finally:
        watch.stop()
        logger.removeHandler(watch)
