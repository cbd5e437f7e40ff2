"""What model parallelism asks of a model: how it splits into pipeline stages, and which
of its linear layers a tensor-parallel plan shards.

A model offers a :class:`ParallelParts`: the built-in gpt (mbtune.models.gpt), a Llama-family
Hugging Face decoder (mbtune.models.hf) and a user model through its hooks
(mbtune.models.user). mbtune.trial.parallelize applies them, in torchtitan's order per stage:
the split, the tensor-parallel plan, activation checkpointing, compile, FSDP2.

A stage is a module of *copies* of the model's parts (torchtitan's ``pipeline_module_split``
deep-copies the model and drops what a stage does not hold): the first stage holds the
input embedding and takes stage 0's inputs, the last holds the final norm and head and
gives what the loss reads, each holds a run of consecutive blocks. A weight the whole model
ties (an embedding that is also the head) is a copy on the first stage and one on the last:
:attr:`ParallelParts.tied` names them, and the pipeline sums their gradients, as Megatron
all-reduces the embedding's, so the copies stay equal and train as the tied model does.
A stage made from a model on the meta device is a copy without memory; where the model
offers its init (:attr:`ParallelParts.init`) the rank materialises its stages' shards alone
and replays that init into them (mbtune.trial.rank_init).

The tensor-parallel plan maps module paths inside a stage (``*`` for any one name, as
``torch.distributed.tensor.parallel.parallelize_module`` reads them) to ``colwise`` (the
output features sharded: query, key and value projections, an MLP's first layers) or
``rowwise`` (the input features sharded, the output all-reduced: the projections back to
the model's width). A sharded attention must take its number of heads from its
projections' local width (``view(B, T, -1, head_dim)``), as the built-in gpt and
transformers' Llama do.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

__all__ = ["TP_STYLES", "ParallelParts"]

TP_STYLES = ("colwise", "rowwise")
"""The tensor-parallel styles a plan names (torch's ColwiseParallel and RowwiseParallel)."""


@dataclass(frozen=True, kw_only=True)
class ParallelParts:
    """How one model is split into pipeline stages and sharded by tensor parallelism."""

    num_blocks: int
    """The blocks the stages share out (each stage a run of ``num_blocks / stages``)."""
    make_stage: Callable[..., nn.Module] | None
    """``make_stage(start, stop, first=..., last=...)``: a new module of copies of blocks
    ``[start, stop)``, with the input embedding where ``first`` and the final norm and head
    where ``last``. Its forward takes stage 0's inputs (first) or the previous stage's
    output, and gives the next stage's input or (last) what :attr:`loss` reads. None: the
    model has no stages (a user model with a tensor-parallel plan alone): it is its own one
    stage, with its own loss."""
    io: Callable[[Any], tuple[tuple[torch.Tensor, ...], torch.Tensor]] | None
    """``io(batch) -> (inputs, target)``: stage 0's positional inputs and the loss's
    target, each with the samples along dimension 0 (the pipeline cuts them into
    micro-batches)."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    """``loss(output, target)``: a micro-batch's mean loss from the last stage's output, the
    one-process loss of the same samples."""
    tp_plan: Mapping[str, str] = field(default_factory=dict)
    """Module paths inside a stage -> ``colwise`` or ``rowwise`` (:data:`TP_STYLES`); empty:
    the model offers no tensor parallelism."""
    tp_divides: Mapping[str, int] = field(default_factory=dict)
    """What the tensor-parallel degree must divide, by name (``attention heads``: 12)."""
    tied: tuple[tuple[str, str], ...] = ()
    """Pairs (a first-stage parameter, a last-stage parameter) by their names in a stage,
    one weight in the whole model: their gradients are summed across the stages."""
    blocks_attr: str = "blocks"
    """The stage's ModuleList of blocks (each an FSDP unit, compiled on its own)."""
    init: Callable[[nn.Module], None] | None = None
    """``init(model)``: the whole model's initialisation as its one-process build draws it
    from torch's RNG (after the build's seed), run on the model built on the meta device;
    each stage then says which of the model's modules it copied (its ``copied_from``: stage
    path -> the model's path). With both a rank builds the model on the meta device and
    gives only its stages' shards memory and values (mbtune.trial.rank_init); None: the
    model is built whole on the CPU and the stages copy it."""
