"""The lattice's arithmetic: the rules of (B, n, m) and of a layout (t, p, schedule), the
splits, the nearest valid values, the pipeline's bubble; the names and vocabulary are the
package's (mbtune.lattice). Pure integers."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

from mbtune.errors import MbtuneError

__all__ = [
    "GRAD_SYNCS",
    "LAYOUT",
    "MAX_CONFIGS",
    "MODES",
    "PIPELINE_SCHEDULES",
    "SETTINGS",
    "GradSync",
    "LatticeError",
    "ModelShape",
    "PipelineSchedule",
    "bubble_fraction",
    "canonical_micro_batch_size",
    "divisors",
    "even_split",
    "grad_accum_steps",
    "is_strictly_valid",
    "layout_rule",
    "model_rule",
    "nearest_valid_batch_sizes",
    "per_device_batch",
    "stages_per_rank",
    "valid_micro_batch_sizes",
    "valid_num_devices",
]

MODES = ("auto", "explore", "none")
"""The named micro-batch modes; a positive int is the fourth (explicit) mode."""

GradSync = Literal["last", "every"]
"""When a step's gradients are synchronised across the devices: ``last``, once, in the
backward pass of its last micro-batch (the others accumulate locally: DDP's ``no_sync``,
FSDP2's ``set_requires_gradient_sync(False)``), or ``every``, in each micro-batch's (with
sharding, each micro-batch's gradients are reduce-scattered and freed: less memory for
more traffic)."""
GRAD_SYNCS: tuple[str, ...] = get_args(GradSync)

SETTINGS = ("activation_checkpointing", "reshard_after_forward", "grad_sync")
"""How a step runs a configuration, beside its sizes (:attr:`BatchConfig.settings`)."""

PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zbv", "dualpipev"]
"""How a pipeline orders its micro-batches' passes (torch.distributed.pipelining's
ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZBVZeroBubble,
ScheduleDualPipeV)."""
PIPELINE_SCHEDULES: tuple[str, ...] = get_args(PipelineSchedule)

LAYOUT = ("tensor_parallel", "pipeline_parallel", "pipeline_schedule")
"""How the model is split over a replica's devices (:attr:`BatchConfig.layout`)."""

MAX_CONFIGS = 100_000
"""A space larger than this is refused: no search could cover it."""


class LatticeError(MbtuneError):
    """A configuration breaks a rule of the lattice; the message names rule and numbers."""


# ---------------------------------------------------------------------------
# splits


def even_split(total: int, parts: int) -> list[int]:
    """Spread ``total`` samples over ``parts`` so that sizes differ by at most one.

    The larger parts come first: ``even_split(10, 3) == [4, 3, 3]``.
    """
    if parts < 1:
        raise LatticeError(f"cannot split {total} samples into {parts} parts: parts must be >= 1")
    if total < parts:
        raise LatticeError(f"cannot split {total} samples into {parts} non-empty parts")
    q, r = divmod(total, parts)
    return [q + 1] * r + [q] * (parts - r)


