"""How mbtune names a configuration, one way everywhere: its sizes and layout
(:func:`sizes`: 'num_devices 2, batch_size 64, micro_batch_size 8'), how it computes
(:func:`step_suffix`: ', bf16, with activation checkpointing'), how it splits into
micro-batches (:func:`micro_batches`: '4x8', '3+2+2', and the sentences built on it,
:func:`devices_split` and :func:`per_device_split`), and its layout and settings as the
tables of the best configurations head them (:func:`shown_columns`)."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from mbtune.lattice import BatchConfig

__all__ = [
    "devices_split",
    "layout",
    "micro_batches",
    "per_device_split",
    "plural",
    "shown_columns",
    "sizes",
    "step_suffix",
    "value_text",
]


def sizes(config: BatchConfig) -> str:
    """The sizes that name a configuration, in the order of trials.csv's columns, and its
    layout where it splits the model: 'num_devices 8, tensor_parallel 2, pipeline_parallel 2
    (1f1b), batch_size 64, micro_batch_size 4'."""
    return (
        f"num_devices {config.num_devices}{layout(config, ' ')}, batch_size {config.batch_size}, "
        f"micro_batch_size {config.micro_batch_size}"
    )


def layout(config: BatchConfig, sep: str) -> str:
    """', tensor_parallel 2, pipeline_parallel 2 (1f1b)' (``sep`` between a key and its
    value: ' ' or ': '), only what splits the model; empty where nothing does."""
    t, p, schedule = config.layout
    return f", tensor_parallel{sep}{t}" * (t > 1) + (
        f", pipeline_parallel{sep}{p} ({schedule})" if p > 1 else ""
    )


def layout_cell(t: int, p: int, schedule: str) -> str:
    """A model's split in a table's cell: '2x2 interleaved_1f1b' (t x p, the schedule only
    where there is a pipeline)."""
    return f"{t}x{p}" + f" {schedule}" * (int(p) > 1)


def plural(count: int, word: str, suffix: str = "s") -> str:
    return f"{count} {word}{suffix if count != 1 else ''}"


def micro_batches(config: BatchConfig) -> str:
    """The micro-batches one device runs: '4x8', '3+2+2', or '1000x3+24x2' for many.

    Computed from (P, g) rather than from the list of sizes, which a configuration such as
    batch_size 2**31 at micro_batch_size 1 would make billions of items long.
    """
    g = config.grad_accum_steps
    q, r = divmod(config.per_device_batch, g)
    if r == 0:
        return f"{g}x{q}"
    if g <= 8:
        return "+".join(map(str, [q + 1] * r + [q] * (g - r)))
    return f"{r}x{q + 1}+{g - r}x{q}"


def _even_or_listed(config: BatchConfig, even: str) -> str:
    """``even`` (a phrase of g and the size q) where the micro-batches are all one size,
    else :func:`micro_batches`."""
    g = config.grad_accum_steps
    q, r = divmod(config.per_device_batch, g)
    return even.format(g=g, q=q) if r == 0 else micro_batches(config)


def devices_split(config: BatchConfig) -> str:
    """How one configuration runs, e.g. '2 devices x 4 micro-batches of 8', or with a split
    model '2 replicas of 4 devices x 4 micro-batches of 8'."""
    g, d = config.grad_accum_steps, config.data_parallel
    split = config.num_devices // d
    who = plural(d, "replica") + f" of {split} devices" if split > 1 else plural(d, "device")
    return f"{who} x {plural(g, 'micro-batch', 'es')} of " + _even_or_listed(config, "{q}")


def per_device_split(config: BatchConfig) -> str:
    """What one device computes, e.g. 'per device 16 samples as 2 x 8', or where the
    devices differ by a sample, 'per device 17 or 16 samples, the busiest as 5+4+4+4'; with
    a split model, 'per replica' (its t x p devices share the replica's samples)."""
    runs = _even_or_listed(config, "{g} x {q}")
    b, d = config.batch_size, config.data_parallel
    each = "per device" if d == config.num_devices else "per replica"
    if b % d:
        return f"{each} {b // d + 1} or {b // d} samples, the busiest as {runs}"
    return f"{each} {b // d} samples as {runs}"


def step_suffix(
    precision: str | None,
    activation_checkpointing: bool,
    reshard_after_forward: bool = True,
    grad_sync: str = "last",
    *,
    sharding: str | None = None,
) -> str:
    """How a step computes, to follow a configuration's sizes (its settings, in the order
    of ``BatchConfig.settings``): ', bf16, with activation checkpointing', and, sharded,
    ', reshard_after_forward false, grad_sync every'. A setting at its default is not named
    (so that a configuration without them reads as it always has), unless ``sharding`` is
    ``fsdp``: then both of FSDP's are, ', fsdp, reshard_after_forward true, grad_sync last'."""
    words = [precision] if precision else []
    if activation_checkpointing:
        words.append("with activation checkpointing")
    fsdp = sharding == "fsdp"
    words += ["fsdp"] * fsdp
    if fsdp or not reshard_after_forward:
        words.append(f"reshard_after_forward {str(reshard_after_forward).lower()}")
    if fsdp or grad_sync != "last":
        words.append(f"grad_sync {grad_sync}")
    return "".join(f", {w}" for w in words)


def value_text(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


COLUMNS = (
    ("tensor_parallel", "t"),
    ("pipeline_parallel", "p"),
    ("pipeline_schedule", "schedule"),
    ("activation_checkpointing", "ckpt"),
    ("reshard_after_forward", "reshard_after_forward"),
    ("grad_sync", "grad_sync"),
)
"""The layout (mbtune.lattice.LAYOUT) and the settings of a step (mbtune.lattice.SETTINGS)
as a table of configurations heads them."""


def shown_columns(
    configs: Sequence[BatchConfig], keys: Collection[str] | None = None
) -> list[tuple[str, list[str]]]:
    """The columns of ``keys`` (of :data:`COLUMNS`; None: all of them) that a table of
    ``configs`` shows: only where a configuration has it off its default, so that a table
    of configurations without them reads as it always has; each as (heading, its words,
    one a config, right-aligned to the heading): on/off for activation checkpointing,
    true/false for reshard_after_forward, the value itself otherwise."""
    default = BatchConfig(1, 1, 1)
    shown = []
    for key, label in COLUMNS:
        if keys is not None and key not in keys:
            continue
        if any(getattr(c, key) != getattr(default, key) for c in configs):
            words = [_column_word(key, getattr(c, key)) for c in configs]
            shown.append((label, [f"{w:>{len(label)}}" for w in words]))
    return shown


def _column_word(key: str, value: Any) -> str:
    if key == "activation_checkpointing":
        return "on" if value else "off"
    return value_text(value)
