"""The searcher Tune asks (:class:`MbtuneSearcher`): Ray Tune runs the trials, the run's
Optuna study proposes them (what a trial reports to Tune is mbtune.trial.launch's
:func:`~mbtune.trial.launch.pack_result`).

Every trial Tune runs is a trial of the study, asked when it starts: the sampler's
proposal (mbtune.search._samplers), or a configuration enqueued for it (a start point, or
another look the searcher takes with Optuna's own samplers and the baselines). Whatever
the searcher knows of the search it reads from the study (mbtune.search._history): what
was measured, how often, what runs; its own state is only which study trial each of
Tune's trials is. A proposal whose canonical configuration was measured already is
answered from what was measured and the sampler asked again; a sampler that proposes
only those (:data:`STUCK_PROPOSALS` in a row) gets the unmeasured configuration nearest
its last proposal measured.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import optuna
from ray.tune.search import Searcher

from mbtune.config.search import SearchConfig
from mbtune.lattice import BatchConfig
from mbtune.recommend.confidence import Assessment, SearchModel
from mbtune.recommend.observation import Observation
from mbtune.report import another_look_line
from mbtune.runs.record import TrialRecord
from mbtune.search._history import History, read_history
from mbtune.search._samplers import DONE, LatticeSampler, ModelSampler, make_sampler
from mbtune.search._space import OptunaSpace
from mbtune.search._stopping import another_look, nearest
from mbtune.search._study import (
    CACHED,
    DUPLICATE,
    WARM_START,
    SearchStudy,
    config_attrs,
)
from mbtune.trial.launch import METRIC, unpack_result

__all__ = ["MbtuneSearcher", "make_searcher", "resume_line"]

STUCK_PROPOSALS = 20
"""Proposals in a row answered from the cache (or running already) after which a sampler
counts as stuck, and the unmeasured configuration nearest its last proposal is measured
instead, asked of the study so that the sampler learns it as one of its own. Without it,
Optuna's GPSampler near the end of test_searchers' 11 points (seed 2) was asked 218 times
and the search ended with a valid point never measured."""

_SETTINGS = ("model", "target", "max_repeats", "ledger", "announce", "start_points", "budget",
             "url", "points", "space")  # fmt: skip


class MbtuneSearcher(Searcher):
    """The searcher Tune asks: each trial a trial of the study ``sampler`` proposes in,
    each configuration measured once, and measured again only where the search model says
    another look is worth more than anything new (see :func:`another_look`; the
    :class:`ModelSampler` weighs that itself).

    The study lives in the run's optuna.db (``url``), where the run's trial log tells it
    each finished trial after writing its row of trials.csv (mbtune.search._ledger), or in
    memory, where this searcher tells it (driven alone, as the tests and the benches drive
    it). ``ledger``: the run's trials.csv, which a restored searcher has the study catch
    up with (the rows a killed driver wrote and could not tell)."""

    def __init__(
        self,
        sampler: optuna.samplers.BaseSampler,
        model: SearchModel,
        *,
        target: int = 90,
        max_repeats: int = SearchConfig.max_repeats,
        start_points: Sequence[BatchConfig] = (),
        url: str | None = None,
        ledger: str | None = None,
        announce: Callable[[str], None] | None = None,
        budget: int | None = None,
    ) -> None:
        super().__init__(metric=METRIC, mode="max")
        self.sampler, self.model = sampler, model
        self.budget = budget
        """search.num_samples: counted on the study, which a killed driver's last trials
        reached (Tune counts only the trials in its saved state)."""
        self.target, self.max_repeats = target, max_repeats
        self.url, self.ledger, self.announce = url, ledger, announce
        self.points = {p.canonical() for p in model.points}
        self.space = sampler.space if isinstance(sampler, LatticeSampler) else (
            OptunaSpace(sorted(self.points)))  # fmt: skip
        self.start_points = [p.canonical() for p in start_points]
        """Configurations to measure first (search.start_points)."""
        self.running: dict[str, int] = {}
        """Tune's trial id -> the number of the study's trial it is."""
        self._study: SearchStudy | None = None

    @property
    def study(self) -> SearchStudy:
        """The search's study (in the run's optuna.db, or in memory)."""
        if self._study is None:
            self._study = (SearchStudy.at(self.url, self.space, self.sampler) if self.url
                           else SearchStudy(self.space, sampler=self.sampler))  # fmt: skip
        return self._study

    def history(self) -> History:
        """The study read as the search reads it."""
        chosen = {}
        if isinstance(self.sampler, LatticeSampler):
            chosen = {n: p.config for n in self.running.values()
                      if (p := self.sampler.proposal(n)) is not None}  # fmt: skip
        return read_history(self.study.trials(), self.space, chosen=chosen)

    # -- Tune's questions ---------------------------------------------------

    def suggest(self, trial_id: str) -> dict | str | None:
        h = self.history()
        if self.budget is not None and h.trials + len(self.running) >= self.budget:
            return Searcher.FINISHED
        for start in self.start_points:
            point = h.key(start)
            if point not in h.measured and point not in h.busy:
                return self._start(trial_id, h, point, enqueue=True)
        if isinstance(self.sampler, ModelSampler):  # it weighs another look itself
            return self._from_model(trial_id, h)
        a = self.assessment(h)
        if a is not None and a.confidence >= self.target:  # the leader, before stopping
            look = another_look(a, **self._rule(), busy=h.busy, new_threat=None)
            if look is not None:
                return self._start(trial_id, h, look[0], why=look[1], enqueue=True)
        params = self._from_sampler(trial_id, h)
        if params != Searcher.FINISHED:
            return params
        # nothing new to propose: another look where the model finds one worth it
        look = a and another_look(a, **self._rule(), busy=h.busy, new_threat=None)
        return self._start(trial_id, h, look[0], why=look[1], enqueue=True) if look else (
            Searcher.FINISHED)  # fmt: skip

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
        number = self.running.pop(trial_id, None)
        if number is None or self.url is not None:
            return  # the run's trial log tells the study, once trials.csv has its row
        result = unpack_result(result) or {}
        point = BatchConfig.from_mapping(self.study.trials()[number].user_attrs)
        rows = self.study.rows()
        record = TrialRecord.from_result({
            **point.sizes(), **result, "status": "error" if error else result.get("status"),
            "trial": max(rows, default=0) + 1, "trial_id": trial_id,
        })  # fmt: skip
        mixes = {"mixes_batch": True} if result.get("mixes_batch") else {}
        self.study.tell(record, number=number, crashed=error, **mixes)

    # -- what the search model says -------------------------------------------

    def assessment(self, h: History | None = None, taught: bool = False) -> Assessment | None:
        """The search model's view of this search's trials (and, with ``taught``, of a
        warm start's), or None before any trial ran ok."""
        h = h or self.history()
        observations = [*h.taught, *h.observations] if taught else h.observations
        if not any(o.status == "ok" for o in observations):
            return None
        return self.model.assess(observations)

    @property
    def observations(self) -> list[Observation]:
        """Every trial this search finished (and each prediction), in order."""
        return self.history().observations

    @property
    def finished_ids(self) -> set[str]:
        """Ray's ids of the trials this search finished."""
        return self.history().trial_ids

    def _rule(self) -> dict[str, Any]:
        return {"target": self.target, "max_repeats": self.max_repeats,
                "noise_floor": self.model.noise_floor}  # fmt: skip

    def _from_model(self, trial_id: str, h: History) -> dict | str | None:
        proposal = self.sampler.propose(h)
        if proposal is None or proposal == DONE:
            return None if proposal is None else Searcher.FINISHED
        return self._start(trial_id, h, proposal.config, why=proposal.why)

    def _from_sampler(self, trial_id: str, h: History) -> dict | str | None:
        left = self.points - set(h.measured) - h.busy
        if not left:
            return Searcher.FINISHED
        for _ in range(STUCK_PROPOSALS):
            if isinstance(self.sampler, LatticeSampler):
                proposal = self.sampler.propose(self.history())
                if proposal is None or proposal == DONE:
                    return None if proposal is None else Searcher.FINISHED
            number, proposed = self.study.ask()
            point = h.key(proposed)
            if point in h.measured:
                self.study.finish(number, CACHED, h.measured[point], **config_attrs(proposed))
            elif point in h.busy:  # being measured by another trial
                self.study.finish(number, DUPLICATE, **config_attrs(proposed))
            else:
                return self._begin(trial_id, h, number, point)
        return self._start(trial_id, h, nearest(sorted(left), point), enqueue=True)

    def _start(
        self,
        trial_id: str,
        h: History,
        point: BatchConfig,
        why: str | None = None,
        enqueue: bool = False,
    ) -> dict[str, Any]:
        """Ask the study for ``point``: enqueued (a start point, another look), or the
        sampler's proposal."""
        number, asked = self.study.ask(point if enqueue else None)
        return self._begin(trial_id, h, number, point if enqueue else asked, why)

    def _begin(
        self, trial_id: str, h: History, number: int, point: BatchConfig, why: str | None = None
    ) -> dict[str, Any]:
        looks = h.looks.get(point, 0)
        attrs = {**config_attrs(point), "trial_id": trial_id, "repeat": looks}
        self.study.set_attrs(number, attrs)
        self.running[trial_id] = number
        if why and self.announce:
            self.announce(another_look_line(why, point, looks + 1))
        return {**point.sizes(), "repeat": looks}

    # -- results it did not ask for -------------------------------------------

    def teach(self, record: TrialRecord, earlier: str = "an earlier run") -> None:
        """A result of an earlier run (warm start): the samplers learn it (Optuna's and the
        model's proposals; the baselines and the score do not), and it is measured here
        all the same. ``earlier``: where it comes from, the trial's ``warm_start``."""
        self.study.add(record, **{WARM_START: earlier})

    def add_predicted(self, records: Sequence[TrialRecord]) -> None:
        """Configurations predicted out of memory before the first trial (their records,
        :attr:`TrialRecord.predicted`): pruned trials of the study, never measured, an
        ``oom`` to the search model (a larger micro-batch cannot run either) and to the
        proposer, and no trial of ``budget``. Once each: a row the study has is skipped."""
        told = self.study.rows()
        for record in records:
            if record.trial not in told:
                self.study.add(record)

    # -- resume ------------------------------------------------------------------

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec):
        return True

    def __getstate__(self) -> dict[str, Any]:
        # a study in the run's optuna.db is opened again where the searcher is restored
        return {**self.__dict__, "_study": None if self.url else self._study}

    def save(self, checkpoint_path: str) -> None:
        # what the constructor was given (the experiment's settings) is not state
        state = {k: v for k, v in self.__getstate__().items() if k not in _SETTINGS}
        with open(checkpoint_path, "wb") as f:
            pickle.dump(state, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))
        self._catch_up()

    def _catch_up(self) -> None:
        """Once restored: the study catches up with trials.csv (written first: the rows a
        killed driver could not tell it) and fails what was left running; a trial of Tune's
        that had finished is no longer in flight, and one that had not, which Tune runs
        again, is a running trial of the study again."""
        if self.ledger and Path(self.ledger).exists():
            from mbtune.runs.rundir import RunDir

            self.study.catch_up(RunDir(Path(self.ledger).parent).records())
        else:
            self.study.fail_interrupted()
        h = self.history()
        trials = self.study.trials()
        for trial_id, number in list(self.running.items()):
            del self.running[trial_id]
            if trial_id in h.trial_ids:
                continue
            attrs = trials[number].user_attrs
            if "batch_size" in attrs:  # given its configuration before the driver stopped
                self._start(trial_id, h, BatchConfig.from_mapping(attrs), enqueue=True)
        if self.announce:
            self.announce(resume_line(h.trials, len(self.running)))


