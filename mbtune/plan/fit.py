"""The step time of a configuration on a cluster the run did not measure, fitted to the
run's trials, with its uncertainty as draws.

A data-parallel step is the compute of the busiest device's micro-batches and then the
collectives of its gradients::

    t_step(B, n, m) = g x c(m) + t_sync(n)

``c(m)`` (seconds per micro-batch of m samples, for each activation checkpointing setting)
is the device's own: it does not depend on n, so the trials measure it at any n. ``t_sync``
is the ring's: an all-reduce moves 2 (n - 1) / n of the gradient's bytes over each link
with 2 (n - 1) hops of latency, an all-gather or a reduce-scatter half of that; beyond
one node the ring runs at the slower of the intra-node bandwidth and a node's k devices'
own links together (k x the inter-node bandwidth), with the inter-node latency per hop.
Where the run measured its collectives at two or more device counts within a node (a
``ddp`` run's timing, or a replay's step times) the intra-node link is fitted to them and
combined with the plan's prior; otherwise it is the prior alone. The link
between nodes is always the prior: no run of mbtune crosses one.

The uncertainty is a parametric bootstrap: each draw perturbs every measured step time by
its own noise (its step times' spread and the run's drift between trials), refits ``c`` and
the link, and draws the prior links from their ``uncertainty``; draw 0 is the fit to the
measurements as they are, with the prior at its median. Pure: numpy and scipy only.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.runs.record import TrialRecord

__all__ = [
    "DRAWS",
    "Link",
    "Measurement",
    "StepModel",
    "fit_step_model",
    "gather_s",
    "measurements",
    "sync_s",
]

DRAWS = 1000
"""Bootstrap draws: the 5th and 95th percentiles of 1000 draws move by 1.5 to 3% of the
interval's width (an sd) from one seed to another (three generated landscapes at 256
devices, bench/plan_coverage.py's, ten seeds each)."""
_IQR_TO_SD = 1.349
"""The interquartile range of a normal distribution, in sds."""


@dataclass(frozen=True)
class Link:
    """One tier's link: bytes/s and seconds per hop, each an array over the draws."""

    bandwidth: np.ndarray
    latency_s: np.ndarray


def gather_s(nbytes: float, n: int, per_node: int, intra: Link, inter: Link) -> np.ndarray:
    """One ring all-gather (or reduce-scatter) of ``nbytes`` over n devices, two tiers.

    Within a node: n - 1 steps, each moving nbytes / n over the intra-node link. Across N
    nodes of k devices, the ring's steps stream through both tiers at once (NCCL pipelines
    them), so the slower one sets the pace: a node's k devices leave it each on its own
    link, k x the inter-node bandwidth, which is what nccl-tests' bus bandwidth across
    nodes shows; and every step waits on a node crossing's latency.
    """
    if n <= per_node:
        return (n - 1) / n * nbytes / intra.bandwidth + (n - 1) * intra.latency_s
    bus = np.minimum(intra.bandwidth, per_node * inter.bandwidth)
    return (n - 1) / n * nbytes / bus + (n - 1) * inter.latency_s


def sync_s(
    grad_bytes: float, n: int, g: int, sharding: str, per_node: int, intra: Link, inter: Link
) -> np.ndarray:
    """One step's collectives: an all-reduce of the gradients (a reduce-scatter then an
    all-gather); with ``sharding: fsdp``, FSDP2's all-gather of the parameters in the
    forward and the backward pass of each of the g micro-batches and one reduce-scatter
    of the gradients."""
    if n <= 1:
        return np.zeros_like(intra.bandwidth)
    once = gather_s(grad_bytes, n, per_node, intra, inter)
    return (2 * g + 1) * once if sharding == "fsdp" else 2 * once


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What one measured trial says about the step model."""

    config: BatchConfig
    step_s: float
    """The step's median time (B / samples_per_s)."""
    sync_s: float | None
    """The step's collectives where the trial says them apart (trials.csv's comm_time_ms:
    modelled with ``simulate``, timed with ``ddp``; 0 on one device); None where they are
    folded into the step time (a replayed table's throughput), for the fit to find."""
    rel_sd: float
    """The relative sd of ``step_s``: the median's own (its step times' IQR) and the drift
    between trials, together."""
    sharding: str
    parallel: str


