"""PNG plots of a run, from the frames of mbtune.runs.load and mbtune.analysis.frames.

matplotlib's object API with its Agg renderer: no display, no pyplot state, nothing
changed in the caller's own matplotlib (a notebook keeps its backend). A line is one
num_devices and one setting of each other dimension the run varied
(mbtune.analysis.frames.varied_dimensions: activation checkpointing on and off are two
lines), over the micro-batch size.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import (
    FixedLocator,
    FuncFormatter,
    LogLocator,
    NullFormatter,
    NullLocator,
)

from mbtune.analysis.frames import best_per_config, ranked_ok, varied_dimensions
from mbtune.errors import MbtuneError
from mbtune.runs.load import RunInfo
from mbtune.runs.record import CONFIG_KEY, SIZES

if TYPE_CHECKING:  # the plan is passed in, made by mbtune.plan (scipy): not imported here
    from mbtune.plan.planner import Plan, PlanRow

__all__ = [
    "PLAN_PLOT",
    "PLOT_FILES",
    "compare_figure",
    "confidence_figure",
    "memory_figure",
    "plan_figure",
    "save",
    "step_time_figure",
    "throughput_figure",
    "write_plots",
]

PLOT_FILES = {
    "throughput": "plot-throughput.png",
    "memory": "plot-memory.png",
    "step_time": "plot-step-time.png",
    "confidence": "plot-confidence.png",
}
"""The file each plot is written to, inside the run directory."""

PLAN_PLOT = "plot-plan.png"
"""The plan's plot (:func:`plan_figure`), where the run has a plan: ``mbtune analyze``."""

STEP_TIME_BARS = 24
"""At most this many bars in the step-time plot: the best trials, by objective."""

_FAILED = {"oom": ("X", "out of memory"), "error": ("v", "error"), "timeout": ("s", "timeout")}
_MiB = 2**20


def write_plots(trials: pd.DataFrame, info: RunInfo) -> tuple[list[Path], list[str]]:
    """Every plot of one run, into its directory: the files written, and one line for
    each plot that could not be drawn, saying why."""
    title = info.name
    figures = {
        "throughput": throughput_figure(trials, title=title),
        "memory": memory_figure(trials, device_memory_bytes=info.device_memory_bytes, title=title),
        "step_time": step_time_figure(trials, title=title),
    }
    skipped = []
    recs = info.recommendations
    if recs is None or recs["confidence"].notna().sum() == 0:
        why = "has no recommendations.jsonl" if recs is None else "has no confidence records"
        skipped.append(f"{PLOT_FILES['confidence']} not written: the run {why} (older run?)")
    else:
        figures["confidence"] = confidence_figure(recs, target=info.confidence_target, title=title)
    written = [save(fig, info.path / PLOT_FILES[name]) for name, fig in figures.items()]
    return written, skipped


def throughput_figure(trials: pd.DataFrame, *, title: str) -> Figure:
    """samples/s against micro-batch size, one line per num_devices (and setting of each
    other dimension the run varied) through each configuration's median; where a
    configuration was measured more than once, a bar from its lowest to its highest
    measurement; the failed trials marked on the axis, and the best configuration (the
    run's ranking) starred at the model's estimate of it, or at its line where the run
    has none."""
    fig, ax = _figure()
    cells = best_per_config(trials)
    lines = _line_columns(trials)
    measured = trials[trials["status"].eq("ok")]
    for color, (key, group) in zip(_colors(), cells.groupby(lines), strict=False):
        speeds = _on_line(measured, lines, key).groupby("micro_batch_size")["samples_per_s"]
        line = speeds.median()
        ax.plot(line.index, line.to_numpy(), "o-", color=color, label=_label(lines, key))
        spread = speeds.agg(["min", "max", "count"])
        spread = spread[spread["count"] > 1]
        ax.vlines(spread.index, spread["min"], spread["max"], color=color, linewidth=3, alpha=0.5)
        _mark_failed(ax, group, color, y=0.0)
    _failure_legend(ax, cells["status"])
    ok = ranked_ok(trials)
    if len(ok):
        best = ok.iloc[0]
        estimate = best.get("estimated_samples_per_s")
        line = ok.groupby(list(CONFIG_KEY), dropna=False, sort=False)["samples_per_s"].median()
        value = line.iloc[0] if pd.isna(estimate) else estimate  # best's: the first group
        ax.plot(
            [best["micro_batch_size"]], [value], "*", color="gold", markersize=16,
            markeredgecolor="black", zorder=5,
            label=f"best: {value:,.0f} samples/s" + ("" if pd.isna(estimate) else " (estimated)"),
        )  # fmt: skip
    return _finish(fig, ax, trials, ylabel="samples/s (global)",
                   title=f"{title}: throughput by micro-batch size")  # fmt: skip


