"""The confidence score: how likely is the recommendation within 2% of the best?

Pure numerics (numpy and scipy; neither torch nor ray). The method, in the order the
code runs it (``docs/confidence.md`` has the reasoning and the calibration figures):

1. **Feasible region.** Every distinct configuration of the space is a candidate, except
   those that cannot win: a configuration that failed (``error``, ``timeout``) and every
   configuration whose micro-batch is at least as large as one that ran out of memory
   with the same activation checkpointing (memory grows with the micro-batch a device
   runs, whatever n and B are).
2. **Measurement noise.** Each trial keeps every step time. The relative spread of step
   times is pooled over all trials (one trial's few steps say little on their own) and
   turned into the variance of the log of each trial's median, plus the run-to-run drift
   one trial cannot see: estimated from the configurations measured more than once (how
   far their repeats disagree beyond their step noise), with ``noise_floor`` as the
   prior (worth ``DRIFT_PRIOR_DOF`` repeats). Every repeat is an observation of its own.
3. **A model of the rest.** The log of the objective over (log2 m, log2 n, log2 B, and
   activation checkpointing as 0 or 1 where the space searches it) is a
   Gaussian process: a constant, a linear trend (throughput scales with devices and
   grows with m), a curvature in n (communication can make fewer devices faster), a
   curvature in m (throughput saturates with the micro-batch) and a smooth Matern-5/2
   deviation from them. Its two shape
   hyperparameters (length scale, amplitude) are not fixed but averaged over a grid,
   each weighted by how well it explains the measurements (Bayesian model averaging):
   with few measurements many shapes remain possible, and the score stays low.
4. **The score.** Joint samples of the true objective of every feasible configuration,
   measured or not, are drawn from the posterior. The recommendation is the measured
   configuration with the highest posterior mean; the score is the fraction of samples
   in which it is within ``tolerance`` of the sample's best, in percent, capped at 99.
   Each other configuration's *threat* is the fraction in which it beats the
   recommendation by more than ``tolerance``, and the unmeasured configurations' threat
   the fraction in which any of them does: what the search weighs when it chooses
   between a new configuration and another look at a measured one (mbtune.search).
5. **What was never measured.** A value of a searched dimension that no trial measured
   (a device count, an activation checkpointing setting) is not something the model can
   speak for: it keeps a chance of ``OPEN_CHANCE`` of holding the best, which the score
   leaves out (each such value multiplies it by ``1 - OPEN_CHANCE``) until a trial
   measures it. Device counts included, however many others were measured: a
   communication cost fitted on them cannot see a link tier between two of them (1, 4
   and 8 devices measured, 2 the fastest: bench/close_calls.py, docs/confidence.md).
6. **A tie** (:meth:`SearchModel.assess`). Below the target, the fewest measured
   configurations that hold the best (within the tolerance) with a probability of at
   least the target are the contenders. Where there are several, their estimates lie
   within two measured spreads (drift and step noise) of each other, and each was
   measured enough (``TIE_LOOKS``), they cannot be told apart at this machine's spread:
   the search stops on a tie, recommends one of them by a rule (:func:`tie_order`) and
   says what it was sure of.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.linalg import solve_triangular
from threadpoolctl import threadpool_limits

from mbtune.lattice import BatchConfig
from mbtune.runs.record import CONFIG_KEY, TrialRecord

__all__ = [
    "Assessment",
    "Observation",
    "SearchModel",
    "Tie",
    "assess",
    "between_trial_drift",
    "observation",
    "relative_step_noise",
    "tie_order",
]

TOLERANCE = 0.02
"""Within 2% of the best counts as right."""

MAX_SCORE = 99
"""The score is a probability in percent and never claims certainty."""

DEFAULT_NOISE = 0.03
"""Relative step-time spread assumed while no trial has kept two step times."""

DRIFT_PRIOR_DOF = 4
"""How many repeats' worth of evidence ``noise_floor`` counts for as the drift's prior:
little, so that a run whose repeats disagree (a machine getting busier) or agree (a
quiet accelerator) soon speaks for itself."""

OPEN_CHANCE = 0.15
"""The chance a value of a searched dimension that was never measured (and that the
measured data do not bound) keeps of holding the best: one such value leaves a score of
at most 85, below the usual target, so the search measures it before it stops."""

TIE_LOOKS = 2
"""How often each contender of a tie is measured, at least, before the search calls it
a tie: with two looks each, the spread between repeats is measured on the contenders
themselves. Enough where the machine's spread is too wide for the looks left to tell
two apart by the tolerance (``TIE_RESOLVES``), and for contenders within one spread of
the fastest; otherwise every contender is measured as often as ``search.max_repeats``
allows."""

TIE_RESOLVES = 2.0
"""The looks left can tell two configurations apart where the standard error of their
difference at ``search.max_repeats`` looks each is below this many tolerances (a busy
machine, 7% between repeats, cannot: bench/close_calls.py --landscape busy; a quiet
one, 3.5%, can: --landscape close)."""

TIE_SPREADS = 2.0
"""A tie's members' estimates lie within this many measured spreads of each other."""


_LENGTH_SCALES = (0.75, 1.5, 3.0)  # in octaves of m, n and B
_AMPLITUDES = (0.05, 0.12, 0.3)  # sd of the deviation from the trend, in log units
_TREND_SD = 0.6  # prior sd of the trend's slope per octave (of throughput per device)
_CURVE_SD = 0.2  # prior sd of the trend's curvature in n, per octave squared (see _kernels)
_CURVE_M_SD = 0.05  # the same in m: as much as a saturating curve bends (see _kernels)
_LEVEL_SD = 1.0  # prior sd of the constant, in log units around the mean measurement
_MAX_CANDIDATES = 600  # joint sampling is cubic in this; the rest are pruned (see _threats)


@dataclass(frozen=True)
class Observation:
    """One finished trial, as the confidence math sees it."""

    config: BatchConfig
    """The canonical configuration measured."""
    status: str
    """``ok``, ``oom``, ``error`` or ``timeout``."""
    value: float | None = None
    """The objective (samples/s, or per device), for ``ok``."""
    step_times_ms: tuple[float, ...] = ()
    """Every timed step, to estimate the measurement's noise."""
    oom_micro_batch_sizes: tuple[int, ...] = ()
    """Micro-batch sizes that ran out of memory on the way (``trial.on_oom: halve``)."""


