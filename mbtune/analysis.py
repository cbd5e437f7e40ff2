"""A run directory as pandas: one row per trial, ranked, pivoted and compared.

Pure: pandas and numpy, never torch nor ray, and no plotting (that is mbtune.plots).
It reads a finished run, an interrupted one (no summary.json) and one whose driver was
killed (trials.csv may end in half a row, which is dropped and counted).

``load_run(RUN_DIR)`` gives one row per trial with the columns of :mod:`mbtune.record`
(``COLUMNS``; docs/analysis.md lists them with their dtypes). Times are in ms unless the
name ends in ``_s``; memory in bytes; a figure that was not measured (a failed trial, a
CPU without tokens) is NaN.

``load_runs([...])`` puts several runs in one frame, with a first column ``run``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from mbtune import record
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig, LatticeError
from mbtune.report import recommended_line, sizes
from mbtune.rundir import TRIAL_COLUMNS, RunDir

__all__ = [
    "COLUMNS",
    "FORMATS",
    "Recommendation",
    "RunInfo",
    "best_per_config",
    "compare_report",
    "compare_runs",
    "has_ok_trial",
    "load_recommendations",
    "load_run",
    "load_runs",
    "ranked",
    "recommendation",
    "no_ok_trial_message",
    "render_table",
    "run_report",
    "run_info",
    "status_counts",
    "status_pivot",
    "throughput_pivot",
]

SIZES = ("batch_size", "num_devices", "micro_batch_size")
"""The three sizes that name a configuration (and match runs in a comparison)."""

_INTS = record.names_of("int")
_FLOATS = record.names_of("float")
_BOOLS = tuple(c.name for c in record.COLUMNS if c.kind == "bool" and not c.derived)
_LISTS = {
    **dict.fromkeys(record.names_of("ints"), int),
    **dict.fromkeys(record.names_of("floats"), float),
}

COLUMNS = tuple(c.name for c in record.COLUMNS)
"""The columns of :func:`load_run`, in order (a newer trials.csv may add more after)."""

FORMATS = ("table", "csv", "json", "markdown")

try:
    _TEXT: Any = pd.StringDtype(na_value=np.nan)  # what pandas 3 calls "str"; missing: NaN
except TypeError:  # pandas < 2.3
    _TEXT = object

SUMMARY_FILE = "summary.json"


# ---------------------------------------------------------------------------
# loading


def load_run(run_dir: str | Path) -> pd.DataFrame:
    """One row per finished trial of the run in ``run_dir`` (see the module docstring).

    Rows a killed driver left half-written are dropped; ``df.attrs["dropped_rows"]`` says
    how many. A run with no trials.csv yet is an error; one with only its header is an
    empty frame with every column.
    """
    run = RunDir.open(run_dir)
    if not run.trials_file.is_file():
        raise MbtuneError(
            f"RUN_DIR: {run.path} has no trials.csv yet: no trial of this run has finished"
        )
    header, records, dropped = _read_trials_csv(run.trials_file)
    frame, unusable = _typed_frame(header, records, _default_pipeline_stages(run))
    frame.attrs["dropped_rows"] = dropped + unusable
    return frame


def load_runs(run_dirs: Iterable[str | Path]) -> pd.DataFrame:
    """Several runs in one frame, with a first column ``run`` naming each (its directory).

    Two runs with the same directory name are told apart by their full paths.
    """
    paths = [Path(p) for p in run_dirs]
    if not paths:
        raise MbtuneError("load_runs: give at least one run directory")
    names = [p.name for p in paths]
    labels = [str(p) if names.count(p.name) > 1 else p.name for p in paths]
    frames = []
    dropped = 0
    for label, path in zip(labels, paths, strict=True):
        frame = load_run(path)
        dropped += frame.attrs.get("dropped_rows", 0)
        frame.insert(0, "run", label)
        frames.append(frame)
    out = pd.concat(frames, ignore_index=True)
    out.attrs["dropped_rows"] = dropped
    return out


def _read_trials_csv(path: Path) -> tuple[list[str], list[list[str]], int]:
    """The header, every complete record, and how many partial records were dropped."""
    text = path.read_bytes().decode("utf-8", errors="replace")
    if "\n" not in text:
        return list(TRIAL_COLUMNS), [], 0  # killed while writing the header: no trial yet
    try:
        records = list(csv.reader(io.StringIO(text, newline="")))
    except csv.Error as e:
        raise MbtuneError(f"RUN_DIR: {path} is not a CSV file ({e})") from None
    header, body = records[0], [r for r in records[1:] if r]
    missing = [c for c in (*SIZES, "status") if c not in header]
    if missing:
        raise MbtuneError(
            f"RUN_DIR: {path} lacks the column(s) {', '.join(missing)}; an mbtune "
            f"trials.csv starts with the header {','.join(TRIAL_COLUMNS[:6])},..."
        )
    dropped = 0
    if body and not text.endswith(("\n", "\r")):  # csv ends its rows with \r\n
        body, dropped = body[:-1], 1  # the driver died mid-row: the last row is partial
    complete = [r for r in body if len(r) == len(header)]
    return header, complete, dropped + len(body) - len(complete)


def _typed_frame(
    header: list[str], records: list[list[str]], pipeline_stages: int
) -> tuple[pd.DataFrame, int]:
    """Text records -> the typed columns of COLUMNS; rows without their sizes are unusable."""
    raw = pd.DataFrame(records, columns=header, dtype=object)
    for name in TRIAL_COLUMNS:
        if name not in raw:
            raw[name] = ""  # an older trials.csv without this column
    numbers = {name: pd.to_numeric(raw[name], errors="coerce") for name in (*_INTS, *_FLOATS)}
    sizes = pd.concat([numbers[s] for s in ("trial", *SIZES)], axis=1)
    usable = (sizes.notna().all(axis=1) & (sizes[list(SIZES)] >= 1).all(axis=1)).to_numpy()
    raw = raw[usable].reset_index(drop=True)
    numbers = {k: v[usable].reset_index(drop=True) for k, v in numbers.items()}

    b, n, m = (numbers[s].astype("int64") for s in SIZES)
    per_device = numbers["per_device_batch"].fillna(-(-b // n)).astype("int64")
    derived = {
        "per_device_batch": per_device,
        "grad_accum_steps": numbers["grad_accum_steps"].fillna(-(-per_device // m)),
        "pipeline_stages": numbers["pipeline_stages"].fillna(pipeline_stages),
    }
    columns: dict[str, Any] = {}
    for name in COLUMNS:
        if name in _INTS:
            columns[name] = derived.get(name, numbers[name]).astype("int64")
        elif name in _FLOATS:
            columns[name] = numbers[name].astype("float64")
        elif name == "strict":
            columns[name] = ((b % n == 0) & ((b // n) % m == 0)).astype(bool)
        elif name in _BOOLS:  # missing in older runs: false
            columns[name] = raw[name].str.strip().str.lower().isin(("true", "1")).astype(bool)
        elif name in _LISTS:
            columns[name] = pd.Series(
                [_parse_list(v, _LISTS[name]) for v in raw[name]], index=raw.index, dtype=object
            )
        elif name == "finished_at":
            columns[name] = pd.to_datetime(
                raw[name].replace("", None), errors="coerce", format="ISO8601"
            )
        else:
            columns[name] = _text(raw[name])
    for name in header:  # columns a newer trials.csv may add: kept as text
        if name not in columns:
            columns[name] = _text(raw[name])
    return pd.DataFrame(columns), int((~usable).sum())


def _text(column: pd.Series) -> pd.Series:
    return pd.Series([v.strip() or None for v in column], index=column.index, dtype=object).astype(
        _TEXT
    )


def _parse_list(text: str, kind: type) -> list:
    try:
        return [kind(float(v)) if kind is int else kind(v) for v in text.split()]
    except ValueError:
        return []


def _default_pipeline_stages(run: RunDir) -> int:
    stages = (_experiment(run).get("train_input") or {}).get("pipeline_stages", 1)
    return stages if isinstance(stages, int) and stages >= 1 else 1


def _experiment(run: RunDir) -> dict[str, Any]:
    try:
        data = yaml.safe_load(run.experiment_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise MbtuneError(f"RUN_DIR: cannot read {run.experiment_file}: {e}") from None
    return data if isinstance(data, dict) else {}


# ---------------------------------------------------------------------------
# what else the run directory says


@dataclass(frozen=True)
class RunInfo:
    """The rest of a run directory: its settings, summary and recommendation stream."""

    path: Path
    name: str
    objective: str
    """The column the search maximised: samples_per_s or samples_per_s_per_device."""
    device_memory_bytes: int | None
    """The experiment's memory budget per device (trial.device_memory); None: no budget."""
    confidence_target: int | None
    summary: Mapping[str, Any] | None
    """summary.json; None while the run has not finished (or was killed)."""
    recommendations: pd.DataFrame | None
    """recommendations.jsonl, one row per record; None where the run has none."""


