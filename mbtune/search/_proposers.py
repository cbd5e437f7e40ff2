"""Who proposes the next configuration: Optuna over the lattice, or a baseline.

Every proposal is a point of the experiment's lattice, valid by construction:

- Optuna (``tpe``, ``gp``, ``random``) asks and is told through :class:`OptunaSearcher`,
  over a define-by-run space whose parameters are *indices* into fixed, sorted lists: one
  list of device counts, one list of batch sizes per device count, and the micro-batch
  size's log2 (see :class:`OptunaSpace`). Each parameter name always has the same range
  (Optuna forbids dynamic ones) and its order (small to large) is something TPE and GP
  can exploit.
- ``grid`` measures every distinct configuration once, in order.
- ``halving`` (Composer) starts at m = P and halves on out-of-memory; ``doubling``
  (Lightning, Ludwig) starts small and doubles until the next size no longer fits or is
  no faster.
- ``model`` is not here: the search model proposes itself (mbtune.search._searcher).
"""

from __future__ import annotations

import math
import pickle
import warnings
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import optuna
from ray.tune.search import Searcher

from mbtune.lattice import SETTINGS, BatchConfig
from mbtune.search._study import STUDY_NAME, config_attrs, set_trial_attrs

__all__ = [
    "METRIC",
    "DoublingSearcher",
    "GridSearcher",
    "HalvingSearcher",
    "ListSearcher",
    "OptunaSearcher",
    "OptunaSpace",
    "first_guess",
]

METRIC = "objective"
"""The value every searcher maximises: the experiment's objective, 0 for a failed trial."""


# ---------------------------------------------------------------------------
# Optuna


class OptunaSpace:
    """A define-by-run space proposing only the given points (picklable, for resume).

    Devices and batch sizes are indices into fixed sorted lists. The micro-batch size is
    one parameter shared by every (devices, batch): its log2, mapped to the nearest valid
    size of the chosen (devices, batch). Sharing it lets the sampler carry what it learnt
    about micro-batch sizes on one device count over to the others.
    """

    M_PARAM = "micro_batch_size_log2"

    def __init__(self, points: Sequence[BatchConfig]) -> None:
        self.by_n: dict[int, list[int]] = defaultdict(list)
        self.by_nb: dict[tuple[int, int], list[int]] = defaultdict(list)
        # (B, n, m) once each, whatever settings of a step come with it
        for n, b, m in sorted({(c.num_devices, c.batch_size, c.micro_batch_size) for c in points}):
            if not self.by_n[n] or self.by_n[n][-1] != b:
                self.by_n[n].append(b)
            self.by_nb[n, b].append(m)
        self.choices = {key: sorted({getattr(c, key) for c in points}, key=str) for key in SETTINGS}
        """Each setting of a step (mbtune.lattice.SETTINGS: activation_checkpointing,
        reshard_after_forward, grad_sync) and the values the space gives it: one value, or
        several, then a categorical parameter of its own, named as the setting (every
        (B, n, m) of the lattice comes with each combination of the space)."""
        self.ns = sorted(self.by_n)
        self.log2_max = math.log2(max(max(ms) for ms in self.by_nb.values()))

    def encode(self, c: BatchConfig) -> tuple[dict[str, float], dict[str, Any]]:
        """The Optuna parameters (and their distributions) that propose ``c``."""
        params: dict[str, float] = {}
        dists: dict[str, Any] = {}
        for name, values, value in (
            ("num_devices_index", self.ns, c.num_devices),
            (f"batch_size_index_n{c.num_devices}", self.by_n[c.num_devices], c.batch_size),
        ):
            if len(values) > 1:
                params[name] = values.index(value)
                dists[name] = optuna.distributions.IntDistribution(0, len(values) - 1)
        if self.log2_max > 0:
            params[self.M_PARAM] = math.log2(c.micro_batch_size)
            dists[self.M_PARAM] = optuna.distributions.FloatDistribution(0.0, self.log2_max)
        for key, values in self.choices.items():
            if len(values) > 1:
                params[key] = getattr(c, key)
                dists[key] = optuna.distributions.CategoricalDistribution(values)
        return params, dists

    def decode(self, params: dict[str, Any]) -> BatchConfig:
        """The configuration that Optuna parameters (as :meth:`encode` gives) propose."""
        return BatchConfig.from_mapping(self(optuna.trial.FixedTrial(params)))

    def __call__(self, trial: Any) -> dict[str, Any]:
        n = _pick(trial, "num_devices_index", self.ns)
        b = _pick(trial, f"batch_size_index_n{n}", self.by_n[n])
        ms = self.by_nb[n, b]
        x = trial.suggest_float(self.M_PARAM, 0.0, self.log2_max) if self.log2_max > 0 else 0.0
        m = min(ms, key=lambda m: abs(math.log2(m) - x))
        settings = [
            trial.suggest_categorical(key, values) if len(values) > 1 else values[0]
            for key, values in self.choices.items()
        ]
        return BatchConfig(b, n, m).with_settings(settings).sizes()