def observation(record: TrialRecord) -> Observation:
    """A finished trial as the confidence math sees it: its canonical configuration, its
    objective where it ran ok (an ok trial without a positive objective counts as an
    error), its step times, and the micro-batch sizes that ran out of memory on the way
    (``micro_batch_sizes_tried`` in order: all but the last, or all of them for an oom)."""
    value = record.objective
    status = record.status or "error"
    if status == "ok" and not (value and value > 0):
        status = "error"
    tried = record.micro_batch_sizes_tried
    return Observation(
        config=record.config.canonical(),
        status=status,
        value=float(value) if status == "ok" else None,
        step_times_ms=record.step_times_ms,
        oom_micro_batch_sizes=tried if status == "oom" else tried[:-1],
    )


@dataclass(frozen=True)
class Tie:
    """Measured configurations the search cannot tell apart, which together hold the best."""

    members: tuple[BatchConfig, ...]
    """The recommendation first: those whose estimate is within the tolerance of the
    fastest's in the order of :func:`tie_order`, then the rest by their estimate."""
    width: float
    """How far apart their estimates are: 1 - the slowest's over the fastest's."""
    probability: float
    """The probability that one of them is within the tolerance of the best."""
    sure: tuple[tuple[str, Any, Any, float], ...] = ()
    """What the search is sure of: (dimension, the members' value, the best other value,
    how many times faster the best member is than the best configuration with it)."""

    def record(self) -> dict[str, Any]:
        """As recommendations.jsonl and summary.json carry it."""
        return {
            "members": [c.sizes() for c in self.members],
            "width": round(self.width, 4),
            "probability": round(self.probability, 3),
            "rule": TIE_RULE,
            "sure": [
                {"dimension": d, "value": v, "over": o, "speedup": round(x, 3)}
                for d, v, o, x in self.sure
            ],
        }


