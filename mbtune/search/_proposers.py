"""Who proposes the next configuration: Optuna over the lattice, or a baseline.

Every proposal is a point of the experiment's lattice, valid by construction:

- Optuna (``tpe``, ``gp``, ``random``) runs inside Ray Tune's ``OptunaSearch`` with a
  define-by-run space whose parameters are *indices* into fixed, sorted lists: one list of
  device counts, one list of batch sizes per device count, one list of micro-batch sizes
  per (devices, batch). Each parameter name always has the same range (Optuna forbids
  dynamic ones) and its order (small to large) is something TPE and GP can exploit.
- ``grid`` measures every distinct configuration once, in order.
- ``halving`` (Composer) starts at m = P and halves on out-of-memory; ``doubling``
  (Lightning, Ludwig) starts small and doubles until the next size no longer fits or is
  no faster.

:class:`DedupSearcher` wraps any of them so that the same measurement is never made
twice: a proposal whose canonical configuration (the micro-batches it really runs) was
measured already is answered from the cache and the proposer asked again.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pickle
import warnings
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import optuna
from ray.tune.search import Searcher

from mbtune.lattice import BatchConfig

__all__ = [
    "METRIC",
    "DedupSearcher",
    "DoublingSearcher",
    "GridSearcher",
    "HalvingSearcher",
    "OptunaSpace",
    "make_searcher",
    "pack_result",
    "unpack_result",
]

METRIC = "objective"
"""The value every searcher maximises: the experiment's objective, 0 for a failed trial."""

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


MAX_REPEATS = 200
"""Proposals in a row answered from the cache before the space counts as exhausted."""


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
    AC_PARAM = "activation_checkpointing"

    def __init__(self, points: Sequence[BatchConfig]) -> None:
        self.by_n: dict[int, list[int]] = defaultdict(list)
        self.by_nb: dict[tuple[int, int], list[int]] = defaultdict(list)
        # (B, n, m) once each, whatever settings of activation checkpointing come with it
        for n, b, m in sorted({(c.num_devices, c.batch_size, c.micro_batch_size) for c in points}):
            if not self.by_n[n] or self.by_n[n][-1] != b:
                self.by_n[n].append(b)
            self.by_nb[n, b].append(m)
        self.checkpointing = sorted({c.activation_checkpointing for c in points})
        """[False], [True] or [False, True]: the last a categorical parameter of its own
        (every (B, n, m) of the lattice comes with each setting of the space)."""
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
        if len(self.checkpointing) > 1:
            params[self.AC_PARAM] = c.activation_checkpointing
            dists[self.AC_PARAM] = optuna.distributions.CategoricalDistribution([False, True])
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
        if len(self.checkpointing) > 1:
            checkpointing = trial.suggest_categorical(self.AC_PARAM, [False, True])
        else:
            checkpointing = self.checkpointing[0]
        return BatchConfig(b, n, m, checkpointing).sizes()


def _pick(trial: Any, name: str, values: list[int]) -> int:
    """One of ``values`` (sorted), through an integer index Optuna can model."""
    if len(values) == 1:
        return values[0]
    return values[trial.suggest_int(name, 0, len(values) - 1)]


