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
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy.linalg import solve_triangular
from threadpoolctl import threadpool_limits

from mbtune.lattice import BatchConfig
from mbtune.runs.record import TrialRecord

__all__ = [
    "Assessment",
    "Observation",
    "SearchModel",
    "assess",
    "between_trial_drift",
    "observation",
    "relative_step_noise",
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
) -> Assessment:
    """Recommend a measured configuration and score it, over the space ``points``.

    ``global_objective``: the objective grows with the devices (samples/s of all of them),
    so the model learns it per device and multiplies back; False when it is per device.
    """
    looks: dict[BatchConfig, list[Observation]] = {}
    for o in observations:  # every repeat of a configuration is an observation of it
        looks.setdefault(o.config, []).append(o)
    counts = {config: len(seen) for config, seen in looks.items()}
    feasible = _feasible(points, observations)
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
    within = draws[:, r] >= draws.max(axis=1) + margin
    probability = float(within.mean())
    winners = np.bincount(draws.argmax(axis=1), minlength=len(keep)) / len(draws)
    beating = draws + margin > draws[:, [r]]
    beats = beating.mean(axis=0)
    unmeasured_columns = [j for j, i in enumerate(keep) if i not in fitted]
    recommended = candidates[best_measured]
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
        unmeasured_threat=float(beating[:, unmeasured_columns].any(axis=1).mean()),
        drift=drift,
        drift_dof=drift_dof,
    )


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

    def assess(self, observations: Sequence[Observation]) -> Assessment:
        return _remembered(self, tuple(observations))


@functools.lru_cache(maxsize=4)
def _remembered(model: SearchModel, observations: tuple[Observation, ...]) -> Assessment:
    return assess(
        model.points,
        observations,
        noise_floor=model.noise_floor,
        global_objective=model.global_objective,
        seed=model.seed,
    )


def _feasible(points: Sequence[BatchConfig], observed: Iterable[Observation]) -> set[BatchConfig]:
    """The configurations that can still win: not failed (in every look), not above an
    out-of-memory size."""
    failed: set[BatchConfig] = set()
    ran: set[BatchConfig] = set()
    # with and without activation checkpointing, memory grows with m on its own scale
    oom_at: dict[bool, float] = {False: math.inf, True: math.inf}
    for o in observed:
        ac = o.config.activation_checkpointing
        if o.status == "oom":
            oom_at[ac] = min(oom_at[ac], o.config.micro_batch_size)
        elif o.status != "ok":
            failed.add(o.config)
        else:
            ran.add(o.config)
        for m in o.oom_micro_batch_sizes:
            oom_at[ac] = min(oom_at[ac], m)
    return {
        c
        for c in (p.canonical() for p in points)
        if (c in ran or c not in failed) and c.micro_batch_size < oom_at[c.activation_checkpointing]
    }


def _features(c: BatchConfig) -> tuple[float, float, float, float]:
    """Octaves of m, n and B, and activation checkpointing (0 or 1): a surface of its own,
    shifted by the trend and close to the other by the smooth deviation (one unit apart,
    as an octave is), so that what one setting measures tells of the other."""
    return (
        math.log2(c.micro_batch_size),
        math.log2(c.num_devices),
        math.log2(c.batch_size),
        float(c.activation_checkpointing),
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
