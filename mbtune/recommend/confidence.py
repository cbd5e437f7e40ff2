"""The confidence score: how likely is the recommendation within 2% of the best?

Pure numerics (numpy and scipy; neither torch nor ray). The method, in the order the
code runs it (``docs/confidence.md`` has the reasoning and the calibration figures):

1. **Feasible region.** Every distinct configuration of the space is a candidate, except
   those that cannot win: a configuration that failed (``error``, ``timeout``) and every
   configuration whose micro-batch is at least as large as one that ran out of memory
   with the same variant, the layout (t, p, schedule) and the settings of a step (memory
   grows with the micro-batch a device runs, whatever n and B are; in a pipeline with the
   replica's batch P too): :func:`feasible_points`.
2. **Measurement noise.** Each trial keeps every step time. The relative spread of step
   times is pooled over all trials (one trial's few steps say little on their own) and
   turned into the variance of the log of each trial's median, plus the run-to-run drift
   one trial cannot see: estimated from the configurations measured more than once (how
   far their repeats disagree beyond their step noise), with ``noise_floor`` as the
   prior (worth ``DRIFT_PRIOR_DOF`` repeats), and widened for how few repeats it rests on
   (:func:`drift_variance`): mbtune.recommend.noise. Every repeat is an observation of
   its own (mbtune.recommend.observation).
3. **A model of the rest** (:mod:`mbtune.recommend.gp`). The log of the objective over
   (m, n, B, the settings of a step and the layout: t, p in octaves, the schedule as a
   category, the pipeline's bubble in the trend) is a Gaussian process with a trend and a
   smooth deviation, averaged over its shape hyperparameters.
4. **The score.** Joint samples of the true objective of every feasible configuration,
   measured or not, are drawn from the posterior. The recommendation is the measured
   configuration with the highest posterior mean; the score is the fraction of samples
   in which it is within ``tolerance`` of the sample's best, in percent, capped at 99;
   read a second time with the measured rivals' samples shuffled apart from the
   recommendation's (:func:`shuffled`: no correlation lent by the smooth prior between two
   measured configurations), the score is the smaller of the two readings.
   Each other configuration's *threat* is the fraction in which it beats the
   recommendation by more than ``tolerance``, and the unmeasured configurations' threat
   the fraction in which any of them does: what the search weighs when it chooses
   between a new configuration and another look at a measured one (mbtune.search).
5. **What was never measured.** A value of a searched dimension that no trial measured
   (a device count, an activation checkpointing setting) is not something the model can
   speak for: the search measures it before it stops (mbtune.search._stopping), and
   until then it keeps a chance of ``OPEN_CHANCE`` of holding the best in what a new
   measurement could settle (``unmeasured_threat``). Device counts included, however many
   others were measured: a communication cost fitted on them cannot see a link tier
   between two of them (1, 4 and 8 devices measured, 2 the fastest: bench/close_calls.py,
   docs/confidence.md). The score itself is the model's: discounted by
   ``1 - OPEN_CHANCE`` per such value, it was under-confident by 19-27 points from 60 to
   79 (the good configuration is measured early, several device counts still open).
6. **A tie** (:meth:`SearchModel.assess`). Below the target, the fewest measured
   configurations that hold the best (within the tolerance) with a probability of at
   least the target are the contenders. Where there are several, their estimates lie
   within two measured spreads (drift and step noise) of each other, and each was
   measured enough (``TIE_LOOKS``), they cannot be told apart at this machine's spread:
   the search stops on a tie, recommends one of them by a rule (:func:`tie_order`) and
   says what it was sure of: mbtune.recommend.tie.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from threadpoolctl import threadpool_limits

from mbtune.config.search import SearchConfig
from mbtune.lattice import BatchConfig
from mbtune.recommend.gp import Mixture, Scale, plausible
from mbtune.recommend.noise import (
    between_trial_drift,
    drift_variance,
    relative_step_noise,
    step_variance,
)
from mbtune.recommend.observation import Observation
from mbtune.recommend.tie import Tie, called_tie, find_contenders, resolvable
from mbtune.runs.record import CONFIG_KEY

__all__ = [
    "MAX_SCORE",
    "OPEN_CHANCE",
    "TOLERANCE",
    "Assessment",
    "SearchModel",
    "assess",
    "feasible_points",
]

TOLERANCE = 0.02
"""Within 2% of the best counts as right."""

MAX_SCORE = 99
"""The score is a probability in percent and never claims certainty."""

OPEN_CHANCE = 0.15
"""The chance a value of a searched dimension that was never measured (and that the
measured data do not bound) keeps of holding the best, beyond what the model says: what a
new measurement could settle (``Assessment.unmeasured_threat``), weighed against another
look at a measured rival. The stop waits for every such value to be measured
(mbtune.search._stopping); the score is not discounted for it."""


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
    """One trial's relative spread at the estimated drift, with the step noise of a
    trial's median (their variances pooled over the trials): what a tie and whether more
    looks can settle one are read against (the score reads the drift wider:
    :func:`drift_variance`)."""
    estimate: dict[BatchConfig, float] = field(default_factory=dict, repr=False)
    """Each measured feasible configuration's objective as the model estimates it (the
    posterior mean): what the recommendation and the table of the best rank by."""
    unmeasured_values: dict[str, tuple] = field(default_factory=dict)
    """Values of searched dimensions never measured that the data do not bound (each
    keeps ``OPEN_CHANCE`` in ``unmeasured_threat``), by dimension."""
    open_points: frozenset[BatchConfig] = field(default_factory=frozenset, repr=False)
    """The unmeasured configurations with such a value: what the search measures next,
    and, one of each value, before it stops."""
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
    resolvable: bool = True
    """Whether this machine's spread lets more looks tell two configurations apart by
    the tolerance (``TIE_RESOLVES``); where not, two looks each (``TIE_LOOKS``) are all a
    close contender gets."""
    own_threat: dict[BatchConfig, float] = field(default_factory=dict, repr=False)
    """For each measured feasible configuration, the probability that it beats the
    recommendation by more than the tolerance read on the two's own looks alone
    (:func:`own_looks_threat`: no trend, no neighbours): what the check before a stop
    reads a rival at another device count by (mbtune.search._stopping)."""
    own_estimate: dict[BatchConfig, float] = field(default_factory=dict, repr=False)
    """Each measured feasible configuration's objective on its own looks alone (their
    geometric mean), beside the model's ``estimate``, which its neighbours move too."""


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
    memory bounds and whether the model counts the step's collectives (mbtune.recommend.gp).
    """
    looks: dict[BatchConfig, list[Observation]] = {}
    for o in observations:  # every repeat of a configuration is an observation of it
        looks.setdefault(o.config, []).append(o)
    counts = {config: len(seen) for config, seen in looks.items()}
    feasible = feasible_points(points, observations, sharded=sharded)
    ok = [o for o in observations if o.status == "ok" and o.value and o.config in feasible]
    if not ok:
        return Assessment(None, None, 0, 0.0, len(feasible), len(feasible), looks=counts)
    spread, _ = relative_step_noise(ok)
    drift, drift_dof = between_trial_drift(ok, spread, prior=noise_floor)
    step_var = np.array([step_variance(spread, o) for o in ok])
    noise_var = step_var + drift_variance(drift, drift_dof)
    scale = Scale(points, sharded=sharded)
    candidates = sorted(feasible)
    z = scale(candidates)

    def per_device(configs: Iterable[BatchConfig]) -> np.ndarray:
        return np.log([c.num_devices if global_objective else 1 for c in configs])

    y = np.log([o.value for o in ok]) - per_device(o.config for o in ok)
    gp = Mixture(scale(o.config for o in ok), y, noise_var)
    offset = per_device(candidates)
    index = {c: i for i, c in enumerate(candidates)}
    measured = sorted({index[o.config] for o in ok})
    fitted = dict(zip(measured, gp.mean(z[measured]) + offset[measured], strict=True))
    best_measured = max(measured, key=fitted.__getitem__)
    keep = plausible(gp, z, offset, best_measured, tolerance)
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
    # the measured rivals read apart from the leader too: without the correlation the
    # smooth prior lends two measured neighbours
    rivals = [j for j, i in enumerate(keep) if i in fitted and i != best_measured]
    apart = within_draws(shuffled(draws, rivals, seed), margin)[:, r]
    probability = min(probability, float(apart.mean()))
    never = sum(map(len, unbounded.values()))
    unmeasured_threat = max(unmeasured_threat, 1 - (1 - OPEN_CHANCE) ** never)
    open_points = frozenset(
        c for c in candidates
        if c not in estimate and any(getattr(c, d) in v for d, v in unbounded.items())
    )  # fmt: skip
    recommended = candidates[best_measured]
    columns = {candidates[i]: j for j, i in enumerate(keep) if i in fitted}
    contenders = None  # a target above what a score can reach (100): the search never stops
    if probability * 100 < target <= MAX_SCORE:
        contenders = find_contenders(each, columns, estimate, target=target,
                                     tolerance=TOLERANCE)  # fmt: skip
    values = [o.value for o in ok if o.config == recommended]
    looks = own_looks(ok, noise_var)
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
        trial_sd=math.sqrt(float(step_var.mean()) + drift**2),
        estimate=estimate,
        unmeasured_values=unbounded,
        open_points=open_points,
        within={c: float(each[:, j].mean()) for c, j in columns.items()},
        contenders=contenders,
        own_threat=own_looks_threat(looks, recommended, tolerance),
        own_estimate={c: math.exp(mean) for c, (mean, _) in looks.items()},  # geometric mean
    )


Looks = tuple[float, float]
"""A configuration's own looks: the mean of their logs and its variance (:func:`own_looks`)."""


