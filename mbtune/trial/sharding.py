"""Sharded trials (``trial.sharding: fsdp``): each ddp rank holds only its shard of the model.

With ``fsdp`` every Ray Train worker of a ``parallel: ddp`` trial wraps the model with
PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``): one unit per block (the classes
a model names, see :func:`shard_units`) and the root. No worker ever holds the whole model:
the model is built on the meta device (mbtune.trial.step), sharded, materialized empty
on the device with ``to_empty`` and initialised by its own init (:func:`materialize`), so
that a CPU trial's peak, the process's high-water mark, shows the saving.

The initialisation is the model's own (``init_weights()`` where the model has one; a
transformers model's ``initialize_weights()``; else each submodule's
``reset_parameters()``), run after the torch seed, with every random fill of a sharded
parameter drawing the whole parameter and keeping this rank's shard: one parameter is whole
at a time, every rank agrees, and the result is the unsharded model's own init of the same
seed (for the built-in gpt exactly; tests/test_sharding.py checks it).

:class:`FullyShardedGroup` is mbtune.trial.collectives' ``ProcessGroup`` for such a rank:
it places the model (shards and materializes it), runs no DDP all-reduce on top of FSDP
(FSDP reduce-scatters the gradients itself: with ``grad_sync: last``, the default, in the
backward pass of a step's last micro-batch, the others running under
``set_requires_gradient_sync(False)``; with ``every``, in each micro-batch's), and times one
step's bytes as FSDP moves them (an all-gather and a reduce-scatter). Each unit is sharded
with the configuration's ``reshard_after_forward`` (true: its parameters are freed after
its forward pass and gathered again for the backward; false: kept until then). ``trial.precision``
becomes FSDP2's ``MixedPrecisionPolicy`` (parameters in the compute dtype, gradients
reduced in fp32); with compile on, each block is compiled on its own.

With ``trial.parallel: simulate`` (:class:`SimulatedShards`) the trial's own process is rank
0 of N on torch's fake process group (:func:`fake_process_group`, which ``mbtune memory``
uses too), sharded the same way; its collectives take no time and are modelled instead.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

from mbtune.config.trial import TrialConfig
from mbtune.errors import MbtuneError
from mbtune.lattice import GradSync
from mbtune.trial.collectives import ProcessGroup
from mbtune.trial.memory import Verdict, verdict
from mbtune.trial.precision import resolve

__all__ = [
    "SHARD_BLOCKS_ATTR",
    "FullyShardedGroup",
    "SimulatedShards",
    "fake_process_group",
    "gradient_sync_skipped",
    "materialize",
    "shard",
    "shard_units",
]

SHARD_BLOCKS_ATTR = "shard_blocks"
"""The attribute a model sets to the class name(s) of its blocks, one FSDP unit each (the
built-in gpt: ``Block``). A transformers model's ``_no_split_modules`` serves the same; a
model with neither is sharded by its top-level children."""

_RANDOM_FILLS = frozenset(
    ["normal_", "uniform_", "random_", "bernoulli_", "exponential_", "log_normal_", "cauchy_",
     "geometric_"]
)  # fmt: skip
"""In-place random fills (aten): on a shard they must draw the whole parameter."""


class FullyShardedGroup(ProcessGroup):
    """The collectives of one rank of a sharded trial (``trial.sharding: fsdp``)."""

    sharded = True

    @classmethod
    def for_config(cls, device: Any, trial: TrialConfig, config: Any, *, seed: int) -> Any:
        """The group for one configuration (mbtune.lattice.BatchConfig): its FSDP settings."""
        return cls(device, trial, seed=seed, reshard_after_forward=config.reshard_after_forward,
                   grad_sync=config.grad_sync)  # fmt: skip

    def __init__(
        self,
        device: Any,
        trial: TrialConfig,
        *,
        seed: int,
        reshard_after_forward: bool = True,
        grad_sync: GradSync = "last",
    ) -> None:
        """``reshard_after_forward`` and ``grad_sync``: the configuration's (mbtune.lattice.
        BatchConfig): FSDP2's ``reshard_after_forward`` of every unit, and whether a step's
        micro-batches but the last skip the gradients' reduce-scatter (``last``) or not."""
        from torch.distributed.device_mesh import init_device_mesh

        super().__init__(device)
        self.trial, self.seed = trial, seed
        self.reshard_after_forward, self.grad_sync = reshard_after_forward, grad_sync
        # explicit, on the CPU too: FSDP2 without a mesh assumes CUDA (pytorch issue 132471);
        # made here, where every rank arrives, not where a failing build may leave one out
        self.mesh = init_device_mesh(device.type, (self.world_size,))

    def place(self, module: Any, device: Any) -> Any:
        """Shard ``module`` (built on the meta device), then materialize and initialise this
        rank's shard on ``device``. No collective: a failure here can be agreed on."""
        from torch.distributed.fsdp import MixedPrecisionPolicy

        tr = self.trial
        policy = mixed_precision(resolve(tr.precision, device))
        units = shard_units(module)
        # what each unit's collectives move (the root holds what no block does): the sync
        # is timed unit by unit, never with a buffer of the whole model
        sizes = [sum(p.numel() for p in u.parameters() if p.requires_grad) for u in units]
        total = sum(p.numel() for p in module.parameters() if p.requires_grad)
        self.unit_numels = [n for n in (*sizes, total - sum(sizes)) if n > 0]
        # the bytes each unit's collectives move: parameters gathered in the compute dtype,
        # gradients reduced in the reduce dtype (without a policy: the parameters' own)
        own = next((p.dtype for p in module.parameters() if p.requires_grad), None)
        gather = getattr(policy, "param_dtype", None) or own
        reduce = getattr(policy, "reduce_dtype", None) or own
        self.unit_bytes = tuple(
            (n * _itemsize(gather), n * _itemsize(reduce)) for n in self.unit_numels
        )
        for unit in units:
            if tr.compile:  # per block, as torchtitan: FSDP's hooks stay outside the graphs
                unit.compile(mode=tr.compile_mode, dynamic=None if tr.dynamic else False)
        shard(module, units, self.mesh, policy or MixedPrecisionPolicy(),
              reshard_after_forward=self.reshard_after_forward)  # fmt: skip
        materialize(module, device, seed=self.seed)
        return module

    def data_parallel(self, module: Any) -> Any:
        return module  # sharded already: FSDP's hooks all-gather and reduce-scatter

    def no_sync(self, model: Any) -> contextlib.AbstractContextManager[Any]:
        """The context of a step's micro-batches but the last: no reduce-scatter with
        ``grad_sync: last`` (each rank accumulates its unsharded gradients), one per
        micro-batch with ``every``."""
        return gradient_sync_skipped(model, skip=self.grad_sync == "last")

    def timing_buffer(self, dtype: Any, device: Any) -> Any:
        """A buffer for :meth:`sync_gradients`: the largest unit's elements, padded to a
        multiple of the ranks (a rank never holds more of it at once in a step)."""
        import torch

        n = self.world_size
        return torch.zeros(-(-max(self.unit_numels) // n) * n, dtype=dtype, device=device)

    def sync_gradients(self, tensor: Any) -> None:
        """Once each unit's bytes as FSDP moves them, in ``tensor`` (:meth:`timing_buffer`):
        an all-gather of its parameters and a reduce-scatter of its gradients (together an
        all-reduce's traffic). A step with g micro-batches gathers 2g times: the plan
        (mbtune.plan) counts the collectives of a step from these."""
        import torch.distributed as dist

        n = self.world_size
        for numel in self.unit_numels:
            whole = tensor[: -(-numel // n) * n]
            shard = whole.new_empty(whole.numel() // n)
            dist.reduce_scatter_tensor(shard, whole)
            dist.all_gather_into_tensor(whole, shard)


class SimulatedShards(FullyShardedGroup):
    """Rank 0 of N alone (``trial.parallel: simulate`` with ``sharding: fsdp``), on torch's
    fake process group (:func:`fake_process_group`): its shard, memory and compute are
    real (the fake backend's all-gather fills every rank's part with this rank's shard, its
    reduce-scatter keeps this rank's part: the values stay finite), no collective takes any
    time, and FSDP's all-gathers and reduce-scatters are modelled from :attr:`unit_bytes`
    (mbtune.comm.fsdp_traffic), as one process models DDP's all-reduce. There is no
    one to agree with: a failure is the trial's result, as with ``OneProcess``."""

    simulated = True

    def agree(self, failure: BaseException | None, over: str | None = None) -> Verdict | None:
        return verdict(failure, over)

    def slowest(self, values: list[float]) -> list[float]:
        return list(values)

    def all_reduce(self, tensor: Any) -> None:
        pass  # one process: its own figures

    def sync_gradients(self, tensor: Any) -> None:
        pass  # modelled


@contextlib.contextmanager
def fake_process_group(world_size: int, *, who: str) -> Iterator[Any]:
    """A process group of ``world_size`` ranks, this process rank 0, with torch's ``fake``
    backend (no communication), and a CPU device mesh over it; torn down after. ``who``
    names what needs it, for the error where this process has a group already."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        raise MbtuneError(
            f"{who} runs rank 0 of N on a fake process group of its own, and this process "
            "already has a process group; run it from a process without one"
        )
    import torch.distributed.fsdp  # noqa: F401  (registers torch 2.13's fake backend)

    if not hasattr(dist.Backend, "FAKE"):
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (torch < 2.10)
    dist.init_process_group("fake", rank=0, world_size=world_size, store=dist.HashStore())
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()


def _itemsize(dtype: Any) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def shard(
    module: Any, units: list[Any], mesh: Any, policy: Any, *, reshard_after_forward: bool
) -> None:
    """FSDP2 over ``mesh``: each of ``units`` (:func:`shard_units`, inner first) a unit of
    its own, then the root, each with ``reshard_after_forward`` (FSDP2 keeps the root's
    parameters after the forward pass whatever it is told: the backward starts with them)."""
    from torch.distributed.fsdp import fully_shard

    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(module, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


@contextlib.contextmanager
def gradient_sync_skipped(model: Any, *, skip: bool = True) -> Iterator[None]:
    """A sharded model's backward passes in this context reduce-scatter no gradient
    (``set_requires_gradient_sync(False)``) where ``skip``, else as usual."""
    if not skip:
        yield
        return
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def mixed_precision(precision: str) -> Any:
    """FSDP2's policy for a resolved ``trial.precision``: parameters all-gathered in the
    compute dtype, gradients reduced in fp32; None for fp32 and tf32 (nothing to cast)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def shard_units(module: Any) -> list[Any]:
    """The submodules that become FSDP units of their own: the blocks the model names
    (``shard_blocks``, else a transformers model's ``_no_split_modules``), else its
    top-level children that hold parameters and share none with another child (a tied
    embedding stays with the root)."""
    names = getattr(module, SHARD_BLOCKS_ATTR, None) or getattr(module, "_no_split_modules", None)
    if names:
        names = (names,) if isinstance(names, str) else tuple(names)
        # FSDP shards a unit's children before the unit itself: post-order, inner first
        units = [m for m in _post_order(module) if m is not module and type(m).__name__ in names]
        if not units:
            raise MbtuneError(
                f"trial.sharding: {type(module).__name__} names its blocks "
                f"{', '.join(names)}, but has no submodule of that class; set "
                f"model.{SHARD_BLOCKS_ATTR} to the class name of its repeated block"
            )
        return units
    children = [c for c in module.children() if any(True for _ in c.parameters())]
    owners = Counter(id(p) for c in children for p in c.parameters())
    return [c for c in children if all(owners[id(p)] == 1 for p in c.parameters())]


def materialize(module: Any, device: Any, *, seed: int) -> None:
    """Give ``module``'s parameters (sharded, on the meta device) memory on ``device`` and
    the model's own initial values under ``seed``, whole parameter by whole parameter."""
    import torch

    module.to_empty(device=device)
    torch.manual_seed(seed)
    with torch.no_grad(), _whole_then_shard():
        _init_weights(module)


def _init_weights(module: Any) -> None:
    """The model's own init: ``init_weights()`` (the built-in gpt, a user model that has
    one), transformers' ``initialize_weights()``, else every ``reset_parameters()``."""
    if callable(getattr(module, "initialize_weights", None)) and hasattr(module, "_init_weights"):
        for m in module.modules():  # transformers skips what it marked as initialised
            m.__dict__.pop("_is_hf_initialized", None)
        module.initialize_weights()
    elif callable(getattr(module, "init_weights", None)):
        module.init_weights()
    else:
        for m in module.modules():
            if callable(getattr(m, "reset_parameters", None)):
                m.reset_parameters()


def _whole_then_shard() -> Any:
    """A dispatch mode in which a random fill of a sharded parameter draws the whole."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class WholeThenShard(TorchDispatchMode):
        """A random fill of a sharded parameter draws the whole parameter from torch's RNG
        (as the unsharded model would) and keeps this rank's shard of it."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            target = args[0] if args else None
            if func.overloadpacket.__name__ in _RANDOM_FILLS and isinstance(target, DTensor):
                import torch

                local = target.to_local()
                whole = torch.empty(target.shape, dtype=target.dtype, device=local.device)
                func(whole, *args[1:], **kwargs)
                # src_data_rank None: every rank cuts its own shard, no collective
                mine = distribute_tensor(
                    whole, target.device_mesh, target.placements, src_data_rank=None
                )
                local.copy_(mine.to_local())
                return target
            return func(*args, **kwargs)

    return WholeThenShard()


def _post_order(module: Any) -> list[Any]:
    """``module``'s submodules, each after its own children, siblings in their order."""
    out = []
    for child in module.children():
        out += _post_order(child)
    return [*out, module]
