"""``mbtune watch RUN_DIR``: a run directory followed as it is written.

It reads only what the run directory holds (experiment.yaml, trials.csv through the one
reader, recommendations.jsonl, summary.json), never Ray, so it follows a search running on
another machine of a shared filesystem as well as one here, or shows a finished one. It
polls the files: what it shows is the stream's current recommendation line, the best
configurations so far (as the stream's latest record ranks them: the one order of
"best"), and two bars, the trials against ``search.num_samples`` and the
confidence score against ``search.confidence_target``. On a terminal the view is redrawn
in place; elsewhere (a log, a pipe) a plain copy is printed each time it changes. It ends,
with exit code 0, once the run's summary.json is written, or on Ctrl-C.

Pure: no torch, no ray, no pandas.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from mbtune.config.load import load_experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.report import stream_line, tie_line
from mbtune.report.words import shown_columns
from mbtune.runs.record import TrialRecord
from mbtune.runs.rundir import SUMMARY_FILE, RunDir, read_trials

__all__ = ["RunView", "Watcher", "view_lines", "watch"]

BAR_WIDTH = 30
TOP = 5
"""Configurations in the table of the best."""


@dataclass(frozen=True, kw_only=True)
class RunView:
    """What a run directory says at one moment, as ``mbtune watch`` shows it."""

    path: Path
    name: str
    budget: int
    """search.num_samples: the trials the run may measure."""
    target: int
    """search.confidence_target: the score at which the search stops (100: never)."""
    records: tuple[TrialRecord, ...]
    recommendation: Mapping[str, Any] | None
    """The last record of recommendations.jsonl; None before the first."""
    summary_status: str | None
    """summary.json's status once the run has ended (None while it runs)."""


def view_lines(view: RunView) -> list[str]:
    """The view, as lines: the recommendation as the stream says it, the bars, the best."""
    failed = sum(r.status != "ok" for r in view.records)
    lines = [f"mbtune watch: {view.name} in {view.path}"]
    rec = view.recommendation
    if rec is None:
        lines.append("no recommendation yet: no trial has run successfully")
    else:
        lines.append(_recommendation_line(rec))
        if rec.get("tie"):
            lines.append(tie_line(rec["tie"]))
    done = len(view.records)
    not_ok = f" ({failed} not ok)" if failed else ""
    lines.append(f"trials      {_bar(done, view.budget)} {done} of {view.budget}{not_ok}")
    confidence = int(rec["confidence"]) if rec is not None else 0
    if view.target < 100:
        lines.append(
            f"confidence  {_bar(confidence, view.target)} {confidence} of target {view.target}"
        )
    else:  # the score is 0..99: a target of 100 is never reached
        lines.append(f"confidence  {_bar(confidence, 99)} {confidence} (no target: runs to the "
                     f"budget)")  # fmt: skip
    lines += _best_table(rec.get("ranking") or [] if rec is not None else [])
    if view.summary_status is not None:
        lines.append(f"the run has ended ({view.summary_status}): {view.path / SUMMARY_FILE}")
    return lines


def _recommendation_line(rec: Mapping[str, Any]) -> str:
    """The stream's line of a recommendations.jsonl record (the search printed the same)."""
    return stream_line(
        made_at=str(rec.get("time", "")),
        config=BatchConfig.from_mapping(rec),
        estimated_performance=float(rec["estimated_performance"]),
        confidence=int(rec["confidence"]),
        precision=rec.get("precision"),
        mfu=rec.get("mfu"),
        sharding=rec.get("sharding"),
    )


def _bar(done: float, whole: float) -> str:
    filled = round(BAR_WIDTH * min(max(done / whole, 0.0), 1.0)) if whole > 0 else 0
    return "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"


