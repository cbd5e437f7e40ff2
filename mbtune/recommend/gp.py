"""The model of what was not measured: a Gaussian process over the log of the objective.

Pure numerics (numpy and scipy), for mbtune.recommend.confidence, whose score draws from
it. Over (log2 m, log2 n, log2 B, each setting of a step as 0 or 1: activation
checkpointing, and sharded, reshard_after_forward and grad_sync; and the layout: log2 t,
log2 p and the pipeline's schedule as a category) the log objective per device is a
constant, a linear trend (throughput scales with devices and grows with m), a curvature in
n (communication can make fewer devices faster), a curvature in m (throughput saturates
with the micro-batch), an interaction of the two (a cost per step weighs more on a faster
step), the pipeline's bubble (Megatron's: a step takes 1 + (p - 1) / (v g) of its ideal
time, known before measuring), where the trials shard the model the step's collectives
(FSDP2's, counted by mbtune.comm, with a learnt coefficient) and a smooth Matern-5/2
deviation from them.
Its two shape hyperparameters (length scale, amplitude) are not fixed but averaged over a
grid, each weighted by how well it explains the measurements (Bayesian model averaging):
with few measurements many shapes remain possible, and the score stays low.
``docs/confidence.md`` has the reasoning and the calibration figures.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
from scipy.linalg import solve_triangular

from mbtune.comm import step_traffic
from mbtune.lattice import PIPELINE_SCHEDULES, BatchConfig

__all__ = ["Mixture", "Scale", "comm_per_sample", "features", "plausible"]

_LENGTH_SCALES = (0.75, 1.5, 3.0)  # in octaves of m, n and B
_AMPLITUDES = (0.05, 0.12, 0.3)  # sd of the deviation from the trend, in log units
_TREND_SD = 0.6  # prior sd of the trend's slope per octave (of throughput per device)
_CURVE_SD = 0.2  # prior sd of the trend's curvature in n, per octave squared (see _kernels)
_CURVE_M_SD = 0.05  # the same in m: as much as a saturating curve bends (see _kernels)
_CROSS_SD = 0.05  # the same for the interaction of m and n, per octave of each (see _kernels)
_LEVEL_SD = 1.0  # prior sd of the constant, in log units around the mean measurement
_BUBBLE_SD = 0.3  # prior sd of the bubble's coefficient around Megatron's -1 (see features)
_COMM_SD = 1.0  # prior sd of the collectives' cost where the space sends most (see Scale)
_COMM_OCTAVE_SD = _TREND_SD  # prior sd of their slope per octave, as any other (see Scale)
_MAX_CANDIDATES = 600  # joint sampling is cubic in this; the rest are pruned (see plausible)


def features(c: BatchConfig, *, sharded: bool = False) -> tuple[float, ...]:
    """Octaves of m, n and B; each setting of a step as 0 or 1 (activation checkpointing
    on; sharded, reshard_after_forward off, grad_sync every); the layout: octaves of t and
    p, and the pipeline's schedule as a category (one column per schedule, two schedules
    one unit apart); and last two terms of the trend that are not coordinates of the
    surface (:data:`_SHAPE`): the bubble's log share of a step, log(1 + (p - 1) / (v g))
    (``BatchConfig.bubble``), and, where the trials shard the model (``sharded``), the
    step's collectives per sample (:func:`comm_per_sample`; 0 otherwise; :class:`Scale`
    makes it two columns). Each setting and each value of the layout is a surface of its
    own, shifted by the trend and close to the others by the smooth deviation (one unit
    apart, as an octave is), so that what one measures tells of the other. A setting
    the space does not vary is one value everywhere: centred away (:class:`Scale`).

    Why the layout so. Megatron's relations: t and p divide a replica's compute (the
    per-device objective learns what they cost beyond: all-reduces inside a node, sends,
    smaller matrices), and the pipeline idles (p - 1) / (v g) of its ideal time with g
    micro-batches and v stages a rank (a third of that for the zero-bubble schedules): a
    larger m means fewer micro-batches and a larger bubble. That relation is known, so the
    trend holds it at its value (a coefficient of -1 on log(1 + bubble), prior sd
    ``_BUBBLE_SD``) rather than learning it from the measurements; what a schedule costs
    beyond its bubble (interleaved's extra sends) is its category's level. Schedules that
    differ in nothing but their memory (gpipe and 1f1b) are still two categories: a real
    machine may run them at different speeds."""
    schedule = c.pipeline_schedule if c.pipeline_parallel > 1 else "none"
    return (
        math.log2(c.micro_batch_size),
        math.log2(c.num_devices),
        math.log2(c.batch_size),
        float(c.activation_checkpointing),
        float(not c.reshard_after_forward),
        float(c.grad_sync == "every"),
        math.log2(c.tensor_parallel),
        math.log2(c.pipeline_parallel),
        *(_CATEGORY * (schedule == s) for s in PIPELINE_SCHEDULES),
        math.log1p(c.bubble),
        comm_per_sample(c) if sharded else 0.0,
    )


def comm_per_sample(c: BatchConfig) -> float:
    """The bytes one device sends in a sharded step's collectives per sample of its batch,
    in units of the whole model's gradient bytes (mbtune.comm.step_traffic, ``sharding:
    fsdp``, over the d = n / (t p) replicas, each device's share 1 / (t p) of the model):
    FSDP2's all-gathers in every micro-batch's forward pass and, with
    ``reshard_after_forward``, its backward, and its reduce-scatters once a step or
    (``grad_sync: every``) once a micro-batch.

    Why it is a term of the trend, in two columns (:class:`Scale`). Where the collectives
    wait on nothing, a step takes P x (compute per sample) + volume x (seconds per byte),
    so the per-device objective falls by log(1 + k x) in log units, x this column and k
    the link's time for the model's gradient over one sample's compute: about -k x while
    k x is small, a coefficient on x. Where FSDP2 hides them behind the compute (it
    prefetches the next unit's gathers), they cost nothing until they outlast it, and
    then the step is the collectives: the objective falls as 1 / x, a slope of -1 on log x.
    k, and how much the machine hides, are the model's and the machine's: the trend
    learns both coefficients, on x in units of the most the space sends and on its
    octaves (bench/fsdp_search.py measures each alone and both).

    Why only where the trials shard. Unsharded, the collectives are data parallelism's
    all-reduce, once a step: per sample a function of n and B (and the layout's t and p),
    which their slopes and the curvature in n already carry; the column added nothing the
    measurements did not cover, and its prior variance made unmeasured configurations less
    certain (docs/confidence.md, "The communication term": more ties, a stop off on the
    model-parallel family). Sharded, the gathers and scatters come once a micro-batch, so
    their count depends on m and on FSDP's settings together, which no column carries."""
    share = c.tensor_parallel * c.pipeline_parallel
    return step_traffic(c, grad_bytes=1.0 / share, sharding="fsdp").volume / c.per_device_batch


_CATEGORY = math.sqrt(0.5)
"""A category's column value: two categories differ in two columns, one unit apart."""
_SHAPE = slice(0, -3)
"""The columns of :class:`Scale` that are coordinates of the surface (the deviation's
distances); the last three, the bubble and the collectives' two, enter the trend only."""
_BUBBLE, _COMM, _COMM_OCTAVES = -3, -2, -1


class Scale:
    """Features in octaves, centred on the space, so the linear trend pivots at its middle.
    The collectives per sample (:func:`comm_per_sample`, ``sharded``), :func:`features`'
    last column, become two: in units of the most the space's configurations send (the
    coefficient is the log of what they cost there, whatever the model's size and the
    link's speed: prior sd ``_COMM_SD``), and in octaves, no fewer than the least the
    space sends (one device sends nothing: prior sd ``_COMM_OCTAVE_SD``)."""

    def __init__(self, points: Sequence[BatchConfig], *, sharded: bool = False) -> None:
        self.sharded = sharded
        f = np.array([features(p, sharded=sharded) for p in points])
        sent = f[:, -1][f[:, -1] > 0]
        self.least, self.most = (float(sent.min()), float(sent.max())) if len(sent) else (0, 1)
        self.centre = self._columns(f).mean(axis=0)

    def __call__(self, configs: Iterable[BatchConfig]) -> np.ndarray:
        f = np.array([features(c, sharded=self.sharded) for c in configs])
        return self._columns(f) - self.centre

    def _columns(self, f: np.ndarray) -> np.ndarray:
        x = f[:, -1:]
        octaves = np.log2(np.maximum(x, self.least)) if self.least else np.zeros_like(x)
        return np.hstack([f[:, :-1], x / self.most, octaves])


def plausible(
    gp: Mixture, z: np.ndarray, offset: np.ndarray, best: int, tolerance: float
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


class Mixture:
    """Gaussian processes over log objective, averaged over their shape hyperparameters."""

    def __init__(self, x: np.ndarray, y: np.ndarray, noise_var: np.ndarray) -> None:
        self.x = x
        y = y - _prior_mean(x)
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
        return _prior_mean(z) + sum(
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
        spread = np.sqrt(sum(w * (var + (m - mean) ** 2) for w, m, var in parts))
        return _prior_mean(z) + mean, spread

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
                mean = _prior_mean(z) + self.level + kzx @ alpha
                draws.append(mean + rng.standard_normal((count, len(z))) @ root.T)
        return np.vstack(draws)


def _prior_mean(x: np.ndarray) -> np.ndarray:
    """The trend's known part: Megatron's bubble, a step 1 + bubble times its ideal time
    (:func:`features`' bubble column; centred, which the constant absorbs)."""
    return -x[:, _BUBBLE]


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
    uncertain by 30%. And an interaction of m and n: a cost per step that does not shrink
    with m (an all-reduce, a slow link past some device count) takes a larger share of a
    faster step, so the slope in m differs from one device count to another; without it
    the model carried 4 devices' curve over to 2 devices measured at a small m only, and
    stopped at 90 on 4 devices where 2 devices at a large m were 8-10% faster
    (bench/close_calls.py --landscape fewer-devices: 7 such stops in 110, 1 with it)."""
    dist = np.sqrt(((a[:, None, _SHAPE] - b[None, :, _SHAPE]) ** 2).sum(-1)) * math.sqrt(5)
    base = _trend(a[:, None, :], b[None, :, :])
    for length in _LENGTH_SCALES:
        d = dist / length
        matern = (1 + d + d**2 / 3) * np.exp(-d)
        for amplitude in _AMPLITUDES:
            yield amplitude, amplitude**2 * matern + base


def _trend(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The prior covariance of the trend (constant, slopes, curvatures in n and m, the
    interaction of m and n, the bubble's coefficient about its known value, the
    collectives' coefficient) between the
    points of ``a`` and ``b``, which broadcast against each other: a matrix from
    ``a[:, None]`` and ``b[None]``, its diagonal from ``a`` and ``a``."""
    return (
        _TREND_SD**2 * (a[..., _SHAPE] * b[..., _SHAPE]).sum(-1)
        + _BUBBLE_SD**2 * a[..., _BUBBLE] * b[..., _BUBBLE]
        + _COMM_SD**2 * a[..., _COMM] * b[..., _COMM]
        + _COMM_OCTAVE_SD**2 * a[..., _COMM_OCTAVES] * b[..., _COMM_OCTAVES]
        + _CURVE_SD**2 * a[..., 1] ** 2 * b[..., 1] ** 2
        + _CURVE_M_SD**2 * a[..., 0] ** 2 * b[..., 0] ** 2
        + _CROSS_SD**2 * (a[..., 0] * a[..., 1]) * (b[..., 0] * b[..., 1])
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
