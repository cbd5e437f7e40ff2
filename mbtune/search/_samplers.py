"""Who proposes the next configuration: Optuna samplers, every one of them.

mbtune's own samplers are :class:`LatticeSampler`\\ s: Optuna ``BaseSampler``\\ s that read
the study (mbtune.search._history), pick a whole configuration of the lattice when a trial
asks for its first parameter, and answer each parameter of the space's encoding
(mbtune.search._space.OptunaSpace) from it:

- ``model`` (:class:`ModelSampler`): the configuration the search model
  (mbtune.recommend.confidence.SearchModel) finds most likely the fastest, or the leader or
  a close rival to look at again (mbtune.search._stopping.another_look);
- ``grid`` (:class:`LatticeGridSampler`): every configuration once, in order (Optuna's
  ``GridSampler`` does not fit: a lattice is no product of lists, and its order is drawn);
- ``halving`` (Composer): start at m = P, halve on out-of-memory; ``doubling`` (Lightning,
  Ludwig): start small and double until the next size no longer fits or is no faster.

``tpe``, ``gp`` and ``random`` are Optuna's own (:func:`optuna_sampler`). Any of them
proposes in a study of your own as well as in ``mbtune run``: docs/search.md has the
example. :class:`RecommendAndStop` is the study's callback for the stop and the
recommendation after each trial.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import optuna
from optuna.trial import FrozenTrial, TrialState

from mbtune.config.experiment import Experiment
from mbtune.lattice import BatchConfig
from mbtune.recommend.confidence import Assessment, SearchModel
from mbtune.recommend.observation import Observation
from mbtune.recommend.reporter import Reporter
from mbtune.search._history import History, read_history
from mbtune.search._space import OptunaSpace
from mbtune.search._stopping import another_look, nearest, settled
from mbtune.search._study import config_attrs, publish, records_of

__all__ = [
    "DONE",
    "DoublingSampler",
    "HalvingSampler",
    "LatticeGridSampler",
    "LatticeSampler",
    "ModelSampler",
    "Proposal",
    "RecommendAndStop",
    "first_guess",
    "likeliest_best",
    "make_sampler",
    "optuna_sampler",
    "search_model",
    "search_points",
]

DONE = "done"
"""What :meth:`LatticeSampler.propose` says when it has nothing left to propose (None:
nothing until a running trial finishes)."""


class Proposal(NamedTuple):
    """A configuration to measure, and why, where it is another look at one measured."""

    config: BatchConfig
    why: str | None = None


def search_points(exp: Experiment) -> list[BatchConfig]:
    """The distinct measurements of the experiment's space (canonical micro-batch sizes)."""
    return sorted({c.canonical() for c in exp.configs()})


def search_model(exp: Experiment, points: Sequence[BatchConfig] | None = None) -> SearchModel:
    """The one search model of a run of ``exp``: the sampler proposes with it, the
    reporter scores with it."""
    s = exp.search
    return SearchModel(
        tuple(points if points is not None else search_points(exp)), exp.noise_floor,
        s.objective == "samples_per_s", s.seed, s.confidence_target, s.max_repeats,
        exp.trial.sharding == "fsdp",
    )  # fmt: skip