TIE_RULE = "among those within 2% of the fastest: the fewest devices, then the fastest"
"""How a tie picks its recommendation (:func:`tie_order`)."""


def tie_order(c: BatchConfig, estimate: float) -> tuple:
    """A tie's order among its members within the tolerance of the fastest estimate: the
    fewest devices (at the same throughput, the cheapest), then the highest estimate."""
    return (c.num_devices, -estimate, c)


@dataclass(frozen=True)
class Assessment:
    """The recommendation after some trials, and how sure it is."""

    recommended: BatchConfig | None
    value: float | None
    """The recommended configuration's measured objective."""
    confidence: int
    """0..99: the probability, in percent, that it is within 2% of the best."""
    probability: float
    feasible: int
    """Configurations that can still win (measured or not)."""
    unmeasured: int
    """Of those, how many were never measured."""
    p_best: dict[BatchConfig, float] = field(default_factory=dict, repr=False)
    """For each feasible configuration, the probability that it is the fastest."""
    threat: dict[BatchConfig, float] = field(default_factory=dict, repr=False)
    """For each feasible configuration, the probability that it beats the recommendation
    by more than the tolerance (the recommendation's own is 0)."""
    looks: dict[BatchConfig, int] = field(default_factory=dict, repr=False)
    """How many finished trials measured each configuration (any status)."""
    unmeasured_threat: float = 0.0
    """The probability that some configuration never measured beats the recommendation by
    more than the tolerance: the doubt a new measurement can settle (it informs the
    unmeasured configurations near it too, which the model correlates)."""
    drift: float = 0.0
    """The relative run-to-run drift the model assumed (the estimate from repeats, or the
    prior alone)."""
    drift_dof: int = 0
    """Degrees of freedom of repeats behind ``drift`` (0: the prior alone)."""
    trial_sd: float = 0.0
    """One trial's relative spread the model allowed for: the drift with the step noise of
    a trial's median (their variances pooled over the trials): what a tie is read against."""
    estimate: dict[BatchConfig, float] = field(default_factory=dict, repr=False)
    """Each measured feasible configuration's objective as the model estimates it (the
    posterior mean): what the recommendation and the table of the best rank by."""
    unmeasured_values: dict[str, tuple] = field(default_factory=dict)
    """Values of searched dimensions never measured that the data do not bound (each
    keeps ``OPEN_CHANCE``), by dimension."""
    open_points: frozenset[BatchConfig] = field(default_factory=frozenset, repr=False)
    """The unmeasured configurations with such a value: what the search measures next."""
    within: dict[BatchConfig, float] = field(default_factory=dict, repr=False)
    """For each measured feasible configuration, the probability that it is within the
    tolerance of the best (the recommendation's is the score)."""
    contenders: Tie | None = None
    """Below the target: the fewest measured configurations that together hold the best
    with the target's probability, where they are several (module docstring, 6)."""
    tie: Tie | None = None
    """The contenders, where :meth:`SearchModel.assess` found that another look cannot
    tell them apart (then ``recommended`` is the tie's first member and the score its
    own)."""


def relative_step_noise(observations: Iterable[Observation]) -> tuple[float, int]:
    """The pooled relative sd of step times, and its degrees of freedom (0: none seen)."""
    squares, dof = 0.0, 0
    for o in observations:
        times = np.asarray(o.step_times_ms, dtype=float)
        if o.status != "ok" or len(times) < 2 or not np.all(times > 0):
            continue
        squares += float(np.var(np.log(times), ddof=1)) * (len(times) - 1)
        dof += len(times) - 1
    return (math.sqrt(squares / dof), dof) if dof else (DEFAULT_NOISE, 0)


