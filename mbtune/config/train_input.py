"""The train_input section, ``train_input:``: the user's own configuration (the batch, the
devices and the micro-batch mode), the reference for "faster than yours"; and the lattice's
rules as a person reads them: the rule a size breaks, both numbers, and the nearest values
that keep every rule (mbtune.lattice's arithmetic), raised as LatticeError and reported at
the field that broke it (:func:`lattice_rule`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

from mbtune import lattice
from mbtune.config.rules import ConfigError, check_fields, number
from mbtune.lattice import (
    BatchConfig,
    LatticeError,
    nearest_valid_batch_sizes,
    per_device_batch,
    valid_micro_batch_sizes,
    valid_num_devices,
)

__all__ = [
    "TrainInput",
    "check_batch_size",
    "check_micro_batch_size",
    "lattice_rule",
    "nearest_batch_sizes_text",
    "unused_values",
]

MicroBatchMode = Literal["auto", "explore", "none"]
"""lattice.MODES: how a search chooses m when train_input does not fix it."""


@contextmanager
def lattice_rule(where: str) -> Iterator[None]:
    """Report a broken lattice rule as a config error at ``where``."""
    try:
        yield
    except LatticeError as e:
        raise ConfigError(where, str(e)) from None


@dataclass(frozen=True, kw_only=True)
class TrainInput:
    """The user's own configuration: the reference for "faster than yours"."""

    batch_size: int = number()
    """Global batch B: samples per optimizer step, all devices together."""
    micro_batch_size: int | MicroBatchMode = number("auto", also="'auto', 'explore' or 'none'")
    """A positive int (use exactly this m), ``none``, ``auto`` or ``explore``."""
    num_devices: int = number(1)
    """Data-parallel devices n (YAML also accepts the Cerebras spelling ``num_csx``)."""
    allow_uneven: bool = False
    """Allow splits that differ by one sample where strict validity would refuse them."""
    tensor_parallel: int = number(1)
    """t: the devices each layer's weights are split over (Megatron's tensor parallel);
    num_devices = data-parallel replicas x t x pipeline_parallel."""
    pipeline_parallel: int = number(1)
    """p: pipeline stages, each on its own devices (the old name ``pipeline_stages`` is
    still read); with micro-batches g a step idles (p - 1) / g of its time (1f1b)."""

    def __post_init__(self) -> None:
        check_fields(self, "train_input")
        b, m = self.batch_size, self.micro_batch_size
        t, p = self.tensor_parallel, self.pipeline_parallel
        fixed = m if isinstance(m, int) else None
        uneven_ok = self.allow_uneven or m == "explore"
        split = t * p > 1
        if self.num_devices % (t * p):
            # a batch or micro-batch that no device count runs is the problem to name first
            dataclasses.replace(self, num_devices=t * p * max(1, self.num_devices // (t * p)))
            raise ConfigError(
                "train_input.num_devices",
                f"num_devices {self.num_devices} is not a multiple of tensor_parallel {t} x "
                f"pipeline_parallel {p} = {t * p}{self._devices_fix()}",
            )
        n = self.replicas  # the lattice's rules below are of the data-parallel replicas
        if split and uneven_ok:  # first: what else it says assumes t = p = 1
            key = "pipeline_parallel" if p > 1 else "tensor_parallel"
            raise ConfigError(
                f"train_input.{key}" if m == "explore" else "train_input.allow_uneven",
                (
                    f"{key} {getattr(self, key)} cannot explore uneven micro-batches"
                    if m == "explore"
                    else "uneven splits cannot be split over a model's devices: Megatron "
                    "requires batch_size = data-parallel replicas x micro_batch_size x "
                    "micro-batches"
                )
                + f"; {self._even_pipeline_fix()}",
            )
        # auto tries the divisors of P only, and a split model splits evenly: there
        # allow_uneven makes no uneven split run, so no message offers it
        offer_uneven = m != "auto" and not split
        if b < n or (b % n and not uneven_ok):
            with lattice_rule("train_input.batch_size"):
                check_batch_size(
                    b, n, fixed, allow_uneven=uneven_ok and m != "auto", offer_uneven=offer_uneven,
                    split=t * p,
                )  # fmt: skip
        if fixed is not None:
            with lattice_rule("train_input.micro_batch_size"):
                check_micro_batch_size(
                    b, n, fixed, allow_uneven=uneven_ok, offer_uneven=offer_uneven, split=t * p
                )

    def _devices_fix(self) -> str:
        """What makes num_devices a multiple of t x p: the device counts that run the
        batch evenly (a split model's rule), or no split where the sizes run without one."""
        b, m, k = (
            self.batch_size,
            self.micro_batch_size,
            self.tensor_parallel * self.pipeline_parallel,
        )
        fixed = m if isinstance(m, int) else None
        if not (self.allow_uneven or m == "explore"):
            valid = [d * k for d in valid_num_devices(b, fixed)]
            if valid:
                for_m = f" and micro_batch_size {fixed}" if fixed else ""
                return f"; valid num_devices for batch_size {b}{for_m}: " + ", ".join(
                    map(str, valid)
                )
        return self._unsplit_fix(";")

    @property
    def replicas(self) -> int:
        """d = num_devices / (t x p): the data-parallel replicas that share the batch."""
        return self.num_devices // (self.tensor_parallel * self.pipeline_parallel)

    def _even_pipeline_fix(self) -> str:
        """What makes an uneven-split mode valid with a split model: the even mode and sizes
        it needs, or no split where the sizes run unevenly."""
        b, n, m = self.batch_size, self.replicas, self.micro_batch_size
        fixed = m if isinstance(m, int) else None
        p = lattice.per_device_batch(b, n)
        even = b >= n and b % n == 0 and (fixed is None or p % fixed == 0)
        changes = ["micro_batch_size: auto or none"] * (m == "explore")
        changes += ["allow_uneven: false"] * self.allow_uneven
        fix = "set " + " and ".join(changes)
        if not even:
            fix += f" with {nearest_batch_sizes_text(b, n, fixed)}"
        return fix + self._unsplit_fix(", or")

    def _unsplit_fix(self, joint: str) -> str:
        """'{joint} set tensor_parallel: 1 and pipeline_parallel: 1' where that alone makes
        these sizes valid; else empty."""
        try:
            unsplit = dataclasses.replace(self, tensor_parallel=1, pipeline_parallel=1)
        except ConfigError:
            return ""
        b, n = unsplit.batch_size, unsplit.num_devices
        if unsplit.micro_batch_size == "auto" and b % n:  # auto runs even splits alone
            return ""
        return f"{joint} set tensor_parallel: 1 and pipeline_parallel: 1"

    @property
    def mode(self) -> str:
        """``int``, ``none``, ``auto`` or ``explore``."""
        return "int" if isinstance(self.micro_batch_size, int) else self.micro_batch_size

    @property
    def config(self) -> BatchConfig | None:
        """The user's own (B, n, m) and (t, p), where the mode fixes m (the pipeline's
        schedule is the trial's: Experiment.user_config)."""
        b, n, m = self.batch_size, self.num_devices, self.micro_batch_size
        layout = {"tensor_parallel": self.tensor_parallel,
                  "pipeline_parallel": self.pipeline_parallel}  # fmt: skip
        if isinstance(m, int):
            return BatchConfig(b, n, m, **layout)
        if m == "none":
            return BatchConfig(b, n, lattice.per_device_batch(b, self.replicas), **layout)
        return None


# ---------------------------------------------------------------------------
# the lattice's rules, in words


def nearest_batch_sizes_text(
    batch_size: int, num_devices: int, micro_batch_size: int | None = None, *,
    allow_uneven: bool = False,
) -> str:  # fmt: skip
    """'nearest valid batch_size for micro_batch_size 4: 96 (below) or 108 (above)', the
    phrase every message uses; ``micro_batch_size`` None: a mode chooses m, so B need only
    split evenly over n."""
    m = micro_batch_size or 1
    below, above = nearest_valid_batch_sizes(batch_size, num_devices, m, allow_uneven=allow_uneven)
    for_m = f" for micro_batch_size {micro_batch_size}" if micro_batch_size else ""
    return f"nearest valid batch_size{for_m}: {_below_above(below, above)}"


def check_batch_size(
    batch_size: int, num_devices: int, micro_batch_size: int | None = None, *,
    allow_uneven: bool = False, offer_uneven: bool = False, split: int = 1,
) -> None:  # fmt: skip
    """Raise LatticeError where B < n or, unless ``allow_uneven``, B % n != 0.

    The message names the rule, both numbers, and the nearest batch sizes (for B < n also
    the device counts) that satisfy every rule with the micro-batch size too (None: a mode
    chooses m). ``offer_uneven``: the caller may set allow_uneven; the message says so
    where that alone makes these sizes valid. ``split``: t x p, the devices of one
    data-parallel replica; ``num_devices`` then counts the replicas, d = n / (t x p).
    """
    b, n, m = batch_size, num_devices, micro_batch_size
    them = _replicas_text(n, split)
    if b < n:
        devices = _valid_devices_text(b, m, allow_uneven, split)
        raise LatticeError(
            f"batch_size {b} is smaller than {them}: every {'device' if split == 1 else 'replica'}"
            f" needs at least one sample; "
            f"{nearest_batch_sizes_text(b, n, m, allow_uneven=allow_uneven)}"
            + (f"; {devices}" if devices else "")
        )
    if b % n and not allow_uneven:
        uneven_runs = offer_uneven and (m is None or m <= per_device_batch(b, n))
        devices = _valid_devices_text(b, m, False, split)
        raise LatticeError(
            f"batch_size {b} is not divisible by {them}; "
            f"{nearest_batch_sizes_text(b, n, m)}"
            + (f"; {devices}" if devices else "")
            + _UNEVEN_HINT * uneven_runs
        )


def check_micro_batch_size(
    batch_size: int, num_devices: int, micro_batch_size: int, *,
    allow_uneven: bool = False, offer_uneven: bool = False, split: int = 1,
) -> None:  # fmt: skip
    """Raise LatticeError where m > P or, unless ``allow_uneven``, P % m != 0; (B, n) has
    passed :func:`check_batch_size` with the same ``allow_uneven``.

    The message names the rule, both numbers, the nearest batch sizes for this m and the
    micro-batch sizes for this B that satisfy every rule; ``offer_uneven`` as there.
    """
    b, n, m = batch_size, num_devices, micro_batch_size
    p = per_device_batch(b, n)
    valid_b = nearest_batch_sizes_text(b, n, m, allow_uneven=allow_uneven)
    # with allow_uneven every m up to P runs; P can be 2**31: name the range, never list it
    valid_m = _span(p) if allow_uneven else ", ".join(map(str, valid_micro_batch_sizes(b, n)))
    sizes = f"the per-device batch {p} (batch_size {b} / {_replicas_text(n, split)})"
    if m > p:
        raise LatticeError(
            f"micro_batch_size {m} exceeds {sizes}; {valid_b}; valid micro_batch_size for "
            f"batch_size {b}: {valid_m}"
        )
    if p % m and not allow_uneven:
        raise LatticeError(
            f"micro_batch_size {m} does not divide {sizes}; {valid_b}; valid micro_batch_size "
            f"for batch_size {b}: {valid_m}" + _UNEVEN_HINT * offer_uneven
        )


_UNEVEN_HINT = " (or set allow_uneven: true)"


def _replicas_text(replicas: int, split: int) -> str:
    """'num_devices 4', or with a split model 'the 2 data-parallel replicas (num_devices 8 /
    (tensor_parallel x pipeline_parallel 4))'."""
    if split == 1:
        return f"num_devices {replicas}"
    return (
        f"the {replicas} data-parallel replicas (num_devices {replicas * split} / "
        f"(tensor_parallel x pipeline_parallel {split}))"
    )


def _valid_devices_text(
    batch_size: int, micro_batch_size: int | None, allow_uneven: bool, split: int = 1
) -> str:
    """The device counts that run ``batch_size`` with m (None: a mode chooses it), as a
    phrase; empty where none does. ``split``: the devices of a replica (t x p)."""
    b, m = batch_size, micro_batch_size
    if allow_uneven:  # m <= ceil(B / n), that is n <= (B - 1) / (m - 1): a range from 1
        most = b if not m or m == 1 else min(b, (b - 1) // (m - 1))
        values = _span(most)
    else:
        values = ", ".join(str(d * split) for d in valid_num_devices(b, m))
    for_m = f" and micro_batch_size {m}" if m else ""
    return f"valid num_devices for batch_size {b}{for_m}: {values}" if values else ""


def _span(most: int) -> str:
    """1..most, named without listing it (empty where most < 1)."""
    return "" if most < 1 else "1" if most == 1 else f"1..{most}"


def _below_above(below: int | None, above: int) -> str:
    return f"{above} (above)" if below is None else f"{below} (below) or {above} (above)"


# ---------------------------------------------------------------------------
# the values of a space that leave nothing, in words


def unused_values(
    t: TrainInput,
    configs: Iterable[BatchConfig],
    *,
    batch: int | tuple[int, int],
    num_devices: Sequence[int] | None,
    micro_batch_sizes: Sequence[int] | None,
    micro_batch_range: tuple[int, int] | None = None,
) -> list[str]:
    """Each value a searched dimension lists that leaves no valid configuration (none of
    ``configs``, the space's, has it) and why, one line per reason: 'num_devices 3:
    batch_size 32 does not split evenly over 3 devices; valid num_devices for batch_size
    32: 1, 2, 4, 8, 16, 32'. ``batch``: the space's one batch size, or its (min, max)
    range; ``num_devices``: the device counts it lists (None: train_input's alone);
    ``micro_batch_sizes``: the sizes it lists by name (None: none, or a range, which bounds
    the sizes the mode chooses rather than naming each; ``micro_batch_range``: such a
    range, which an explicit micro_batch_size leaves unused as a whole). A batch_size is
    never one: the space holds one (the space is empty without it) or a range that B =
    n x m x g picks from; nor a setting of a step: every combination runs every size."""
    present = {(c.num_devices, c.micro_batch_size) for c in configs}
    lines = []
    for i, (key, listed, reason) in enumerate((
        ("num_devices", num_devices, _device_reason(t, batch)),
        ("micro_batch_size", micro_batch_sizes, _micro_reason(t, batch, num_devices)),
    )):  # fmt: skip
        groups: dict[str, list[int]] = {}
        for value in sorted(set(listed or ()) - {sizes[i] for sizes in present}):
            groups.setdefault(reason(value), []).append(value)
        for why, values in groups.items():
            them = f"{values[0]} devices" if len(values) == 1 else "any of them"
            lines.append(f"{key} {_values_text(values)}: {why.replace('{them}', them)}")
    if isinstance(t.micro_batch_size, int) and micro_batch_range is not None:
        lo, hi = micro_batch_range
        lines.append(f"micro_batch_size {lo}..{hi}: {_explicit(t.micro_batch_size)}")
    return lines


def _explicit(mode: int) -> str:
    return f"train_input.micro_batch_size {mode} is explicit: the space cannot vary it"


def _device_reason(t: TrainInput, batch: int | tuple[int, int]) -> Callable[[int], str]:
    """Why a device count leaves no configuration of the space ('{them}': the counts)."""
    mode = t.micro_batch_size
    if isinstance(batch, tuple):
        return lambda n: _range_reason(batch, mode)
    b, fixed = batch, mode if isinstance(mode, int) else None
    uneven = (t.allow_uneven or mode == "explore") and mode != "auto"  # auto: divisors of P
    devices = _valid_devices_text(b, fixed, uneven)

    def reason(n: int) -> str:
        p = per_device_batch(b, n)
        if b < n:
            return f"more devices than batch_size {b} has samples; {devices}"
        if b % n and not uneven:
            runs = mode != "auto" and t.replicas == t.num_devices and (fixed is None or fixed <= p)
            return f"batch_size {b} does not split evenly over {{them}}; {devices}" + (
                _UNEVEN_HINT * runs
            )
        if fixed is not None:
            verb = "exceeds" if fixed > p else "does not divide"
            return f"micro_batch_size {fixed} {verb} the per-device batch {p}; {devices}"
        if mode == "explore":
            return f"every micro_batch_size of the space exceeds the per-device batch {p}"
        return f"no micro_batch_size of the space divides the per-device batch {p}"

    return reason


def _micro_reason(
    t: TrainInput, batch: int | tuple[int, int], num_devices: Sequence[int] | None
) -> Callable[[int], str]:
    """Why a micro-batch size the space names leaves no configuration of it."""
    mode = t.micro_batch_size
    if isinstance(mode, int):
        return lambda m: _explicit(mode)
    if isinstance(batch, tuple):
        return lambda m: _range_reason(batch, mode)
    b = batch
    uneven = mode == "explore" or (t.allow_uneven and mode == "none")
    ns = num_devices or [t.num_devices]
    ps = sorted({per_device_batch(b, n) for n in ns if b >= n and (uneven or b % n == 0)})
    batches = _values_text(ps) if len(ps) <= 6 else f"from {ps[0]} to {ps[-1]}"

    def reason(m: int) -> str:
        if not ps:
            return f"no num_devices of the space splits batch_size {b}"
        if mode == "none":
            return (
                f"not a per-device batch ({batches}): micro_batch_size none runs each "
                "device's batch as one micro-batch"
            )
        if m > ps[-1]:
            return f"larger than every per-device batch ({batches})"
        return f"not a divisor of any per-device batch ({batches})"  # auto

    return reason


def _range_reason(batch: tuple[int, int], mode: int | str) -> str:
    """Why a value leaves nothing where the space's batch_size is a range: B = n x m x g."""
    lo, hi = batch
    if mode == "none":
        return f"no batch_size in {lo}..{hi} is num_devices x micro_batch_size (mode none: g = 1)"
    return f"no batch_size in {lo}..{hi} is num_devices x micro_batch_size x micro-batches"


def _values_text(values: Sequence[int]) -> str:
    """'3, 5..7, 9': the values in order, three or more in a row as their ends."""
    runs: list[list[int]] = []
    for v in sorted(set(values)):
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ", ".join(f"{r[0]}..{r[-1]}" if len(r) >= 3 else ", ".join(map(str, r)) for r in runs)
