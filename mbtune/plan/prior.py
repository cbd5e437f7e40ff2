"""The link prior of the plan (``plan.intra_node``, ``plan.inter_node``) and how a fitted
link is weighed against it: drawn about its figures, combined with the fit where the
measurements agree with it, yielding where they contradict it (docs/plan.md, "Fitted to
the run"). Pure: numpy.
"""

from __future__ import annotations

import math

import numpy as np

from mbtune.comm import Link, step_traffic
from mbtune.lattice import BatchConfig

__all__ = ["PRIOR_HOLDS", "prior_link", "with_prior"]

_IQR_TO_SD = 1.349
"""The interquartile range of a normal distribution, in sds."""
PRIOR_HOLDS = 0.9
"""How likely a cluster's link is near the prior's figures (within its ``uncertainty``)
before the run says anything; otherwise it may be anything (:data:`_ANYTHING_SD`). A fitted
link far outside the prior's spread is then read as that other case, and the prior yields
to the measurements (:func:`with_prior`)."""
_ANYTHING_SD = 2.0
"""The sd of the log of a link that is not near the prior: 7x either way at one sd."""


def with_prior(
    fit: Link,
    counts: tuple[int, ...],
    latency_fitted: bool,
    prior: Link,
    figures: tuple[float, float, float],
    grad_bytes: int,
    sharding: str,
    rng: np.random.Generator,
) -> tuple[Link, float]:
    """The fitted intra-node link (``fit``: measured at ``counts`` devices; its latency the
    prior's unless ``latency_fitted``) with its prior, and the weight the prior kept.

    Whether the prior holds is read where the measurements are surest: the collectives of
    a step at the largest device count whose link they show, the fit's against the
    prior's, in logs (bandwidth and latency alone can be far less sure than their sum: a
    few device counts barely tell them apart). The prior is a mixture: with
    :data:`PRIOR_HOLDS` the link is near its figures (the draws' own spread), otherwise
    anything (:data:`_ANYTHING_SD`); each explains the fit's collectives by the chance of
    that gap. Where the prior holds, each figure is the fit's and the prior's combined by
    their precisions (:func:`_combine`); where it does not, the fit's draws stand as they
    are. Each draw takes one case by its weight; draw 0, the likelier."""
    n = max(counts)
    config = BatchConfig(n, n, 1)  # one micro-batch
    traffic = step_traffic(config, grad_bytes=grad_bytes, sharding=sharding)
    said = np.log(np.maximum(traffic.seconds(fit.bandwidth, fit.latency_s), 1e-15))
    expected = np.log(traffic.seconds(prior.bandwidth, prior.latency_s))
    fit_var, prior_var = _robust_var(said), _robust_var(expected)
    gap = float(said[0] - expected[0])
    if figures[2] == 0:
        return prior, 1.0  # a prior held exactly (uncertainty 0)
    evidence = [
        share * math.exp(-0.5 * gap**2 / total) / math.sqrt(total)
        for share, total in ((PRIOR_HOLDS, max(fit_var + prior_var, 1e-12)),
                             (1 - PRIOR_HOLDS, fit_var + _ANYTHING_SD**2))
    ]  # fmt: skip
    held = evidence[0] / sum(evidence)
    bandwidth = _combine(fit.bandwidth, figures[0], figures[2], rng)
    latency = prior.latency_s
    if latency_fitted:
        latency = _combine(fit.latency_s, figures[1], figures[2], rng)
    near = rng.random(bandwidth.size) < held
    near[0] = held >= 0.5
    return Link(np.where(near, bandwidth, fit.bandwidth),
                np.where(near, latency, fit.latency_s)), held  # fmt: skip


def _robust_var(logs: np.ndarray) -> float:
    """The variance of draws by their interquartile range (draw 0, the point, left out)."""
    if logs.size < 3:
        return 0.0
    q1, q3 = np.percentile(logs[1:], [25, 75])
    return float(((q3 - q1) / _IQR_TO_SD) ** 2)


def _combine(fit: np.ndarray, prior: float, spread: float, rng: np.random.Generator) -> np.ndarray:
    """A fitted link figure combined with its prior, in logs, each weighted by its
    precision: the fit's spread is its draws' (a robust sd: the draws of a figure the
    measurements barely show, a latency where the bytes dominate, scatter widely), the
    prior's its ``uncertainty``. Draw 0 is the combination's centre; the others are drawn
    about it with the combination's sd (a normal approximation in logs)."""
    logs = np.log(np.maximum(fit, prior * 1e-6))
    centre = float(np.median(logs[1:])) if logs.size > 1 else float(logs[0])
    fit_var = _robust_var(logs)
    centre = float(logs[0]) if logs.size == 1 else centre
    if fit_var == 0:
        weights = (1.0, 0.0)
    else:
        precision = 1 / fit_var + 1 / spread**2
        weights = (1 / fit_var / precision, 1 / spread**2 / precision)
    mean = weights[0] * float(logs[0]) + weights[1] * math.log(prior)
    sd = 0.0 if fit_var == 0 else math.sqrt(1 / precision)
    z = rng.standard_normal(logs.size)
    z[0] = 0.0
    return np.exp(mean + sd * z)


def prior_link(prior: tuple[float, float, float], rng: np.random.Generator, draws: int) -> Link:
    """The prior link's draws: lognormal about the given figures (draw 0 at them)."""
    bandwidth, latency_s, spread = prior
    z = rng.standard_normal((2, draws + 1)) * spread
    z[:, 0] = 0.0
    return Link(bandwidth * np.exp(z[0]), latency_s * np.exp(z[1]))
