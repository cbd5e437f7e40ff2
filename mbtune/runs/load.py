"""A run directory read back: its trials as pandas, its typed experiment, and the rest of
what it says.

Pure: pandas and numpy, never torch nor ray. It reads a finished run, an interrupted one
(no summary.json) and one whose driver was killed (trials.csv may end in half a row,
which is dropped and counted). mbtune.runs.rundir writes what this reads, and reads
trials.csv for it (``read_trials``: the one rule for a half-written row).

``load_run(RUN_DIR)`` gives one row per trial with the columns of :mod:`mbtune.runs.record`
(``COLUMNS``; docs/analysis.md lists them with their dtypes). Times are in ms unless the
name ends in ``_s``; memory in bytes; a figure that was not measured (a failed trial, a
CPU without tokens) is NaN.

``load_runs([...])`` puts several runs in one frame, with a first column ``run``.
``run_info(RUN_DIR)`` gives the rest: the experiment's settings, summary.json and the
recommendation stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mbtune.config.experiment import Experiment
from mbtune.config.load import load_experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.runs import record
from mbtune.runs.record import TrialRecord
from mbtune.runs.rundir import SUMMARY_FILE, RunDir, read_trials

__all__ = [
    "COLUMNS",
    "RunInfo",
    "load_recommendations",
    "load_run",
    "load_run_experiment",
    "load_runs",
    "ranking",
    "run_info",
]

MODEL_COLUMNS = ("model_rank", "estimated_samples_per_s")
"""What the search's model says of each trial's configuration, as the run's latest
recommendation ranked them (its ``ranking``: summary.json's, or the stream's last record
while the run goes on): its place, 1 for the recommendation, and its estimated samples/s.
NaN where the run ranked none (a failed configuration, a run from before rankings)."""

COLUMNS = (*(c.name for c in record.COLUMNS), *MODEL_COLUMNS)
"""The columns of :func:`load_run`, in order (a newer trials.csv may add more after)."""

try:
    _TEXT: Any = pd.StringDtype(na_value=np.nan)  # what pandas 3 calls "str"; missing: NaN
except TypeError:  # pandas < 2.3
    _TEXT = object


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
    trials = read_trials(run.trials_file)
    frame = _typed_frame(trials.header, trials.records, ranking(run.path))
    frame.attrs["dropped_rows"] = trials.dropped
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


def _typed_frame(
    header: Sequence[str],
    records: Sequence[TrialRecord],
    ranked: Sequence[Mapping[str, Any]] = (),
) -> pd.DataFrame:
    """The records as the typed columns of COLUMNS (then a newer trials.csv's own, as
    text); what an older run did not record is completed from the sizes (P, g), or its
    default."""
    columns: dict[str, Any] = {}
    for c in record.COLUMNS:
        values = [_completed(r, c.name) for r in records]
        if c.kind == "int":
            columns[c.name] = pd.Series(values, dtype="int64")
        elif c.kind == "float":
            columns[c.name] = pd.Series(
                [np.nan if v is None else float(v) for v in values], dtype="float64"
            )
        elif c.kind == "bool":
            columns[c.name] = pd.Series(values, dtype=bool)
        elif c.kind in ("ints", "floats"):
            columns[c.name] = pd.Series([list(v) for v in values], dtype=object)
        elif c.kind == "datetime":
            columns[c.name] = pd.to_datetime(
                pd.Series(values, dtype=object), errors="coerce", format="ISO8601"
            )
        else:
            columns[c.name] = _text(values)
    columns.update(_model_columns(records, ranked))
    for name in header:  # columns a newer trials.csv may add: kept as text
        if name not in columns:
            cells = [dict(r.extras).get(name, "").strip() or None for r in records]
            columns[name] = _text(cells)
    return pd.DataFrame(columns)


def _model_columns(
    records: Sequence[TrialRecord], ranked: Sequence[Mapping[str, Any]]
) -> dict[str, pd.Series]:
    """:data:`MODEL_COLUMNS` for each record: its canonical configuration's place in the
    run's ranking and the model's estimate of its samples/s."""
    place = {BatchConfig.from_mapping(e): (float(i), e.get("estimated_samples_per_s"))
             for i, e in enumerate(ranked, start=1)}  # fmt: skip
    found = [place.get(r.config.canonical(), (np.nan, None)) for r in records]
    estimates = [np.nan if e is None else float(e) for _, e in found]
    return {
        "model_rank": pd.Series([i for i, _ in found], dtype="float64"),
        "estimated_samples_per_s": pd.Series(estimates, dtype="float64"),
    }


_COMPLETED = ("per_device_batch", "grad_accum_steps")
"""Columns an older run may lack, which follow from the sizes."""


def _completed(r: TrialRecord, name: str) -> Any:
    """The record's value of column ``name``; where an older run did not record P or g,
    what follows from the sizes."""
    value = getattr(r, name)
    if value is not None or name not in _COMPLETED:
        return value
    return {"per_device_batch": r.config.per_device_batch,
            "grad_accum_steps": r.config.grad_accum_steps}[name]  # fmt: skip


def _text(values: Sequence[str | None]) -> pd.Series:
    return pd.Series(values, dtype=object).astype(_TEXT)


def load_run_experiment(run_dir: str | Path) -> Experiment:
    """The typed experiment a run directory saved (its ``experiment.yaml``).

    The saved experiment is resolved (Experiment.to_dict: the table's absolute path, the
    space inline), and reading it opens no file it names: a run whose replay table or
    user model is gone still reads, as long as it is a valid experiment.
    """
    run = RunDir.open(run_dir)
    return load_experiment(run.experiment_file)


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


def ranking(run_dir: str | Path) -> list[dict[str, Any]]:
    """The one order of "best" the run wrote (mbtune.recommend.reporter.ranking):
    summary.json's, else the stream's last record's while the run goes on; empty where
    it wrote none."""
    run = RunDir(Path(run_dir))
    summary = _summary(run) or {}
    ranked = summary.get("ranking")
    if not isinstance(ranked, list) and run.recommendations_file.is_file():
        stream = run.recommendations()
        ranked = stream[-1].get("ranking") if stream else None
    return [e for e in ranked if isinstance(e, Mapping)] if isinstance(ranked, list) else []


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