def measurements(records: Sequence[TrialRecord], drift: float) -> list[Measurement]:
    """The measured trials (status ok, with a throughput) as the fit reads them.

    ``drift`` is the relative sd between trials of one configuration that a trial's own
    step times cannot show (the experiment's noise floor); the run's repeats refine it,
    the prior counting as two of them (as the search's model does).
    """
    ok = [r for r in records if r.status == "ok" and r.samples_per_s and r.samples_per_s > 0]
    staged = [r for r in ok if (r.pipeline_stages or 1) > 1]
    if staged:
        raise MbtuneError(
            f"plan: the run was pipelined (pipeline_stages {staged[0].pipeline_stages}); the "
            "plan models data parallelism alone: plan a run measured with pipeline_stages: 1"
        )
    drift = _pooled_drift(ok, drift)
    out = []
    for r in ok:
        config = BatchConfig(r.batch_size, r.num_devices, r.micro_batch_size,
                             r.activation_checkpointing)  # fmt: skip
        step_s = r.batch_size / r.samples_per_s
        comm: float | None = None
        if r.num_devices == 1:
            comm = 0.0
        elif r.comm_time_ms is not None and r.backend != "replay":  # a replay's is folded in
            comm = r.comm_time_ms / 1e3
            if r.sharding == "fsdp" and r.parallel == "ddp":  # timed: one all-gather and
                comm *= (2 * (r.grad_accum_steps or 1) + 1) / 2  # one reduce-scatter; a step
                # has 2g + 1 (sync_s); simulate's is the step's own, modelled
        own = 0.0
        if r.step_time_ms_iqr and r.step_time_ms_median and len(r.step_times_ms) > 1:
            own = r.step_time_ms_iqr / _IQR_TO_SD / r.step_time_ms_median
            own /= math.sqrt(len(r.step_times_ms))  # the median's: about 1.25 x the mean's
            own *= 1.25
        out.append(
            Measurement(
                config=config,
                step_s=step_s,
                sync_s=comm,
                rel_sd=math.hypot(own, drift),
                sharding=r.sharding or "none",
                parallel=r.parallel or "simulate",
            )
        )
    return out


def _pooled_drift(records: Sequence[TrialRecord], prior: float) -> float:
    """The drift between repeats of one configuration: the prior as two observations,
    pooled with the run's repeats (log throughput, sd about each configuration's mean)."""
    groups: dict[tuple, list[float]] = defaultdict(list)
    for r in records:
        key = (r.batch_size, r.num_devices, r.micro_batch_size, r.activation_checkpointing)
        groups[key].append(math.log(r.samples_per_s))  # type: ignore[arg-type]
    squares, dof = 2 * prior**2, 2.0
    for values in groups.values():
        if len(values) > 1:
            mean = sum(values) / len(values)
            squares += sum((v - mean) ** 2 for v in values)
            dof += len(values) - 1
    return math.sqrt(squares / dof)


@dataclass(frozen=True, kw_only=True)
class StepModel:
    """The fitted step time, as draws (index 0: the point estimate)."""

    compute: dict[bool, tuple[np.ndarray, np.ndarray]]
    """For each activation checkpointing setting: the measured micro-batch sizes and the
    seconds per micro-batch at each, an array (sizes x draws)."""
    intra: Link
    inter: Link
    per_node: int
    grad_bytes: int
    sharding: str
    fitted_link: bool
    """True: the intra-node link was fitted to measured collectives."""
    link_basis: str
    """What the link rests on, in words (the plan says it)."""
    measured_sync: dict[int, np.ndarray]
    """The collectives of a step the run measured at each of its device counts above 1
    (ddp's timing, or what a replay's step times say): the plan uses them at those counts."""
    largest_micro_batch: dict[bool, int]
    """The largest micro-batch that ran, per setting: the plan goes no higher (memory)."""
    device_counts: tuple[int, ...]
    """The device counts the run measured."""

    def step_s(self, config: BatchConfig) -> np.ndarray:
        """The step time of ``config`` in each draw (seconds)."""
        g = config.grad_accum_steps
        compute = g * self.micro_batch_s(config.canonical_micro_batch_size,
                                         config.activation_checkpointing)  # fmt: skip
        sync = self.measured_sync.get(config.num_devices)
        if sync is None:
            sync = sync_s(self.grad_bytes, config.num_devices, g, self.sharding, self.per_node,
                          self.intra, self.inter)  # fmt: skip
        return compute + sync

    def micro_batch_s(self, m: int, checkpointing: bool) -> np.ndarray:
        """Seconds per micro-batch of m: measured, linear between the sizes measured, and
        outside them the affine fit (a fixed cost per pass plus a cost per sample)."""
        sizes, times = self.compute[checkpointing]
        hit = np.flatnonzero(sizes == m)
        if hit.size:
            return times[hit[0]]
        if len(sizes) == 1:
            return times[0] * m / sizes[0]  # no fixed cost to see: proportional
        if sizes[0] < m < sizes[-1]:
            i = int(np.searchsorted(sizes, m))
            w = (m - sizes[i - 1]) / (sizes[i] - sizes[i - 1])
            return (1 - w) * times[i - 1] + w * times[i]
        x = sizes.astype(float)
        xc = x - x.mean()
        slope = (xc @ (times - times.mean(axis=0))) / (xc @ xc)
        slope = np.maximum(slope, 0.0)
        fixed = np.maximum(times.mean(axis=0) - slope * x.mean(), 0.0)
        nearest = times[0] * m / sizes[0] if m < sizes[0] else times[-1] * m / sizes[-1]
        fitted = fixed + slope * m
        return np.where(fitted > 0, fitted, nearest)

    def feasible(self, config: BatchConfig) -> bool:
        """Measured activation checkpointing, and a micro-batch no larger than one that ran."""
        ckpt = config.activation_checkpointing
        return (
            ckpt in self.compute
            and config.canonical_micro_batch_size <= (self.largest_micro_batch[ckpt])
        )


