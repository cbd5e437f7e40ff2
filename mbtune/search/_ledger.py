"""What a finished trial becomes: a trials.csv row, a trial of the run's Optuna study, a
line of the stream, the next recommendation; and when the search may stop. Ray Tune
callbacks (they run in the driver, one trial at a time).

A finished trial becomes one TrialRecord (mbtune.runs.record), built once from what the
trial reported, kept in memory and written as its row; trials.csv is read back (by
RunDir's one reader) only when a resumed search restores its callbacks from Ray's state.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune import Callback

from mbtune import progress
from mbtune.cluster import EXIT_CLUSTER_LOST
from mbtune.config.search import SearchConfig
from mbtune.lattice import BatchConfig
from mbtune.recommend.reporter import Reporter
from mbtune.report import trial_line
from mbtune.runs.record import TrialRecord
from mbtune.runs.rundir import SUMMARY_FILE, TRIAL_COLUMNS, RunDir
from mbtune.search._space import OptunaSpace
from mbtune.search._stopping import settled
from mbtune.search._study import SearchStudy
from mbtune.trial.launch import unpack_result

__all__ = [
    "LEDGER_LOCK",
    "ConfidenceStop",
    "TrialLog",
    "TrialProgress",
    "head_lost",
    "print_line",
    "settled_after",
]

LEDGER_LOCK = threading.Lock()
"""Held while a finished trial is written, so that a search ended by a lost head never
leaves one half-written."""


def print_line(line: str) -> None:
    """Print one line now. Not ``print`` itself: Tune pickles the callbacks with its
    experiment state, and once Ray has replaced ``builtins.print`` (it does to show worker
    output, on a cluster or with --verbose) the original no longer pickles. Above the
    progress line, where one is shown (mbtune.progress)."""
    progress.echo(line)


class TrialLog(Callback):
    """After every finished trial: append it to trials.csv (flushed), print its line, then
    the reporter's recommendation (printed and appended to recommendations.jsonl), and
    decide whether the search may stop (:func:`mbtune.search.settled`)."""

    def __init__(
        self,
        run: RunDir,
        echo: Any,
        reporter: Reporter,
        *,
        target: int = 90,
        max_repeats: int = SearchConfig.max_repeats,
    ) -> None:
        self.run, self.echo, self.reporter = run, echo, reporter
        self.target, self.max_repeats = target, max_repeats
        self.results: dict[str, dict[str, Any]] = {}
        self.settled = False
        """The confidence score reached its target and the leader was measured twice."""
        self._rows: list[TrialRecord] | None = []
        self._history: list[dict[str, Any]] | None = []
        self._study: SearchStudy | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Tune saves the callbacks with its state; a resumed search reads the records back
        # from the run directory, which holds every trial finished since that save too
        return {**self.__dict__, "_rows": None, "_history": None, "_study": None}

    def _records(self) -> tuple[list[TrialRecord], list[dict[str, Any]]]:
        if self._rows is None or self._history is None:  # restored: read the run back
            self._rows, self._history = self.run.records(), self.run.recommendations()
        return self._rows, self._history

    def study(self) -> SearchStudy:
        """The run's Optuna study, which it tells each finished trial after its row."""
        if getattr(self, "_study", None) is None:  # None too where restored from an older run
            self._study = SearchStudy.at(self.run.optuna_url,
                                         OptunaSpace(self.reporter.model.points))  # fmt: skip
        return self._study

    @property
    def rows(self) -> list[TrialRecord]:
        """Every finished trial of the run, in order."""
        return self._records()[0]

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every recommendation of the run, in order."""
        return self._records()[1]

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.results[trial.trial_id] = unpack_result(result)

    def on_trial_complete(self, iteration, trials, trial, **info):
        result = self.results.pop(trial.trial_id, None)
        if result is not None:  # None: stopped before it reported, e.g. once confident
            self._finish(trial, result)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._finish(trial, self.results.pop(trial.trial_id, None), crashed=True)

    def _finish(self, trial: Any, result: dict | None, crashed: bool = False) -> None:
        with LEDGER_LOCK:  # a finished trial is written whole (row, recommendation) or not
            row = self._record(trial, result, crashed)
            if row is None:
                return
            # the study after the row: a driver killed between the two leaves the study a
            # row short, which it catches up with on --resume (SearchStudy.catch_up)
            mixes = {"mixes_batch": True} if (result or {}).get("mixes_batch") else {}
            self.study().tell(row, crashed=crashed, **mixes)
            self.echo(trial_line(row))
            rec = self.reporter.update(self.rows, self.history)
            if rec is not None:
                self.run.append_recommendation(rec.record())
                self.history.append(rec.record())
                self.echo(rec.line())
                self.study().publish(rec.line(), confidence=rec.confidence,
                                     target=self.target, trials=len(self.rows))  # fmt: skip
                self.settled = settled_after(
                    self.reporter, self.rows, target=self.target, max_repeats=self.max_repeats
                )
            # the board's Ray metrics: the very records just written (mbtune.metrics)
            progress.recorded(row, self.history[-1] if rec is not None else None)

    def _record(self, trial: Any, result: dict | None, crashed: bool) -> TrialRecord | None:
        if any(r.trial_id == trial.trial_id for r in self.rows):
            return None  # recorded before an interruption; Ray's state had not caught up
        row: dict[str, Any] = {
            **BatchConfig.from_mapping(trial.config).sizes(),
            "repeat": int(trial.config.get("repeat", 0)),
            "status": "error",
            "reason": "no result",
        }
        if crashed and result is None:
            row["node_id"] = progress.node_of(trial.trial_id)
            reason = _actor_failure(trial)
            # Ray says an actor is unavailable when its connection broke, as when its node
            # went away; it says so before its health checks have marked the node dead
            wait_s = NODE_DEATH_WAIT_S if "unavailable" in reason else 0.0
            if _is_lost(row["node_id"], wait_s):
                reason = _actor_failure(trial, lost_node=True)
            row["reason"] = reason
        row.update({k: v for k, v in (result or {}).items() if k in TRIAL_COLUMNS})
        row["trial"] = len(self.rows) + 1
        row["trial_id"] = trial.trial_id
        row["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        record = TrialRecord.from_result(row)
        self.run.append_trial(record)
        self.rows.append(record)
        return record


def settled_after(
    reporter: Reporter, rows: list[TrialRecord], *, target: int, max_repeats: int
) -> bool:
    """Whether a search may stop after ``rows`` (:func:`mbtune.search.settled`, on the
    reporter's search model: the one the searcher proposes with)."""
    return settled(reporter.assess(rows), target=target, max_repeats=max_repeats,
                   noise_floor=reporter.model.noise_floor)  # fmt: skip


def _actor_failure(trial: Any, *, lost_node: bool = False) -> str:
    """Why a trial's Ray actor failed (its node lost, the actor killed), in one line, from
    the error Tune recorded; ``lost_node``: the cluster no longer has the node it ran on."""
    path = getattr(trial, "error_file", None)
    try:
        text = Path(path).read_text(errors="replace") if path else ""
    except OSError:
        text = ""
    last = text.rsplit("Failure # ", 1)[-1].splitlines()[1:]  # Tune's header line, then Ray's
    words = " ".join(line.strip() for line in last if line.strip())
    what = "the node the trial ran on was lost" if lost_node else "the trial actor failed"
    return what + (f": {words[:300]}" if words else "")


NODE_DEATH_WAIT_S = 30.0
"""How long a crashed trial's row waits for the cluster to say whether its node died: Ray
marks a node dead after its health checks fail (about 15 s by default), while the trial's
actor is seen to fail at once."""


def _is_lost(node_id: str | None, wait_s: float = NODE_DEATH_WAIT_S) -> bool:
    """Whether the cluster knows ``node_id`` as a node that is no longer alive, asked until
    it says so or ``wait_s`` has passed (a node that answers its health checks is alive)."""
    if not node_id:
        return False
    deadline = time.monotonic() + wait_s
    while True:
        try:
            alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
        except Exception:  # noqa: BLE001 - without the cluster's word, the failure stands
            return False
        if not alive.get(node_id, True):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


class TrialProgress(Callback):
    """Tells the progress display (mbtune.progress) which trials run; it keeps no state,
    so that it pickles with Tune's."""

    def on_trial_start(self, iteration, trials, trial, **info):
        progress.started(trial.trial_id, BatchConfig.from_mapping(trial.config))

    def on_trial_complete(self, iteration, trials, trial, **info):
        progress.ended(trial.trial_id)

    def on_trial_error(self, iteration, trials, trial, **info):
        progress.ended(trial.trial_id)


class ConfidenceStop(tune.Stopper):
    """Stops the search once the trial log says it is settled."""

    def __init__(self, log: TrialLog) -> None:
        self.log = log

    def __call__(self, trial_id: str, result: dict) -> bool:
        return False  # a trial reports once; only the whole search is stopped

    def stop_all(self) -> bool:
        return self.log.settled


def head_lost(cluster: str, run: RunDir, reporter: Reporter, silent_s: float) -> None:
    """The cluster's head went away: Tune's loop waits on it and cannot return. Every
    finished trial is in trials.csv already; write the summary (interrupted, and why), say
    so in one line and exit. The trial in flight was not measured: --resume runs it."""
    with LEDGER_LOCK:  # no row is being written now, and none will be
        rows = run.records()
        summary = reporter.summary(rows, "interrupted", run.recommendations())
        summary["reason"] = f"the Ray cluster's head node ({cluster}) went away"
        run.write_json(SUMMARY_FILE, summary)
        sys.stdout.flush()
        print(
            f"mbtune: error: the Ray cluster's head node ({cluster}) has not answered for "
            f"{silent_s:.0f} s; {run.trials_file} holds the {len(rows)} finished trial(s); "
            f"continue with: mbtune run --resume {run.path} (and --address of a cluster)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_CLUSTER_LOST)  # Tune's loop waits on the dead cluster: it cannot return
