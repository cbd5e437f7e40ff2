"""A run's trials ranked, pivoted and compared, and the report ``mbtune analyze`` prints.

Pure: pandas and numpy, never torch nor ray, and no plotting (that is mbtune.analysis.plots).
Reading a run directory is mbtune.runs.load (``load_run``, ``load_runs``, ``run_info``);
every sentence about a recommendation is mbtune.report.

A configuration is named by all its searched dimensions (mbtune.runs.record's
``CONFIG_KEY``): deduplication and the matching of two runs use all of them, and a table,
pivot or plot keeps apart the values of each dimension beyond the three sizes that a run
varied (:func:`varied_dimensions`: activation checkpointing where a run searched it on and
off). The one dimension a pivot or a plot line summarises is the batch size, where a run
tried several: its best (a pivot says so) or median.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mbtune.config.trial import STATUSES
from mbtune.errors import MbtuneError
from mbtune.lattice import LAYOUT, BatchConfig, LatticeError
from mbtune.report import recommended_line, sizes, step_suffix
from mbtune.report.words import layout_cell
from mbtune.runs.load import RunInfo
from mbtune.runs.record import CONFIG_KEY, SIZES
from mbtune.runs.rundir import SUMMARY_FILE

__all__ = [
    "FORMATS",
    "RunRecommendation",
    "best_per_config",
    "compare_report",
    "compare_runs",
    "has_ok_trial",
    "ranked",
    "ranked_ok",
    "recommendation",
    "no_ok_trial_message",
    "render_table",
    "repeat_spread",
    "run_report",
    "status_counts",
    "status_pivot",
    "throughput_pivot",
    "varied_dimensions",
]

FORMATS = ("table", "csv", "json", "markdown")


# ---------------------------------------------------------------------------
# ranking and pivots


def varied_dimensions(*runs: pd.DataFrame) -> list[str]:
    """The searched dimensions beyond the three sizes (``CONFIG_KEY`` less ``SIZES``)
    that hold more than one value in ``runs`` together: activation checkpointing, where a
    run measured it on and off. A table shows them after the sizes, and a pivot or a plot
    keeps their values apart; one that holds a single value tells no two rows apart."""
    others = [k for k in CONFIG_KEY if k not in SIZES]
    values = pd.concat([run[others] for run in runs], ignore_index=True)
    return [k for k in others if values[k].nunique(dropna=False) > 1]


def status_counts(trials: pd.DataFrame) -> dict[str, int]:
    """How many trials ended in each status, ok first."""
    counts = trials["status"].fillna("?").value_counts()
    order = sorted(counts.index, key=lambda s: (s != "ok", s))
    return {s: int(counts[s]) for s in order}


def ranked(trials: pd.DataFrame) -> pd.DataFrame:
    """The ok trials best first, then every failed trial in trial order; ``rank`` (1, 2,
    ... ; NA for a failed trial) comes first. Best is the one order of "best" the run
    wrote (``model_rank``: its recommendation first, then by the search model's
    estimate, as the stream, summary.json and ``mbtune watch`` have it); within a
    configuration, and where the run ranked none, by the trial's objective (then the
    earlier trial)."""
    score = trials["objective"].where(trials["objective"] > 0, trials["samples_per_s"])
    ok = trials["status"].eq("ok") & score.notna()
    model = trials["model_rank"] if "model_rank" in trials else pd.Series(np.nan, trials.index)
    order = pd.DataFrame({"ok": ~ok, "model": model.fillna(np.inf),
                          "score": -score.fillna(0.0), "trial": trials["trial"]})  # fmt: skip
    keys = ["ok", "model", "score", "trial"]
    out = trials.loc[order.sort_values(keys, kind="stable").index]
    out = out.reset_index(drop=True)
    rank = pd.array([*range(1, int(ok.sum()) + 1), *[pd.NA] * int((~ok).sum())], dtype="Int64")
    out.insert(0, "rank", rank)
    return out


def ranked_ok(trials: pd.DataFrame) -> pd.DataFrame:
    """The ok trials best first: :func:`ranked` without its failed rows (empty: none ran ok)."""
    table = ranked(trials)
    return table[table["rank"].notna()]


def best_per_config(trials: pd.DataFrame) -> pd.DataFrame:
    """One row per configuration (``CONFIG_KEY``: every searched dimension): its fastest
    ok trial (its ``samples_per_s``, the fastest single measurement), or, where none was
    ok, its first trial (with its status); with ``model_rank`` and
    ``estimated_samples_per_s`` where the run ranked it. Ordered as the run ranked them
    (the one order of "best": :func:`ranked`), then by the dimensions."""
    if trials.empty:
        return trials.copy()
    order = trials.assign(_ok=trials["status"].ne("ok"), _speed=-trials["samples_per_s"])
    order = order.sort_values(["_ok", "_speed", "trial"], na_position="last", kind="stable")
    out = order.drop_duplicates(list(CONFIG_KEY)).drop(columns=["_ok", "_speed"])
    out = out.sort_values(list(CONFIG_KEY)[::-1])
    if "model_rank" in out:
        out = out.sort_values("model_rank", na_position="last", kind="stable")
    return out.reset_index(drop=True)


def repeat_spread(trials: pd.DataFrame) -> pd.DataFrame:
    """The configurations measured more than once (a search's further looks at a close
    call): how many ok measurements, their median, lowest and highest samples/s, and their
    relative spread (sd over mean): what the drift between trials looked like."""
    keys = list(CONFIG_KEY)
    ok = trials[trials["status"].eq("ok") & trials["samples_per_s"].notna()]
    stats = ok.groupby(keys)["samples_per_s"].agg(["count", "median", "min", "max", "mean", "std"])
    stats = stats[stats["count"] > 1]
    out = stats.reset_index().rename(columns={
        "count": "measurements", "median": "samples_per_s_median", "min": "samples_per_s_min",
        "max": "samples_per_s_max",
    })  # fmt: skip
    out["spread"] = out["std"] / out["mean"]
    return out.drop(columns=["mean", "std"]).sort_values(keys).reset_index(drop=True)


def throughput_pivot(trials: pd.DataFrame, value: str = "samples_per_s") -> pd.DataFrame:
    """``value`` over micro_batch_size (rows) x num_devices (columns): the best ok trial
    of each cell (over batch sizes, where the run tried several); NaN where none was ok.
    The other dimensions the run varied (:func:`varied_dimensions`) are kept apart: each a
    column level after num_devices, so that a cell is one setting of them."""
    columns = ["num_devices", *varied_dimensions(trials)]
    ok = trials[trials["status"].eq("ok")]
    if len(columns) == 1:
        cells: pd.Index = pd.Index(sorted(trials["num_devices"].unique()), name="num_devices")
    else:  # every setting tried, whatever its status
        cells = pd.MultiIndex.from_frame(trials[columns].drop_duplicates().sort_values(columns))
    rows = pd.Index(sorted(trials["micro_batch_size"].unique()), name="micro_batch_size")
    if ok.empty:
        return pd.DataFrame(np.nan, index=rows, columns=cells)
    table = ok.pivot_table(index="micro_batch_size", columns=columns, values=value, aggfunc="max")
    return table.reindex(index=rows, columns=cells)


def status_pivot(trials: pd.DataFrame) -> pd.DataFrame:
    """The pivot of :func:`throughput_pivot` as text: samples/s, or the status of a cell
    where nothing was ok (oom, error, timeout), or '' where nothing was tried."""
    speeds = throughput_pivot(trials)
    columns = ["num_devices", *varied_dimensions(trials)]
    failed = trials[trials["status"].ne("ok")].groupby(["micro_batch_size", *columns])["status"]
    text = speeds.map(lambda v: "" if pd.isna(v) else f"{v:,.1f}").astype(object)
    for (m, *cell), status in failed.first().items():
        column = cell[0] if len(cell) == 1 else tuple(cell)
        if text.loc[m, column] == "":
            text.loc[m, column] = str(status)
    return text


# ---------------------------------------------------------------------------
# the recommendation


@dataclass(frozen=True)
class RunRecommendation:
    """The configuration a finished (or stopped) run recommends, as ``mbtune analyze``
    reads it back, and where that came from: summary.json, or the best ok trial of a run
    that wrote none. Not :class:`mbtune.recommend.reporter.StreamRecommendation`, the
    recommendation the search streams after each trial (a recommendations.jsonl record)."""

    config: BatchConfig
    """The measured configuration (B, n, m, activation checkpointing)."""
    samples_per_s: float | None
    source: str
    """``summary.json`` or ``best ok trial``."""
    confidence: int | None = None
    recommended_batch_size: int | None = None
    """summary.json's global batch for (n, m), where it differs from the measured B."""
    precision: str = "fp32"
    """The arithmetic it was measured with (fp32 in runs from before it was recorded)."""

    @property
    def grad_accum_steps(self) -> int:
        return self.config.grad_accum_steps

    def line(self) -> str:
        return recommended_line(
            self.config,
            source=self.source,
            samples_per_s=self.samples_per_s,
            confidence=self.confidence,
            recommended_batch_size=self.recommended_batch_size,
            precision=self.precision,
        )


