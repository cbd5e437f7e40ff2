"""Gloo ranks for the multi-process tests, as ``torch.multiprocessing.spawn`` starts them
(a rank's failed assertion is raised in the test, with the rank's own traceback), but
forked from one forkserver per test process that imported torch, dynamo (which the FLOP
count imports on its first operation), torch.distributed's FSDP and mbtune's trial code
once: a spawned rank imported them itself, about 2.5 CPU-s a rank on this machine, most
of what a small model's rank does. As mbtune's own warm parent (mbtune/trial/warm.py),
the server runs one thread and no torch op, so a fork of it is a clean process; each
rank still gets the test's working directory and sys.path (multiprocessing's preparation
data), though not an environment changed after the server started (no rank test reads
one)."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

PRELOAD = [
    "torch",
    "torch._dynamo",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "mbtune.trial.measure",
    "mbtune.trial.pipeline",
    "mbtune.trial.sharding",
    "mbtune.trial.step",
    "mbtune.models.build",
]


def spawn_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, joined; a rank's error raised here."""
    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts: once
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