def memory_figure(trials: pd.DataFrame, *, device_memory_bytes: int | None, title: str) -> Figure:
    """Peak memory of one device against micro-batch size, one line per num_devices (and
    setting of each other dimension the run varied), with the experiment's memory budget
    (trial.device_memory) drawn where it has one."""
    fig, ax = _figure()
    lines = _line_columns(trials)
    for color, (key, group) in zip(_colors(), trials.groupby(lines), strict=False):
        ok = group[group["status"] == "ok"].groupby("micro_batch_size")["peak_memory_bytes"].max()
        ax.plot(ok.index, ok.to_numpy() / _MiB, "o-", color=color, label=_label(lines, key))
        failed = group[(group["status"] != "ok") & group["peak_memory_bytes"].notna()]
        _mark_failed(ax, failed, color, y=failed["peak_memory_bytes"] / _MiB)
    _failure_legend(ax, trials.loc[trials["peak_memory_bytes"].notna(), "status"])
    if device_memory_bytes:
        ax.axhline(
            device_memory_bytes / _MiB, color="crimson", linestyle="--",
            label=f"budget (device_memory) {_size(device_memory_bytes)}",
        )  # fmt: skip
        budget = ""
    else:
        budget = " (no device_memory budget set)"
    return _finish(fig, ax, trials, ylabel="peak memory per device (MiB)",
                   title=f"{title}: peak memory by micro-batch size{budget}")  # fmt: skip


def step_time_figure(trials: pd.DataFrame, *, title: str) -> Figure:
    """Each ok trial's median step split into compute, communication and pipeline bubble
    (stacked bars), ordered by (num_devices, batch_size, micro_batch_size, and each other
    dimension the run varied, which a bar's label then names)."""
    ok = ranked_ok(trials)
    apart = varied_dimensions(trials)
    shown = ok.head(STEP_TIME_BARS).sort_values(
        ["num_devices", "batch_size", "micro_batch_size", *apart, "trial"]
    )
    fig, ax = _figure(width=max(6.4, 0.45 * len(shown)))
    several_batches = trials["batch_size"].nunique() > 1
    labels = [
        f"n{r['num_devices']} m{r['micro_batch_size']}"
        + (f"\nB{r['batch_size']}" * several_batches)
        + "".join(f"\n{name} {r[name]}" for name in apart)
        for _, r in shown.iterrows()
    ]
    x = range(len(shown))
    bottom = pd.Series(0.0, index=shown.index)
    parts = (("compute_time_ms", "compute"), ("comm_time_ms", "all-reduce"),
             ("bubble_time_ms", "pipeline bubble"))  # fmt: skip
    for color, (column, label) in zip(_colors(), parts, strict=False):
        height = shown[column].fillna(0.0)
        ax.bar(x, height.to_numpy(), bottom=bottom.to_numpy(), color=color, label=label)
        bottom += height
    ax.set_xticks(list(x), labels, fontsize=8, rotation=0 if len(shown) <= 12 else 90)
    ax.set_ylabel("median step time (ms)")
    ax.set_xlabel("trial (n: num_devices, m: micro_batch_size)")
    cut = f" (best {len(shown)} of {len(ok)})" if len(shown) < len(ok) else ""
    ax.set_title(f"{title}: where a step's time goes{cut}")
    if not len(shown):
        ax.text(0.5, 0.5, "no trial ran ok", ha="center", transform=ax.transAxes)
    _legend(ax)
    return fig