# Its matrices are small (a few hundred rows): BLAS threads only add spin-waits, and the
# driver shares the machine with the trials it measures (5 to 10 times slower when busy).
@threadpool_limits.wrap(limits=1, user_api="blas")
def assess(
    points: Sequence[BatchConfig],
    observations: Sequence[Observation],
    *,
    tolerance: float = TOLERANCE,
    noise_floor: float = 0.0,
    global_objective: bool = True,
    samples: int = 4000,
    seed: int = 0,
    target: int = 90,
    sharded: bool = False,
) -> Assessment:
    """Recommend a measured configuration and score it, over the space ``points``.

    ``global_objective``: the objective grows with the devices (samples/s of all of them),
    so the model learns it per device and multiplies back; False when it is per device.
    ``target``: the search's, which the contenders hold the best with. ``sharded``: the
    trials shard the model (``trial.sharding: fsdp``), which decides what an out of
    memory bounds.
    """
    looks: dict[BatchConfig, list[Observation]] = {}
    for o in observations:  # every repeat of a configuration is an observation of it
        looks.setdefault(o.config, []).append(o)
    counts = {config: len(seen) for config, seen in looks.items()}
    feasible = _feasible(points, observations, sharded=sharded)
    ok = [o for o in observations if o.status == "ok" and o.value and o.config in feasible]
    if not ok:
        return Assessment(None, None, 0, 0.0, len(feasible), len(feasible), looks=counts)
    spread, _ = relative_step_noise(ok)
    drift, drift_dof = between_trial_drift(ok, spread, prior=noise_floor)
    noise_var = np.array([_step_var(spread, o) + drift**2 for o in ok])
    scale = _Scale(points)
    candidates = sorted(feasible)
    z = scale(candidates)

    def per_device(configs: Iterable[BatchConfig]) -> np.ndarray:
        return np.log([c.num_devices if global_objective else 1 for c in configs])

    y = np.log([o.value for o in ok]) - per_device(o.config for o in ok)
    gp = _Mixture(scale(o.config for o in ok), y, noise_var)
    offset = per_device(candidates)
    index = {c: i for i, c in enumerate(candidates)}
    measured = sorted({index[o.config] for o in ok})
    fitted = dict(zip(measured, gp.mean(z[measured]) + offset[measured], strict=True))
    best_measured = max(measured, key=fitted.__getitem__)
    keep = _threats(gp, z, offset, best_measured, tolerance)
    draws = gp.sample(z[keep], samples, seed) + offset[keep]
    r = keep.index(best_measured)
    margin = math.log(1 - tolerance)
    each = within_draws(draws, margin)
    probability = float(each[:, r].mean())
    winners = np.bincount(draws.argmax(axis=1), minlength=len(keep)) / len(draws)
    beating = draws + margin > draws[:, [r]]
    beats = beating.mean(axis=0)
    unmeasured_columns = [j for j, i in enumerate(keep) if i not in fitted]
    unmeasured_threat = float(beating[:, unmeasured_columns].any(axis=1).mean())
    estimate = {candidates[i]: math.exp(v) for i, v in fitted.items()}
    unbounded = _unmeasured_values(
        candidates, [o.config for o in observations if o.status != "oom"]
    )
    held_open = (1 - OPEN_CHANCE) ** sum(map(len, unbounded.values()))
    probability *= held_open
    unmeasured_threat = max(unmeasured_threat, 1 - held_open)
    open_points = frozenset(
        c for c in candidates
        if c not in estimate and any(getattr(c, d) in v for d, v in unbounded.items())
    )  # fmt: skip
    recommended = candidates[best_measured]
    columns = {candidates[i]: j for j, i in enumerate(keep) if i in fitted}
    contenders = None  # a target above what a score can reach (100): the search never stops
    if probability * 100 < target <= MAX_SCORE:
        contenders = _contenders(each, columns, estimate, held_open, target=target)
    values = [o.value for o in ok if o.config == recommended]
    return Assessment(
        recommended=recommended,
        value=statistics.geometric_mean(values),  # every look, pooled
        confidence=min(MAX_SCORE, int(probability * 100)),
        probability=probability,
        feasible=len(candidates),
        unmeasured=len(candidates) - len(measured),
        p_best={candidates[i]: float(p) for i, p in zip(keep, winners, strict=True)},
        threat={candidates[i]: float(p) for i, p in zip(keep, beats, strict=True)},
        looks=counts,
        unmeasured_threat=unmeasured_threat,
        drift=drift,
        drift_dof=drift_dof,
        trial_sd=math.sqrt(float(noise_var.mean())),
        estimate=estimate,
        unmeasured_values=unbounded,
        open_points=open_points,
        within={c: float(each[:, j].mean()) * held_open for c, j in columns.items()},
        contenders=contenders,
    )


