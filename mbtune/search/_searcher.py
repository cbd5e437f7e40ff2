"""The searcher Tune asks (:class:`MbtuneSearcher`): proposals, each configuration
measured once, and measured again where the search model finds another look worth more
than anything new; and what a trial reports to Tune (:func:`pack_result`).

A proposal whose canonical configuration (the micro-batches it really runs) was measured
already is answered from the cache and the proposer asked again. A repeat is a fresh
trial of a configuration measured before; repeats are pooled as observations of it, and
their spread is how the search model learns the drift between trials
(mbtune.recommend.confidence).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import statistics
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ray.tune.search import Searcher

from mbtune.config.search import SearchConfig
from mbtune.lattice import BatchConfig
from mbtune.recommend.confidence import Assessment, SearchModel
from mbtune.recommend.observation import Observation, observation
from mbtune.report import another_look_line
from mbtune.runs.record import CONFIG_KEY, SIZES, TrialRecord
from mbtune.search._proposers import (
    METRIC,
    DoublingSearcher,
    GridSearcher,
    HalvingSearcher,
    OptunaSearcher,
    OptunaSpace,
    first_guess,
)
from mbtune.search._stopping import another_look
from mbtune.search._study import record_attrs

__all__ = [
    "MbtuneSearcher",
    "make_searcher",
    "pack_result",
    "unpack_result",
]

MEASURED = "measured"
"""The key under which a trial reports everything it measured, as one JSON string."""


def pack_result(result: dict[str, Any]) -> dict[str, Any]:
    """What a trial reports to Tune: the objective, and the rest as one string.

    Tune keeps running statistics for every numeric key of every result of every trial
    for the whole search; one numeric key instead of thirty keeps the driver small.
    """
    return {METRIC: float(result.get(METRIC) or 0.0), MEASURED: json.dumps(result)}


def unpack_result(result: dict[str, Any] | None) -> dict[str, Any] | None:
    """The trial's own result from what Tune hands back (a plain result passes through)."""
    if result is None or MEASURED not in result:
        return result
    return json.loads(result[MEASURED])


# ---------------------------------------------------------------------------
# what Tune talks to


MAX_CACHED_PROPOSALS = 200
"""Proposals in a row answered from the cache before the proposer counts as exhausted."""


def nearest(points: Sequence[BatchConfig], to: BatchConfig) -> BatchConfig:
    """The point of ``points`` nearest ``to``, in octaves of m, n and B and the other
    dimensions (0 or 1 where they differ)."""

    def distance(c: BatchConfig) -> tuple[float, BatchConfig]:
        octaves = sum(abs(math.log2(getattr(c, d)) - math.log2(getattr(to, d))) for d in SIZES)
        return octaves + sum(getattr(c, d) != getattr(to, d) for d in CONFIG_KEY
                             if d not in SIZES), c  # fmt: skip

    return min(points, key=distance)


_SETTINGS = ("inner", "model", "target", "max_repeats", "ledger", "announce", "points", "budget")


