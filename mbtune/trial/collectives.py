"""The collectives a trial's measurement loop (mbtune.trial.measure) runs over, in the manner of
Composer's ``utils/dist.py``: on one process they do nothing, so that one loop serves a
simulated trial and every rank of a ddp run.

:class:`OneProcess` (``trial.parallel: simulate``) stands for every device of the
configuration: there is no one to agree with, no gradient to all-reduce (the all-reduce is
modelled from the gradient's bytes), and a failure anywhere is simply the trial's result.
:class:`ProcessGroup` (``ddp``, one per rank inside a Ray Train worker) wraps the model in
PyTorch's ``DistributedDataParallel`` and agrees with the other ranks through
torch.distributed; with ``trial.sharding: fsdp`` its subclass in mbtune.trial.sharding shards the
model with FSDP2 instead, and no DDP all-reduce runs on top of it. torch is imported inside
the methods: the driver imports this module.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any, Protocol

from mbtune.trial.memory import Verdict, verdict

__all__ = ["Collectives", "OneProcess", "ProcessGroup"]


class Collectives(Protocol):
    """What the measurement loop asks of the processes that run one trial together."""

    rank: int
    """This process's rank (0 on one process)."""
    world_size: int
    """How many processes run the trial (1 on one process)."""
    simulated: bool
    """True: one process stands for every device of the configuration. Nothing waits on
    it, so a failure anywhere is a result; its steps have no all-reduce, which is modelled."""
    sharded: bool
    """True: each process holds only its shard of the model (``trial.sharding: fsdp``,
    mbtune.trial.sharding): the model is built on the meta device and :meth:`place` shards
    it, and every pass has collectives in it (no step is local)."""

    def place(self, module: Any, device: Any) -> Any:
        """``module`` as this process holds it on ``device``: the whole model, or (sharded)
        this rank's shard of a model built on the meta device. No collective."""
        ...

    def agree(self, failure: BaseException | None, over: str | None = None) -> Verdict | None:
        """Every process's :func:`mbtune.trial.memory.verdict` of its own ``failure`` (or peak
        ``over`` the budget), agreed: None if all are fine, else the worst (an
        out-of-memory before an error), the same everywhere. Also a barrier."""
        ...

    def slowest(self, values: list[float]) -> list[float]:
        """Each value's maximum over the processes."""
        ...

    def data_parallel(self, module: Any) -> Any:
        """``module`` as the step calls it (ddp: wrapped in DistributedDataParallel)."""
        ...

    def no_sync(self, model: Any) -> contextlib.AbstractContextManager[Any]:
        """A context in which backward passes accumulate gradients without all-reducing."""
        ...

    def all_reduce(self, tensor: Any) -> None:
        """Sum ``tensor`` over the processes, in place."""
        ...

    def sync_gradients(self, tensor: Any) -> None:
        """The collectives of one step's gradient sync, alone, on ``tensor`` (the gradients'
        bytes as one buffer), for timing: DDP's all-reduce (FSDP's: mbtune.trial.sharding)."""
        ...


class OneProcess:
    """The collectives of one process: each does nothing (``trial.parallel: simulate``)."""

    rank = 0
    world_size = 1
    simulated = True
    sharded = False

    def place(self, module: Any, device: Any) -> Any:
        return module.to(device)

    def agree(self, failure: BaseException | None, over: str | None = None) -> Verdict | None:
        return verdict(failure, over)

    def slowest(self, values: list[float]) -> list[float]:
        return list(values)

    def data_parallel(self, module: Any) -> Any:
        return module

    def no_sync(self, model: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def all_reduce(self, tensor: Any) -> None:
        pass

    def sync_gradients(self, tensor: Any) -> None:
        pass


_CODES = {None: 0, "error": 1, "oom": 2}
"""Verdicts ordered by how bad they are: an out-of-memory outranks an error."""


class ProcessGroup:
    """The collectives of one rank of a torch.distributed process group (``ddp``).

    Not the gradients' all-reduce: that is DDP's, in the last backward pass of a step.
    """

    simulated = False
    sharded = False

    def __init__(self, device: Any) -> None:
        import torch.distributed as dist

        self.device = device
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def agree(self, failure: BaseException | None, over: str | None = None) -> Verdict | None:
        import torch
        import torch.distributed as dist

        mine = verdict(failure, over)
        code = _CODES[mine[0] if mine else None]
        flag = torch.tensor([float(code)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        worst = int(flag.item())
        if worst == 0:
            return None
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, mine)
        rank = next(r for r, v in enumerate(every) if _CODES[v[0] if v else None] == worst)
        status, reason = every[rank]
        return status, f"rank {rank}: {reason}"

    def slowest(self, values: list[float]) -> list[float]:
        import torch
        import torch.distributed as dist

        if not values:
            return []
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # one collective for all of them
        return t.tolist()

    def place(self, module: Any, device: Any) -> Any:
        return module.to(device)

    def data_parallel(self, module: Any) -> Any:
        from torch.nn.parallel import DistributedDataParallel

        # DDP broadcasts rank 0's weights here (every rank arrives: all built). No buffer
        # broadcast before each forward pass: it would put a collective into the local
        # steps, where a failing rank must not leave the others waiting.
        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(module, device_ids=ids, **_no_forward_buffer_sync())

    def no_sync(self, model: Any) -> contextlib.AbstractContextManager[Any]:
        return model.no_sync()

    def all_reduce(self, tensor: Any) -> None:
        import torch.distributed as dist

        dist.all_reduce(tensor)

    def sync_gradients(self, tensor: Any) -> None:
        self.all_reduce(tensor)


def _no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's option that turns off the buffer broadcast before each forward pass (named
    ``forward_sync_buffers`` from torch 2.13, ``broadcast_buffers`` before)."""
    from torch.nn.parallel import DistributedDataParallel

    names = inspect.signature(DistributedDataParallel).parameters
    key = "forward_sync_buffers" if "forward_sync_buffers" in names else "broadcast_buffers"
    return {key: False}
