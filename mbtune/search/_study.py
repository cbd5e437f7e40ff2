"""The run's Optuna study (:class:`SearchStudy`, in optuna.db), whatever the sampler: every
trial of the search one trial of the study, asked when it starts and told when it
finishes, with its configuration as the user names it and everything it measured as user
attributes; configurations predicted out of memory as pruned trials with their reason; no
trial left running by an interrupted driver; the current recommendation as the study's
note and user attributes.

The study is what the samplers read (mbtune.search._history); trials.csv, written first,
is the record a killed driver cannot lose: :meth:`SearchStudy.catch_up` tells the study
every row it lacks, so that after a kill the two agree again.

Optuna's own parameters are the space's encoding (``num_devices_index``,
``micro_batch_size_log2``: mbtune.search._space.OptunaSpace); the user attributes are what a
person looks for (``batch_size``, ``num_devices``, ``micro_batch_size``, ``samples_per_s``,
``status``, ...): each non-empty column of the trial's row of trials.csv. Public Optuna API
only: a trial's attributes are set through the storage's own methods, before the trial is
told (a finished trial is frozen).
"""

from __future__ import annotations

import functools
import os
import sqlite3
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from mbtune.lattice import BatchConfig
from mbtune.runs.record import CONFIG_KEY, CSV_COLUMNS, TrialRecord
from mbtune.search._space import OptunaSpace

__all__ = [
    "CACHED",
    "DUPLICATE",
    "INTERRUPTED",
    "RECOMMENDATION_ATTR",
    "STUDY_NAME",
    "WARM_START",
    "SearchStudy",
    "config_attrs",
    "finished_order",
    "publish",
    "record_attrs",
    "record_of",
    "records_of",
    "storage_for",
]

STUDY_NAME = "mbtune"
"""The name of the study in every run's optuna.db."""

RECOMMENDATION_ATTR = "recommendation"
"""The study's user attribute holding the current recommendation line (beside
``confidence`` and ``trials``), for those without optuna-dashboard's note."""

INTERRUPTED = "interrupted"
"""The ``status`` of a trial whose driver stopped before it finished."""

CACHED = "cached"
"""The ``status`` of a trial a sampler proposed that was measured before: answered from
what was measured, never run."""

DUPLICATE = "duplicate"
"""The ``status`` of a trial a sampler proposed while another trial measures it."""

WARM_START = "warm_start"
"""The user attribute of a trial learnt from an earlier run (``--warm-start``): that run's
name and trial number. The samplers learn from it; it is no trial of this run."""

NOT_MEASURED = (CACHED, DUPLICATE, INTERRUPTED)


def config_attrs(config: BatchConfig) -> dict[str, Any]:
    """A configuration as the user names it: every column of ``CONFIG_KEY``, and g."""
    return {
        **{k: getattr(config, k) for k in CONFIG_KEY},
        "grad_accum_steps": config.grad_accum_steps,
    }


def record_attrs(record: TrialRecord) -> dict[str, Any]:
    """A finished trial's user attributes: every column of its row of trials.csv that holds
    something (a figure it did not measure is left out, not null; a list stays a list), and
    its ``status`` always (a trial that said none is an error)."""
    attrs = {k: getattr(record, k) for k in CSV_COLUMNS}
    attrs["status"] = record.status or "error"
    return {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.items()
            if v is not None and v != ()}  # fmt: skip


def record_of(trial: FrozenTrial, space: OptunaSpace) -> TrialRecord | None:
    """A finished trial of the study as trials.csv's record of it, or None for one that
    measured nothing (running, cached, a duplicate, interrupted). The user attributes hold
    the record where mbtune told the trial; a trial of a study of your own is read from
    its parameters and value, with what its user attributes add (``status``:
    ``ok``, ``oom``, ``error``, ``timeout``; ``step_times_ms``; any column of trials.csv).
    Completed, it is ok where its value is positive; pruned, out of memory; failed, an
    error."""
    attrs = trial.user_attrs
    status = attrs.get("status")
    if trial.state == TrialState.RUNNING or trial.state == TrialState.WAITING:
        return None
    if status in NOT_MEASURED:
        return None
    if status is None:
        if trial.state == TrialState.COMPLETE:
            status = "ok" if trial.value and trial.value > 0 else "error"
        else:
            status = "oom" if trial.state == TrialState.PRUNED else "error"
    known = {k: v for k, v in attrs.items() if k in CSV_COLUMNS}
    if "batch_size" not in known:
        known.update(config_attrs(space.decode(trial.params)))
    if "objective" not in known:
        known["objective"] = trial.value if trial.state == TrialState.COMPLETE else 0.0
    if not isinstance(known.get("trial"), int):
        known["trial"] = trial.number + 1
    return TrialRecord.from_result({**known, "status": status})