def fit_step_model(
    found: Sequence[Measurement],
    *,
    grad_bytes: int,
    per_node: int,
    intra_prior: tuple[float, float, float],
    inter_prior: tuple[float, float, float],
    draws: int = DRAWS,
    seed: int = 0,
) -> StepModel:
    """Fit the step model to ``found`` (see the module's docstring); the priors are
    (bytes/s, latency in seconds, the sd of their logs)."""
    if not found:
        raise MbtuneError("plan: the run has no measured trial (status ok) to plan from")
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal((len(found), draws + 1))
    noise[:, 0] = 0.0
    factor = np.exp(noise * np.array([f.rel_sd for f in found])[:, None])  # per trial, per draw
    steps = np.array([f.step_s for f in found])[:, None] * factor
    compute, folded = _fit_compute(found, steps)

    counts = tuple(sorted({f.config.num_devices for f in found}))
    sharding = "fsdp" if any(f.sharding == "fsdp" for f in found) else "none"
    # the collectives measured at each device count above 1: a ddp run's timed ones, a
    # replay's found by the fit; a simulated run's were modelled, and say nothing
    measured: dict[int, np.ndarray] = dict(folded)
    for n in counts:
        timed = [
            i
            for i, f in enumerate(found)
            if f.config.num_devices == n > 1 and f.parallel == "ddp" and f.sync_s is not None
        ]
        if timed and n not in measured:
            measured[n] = np.mean([found[i].sync_s * factor[i] for i in timed], axis=0)
    intra = _prior(intra_prior, rng, draws)
    inter = _prior(inter_prior, rng, draws)
    fitted, basis = _fit_link(found, measured, grad_bytes, per_node, counts, sharding)
    if fitted is not None:
        intra = Link(
            _combine(fitted.bandwidth, intra_prior[0], intra_prior[2], rng),
            _combine(fitted.latency_s, intra_prior[1], intra_prior[2], rng),
        )
    return StepModel(
        compute={ckpt: (sizes, times) for ckpt, (sizes, times) in compute.items()},
        intra=intra,
        inter=inter,
        per_node=per_node,
        grad_bytes=grad_bytes,
        sharding=sharding,
        fitted_link=fitted is not None,
        link_basis=basis,
        measured_sync={} if sharding == "fsdp" else measured,
        largest_micro_batch={ckpt: int(sizes[-1]) for ckpt, (sizes, _) in compute.items()},
        device_counts=counts,
    )


def _fit_compute(
    found: Sequence[Measurement], steps: np.ndarray
) -> tuple[dict[bool, tuple[np.ndarray, np.ndarray]], dict[int, np.ndarray]]:
    """Seconds per micro-batch at each measured (m, checkpointing), and the collectives
    at each device count whose trials folded them into their step time, per draw.

    One least-squares fit, relative to each step time: t = g x c(m) where the trial said
    its collectives apart (they are taken off first), t = g x c(m) + s(n) where it did
    not (a replay). Where c and s cannot be told apart (no micro-batch size measured at
    two device counts), s is folded into c.
    """
    groups = sorted({(f.config.activation_checkpointing, f.config.canonical_micro_batch_size)
                     for f in found})  # fmt: skip
    col = {key: j for j, key in enumerate(groups)}
    unknown = sorted({f.config.num_devices for f in found if f.sync_s is None})
    a = np.zeros((len(found), len(groups) + len(unknown)))
    b = steps.copy()
    for i, f in enumerate(found):
        c = f.config
        a[i, col[c.activation_checkpointing, c.canonical_micro_batch_size]] = c.grad_accum_steps
        if f.sync_s is None:
            a[i, len(groups) + unknown.index(c.num_devices)] = 1.0
        else:
            b[i] -= f.sync_s
    weight = 1.0 / np.array([f.step_s for f in found])[:, None]
    if unknown and np.linalg.matrix_rank(a) < a.shape[1]:
        a, unknown = a[:, : len(groups)], []  # s(n) and c(m) confounded: fold s into c
    solution = np.linalg.lstsq(a * weight, b * weight, rcond=None)[0]
    floor = 1e-3 * float(np.min([f.step_s / f.config.grad_accum_steps for f in found]))
    compute: dict[bool, tuple[np.ndarray, np.ndarray]] = {}
    for ckpt in sorted({k for k, _ in groups}):
        js = [j for j, (k, _) in enumerate(groups) if k == ckpt]
        sizes = np.array([groups[j][1] for j in js])
        compute[ckpt] = (sizes, np.maximum(solution[js], floor))
    folded = {n: np.maximum(solution[len(groups) + k], 0.0) for k, n in enumerate(unknown)}
    return compute, folded