def resume_line(finished: int, interrupted: int) -> str:
    """What a resumed search starts from: the trials kept, and those measured again."""
    again = f", {interrupted} interrupted, measured again" if interrupted else ""
    return f"mbtune: resuming: {finished} trials finished{again}"


def make_searcher(
    sampler: str,
    points: Sequence[BatchConfig],
    *,
    seed: int,
    url: str | None = None,
    start_points: Sequence[BatchConfig] = (),
    global_objective: bool = True,
    ledger: str | Path | None = None,
    noise_floor: float = 0.0,
    target: int = 90,
    max_repeats: int = SearchConfig.max_repeats,
    announce: Callable[[str], None] | None = None,
    model: SearchModel | None = None,
    budget: int | None = None,
    sharded: bool = False,
) -> MbtuneSearcher:
    """The searcher for ``search.sampler`` over ``points``; ``model``: the run's search
    model, else one of ``noise_floor``, ``global_objective``, ``seed`` and ``sharded``
    (the trials shard the model); ``url``: the run's optuna.db (else the study is in
    memory)."""
    canonical = sorted({p.canonical() for p in points})
    model = model or SearchModel(
        tuple(canonical), noise_floor, global_objective, seed, target, max_repeats, sharded
    )
    return MbtuneSearcher(
        make_sampler(sampler, model, seed=seed),
        model,
        target=target,
        max_repeats=max_repeats,
        start_points=start_points,
        url=url,
        ledger=str(ledger) if ledger else None,
        announce=announce,
        budget=budget,
    )
