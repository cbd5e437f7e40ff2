"""The batch lattice: which (batch_size, num_devices, micro_batch_size) can run, and how.

Pure integer arithmetic (no torch, no ray), in the vocabulary of docs/design.md:

    B  batch_size         global batch, samples per optimizer step, all devices together
    n  num_devices        data-parallel devices
    P  per_device_batch   ceil(B / n); devices differ by at most one sample
    m  micro_batch_size   samples in one forward/backward pass on one device
    g  grad_accum_steps   ceil(P / m); micro-batches differ by at most one sample

A configuration is *strictly valid* (what Cerebras requires of an explicit
micro_batch_size) when B >= n, B % n == 0 and (B / n) % m == 0. Uneven splits are
allowed only where the mode or ``allow_uneven`` says so. The rules in words, for a person,
with the nearest values that keep them, are mbtune.config.train_input's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from mbtune.errors import MbtuneError

__all__ = [
    "GRAD_SYNCS",
    "MAX_CONFIGS",
    "MODES",
    "SETTINGS",
    "BatchConfig",
    "GradSync",
    "as_flag",
    "LatticeError",
    "bubble_fraction",
    "canonical_micro_batch_size",
    "divisors",
    "enumerate_configs",
    "even_split",
    "grad_accum_steps",
    "is_strictly_valid",
    "nearest_valid_batch_sizes",
    "per_device_batch",
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
# pipeline parallelism (Megatron's bubble)


def bubble_fraction(pipeline_stages: int, microbatches: int) -> float:
    """The idle share of a pipeline step: (p - 1) / number of micro-batches."""
    return (pipeline_stages - 1) / microbatches


# ---------------------------------------------------------------------------
# configurations


@dataclass(frozen=True, order=True)
class BatchConfig:
    """One point of the lattice: (batch_size, num_devices, micro_batch_size), and how a step
    runs it: whether the model recomputes its blocks' activations in the backward pass
    (compute for memory), and, for a sharded model (``trial.sharding: fsdp``), whether each
    block's parameters are freed after the forward pass (``reshard_after_forward``: memory
    for all-gather traffic) and when gradients are synchronised (``grad_sync``). Each is a
    further dimension of the search where the space lists it (:attr:`settings`)."""

    batch_size: int
    num_devices: int
    micro_batch_size: int
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True
    """FSDP2's ``reshard_after_forward``: true (its default; ZeRO-3-like) frees each block's
    gathered parameters after its forward pass and gathers them again for the backward;
    false (ZeRO-2-like) keeps them. True, and of no effect, without sharding."""
    grad_sync: GradSync = "last"
    """:data:`GradSync`: ``last`` (the default, what a step without sharding does too) or
    ``every``."""

    def __post_init__(self) -> None:
        if min(self.batch_size, self.num_devices, self.micro_batch_size) < 1:
            raise LatticeError(f"sizes must be positive, got {self}")
        if self.batch_size < self.num_devices:
            raise LatticeError(
                f"batch_size {self.batch_size} is smaller than num_devices {self.num_devices}"
            )
        if self.grad_sync not in GRAD_SYNCS:
            raise LatticeError(
                f"grad_sync {self.grad_sync!r} is not one of: {', '.join(GRAD_SYNCS)}"
            )

    @property
    def per_device_batch(self) -> int:
        return per_device_batch(self.batch_size, self.num_devices)

    @property
    def grad_accum_steps(self) -> int:
        return grad_accum_steps(self.per_device_batch, self.micro_batch_size)

    @property
    def device_batch_sizes(self) -> list[int]:
        """Samples on each device: the even split of B over n."""
        return even_split(self.batch_size, self.num_devices)

    @property
    def micro_batch_sizes(self) -> list[int]:
        """The micro-batches run on the busiest device (P samples): the even split of P."""
        return even_split(self.per_device_batch, self.grad_accum_steps)

    @property
    def canonical_micro_batch_size(self) -> int:
        """The largest micro-batch actually run; equal for every m with the same g."""
        return canonical_micro_batch_size(self.per_device_batch, self.micro_batch_size)

    @property
    def is_strict(self) -> bool:
        return is_strictly_valid(self.batch_size, self.num_devices, self.micro_batch_size)

    @property
    def settings(self) -> tuple[Any, ...]:
        """How a step runs, beside the sizes: the values of :data:`SETTINGS`
        (activation_checkpointing, reshard_after_forward, grad_sync). Memory grows with the
        micro-batch on each combination's own scale."""
        return tuple(getattr(self, key) for key in SETTINGS)

    def with_settings(self, settings: Sequence[Any]) -> BatchConfig:
        """The same sizes with ``settings``: values of :data:`SETTINGS`, in its order."""
        return dataclasses.replace(self, **dict(zip(SETTINGS, settings, strict=True)))

    def canonical(self) -> BatchConfig:
        """The same measurement, named by the micro-batch it really runs."""
        return dataclasses.replace(self, micro_batch_size=self.canonical_micro_batch_size)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> BatchConfig:
        """From a mapping with the three sizes (ints, or text as read from a CSV) and, where
        it has them, ``activation_checkpointing`` and ``reshard_after_forward`` (a bool, or
        text: true/false) and ``grad_sync`` (``last`` or ``every``); an empty cell is the
        default."""
        return cls(
            int(data["batch_size"]),
            int(data["num_devices"]),
            int(data["micro_batch_size"]),
            as_flag(data.get("activation_checkpointing", False)),
            as_flag(data.get("reshard_after_forward", True), empty=True),
            str(data.get("grad_sync") or "last").strip() or "last",  # type: ignore[arg-type]
        )

    @classmethod
    def of(cls, record: Any) -> BatchConfig:
        """The configuration a record measured: one with this class's fields as
        attributes (a trial's result, a trials.csv row)."""
        return cls(*(getattr(record, f.name) for f in dataclasses.fields(cls)))

    def sizes(self) -> dict[str, Any]:
        """What names the configuration: the three sizes, and each setting where it is not
        its default (so that a configuration without them reads as it always has)."""
        named: dict[str, Any] = {
            "batch_size": self.batch_size,
            "num_devices": self.num_devices,
            "micro_batch_size": self.micro_batch_size,
        }
        if self.activation_checkpointing:
            named["activation_checkpointing"] = True
        if not self.reshard_after_forward:
            named["reshard_after_forward"] = False
        if self.grad_sync != "last":
            named["grad_sync"] = self.grad_sync
        return named

    def as_dict(self) -> dict[str, Any]:
        """The three sizes, the settings, and what follows from them."""
        return {
            "batch_size": self.batch_size,
            "num_devices": self.num_devices,
            "micro_batch_size": self.micro_batch_size,
            "activation_checkpointing": self.activation_checkpointing,
            "reshard_after_forward": self.reshard_after_forward,
            "grad_sync": self.grad_sync,
            "per_device_batch": self.per_device_batch,
            "grad_accum_steps": self.grad_accum_steps,
        }