class LatticeSampler(optuna.samplers.BaseSampler):
    """An Optuna sampler whose proposal is a whole configuration of the lattice
    (:meth:`propose`, read off the study), picked when a trial asks its first parameter of
    :attr:`space`; a parameter outside the space is Optuna's ``RandomSampler``'s."""

    def __init__(self, points: Sequence[BatchConfig]) -> None:
        self.points = sorted({p.canonical() for p in points})
        self.space = OptunaSpace(self.points)
        """The lattice as the study's parameters: ``space(trial)`` proposes in a trial."""
        self._chosen: dict[int, Proposal] = {}
        self._other = optuna.samplers.RandomSampler()

    def propose(self, h: History) -> Proposal | str | None:
        """The next configuration to measure after ``h``; None: nothing until a running
        trial finishes; :data:`DONE`: nothing left."""
        raise NotImplementedError

    def history(self, study: optuna.Study, exclude: int | None = None) -> History:
        """``study`` as the search reads it."""
        chosen = {n: p.config for n, p in self._chosen.items()}
        return read_history(study.get_trials(deepcopy=False), self.space, exclude=exclude,
                            chosen=chosen)  # fmt: skip

    def proposal(self, number: int) -> Proposal | None:
        """What this sampler proposed for the running trial ``number``."""
        return self._chosen.get(number)

    def configuration(self, trial: optuna.Trial) -> BatchConfig:
        """In an objective of your own: the configuration ``trial`` is to measure, with
        its sizes as user attributes and ``repeat``, how often it was measured before."""
        config = BatchConfig.from_mapping(self.space(trial))
        h = self.history(trial.study, exclude=trial.number)
        for key, value in {**config_attrs(config), "repeat": h.looks.get(h.key(config), 0)}.items():
            trial.set_user_attr(key, value)
        return config

    # -- Optuna's sampler interface -----------------------------------------------------

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict:
        return {}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial, search_space: dict) -> dict:
        return {}

    def sample_independent(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        param_name: str,
        param_distribution: optuna.distributions.BaseDistribution,
    ) -> Any:
        if trial.number not in self._chosen:
            h = self.history(study, exclude=trial.number)
            proposal = self.propose(h)
            if not isinstance(proposal, Proposal):  # asked anyway: the best so far again
                proposal = Proposal(_anyway(h, self.points))
            self._chosen[trial.number] = proposal
        params = self.space.encode(self._chosen[trial.number].config)[0]
        if param_name in params:
            return params[param_name]
        return self._other.sample_independent(study, trial, param_name, param_distribution)

    def after_trial(
        self,
        study: optuna.Study,
        trial: FrozenTrial,
        state: TrialState,
        values: Sequence[float] | None,
    ) -> None:
        self._chosen.pop(trial.number, None)


def _anyway(h: History, points: Sequence[BatchConfig]) -> BatchConfig:
    """What a trial asked of a sampler with nothing to propose measures: the configuration
    measured best so far, else the first."""
    ok = {c: v for c, v in h.measured.items() if v > 0}
    return max(ok, key=ok.__getitem__) if ok else points[0]


class ModelSampler(LatticeSampler):
    """The search model as an Optuna sampler (``search.sampler: model``): the configuration
    the model finds most likely the fastest, first and whenever it is still to be measured
    (:func:`likeliest_best`); then the checks a stop waits for: a value of a dimension
    never measured (beside the leader), another look at the leader or a close rival where
    the model finds that worth more than anything new, and the likeliest rivals before a
    stop (docs/confidence.md). Its state is the study's trials: a study
    resumed, or taught an earlier run's trials (user attribute ``warm_start``), is
    proposed in as if it had never stopped. ``RecommendAndStop`` stops a study of your own
    where ``mbtune run`` would stop."""

    def __init__(self, model: SearchModel) -> None:
        super().__init__(model.points)
        self.model = model

    @classmethod
    def for_experiment(cls, exp: Experiment) -> ModelSampler:
        """The sampler ``mbtune run`` proposes with for ``exp`` (its space, noise floor,
        objective, seed, confidence target and max_repeats)."""
        return cls(search_model(exp))

    def assessment(self, observations: Sequence[Observation]) -> Assessment | None:
        """The search model's view of ``observations``, or None before any ran ok."""
        if not any(o.status == "ok" for o in observations):
            return None
        return self.model.assess(observations)

    def rule(self) -> dict[str, Any]:
        """The search's rule for another look and the stop (mbtune.search._stopping)."""
        return {"target": self.model.target, "max_repeats": self.model.max_repeats,
                "noise_floor": self.model.noise_floor}  # fmt: skip

    def propose(self, h: History) -> Proposal | str | None:
        a = self.assessment(h.observations)
        view = self.assessment([*h.taught, *h.observations]) if h.taught else a
        # with batch mixing, only m = P runs: every other point is that one (key)
        open_points = sorted({h.key(p) for p in self.points} - set(h.measured) - h.busy)
        if open_points and view is None:
            return Proposal(first_guess(open_points, self.model.global_objective))
        if view is not None and (best := likeliest_best(view, open_points, self.model.target)):
            return Proposal(best)  # the best guess first, the checks after it
        new = None
        if open_points:
            if unmeasured := [p for p in open_points if p in view.open_points]:
                # a value never measured (nothing else settles its chance): beside the
                # leader, so that the two differ in that value alone
                new = nearest(unmeasured, view.recommended or unmeasured[0])
            else:
                likely = {p: view.p_best.get(p, 0.0) for p in open_points}
                new = max(likely, key=likely.__getitem__)
        if a is not None:
            threat = a.unmeasured_threat if new is not None else None
            look = another_look(a, **self.rule(), busy=h.busy, new_threat=threat)
            if look is not None:
                return Proposal(*look)
        if new is None:
            return None if h.running else DONE
        return Proposal(new)