def confidence_figure(recommendations: pd.DataFrame, *, target: int | None, title: str) -> Figure:
    """The recommendation's confidence score after each trial, with the stopping target;
    each change of the recommended configuration is labelled."""
    fig, ax = _figure()
    recs = recommendations.dropna(subset=["confidence"])
    trials = recs["trials"].fillna(pd.Series(range(1, len(recs) + 1), index=recs.index))
    ax.step(trials, recs["confidence"], "o-", where="post", color="tab:blue", label="confidence")
    if target is not None:
        ax.axhline(target, color="gray", linestyle="--", label=f"target {target}")
    previous = None
    # a record names a dimension beyond the sizes only where it is on (BatchConfig.sizes)
    key = [k for k in CONFIG_KEY if k in recs]
    for x, (_, r) in zip(trials, recs.iterrows(), strict=True):
        config = tuple(False if pd.isna(r[k]) and k not in SIZES else r[k] for k in key)
        sizes = (r["num_devices"], r["micro_batch_size"], r["batch_size"])
        if config != previous and not any(pd.isna(v) for v in sizes):
            ax.annotate(
                f"n{sizes[0]:.0f} m{sizes[1]:.0f}",
                (x, r["confidence"]), textcoords="offset points", xytext=(0, 8),
                ha="center", fontsize=8,
            )  # fmt: skip
        previous = config
    ax.set_ylim(0, 100)
    ax.set_xlabel("trials finished")
    ax.set_ylabel("confidence score (0-99)")
    ax.set_title(f"{title}: confidence in the recommendation")
    _legend(ax)
    return fig


def compare_figure(runs: Sequence[pd.DataFrame], labels: Sequence[str], *, title: str) -> Figure:
    """samples/s against micro-batch size of several runs: one color per num_devices (and
    setting of each other dimension the runs varied), one line style per run."""
    fig, ax = _figure()
    styles = ("o-", "s--", "^:", "d-.")
    lines = _line_columns(*runs)
    keys = sorted(pd.concat(runs)[lines].drop_duplicates().itertuples(index=False, name=None))
    colors = dict(zip(keys, _colors(), strict=False))
    for style, label, trials in zip(styles, labels, runs, strict=False):
        cells = best_per_config(trials)
        for key, group in cells.groupby(lines):
            ok = group[group["status"] == "ok"].groupby("micro_batch_size")["samples_per_s"].max()
            short = _label(lines, key).replace("num_devices", "n")
            ax.plot(ok.index, ok.to_numpy(), style, color=colors[key], label=f"{label}, {short}")
            _mark_failed(ax, group, colors[key], y=0.0)
    _failure_legend(ax, pd.concat([best_per_config(t) for t in runs])["status"])
    return _finish(fig, ax, pd.concat(runs), ylabel="samples/s (global)", title=title)


def plan_figure(plan: Plan, *, title: str) -> Figure:
    """The plan against the device count: above, the hours to train; below, the cost (the
    device-hours without a price). Each planned count's best configuration (labelled with
    its sizes) through a band of its 90% interval; the fastest, the cheapest and the
    cheapest within max_slowdown marked; the node's size drawn where the counts cross it."""
    fig = Figure(figsize=(6.4, 6.4), dpi=100, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True)
    rows = plan.rows
    x = [r.config.num_devices for r in rows]
    price = plan.plan.price_per_device_hour
    below = ("cost", f"cost at {price:g} per device-hour") if price is not None else (
        "device_hours", "device-hours (no plan.price_per_device_hour)")  # fmt: skip
    picks = (  # a row may be several picks: the markers differ in shape and size
        (plan.fastest, "*", 17, "gold", "fastest"),
        (plan.cheapest, "D", 10, "none", "cheapest"),
        (plan.cheapest_within, "s", 16, "none",
         f"cheapest within {plan.plan.max_slowdown:.0%} of the fastest"),
    )  # fmt: skip
    node = plan.plan.devices_per_node
    for ax, (key, ylabel), color in zip((top, bottom), (("hours", "hours to train"), below),
                                        ("tab:blue", "tab:green"), strict=True):  # fmt: skip
        ax.grid(True, alpha=0.3)
        values = [getattr(r, key) for r in rows]
        low, high = [v.low for v in values], [v.high for v in values]
        ax.fill_between(x, low, high, color=color, alpha=0.25, linewidth=0,
                        label="90% interval")  # fmt: skip
        ax.vlines(x, low, high, color=color, linewidth=2, alpha=0.5)  # one count: no band
        ax.plot(x, [v.value for v in values], "o-", color=color, label="best configuration")
        for row, marker, size, face, label in picks:
            ax.plot([row.config.num_devices], [getattr(row, key).value], marker,
                    markersize=size, markerfacecolor=face, markeredgecolor="black",
                    zorder=5, label=label)  # fmt: skip
        if min(x) <= node < max(x):
            ax.axvline(node, color="gray", linestyle=":", label=f"one node ({node} devices)")
        if max(high) >= 4 * min(low) > 0:  # spans: a ratio reads as a distance
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.4g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_ylabel(ylabel)
    top.margins(y=0.15)  # room for the labels
    for row in rows:
        top.annotate(_sizes(row), (row.config.num_devices, row.hours.value), fontsize=8,
                     textcoords="offset points", xytext=(0, 9), ha="center")  # fmt: skip
    if max(x) >= 4 * min(x):
        bottom.set_xscale("log", base=2)
    bottom.xaxis.set_major_locator(FixedLocator(x))
    bottom.xaxis.set_minor_locator(NullLocator())
    bottom.set_xticklabels([str(n) for n in x])
    measured = ", ".join(map(str, plan.device_counts))
    skipped = ", ".join(str(n) for n, _ in plan.skipped)
    bottom.set_xlabel(f"num_devices (measured: {measured}"
                      + (f"; no configuration at {skipped}" if skipped else "") + ")")  # fmt: skip
    fig.suptitle(f"{title}: {plan.amount}, 90% intervals")
    _legend(top)
    return fig


