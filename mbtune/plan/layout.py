"""A layout's step collectives, placed on the tiers of a cluster as Megatron orders its
ranks: tensor parallel innermost, then data parallel, then the pipeline.

One device of a configuration with tensor parallelism t, pipeline parallelism p and d
replicas runs three kinds of traffic (counted by mbtune.comm, as the simulated trial
counts them):

- the data-parallel sync of its own gradients (its stage's and shard's: grad_bytes / (t p))
  over the d replicas;
- the tensor-parallel all-reduces of its blocks' activations over t (Megatron's four a
  block a micro-batch);
- the pipeline's sends of activations and their gradients to the next and previous stage.

The last two do not change with d: a layout measured at any d says them. Where each runs:
the t devices of a tensor-parallel group are consecutive ranks, inside one node where
t <= per_node; a data-parallel ring takes every t-th rank, so it leaves the node where
t x d > per_node (then per_node / t of its devices share a node, each on its own link);
the pipeline's stages are blocks of t x d ranks, so a stage sends to another node where
t x d >= per_node (one device's link: the inter-node tier). Each over its tier's link
(:func:`mbtune.comm.two_tier_s`). Pure: numpy through mbtune.comm.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mbtune.comm import (
    Link,
    Traffic,
    pipeline_traffic,
    step_traffic,
    tensor_parallel_traffic,
    two_tier_s,
)
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig, ModelShape
from mbtune.runs.record import TrialRecord

__all__ = ["Activations", "Parts", "activations_of", "layout_traffic", "placed_s"]


@dataclass(frozen=True)
class Activations:
    """What a split model's tensor-parallel and pipeline traffic is counted from."""

    sample_bytes: float
    """One sample's activations between blocks: tokens x hidden x the element's bytes."""
    layers: int
    """The model's blocks (a stage holds layers / p of them)."""


@dataclass(frozen=True)
class Parts:
    """One device's traffic of a step, by kind (each placed on its own tier)."""

    data: Traffic
    tensor: Traffic
    pipeline: Traffic

    @property
    def total(self) -> Traffic:
        """All of it, as one link within a node carries it."""
        return self.data + self.tensor + self.pipeline

    def data_only(self, *, bytes_only: bool = False) -> Parts:
        """The data-parallel sync alone (its bytes alone, no hops, with ``bytes_only``):
        what grows with d, and what the measured link floors past the measured counts."""
        return Parts(Traffic(self.data.volume) if bytes_only else self.data, Traffic(), Traffic())


def activations_of(shape: ModelShape | None, records: Sequence[TrialRecord]) -> Activations:
    """One sample's activation bytes between blocks, as the simulated trial counts them:
    the model's ``hidden`` x the tokens of one sample (the run's split trials' tokens/s over
    samples/s; 1 where they counted none) x 2 bytes where they ran in bf16 or fp16, else 4.
    A model whose shape does not say its width and blocks is refused."""
    if shape is None or shape.hidden is None or shape.layers is None:
        raise MbtuneError(
            "plan: the run split its model (tensor_parallel or pipeline_parallel > 1), and "
            "the plan counts the traffic of a split model from the model's block width "
            "(hidden) and layers, which this model does not say; set its mbtune_shape "
            "(docs/model_parallel.md)"
        )
    split = [r for r in records if r.status == "ok" and r.config.layout[:2] != (1, 1)]
    tokens = [r.tokens_per_s / r.samples_per_s for r in split
              if r.tokens_per_s and r.samples_per_s]  # fmt: skip
    precisions = [r.precision for r in split if r.precision]
    common = max(set(precisions), key=precisions.count) if precisions else None
    itemsize = 2 if common in ("bf16", "fp16") else 4
    per_sample = statistics.median(tokens) if tokens else 1
    return Activations(per_sample * shape.hidden * itemsize, shape.layers)


def layout_traffic(
    config: BatchConfig, *, grad_bytes: float, sharding: str, activations: Activations | None
) -> Parts:
    """One device's step traffic of ``config``: its gradients' data-parallel sync over d,
    and where the model is split, its tensor-parallel all-reduces and pipeline sends."""
    share = config.tensor_parallel * config.pipeline_parallel
    data = step_traffic(config, grad_bytes=grad_bytes / share, sharding=sharding)
    if share == 1:
        return Parts(data, Traffic(), Traffic())
    if activations is None:
        raise MbtuneError("plan: a split layout's traffic needs the model's activations")
    each = activations.sample_bytes
    layers = activations.layers / config.pipeline_parallel
    tensor = tensor_parallel_traffic(config, layers=layers, activation_bytes=each)
    return Parts(data, tensor, pipeline_traffic(config, activation_bytes=each))


def placed_s(config: BatchConfig, parts: Parts, per_node: int, intra: Link, inter: Link) -> Any:
    """The seconds of ``parts`` with each kind over its tier (the module's docstring):
    floats, or arrays over the draws of the links."""
    t, d = config.tensor_parallel, config.data_parallel
    data = two_tier_s(parts.data, d, max(1, per_node // t), intra, inter)
    tensor = two_tier_s(parts.tensor, t, per_node, intra, inter)
    crosses = t * d >= per_node and config.pipeline_parallel > 1
    pipeline = two_tier_s(parts.pipeline, 2 if crosses else 1, 1, intra, inter)
    return data + tensor + pipeline
