"""The model as one rank holds it under tensor and pipeline parallelism.

A trial of ``num_devices = d x p x t`` ranks runs on one ``DeviceMesh`` of dimensions
(``dp``, ``pp``, ``tp``) (:class:`ParallelDims`). Each rank's share of the model is made
as torchtitan makes it, per stage (``models/llama3/infra/parallelize.py``):

1. **split**: the model, built on the meta device (:func:`rank_spec`), gives this rank's
   stages as modules of copies of its parts (mbtune.models.parallel.ParallelParts; the
   built-in gpt, a Llama-family ``hf:`` decoder, or a user model's hooks), none with memory
   yet. A rank holds one stage (gpipe, 1f1b), or two (v = 2): stages r and r + p
   (interleaved_1f1b, looped) or r and 2p - 1 - r (zbv, dualpipev: the V);
2. **tensor parallel** over ``tp``: the model's plan (colwise q/k/v and MLP-in, rowwise
   out-projections) with torch's ``parallelize_module``;
3. **activation checkpointing**: already on the blocks the stage copied (the model was
   built with it: mbtune.trial.step.build_spec);
4. **compile**: each block on its own (``trial.compile``), as a sharded trial does;
5. **data parallel** over ``dp``: FSDP2 with ``trial.sharding: fsdp`` (each block a unit,
   then the stage); with ``sharding: none`` and d > 1 FSDP2's ``replicate`` (the same units,
   each replica the whole stage, gradients all-reduced). Not DDP: on a pipeline stage it
   fails, or silently gives the last stage wrong gradients (torchtitan refuses DDP with more
   than one dimension too);
6. **materialise**: only now do the rank's stages, sharded, get memory (``to_empty``) and
   the values the whole model has in one process with the same seed, the model's own init
   replayed into them (mbtune.trial.rank_init): the host never holds the whole model. A user
   model, whose init mbtune cannot replay, is built whole on the CPU instead, its stages
   copies of it, and freed after the split.

fp16 is refused (:func:`model_parallel_problem`): its gradient scaler is not run across
stages and shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mbtune.config.experiment import Experiment
from mbtune.config.trial import TrialConfig
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig, stages_per_rank
from mbtune.models.parallel import ParallelParts
from mbtune.trial.precision import resolve
from mbtune.trial.rank_init import initialise_kept
from mbtune.trial.sharding import mixed_precision, shard, shard_units
from mbtune.trial.step import build_spec

__all__ = [
    "MESH_DIMS",
    "SCHEDULES",
    "ParallelDims",
    "RankModel",
    "build_rank_model",
    "model_parallel_problem",
    "model_parts",
    "rank_spec",
    "tensor_parallel",
]

MESH_DIMS = ("dp", "pp", "tp")
"""The trial's device mesh, outermost first: data parallel, pipeline, tensor parallel (the
ranks of one tensor-parallel group adjacent, as on one node's fast links)."""

SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
"""``trial.pipeline_schedule`` -> its class in ``torch.distributed.pipelining``."""

V_SCHEDULES = ("zbv", "dualpipev")
"""The schedules whose rank r holds stages r and 2p - 1 - r (the first and the last on
rank 0); the other schedules of two stages a rank hold r and r + p."""


@dataclass(frozen=True)
class ParallelDims:
    """A configuration's degrees: d x p x t ranks, and its pipeline schedule."""

    dp: int
    pp: int
    tp: int
    schedule: str = "1f1b"

    @classmethod
    def of(cls, config: BatchConfig) -> ParallelDims:
        return cls(config.data_parallel, config.pipeline_parallel, config.tensor_parallel,
                   config.pipeline_schedule)  # fmt: skip

    @property
    def stages_per_rank(self) -> int:
        """v: 2 for the interleaved and V schedules, else 1 (and 1 without a pipeline)."""
        return stages_per_rank(self.schedule) if self.pp > 1 else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def stage_indices(self, pp_rank: int) -> tuple[int, ...]:
        """The stages pipeline rank ``pp_rank`` holds, in stage order."""
        if self.stages_per_rank == 1:
            return (pp_rank,)
        if self.schedule in V_SCHEDULES:
            return (pp_rank, self.num_stages - 1 - pp_rank)
        return tuple(pp_rank + i * self.pp for i in range(self.stages_per_rank))

    def mesh(self, device_type: str) -> Any:
        """The (dp, pp, tp) mesh over the process group every rank has joined."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.dp, self.pp, self.tp), mesh_dim_names=MESH_DIMS)


def model_parallel_problem(trial: TrialConfig, config: BatchConfig) -> str | None:
    """Why a ``ddp`` trial of ``config`` cannot run with ``trial``'s settings, or None."""
    if (
        trial.precision == "fp16"
        and ParallelDims.of(config).num_stages * config.tensor_parallel > 1
    ):
        return (
            "trial.precision: fp16's gradient scaler is not run across pipeline stages or "
            "tensor-parallel shards; use bf16 (or fp32, tf32)"
        )
    return None