@functools.lru_cache(maxsize=8)
def storage_for(url: str) -> optuna.storages.RDBStorage:
    """One storage per run's optuna.db for the driver's life (opening it checks the
    schema): the searcher's and the ledger's, so that each sees what the other wrote.

    Its commits do not wait for the disk (SQLite's ``synchronous`` OFF, on connections of
    its own: engine_kwargs' ``creator``). Optuna commits each user attribute apart, some
    60 commits a trial (its 47 attributes, its parameters, the recommendation), and at
    SQLite's default each waited for an fsync: 0.76 s for 47 attributes here against 0.11
    s, most of what passed between one trial's end and the next one's start. A process
    killed at any point loses nothing by it (what it wrote is the kernel's); a machine
    that crashes may leave the file damaged. The record a crash cannot lose is trials.csv,
    each row fsync'd before the study is told it: a damaged optuna.db is set aside
    (``optuna.db.damaged``) and the study rebuilt from trials.csv (:meth:`SearchStudy.catch_up`,
    as --resume does)."""
    import sqlalchemy.exc  # as the storage imports it: not before a run opens its study

    path = url.removeprefix("sqlite:///")
    if path == url or path.startswith(":memory:"):
        return optuna.storages.RDBStorage(url)

    def connect() -> sqlite3.Connection:
        connection = sqlite3.connect(path, check_same_thread=False)
        connection.execute("PRAGMA synchronous = OFF")
        return connection

    try:
        return optuna.storages.RDBStorage(url, engine_kwargs={"creator": connect})
    except sqlalchemy.exc.DatabaseError as e:  # not a database, or a malformed one
        os.replace(path, f"{path}.damaged")
        print(f"mbtune: {path} is damaged ({str(e.orig or e).strip()}): set aside as "
              f"{Path(path).name}.damaged; the study is rebuilt from trials.csv",
              file=sys.stderr, flush=True)  # fmt: skip
        return optuna.storages.RDBStorage(url, engine_kwargs={"creator": connect})