class RecommendAndStop:
    """An Optuna callback for a study a :class:`ModelSampler` proposes in: after each
    trial, the recommendation (the study's user attributes ``recommendation``,
    ``confidence`` and ``trials``, and optuna-dashboard's note), and ``study.stop()`` where
    ``mbtune run`` would stop: the score at its target with the looks it wants taken, a
    tie, or nothing left to measure."""

    def __init__(self, sampler: ModelSampler) -> None:
        self.sampler = sampler
        self.reporter = Reporter(sampler.model)
        self.history: list[dict[str, Any]] = []

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        records = records_of(study.get_trials(deepcopy=False), self.sampler.space)
        rec = self.reporter.update(records, self.history)
        if rec is not None:
            self.history.append(rec.record())
            publish(study, rec.line(), confidence=rec.confidence,
                    target=self.sampler.model.target, trials=len(records))  # fmt: skip
            if settled(self.reporter.assess(records), **self.sampler.rule()):
                study.stop()
                return
        if self.sampler.propose(self.sampler.history(study)) == DONE:
            study.stop()


# ---------------------------------------------------------------------------
# the model's first guess and its neighbour


def first_guess(points: Sequence[BatchConfig], global_objective: bool) -> BatchConfig:
    """What the model expects fastest before anything is measured: throughput per device
    is all it models, so with a global objective the most devices; then the middle of the
    rest of the space (in octaves of m, n and B, and of the split, t and p), which the first
    measurement tells most about; and of the schedules at that point, the one its known
    trend expects fastest: the least bubble (``BatchConfig.bubble``). A
    data-parallel space has one split (t = p = 1, no bubble): the middle of m, n and B."""
    if global_objective:
        most = max(p.num_devices for p in points)
        points = [p for p in points if p.num_devices == most]
    return _middle(points)


def likeliest_best(
    a: Assessment, open_points: Sequence[BatchConfig], target: int
) -> BatchConfig | None:
    """The configuration the model finds likeliest the fastest (the highest probability
    of being the best, measured or not), where it is still to be measured and the search
    is below its target: measured next, before another look or a check. Caution belongs
    before the stop, not before the best guess: the second looks and every value's
    likeliest configuration (a device count never measured) come once the likeliest best
    is measured, and the stop waits for them all the same (docs/confidence.md)."""
    if not a.p_best or a.confidence >= target or a.tie is not None:
        return None
    best = max(a.p_best, key=a.p_best.__getitem__)
    return best if best in open_points else None


def _middle(points: Sequence[BatchConfig]) -> BatchConfig:
    """The point nearest the centre of the space, in octaves of m, n, B, t and p; of the
    schedules there, the least bubble."""

    def octaves(c: BatchConfig) -> tuple[float, ...]:
        return tuple(math.log2(getattr(c, d)) for d in _OCTAVES)

    centre = [sum(dim) / len(points) for dim in zip(*map(octaves, points), strict=True)]
    return min(points, key=lambda c: (math.dist(octaves(c), centre), c.bubble))


