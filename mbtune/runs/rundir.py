"""The run directory: everything a search writes, as it goes, so nothing is ever lost;
and trials.csv's one reader (:func:`read_trials`), which every reader of a run uses (the
resumed search, its searcher catching up, ``load_run``).

NAME-YYYYmmdd-HHMMSS/
    experiment.yaml   the resolved experiment
    trials.csv        one row per finished trial (mbtune.runs.record), appended and flushed
                      at once
    recommendations.jsonl  the recommendation after each finished trial (one JSON a line)
    summary.json      the final summary (written atomically)
    plan.csv          the plan, where ``mbtune plan`` or ``mbtune analyze`` planned the run
                      (mbtune.plan.Plan.as_frame; plot-plan.png its plot)
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mbtune.errors import MbtuneError
from mbtune.lattice import LatticeError
from mbtune.runs.record import CSV_COLUMNS, SIZES, TrialRecord, cell

__all__ = ["PLAN_FILE", "SUMMARY_FILE", "TRIAL_COLUMNS", "RunDir", "Trials", "read_trials"]

SUMMARY_FILE = "summary.json"
"""The end of a run: written once, when the search ends (atomically); none while it runs."""
PLAN_FILE = "plan.csv"
"""The plan as a table (every configuration considered at each planned device count, with
its 90% intervals: mbtune.plan.Plan.as_frame), where the run was planned."""

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
    def plan_file(self) -> Path:
        return self.path / PLAN_FILE

    @property
    def recommendations_file(self) -> Path:
        return self.path / "recommendations.jsonl"

    @property
    def optuna_url(self) -> str:
        return f"sqlite:///{(self.path / 'optuna.db').resolve()}"

    def write_experiment(self, resolved: Mapping[str, Any]) -> None:
        _atomic_write(self.experiment_file, yaml.safe_dump(dict(resolved), sort_keys=False))

    def append_trial(self, record: TrialRecord | Mapping[str, Any]) -> None:
        """Append one finished trial and flush it to disk before returning: a record, or
        a mapping of columns to values (as a test writes a row by hand).

        A row is one write of the whole line, fsync'd. Should the machine die in the
        middle of one, the torn line is cut off here before the next row is appended (and
        :func:`read_trials` never reads it), so it cannot corrupt the next.
        """
        row = record.to_row() if isinstance(record, TrialRecord) else record
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
        writer.writerow({k: cell(v) for k, v in row.items()})
        with self.trials_file.open("a", newline="", encoding="utf-8") as f:
            f.write(text.getvalue())
            f.flush()
            os.fsync(f.fileno())
        if new:
            _fsync_dir(self.path)

    def _header(self) -> tuple[str, ...]:
        with self.trials_file.open(newline="", encoding="utf-8") as f:
            return tuple(next(csv.reader(f), ()))

    def records(self) -> list[TrialRecord]:
        """Every finished trial so far (also from a run that was interrupted or killed)."""
        return list(read_trials(self.trials_file).records)

    def trials(self) -> list[dict[str, str]]:
        """The same trials as text, each a row keyed by trials.csv's own header: what the
        file says, for a person or a test to look at (mbtune reads :meth:`records`)."""
        read = read_trials(self.trials_file)
        rows = [r.to_row() for r in read.records]
        return [{c: row.get(c, "") for c in read.header} for row in rows]

    def append_recommendation(self, record: Mapping[str, Any]) -> None:
        """Append one recommendation record and flush it to disk before returning; a line
        a killed driver left without its end is ended first, so it cannot swallow this one."""
        torn = self.recommendations_file.is_file() and not _ends_a_line(self.recommendations_file)
        with self.recommendations_file.open("a", encoding="utf-8") as f:
            f.write(("\n" if torn else "") + json.dumps(dict(record)) + "\n")
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
    """Cut the torn end of a write off ``path``, by :func:`read_trials`'s rule: what it
    never reads is cut; a row torn between its \\r and \\n, which it reads, gets its \\n."""
    with path.open("rb+") as f:
        data = f.read()
        if data.endswith(b"\r"):
            f.write(b"\n")
        elif data and not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
        else:
            return
        f.flush()
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------
# the one reader


@dataclass(frozen=True)
class Trials:
    """What trials.csv holds, as :func:`read_trials` reads it."""

    header: tuple[str, ...]
    """trials.csv's own header: a run begun by an older mbtune has fewer columns, a newer
    one may have more."""
    records: tuple[TrialRecord, ...]
    """Every finished trial, in the file's order."""
    dropped: int
    """Rows that are no finished trial (see :func:`read_trials`), skipped."""


def read_trials(path: Path) -> Trials:
    """Every finished trial in the trials.csv at ``path``; none where it does not exist yet.

    The one rule for a half-written row: a row is written whole, \\r\\n included, in one
    write; a driver killed in the middle of one leaves a last line with no line end. So a
    row counts once its line end was begun (its \\r, or \\n): the text after the last
    line end is a torn row and never a trial. Of the rest, a row is a finished trial when it
    holds the header's number of fields and its trial number and sizes are whole numbers
    that form a configuration (:meth:`TrialRecord.from_row`). Every other row is dropped
    and counted (``dropped``). The writer (:meth:`RunDir.append_trial`) cuts exactly the
    torn row before it appends, so a resumed run never glues a row to it.
    """
    try:
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
    except FileNotFoundError:
        return Trials(CSV_COLUMNS, (), 0)
    whole = text if text.endswith("\r") else text[: text.rfind("\n") + 1]
    if not whole:
        return Trials(CSV_COLUMNS, (), 0)  # killed while writing the header: no trial yet
    try:
        rows = [r for r in csv.reader(io.StringIO(whole, newline="")) if r]
    except csv.Error as e:
        raise MbtuneError(f"RUN_DIR: {path} is not a CSV file ({e})") from None
    header, body = tuple(rows[0]) if rows else CSV_COLUMNS, rows[1:]
    missing = [c for c in (*SIZES, "status") if c not in header]
    if missing:
        raise MbtuneError(
            f"RUN_DIR: {path} lacks the column(s) {', '.join(missing)}; an mbtune "
            f"trials.csv starts with the header {','.join(CSV_COLUMNS[:6])},..."
        )
    records = []
    for fields in body:
        if len(fields) != len(header):
            continue
        try:
            records.append(TrialRecord.from_row(dict(zip(header, fields, strict=True))))
        except (ValueError, OverflowError, LatticeError):
            continue  # no trial number, or sizes that are no configuration
    torn = bool(text[len(whole) :].strip())
    return Trials(header, tuple(records), len(body) - len(records) + torn)


def _ends_a_line(path: Path) -> bool:
    """Whether ``path`` is empty or its last byte ends a line."""
    with path.open("rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() == 0:
            return True
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