def within_draws(draws: np.ndarray, margin: float) -> np.ndarray:
    """For each draw (row) and configuration (column): within the tolerance of the draw's
    best (``margin``: the log of 1 - tolerance)."""
    return draws >= draws.max(axis=1, keepdims=True) + margin


def _unmeasured_values(
    candidates: Sequence[BatchConfig], measured: Iterable[BatchConfig]
) -> dict[str, tuple]:
    """Values of the searched dimensions (beyond the batch and micro-batch sizes) that
    candidates take and no trial ``measured`` (ok, or failed otherwise than out of
    memory: a value that cannot run has had its look)."""
    measured = list(measured)
    out: dict[str, tuple] = {}
    for dim in CONFIG_KEY:
        if dim in ("batch_size", "micro_batch_size"):
            continue
        seen = {getattr(c, dim) for c in measured}
        never = sorted({getattr(c, dim) for c in candidates} - seen)
        if never:
            out[dim] = tuple(never)
    return out


def _contenders(
    within: np.ndarray,
    columns: dict[BatchConfig, int],
    estimate: dict[BatchConfig, float],
    held_open: float,
    *,
    target: int,
) -> Tie | None:
    """The fewest measured configurations (added in order of their own chance of being
    within the tolerance of the best) that together hold it with a probability of at
    least ``target``, where they are several; None where none do together."""
    alone = {c: float(within[:, j].mean()) for c, j in columns.items()}
    members: list[BatchConfig] = []
    held = np.zeros(len(within), dtype=bool)
    for c in sorted(alone, key=lambda c: (-alone[c], c)):
        members.append(c)
        held |= within[:, columns[c]]
        if held.mean() * held_open * 100 >= target:
            break
    else:
        return None
    if len(members) < 2:
        return None
    fastest = max(estimate[c] for c in members)
    # the rule picks among the members as fast as the fastest within the tolerance: where
    # the estimates say one is faster by more, it stays first
    close = [c for c in members if estimate[c] >= fastest * (1 - TOLERANCE)]
    members = sorted(close, key=lambda c: tie_order(c, estimate[c])) + sorted(
        (c for c in members if c not in close), key=lambda c: -estimate[c]
    )
    return Tie(
        members=tuple(members),
        width=1 - min(estimate[c] for c in members) / fastest,
        probability=float(held.mean() * held_open),
        sure=tuple(_sure(members, estimate, fastest)),
    )


def _sure(
    members: Sequence[BatchConfig], estimate: dict[BatchConfig, float], fastest: float
) -> Iterator[tuple[str, Any, Any, float]]:
    """What a tie's members agree on, against the best measured configuration that
    differs there: (dimension, their value, its value, how much faster they are)."""
    for dim in CONFIG_KEY:
        if dim == "micro_batch_size":
            continue
        values = {getattr(c, dim) for c in members}
        others = [c for c in estimate if getattr(c, dim) not in values]
        if len(values) == 1 and others:
            rival = max(others, key=estimate.__getitem__)
            yield dim, values.pop(), getattr(rival, dim), fastest / estimate[rival]


def _step_var(spread: float, o: Observation) -> float:
    """The variance of the log of one trial's median step time, from the step noise: the
    median of k samples varies pi/2 times as much as their mean."""
    return (math.pi / 2) * spread**2 / max(1, len(o.step_times_ms))