def per_device_batch(batch_size: int, num_devices: int) -> int:
    """P = ceil(B / n): the largest share of the global batch on one device."""
    return -(-batch_size // num_devices)


def grad_accum_steps(per_device: int, micro_batch_size: int) -> int:
    """g = ceil(P / m): forward/backward passes per optimizer step."""
    return -(-per_device // micro_batch_size)


def canonical_micro_batch_size(per_device: int, micro_batch_size: int) -> int:
    """The largest micro-batch actually run when P is spread evenly over ceil(P / m).

    Every m with the same ceil(P / m) runs identical micro-batches, so they are one
    measurement; this is its representative. ``canonical_micro_batch_size(8, 5) == 4``.
    """
    return per_device_batch(per_device, grad_accum_steps(per_device, micro_batch_size))


def divisors(k: int) -> list[int]:
    """The positive divisors of ``k`` in increasing order."""
    small, large = [], []
    for d in range(1, math.isqrt(k) + 1):
        if k % d == 0:
            small.append(d)
            if d != k // d:
                large.append(k // d)
    return small + large[::-1]


# ---------------------------------------------------------------------------
# strict validity


def is_strictly_valid(batch_size: int, num_devices: int, micro_batch_size: int) -> bool:
    """B >= n, B % n == 0 and (B / n) % m == 0 (all positive)."""
    if min(batch_size, num_devices, micro_batch_size) < 1 or batch_size < num_devices:
        return False
    return batch_size % num_devices == 0 and (batch_size // num_devices) % micro_batch_size == 0


def valid_micro_batch_sizes(batch_size: int, num_devices: int) -> list[int]:
    """Every m for which (B, n, m) is strictly valid: the divisors of B / n."""
    if batch_size < num_devices or batch_size % num_devices:
        return []
    return divisors(batch_size // num_devices)


def valid_num_devices(batch_size: int, micro_batch_size: int | None = None) -> list[int]:
    """Every n for which (B, n, m) is strictly valid: the divisors of B / m (of B where m is
    not fixed); none where m does not divide B."""
    m = micro_batch_size or 1
    return divisors(batch_size // m) if batch_size % m == 0 else []


def nearest_valid_batch_sizes(
    batch_size: int, num_devices: int, micro_batch_size: int, *, allow_uneven: bool = False
) -> tuple[int | None, int]:
    """The nearest valid batch sizes for (n, m) at or below and at or above ``batch_size``.

    Strictly valid batch sizes for (n, m) are the positive multiples of n * m. With
    ``allow_uneven`` every B >= n with m <= ceil(B / n) is valid: every B from
    max(n, n * (m - 1) + 1) on. Below is None when no valid one exists. When
    ``batch_size`` is itself valid, both are it.
    """
    n, m = num_devices, micro_batch_size
    if allow_uneven:
        smallest = max(n, n * (m - 1) + 1)
        return (batch_size, batch_size) if batch_size >= smallest else (None, smallest)
    step = n * m
    below = (batch_size // step) * step
    above = -(-batch_size // step) * step
    return (below if below > 0 else None), max(above, step)


# ---------------------------------------------------------------------------
# model parallelism: Megatron's rules and the pipeline's bubble


def stages_per_rank(schedule: str) -> int:
    """v: the model chunks (stages) one pipeline rank holds: 2 for the interleaved and V
    schedules, 1 for gpipe and 1f1b."""
    return 1 if schedule in ("gpipe", "1f1b") else 2


def bubble_fraction(pipeline_parallel: int, microbatches: int, schedule: str = "1f1b") -> float:
    """The idle share of a pipeline step, relative to its ideal (bubble-free) time:
    (p - 1) / g for gpipe and 1f1b, (p - 1) / (v g) interleaved (Megatron); the zero-bubble
    schedules (zbv, dualpipev) split the backward into its input and weight halves and fill
    the fill/drain slots with the latter: with the forward, the input and the weight
    gradient one third of a pass each, a third of the interleaved bubble is left."""
    p, g = pipeline_parallel, microbatches
    if p <= 1:
        return 0.0
    bubble = (p - 1) / (stages_per_rank(schedule) * g)
    return bubble / 3 if schedule in ("zbv", "dualpipev") else bubble


def layout_rule(
    num_devices: int, tensor_parallel: int, pipeline_parallel: int, schedule: str,
    microbatches: int | None = None,
) -> str | None:  # fmt: skip
    """Why (n, t, p, schedule) and g micro-batches (None: not yet known) cannot run, in
    words; None where they can. Megatron's rules: n % (t x p) == 0; the pipeline's schedule
    needs g >= p (1f1b), g a multiple of p (interleaved_1f1b), g >= 2p (dualpipev)."""
    n, t, p, g = num_devices, tensor_parallel, pipeline_parallel, microbatches
    if schedule not in PIPELINE_SCHEDULES:
        return f"pipeline_schedule {schedule!r} is not one of: {', '.join(PIPELINE_SCHEDULES)}"
    if n % (t * p):
        return (
            f"num_devices {n} is not a multiple of tensor_parallel {t} x pipeline_parallel "
            f"{p} = {t * p}"
        )
    if p == 1 or g is None:
        return None
    need = {"1f1b": (p, "at least"), "dualpipev": (2 * p, "at least")}.get(schedule)
    if need and g < need[0]:
        return (
            f"{schedule} with pipeline_parallel {p} needs {need[1]} {need[0]} micro-batches "
            f"per step, and this configuration has {g}"
        )
    if schedule == "interleaved_1f1b" and g % p:
        return (
            f"interleaved_1f1b needs the micro-batches per step ({g}) to be a multiple of "
            f"pipeline_parallel {p}"
        )
    return None


@dataclass(frozen=True)
class ModelShape:
    """What Megatron's rules need of a model: its repeated blocks (layers), attention heads,
    key/value heads, MLP width and vocabulary (None: the model has no such part, or did not
    say)."""

    layers: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    mlp_width: int | None = None
    vocab: int | None = None
    """Only where the tensor-parallel plan splits the head's columns (a
    vocabulary-parallel loss); None where the head stays whole."""
    hidden: int | None = None
    """The width of what passes between blocks (one token's activation): what a pipeline
    sends and a tensor-parallel block all-reduces."""


def model_rule(tensor_parallel: int, pipeline_parallel: int, schedule: str,
               shape: ModelShape) -> str | None:  # fmt: skip
    """Why the model of ``shape`` cannot be split so, in words; None where it can: t
    divides the heads, the key/value heads, the MLP width and, where the head is split by
    columns, the vocabulary; and p x v divides the layers (v: :func:`stages_per_rank`)."""
    t, p = tensor_parallel, pipeline_parallel
    if t > 1:
        for name, size in (("attention heads", shape.heads), ("key/value heads", shape.kv_heads),
                           ("MLP width", shape.mlp_width),
                           ("vocabulary (its head is split by columns)", shape.vocab)):  # fmt: skip
            if size is not None and size % t:
                return f"tensor_parallel {t} does not divide the model's {size} {name}"
        if shape.heads is None:
            return f"tensor_parallel {t} needs a model whose attention heads are known"
    if p > 1:
        stages = p * stages_per_rank(schedule)
        if shape.layers is None:
            return f"pipeline_parallel {p} needs a model whose blocks are known"
        if shape.layers % stages:
            v = f" x {stages // p} stages per rank ({schedule})" if stages > p else ""
            return (
                f"pipeline_parallel {p}{v} = {stages} stages does not divide the model's "
                f"{shape.layers} layers"
            )
    return None