_OCTAVES = ("micro_batch_size", "num_devices", "batch_size", "tensor_parallel", "pipeline_parallel")
"""The dimensions a first guess is the middle of: the sizes and the split."""


# ---------------------------------------------------------------------------
# baselines


class LatticeGridSampler(LatticeSampler):
    """Every configuration once, in order (devices, batch, micro-batch)."""

    def propose(self, h: History) -> Proposal | str | None:
        seen = set(h.values) | set(h.running.values())
        for p in self.points:
            if p not in seen:
                return Proposal(p)
        return DONE


Values = dict[BatchConfig, float]
"""Each configuration's latest answer, as a baseline climbs on it (History.values)."""


class _LadderSampler(LatticeSampler):
    """One ladder of micro-batch sizes per (devices, batch, settings of a step), climbed
    one rung at a time: each rung depends on the last result."""

    def propose(self, h: History) -> Proposal | str | None:
        if h.running:
            return None
        ladders: dict[tuple[Any, ...], list[BatchConfig]] = {}
        for p in self.points:  # in increasing m
            ladders.setdefault((p.num_devices, p.batch_size, *p.settings), []).append(p)
        for key in sorted(ladders):
            point = self.climb(ladders[key], h.values)
            if point is not None:
                return Proposal(point)
        return DONE

    def climb(self, ladder: list[BatchConfig], values: Values) -> BatchConfig | None:
        raise NotImplementedError


class HalvingSampler(_LadderSampler):
    """Composer: start at m = P; on out-of-memory halve; stop at the first that fits."""

    def climb(self, ladder: list[BatchConfig], values: Values) -> BatchConfig | None:
        target = ladder[-1].micro_batch_size  # the largest: P where P is in the space
        while True:
            candidates = [p for p in ladder if p.micro_batch_size <= target]
            if not candidates:
                return None
            point = candidates[-1]
            if point not in values:
                return point
            if values[point] > 0:  # it fits: this ladder is done
                return None
            target = point.micro_batch_size // 2


class DoublingSampler(_LadderSampler):
    """Lightning/Ludwig: start at the smallest m and double while it fits and gets faster."""

    def climb(self, ladder: list[BatchConfig], values: Values) -> BatchConfig | None:
        previous: float | None = None
        target = ladder[0].micro_batch_size
        while True:
            candidates = [p for p in ladder if p.micro_batch_size >= target]
            if not candidates:
                return None
            point = candidates[0]
            if point not in values:
                return point
            value = values[point]
            if value <= 0 or (previous is not None and value <= previous):
                return None  # no longer fits, or no faster: stop climbing
            previous = value
            target = point.micro_batch_size * 2


# ---------------------------------------------------------------------------
# by name


def optuna_sampler(name: str, seed: int) -> optuna.samplers.BaseSampler:
    """Optuna's own sampler ``tpe``, ``gp`` or ``random``, seeded."""
    if name == "tpe":
        # few startup trials: the lattice is small and every trial is expensive
        with warnings.catch_warnings():  # multivariate TPE is "experimental" since 2.2
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            return optuna.samplers.TPESampler(
                seed=seed, n_startup_trials=4, multivariate=True, group=True
            )
    if name == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=4)
    return optuna.samplers.RandomSampler(seed=seed)


def make_sampler(name: str, model: SearchModel, *, seed: int) -> optuna.samplers.BaseSampler:
    """The sampler ``search.sampler: name`` names, over ``model``'s points."""
    lattice = {"grid": LatticeGridSampler, "halving": HalvingSampler, "doubling": DoublingSampler}
    if name == "model":
        return ModelSampler(model)
    if name in lattice:
        return lattice[name](model.points)
    return optuna_sampler(name, seed)