def between_trial_drift(
    ok: Sequence[Observation], spread: float, *, prior: float
) -> tuple[float, int]:
    """The relative drift between trials of one configuration, and the degrees of freedom
    of repeats it rests on: how far repeats disagree beyond what their step noise
    explains, pooled over configurations, shrunk towards ``prior`` (worth
    ``DRIFT_PRIOR_DOF`` degrees of freedom)."""
    logs: dict[BatchConfig, list[float]] = {}
    noise: dict[BatchConfig, list[float]] = {}
    for o in ok:
        logs.setdefault(o.config, []).append(math.log(o.value))
        noise.setdefault(o.config, []).append(_step_var(spread, o))
    excess, dof = 0.0, 0
    for config, y in logs.items():
        if len(y) < 2:
            continue
        mean = statistics.fmean(y)
        # E[sum of squares] = (r - 1) (drift^2 + the mean step variance)
        excess += sum((v - mean) ** 2 for v in y) - (len(y) - 1) * statistics.fmean(noise[config])
        dof += len(y) - 1
    if not dof:
        return prior, 0
    estimate = max(0.0, excess / dof)
    return math.sqrt((DRIFT_PRIOR_DOF * prior**2 + dof * estimate) / (DRIFT_PRIOR_DOF + dof)), dof


@dataclass(frozen=True)
class SearchModel:
    """The one model the search proposes with and the reporter scores with: the same
    space, noise floor, objective and seed, so the two never fit different models.
    Its assessments are remembered for the latest few sets of observations (the searcher
    and the reporter ask about the same trials one after the other)."""

    points: tuple[BatchConfig, ...]
    noise_floor: float = 0.0
    global_objective: bool = True
    seed: int = 0
    target: int = 90
    """search.confidence_target: a tie holds the best with at least this probability."""
    max_repeats: int = 3
    sharded: bool = False
    """``trial.sharding: fsdp``: an out of memory bounds fewer devices only."""

    def assess(self, observations: Sequence[Observation]) -> Assessment:
        """The assessment of ``observations``, with the tie where its contenders cannot
        be told apart (module docstring, 6)."""
        return _remembered(self, tuple(observations))

    def _score(self, observations: tuple[Observation, ...]) -> Assessment:
        return assess(
            self.points,
            observations,
            noise_floor=self.noise_floor,
            global_objective=self.global_objective,
            seed=self.seed,
            target=self.target,
            sharded=self.sharded,
        )

    def _tie(self, a: Assessment) -> Tie | None:
        """The contenders, where another look cannot tell them apart at this machine's
        spread (module docstring, 6)."""
        tie = a.contenders
        if tie is None:
            return None
        sd = a.trial_sd
        fastest = max(a.estimate[c] for c in tie.members)
        # could the looks the search may still take tell two apart by the tolerance?
        resolvable = sd * math.sqrt(2 / max(1, self.max_repeats)) < TIE_RESOLVES * TOLERANCE
        for c in tie.members:
            close = a.estimate[c] >= fastest * (1 - max(TOLERANCE, sd))
            looks = TIE_LOOKS if close and not resolvable else max(TIE_LOOKS, self.max_repeats)
            if a.looks.get(c, 0) < min(looks, self.max_repeats):
                return None
        return tie if tie.width <= TIE_SPREADS * sd else None


@functools.lru_cache(maxsize=4)
def _remembered(model: SearchModel, observations: tuple[Observation, ...]) -> Assessment:
    a = model._score(observations)
    tie = model._tie(a)
    if tie is None:
        return a
    pick = tie.members[0]
    values = [o.value for o in observations if o.config == pick and o.status == "ok"]
    return dataclasses.replace(
        a,
        tie=tie,
        recommended=pick,
        value=statistics.geometric_mean(values),
        probability=a.within[pick],
        confidence=min(MAX_SCORE, int(a.within[pick] * 100)),
    )