def own_looks(ok: Sequence[Observation], noise_var: np.ndarray) -> dict[BatchConfig, Looks]:
    """Each configuration of ``ok`` read on its own looks alone: the mean of their logs,
    and its variance, their noise (``noise_var``, each look's) over the looks squared."""
    logs: dict[BatchConfig, list[tuple[float, float]]] = {}
    for o, var in zip(ok, noise_var, strict=True):
        logs.setdefault(o.config, []).append((math.log(o.value), float(var)))
    out = {}
    for c, each in logs.items():
        values, variances = zip(*each, strict=True)
        out[c] = statistics.fmean(values), sum(variances) / len(values) ** 2
    return out


def own_looks_threat(
    looks: dict[BatchConfig, Looks], leader: BatchConfig, tolerance: float
) -> dict[BatchConfig, float]:
    """For each configuration of ``looks`` (:func:`own_looks`), the probability that it
    beats ``leader`` by more than ``tolerance`` on the two's own looks alone, the two
    independent. Where two configurations at different device counts look level, the
    model can still put them apart by its trend over the device counts, which a link tier
    breaks (bench/close_calls.py --landscape fewer-devices, seed 68: 4 and 2 devices at
    m = 16 each seen at 0.96 and 0.99 of the best, put 3% apart; 2 devices 8% faster):
    this reading is what their looks alone can tell (docs/confidence.md)."""
    lead, lead_var = looks[leader]
    ahead = -math.log(1 - tolerance)  # beats the leader by more than the tolerance
    out = {}
    for c, (mean, var) in looks.items():
        if c == leader or var + lead_var <= 0:  # looks without noise say it outright
            out[c] = float(c != leader and mean - lead > ahead)
            continue
        out[c] = 0.5 * math.erfc((ahead - (mean - lead)) / math.sqrt(2 * (var + lead_var)))
    return out


