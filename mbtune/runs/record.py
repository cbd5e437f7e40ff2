"""The trial record: the one definition of what a finished trial is, as a row.

:class:`TrialRecord` is a finished trial, typed: the trial's result as it reported it and
what the run adds (its number, Ray's id, which look at the configuration, when, where).
After the trial nothing else holds it: the run directory writes it as one row of
trials.csv (:meth:`TrialRecord.to_row`) and reads it back (:meth:`TrialRecord.from_row`,
by mbtune.runs.rundir's one reader); the search model, the reporter and ``load_run`` take
it typed. trials.csv's header (:data:`CSV_COLUMNS`), the record's conversions, the typed
frame of ``load_run`` (its dtypes), what names a configuration (:data:`CONFIG_KEY`) and
the column table of docs/analysis.md (:func:`markdown_table`, checked by a test) are all
derived from :data:`COLUMNS`. Pure: no torch, no pandas, no ray.

A column is added here, once (a :class:`Column`, and the record's field of the same
name), and a trial result field of the same name then reaches trials.csv, the pandas
frame and the docs; a new searched dimension is a column with ``searched=True``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mbtune.lattice import BatchConfig

__all__ = [
    "COLUMNS",
    "CONFIG_KEY",
    "CSV_COLUMNS",
    "KINDS",
    "PREDICTED",
    "SIZES",
    "Column",
    "TrialRecord",
    "cell",
    "markdown_table",
]

PREDICTED = "predicted"
"""How the reason of an ``oom`` recorded without a trial begins: the configuration's memory,
predicted before the search (``search.predict_memory``), is over the budget."""

KINDS = ("int", "float", "bool", "text", "ints", "floats", "datetime")
"""How a column is typed in ``load_run``: int64, float64 (NaN where not measured), bool,
text, a list of int, a list of float, a datetime."""


@dataclass(frozen=True)
class Column:
    name: str
    kind: str
    """One of :data:`KINDS`."""
    unit: str
    meaning: str
    derived: bool = False
    """Computed by ``load_run`` from other columns; not a column of trials.csv."""
    searched: bool = False
    """A dimension the search varies: part of what names a configuration (:data:`CONFIG_KEY`)."""

    @property
    def dtype(self) -> str:
        """The dtype ``load_run`` gives the column, as docs/analysis.md names it."""
        return {
            "int": "int64", "float": "float64", "bool": "bool", "text": "text",
            "ints": "object", "floats": "object", "datetime": "datetime",
        }[self.kind]  # fmt: skip


COLUMNS: tuple[Column, ...] = (
    Column("trial", "int", "", "1, 2, ... in the order the trials finished"),
    Column("trial_id", "text", "", "Ray Tune's id of the trial"),
    Column("status", "text", "", "`ok`, `oom`, `error` or `timeout`"),
    Column(
        "batch_size", "int", "samples",
        "B: global batch, samples per optimizer step, all devices together", searched=True,
    ),
    Column(
        "num_devices", "int", "devices",
        "n: every device of the trial, data-parallel replicas x tensor_parallel x "
        "pipeline_parallel", searched=True,
    ),
    Column(
        "micro_batch_size", "int", "samples",
        "m: samples per forward/backward pass on one device, as measured (after halving on OOM)",
        searched=True,
    ),
    Column(
        "activation_checkpointing", "bool", "",
        "whether the blocks' activations were recomputed in the backward pass (false in runs "
        "from before it was recorded)", searched=True,
    ),
    Column(
        "reshard_after_forward", "bool", "",
        "`sharding: fsdp`: whether each block's parameters were freed after its forward pass "
        "and gathered again for the backward (true, ZeRO-3-like) or kept (false, ZeRO-2-like); "
        "true without sharding and in runs from before it was recorded", searched=True,
    ),
    Column(
        "grad_sync", "text", "",
        "when the gradients were synchronised: `last` (once per step, in the last "
        "micro-batch's backward pass) or `every` (in each micro-batch's; sharded: less memory, "
        "more traffic); `last` without sharding and in runs from before it was recorded",
        searched=True,
    ),
    Column(
        "tensor_parallel", "int", "devices",
        "t: the devices each layer was split over (1: none; 1 in runs from before it was "
        "recorded)", searched=True,
    ),
    Column(
        "pipeline_parallel", "int", "stages",
        "p: pipeline stages (1: no pipeline; a run's `pipeline_stages` from before it was "
        "named so, its n then counted the data-parallel devices alone)", searched=True,
    ),
    Column(
        "pipeline_schedule", "text", "",
        "the pipeline's schedule: `gpipe`, `1f1b`, `interleaved_1f1b`, `zbv` or "
        "`dualpipev`; `1f1b` without a pipeline", searched=True,
    ),
    Column(
        "repeat", "int", "",
        "0 for a configuration's first measurement in the run, 1, 2, ... for the search's "
        "further looks at it (0 in runs from before repeats)",
    ),
    Column("per_device_batch", "int", "samples",
           "P = ceil(B / d): one data-parallel replica's batch, d = n / (t x p)"),
    Column("grad_accum_steps", "int", "passes", "g = ceil(P / m)"),
    Column(
        "micro_batches", "ints", "samples",
        "list of int: the micro-batches one device runs per step, e.g. [4, 4] or [3, 2, 2]",
    ),
    Column(
        "strict", "bool", "", "B % d == 0 and (B / d) % m == 0: every split is even",
        derived=True,
    ),
    Column(
        "precision", "text", "",
        "the arithmetic measured: `fp32`, `tf32`, `bf16` or `fp16` (`trial.precision` resolved)",
    ),
    Column(
        "sharding", "text", "",
        "`none` (each device holds the whole model) or `fsdp` (each holds its shard: FSDP2); "
        "empty in runs from before it was recorded",
    ),
    Column("samples_per_s", "float", "samples/s", "global throughput: B / median step time"),
    Column("samples_per_s_per_device", "float", "samples/s", "samples_per_s / n"),
    Column(
        "tokens_per_s", "float", "tokens/s", "global tokens per second (models with a sequence)"
    ),
    Column("step_time_ms_median", "float", "ms", "median optimizer-step time"),
    Column("step_time_ms_iqr", "float", "ms", "spread: interquartile range of the step times"),
    Column(
        "compute_time_ms", "float", "ms",
        "forward/backward passes and optimizer step on one device",
    ),
    Column(
        "comm_time_ms", "float", "ms",
        "gradient all-reduce per step (modelled with `parallel: simulate`)",
    ),
    Column(
        "bubble_time_ms", "float", "ms",
        "pipeline bubble per step (modelled with `parallel: simulate`)",
    ),
    Column("compile_s", "float", "s", "torch.compile time (never counted in the throughput)"),
    Column(
        "compile_from_cache", "bool", "",
        "every graph came from torch's on-disk compile cache (a shape an earlier trial or run "
        "compiled): `compile_s` is less than a cold compile",
    ),
    Column(
        "compile_fallback", "text", "",
        "why torch.compile fell back to running the model eagerly, if it did",
    ),
    Column(
        "flops_per_sample", "float", "FLOP",
        "model FLOPs of one sample's forward and backward pass (3 x the forward pass counted "
        "by torch's FlopCounterMode; recompute not counted)",
    ),
    Column(
        "tflops_per_s", "float", "TFLOP/s",
        "achieved model FLOPs per second of one device: flops_per_sample x samples_per_s / n",
    ),
    Column(
        "mfu", "float", "",
        "model FLOPs utilisation: tflops_per_s / the device's peak for this precision; NaN "
        "where the peak is unknown (`trial.peak_tflops` sets it)",
    ),
    Column(
        "peak_memory_bytes", "float", "bytes",
        "peak memory of one device (CUDA: allocated; CPU: the process's resident set)",
    ),
    Column(
        "peak_reserved_bytes", "float", "bytes",
        "CUDA: peak memory the caching allocator reserved (NaN on the CPU)",
    ),
    Column(
        "alloc_retries", "float", "",
        "CUDA: times the allocator freed its cache and retried during the timed steps; more "
        "than 0 flags a configuration that slows down or dies later in training",
    ),
    Column("eval_samples_per_s", "float", "samples/s", "forward-only throughput (`trial.eval`)"),
    Column(
        "loss", "float", "",
        "mean loss of the last timed step, over the global batch (`ddp`: all ranks' samples) "
        "or the one measured device's (`simulate`); a non-finite loss makes the trial `error`; "
        "empty for replayed trials and in runs from before it was recorded",
    ),
    Column(
        "objective", "float", "",
        "what the search maximised (`search.objective`); 0 for a failed trial",
    ),
    Column(
        "micro_batch_sizes_tried", "ints", "samples",
        "list of int: every m tried (several after halving on OOM)",
    ),
    Column("step_times_ms", "floats", "ms", "list of float: every timed step, in order"),
    Column("wall_s", "float", "s", "wall time of the whole trial, build and compile included "
           "(in a search: from the start of its process)"),
    Column("device", "text", "", "where the trial ran: `cpu`, `cuda`, `cuda:0`, or `replay`"),
    Column("backend", "text", "", "`torch` (measured) or `replay` (answered from a table)"),
    Column(
        "parallel", "text", "",
        "`simulate` (one device measured, all-reduce modelled) or `ddp` (every device a process)",
    ),
    Column(
        "reason", "text", "",
        "why the status is not `ok`; an `oom` whose reason starts with `predicted:` was "
        "predicted over the memory budget before the search and never run "
        "(`search.predict_memory`; its row has no `trial_id`)",
    ),
    Column("note", "text", "", "something to know about the measurement (batch mixing, ...)"),
    Column("finished_at", "datetime", "", "when the trial finished (local time)"),
    Column(
        "node_id", "text", "",
        "the Ray node that measured the trial (on a cluster, which machine)",
    ),
)  # fmt: skip
"""Every column of a trial, in the order of trials.csv and of ``load_run``."""

CSV_COLUMNS: tuple[str, ...] = tuple(c.name for c in COLUMNS if not c.derived)
"""The header of trials.csv."""

CONFIG_KEY: tuple[str, ...] = tuple(c.name for c in COLUMNS if c.searched)
"""What names a configuration: every dimension the search varies (batch_size,
num_devices, micro_batch_size, activation_checkpointing, reshard_after_forward,
grad_sync, tensor_parallel, pipeline_parallel, pipeline_schedule). Two trials with the same values
here measured the same configuration; analysis deduplicates, matches runs and keeps
pivots and plot lines apart on it."""

SIZES = ("batch_size", "num_devices", "micro_batch_size")
"""The three sizes of a configuration (B, n, m), the lattice's: the columns a table always
shows, and the axes of a pivot and a plot. Part of :data:`CONFIG_KEY`, never all of it."""


@dataclass(frozen=True, kw_only=True)
class TrialRecord:
    """One finished trial: one row of trials.csv, typed.

    Each field is the column of :data:`COLUMNS` of the same name (its meaning and unit are
    there); a figure that was not measured is None, and a float column holds a number as the
    trial reported it (an int where it reported a whole number: peak_memory_bytes), so that
    :meth:`to_row` writes what the trial reported. ``extras`` holds, as text, the columns a
    newer trials.csv may add. The sizes form a configuration, or the record is refused.
    """

    trial: int
    trial_id: str | None = None
    status: str | None
    batch_size: int
    num_devices: int
    micro_batch_size: int
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True
    grad_sync: str = "last"
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_schedule: str = "1f1b"
    repeat: int = 0
    per_device_batch: int | None = None
    grad_accum_steps: int | None = None
    micro_batches: tuple[int, ...] = ()
    precision: str | None = None
    sharding: str | None = None
    samples_per_s: float | None = None
    samples_per_s_per_device: float | None = None
    tokens_per_s: float | None = None
    step_time_ms_median: float | None = None
    step_time_ms_iqr: float | None = None
    compute_time_ms: float | None = None
    comm_time_ms: float | None = None
    bubble_time_ms: float | None = None
    compile_s: float | None = None
    compile_from_cache: bool | None = None
    compile_fallback: str | None = None
    flops_per_sample: float | None = None
    tflops_per_s: float | None = None
    mfu: float | None = None
    peak_memory_bytes: float | None = None
    peak_reserved_bytes: float | None = None
    alloc_retries: float | None = None
    eval_samples_per_s: float | None = None
    loss: float | None = None
    objective: float | None = None
    micro_batch_sizes_tried: tuple[int, ...] = ()
    step_times_ms: tuple[float, ...] = ()
    wall_s: float | None = None
    device: str | None = None
    backend: str | None = None
    parallel: str | None = None
    reason: str | None = None
    note: str | None = None
    finished_at: str | None = None
    """ISO 8601 local time, as trials.csv holds it (``load_run`` makes it a datetime)."""
    node_id: str | None = None
    extras: tuple[tuple[str, str], ...] = ()
    """(column, text) of the columns a newer trials.csv holds beyond :data:`CSV_COLUMNS`."""

    def __post_init__(self) -> None:
        # a record names a configuration: sizes (and a grad_sync) the lattice refuses
        # (LatticeError) are no trial
        self.config  # noqa: B018

    @property
    def config(self) -> BatchConfig:
        """The configuration measured (B, n, m as measured, and its settings)."""
        return BatchConfig.of(self)

    @property
    def predicted(self) -> bool:
        """An ``oom`` recorded from the memory prediction before the search, without a
        trial (its reason starts with :data:`PREDICTED`; mbtune.search)."""
        return self.status == "oom" and (self.reason or "").startswith(PREDICTED)

    @property
    def strict(self) -> bool:
        """B % n == 0 and (B / n) % m == 0: every split is even."""
        return self.config.is_strict

    @classmethod
    def from_result(cls, result: Mapping[str, Any]) -> TrialRecord:
        """A trial's result as it reported it (numbers, lists, None: ``trial_metrics``, or
        the JSON Tune hands back) with the run's columns of it (``trial``, ``trial_id``,
        ``repeat``, ``finished_at``, ...). A key that is no column of trials.csv
        (``mixes_batch``) is not recorded; a column it lacks is not measured."""
        return cls(**{c.name: _typed(c.kind, result[c.name]) for c in _CSV if c.name in result})

    @classmethod
    def from_row(cls, row: Mapping[str, str]) -> TrialRecord:
        """A row of trials.csv, as its text (a column it lacks is empty; one it does not know
        is kept in ``extras``). Raises ValueError (or LatticeError) where the row names no
        trial: its trial number or sizes are not whole numbers, or form no configuration.
        A figure that is not a number reads as not measured; a list with an item that is not
        a number as empty; a run from before a column was recorded gets its default."""
        values: dict[str, Any] = {}
        for c in _CSV:
            parsed = _PARSE[c.kind]((row.get(c.name) or "").strip())
            if parsed is not None:
                values[c.name] = parsed
        missing = [name for name in ("trial", *SIZES) if name not in values]
        if missing:
            raise ValueError(f"no whole number in {', '.join(missing)}")
        stages = _whole((row.get("pipeline_stages") or "").strip())
        if "pipeline_parallel" not in row and stages and stages > 1:
            # a run from before the name: its n counted the data-parallel devices alone
            values["pipeline_parallel"] = stages
            values["num_devices"] *= stages
        values.setdefault("status", None)
        extras = tuple((k, v) for k, v in row.items() if k not in _CSV_NAMES and k is not None)
        return cls(**values, extras=extras)

    def to_row(self) -> dict[str, str]:
        """The record as one row of trials.csv: each column's text, extras after them."""
        return {**{c.name: cell(getattr(self, c.name)) for c in _CSV}, **dict(self.extras)}


