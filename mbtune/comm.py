"""A training step's collectives and what they cost over a link: the one model of them,
for the simulated trial (which models what one process cannot time), the plan (which
fits the link to a run's step times and predicts more devices) and the search model
(whose trend, where the trials shard, learns what a sharded step's collectives cost:
mbtune.recommend.gp).

A collective is counted as the ring runs it, as :class:`Traffic`: the bytes each device
sends over its link and the hops that each wait one link latency. Over n devices a ring
all-gather (or reduce-scatter) of a tensor of S bytes is n - 1 steps of S / n bytes:
``(n - 1) / n x S`` bytes and ``n - 1`` hops; an all-reduce is a reduce-scatter and then
an all-gather, twice that; a point-to-point send (a pipeline's activations) is S bytes and
one hop. Traffic adds up and multiplies by a count, so a step's collectives are one
Traffic, and its time is linear in the link's seconds per byte and seconds per hop::

    seconds = volume / bandwidth + hops x latency

which is what lets the plan fit a link to step times by least squares. Which collectives
a step runs (:func:`step_traffic`): data parallelism all-reduces the gradients once;
FSDP2 (``sharding: fsdp``) all-gathers each unit's parameters in every micro-batch's
forward pass and, with ``reshard_after_forward``, again in its backward (not the root's),
and reduce-scatters its gradients once a step (``grad_sync: last``) or once a micro-batch
(``every``). Beyond a node (:func:`two_tier_s`) the ring streams through both tiers at
once, so the slower sets the pace.

Pure: floats, or numpy arrays of draws (the plan's bootstrap) through numpy's minimum.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from mbtune.lattice import BatchConfig, stages_per_rank

__all__ = [
    "Link",
    "Traffic",
    "all_gather",
    "all_reduce",
    "fsdp_traffic",
    "pipeline_traffic",
    "reduce_scatter",
    "send",
    "tensor_parallel_traffic",
    "step_traffic",
    "two_tier_s",
]


@dataclass(frozen=True)
class Traffic:
    """Collectives as a ring runs them: ``volume``, the bytes each device sends over its
    link; ``hops``, the steps that each wait one link latency."""

    volume: float = 0.0
    hops: float = 0.0

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.volume + other.volume, self.hops + other.hops)

    def __mul__(self, count: float) -> Traffic:
        return Traffic(self.volume * count, self.hops * count)

    __rmul__ = __mul__

    def seconds(self, bandwidth: Any, latency_s: Any) -> Any:
        """The time over one link of ``bandwidth`` bytes/s and ``latency_s`` a hop (floats,
        or arrays of draws)."""
        return self.volume / bandwidth + self.hops * latency_s


def all_gather(nbytes: float, n: int) -> Traffic:
    """A ring all-gather of a tensor of ``nbytes`` (the whole, gathered) over n devices
    (nothing on one device, or of nothing)."""
    if n <= 1 or nbytes <= 0:
        return Traffic()
    return Traffic((n - 1) / n * nbytes, n - 1)


reduce_scatter = all_gather
"""A ring reduce-scatter moves what an all-gather of the same tensor moves."""


def all_reduce(nbytes: float, n: int) -> Traffic:
    """A ring all-reduce: a reduce-scatter, then an all-gather."""
    return 2 * all_gather(nbytes, n)


def send(nbytes: float) -> Traffic:
    """A point-to-point send of ``nbytes`` (a pipeline stage's activations or gradients)."""
    return Traffic(float(nbytes), 1)


def fsdp_traffic(units: Sequence[tuple[float, float]], config: BatchConfig) -> Traffic:
    """One step's FSDP2 collectives over ``config.num_devices``, unit by unit. ``units``:
    each FSDP unit's (all-gather bytes: its parameters in the compute dtype,
    reduce-scatter bytes: its gradients in the reduce dtype), the root last. Each of the
    step's g micro-batches all-gathers every unit in its forward pass and, with
    ``reshard_after_forward``, again in its backward (not the root's: FSDP2 keeps them for
    the backward); the gradients are reduce-scattered once a step (``grad_sync: last``) or
    once a micro-batch (``every``). A unit gathered once and reduce-scattered once moves
    an all-reduce's bytes."""
    n, g = config.data_parallel, config.grad_accum_steps
    scatters = g if config.grad_sync == "every" else 1
    total = Traffic()
    for i, (gather, scatter) in enumerate(units):
        root = i == len(units) - 1
        gathers = g * (2 if config.reshard_after_forward and not root else 1)
        total += gathers * all_gather(gather, n) + scatters * reduce_scatter(scatter, n)
    return total


def step_traffic(
    config: BatchConfig,
    *,
    grad_bytes: float,
    sharding: str = "none",
    units: Sequence[tuple[float, float]] | None = None,
) -> Traffic:
    """A data-parallel step's collectives over the d replicas: the gradients' all-reduce
    (``grad_bytes``, one device's: its stage's and shard's with model parallelism), or with
    ``sharding: fsdp`` FSDP2's (:func:`fsdp_traffic`) over ``units``; where the units are
    not known (a plan), the whole model as one unit beside an empty root."""
    if sharding != "fsdp":
        return all_reduce(grad_bytes, config.data_parallel)
    return fsdp_traffic(units if units else ((grad_bytes, grad_bytes), (0, 0)), config)


def tensor_parallel_traffic(config: BatchConfig, *, layers: float, activation_bytes: float,
                            ) -> Traffic:  # fmt: skip
    """One device's tensor-parallel collectives of a step (Megatron's): each of its stage's
    ``layers`` blocks all-reduces its activations over t twice in the forward pass (after
    attention and after the MLP) and twice in the backward, for each of the g
    micro-batches; ``activation_bytes``: one sample's activations between blocks. With
    sequence parallelism they are reduce-scatters and all-gathers of the same volume."""
    t, g, m = config.tensor_parallel, config.grad_accum_steps, config.micro_batch_size
    return 4 * layers * g * all_reduce(m * activation_bytes, t)


def pipeline_traffic(config: BatchConfig, *, activation_bytes: float) -> Traffic:
    """One stage's point-to-point traffic of a step: for each micro-batch and each of its
    v chunks (lattice.stages_per_rank), the activations sent on in the forward pass and
    their gradients sent back in the backward (``activation_bytes``: one sample's, between
    blocks), in its tensor-parallel shard (each of t devices sends 1/t of them)."""
    if config.pipeline_parallel <= 1:
        return Traffic()
    v = stages_per_rank(config.pipeline_schedule)
    each = config.micro_batch_size * activation_bytes / config.tensor_parallel
    return 2 * v * config.grad_accum_steps * send(each)


@dataclass(frozen=True)
class Link:
    """One tier's link: bytes/s and seconds per hop (floats, or arrays over draws)."""

    bandwidth: Any
    latency_s: Any


def two_tier_s(traffic: Traffic, n: int, per_node: int, intra: Link, inter: Link) -> Any:
    """``traffic`` over n devices, ``per_node`` to a node. Within a node, the intra-node
    link. Across nodes the ring's steps stream through both tiers at once (NCCL pipelines
    them), so the slower one sets the pace: the intra-node bandwidth, or a node's k devices
    leaving it each on its own link (k x the inter-node bandwidth, what nccl-tests' bus
    bandwidth across nodes shows); and a hop waits on the slower tier's latency. Crossing
    a node therefore never makes a byte or a hop cheaper than within one."""
    if n <= per_node:
        return traffic.seconds(intra.bandwidth, intra.latency_s)
    bus = np.minimum(intra.bandwidth, per_node * inter.bandwidth)
    return traffic.seconds(bus, np.maximum(intra.latency_s, inter.latency_s))