def _feasible(
    points: Sequence[BatchConfig], observed: Iterable[Observation], *, sharded: bool = False
) -> set[BatchConfig]:
    """The configurations that can still win: not failed (in every look), not above an
    out-of-memory size: one that ran out of memory at micro-batch m on n devices bounds
    every configuration with the same settings of a step (activation checkpointing, and
    sharded, FSDP's: memory grows with m on each one's own scale) at m or more, on any
    number of devices (each holds the whole model), or ``sharded``, on n or fewer (each
    holds a share of it, larger on fewer)."""
    failed: set[BatchConfig] = set()
    ran: set[BatchConfig] = set()
    oom_at: dict[tuple, list[tuple[int, int]]] = {}  # settings -> (n, m) out of memory
    for o in observed:
        c = o.config
        sizes = [c.micro_batch_size] * (o.status == "oom") + list(o.oom_micro_batch_sizes)
        oom_at.setdefault(c.settings, []).extend((c.num_devices, m) for m in sizes)
        if o.status not in ("ok", "oom"):
            failed.add(c)
        elif o.status == "ok":
            ran.add(c)

    def fits(c: BatchConfig) -> bool:
        return not any(
            c.micro_batch_size >= m and (c.num_devices <= n or not sharded)
            for n, m in oom_at.get(c.settings, ())
        )

    return {c for c in (p.canonical() for p in points) if (c in ran or c not in failed) and fits(c)}


def _features(c: BatchConfig) -> tuple[float, ...]:
    """Octaves of m, n and B, and each setting of a step as 0 or 1 (activation
    checkpointing on; sharded, reshard_after_forward off, grad_sync every): each a surface
    of its own, shifted by the trend and close to the other by the smooth deviation (one
    unit apart, as an octave is), so that what one setting measures tells of the other. A
    setting the space does not vary is one value everywhere: centred away (:class:`_Scale`)."""
    return (
        math.log2(c.micro_batch_size),
        math.log2(c.num_devices),
        math.log2(c.batch_size),
        float(c.activation_checkpointing),
        float(not c.reshard_after_forward),
        float(c.grad_sync == "every"),
    )


class _Scale:
    """Features in octaves, centred on the space, so the linear trend pivots at its middle."""

    def __init__(self, points: Sequence[BatchConfig]) -> None:
        self.centre = np.mean([_features(p) for p in points], axis=0)

    def __call__(self, configs: Iterable[BatchConfig]) -> np.ndarray:
        return np.array([_features(c) for c in configs]) - self.centre


def _threats(
    gp: _Mixture, z: np.ndarray, offset: np.ndarray, best: int, tolerance: float
) -> list[int]:
    """The candidates that could plausibly beat the best measured one (at most a few hundred).

    Joint sampling costs the cube of the candidates; a configuration whose marginal
    posterior puts it far below the best measured one cannot change the score.
    """
    if len(z) <= _MAX_CANDIDATES:
        return list(range(len(z)))
    mean, sd = gp.marginals(z)
    mean = mean + offset
    margin = (mean - mean[best] - math.log(1 - tolerance)) / np.maximum(sd, 1e-9)
    order = [i for i in np.argsort(-margin) if i != best][: _MAX_CANDIDATES - 1]
    return sorted([best, *order])


