"""The run directory: everything a search writes, as it goes, so nothing is ever lost.

NAME-YYYYmmdd-HHMMSS/
    experiment.yaml   the resolved experiment
    trials.csv        one row per finished trial, appended and flushed at once
    recommendations.jsonl  the recommendation after each finished trial (one JSON a line)
    summary.json      the final summary (written atomically)
    optuna.db         the Optuna study (open it with optuna-dashboard)
    ray/              Ray Tune's own experiment state
"""

from __future__ import annotations

import csv
import io
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from mbtune.errors import MbtuneError
from mbtune.runs.record import CSV_COLUMNS

__all__ = ["TRIAL_COLUMNS", "RunDir"]

TRIAL_COLUMNS = CSV_COLUMNS
"""The columns of trials.csv: mbtune.runs.record says what each holds."""


class RunDir:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)

    @classmethod
    def create(cls, output_dir: Path, name: str) -> RunDir:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path = Path(output_dir) / f"{name}-{stamp}"
        suffix = 1
        while path.exists():
            suffix += 1
            path = Path(output_dir) / f"{name}-{stamp}-{suffix}"
        path.mkdir(parents=True)
        return cls(path)

    @classmethod
    def open(cls, path: str | Path, *, flag: str = "RUN_DIR") -> RunDir:
        run = cls(Path(path))
        if not (run.path / "experiment.yaml").is_file():
            raise MbtuneError(
                f"{flag}: {path} is not an mbtune run directory (it has no experiment.yaml)"
            )
        return run

    @property
    def experiment_file(self) -> Path:
        return self.path / "experiment.yaml"

    @property
    def trials_file(self) -> Path:
        return self.path / "trials.csv"

    @property
    def recommendations_file(self) -> Path:
        return self.path / "recommendations.jsonl"

    @property
    def ray_dir(self) -> Path:
        return self.path / "ray"

    @property
    def optuna_url(self) -> str:
        return f"sqlite:///{(self.path / 'optuna.db').resolve()}"

    def write_experiment(self, resolved: Mapping[str, Any]) -> None:
        _atomic_write(self.experiment_file, yaml.safe_dump(dict(resolved), sort_keys=False))

    def append_trial(self, row: Mapping[str, Any]) -> None:
        """Append one finished trial and flush it to disk before returning.

        A row is one write of the whole line, fsync'd. Should the machine die in the
        middle of one, the torn line has no line end: it is cut off here before the next
        row is appended (and :meth:`trials` never reads it), so it cannot corrupt the next.
        """
        if self.trials_file.exists():
            _drop_torn_line(self.trials_file)
        new = not self.trials_file.exists() or self.trials_file.stat().st_size == 0
        # a run begun by an older mbtune (resumed) keeps its own columns: a row never
        # holds more fields than the header it is read with
        columns = TRIAL_COLUMNS if new else self._header() or TRIAL_COLUMNS
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=columns, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow({k: _cell(v) for k, v in row.items()})
        with self.trials_file.open("a", newline="", encoding="utf-8") as f:
            f.write(text.getvalue())
            f.flush()
            os.fsync(f.fileno())
        if new:
            _fsync_dir(self.path)

    def _header(self) -> tuple[str, ...]:
        with self.trials_file.open(newline="", encoding="utf-8") as f:
            return tuple(next(csv.reader(f), ()))

    def trials(self) -> list[dict[str, str]]:
        """Every finished trial so far (also from a run that was interrupted or killed)."""
        if not self.trials_file.exists():
            return []
        with self.trials_file.open(newline="", encoding="utf-8") as f:
            text = f.read()
        if not text.endswith("\n"):  # a torn last line: that trial never finished writing
            text = text[: text.rfind("\n") + 1]
        rows = csv.DictReader(io.StringIO(text))
        # a row with too few fields (None values) or too many (a None key) is not a trial
        return [r for r in rows if r.get("trial") and None not in r and None not in r.values()]

    def append_recommendation(self, record: Mapping[str, Any]) -> None:
        """Append one recommendation record and flush it to disk before returning."""
        with self.recommendations_file.open("a", encoding="utf-8") as f:
            f.write(json.dumps(dict(record)) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def recommendations(self) -> list[dict[str, Any]]:
        """Every recommendation so far; a line that is not a JSON object (one cut short by
        a killed driver) is skipped."""
        if not self.recommendations_file.is_file():
            return []
        text = self.recommendations_file.read_bytes().decode("utf-8", errors="replace")
        records = []
        for line in text.splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
        return records

    def write_json(self, name: str, data: Any) -> None:
        _atomic_write(self.path / name, json.dumps(data, indent=2, default=str) + "\n")


def _cell(value: Any) -> Any:
    if isinstance(value, list | tuple):
        return " ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in value)
    return "" if value is None else value


def _atomic_write(path: Path, text: str) -> None:
    """Write to a temporary file and rename it: a crash never leaves half a file.

    Readers see the old file or the new one, whole. A failure (disk full, an interrupt)
    removes the temporary file and leaves the old one as it was.
    """
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # the rename itself survives a power cut


def _fsync_dir(path: Path) -> None:
    """Make a new or renamed directory entry durable (a no-op where it is unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _drop_torn_line(path: Path) -> None:
    """Cut a last line that has no line end (a write torn by a crash) off ``path``."""
    with path.open("rb+") as f:
        data = f.read()
        if data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
            f.flush()
            os.fsync(f.fileno())