def model_parts(module: Any, dims: ParallelDims) -> ParallelParts:
    """How ``module`` splits and shards: the built-in gpt's, a transformers decoder's, or a
    user model's hooks (MbtuneError where it offers what ``dims`` needs none of)."""
    from mbtune.models.gpt import GPT, gpt_parts

    if isinstance(module, GPT):
        return gpt_parts(module)
    if type(module).__module__.startswith("transformers."):
        from mbtune.models.hf import hf_parts

        return hf_parts(module)
    from mbtune.models.user import user_parallel_parts

    return user_parallel_parts(module, pipeline=dims.pp > 1, tensor=dims.tp > 1)


@dataclass(frozen=True, kw_only=True)
class RankModel:
    """This rank's share of the model: its stages, each split, sharded and placed."""

    parts: ParallelParts
    stages: tuple[Any, ...]
    """This rank's stage modules, in stage order."""
    indices: tuple[int, ...]
    """Their stage numbers, of :attr:`num_stages`."""
    num_stages: int
    grad_bytes: int = 0
    """The bytes of this rank's parameters after tensor parallelism, before FSDP: what a
    data-parallel step synchronises of them (each at its own width)."""
    unit_bytes: tuple[tuple[int, int], ...] = ()
    """With FSDP, each unit's (all-gather, reduce-scatter) bytes of this rank's tensor-
    parallel shard, each stage's blocks then the stage (as mbtune.trial.sharding's)."""

    @property
    def has_first(self) -> bool:
        return 0 in self.indices

    @property
    def has_last(self) -> bool:
        return self.num_stages - 1 in self.indices

    def parameters(self) -> list[Any]:
        return [p for stage in self.stages for p in stage.parameters()]


def rank_spec(exp: Experiment, config: BatchConfig, dims: ParallelDims) -> Any:
    """The model a rank of a split trial starts from (its ModelSpec): built on the meta
    device where the model offers its init (the built-in gpt, a Llama-family decoder), so
    that :func:`build_rank_model` materialises only the rank's share; else built whole and
    seeded on the CPU (a user model), its stages copies of it."""
    try:
        spec = build_spec(exp, config, meta=True)
        if model_parts(spec.module, dims).init is not None:
            return spec
    except Exception:  # noqa: S110  (the build on the CPU says what is wrong, if anything)
        pass
    return build_spec(exp, config)


def build_rank_model(
    module: Any, dims: ParallelDims, mesh: Any, trial: TrialConfig, config: BatchConfig,
    device: Any, *, seed: int | None = None,
) -> RankModel:  # fmt: skip
    """This rank's stages of ``module``, in torchtitan's order: split, tensor parallel,
    (checkpointing, already on the blocks), compile, FSDP2, and, where ``module`` is on the
    meta device and ``device`` is not, materialised: the whole model's init under ``seed``
    replayed into the rank's shards (mbtune.trial.rank_init). A whole model on the CPU is
    copied and its memory given back (its parameters moved to the meta device); on the meta
    device with a meta ``device`` (the memory prediction) nothing gets memory."""
    parts = model_parts(module, dims)
    _check_degrees(parts, dims)
    on_meta = next(iter(module.parameters())).is_meta
    materialise = on_meta and device.type != "meta"
    if materialise and (parts.init is None or parts.make_stage is None or seed is None):
        raise MbtuneError(
            f"{type(module).__name__} was built on the meta device, but offers no init to "
            "give its stages their values: build it on the CPU (rank_spec)"
        )
    count = dims.num_stages
    indices = dims.stage_indices(mesh["pp"].get_local_rank())
    per = parts.num_blocks // count
    stages, grad_bytes, unit_bytes = [], 0, []
    for i in indices:
        if parts.make_stage is None:  # a user model with a plan alone: its own one stage
            stage = module
        else:
            stage = parts.make_stage(i * per, (i + 1) * per, first=i == 0, last=i == count - 1)
        stage.train()
        if not on_meta:  # on the meta device it stays there until sharded
            stage.to(device)
        if dims.tp > 1:
            tensor_parallel(stage, parts.tp_plan, mesh["tp"])
        blocks = _blocks(stage, parts)
        grad_bytes += _local_bytes(stage.parameters())
        if trial.compile:  # per block, as torchtitan: FSDP's hooks stay outside the graphs
            for block in blocks:
                block.compile(mode=trial.compile_mode, dynamic=None if trial.dynamic else False)
        if trial.sharding == "fsdp":
            from torch.distributed.fsdp import MixedPrecisionPolicy

            policy = mixed_precision(resolve(trial.precision, device))
            unit_bytes += _unit_bytes(stage, blocks, policy)
            shard(stage, blocks, mesh["dp"], policy or MixedPrecisionPolicy(),
                  reshard_after_forward=config.reshard_after_forward)  # fmt: skip
        elif dims.dp > 1:
            replicate(stage, blocks, mesh["dp"], mixed_precision(resolve(trial.precision, device)))
        stages.append(stage)
    if materialise:
        initialise_kept(module, stages, parts.init, device, seed=seed)
    elif parts.make_stage is not None:
        module.to("meta")  # the stages hold copies: the whole model's memory goes back
    return RankModel(parts=parts, stages=tuple(stages), indices=indices, num_stages=count,
                     grad_bytes=grad_bytes, unit_bytes=tuple(unit_bytes))  # fmt: skip


