"""What one measurement is worth: the relative noise of a trial's step times, pooled over
the trials (:func:`relative_step_noise`), the variance it gives a trial's median
(:func:`step_variance`), and the drift between trials of one configuration that a trial
cannot see in its own steps, learnt from the repeats with ``noise_floor`` as its prior
(:func:`between_trial_drift`, the prior worth :data:`DRIFT_PRIOR_DOF` repeats) and read as
Student's t (:func:`drift_variance`). The search's model (mbtune.recommend.confidence) reads
them; pure numerics (numpy; no torch, no ray).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence

import numpy as np

from mbtune.lattice import BatchConfig
from mbtune.recommend.observation import Observation

__all__ = [
    "DEFAULT_NOISE",
    "DRIFT_PRIOR_DOF",
    "between_trial_drift",
    "drift_variance",
    "relative_step_noise",
    "step_variance",
]

DEFAULT_NOISE = 0.03
"""Relative step-time spread assumed while no trial has kept two step times."""

DRIFT_PRIOR_DOF = 4
"""How many repeats' worth of evidence ``noise_floor`` counts for as the drift's prior:
little, so that a run whose repeats disagree (a machine getting busier) or agree (a
quiet accelerator) soon speaks for itself."""


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


def step_variance(spread: float, o: Observation) -> float:
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
        noise.setdefault(o.config, []).append(step_variance(spread, o))
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


def drift_variance(drift: float, dof: int) -> float:
    """The variance of the drift a trial is read with: the estimate's, widened for how
    little it rests on. Behind ``drift`` are the prior (``DRIFT_PRIOR_DOF``) and ``dof``
    degrees of freedom of repeats; with nu their sum, the drift a trial draws is Student's
    t, whose variance is nu / (nu - 2) times the estimate's: twice it on the prior alone,
    1.25 times after six repeats. Read at the estimate instead, the score was over-confident
    just above the target on close calls (a search stops where its estimate happens to be
    low): bench/close_calls.py --landscape drawn-close, docs/confidence.md."""
    nu = DRIFT_PRIOR_DOF + dof
    return drift**2 * nu / (nu - 2)