class ModelSampler(optuna.samplers.BaseSampler):
    """An Optuna sampler that proposes what the confidence score's model finds most
    likely to be the fastest configuration (``search.sampler: model``).

    The model (:mod:`mbtune.confidence`) sees every finished trial of the study: its
    configuration, objective, status and step times (user attributes the search sets).
    It proposes the unmeasured configuration with the highest probability of being the
    fastest in the space, so each trial is the one that can most change, or most
    confirm, the recommendation; with nothing measured yet, its first guess (see
    ``_first_guess``).
    It proposes whole configurations, so it answers Optuna's define-by-run questions
    from the configuration it chose for the trial.
    """

    def __init__(
        self,
        space: OptunaSpace,
        points: Sequence[BatchConfig],
        seed: int,
        global_objective: bool = True,
    ) -> None:
        self.space = space
        self.global_objective = global_objective
        self.points = sorted({p.canonical() for p in points})
        self.seed = seed
        self.fallback = optuna.samplers.RandomSampler(seed=seed)
        self.chosen: dict[int, dict[str, float]] = {}

    def infer_relative_search_space(self, study: Any, trial: Any) -> dict:
        return {}

    def sample_relative(self, study: Any, trial: Any, search_space: dict) -> dict:
        return {}

    def sample_independent(self, study: Any, trial: Any, name: str, distribution: Any) -> Any:
        if trial.number not in self.chosen:
            self.chosen[trial.number] = self.space.encode(self.propose(study))[0]
        params = self.chosen[trial.number]
        if name in params:
            return params[name]
        return self.fallback.sample_independent(study, trial, name, distribution)

    def propose(self, study: Any) -> BatchConfig:
        from mbtune.confidence import assess, observation

        observations, busy = [], set()
        for t in study.get_trials(deepcopy=False):
            try:
                config = self.space.decode(t.params)
            except ValueError:  # a trial still being asked (this one): no full params yet
                continue
            if t.state == optuna.trial.TrialState.RUNNING:
                busy.add(config)
            elif t.state == optuna.trial.TrialState.COMPLETE:
                # a warm start's trials carry no status: a positive value ran
                attrs = {"status": "ok" if t.value else "error", **t.user_attrs}
                observations.append(observation({**config.sizes(), "objective": t.value, **attrs}))
        done = busy | {o.config for o in observations}
        open_points = [p for p in self.points if p not in done]
        if not open_points:
            return self.points[0]  # everything measured: the searcher ends the search
        if not any(o.status == "ok" for o in observations):
            return _first_guess(open_points, self.global_objective)
        a = assess(
            self.points,
            observations,
            global_objective=self.global_objective,
            seed=self.seed + len(observations),
        )
        likely = {p: a.p_best.get(p, 0.0) for p in open_points}
        best = max(likely, key=likely.get)
        if likely[best] > 0:
            return best
        # nothing unmeasured can still win: any point left (the search is about to stop)
        return open_points[len(observations) % len(open_points)]

    def reseed_rng(self) -> None:
        self.fallback.reseed_rng()

    def after_trial(self, study: Any, trial: Any, state: Any, values: Any) -> None:
        self.chosen.pop(trial.number, None)


def _first_guess(points: Sequence[BatchConfig], global_objective: bool) -> BatchConfig:
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


def _optuna_searcher(
    sampler_name: str,
    points: Sequence[BatchConfig],
    seed: int,
    storage: Any,
    global_objective: bool = True,
):
    from ray.tune.search.optuna import OptunaSearch

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    space = OptunaSpace(points)
    # the GP sampler fits its model inside ask(), which Ray mistakes for work done in the
    # define-by-run space; the space itself only picks indices
    warnings.filterwarnings("ignore", message="Define-by-run function passed in the `space`")
    if sampler_name == "tpe":
        # few startup trials: the lattice is small and every trial is expensive
        with warnings.catch_warnings():  # multivariate TPE is "experimental" since 2.2
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            sampler = optuna.samplers.TPESampler(
                seed=seed, n_startup_trials=4, multivariate=True, group=True
            )
    elif sampler_name == "gp":
        sampler = optuna.samplers.GPSampler(seed=seed, n_startup_trials=4)
    elif sampler_name == "model":
        sampler = ModelSampler(space, points, seed, global_objective)
    else:
        sampler = optuna.samplers.RandomSampler(seed=seed)
    return OptunaSearch(
        space=space,
        metric=METRIC,
        mode="max",
        sampler=sampler,
        storage=storage,
        study_name="mbtune",
    )


# ---------------------------------------------------------------------------
# baselines