def cell(value: Any) -> str:
    """A value as trials.csv writes it: a list space-separated (a float to 4 significant
    digits), None empty, anything else as ``str`` (a float's shortest exact form)."""
    if isinstance(value, list | tuple):
        return " ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in value)
    return "" if value is None else str(value)


_CSV = tuple(c for c in COLUMNS if not c.derived)
_CSV_NAMES = frozenset(CSV_COLUMNS)


def _typed(kind: str, value: Any) -> Any:
    """A reported value as the record holds it: a list as a tuple, a figure that is not a
    finite number (NaN) as None."""
    if kind in ("ints", "floats"):
        return tuple(value or ())
    if kind == "float" and value is not None and not math.isfinite(value):
        return None
    return value


def _whole(text: str) -> int | None:
    """A whole number written as one (``4``, ``4.0``), else None."""
    number = _number(text)
    return int(number) if number is not None and float(number).is_integer() else None


def _number(text: str) -> float | None:
    """A finite number as written (an int where it is one), else None."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        number = float(text)
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _numbers(kind: type) -> Any:
    """The parser of a space-separated list of ``kind``; one item that is not a number
    (or an int column's inf) makes it empty."""

    def parse(text: str) -> tuple:
        try:
            return tuple(kind(float(v)) if kind is int else kind(v) for v in text.split())
        except (ValueError, OverflowError):
            return ()

    return parse


_PARSE = {
    "int": _whole,
    "float": _number,
    "bool": lambda text: text.lower() in ("true", "1") if text else None,
    "text": lambda text: text or None,
    "datetime": lambda text: text or None,
    "ints": _numbers(int),
    "floats": _numbers(float),
}
"""How a column's text in trials.csv becomes its value, by :data:`KINDS`; None: not there."""


def markdown_table() -> str:
    """The column table of docs/analysis.md."""
    lines = ["| column | dtype | unit | meaning |", "| --- | --- | --- | --- |"]
    lines += [f"| `{c.name}` | {c.dtype} | {c.unit} | {c.meaning} |" for c in COLUMNS]
    return "\n".join(lines) + "\n"