def shuffled(draws: np.ndarray, columns: Sequence[int], seed: int) -> np.ndarray:
    """``draws`` with each of ``columns`` shuffled over the draws (rows) on its own: each
    keeps its marginal posterior and loses its correlation with every other column. The
    measured rivals so shuffled are read apart from the leader: the joint draws correlate
    neighbouring configurations through the smooth prior, which narrows the difference
    between two measured ones beyond what their looks show; where the landscape has a
    step between neighbours (the best 4% and 6% ahead of the two beside it) a rival
    measured twice kept 3.4% of beating the leader in the joint draws where the two
    posteriors apart give 8.7% (bench/close_calls.py --landscape rivals;
    docs/confidence.md)."""
    rng = np.random.default_rng(seed)
    out = draws.copy()
    for j in columns:
        out[:, j] = rng.permutation(out[:, j])
    return out


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
    max_repeats: int = SearchConfig.max_repeats
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

    def _resolvable(self, a: Assessment) -> bool:
        """Could the looks the search may take tell two apart by the tolerance?"""
        return resolvable(a.trial_sd, self.max_repeats, tolerance=TOLERANCE)

    def _tie(self, a: Assessment) -> Tie | None:
        """The contenders, where another look cannot tell them apart at this machine's
        spread (module docstring, 6)."""
        return called_tie(
            a.contenders, estimate=a.estimate, looks=a.looks, trial_sd=a.trial_sd,
            resolvable=a.resolvable, max_repeats=self.max_repeats, tolerance=TOLERANCE,
        )  # fmt: skip


@functools.lru_cache(maxsize=4)
def _remembered(model: SearchModel, observations: tuple[Observation, ...]) -> Assessment:
    a = model._score(observations)
    a = dataclasses.replace(a, resolvable=model._resolvable(a))
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


def feasible_points(
    points: Sequence[BatchConfig], observed: Iterable[Observation], *, sharded: bool = False
) -> set[BatchConfig]:
    """The configurations that can still win: not failed (in every look), not above an
    out-of-memory size: one that ran out of memory at micro-batch m on n devices bounds
    every configuration of the same variant (the layout, t, p and the schedule, and the
    settings of a step, activation checkpointing and FSDP's: memory grows with m on each
    one's own scale) at m or more, on any number of devices (each holds its whole stage),
    or ``sharded``, on n or fewer (each holds a share of it, larger on fewer; and one
    micro-batch a device is on ``grad_sync: every``'s scale: BatchConfig.memory_variant). A pipeline
    holds up to all of a replica's P samples' activations in flight (gpipe: every
    micro-batch), so there it bounds only a per-replica batch P as large or larger."""
    failed: set[BatchConfig] = set()
    ran: set[BatchConfig] = set()
    oom_at: dict[tuple, list[tuple[int, int, int]]] = {}  # variant -> (n, P, m) out of memory
    for o in observed:
        c = o.config
        sizes = [c.micro_batch_size] * (o.status == "oom") + list(o.oom_micro_batch_sizes)
        oom_at.setdefault(c.memory_variant(sharded), []).extend(
            (c.num_devices, c.per_device_batch, m) for m in sizes
        )
        if o.status not in ("ok", "oom"):
            failed.add(c)
        elif o.status == "ok":
            ran.add(c)

    def fits(c: BatchConfig) -> bool:
        piped = c.pipeline_parallel > 1
        return not any(
            c.micro_batch_size >= m
            and (c.num_devices <= n or not sharded)
            and (c.per_device_batch >= p or not piped)
            for n, p, m in oom_at.get(c.memory_variant(sharded), ())
        )

    return {c for c in (p.canonical() for p in points) if (c in ran or c not in failed) and fits(c)}