class _ListSearcher(Searcher):
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

    def save(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "wb") as f:
            pickle.dump(self.__dict__, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            self.__dict__.update(pickle.load(f))


class GridSearcher(_ListSearcher):
    """Every point once, in order (devices, batch, micro-batch)."""

    def next_point(self) -> BatchConfig | str | None:
        seen = set(self.values) | set(self.pending.values())
        for p in self.points:
            if p not in seen:
                return p
        return Searcher.FINISHED


class _LadderSearcher(_ListSearcher):
    """One ladder of micro-batch sizes per (devices, batch), climbed one rung at a time."""

    def ladders(self) -> list[list[BatchConfig]]:
        """One per (devices, batch, activation checkpointing), in increasing m."""
        by_nb: dict[tuple[int, int, bool], list[BatchConfig]] = defaultdict(list)
        for p in self.points:
            by_nb[p.num_devices, p.batch_size, p.activation_checkpointing].append(p)
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


# ---------------------------------------------------------------------------
# no measurement twice


class DedupSearcher(Searcher):
    """Wraps a searcher; never hands out a configuration already measured or running.

    A repeated proposal is answered at once from the cache (the inner searcher is told
    the measured value) and the inner searcher asked again. Once every distinct point has
    been measured, or the inner searcher keeps repeating itself, the search is finished.
    """

    def __init__(
        self,
        inner: Searcher,
        points: Sequence[BatchConfig],
        start_points: Sequence[BatchConfig] = (),
        ledger: str | None = None,
    ) -> None:
        super().__init__(metric=METRIC, mode="max")
        self.ledger = ledger
        """The run's trials.csv: on restore, what finished since the last save."""
        self.inner = inner
        self.points = {p.canonical() for p in points}
        self.queue = [p.canonical() for p in start_points]
        """Configurations to measure first (search.start_points)."""
        self.measured: dict[BatchConfig, float] = {}
        self.running: dict[str, tuple[BatchConfig, str | None]] = {}
        self.full_batch_only = False
        """Set once a trial reports that the model mixes the batch: then m = P only."""
        self._asked = 0

    def key(self, config: BatchConfig) -> BatchConfig:
        if self.full_batch_only:
            config = dataclasses.replace(config, micro_batch_size=config.per_device_batch)
        return config.canonical()

    def suggest(self, trial_id: str) -> dict | str | None:
        while self.queue:
            point = self.key(self.queue.pop(0))
            if point not in self.measured and point not in self._running_points():
                self.running[trial_id] = (point, None)
                return point.sizes()
        for _ in range(MAX_REPEATS):
            if self._remaining() == 0:
                return Searcher.FINISHED
            self._asked += 1
            inner_id = f"{trial_id}-{self._asked}"
            params = self.inner.suggest(inner_id)
            if params is None or params == Searcher.FINISHED:
                return params
            point = self.key(BatchConfig.from_mapping(params))
            if point in self.measured:
                self.inner.on_trial_complete(inner_id, {METRIC: self.measured[point]})
                continue
            if point in self._running_points():
                self.inner.on_trial_complete(inner_id, None, error=True)
                continue
            self.running[trial_id] = (point, inner_id)
            return {**params, **point.sizes()}
        return Searcher.FINISHED

    def _running_points(self) -> set[BatchConfig]:
        return {p for p, _ in self.running.values()}

    def _remaining(self) -> int:
        done = set(self.measured) | self._running_points()
        return len({self.key(p) for p in self.points} - done)

    def on_trial_complete(self, trial_id: str, result: dict | None = None, error: bool = False):
        point, inner_id = self.running.pop(trial_id, (None, None))
        if point is None:
            return
        result = unpack_result(result)
        value = 0.0 if error or not result else float(result.get(METRIC) or 0.0)
        if result and result.get("mixes_batch"):
            self.full_batch_only = True
        self.measured[point] = value
        if result and "micro_batch_size" in result:  # what really ran (e.g. after halving)
            self.measured[self.key(BatchConfig.from_mapping(result))] = value
        attrs = _trial_attrs(result, error)
        if inner_id is None:  # a start point: the proposer did not ask for it
            self.tell(point, value, measured=True, attrs=attrs)
        else:
            trial = getattr(self.inner, "_ot_trials", {}).get(inner_id)  # OptunaSearch's
            if trial is not None:  # what the model sampler learns besides the value
                for key, attr in attrs.items():
                    trial.set_user_attr(key, attr)
            self.inner.on_trial_complete(inner_id, {METRIC: value})

    def add_measured(self, config: BatchConfig, value: float) -> None:
        """A point measured before this search (resume): never measure it again."""
        self.measured[self.key(config)] = value
        self.tell(config, value, measured=True)

    def tell(
        self,
        config: BatchConfig,
        value: float,
        *,
        measured: bool = False,
        attrs: dict[str, Any] | None = None,
    ) -> None:
        """Teach the proposer a result it did not ask for (a start point, a warm start).

        Optuna learns from every result; the baselines only from what this search measured
        (``measured``): a warm start must not make ``grid`` skip a configuration.
        """
        if isinstance(self.inner, _ListSearcher):
            if measured:
                self.inner.values[config.canonical()] = value
            return
        space: OptunaSpace = self.inner._space  # OptunaSearch keeps the define-by-run space
        study = self.inner._ot_study  # and its study: add the result as a finished trial
        params, distributions = space.encode(config.canonical())
        study.add_trial(
            optuna.trial.create_trial(
                params=params, distributions=distributions, value=value, user_attrs=attrs or {}
            )
        )

    def set_search_properties(self, metric: str | None, mode: str | None, config: dict, **spec):
        return True

    def save(self, checkpoint_path: str) -> None:
        # Ray keeps exactly one file per searcher: the inner searcher's state goes inside it
        inner_path = checkpoint_path + ".inner"
        self.inner.save(inner_path)
        state = {k: v for k, v in self.__dict__.items() if k != "inner"}
        state["inner_state"] = Path(inner_path).read_bytes()
        Path(inner_path).unlink()
        with open(checkpoint_path, "wb") as f:
            pickle.dump(state, f)

    def restore(self, checkpoint_path: str) -> None:
        with open(checkpoint_path, "rb") as f:
            state = pickle.load(f)
        inner_path = Path(checkpoint_path + ".inner")
        inner_path.write_bytes(state.pop("inner_state"))
        self.inner.restore(str(inner_path))
        inner_path.unlink()
        self.__dict__.update(state)
        self._catch_up()

    def _catch_up(self) -> None:
        """Learn the trials that finished after Ray last saved this searcher (a driver
        killed between the two): trials.csv, written first, is the record."""
        if not self.ledger or not Path(self.ledger).exists():
            return
        from mbtune.rundir import RunDir

        for row in RunDir(Path(self.ledger).parent).trials():
            config = self.key(BatchConfig.from_mapping(row))
            if config not in self.measured:
                self.add_measured(config, float(row.get("objective") or 0.0))


def _trial_attrs(result: dict | None, error: bool) -> dict[str, Any]:
    """A finished trial's status and step times, as Optuna user attributes."""
    result = result or {}
    return {
        "status": "error" if error else result.get("status", "error"),
        "step_times_ms": list(result.get("step_times_ms") or []),
        "micro_batch_sizes_tried": list(result.get("micro_batch_sizes_tried") or []),
    }


def make_searcher(
    sampler: str,
    points: Sequence[BatchConfig],
    *,
    seed: int,
    storage: Any = None,
    start_points: Sequence[BatchConfig] = (),
    global_objective: bool = True,
    ledger: str | Path | None = None,
) -> DedupSearcher:
    """The searcher for ``search.sampler``, wrapped so nothing is measured twice."""
    baselines = {"grid": GridSearcher, "halving": HalvingSearcher, "doubling": DoublingSearcher}
    canonical = sorted({p.canonical() for p in points})
    if sampler in baselines:
        inner: Searcher = baselines[sampler](canonical)
    else:
        inner = _optuna_searcher(sampler, canonical, seed, storage, global_objective)
    return DedupSearcher(inner, canonical, start_points, str(ledger) if ledger else None)