def recommendation(trials: pd.DataFrame, info: RunInfo) -> RunRecommendation:
    """summary.json's ``recommended`` where the run wrote one, else the best ok trial."""
    summary = info.summary or {}
    rec = summary.get("recommended")
    if isinstance(rec, Mapping):
        try:
            config = BatchConfig.from_mapping(rec)
        except (KeyError, TypeError, ValueError, LatticeError) as e:
            raise MbtuneError(
                f"RUN_DIR: {info.path / SUMMARY_FILE}: 'recommended' needs batch_size, "
                f"num_devices and micro_batch_size as positive whole numbers ({e})"
            ) from None
        speed = rec.get("samples_per_s")
        global_batch = summary.get("recommended_batch_size")
        confidence = summary.get("confidence")
        return RunRecommendation(
            config=config,
            samples_per_s=float(speed) if isinstance(speed, int | float) else None,
            source=SUMMARY_FILE,
            precision=str(rec.get("precision") or "fp32"),
            confidence=int(confidence) if isinstance(confidence, int | float) else None,
            recommended_batch_size=global_batch
            if isinstance(global_batch, int) and global_batch != config.batch_size
            else None,
        )
    top = ranked_ok(trials)
    if top.empty:
        raise MbtuneError(no_ok_trial_message(trials, info.path))
    best = top.iloc[0]
    precision = best.get("precision")
    return RunRecommendation(
        config=BatchConfig.from_mapping(best),
        samples_per_s=float(best["samples_per_s"]),
        source="best ok trial",
        precision=str(precision) if isinstance(precision, str) and precision else "fp32",
    )