class SearchStudy:
    """The search's study and the storage it lives in (a run's optuna.db, or memory),
    through whose public methods the study's trials are written: asked with the
    configuration, told with the record, added where no sampler asked (a row the study
    missed, a prediction, a warm start), and failed where a driver left them running."""

    def __init__(
        self,
        space: OptunaSpace,
        storage: Any = None,
        sampler: optuna.samplers.BaseSampler | None = None,
    ) -> None:
        optuna.logging.set_verbosity(optuna.logging.WARNING)  # mbtune's lines say it all
        self.space = space
        self.storage = storage if storage is not None else optuna.storages.InMemoryStorage()
        self.study = optuna.create_study(
            storage=self.storage,
            # written, not proposed in (the trial log's): the cheapest of Optuna's samplers
            sampler=sampler if sampler is not None else optuna.samplers.RandomSampler(),
            study_name=STUDY_NAME,
            direction="maximize",
            load_if_exists=True,
        )
        self._study_id: int | None = None

    @classmethod
    def at(cls, url: str, space: OptunaSpace, sampler: Any = None) -> SearchStudy:
        """The study of the run whose optuna.db is at ``url`` (created where there is none)."""
        return cls(space, storage_for(url), sampler)

    def trials(self, states: Sequence[TrialState] | None = None) -> list[FrozenTrial]:
        """The study's trials, in the order they were asked or added."""
        return self.study.get_trials(deepcopy=False, states=states)

    def set_attrs(
        self, number: int, attrs: Mapping[str, Any], *, known: Mapping[str, Any] | None = None
    ) -> None:
        """Set ``attrs`` as user attributes of the unfinished trial ``number``; ``known``:
        its attributes as last read, of which those already holding the same value are
        not written again (each is a commit of its own)."""
        if self._study_id is None:
            self._study_id = self.storage.get_study_id_from_name(STUDY_NAME)
        trial_id = self.storage.get_trial_id_from_study_id_trial_number(self._study_id, number)
        for key, value in attrs.items():
            if known is None or key not in known or known[key] != value:
                self.storage.set_trial_user_attr(trial_id, key, value)

    # -- a trial of the search -----------------------------------------------------

    def ask(self, config: BatchConfig | None = None) -> tuple[int, BatchConfig]:
        """A new trial: the sampler's proposal, or ``config`` where one is given (a start
        point, another look: enqueued, so that the sampler is not consulted); its number
        and the configuration it proposes."""
        if config is not None:
            self.study.enqueue_trial(self.space.encode(config)[0])
        trial = self.study.ask()
        return trial.number, BatchConfig.from_mapping(self.space(trial))

    def finish(self, number: int, status: str, value: float | None = None, **attrs: Any) -> None:
        """Tell the trial ``number``, which measured nothing (``status`` one of
        :data:`NOT_MEASURED`): complete with ``value`` (what was measured before), else
        failed."""
        self.set_attrs(number, {"status": status, **attrs})
        if value is None:
            self.study.tell(number, state=TrialState.FAIL)
        else:
            self.study.tell(number, value)

    def tell(
        self, record: TrialRecord, *, number: int | None = None, crashed: bool = False,
        **extra: Any,
    ) -> int:  # fmt: skip
        """Record a finished trial of the search: its record (``extra``: what the record
        has no column for, as ``mixes_batch``) on the running trial asked for it (``number``,
        else the one whose ``trial_id`` it has), told its objective (failed where its
        process ``crashed``); a trial of its own where none runs (asked before a driver
        was interrupted, measured after it resumed). Its number."""
        running = {t.number: t for t in self.trials(states=(TrialState.RUNNING,))}
        if number is None:
            number = next((n for n, t in running.items() if record.trial_id
                           and t.user_attrs.get("trial_id") == record.trial_id), None)  # fmt: skip
        if number is None:
            return self.add(record, **extra)
        asked = running.get(number)  # what it was asked with (its configuration) is set
        self.set_attrs(number, {**record_attrs(record), **extra},
                       known=asked.user_attrs if asked is not None else None)  # fmt: skip
        if crashed:
            self.study.tell(number, state=TrialState.FAIL)
        else:
            self.study.tell(number, float(record.objective or 0.0))
        return number

    def add(self, record: TrialRecord, **extra: Any) -> int:
        """Record a finished trial no sampler asked for (a row the study missed, a
        configuration predicted out of memory: pruned, with its reason; a warm start's,
        with ``extra``): complete with its objective. Its number."""
        params, distributions = self.space.encode(record.config.canonical())
        pruned = record.predicted
        attrs = record_attrs(record)
        if WARM_START in extra:  # its row is the earlier run's, not one of this run
            attrs = {k: v for k, v in attrs.items() if k not in ("trial", "trial_id")}
        self.study.add_trial(
            optuna.trial.create_trial(
                params=params,
                distributions=distributions,
                value=None if pruned else float(record.objective or 0.0),
                state=TrialState.PRUNED if pruned else TrialState.COMPLETE,
                user_attrs={**attrs, **extra},
            )
        )
        return len(self.trials()) - 1

    # -- the study and the ledger ------------------------------------------------------

    def fail_interrupted(self) -> int:
        """Mark every trial left running failed, its ``status`` ``interrupted`` (a driver
        that stopped or was killed mid-trial); how many were."""
        running = self.trials(states=(TrialState.RUNNING,))
        for trial in running:
            self.finish(trial.number, INTERRUPTED)
        return len(running)

    def rows(self) -> dict[int, FrozenTrial]:
        """The trials that are rows of trials.csv, by their ``trial`` number there (not one
        a kill caught between its attributes and its tell: interrupted, it is no row)."""
        return {
            t.user_attrs["trial"]: t
            for t in self.trials()
            if isinstance(t.user_attrs.get("trial"), int)
            and WARM_START not in t.user_attrs
            and t.state.is_finished()
            and t.user_attrs.get("status") not in NOT_MEASURED
        }

    def catch_up(self, records: Iterable[TrialRecord]) -> int:
        """Tell the study every row of trials.csv it lacks (written before a killed driver
        could tell it; a run begun before every run had a study), after failing what a
        driver left running: then the study and the ledger agree. How many it lacked."""
        self.fail_interrupted()
        told = self.rows()
        missing = [r for r in records if r.trial not in told]
        for record in missing:
            self.add(record)
        return len(missing)

    def records(self) -> list[TrialRecord]:
        """What this run measured, as trials.csv's records, in the ledger's order (a
        warm start's trials are not this run's)."""
        return records_of(self.trials(), self.space)

    def publish(self, line: str, *, confidence: int, target: int, trials: int) -> None:
        """Put the current recommendation in the study (:func:`publish`)."""
        publish(self.study, line, confidence=confidence, target=target, trials=trials)


def publish(study: optuna.Study, line: str, *, confidence: int, target: int, trials: int) -> None:
    """Put the current recommendation in ``study``: its note (optuna-dashboard's
    ``save_note``, where optuna-dashboard is installed) and its user attributes
    ``recommendation``, ``confidence`` and ``trials`` (always)."""
    study.set_user_attr(RECOMMENDATION_ATTR, line)
    study.set_user_attr("confidence", confidence)
    study.set_user_attr("trials", trials)
    try:
        from optuna_dashboard import save_note
    except ImportError:
        return
    note = (
        f"## mbtune's recommendation\n\n{line}\n\nconfidence score **{confidence}** of its "
        f"target {target}, after {trials} trial{'s' if trials != 1 else ''} "
        f"(updated after every trial)\n"
    )
    save_note(study, note)


def records_of(trials: Iterable[FrozenTrial], space: OptunaSpace) -> list[TrialRecord]:
    """What a study's ``trials`` measured in its run, as trials.csv's records, in the order
    the search learnt them (a warm start's trials are not the run's)."""
    ordered = sorted((t for t in trials if t.state.is_finished()), key=finished_order)
    found = (record_of(t, space) for t in ordered if WARM_START not in t.user_attrs)
    return [r for r in found if r is not None]


def finished_order(trial: FrozenTrial) -> tuple[Any, int]:
    """The order the search learnt finished trials in (the ledger's: it tells the study
    each as it writes its row), the study's order among equals."""
    return (trial.datetime_complete or trial.datetime_start, trial.number)