class MbtuneSearcher(Searcher):
    """The searcher Tune asks: proposals from ``search.sampler``, each configuration
    measured once, and measured again only where the search model says another look is
    worth more than anything new (see :func:`another_look`).

    ``inner`` proposes new configurations (a baseline or :class:`OptunaSearcher`); None:
    the search model proposes them itself (``search.sampler: model``): the unmeasured
    configuration most likely to be the fastest. A proposal already measured is answered
    from the cache and the proposer asked again. Every finished trial is an observation
    of the search model, which the reporter scores with too (one model, one noise floor).
    """

    def __init__(
        self,
        inner: Searcher | None,
        model: SearchModel,
        *,
        target: int = 90,
        max_repeats: int = SearchConfig.max_repeats,
        start_points: Sequence[BatchConfig] = (),
        ledger: str | None = None,
        announce: Callable[[str], None] | None = None,
        budget: int | None = None,
    ) -> None:
        super().__init__(metric=METRIC, mode="max")
        self.inner, self.model = inner, model
        self.budget = budget
        """search.num_samples: Tune counts only the trials in its saved state, and a driver
        killed after a trial's row but before Ray saved it would otherwise buy one more."""
        self.target, self.max_repeats = target, max_repeats
        self.ledger = ledger
        """The run's trials.csv: on restore, what finished since the last save."""
        self.announce = announce
        self.points = {p.canonical() for p in model.points}
        self.queue = [p.canonical() for p in start_points]
        """Configurations to measure first (search.start_points)."""
        self.observations: list[Observation] = []
        """Every trial this search finished, in order."""
        self.taught: list[Observation] = []
        """Results of an earlier run (warm start): proposals learn from them, scores not."""
        self.measured: dict[BatchConfig, float] = {}
        self.looks: dict[BatchConfig, int] = defaultdict(int)
        self.finished_ids: set[str] = set()
        self.running: dict[str, tuple[BatchConfig, str | None]] = {}
        self.full_batch_only = False
        """Set once a trial reports that the model mixes the batch: then m = P only."""
        self.asked = 0

    def key(self, config: BatchConfig) -> BatchConfig:
        if self.full_batch_only:
            config = dataclasses.replace(config, micro_batch_size=config.per_device_batch)
        return config.canonical()

    # -- Tune's questions ---------------------------------------------------

    def suggest(self, trial_id: str) -> dict | str | None:
        if self.budget is not None and len(self.finished_ids) + len(self.running) >= self.budget:
            return Searcher.FINISHED
        while self.queue:
            point = self.key(self.queue.pop(0))
            if point not in self.measured and point not in self.busy():
                return self._start(trial_id, point)
        a = self.assessment()
        if self.inner is None:
            return self._from_model(trial_id, a)
        if a is not None and a.confidence >= self.target:  # the leader, before stopping
            look = another_look(a, **self._rule(), busy=self.busy(), new_threat=None)
            if look is not None:
                return self._start(trial_id, *look)
        params = self._from_inner(trial_id)
        if params != Searcher.FINISHED:
            return params
        # nothing new to propose: another look where the model finds one worth it
        look = a and another_look(a, **self._rule(),
                                  busy=self.busy(), new_threat=None)  # fmt: skip
        return self._start(trial_id, *look) if look else Searcher.FINISHED

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
        point, inner_id = self.running.pop(trial_id, (None, None))
        if point is None:
            return
        result = unpack_result(result) or {}
        value = 0.0 if error else float(result.get(METRIC) or 0.0)
        if result.get("mixes_batch"):
            self.full_batch_only = True
        record = TrialRecord.from_result({
            **point.sizes(), **result, "status": "error" if error else result.get("status"),
            # the searcher's own count: the ledger numbers trials.csv's rows the same way
            "trial": len(self.finished_ids) + 1, "trial_id": trial_id,
        })  # fmt: skip
        ran = self.key(record.config) if "micro_batch_size" in result else point
        self._observe(trial_id, point, ran, record, value)
        if inner_id is not None:
            self.inner.on_trial_complete(inner_id, {METRIC: value, **record_attrs(record)})
        else:  # a start point or another look: the proposer did not ask for it
            self.tell(point, value, measured=True, attrs=record_attrs(record))

    # -- what the search model says -------------------------------------------

    def assessment(self, taught: bool = False) -> Assessment | None:
        """The search model's view of this search's trials (and, with ``taught``, of a
        warm start's), or None before any trial ran."""
        observations = [*self.taught, *self.observations] if taught else self.observations
        if not any(o.status == "ok" for o in observations):
            return None
        return self.model.assess(observations)

    def _rule(self) -> dict[str, Any]:
        return {"target": self.target, "max_repeats": self.max_repeats,
                "noise_floor": self.model.noise_floor}  # fmt: skip

    def busy(self) -> set[BatchConfig]:
        return {p for p, _ in self.running.values()}

    def _from_model(self, trial_id: str, a: Assessment | None) -> dict | str | None:
        # with batch mixing, only m = P runs: every other point is that one (key)
        open_points = sorted({self.key(p) for p in self.points} - set(self.measured) - self.busy())
        view = self.assessment(taught=True) if self.taught else a
        new = None
        if open_points:
            if view is None:
                new = first_guess(open_points, self.model.global_objective)
            elif unmeasured := [p for p in open_points if p in view.open_points]:
                # a value never measured first (nothing else settles its chance): beside
                # the leader, so that the two differ in that value alone
                new = nearest(unmeasured, view.recommended or unmeasured[0])
            else:
                likely = {p: view.p_best.get(p, 0.0) for p in open_points}
                new = max(likely, key=likely.__getitem__)
        if a is not None:
            threat = a.unmeasured_threat if new is not None else None
            look = another_look(a, **self._rule(),
                                busy=self.busy(), new_threat=threat)  # fmt: skip
            if look is not None:
                return self._start(trial_id, *look)
        if new is None:
            return None if self.running else Searcher.FINISHED
        return self._start(trial_id, new)

    def _from_inner(self, trial_id: str) -> dict | str | None:
        for _ in range(MAX_CACHED_PROPOSALS):
            if not self.points - set(self.measured) - {self.key(p) for p in self.busy()}:
                return Searcher.FINISHED
            self.asked += 1
            inner_id = f"{trial_id}-{self.asked}"
            params = self.inner.suggest(inner_id)
            if params is None or params == Searcher.FINISHED:
                return params
            point = self.key(BatchConfig.from_mapping(params))
            if point in self.measured:
                cached = {METRIC: self.measured[point], "status": "cached"}
                self.inner.on_trial_complete(inner_id, cached)
            elif point in self.busy():  # being measured by another trial
                self.inner.on_trial_complete(inner_id, {"status": "duplicate"}, error=True)
            else:
                return self._start(trial_id, point, inner_id=inner_id)
        return Searcher.FINISHED

    def _start(
        self, trial_id: str, point: BatchConfig, why: str | None = None, inner_id: str | None = None
    ) -> dict[str, Any]:
        self.running[trial_id] = (point, inner_id)
        if why and self.announce:
            self.announce(another_look_line(why, point, self.looks[point] + 1))
        return {**point.sizes(), "repeat": self.looks[point]}

    def _observe(
        self, trial_id: str, point: BatchConfig, ran: BatchConfig, record: TrialRecord, value: float
    ) -> None:
        self.finished_ids.add(trial_id)
        self.observations.append(observation(record))
        for config in {point, ran}:
            self.looks[config] += 1
            self.measured[config] = self._pooled(config) or value

    def _pooled(self, config: BatchConfig) -> float | None:
        values = [o.value for o in self.observations if o.config == config and o.value]
        return statistics.geometric_mean(values) if values else None

    # -- results it did not ask for -------------------------------------------

    def tell(
        self,
        config: BatchConfig,
        value: float,
        *,
        measured: bool = False,
        attrs: Mapping[str, Any] | None = None,
    ) -> None:
        """Teach the proposer a result (a start point, another look, a warm start);
        ``measured``: this search measured it; ``attrs``: what Optuna's study shows of it.
        The search model has this search's own trials already and learns a warm start's;
        each inner proposer says what it learns."""
        config = config.canonical()
        if self.inner is not None:
            self.inner.tell(config, value, measured=measured, attrs=attrs)
        elif not measured:
            status = "ok" if value > 0 else "error"
            self.taught.append(Observation(config, status, value if value > 0 else None))

    def add_measured(self, config: BatchConfig, value: float) -> None:
        """A point measured before this search (resume): never measure it again."""
        self.measured[self.key(config)] = value
        self.tell(config, value, measured=True)

    def add_predicted(self, records: Sequence[TrialRecord]) -> None:
        """Configurations predicted out of memory before the first trial (their records,
        :attr:`TrialRecord.predicted`): never measured, an ``oom`` to the search model (a
        larger micro-batch cannot run either) and to the proposer, and no trial of
        ``budget``. Once each: a record learnt already is skipped."""
        for record in records:
            config = self.key(record.config)
            if config in self.measured:
                continue
            self.observations.append(observation(record))
            self.measured[config] = 0.0
            self.tell(config, 0.0, measured=True, attrs=record_attrs(record))

    # -- resume ------------------------------------------------------------------

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec):
        return True

    def save(self, checkpoint_path: str) -> None:
        # Ray keeps exactly one file per searcher: the inner searcher's state goes inside it;
        # what the constructor was given (the experiment's settings) is not state
        state = {k: v for k, v in self.__dict__.items() if k not in _SETTINGS}
        if self.inner is not None:
            inner_path = checkpoint_path + ".inner"
            self.inner.save(inner_path)
            state["inner_state"] = Path(inner_path).read_bytes()
            Path(inner_path).unlink()
        with open(checkpoint_path, "wb") as f:
            pickle.dump(state, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            state = pickle.load(f)
        inner_state = state.pop("inner_state", None)
        if inner_state is not None and self.inner is not None:
            inner_path = Path(checkpoint_path + ".inner")
            inner_path.write_bytes(inner_state)
            self.inner.restore(str(inner_path))
            inner_path.unlink()
        self.__dict__.update(state)
        self._catch_up()

    def _catch_up(self) -> None:
        """Learn the trials that finished after Ray last saved this searcher (a driver
        killed between the two): trials.csv, written first, is the record."""
        if not self.ledger or not Path(self.ledger).exists():
            return
        from mbtune.runs.rundir import RunDir

        for record in RunDir(Path(self.ledger).parent).records():
            if record.trial_id and record.trial_id in self.finished_ids:
                continue
            if record.predicted:  # no trial: learnt before the first (or now, once)
                self.add_predicted([record])
                continue
            config = self.key(record.config)
            value = float(record.objective or 0.0)
            # a trial Ray saved as running had finished: it is no longer in flight, and
            # the proposer that asked for it is told (once: its study may know already)
            point, inner_id = self.running.pop(record.trial_id or "", (None, None))
            # the point proposed and the one measured (halved on out of memory) are both done
            self._observe(record.trial_id or "", point or config, config, record, value)
            if inner_id is not None:
                self.inner.on_trial_complete(inner_id, {METRIC: value, **record_attrs(record)})
            else:
                self.tell(config, value, measured=True, attrs=record_attrs(record))
        if self.announce:
            self.announce(resume_line(len(self.finished_ids), len(self.running)))


def resume_line(finished: int, interrupted: int) -> str:
    """What a resumed search starts from: the trials kept, and those measured again."""
    again = f", {interrupted} interrupted, measured again" if interrupted else ""
    return f"mbtune: resuming: {finished} trials finished{again}"


def make_searcher(
    sampler: str,
    points: Sequence[BatchConfig],
    *,
    seed: int,
    storage: Any = None,
    start_points: Sequence[BatchConfig] = (),
    global_objective: bool = True,
    ledger: str | Path | None = None,
    noise_floor: float = 0.0,
    target: int = 90,
    max_repeats: int = SearchConfig.max_repeats,
    announce: Callable[[str], None] | None = None,
    model: SearchModel | None = None,
    budget: int | None = None,
) -> MbtuneSearcher:
    """The searcher for ``search.sampler`` over ``points``; ``model``: the run's search
    model, else one of ``noise_floor``, ``global_objective`` and ``seed``."""
    baselines = {"grid": GridSearcher, "halving": HalvingSearcher, "doubling": DoublingSearcher}
    canonical = sorted({p.canonical() for p in points})
    model = model or SearchModel(
        tuple(canonical), noise_floor, global_objective, seed, target, max_repeats
    )
    inner: Searcher | None = None
    if sampler in baselines:
        inner = baselines[sampler](canonical)
    elif sampler != "model":
        inner = OptunaSearcher(OptunaSpace(canonical), sampler, seed, storage)
    return MbtuneSearcher(
        inner,
        model,
        target=target,
        max_repeats=max_repeats,
        start_points=start_points,
        ledger=str(ledger) if ledger else None,
        announce=announce,
        budget=budget,
    )