def _pick(trial: Any, name: str, values: list[int]) -> int:
    """One of ``values`` (sorted), through an integer index Optuna can model."""
    if len(values) == 1:
        return values[0]
    return values[trial.suggest_int(name, 0, len(values) - 1)]


def first_guess(points: Sequence[BatchConfig], global_objective: bool) -> BatchConfig:
    """What the model expects fastest before anything is measured: throughput per device
    is all it models, so with a global objective the most devices; then the middle of
    the rest of the space, which the first measurement tells most about."""
    if global_objective:
        most = max(p.num_devices for p in points)
        points = [p for p in points if p.num_devices == most]
    return _middle(points)


def _middle(points: Sequence[BatchConfig]) -> BatchConfig:
    """The point nearest the centre of the space, in octaves of m, n and B."""

    def octaves(c: BatchConfig) -> tuple[float, ...]:
        return tuple(math.log2(v) for v in (c.micro_batch_size, c.num_devices, c.batch_size))

    centre = [sum(dim) / len(points) for dim in zip(*map(octaves, points), strict=True)]
    return min(points, key=lambda c: math.dist(octaves(c), centre))


def _optuna_sampler(name: str, seed: int) -> optuna.samplers.BaseSampler:
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


class _PickledSearcher(Searcher):
    """A Tune searcher whose whole state is its attributes: saved and restored by pickle."""

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))


class OptunaSearcher(_PickledSearcher):
    """Optuna's ask-and-tell over the lattice, as a Tune searcher (``tpe``, ``gp``,
    ``random``): the same adapter as Ray's ``OptunaSearch``, written for a define-by-run
    space of lattice points and told results it did not ask for, through Optuna's public
    API only. Its study lives in ``storage`` (the run's SQLite file) or in memory.

    Every trial of the study carries, as user attributes, the configuration as the user
    names it (set when it is asked) and what it measured (set when it is told: the keys of
    the result beside the objective; mbtune.search._study says which)."""

    def __init__(self, space: OptunaSpace, sampler: str, seed: int, storage: Any = None) -> None:
        super().__init__(metric=METRIC, mode="max")
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.space = space
        self.storage = storage if storage is not None else optuna.storages.InMemoryStorage()
        """The study's storage, through whose methods a trial's attributes are set."""
        self.study = optuna.create_study(
            storage=self.storage,
            sampler=_optuna_sampler(sampler, seed),
            study_name=STUDY_NAME,
            direction="maximize",
            load_if_exists=True,
        )
        self.asked: dict[str, int] = {}
        """Tune's trial id -> the Optuna trial number it was asked as."""

    def suggest(self, trial_id: str) -> dict[str, Any]:
        trial = self.study.ask()
        self.asked[trial_id] = trial.number
        params = self.space(trial)
        for key, value in config_attrs(BatchConfig.from_mapping(params)).items():
            trial.set_user_attr(key, value)
        return params

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
        """Tell the study the trial ``trial_id`` asked for; ``result``: the objective and
        the user attributes of what was measured (mbtune.search._study.record_attrs), or a
        ``status`` alone."""
        number = self.asked.pop(trial_id, None)
        if number is None:
            return
        attrs = {k: v for k, v in (result or {}).items() if k != METRIC}
        value = None if error or not result else float(result.get(METRIC) or 0.0)
        state = self._state(number)
        if state == optuna.trial.TrialState.RUNNING:
            set_trial_attrs(self.storage, number, attrs)
            if value is None:
                self.study.tell(number, state=optuna.trial.TrialState.FAIL)
            else:
                self.study.tell(number, value)
        elif state == optuna.trial.TrialState.FAIL and value is not None and "batch_size" in attrs:
            # asked before the run was interrupted (and marked failed then), measured after
            # it resumed: the result is learnt as a trial of its own
            self.tell(BatchConfig.from_mapping(attrs), value, measured=True, attrs=attrs)
        # COMPLETE: a study in the run directory outlives a killed driver, and may have been
        # told this trial after Ray last saved the searcher that asked it

    def _state(self, number: int) -> optuna.trial.TrialState:
        study_id = self.storage.get_study_id_from_name(STUDY_NAME)
        trial_id = self.storage.get_trial_id_from_study_id_trial_number(study_id, number)
        return self.storage.get_trial(trial_id).state

    def _told(self) -> set[str]:
        """Ray's ids of the trials the study was told the results of."""
        states = (optuna.trial.TrialState.COMPLETE,)
        trials = self.study.get_trials(deepcopy=False, states=states)
        return {t.user_attrs["trial_id"] for t in trials if "trial_id" in t.user_attrs}

    def tell(
        self,
        config: BatchConfig,
        value: float,
        *,
        measured: bool,
        attrs: Mapping[str, Any] | None = None,
    ) -> None:
        """A result it did not ask for (measured in this search or not), added to the
        study as a finished trial: Optuna learns from every result. ``attrs``: its user
        attributes beyond the configuration (mbtune.search._study.record_attrs)."""
        if measured and attrs and attrs.get("trial_id") in self._told():
            return  # told before the driver was killed, and read back from trials.csv now
        params, distributions = self.space.encode(config.canonical())
        status = {"status": "ok" if value > 0 else "error"}
        self.study.add_trial(
            optuna.trial.create_trial(
                params=params,
                distributions=distributions,
                value=value,
                user_attrs={**config_attrs(config), **status, **(attrs or {})},
            )
        )