def _sizes(row: PlanRow) -> str:
    """A plan row's configuration, short: 'B32 m8', 'B32 m8 ckpt'."""
    c = row.config
    return f"B{c.batch_size} m{c.micro_batch_size}" + " ckpt" * c.activation_checkpointing


# ---------------------------------------------------------------------------
# shared


def _finish(fig: Figure, ax, trials: pd.DataFrame, *, ylabel: str, title: str) -> Figure:
    """The ending of a plot over micro_batch_size: its axis, y from 0, the labels, the
    title and the legend."""
    _micro_batch_axis(ax, trials)
    ax.set_ylim(bottom=0)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _legend(ax)
    return fig


def _figure(width: float = 6.4) -> tuple[Figure, object]:
    fig = Figure(figsize=(width, 4.0), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    ax.grid(True, alpha=0.3)
    return fig, ax


def _colors() -> list[str]:
    return [f"C{i}" for i in range(10)]


def _line_columns(*runs: pd.DataFrame) -> list[str]:
    """What one line of a plot over micro_batch_size holds fixed: num_devices, and each
    other dimension the runs varied."""
    return ["num_devices", *varied_dimensions(*runs)]


def _on_line(trials: pd.DataFrame, lines: list[str], key: tuple) -> pd.DataFrame:
    """The trials of one line (``key``: its values of ``lines``)."""
    return trials[(trials[lines] == pd.Series(dict(zip(lines, key, strict=True)))).all(axis=1)]


def _label(lines: list[str], key: tuple) -> str:
    """A line's legend, e.g. 'num_devices 2' or 'num_devices 2, activation_checkpointing True'."""
    return ", ".join(f"{name} {value}" for name, value in zip(lines, key, strict=True))


def _mark_failed(ax, group: pd.DataFrame, color: str, *, y) -> None:
    """Failed trials as markers (x: oom, v: error, square: timeout) at height ``y``."""
    for status, (marker, _) in _FAILED.items():
        mask = group["status"] == status
        if mask.any():
            height = y[mask] if isinstance(y, pd.Series) else [y] * int(mask.sum())
            ax.plot(
                group.loc[mask, "micro_batch_size"], height, marker, color=color,
                markersize=10, linestyle="none", clip_on=False, zorder=4,
            )  # fmt: skip


def _failure_legend(ax, statuses: pd.Series) -> None:
    """One legend entry per failed status drawn (in black: the colour says the devices)."""
    for status, (marker, meaning) in _FAILED.items():
        if statuses.eq(status).any():
            ax.plot([], [], marker, color="black", linestyle="none", label=meaning)


def _micro_batch_axis(ax, trials: pd.DataFrame) -> None:
    sizes = sorted(int(m) for m in trials["micro_batch_size"].unique())
    if sizes and sizes[-1] / sizes[0] >= 4:
        ax.set_xscale("log", base=2)  # sizes are mostly powers of two: even spacing
    ax.xaxis.set_major_locator(FixedLocator(sizes))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([str(m) for m in sizes])
    ax.set_xlabel("micro_batch_size")


def _size(size_bytes: int) -> str:
    """A memory size as people write it: '416 MiB', '4.00 GiB'."""
    return (
        f"{size_bytes / 2**30:.2f} GiB" if size_bytes >= 2**30 else f"{size_bytes / _MiB:.0f} MiB"
    )


def _legend(ax) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")


def save(fig: Figure, path: Path) -> Path:
    """Write ``fig`` as a PNG file."""
    path = Path(path)
    try:
        fig.savefig(path, format="png")
    except OSError as e:
        raise MbtuneError(f"cannot write the plot {path}: {e.strerror or e}") from None
    return path