def replicate(stage: Any, blocks: list[Any], dp_mesh: Any, policy: Any) -> None:
    """``sharding: none`` with d > 1: each replica holds the whole stage, its gradients
    all-reduced over ``dp`` by FSDP2's ``replicate`` (a unit per block, then the stage), which
    a pipeline stage takes as it takes FSDP (DDP on a stage fails: the module's docstring).

    From torch's private ``_composable.replicate_with_fsdp``: torch 2.13 has no public
    equivalent. ``torch.distributed._composable.replicate`` (the package's own export) is
    the older DDP-based one. The public ``fully_shard(..., dp_mesh_dims=
    DataParallelMeshDims(replicate="dp"))`` replicates only parameters that are already
    DTensors on the mesh it is given: it refuses a plain parameter ("all parameters must be
    DTensors on the full SPMD mesh") and a tensor-parallel one on the ``tp`` sub-mesh
    ("Expected param's DTensor mesh to be the same mesh passed to fully_shard"), tried on 2
    and 4 gloo ranks. HSDP over a (dp, 1) mesh is public, but FSDP2 then all-gathers into a
    second copy of every parameter (no fast path for a shard group of 1: pytorch issue
    152710), memory a replica does not hold."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as replicated
    from torch.distributed.fsdp import MixedPrecisionPolicy

    for unit in (*blocks, stage):
        replicated(unit, mesh=dp_mesh, mp_policy=policy or MixedPrecisionPolicy())


def tensor_parallel(stage: Any, plan: dict[str, Any], tp_mesh: Any) -> None:
    """The model's plan over the ``tp`` mesh: ``colwise`` as torch's ColwiseParallel (the
    output features sharded, the input replicated), ``rowwise`` as RowwiseParallel (the
    input features sharded, the output all-reduced); plain tensors in and out."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(
        stage, tp_mesh, {path: styles[s]() if isinstance(s, str) else s for path, s in plan.items()}
    )


def _blocks(stage: Any, parts: ParallelParts) -> list[Any]:
    """The stage's blocks: each an FSDP unit and compiled on its own."""
    blocks = getattr(stage, parts.blocks_attr, None)
    if blocks is not None and len(blocks) > 0:
        return list(blocks)
    return shard_units(stage)


def _local_bytes(params: Any, dtype: Any = None) -> int:
    """The bytes of ``params`` as this rank holds them (a tensor-parallel DTensor's shard),
    each at ``dtype``'s width where given, else its own."""
    total = 0
    for p in params:
        if p.requires_grad:
            local = p.to_local() if hasattr(p, "to_local") else p
            size = local.element_size() if dtype is None else dtype.itemsize
            total += local.numel() * size
    return total


def _unit_bytes(stage: Any, blocks: list[Any], policy: Any) -> list[tuple[int, int]]:
    """Each FSDP unit's (all-gather, reduce-scatter) bytes: its parameters gathered in the
    policy's compute dtype, its gradients reduced in its reduce dtype (else their own)."""
    gather = getattr(policy, "param_dtype", None)
    reduce = getattr(policy, "reduce_dtype", None)
    held = {id(p) for block in blocks for p in block.parameters()}
    units = [list(block.parameters()) for block in blocks]
    units.append([p for p in stage.parameters() if id(p) not in held])  # the stage's root
    return [(_local_bytes(u, gather), _local_bytes(u, reduce)) for u in units if u]


def _check_degrees(parts: ParallelParts, dims: ParallelDims) -> None:
    """The model's rules for t and p (the lattice keeps them for the models it knows): t
    divides every width the plan shards, the stages share the blocks out evenly."""
    for what, size in parts.tp_divides.items():
        if size % dims.tp:
            raise MbtuneError(
                f"train_input.tensor_parallel: {dims.tp} does not divide the model's {size} "
                f"{what}; use a tensor_parallel that divides it"
            )
    if parts.num_blocks % dims.num_stages:
        v = f" x {dims.stages_per_rank} stages per rank ({dims.schedule})" * (
            dims.stages_per_rank > 1
        )
        raise MbtuneError(
            f"train_input.pipeline_parallel: {dims.pp}{v} = {dims.num_stages} stages do not "
            f"share the model's {parts.num_blocks} blocks evenly; use a pipeline_parallel "
            "whose stages divide them"
        )