def run_info(run_dir: str | Path) -> RunInfo:
    run = RunDir.open(run_dir)
    exp = _experiment(run)
    search, trial = exp.get("search") or {}, exp.get("trial") or {}
    memory = trial.get("device_memory")
    target = search.get("confidence_target")
    return RunInfo(
        path=run.path,
        name=str(exp.get("name") or run.path.name),
        objective=str(search.get("objective") or "samples_per_s"),
        device_memory_bytes=memory if isinstance(memory, int) and memory > 0 else None,
        confidence_target=target if isinstance(target, int) else None,
        summary=_summary(run),
        recommendations=load_recommendations(run.path),
    )


def _summary(run: RunDir) -> dict[str, Any] | None:
    path = run.path / SUMMARY_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MbtuneError(f"RUN_DIR: {path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise MbtuneError(f"RUN_DIR: {path} must hold a JSON object, got {type(data).__name__}")
    return data


_RECOMMENDATION_COLUMNS = (
    "time", "trials", "micro_batch_size", "num_devices", "batch_size", "samples_per_s",
    "estimated_performance", "confidence",
)  # fmt: skip


def load_recommendations(run_dir: str | Path) -> pd.DataFrame | None:
    """recommendations.jsonl as a frame (one row per record), or None where there is none.

    A line that is not a JSON object (the driver died while writing it) is skipped.
    """
    run = RunDir(Path(run_dir))
    if not run.recommendations_file.is_file():
        return None
    frame = pd.DataFrame.from_records(run.recommendations())
    for name in _RECOMMENDATION_COLUMNS:
        if name not in frame:
            frame[name] = np.nan
    for name in _RECOMMENDATION_COLUMNS[1:]:
        frame[name] = pd.to_numeric(frame[name], errors="coerce").astype("float64")
    frame["time"] = pd.to_datetime(frame["time"], errors="coerce", format="ISO8601")
    return frame[
        [*_RECOMMENDATION_COLUMNS, *(c for c in frame if c not in _RECOMMENDATION_COLUMNS)]
    ]


# ---------------------------------------------------------------------------
# ranking and pivots


def status_counts(trials: pd.DataFrame) -> dict[str, int]:
    """How many trials ended in each status, ok first."""
    counts = trials["status"].fillna("?").value_counts()
    order = sorted(counts.index, key=lambda s: (s != "ok", s))
    return {s: int(counts[s]) for s in order}


def ranked(trials: pd.DataFrame) -> pd.DataFrame:
    """The ok trials best first by objective (then the earlier trial), then every failed
    trial in trial order; ``rank`` (1, 2, ... ; NA for a failed trial) comes first."""
    score = trials["objective"].where(trials["objective"] > 0, trials["samples_per_s"])
    ok = trials["status"].eq("ok") & score.notna()
    order = pd.DataFrame({"ok": ~ok, "score": -score.fillna(0.0), "trial": trials["trial"]})
    out = trials.loc[order.sort_values(["ok", "score", "trial"], kind="stable").index]
    out = out.reset_index(drop=True)
    rank = pd.array([*range(1, int(ok.sum()) + 1), *[pd.NA] * int((~ok).sum())], dtype="Int64")
    out.insert(0, "rank", rank)
    return out


def best_per_config(trials: pd.DataFrame) -> pd.DataFrame:
    """One row per (batch_size, num_devices, micro_batch_size): its fastest ok trial, or,
    where none was ok, its first trial (with its status)."""
    if trials.empty:
        return trials.copy()
    order = trials.assign(_ok=trials["status"].ne("ok"), _speed=-trials["samples_per_s"])
    order = order.sort_values(["_ok", "_speed", "trial"], na_position="last", kind="stable")
    out = order.drop_duplicates(list(SIZES)).drop(columns=["_ok", "_speed"])
    return out.sort_values(list(SIZES)[::-1]).reset_index(drop=True)


def throughput_pivot(trials: pd.DataFrame, value: str = "samples_per_s") -> pd.DataFrame:
    """``value`` over micro_batch_size (rows) x num_devices (columns): the best ok trial
    of each cell (over batch sizes, where the run tried several); NaN where none was ok."""
    ok = trials[trials["status"].eq("ok")]
    table = ok.pivot_table(
        index="micro_batch_size", columns="num_devices", values=value, aggfunc="max"
    )
    index = sorted(trials["micro_batch_size"].unique())
    columns = sorted(trials["num_devices"].unique())
    return table.reindex(index=index, columns=columns).rename_axis(
        index="micro_batch_size", columns="num_devices"
    )


def status_pivot(trials: pd.DataFrame) -> pd.DataFrame:
    """The pivot of :func:`throughput_pivot` as text: samples/s, or the status of a cell
    where nothing was ok (oom, error, timeout), or '' where nothing was tried."""
    speeds = throughput_pivot(trials)
    failed = (
        trials[trials["status"].ne("ok")]
        .groupby(["micro_batch_size", "num_devices"])["status"]
        .first()
    )
    text = speeds.map(lambda v: "" if pd.isna(v) else f"{v:,.1f}").astype(object)
    for (m, n), status in failed.items():
        if text.loc[m, n] == "":
            text.loc[m, n] = str(status)
    return text


# ---------------------------------------------------------------------------
# the recommendation


@dataclass(frozen=True)
class Recommendation:
    """The configuration a run recommends, and where that came from."""

    config: BatchConfig
    """The measured configuration (B, n, m)."""
    samples_per_s: float | None
    pipeline_stages: int
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


def recommendation(trials: pd.DataFrame, info: RunInfo) -> Recommendation:
    """summary.json's ``recommended`` where the run wrote one, else the best ok trial."""
    stages = int(trials["pipeline_stages"].iloc[0]) if len(trials) else 1
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
        return Recommendation(
            config=config,
            samples_per_s=float(speed) if isinstance(speed, int | float) else None,
            pipeline_stages=stages,
            source=SUMMARY_FILE,
            precision=str(rec.get("precision") or "fp32"),
            confidence=int(confidence) if isinstance(confidence, int | float) else None,
            recommended_batch_size=global_batch
            if isinstance(global_batch, int) and global_batch != config.batch_size
            else None,
        )
    top = ranked(trials)
    if top.empty or pd.isna(top["rank"].iloc[0]):
        raise MbtuneError(no_ok_trial_message(trials, info.path))
    best = top.iloc[0]
    precision = best.get("precision")
    return Recommendation(
        config=BatchConfig.from_mapping(best),
        samples_per_s=float(best["samples_per_s"]),
        pipeline_stages=int(best["pipeline_stages"]),
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
    """Runs ``a`` and ``b`` matched on (batch_size, num_devices, micro_batch_size).

    One row per configuration measured in either: each run's samples/s and status (its
    fastest ok trial of that configuration) and ``ratio`` = b / a where both ran ok.
    """
    keep = [*SIZES, "grad_accum_steps", "samples_per_s", "status"]
    left, right = best_per_config(a)[keep], best_per_config(b)[keep]
    both = left.merge(right, on=list(SIZES), how="outer", suffixes=("_a", "_b"))
    both["grad_accum_steps"] = both.pop("grad_accum_steps_a").fillna(both.pop("grad_accum_steps_b"))
    both["grad_accum_steps"] = both["grad_accum_steps"].astype("int64")
    both_ok = both["status_a"].eq("ok") & both["status_b"].eq("ok")
    # an oom on the CPU still has a measured speed (it was over the budget): no ratio
    both["ratio"] = (both["samples_per_s_b"] / both["samples_per_s_a"]).where(both_ok)
    both = both.sort_values(["num_devices", "batch_size", "micro_batch_size"])
    columns = [*SIZES, "grad_accum_steps", "samples_per_s_a", "status_a", "samples_per_s_b",
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
        lines.append(recommended_line(recommendation(trials, info)))
    sections = []
    ok = table[table["rank"].notna()]
    if len(ok):
        sections.append((f"trials, best first by {info.objective}", _ranked_view(ok, info)))
    failed = table[table["rank"].isna()]
    if len(failed):
        view = failed[["trial", *SIZES, "status", "reason"]]
        sections.append(("failed trials", view))
    if len(ok):
        pivot = status_pivot(trials)
        pivot.columns = [f"num_devices {n}" for n in pivot.columns]
        several = " (best over batch sizes)" if trials["batch_size"].nunique() > 1 else ""
        sections.append((f"samples/s by micro_batch_size x num_devices{several}",
                         pivot.reset_index()))  # fmt: skip
    floats = {
        "samples_per_s": ",.1f", "samples_per_s_per_device": ",.1f", "step_time_ms_median": ".2f",
        "step_time_ms_iqr": ".2f", "compile_s": ".1f", "peak_memory_mib": ",.0f",
    }  # fmt: skip
    for title, view in sections:
        lines.append("")
        lines.append(f"**{title}**\n" if fmt == "markdown" else f"{title}:")
        lines.append(render_table(view, fmt, floats=floats).rstrip("\n"))
    return "\n".join(lines) + "\n"


def _ranked_view(ok: pd.DataFrame, info: RunInfo) -> pd.DataFrame:
    """The columns of the ranked table a person reads; optional ones only where measured."""
    view = ok[["rank", "trial", *SIZES, "grad_accum_steps", "samples_per_s"]].copy()
    if info.objective == "samples_per_s_per_device":
        view["samples_per_s_per_device"] = ok["samples_per_s_per_device"]
    view["step_time_ms_median"] = ok["step_time_ms_median"]
    view["step_time_ms_iqr"] = ok["step_time_ms_iqr"]
    if ok["compile_s"].notna().any():
        view["compile_s"] = ok["compile_s"]
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
        top = ranked(trials)
        counts = ", ".join(f"{v} {k}" for k, v in status_counts(trials).items()) or "none"
        if len(top) and pd.notna(top["rank"].iloc[0]):
            r = top.iloc[0]
            bests.append(float(r["samples_per_s"]))
            speed = r["samples_per_s"]
            best = f"best: {sizes(BatchConfig.from_mapping(r))}: {speed:,.1f} samples/s"
        else:
            best = "no trial ran ok"
        lines.append(
            f"{label}: {info.path} ('{info.name}', {len(trials)} trials: {counts}); {best}"
        )
    if len(bests) == 2:
        lines.append(f"best of b / best of a: {bests[1] / bests[0]:.2f}x")
    lines.append("")
    lines.append(
        "matched on (batch_size, num_devices, micro_batch_size); ratio = samples/s of b / a"
        + (":" if fmt == "table" else "\n")
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
    return bool(numbers) and all(c in _STATUSES or _NUMBER.fullmatch(c) for c in filled)


_NUMBER = re.compile(r"[-+]?[\d,]*\.?\d+(e[-+]?\d+)?")
_STATUSES = ("ok", "oom", "error", "timeout")


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
