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
from pathlib import Path
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


def spawn_ranks(
    fn: Callable[..., None], args: tuple[Any, ...], nprocs: int, rendezvous: Path
) -> None:
    """``fn(rank, nprocs, *args)`` in ``nprocs`` processes, each computing on one thread (as
    a trial's rank that holds one CPU: the ranks share this machine's cores with each other
    and the suite's other worker, see tests/conftest.py) inside a gloo group met at the file
    ``rendezvous`` (which must not exist yet), joined; a rank's error raised here."""
    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(PRELOAD)  # read when the server starts: once
    ranks = mp.start_processes(_in_group, args=(nprocs, f"file://{rendezvous}", fn, *args),
                               nprocs=nprocs, join=False, start_method="forkserver")  # fmt: skip
    deadline = time.monotonic() + HUNG_S
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            hung = [r for r, p in enumerate(ranks.processes) if p.is_alive()]
            for p in ranks.processes:
                p.kill()
            raise AssertionError(f"ranks {hung} of {nprocs} still running after {HUNG_S} s")


_KEPT: list = []
"""What a rank keeps to its end: its process group, never destroyed. Destroyed (or freed
with the last module that holds it), a gloo group's destructor joins gloo's threads holding
the GIL, while one of them may still need the GIL, to release a collective's Python state
(a DDP comm hook's last all-reduce): a deadlock, one rank in 8-15 beside a busy core
(docs/benchmarks.md, "Threads and a deadlock"). A rank's process ends with
multiprocessing's os._exit (a forkserver's child never finalizes its interpreter), so
keeping the group costs nothing."""


def _in_group(rank: int, world: int, init: str, fn: Callable[..., None], *args: Any) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    _KEPT.append(dist.group.WORLD)
    fn(rank, world, *args)
    dist.barrier()  # neither rank leaves while the other still talks to it
