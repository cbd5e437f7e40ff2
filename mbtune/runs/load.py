"""A run directory read back: its trials as pandas, and the rest of what it says.

Pure: pandas and numpy, never torch nor ray. It reads a finished run, an interrupted one
(no summary.json) and one whose driver was killed (trials.csv may end in half a row,
which is dropped and counted). mbtune.runs.rundir writes what this reads.

``load_run(RUN_DIR)`` gives one row per trial with the columns of :mod:`mbtune.runs.record`
(``COLUMNS``; docs/analysis.md lists them with their dtypes). Times are in ms unless the
name ends in ``_s``; memory in bytes; a figure that was not measured (a failed trial, a
CPU without tokens) is NaN.

``load_runs([...])`` puts several runs in one frame, with a first column ``run``.
``run_info(RUN_DIR)`` gives the rest: the experiment's settings, summary.json and the
recommendation stream.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mbtune.config.experiment import Experiment
from mbtune.config.load import load_run_experiment
from mbtune.errors import MbtuneError
from mbtune.runs import record
from mbtune.runs.rundir import TRIAL_COLUMNS, RunDir

__all__ = [
    "COLUMNS",
    "SIZES",
    "SUMMARY_FILE",
    "RunInfo",
    "load_recommendations",
    "load_run",
    "load_runs",
    "run_info",
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
    stages = _experiment(run).train_input.pipeline_stages
    frame, unusable = _typed_frame(header, records, stages)
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
        "repeat": numbers["repeat"].fillna(0),  # older runs measured each configuration once
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


def _experiment(run: RunDir) -> Experiment:
    """The typed experiment the run saved; one that this mbtune cannot read is an error
    that names the file."""
    try:
        return load_run_experiment(run.path)
    except MbtuneError as e:
        raise MbtuneError(f"RUN_DIR: cannot read {run.experiment_file}: {e}") from None


# ---------------------------------------------------------------------------
# what else the run directory says


@dataclass(frozen=True, kw_only=True)
class RunInfo:
    """The rest of a run directory: its settings, summary and recommendation stream."""

    path: Path
    """The run directory."""
    experiment: Experiment
    """The experiment the run saved (experiment.yaml), typed and validated."""
    summary: Mapping[str, Any] | None
    """summary.json; None while the run has not finished (or was killed)."""
    recommendations: pd.DataFrame | None
    """recommendations.jsonl, one row per record; None where the run has none."""

    @property
    def name(self) -> str:
        """The experiment's name."""
        return self.experiment.name

    @property
    def objective(self) -> str:
        """The column the search maximised: samples_per_s or samples_per_s_per_device."""
        return self.experiment.search.objective

    @property
    def device_memory_bytes(self) -> int | None:
        """The memory budget per device (trial.device_memory); None: no budget."""
        return self.experiment.trial.device_memory

    @property
    def confidence_target(self) -> int:
        """The confidence score at which the search stops."""
        return self.experiment.search.confidence_target


def run_info(run_dir: str | Path) -> RunInfo:
    """The rest of the run in ``run_dir``: its experiment, summary and recommendations."""
    run = RunDir.open(run_dir)
    return RunInfo(
        path=run.path,
        experiment=_experiment(run),
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