def no_ok_trial_message(trials: pd.DataFrame, path: Path) -> str:
    """One line: why nothing can be ranked, plotted or exported."""
    if trials.empty:
        return f"RUN_DIR: {path} has no finished trial yet"
    counts = ", ".join(f"{k} {v}" for k, v in status_counts(trials).items())
    reasons = trials["reason"].dropna()
    first = f"; first reason: {reasons.iloc[0]}" if len(reasons) else ""
    return (
        f"RUN_DIR: no trial of {path} ran successfully ({len(trials)} trials: {counts}"
        f"{first}); nothing to rank, plot or export"
    )


# ---------------------------------------------------------------------------
# two runs side by side


def compare_runs(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Runs ``a`` and ``b`` matched on their configurations (``CONFIG_KEY``: a row of
    ``a`` and one of ``b`` are paired only where every searched dimension is equal).

    One row per configuration measured in either: its sizes (and each other dimension
    the two runs varied), each run's samples/s and status (its fastest ok trial of that
    configuration) and ``ratio`` = b / a where both ran ok.
    """
    shown = [*SIZES, *varied_dimensions(a, b)]
    keep = [*CONFIG_KEY, "grad_accum_steps", "samples_per_s", "status"]
    left, right = best_per_config(a)[keep], best_per_config(b)[keep]
    both = left.merge(right, on=list(CONFIG_KEY), how="outer", suffixes=("_a", "_b"))
    both["grad_accum_steps"] = both.pop("grad_accum_steps_a").fillna(both.pop("grad_accum_steps_b"))
    both["grad_accum_steps"] = both["grad_accum_steps"].astype("int64")
    both_ok = both["status_a"].eq("ok") & both["status_b"].eq("ok")
    # an oom on the CPU still has a measured speed (it was over the budget): no ratio
    both["ratio"] = (both["samples_per_s_b"] / both["samples_per_s_a"]).where(both_ok)
    both = both.sort_values(["num_devices", "batch_size", "micro_batch_size", *shown[3:]])
    columns = [*shown, "grad_accum_steps", "samples_per_s_a", "status_a", "samples_per_s_b",
               "status_b", "ratio"]  # fmt: skip
    return both[columns].reset_index(drop=True)


# ---------------------------------------------------------------------------
# reports: what `mbtune analyze` prints


def has_ok_trial(trials: pd.DataFrame) -> bool:
    return bool(trials["status"].eq("ok").any())


def run_report(trials: pd.DataFrame, info: RunInfo, fmt: str = "table") -> str:
    """One run for a person (``table``, ``markdown``): what the run was, its
    recommendation, the ranked trials, the failed ones and the samples/s pivot. For a
    program (``csv``, ``json``): the ranked table alone, every column, failed rows last."""
    table = ranked(trials)
    if fmt in ("csv", "json"):
        return render_table(table, fmt)
    counts = ", ".join(f"{v} {k}" for k, v in status_counts(trials).items())
    state = (
        f"status {info.summary.get('status', '?')}"
        if info.summary is not None
        else "no summary.json (interrupted, killed or still running)"
    )
    lines = [f"{info.path}: '{info.name}', {len(trials)} trials ({counts}); {state}"]
    dropped = trials.attrs.get("dropped_rows", 0)
    if dropped:
        lines.append(
            f"dropped {dropped} half-written row{'s' * (dropped > 1)} of trials.csv (the "
            "driver died while writing)"
        )
    if has_ok_trial(trials) or (info.summary or {}).get("recommended"):
        lines.append(recommendation(trials, info).line())
    apart = varied_dimensions(trials)
    sections = []
    ok = table[table["rank"].notna()]
    if len(ok):
        view = _ranked_view(ok, info, apart)
        by = info.objective
        if "estimated_samples_per_s" in view:
            by = f"the run's ranking (estimated_samples_per_s), then {by}"
        sections.append((f"trials, best first by {by}", view))
    spread = repeat_spread(trials)
    if len(spread):
        view = spread.drop(columns=[k for k in CONFIG_KEY if k not in (*SIZES, *apart)])
        sections.append(("configurations measured more than once (the drift between trials)",
                         view))  # fmt: skip
    failed = table[table["rank"].isna()]
    if len(failed):
        view = failed[["trial", *SIZES, *apart, "status", "reason"]]
        sections.append(("failed trials", view))
    if len(ok):
        pivot = status_pivot(trials)
        names = pivot.columns.names
        pivot.columns = [_column_label(names, c if apart else (c,)) for c in pivot.columns]
        several = ", the best over batch sizes" if trials["batch_size"].nunique() > 1 else ""
        sections.append((f"samples/s by micro_batch_size x num_devices (a configuration's "
                         f"fastest measurement{several})",
                         pivot.reset_index()))  # fmt: skip
    floats = {
        "samples_per_s": ",.1f", "samples_per_s_per_device": ",.1f",
        "estimated_samples_per_s": ",.1f", "step_time_ms_median": ".2f",
        "step_time_ms_iqr": ".2f", "compile_s": ".1f", "peak_memory_mib": ",.0f",
        "samples_per_s_median": ",.1f", "samples_per_s_min": ",.1f", "samples_per_s_max": ",.1f",
        "spread": ".1%",
    }  # fmt: skip
    for title, view in sections:
        lines.append("")
        lines.append(f"**{title}**\n" if fmt == "markdown" else f"{title}:")
        lines.append(render_table(view, fmt, floats=floats).rstrip("\n"))
    return "\n".join(lines) + "\n"


def _column_label(names: Sequence[str], values: Sequence[Any]) -> str:
    """A pivot column's name: 'num_devices 4, t x p 1x2 interleaved_1f1b' (the layout as the
    table of the best writes it, where the run split the model), then the other dimensions."""
    left = dict(zip(names, values, strict=True))
    split = [left.pop(k, d) for k, d in zip(LAYOUT, (1, 1, "1f1b"), strict=True)]
    words = [f"num_devices {left.pop('num_devices')}"]
    words += [f"t x p {layout_cell(*split)}"] * bool(set(LAYOUT) & set(names))
    return ", ".join([*words, *(f"{k} {v}" for k, v in left.items())])


def _ranked_view(ok: pd.DataFrame, info: RunInfo, apart: list[str]) -> pd.DataFrame:
    """The columns of the ranked table a person reads; optional ones only where measured,
    the other dimensions only where the run varied them (``apart``)."""
    view = ok[["rank", "trial", *SIZES, *apart, "grad_accum_steps", "samples_per_s"]].copy()
    if "estimated_samples_per_s" in ok and ok["estimated_samples_per_s"].notna().any():
        view["estimated_samples_per_s"] = ok["estimated_samples_per_s"]  # what ranks them
    if ok["repeat"].gt(0).any():
        view.insert(2, "repeat", ok["repeat"])
    if info.objective == "samples_per_s_per_device":
        view["samples_per_s_per_device"] = ok["samples_per_s_per_device"]
    view["step_time_ms_median"] = ok["step_time_ms_median"]
    view["step_time_ms_iqr"] = ok["step_time_ms_iqr"]
    if ok["compile_s"].notna().any():
        view["compile_s"] = ok["compile_s"]
        if ok["compile_from_cache"].any():  # some came from the compile cache
            view["compile_from_cache"] = ok["compile_from_cache"]
    if ok["peak_memory_bytes"].notna().any():
        view["peak_memory_mib"] = ok["peak_memory_bytes"] / 2**20
    return view


def compare_report(
    a: pd.DataFrame, b: pd.DataFrame, info_a: RunInfo, info_b: RunInfo, fmt: str = "table"
) -> str:
    """Two runs side by side (see :func:`compare_runs`); csv and json: the table alone."""
    table = compare_runs(a, b)
    if fmt in ("csv", "json"):
        return render_table(table, fmt)
    lines = []
    bests = []
    for label, trials, info in (("a", a, info_a), ("b", b, info_b)):
        top = ranked_ok(trials)
        counts = ", ".join(f"{v} {k}" for k, v in status_counts(trials).items()) or "none"
        if len(top):
            r = top.iloc[0]
            bests.append(float(r["samples_per_s"]))
            speed = r["samples_per_s"]
            c = BatchConfig.from_mapping(r)
            step = step_suffix(None, *c.settings)
            best = f"best: {sizes(c)}{step}: {speed:,.1f} samples/s"
        else:
            best = "no trial ran ok"
        lines.append(
            f"{label}: {info.path} ('{info.name}', {len(trials)} trials: {counts}); {best}"
        )
    if len(bests) == 2:
        lines.append(f"best of b / best of a: {bests[1] / bests[0]:.2f}x")
    lines.append("")
    matched = ", ".join([*SIZES, *varied_dimensions(a, b)])
    lines.append(
        f"matched on ({matched}); ratio = samples/s of b / a" + (":" if fmt == "table" else "\n")
    )
    floats = {"samples_per_s_a": ",.1f", "samples_per_s_b": ",.1f", "ratio": ".2f"}
    lines.append(render_table(table, fmt, floats=floats).rstrip("\n"))
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------
# text output


def render_table(frame: pd.DataFrame, fmt: str, *, floats: Mapping[str, str] | None = None) -> str:
    """``frame`` as text: an aligned ``table``, ``csv``, ``json`` (records) or ``markdown``.

    ``floats`` maps a column to a format spec for table and markdown (csv and json keep
    every digit). Missing values are blank (json: null); lists are space-separated in csv.
    """
    if fmt not in FORMATS:
        raise MbtuneError(f"--format: unknown format {fmt!r}; valid: {', '.join(FORMATS)}")
    if fmt == "json":
        return frame.to_json(orient="records", date_format="iso") + "\n"
    if fmt == "csv":
        return _lists_as_text(frame).to_csv(index=False)
    cells = _cells(frame, floats or {})
    right = [_right_aligned(frame[c], cells[c]) for c in frame]
    if fmt == "table":
        widths = [max([len(str(c)), *map(len, cells[c])]) for c in cells]
        rows = [list(map(str, cells.columns)), *cells.itertuples(index=False)]
        lines = (
            "  ".join(
                v.rjust(w) if r else v.ljust(w) for v, w, r in zip(row, widths, right, strict=True)
            )
            for row in rows
        )
        return "\n".join(line.rstrip() for line in lines) + "\n"
    header = "| " + " | ".join(cells.columns) + " |"
    rule = "|" + "|".join("---:" if r else "---" for r in right) + "|"
    rows = ["| " + " | ".join(row) + " |" for row in cells.itertuples(index=False)]
    return "\n".join([header, rule, *rows]) + "\n"


def _right_aligned(column: pd.Series, cells: pd.Series) -> bool:
    """Numbers right, words left; a pivot's cells (numbers or a status) count as numbers."""
    if pd.api.types.is_bool_dtype(column):
        return False
    if pd.api.types.is_numeric_dtype(column):
        return True
    filled = [c for c in cells if c]
    numbers = [c for c in filled if _NUMBER.fullmatch(c)]
    return bool(numbers) and all(c in STATUSES or _NUMBER.fullmatch(c) for c in filled)


_NUMBER = re.compile(r"[-+]?[\d,]*\.?\d+(e[-+]?\d+)?")


def _lists_as_text(frame: pd.DataFrame) -> pd.DataFrame:
    out = frame.copy()
    for name in out:
        if out[name].dtype == object and out[name].map(lambda v: isinstance(v, list)).any():
            out[name] = out[name].map(
                lambda v: (
                    " ".join(f"{x:.4g}" if isinstance(x, float) else str(x) for x in v)
                    if isinstance(v, list)
                    else v
                )
            )
    return out


def _cells(frame: pd.DataFrame, floats: Mapping[str, str]) -> pd.DataFrame:
    def cell(value: Any, spec: str | None) -> str:
        if isinstance(value, list):
            return " ".join(map(str, value))
        if value is None or (not isinstance(value, str) and pd.isna(value)):
            return ""
        if spec and isinstance(value, int | float | np.number):
            return format(value, spec)
        if isinstance(value, float | np.floating) and math.isfinite(value):
            return f"{value:.4g}"
        return str(value)

    return pd.DataFrame(
        {name: [cell(v, floats.get(name)) for v in frame[name]] for name in frame},
        columns=list(frame.columns),
    )
