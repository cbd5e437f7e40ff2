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
import time
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


HUNG_S = 180
"""A rank still running this long is hung (these tests' ranks take seconds): it is killed
and the test fails naming it, where a join without end would hold the suite."""


def spawn_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes, each computing on one thread (as a
    trial's rank that holds one CPU: the ranks share this machine's cores with each other
    and the suite's other worker, see tests/conftest.py), joined; a rank's error raised
    here."""
    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts: once
    ranks = mp.start_processes(_on_one_thread, args=(fn, *args), nprocs=nprocs, join=False,
                               start_method="forkserver")  # fmt: skip
    deadline = time.monotonic() + HUNG_S
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            hung = [r for r, p in enumerate(ranks.processes) if p.is_alive()]
            for p in ranks.processes:
                p.kill()
            raise AssertionError(f"ranks {hung} of {nprocs} still running after {HUNG_S} s")


def _on_one_thread(rank: int, fn: Callable[..., None], *args: Any) -> None:
    import torch

    torch.set_num_threads(1)
    fn(rank, *args)