def _combine(fit: np.ndarray, prior: float, spread: float, rng: np.random.Generator) -> np.ndarray:
    """A fitted link figure combined with its prior, in logs, each weighted by its
    precision: the fit's spread is its draws' (a robust sd: the draws of a figure the
    measurements barely show, a latency where the bytes dominate, scatter widely), the
    prior's its ``uncertainty``. Draw 0 is the combination's centre; the others are drawn
    about it with the combination's sd (a normal approximation in logs)."""
    logs = np.log(np.maximum(fit, prior * 1e-6))
    centre = float(np.median(logs[1:])) if logs.size > 1 else float(logs[0])
    q1, q3 = np.percentile(logs[1:], [25, 75]) if logs.size > 1 else (centre, centre)
    fit_var = ((q3 - q1) / _IQR_TO_SD) ** 2
    centre = float(logs[0]) if logs.size == 1 else centre
    if spread == 0:
        weights = (0.0, 1.0)  # a prior held exactly
    elif fit_var == 0:
        weights = (1.0, 0.0)
    else:
        precision = 1 / fit_var + 1 / spread**2
        weights = (1 / fit_var / precision, 1 / spread**2 / precision)
    mean = weights[0] * float(logs[0]) + weights[1] * math.log(prior)
    sd = 0.0 if spread == 0 or fit_var == 0 else math.sqrt(1 / precision)
    z = rng.standard_normal(logs.size)
    z[0] = 0.0
    return np.exp(mean + sd * z)


def _prior(prior: tuple[float, float, float], rng: np.random.Generator, draws: int) -> Link:
    """The prior link's draws: lognormal about the given figures (draw 0 at them)."""
    bandwidth, latency_s, spread = prior
    z = rng.standard_normal((2, draws + 1)) * spread
    z[:, 0] = 0.0
    return Link(bandwidth * np.exp(z[0]), latency_s * np.exp(z[1]))


def _fit_link(
    found: Sequence[Measurement],
    measured: dict[int, np.ndarray],
    grad_bytes: int,
    per_node: int,
    counts: tuple[int, ...],
    sharding: str,
) -> tuple[Link | None, str]:
    """The intra-node link fitted to the collectives measured at each device count, per
    draw (least squares of t_sync = bytes moved / bandwidth + hops x latency, both
    non-negative, relative to each), and what the link rests on, in words. No fit where the
    run cannot say: it measured one device count, its collectives were modelled
    (``simulate``), it measured them at fewer than two device counts, or crossed a node."""
    prior = "the link rests on the prior alone (plan.intra_node, plan.inter_node): "
    ns = sorted(measured)
    if len(counts) < 2:
        return None, prior + f"the run measured a single device count ({counts[0]})"
    if not ns and any(f.parallel == "simulate" for f in found):
        return None, prior + (
            "the run's collectives were modelled (trial.parallel: simulate), not measured"
        )
    at = f" (it uses the collectives measured at {', '.join(map(str, ns))} devices there)"
    if len(ns) < 2:
        return None, prior + "the run measured collectives at fewer than two device counts " + (
            f"above 1{at if ns else ''}"
        )
    if max(counts) > per_node:
        return None, prior + f"the run's device counts cross a node of {per_node}{at}"
    if grad_bytes <= 0:
        return None, prior + "the model has no gradient to all-reduce"
    if sharding == "fsdp":
        return None, prior + "the run sharded the model (fsdp), whose collectives it does not fit"
    a = np.array([[2 * (n - 1) / n * grad_bytes, 2 * (n - 1)] for n in ns])
    t = np.array([measured[n] for n in ns])
    weight = 1.0 / np.maximum(t[:, :1], 1e-12)  # relative to the point estimate's
    scale = a.max(axis=0)
    inverse_bw, latency = np.empty(t.shape[1]), np.empty(t.shape[1])
    for d in range(t.shape[1]):
        coef, _ = nnls(a / scale * weight, t[:, d] * weight[:, 0])
        inverse_bw[d], latency[d] = coef / scale
    basis = (
        f"the intra-node link is fitted to the collectives measured at {', '.join(map(str, ns))} "
        "devices; the inter-node link is the prior (plan.inter_node)"
    )
    return Link(1.0 / np.maximum(inverse_bw, 1e-15), latency), basis
