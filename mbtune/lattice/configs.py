"""A configuration of the lattice (:class:`BatchConfig`) and the enumeration of a space's
configurations; the arithmetic is mbtune.lattice.arithmetic's."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mbtune.lattice.arithmetic import (
    GRAD_SYNCS,
    MAX_CONFIGS,
    SETTINGS,
    GradSync,
    LatticeError,
    PipelineSchedule,
    bubble_fraction,
    canonical_micro_batch_size,
    divisors,
    even_split,
    grad_accum_steps,
    is_strictly_valid,
    layout_rule,
    per_device_batch,
)

__all__ = ["BatchConfig", "as_flag", "enumerate_configs"]


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
    tensor_parallel: int = 1
    """t: the devices each layer's weights are split over (1: none)."""
    pipeline_parallel: int = 1
    """p: the pipeline's stages, each on its own devices (1: no pipeline)."""
    pipeline_schedule: PipelineSchedule = "1f1b"
    """:data:`PipelineSchedule`; ``1f1b`` without a pipeline, where no schedule runs."""

    def __post_init__(self) -> None:
        sizes = (self.batch_size, self.num_devices, self.micro_batch_size,
                 self.tensor_parallel, self.pipeline_parallel)  # fmt: skip
        if min(sizes) < 1:
            raise LatticeError(f"sizes must be positive, got {self}")
        if self.grad_sync not in GRAD_SYNCS:
            raise LatticeError(
                f"grad_sync {self.grad_sync!r} is not one of: {', '.join(GRAD_SYNCS)}"
            )
        t, p = self.tensor_parallel, self.pipeline_parallel
        problem = layout_rule(self.num_devices, t, p, self.pipeline_schedule)
        if problem:
            raise LatticeError(problem)
        if p == 1:  # no pipeline, no schedule: one name for it
            object.__setattr__(self, "pipeline_schedule", "1f1b")
        if self.batch_size < self.data_parallel:
            raise LatticeError(
                f"batch_size {self.batch_size} is smaller than num_devices {self.num_devices}"
                + (f" / (tensor_parallel {t} x pipeline_parallel {p})" if t * p > 1 else "")
            )

    @property
    def data_parallel(self) -> int:
        """d = n / (t x p): the replicas of the model, each with its share of B."""
        return self.num_devices // (self.tensor_parallel * self.pipeline_parallel)

    @property
    def layout(self) -> tuple[int, int, str]:
        """How the model is split, the values of :data:`LAYOUT` (t, p, schedule)."""
        return self.tensor_parallel, self.pipeline_parallel, self.pipeline_schedule

    @property
    def schedule_problem(self) -> str | None:
        """Why this configuration's pipeline schedule cannot run its micro-batches
        (Megatron's rules, :func:`layout_rule`), in words; None where it can."""
        return layout_rule(self.num_devices, *self.layout, self.grad_accum_steps)

    @property
    def bubble(self) -> float:
        """The share of a step's ideal time its pipeline idles, filling and draining with
        this configuration's micro-batches (Megatron's, by schedule: :func:`bubble_fraction`);
        0 without a pipeline."""
        return bubble_fraction(
            self.pipeline_parallel, self.grad_accum_steps, self.pipeline_schedule
        )

    @property
    def variant(self) -> tuple[Any, ...]:
        """Everything but B, n and m: the layout and the settings. Memory grows with the
        micro-batch on each variant's own scale."""
        return (*self.layout, *self.settings)

    def memory_variant(self, sharded: bool) -> tuple[Any, ...]:
        """The :attr:`variant` on whose scale memory grows with m. Sharded, a device that
        runs one micro-batch (g = 1) reduce-scatters its gradients in it, as
        ``grad_sync: every`` does, and accumulates no unsharded gradients (``last`` does,
        with more than one): ``every``'s scale, whichever it is named
        (:meth:`canonical` names it ``last``)."""
        if sharded and self.grad_accum_steps == 1:
            return dataclasses.replace(self, grad_sync="every").variant
        return self.variant

    @property
    def per_device_batch(self) -> int:
        """P = ceil(B / d): one replica's batch (each device's, without model parallelism)."""
        return per_device_batch(self.batch_size, self.data_parallel)

    @property
    def grad_accum_steps(self) -> int:
        return grad_accum_steps(self.per_device_batch, self.micro_batch_size)

    @property
    def device_batch_sizes(self) -> list[int]:
        """Samples of each replica: the even split of B over d."""
        return even_split(self.batch_size, self.data_parallel)

    @property
    def micro_batch_sizes(self) -> list[int]:
        """The micro-batches of the busiest replica (P samples): the even split of P."""
        return even_split(self.per_device_batch, self.grad_accum_steps)

    @property
    def canonical_micro_batch_size(self) -> int:
        """The largest micro-batch actually run; equal for every m with the same g."""
        return canonical_micro_batch_size(self.per_device_batch, self.micro_batch_size)

    @property
    def is_strict(self) -> bool:
        return is_strictly_valid(self.batch_size, self.data_parallel, self.micro_batch_size)

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
        """The same measurement, named by the micro-batch it really runs and, where a device
        runs one micro-batch (g = 1), by ``grad_sync: last``: its gradients are synchronised
        once, in that micro-batch's backward pass, whichever is set."""
        sync = "last" if self.grad_accum_steps == 1 else self.grad_sync
        return dataclasses.replace(
            self, micro_batch_size=self.canonical_micro_batch_size, grad_sync=sync
        )

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> BatchConfig:
        """From a mapping with the three sizes (ints, or text as read from a CSV) and, where
        it has them, ``activation_checkpointing`` and ``reshard_after_forward`` (a bool, or
        text: true/false), ``grad_sync`` (``last`` or ``every``), ``tensor_parallel``,
        ``pipeline_parallel`` and ``pipeline_schedule``; an empty cell is the default."""

        def text(key: str, default: str) -> Any:
            return str(data.get(key) or default).strip() or default

        return cls(
            int(data["batch_size"]),
            int(data["num_devices"]),
            int(data["micro_batch_size"]),
            as_flag(data.get("activation_checkpointing", False)),
            as_flag(data.get("reshard_after_forward", True), empty=True),
            text("grad_sync", "last"),
            int(float(text("tensor_parallel", "1"))),
            int(float(text("pipeline_parallel", "1"))),
            text("pipeline_schedule", "1f1b"),
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
        if self.tensor_parallel > 1:
            named["tensor_parallel"] = self.tensor_parallel
        if self.pipeline_parallel > 1:
            named["pipeline_parallel"] = self.pipeline_parallel
            named["pipeline_schedule"] = self.pipeline_schedule
        return named

    def as_dict(self) -> dict[str, Any]:
        """The three sizes, the settings, the layout, and what follows from them."""
        return {
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
            "data_parallel": self.data_parallel,
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
    layouts: Sequence[tuple[int, int, str]] = ((1, 1, "1f1b"),),
    limit: int = MAX_CONFIGS,
) -> list[BatchConfig]:
    """Every configuration a search may try, sorted by (n, t, p, B, m, schedule).

    ``mode`` is an explicit micro-batch size or one of :data:`MODES`.
    ``micro_batch_sizes`` is the space's list of m (None: not listed). ``layouts``: the
    (t, p, schedule) to split the model by; each runs on the device counts it divides
    (:func:`layout_rule`), with d = n / (t x p) replicas in place of n below, evenly only
    (Megatron's B = d x m x g) where t x p > 1, and with the micro-batches its schedule
    needs.

    With a fixed batch size (``batch_range`` false, ``batch_sizes`` the candidates):

    - int m: that m where (B, d, m) is strictly valid; with ``allow_uneven``, any B >= d
      with m <= P.
    - ``none``: m = P (no accumulation); B % d == 0 unless ``allow_uneven``.
    - ``auto``: the divisors of P (strictly valid only), restricted to the space's m.
    - ``explore``: every m of the space up to P (all of 1..P when the space lists none),
      divisible or not; replicas and micro-batches split evenly within one sample.

    With a batch range (``batch_range`` true, ``batch_sizes`` = (min, max)), B is free and
    follows from the rest as B = d x m x g, for every g >= 1 with B in range (strictly
    valid by construction); m comes from the space (int mode: the fixed m; ``none``:
    g = 1). The space must then list micro_batch_size unless the mode is an int.

    More than ``limit`` configurations is an error: no search could cover them.
    """
    configs: set[BatchConfig] = set()

    def add(batch: int, n: int, ms: Iterable[int], layout: tuple[int, int, str]) -> None:
        t, p, schedule = layout
        for m in ms:
            c = BatchConfig(batch, n, m, tensor_parallel=t, pipeline_parallel=p,
                            pipeline_schedule=schedule)  # type: ignore[arg-type]  # fmt: skip
            if not c.schedule_problem:
                configs.add(c)
        if len(configs) > limit:
            raise LatticeError(
                f"the space holds more than {limit} configurations; narrow its ranges"
            )

    for n in sorted(num_devices):
        for layout in layouts:
            t, p, _ = layout
            if n % (t * p):
                continue
            d, split = n // (t * p), t * p > 1
            if batch_range:
                _range_configs(batch_sizes, n, d, mode, micro_batch_sizes, layout, add)
                continue
            for b in batch_sizes:  # type: ignore[union-attr]
                if b >= d and (not split or b % d == 0):
                    ms = _fixed_batch_micro_sizes(
                        b, d, mode, micro_batch_sizes, allow_uneven and not split, limit
                    )
                    add(b, n, [m for m in ms if not split or (b // d) % m == 0], layout)
    return sorted(configs, key=_order)


def _range_configs(
    batch_sizes: Any, n: int, d: int, mode: int | str,
    micro_batch_sizes: Sequence[int] | None, layout: Any, add: Any,
) -> None:  # fmt: skip
    """A batch range's configurations of n devices, d replicas: B = d x m x g in range."""
    lo, hi = batch_sizes
    for m in sorted(_range_micro_sizes(mode, micro_batch_sizes)):
        step = d * m
        if step > hi:
            break
        g_max = 1 if mode == "none" else hi // step
        for g in range(max(1, -(-lo // step)), g_max + 1):
            add(step * g, n, [m], layout)


def _fixed_batch_micro_sizes(b: int, d: int, mode: int | str,
                             micro_batch_sizes: Sequence[int] | None, allow_uneven: bool,
                             limit: int) -> Iterable[int]:  # fmt: skip
    """The micro-batch sizes the mode runs for B over d replicas (see enumerate_configs)."""
    even = b % d == 0
    p = per_device_batch(b, d)
    if mode == "explore":
        if micro_batch_sizes is None and p > limit:
            raise LatticeError(
                f"explore over every micro_batch_size up to {p} is more than {limit} "
                "configurations; list micro_batch_size in the space"
            )
        ms = micro_batch_sizes if micro_batch_sizes is not None else range(1, p + 1)
        return [m for m in ms if m <= p]
    if not even and not allow_uneven:
        return []
    if mode == "none":
        return [p]
    if mode == "auto":
        ms = divisors(p) if even else []
        if micro_batch_sizes is not None:
            ms = [m for m in ms if m in set(micro_batch_sizes)]
        return ms
    return [mode] if (p % mode == 0 and even) or (allow_uneven and mode <= p) else []  # type: ignore[list-item,operator]


def _range_micro_sizes(mode: int | str, micro_batch_sizes: Sequence[int] | None) -> Sequence[int]:
    if isinstance(mode, int):
        return [mode]
    if micro_batch_sizes is None:
        raise LatticeError(
            f"a batch_size range needs micro_batch_size listed in the space in mode '{mode}'"
        )
    return micro_batch_sizes


def _order(c: BatchConfig) -> tuple[Any, ...]:
    return (c.num_devices, *c.layout[:2], c.batch_size, c.micro_batch_size, c.pipeline_schedule,
            *c.settings)  # fmt: skip