# ---------------------------------------------------------------------------
# baselines


class ListSearcher(_PickledSearcher):
    """A searcher over a fixed list of points, told the value of each finished one."""

    def __init__(self, points: Sequence[BatchConfig]) -> None:
        super().__init__(metric=METRIC, mode="max")
        self.points = sorted(set(points))
        self.values: dict[BatchConfig, float] = {}
        self.pending: dict[str, BatchConfig] = {}

    def next_point(self) -> BatchConfig | str | None:
        """The next point, None to wait for a result, or FINISHED."""
        raise NotImplementedError

    def suggest(self, trial_id: str) -> dict | str | None:
        point = self.next_point()
        if point is None or point == Searcher.FINISHED:
            return point
        self.pending[trial_id] = point  # type: ignore[assignment]
        return point.sizes()  # type: ignore[union-attr]

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
        point = self.pending.pop(trial_id, None)
        if point is not None:
            self.values[point] = (result or {}).get(METRIC, 0.0) if not error else 0.0

    def tell(
        self,
        config: BatchConfig,
        value: float,
        *,
        measured: bool,
        attrs: Mapping[str, Any] | None = None,
    ) -> None:
        """A result it did not ask for: learnt only where this search ``measured`` it (a
        warm start must not make ``grid`` skip a configuration); ``attrs`` are Optuna's."""
        if measured:
            self.values[config.canonical()] = value


class GridSearcher(ListSearcher):
    """Every point once, in order (devices, batch, micro-batch)."""

    def next_point(self) -> BatchConfig | str | None:
        seen = set(self.values) | set(self.pending.values())
        for p in self.points:
            if p not in seen:
                return p
        return Searcher.FINISHED


class _LadderSearcher(ListSearcher):
    """One ladder of micro-batch sizes per (devices, batch), climbed one rung at a time."""

    def ladders(self) -> list[list[BatchConfig]]:
        """One per (devices, batch, settings of a step), in increasing m."""
        by_nb: dict[tuple[Any, ...], list[BatchConfig]] = defaultdict(list)
        for p in self.points:
            by_nb[(p.num_devices, p.batch_size, *p.settings)].append(p)
        return [sorted(by_nb[k]) for k in sorted(by_nb)]

    def next_point(self) -> BatchConfig | str | None:
        if self.pending:
            return None  # each rung depends on the last result
        for ladder in self.ladders():
            point = self.climb(ladder)
            if point is not None:
                return point
        return Searcher.FINISHED

    def climb(self, ladder: list[BatchConfig]) -> BatchConfig | None:
        raise NotImplementedError


class HalvingSearcher(_LadderSearcher):
    """Composer: start at m = P; on out-of-memory halve; stop at the first that fits."""

    def climb(self, ladder: list[BatchConfig]) -> BatchConfig | None:
        target = ladder[-1].micro_batch_size  # the largest: P where P is in the space
        while True:
            candidates = [p for p in ladder if p.micro_batch_size <= target]
            if not candidates:
                return None
            point = candidates[-1]
            if point not in self.values:
                return point
            if self.values[point] > 0:  # it fits: this ladder is done
                return None
            target = point.micro_batch_size // 2


class DoublingSearcher(_LadderSearcher):
    """Lightning/Ludwig: start at the smallest m and double while it fits and gets faster."""

    def climb(self, ladder: list[BatchConfig]) -> BatchConfig | None:
        previous: float | None = None
        target = ladder[0].micro_batch_size
        while True:
            candidates = [p for p in ladder if p.micro_batch_size >= target]
            if not candidates:
                return None
            point = candidates[0]
            if point not in self.values:
                return point
            value = self.values[point]
            if value <= 0 or (previous is not None and value <= previous):
                return None  # no longer fits, or no faster: stop climbing
            previous = value
            target = point.micro_batch_size * 2