def _best_table(ranking: Sequence[Mapping[str, Any]]) -> list[str]:
    """The best configurations so far, in the one order of "best": the stream's latest
    ranking (mbtune.recommend.reporter.ranking: the recommendation first, then by the
    model's estimate), with the model's estimate of each one's samples/s and how often it
    was measured. Nothing before the first recommendation."""
    ranked = [(BatchConfig.from_mapping(e), e) for e in ranking][:TOP]
    if not ranked:
        return []
    # a layout's or a step's setting only where a configuration has it off its default
    shown = shown_columns([c for c, _ in ranked])
    heads = "".join(f"  {label}" for label, _ in shown)
    lines = ["best configurations:",
             f"  {'rank':>4}  {'num_devices':>11}  {'batch_size':>10}  {'micro_batch_size':>16}"
             f"{heads}  {'grad_accum':>10}  {'est. samples/s':>14}  {'looks':>5}"]  # fmt: skip
    for i, (c, entry) in enumerate(ranked, start=1):
        speed = entry.get("estimated_samples_per_s")
        estimate = f"{speed:,.1f}" if isinstance(speed, int | float) else "-"
        on = "".join(f"  {words[i - 1]}" for _, words in shown)
        lines.append(
            f"  {i:>4}  {c.num_devices:>11}  {c.batch_size:>10}  {c.micro_batch_size:>16}{on}"
            f"  {c.grad_accum_steps:>10}  {estimate:>14}  {entry.get('measurements', 1):>5}"
        )
    return lines


class Watcher:
    """A run directory read again each time :meth:`poll` is called; it re-reads a file
    only when its size or modification time changed."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run = RunDir.open(run_dir)
        try:
            exp = load_experiment(self.run.experiment_file)
        except MbtuneError as e:
            raise MbtuneError(f"RUN_DIR: cannot read {self.run.experiment_file}: {e}") from None
        self.name, self.budget = exp.name, exp.search.num_samples
        self.target = exp.search.confidence_target
        self._stamps: dict[str, tuple[int, int] | None] = {}
        self._records: tuple[TrialRecord, ...] = ()
        self._recommendation: Mapping[str, Any] | None = None
        self._status: str | None = None
        self._shown: list[str] | None = None

    @property
    def ended(self) -> bool:
        """Whether the run's summary.json has been written (it ended, or was stopped)."""
        return self._status is not None

    def view(self) -> RunView:
        """What the run directory holds now."""
        if self._changed(self.run.trials_file):
            self._records = read_trials(self.run.trials_file).records
        if self._changed(self.run.recommendations_file):
            history = self.run.recommendations()
            self._recommendation = history[-1] if history else None
        summary = self.run.path / SUMMARY_FILE
        if self._changed(summary):
            self._status = _summary_status(summary)
        return RunView(
            path=self.run.path, name=self.name, budget=self.budget, target=self.target,
            records=self._records, recommendation=self._recommendation,
            summary_status=self._status,
        )  # fmt: skip

    def poll(self) -> list[str] | None:
        """The view's lines where they changed since the last poll, else None."""
        lines = view_lines(self.view())
        if lines == self._shown:
            return None
        self._shown = lines
        return lines

    def _changed(self, path: Path) -> bool:
        try:
            st = path.stat()
            stamp: tuple[int, int] | None = (st.st_size, st.st_mtime_ns)
        except FileNotFoundError:
            stamp = None
        changed = self._stamps.get(path.name, ...) != stamp
        self._stamps[path.name] = stamp
        return changed


def _summary_status(path: Path) -> str | None:
    """summary.json's status; None while there is none (or it is not yet whole: it is
    written atomically, so this is only a file someone else put there)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return str(data.get("status", "ended")) if isinstance(data, dict) else "ended"


def watch(run_dir: str | Path, *, interval_s: float = 1.0, out: TextIO | None = None) -> int:
    """Follow the run in ``run_dir`` until its summary.json is written (exit code 0), or
    Ctrl-C (0, nothing more printed); ``interval_s``: how often the files are polled."""
    if not interval_s > 0 or not math.isfinite(interval_s):
        raise MbtuneError(f"--interval: must be a number of seconds above 0, got {interval_s}")
    out = out or sys.stdout
    watcher = Watcher(run_dir)
    live = out.isatty()
    drawn = 0
    try:
        while True:
            lines = watcher.poll()
            if lines is not None:
                if live:
                    drawn = _redraw(out, lines, drawn)
                else:
                    out.write("\n".join(lines) + "\n\n")
                out.flush()
            if watcher.ended:
                return 0
            time.sleep(interval_s)
    except KeyboardInterrupt:
        return 0  # the view stands as the last poll left it


def _redraw(out: TextIO, lines: list[str], drawn: int) -> int:
    """Replace the ``drawn`` terminal rows last written with ``lines``; the rows they take
    (a line wider than the terminal wraps)."""
    width = max(shutil.get_terminal_size().columns, 1)
    if drawn:
        out.write(f"\x1b[{drawn}F\x1b[J")  # to the first row drawn, and clear below
    out.write("\n".join(lines) + "\n")
    return sum(max(1, math.ceil(len(line) / width)) for line in lines)
