"""The trial record: the one definition of what a finished trial is, as a row.

trials.csv's header (:data:`CSV_COLUMNS`), the typed frame of ``load_run`` (its dtypes)
and the column table of docs/analysis.md (:func:`markdown_table`, checked by a test)
are all derived from :data:`COLUMNS`. Pure: no torch, no pandas, no ray.

A column is added here, once, and a trial result field of the same name then reaches
trials.csv, the pandas frame and the docs.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["COLUMNS", "CSV_COLUMNS", "KINDS", "Column", "markdown_table", "names_of"]

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
        "B: global batch, samples per optimizer step, all devices together",
    ),
    Column("num_devices", "int", "devices", "n: data-parallel devices"),
    Column(
        "micro_batch_size", "int", "samples",
        "m: samples per forward/backward pass on one device, as measured (after halving on OOM)",
    ),
    Column(
        "activation_checkpointing", "bool", "",
        "whether the blocks' activations were recomputed in the backward pass (false in runs "
        "from before it was recorded)",
    ),
    Column(
        "repeat", "int", "",
        "0 for a configuration's first measurement in the run, 1, 2, ... for the search's "
        "further looks at it (0 in runs from before repeats)",
    ),
    Column("per_device_batch", "int", "samples", "P = ceil(B / n)"),
    Column("grad_accum_steps", "int", "passes", "g = ceil(P / m)"),
    Column(
        "micro_batches", "ints", "samples",
        "list of int: the micro-batches one device runs per step, e.g. [4, 4] or [3, 2, 2]",
    ),
    Column("pipeline_stages", "int", "stages", "p (1 without a pipeline)"),
    Column(
        "strict", "bool", "", "B % n == 0 and (B / n) % m == 0: every split is even",
        derived=True,
    ),
    Column(
        "precision", "text", "",
        "the arithmetic measured: `fp32`, `tf32`, `bf16` or `fp16` (`trial.precision` resolved)",
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
    Column("bubble_time_ms", "float", "ms", "pipeline bubble per step"),
    Column("compile_s", "float", "s", "torch.compile time (never counted in the throughput)"),
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
        "objective", "float", "",
        "what the search maximised (`search.objective`); 0 for a failed trial",
    ),
    Column(
        "micro_batch_sizes_tried", "ints", "samples",
        "list of int: every m tried (several after halving on OOM)",
    ),
    Column("step_times_ms", "floats", "ms", "list of float: every timed step, in order"),
    Column("wall_s", "float", "s", "wall time of the whole trial, build and compile included"),
    Column("device", "text", "", "where the trial ran: `cpu`, `cuda`, `cuda:0`, or `replay`"),
    Column("backend", "text", "", "`torch` (measured) or `replay` (answered from a table)"),
    Column(
        "parallel", "text", "",
        "`simulate` (one device measured, all-reduce modelled) or `ddp` (every device a process)",
    ),
    Column("reason", "text", "", "why the status is not `ok`"),
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


def names_of(kind: str) -> tuple[str, ...]:
    """The columns of one kind, e.g. ``names_of("float")``."""
    return tuple(c.name for c in COLUMNS if c.kind == kind)


def markdown_table() -> str:
    """The column table of docs/analysis.md."""
    lines = ["| column | dtype | unit | meaning |", "| --- | --- | --- | --- |"]
    lines += [f"| `{c.name}` | {c.dtype} | {c.unit} | {c.meaning} |" for c in COLUMNS]
    return "\n".join(lines) + "\n"