class _Mixture:
    """Gaussian processes over log objective, averaged over their shape hyperparameters."""

    def __init__(self, x: np.ndarray, y: np.ndarray, noise_var: np.ndarray) -> None:
        self.x = x
        self.level = float(np.mean(y))
        self.y = y - self.level
        self.fits = []
        for _, k in _kernels(x, x):
            chol = _cholesky(k + np.diag(noise_var))
            alpha = _solve(chol, self.y)
            log_ml = -0.5 * self.y @ alpha - np.log(np.diag(chol)).sum()
            self.fits.append((log_ml, chol, alpha))
        log_w = np.array([f[0] for f in self.fits])
        w = np.exp(log_w - log_w.max())
        self.weights = w / w.sum()

    def mean(self, z: np.ndarray) -> np.ndarray:
        """The mixture's posterior mean at ``z``."""
        return sum(
            w * (self.level + kzx @ alpha)
            for w, (_, _, alpha), (_, kzx) in zip(
                self.weights, self.fits, _kernels(z, self.x), strict=True
            )
        )

    def marginals(self, z: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The mixture's mean and marginal sd at ``z`` (the variance includes the spread of
        the components' means)."""
        prior_trend = _trend(z, z)
        parts = []
        for w, (_, chol, alpha), (amplitude, kzx) in zip(
            self.weights, self.fits, _kernels(z, self.x), strict=True
        ):
            v = _lower_solve(chol, kzx.T)
            var = np.clip(amplitude**2 + prior_trend - (v**2).sum(axis=0), 0, None)
            parts.append((w, self.level + kzx @ alpha, var))
        mean = sum(w * m for w, m, _ in parts)
        return mean, np.sqrt(sum(w * (var + (m - mean) ** 2) for w, m, var in parts))

    def sample(self, z: np.ndarray, n: int, seed: int) -> np.ndarray:
        """``n`` joint draws of the latent log objective at ``z`` (rows: draws)."""
        rng = np.random.default_rng(seed)
        counts = rng.multinomial(n, self.weights)
        draws = []
        for count, (_, chol, alpha), (_, kzx), (_, kzz) in zip(
            counts, self.fits, _kernels(z, self.x), _kernels(z, z), strict=True
        ):
            if count:
                v = _lower_solve(chol, kzx.T)
                root = _cholesky(kzz - v.T @ v)
                mean = self.level + kzx @ alpha
                draws.append(mean + rng.standard_normal((count, len(z))) @ root.T)
        return np.vstack(draws)


def _kernels(a: np.ndarray, b: np.ndarray) -> Iterator[tuple[float, np.ndarray]]:
    """(amplitude, kernel matrix) for every shape of the grid, in one fixed order;
    the distances and the trend are computed once for all of them.

    The trend is linear in the octaves of m, n and B, plus a curvature in n and one in m.
    In n: throughput per device falls with the devices ever faster as communication takes
    over, so the global throughput can peak below the most devices. In m: a device's
    throughput saturates with its micro-batch (a fixed cost per micro-batch): in log
    units the square of the octaves of m has a coefficient of at most about 0.06 on
    such a curve (docs/confidence.md). Without this term the deviation had to carry the
    whole bend, its largest amplitude won, and every unmeasured configuration looked
    uncertain by 30%."""
    dist = np.sqrt(((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)) * math.sqrt(5)
    base = _trend(a[:, None, :], b[None, :, :])
    for length in _LENGTH_SCALES:
        d = dist / length
        matern = (1 + d + d**2 / 3) * np.exp(-d)
        for amplitude in _AMPLITUDES:
            yield amplitude, amplitude**2 * matern + base


def _trend(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The prior covariance of the trend (constant, slopes, curvature in n) between the
    points of ``a`` and ``b``, which broadcast against each other: a matrix from
    ``a[:, None]`` and ``b[None]``, its diagonal from ``a`` and ``a``."""
    return (
        _TREND_SD**2 * (a * b).sum(-1)
        + _CURVE_SD**2 * a[..., 1] ** 2 * b[..., 1] ** 2
        + _CURVE_M_SD**2 * a[..., 0] ** 2 * b[..., 0] ** 2
        + _LEVEL_SD**2
    )


def _cholesky(a: np.ndarray) -> np.ndarray:
    """Lower Cholesky factor, with just enough jitter for a matrix that is PSD in theory."""
    a = (a + a.T) / 2
    jitter = 1e-10 * max(1.0, float(np.mean(np.diag(a))))
    for _ in range(8):
        try:
            return np.linalg.cholesky(a + jitter * np.eye(len(a)))
        except np.linalg.LinAlgError:
            jitter *= 10
    raise np.linalg.LinAlgError("covariance is not positive semi-definite")


def _lower_solve(chol: np.ndarray, b: np.ndarray) -> np.ndarray:
    return solve_triangular(chol, b, lower=True, check_finite=False)


def _solve(chol: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``K^-1 y`` from K's lower Cholesky factor."""
    return solve_triangular(chol, _lower_solve(chol, y), lower=True, trans="T", check_finite=False)