def as_flag(value: Any, *, empty: bool = False) -> bool:
    """A yes/no as a mapping or a CSV cell holds it: a bool, or the text true/false/1/0;
    ``empty``: what an empty cell means."""
    if isinstance(value, str):
        text = value.strip().lower()
        if text in ("true", "1", "yes"):
            return True
        if text in ("false", "0", "no"):
            return False
        if not text:
            return empty
        raise ValueError(f"expected true or false, got {value!r}")
    return bool(value)


def enumerate_configs(
    *,
    mode: int | str,
    batch_sizes: Iterable[int] | tuple[int, int],
    num_devices: Sequence[int],
    micro_batch_sizes: Sequence[int] | None = None,
    batch_range: bool = False,
    allow_uneven: bool = False,
    limit: int = MAX_CONFIGS,
) -> list[BatchConfig]:
    """Every configuration a search may try, sorted by (n, B, m).

    ``mode`` is an explicit micro-batch size or one of :data:`MODES`.
    ``micro_batch_sizes`` is the space's list of m (None: not listed).

    With a fixed batch size (``batch_range`` false, ``batch_sizes`` the candidates):

    - int m: that m where (B, n, m) is strictly valid; with ``allow_uneven``, any B >= n
      with m <= P.
    - ``none``: m = P (no accumulation); B % n == 0 unless ``allow_uneven``.
    - ``auto``: the divisors of P (strictly valid only), restricted to the space's m.
    - ``explore``: every m of the space up to P (all of 1..P when the space lists none),
      divisible or not; devices and micro-batches split evenly within one sample.

    With a batch range (``batch_range`` true, ``batch_sizes`` = (min, max)), B is free and
    follows from the rest as B = n x m x g, for every g >= 1 with B in range (strictly
    valid by construction); m comes from the space (int mode: the fixed m; ``none``:
    g = 1). The space must then list micro_batch_size unless the mode is an int.

    More than ``limit`` configurations is an error: no search could cover them.
    """
    configs: set[BatchConfig] = set()

    def add(batch: int, n: int, ms: Iterable[int]) -> None:
        configs.update(BatchConfig(batch, n, m) for m in ms)
        if len(configs) > limit:
            raise LatticeError(
                f"the space holds more than {limit} configurations; narrow its ranges"
            )

    if batch_range:
        lo, hi = batch_sizes  # type: ignore[misc]
        for n in sorted(num_devices):
            for m in sorted(_range_micro_sizes(mode, micro_batch_sizes)):
                step = n * m
                if step > hi:
                    break
                g_max = 1 if mode == "none" else hi // step
                for g in range(max(1, -(-lo // step)), g_max + 1):
                    add(step * g, n, [m])
        return sorted(configs, key=_order)

    for n in num_devices:
        for b in batch_sizes:
            if b < n:
                continue
            even = b % n == 0
            p = per_device_batch(b, n)
            if mode == "explore":
                if micro_batch_sizes is None and p > limit:
                    raise LatticeError(
                        f"explore over every micro_batch_size up to {p} is more than {limit} "
                        "configurations; list micro_batch_size in the space"
                    )
                ms = micro_batch_sizes if micro_batch_sizes is not None else range(1, p + 1)
                ms = [m for m in ms if m <= p]
            elif not even and not allow_uneven:
                continue
            elif mode == "none":
                ms = [p]
            elif mode == "auto":
                ms = divisors(p) if even else []
                if micro_batch_sizes is not None:
                    ms = [m for m in ms if m in set(micro_batch_sizes)]
            else:
                ms = [mode] if (p % mode == 0 and even) or (allow_uneven and mode <= p) else []
            add(b, n, ms)
    return sorted(configs, key=_order)


def _range_micro_sizes(mode: int | str, micro_batch_sizes: Sequence[int] | None) -> Sequence[int]:
    if isinstance(mode, int):
        return [mode]
    if micro_batch_sizes is None:
        raise LatticeError(
            f"a batch_size range needs micro_batch_size listed in the space in mode '{mode}'"
        )
    return micro_batch_sizes


def _order(c: BatchConfig) -> tuple[Any, ...]:
    return (c.num_devices, c.batch_size, c.micro_batch_size, *c.settings)
