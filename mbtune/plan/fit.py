"""The step time of a configuration on a cluster the run did not measure, fitted to the
run's trials, with its uncertainty as draws.

A step is the compute of one device's micro-batches, with its pipeline's bubble, and then
the collectives::

    t_step = g x c_v(m) x (1 + bubble(p, g, schedule)) + S(config)

``c_v(m)`` (seconds per micro-batch of m samples of one device of the variant v: the
layout, t and p and the schedule, and the settings of the step, activation checkpointing
and with fsdp ``reshard_after_forward`` and ``grad_sync``) is the device's own: it does
not depend on the replicas d = n / (t p), so the trials measure it at any n. ``S`` is the
step's collectives as the ring runs them (mbtune.comm: the bytes a device sends and the
hops it waits, the same model the simulated trial uses): the data-parallel sync of the
device's gradients over d and, where the model is split, the tensor-parallel all-reduces
and the pipeline's sends, which do not change with d; each kind over its tier's link as
Megatron places the ranks (mbtune.plan.layout). A layout measured at some d is planned at
more devices by growing d alone.

The intra-node link is fitted to what the run measured, in one least-squares fit with the
compute: the step times that hold their collectives (a replay's, whose throughput shows
them), and the collectives a ``ddp`` run timed. Since S is linear in the link's seconds
per byte and per hop, the step times across device counts show the link's cost wherever
one micro-batch size was measured at two counts (one device counts: it moves nothing).
Where the run cannot tell bandwidth from latency (one device count above 1), the latency
is the prior's and the bandwidth is fitted; where it cannot see the link at all, the link
is the prior (plan.intra_node). A fitted link is then combined with its prior, which
yields where the measurements contradict it (mbtune.plan.prior); and past the device counts
measured, a step's collectives never cost less than the fitted link alone says: a plan
never scales better than the measurements below it imply. The link between nodes is always
the prior: no run of mbtune crosses one.

The uncertainty is a parametric bootstrap: each draw perturbs every measured step time by
its own noise (its step times' spread and the run's drift between trials, both estimated as
the search's model estimates them: mbtune.recommend.confidence), refits ``c`` and the link,
and draws the prior links from their ``uncertainty``; draw 0 is the fit to the measurements
as they are, with the prior at its median. Pure: numpy and scipy only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import nnls

from mbtune.comm import Link, all_reduce, step_traffic
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.plan.layout import Activations, layout_traffic, placed_s
from mbtune.plan.prior import prior_link, with_prior
from mbtune.recommend.noise import (
    between_trial_drift,
    drift_variance,
    relative_step_noise,
    step_variance,
)
from mbtune.recommend.observation import Observation, observation
from mbtune.runs.record import TrialRecord

__all__ = [
    "DRAWS",
    "StepModel",
    "fit_step_model",
    "observations",
]

DRAWS = 1000
"""Bootstrap draws: the 5th and 95th percentiles of 1000 draws move by 1.5 to 3% of the
interval's width (an sd) from one seed to another (three generated landscapes at 256
devices, bench/plan_coverage.py's, ten seeds each)."""


def observations(records: Sequence[TrialRecord]) -> list[Observation]:
    """The run's trials that ran ok, as the models read them (the one conversion,
    :func:`mbtune.recommend.confidence.observation`)."""
    return [o for o in map(observation, records) if o.status == "ok" and o.samples_per_s]


def _step_s(o: Observation) -> float:
    """The step's median time (B / samples_per_s)."""
    return o.config.batch_size / o.samples_per_s  # type: ignore[operator]


def _said_apart(o: Observation, grad_bytes: int, sharding: str) -> float | None:
    """The step's collectives where the trial said them apart, taken off its step time
    before the fit: modelled (simulate), or timed (ddp: one all-reduce of the gradients,
    scaled to the step's own, fsdp's 2g + 1 gathers); None where folded in (a replay, and
    a real split model's step, whose sends and all-reduces run inside it)."""
    if o.comm_s is None or not o.comm_timed:
        return o.comm_s
    if _split(o.config):
        return None
    timed = all_reduce(grad_bytes, o.config.num_devices)
    step = step_traffic(o.config, grad_bytes=grad_bytes, sharding=sharding)
    return o.comm_s * step.volume / timed.volume


def _split(config: BatchConfig) -> bool:
    return config.tensor_parallel * config.pipeline_parallel > 1


def _passes(config: BatchConfig) -> float:
    """A device's micro-batches of a step in units of one's compute: g, and the pipeline's
    bubble (``BatchConfig.bubble``: its fill and drain slots idle)."""
    return config.grad_accum_steps * (1 + config.bubble)


def _relative_sds(found: Sequence[Observation], noise_floor: float) -> np.ndarray:
    """Each step time's relative sd as the search's model reads it: the run's pooled step
    noise over the trial's step times, and the drift between trials of one configuration
    (``noise_floor`` pooled with the run's repeats, read as Student's t)."""
    spread, _ = relative_step_noise(found)
    drift, dof = between_trial_drift(found, spread, prior=noise_floor)
    drift_var = drift_variance(drift, dof)
    own = [step_variance(spread, o) if len(o.step_times_ms) > 1 else 0.0 for o in found]
    return np.sqrt(np.array(own) + drift_var)


@dataclass(frozen=True, kw_only=True)
class StepModel:
    """The fitted step time, as draws (index 0: the point estimate)."""

    compute: dict[tuple, tuple[np.ndarray, np.ndarray]]
    """For each variant (:attr:`BatchConfig.variant`: the layout and the settings of the
    step): the measured micro-batch sizes and one device's seconds per micro-batch at
    each, an array (sizes x draws)."""
    intra: Link
    """The intra-node link, the fit combined with the prior (arrays over the draws)."""
    measured: Link | None
    """The intra-node link the measurements alone say, where they say it: past the
    measured device counts no step's collectives cost less than with it."""
    inter: Link
    per_node: int
    grad_bytes: int
    sharding: str
    activations: Activations | None
    """One sample's activations and the model's blocks, where the run split its model."""
    link_basis: str
    """What the link rests on, in words (the plan says it)."""
    folded_sync: dict[tuple, np.ndarray]
    """The collectives of a step at each measured device count and layout beyond a node,
    as a replay's step times say them (no link is fitted there): used there."""
    largest_micro_batch: dict[tuple, int]
    """The largest micro-batch that ran, per variant: the plan goes no higher (memory)."""
    device_counts: tuple[int, ...]
    """The device counts the run measured."""

    def step_s(self, config: BatchConfig) -> np.ndarray:
        """The step time of ``config`` in each draw (seconds): g x c_v(m) x (1 + bubble)
        plus the step's collectives."""
        per_pass = self.micro_batch_s(config.canonical_micro_batch_size, config.variant)
        return _passes(config) * per_pass + self.sync_s(config)

    def sync_s(self, config: BatchConfig) -> np.ndarray:
        """The step's collectives in each draw (seconds), each kind on its tier
        (mbtune.plan.layout)."""
        n = config.num_devices
        if (n, config.layout) in self.folded_sync:
            return self.folded_sync[n, config.layout]
        parts = layout_traffic(config, grad_bytes=self.grad_bytes, sharding=self.sharding,
                               activations=self.activations)  # fmt: skip
        sync = placed_s(config, parts, self.per_node, self.intra, self.inter)
        if self.measured is not None and n > max(self.device_counts):
            # the data-parallel sync never cheaper than its bytes cost over the link the
            # measurements say (their latency is too unsure to floor with: a few counts
            # barely show it); the layout's other traffic is as measured
            data = placed_s(config, parts.data_only(), self.per_node, self.intra, self.inter)
            floor = placed_s(config, parts.data_only(bytes_only=True), self.per_node,
                             self.measured, self.inter)  # fmt: skip
            sync = sync + np.maximum(floor - data, 0.0)
        return sync * np.ones_like(self.intra.bandwidth)

    def micro_batch_s(self, m: int, variant: tuple) -> np.ndarray:
        """One device's seconds per micro-batch of m: measured, linear between the sizes
        measured, and outside them the affine fit (a fixed cost per pass plus a cost per
        sample)."""
        sizes, times = self.compute[variant]
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
        """A measured variant (layout and settings), and a micro-batch no larger than one
        that ran with it."""
        variant = config.variant
        return (
            variant in self.compute
            and config.canonical_micro_batch_size <= self.largest_micro_batch[variant]
        )


def fit_step_model(
    found: Sequence[Observation],
    *,
    noise_floor: float,
    grad_bytes: int,
    sharding: str = "none",
    per_node: int,
    intra_prior: tuple[float, float, float],
    inter_prior: tuple[float, float, float],
    activations: Activations | None = None,
    draws: int = DRAWS,
    seed: int = 0,
) -> StepModel:
    """Fit the step model to ``found`` (see the module's docstring); the priors are
    (bytes/s, latency in seconds, the sd of their logs); ``activations``: where the run
    split its model, what its tensor-parallel and pipeline traffic is counted from."""
    if not found:
        raise MbtuneError("plan: the run has no measured trial (status ok) to plan from")
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal((len(found), draws + 1))
    noise[:, 0] = 0.0
    factor = np.exp(noise * _relative_sds(found, noise_floor)[:, None])  # per trial, per draw
    intra = prior_link(intra_prior, rng, draws)
    inter = prior_link(inter_prior, rng, draws)
    counts = tuple(sorted({f.config.num_devices for f in found}))
    plain = [i for i, f in enumerate(found) if not _split(f.config)]
    split = [i for i, f in enumerate(found) if _split(f.config)]
    fit = _fit([found[i] for i in plain], factor[plain], grad_bytes, sharding, per_node,
               intra.latency_s)  # fmt: skip
    measured, basis = None, _why_not_fitted(found, counts, per_node, grad_bytes, fit.link)
    if fit.link is not None:
        measured = fit.link
        intra, held = with_prior(fit.link, fit.link_counts, fit.latency_fitted, intra,
                                 intra_prior, grad_bytes, sharding, rng)  # fmt: skip
        basis = _fitted_basis(fit.link_counts, held, fit.latency_fitted)
    compute = dict(fit.compute)
    if split:

        def sync_s(config: BatchConfig) -> np.ndarray:
            parts = layout_traffic(config, grad_bytes=grad_bytes, sharding=sharding,
                                   activations=activations)  # fmt: skip
            return placed_s(config, parts, per_node, intra, inter)

        compute.update(_split_compute([found[i] for i in split], factor[split], sync_s,
                                      grad_bytes, sharding))  # fmt: skip
    return StepModel(
        compute=compute,
        intra=intra,
        measured=measured,
        inter=inter,
        per_node=per_node,
        grad_bytes=grad_bytes,
        sharding=sharding,
        activations=activations,
        link_basis=basis,
        folded_sync=fit.folded,
        largest_micro_batch={key: int(sizes[-1]) for key, (sizes, _) in compute.items()},
        device_counts=counts,
    )


@dataclass(frozen=True)
class _Fitted:
    compute: dict[tuple, tuple[np.ndarray, np.ndarray]]
    link: Link | None
    """The intra-node link the measurements say, per draw; None where they cannot."""
    latency_fitted: bool
    """False: the measurements could not tell latency from bandwidth; it is the prior's."""
    link_counts: tuple[int, ...]
    """The device counts above 1 whose measurements the link rests on."""
    folded: dict[tuple, np.ndarray]


def _fit(
    found: Sequence[Observation],
    factor: np.ndarray,
    grad_bytes: int,
    sharding: str,
    per_node: int,
    prior_latency: np.ndarray,
) -> _Fitted:
    """One non-negative least-squares fit per draw of the trials of an unsplit model,
    relative to each measured time: the seconds per micro-batch at each measured
    (variant, m), the intra-node link's seconds per byte and per hop, and the collectives
    of each device count beyond a node whose step times folded them in.

    Rows: a step time, t = g x c(m) + [T . (1 / bandwidth, latency) where the trial folded
    its collectives in (a replay) within a node; + s(n) beyond one; nothing where it said
    them apart, which is taken off first]; and a ddp trial's timed collectives, t = T .
    (1 / bandwidth, latency). Columns the measurements cannot tell apart are dropped in
    turn: the latency (then the prior's), the link (then the prior), the folded s(n)
    (then folded into c, as they cannot be told from the compute)."""
    if not found:
        return _Fitted({}, None, False, (), {})
    groups = sorted({(f.config.variant, f.config.canonical_micro_batch_size) for f in found})
    col = {key: j for j, key in enumerate(groups)}
    apart = [_said_apart(f, grad_bytes, sharding) for f in found]
    beyond = sorted({(f.config.num_devices, f.config.layout)
                     for f, sync in zip(found, apart, strict=True)
                     if sync is None and f.config.num_devices > per_node})  # fmt: skip
    timed = [i for i, f in enumerate(found) if f.comm_timed and f.comm_s]
    k, rows = len(groups), len(found) + len(timed)
    a = np.zeros((rows, k + 2 + len(beyond)))  # compute | seconds a byte, a hop | s(n)
    steps = np.array([_step_s(f) for f in found])[:, None] * factor
    b = np.zeros((rows, factor.shape[1]))
    scale = np.zeros(rows)
    link_counts = set()
    for i, f in enumerate(found):
        c = f.config
        a[i, col[c.variant, c.canonical_micro_batch_size]] = _passes(c)
        b[i] = steps[i]
        scale[i] = _step_s(f)
        if apart[i] is not None:
            b[i] -= apart[i]
        elif c.num_devices > per_node:
            a[i, k + 2 + beyond.index((c.num_devices, c.layout))] = 1.0
        elif c.num_devices > 1:
            traffic = step_traffic(c, grad_bytes=grad_bytes, sharding=sharding)
            a[i, k : k + 2] = traffic.volume, traffic.hops
            link_counts.add(c.num_devices)
    for row, i in enumerate(timed, start=len(found)):
        f = found[i]
        traffic = all_reduce(grad_bytes, f.config.num_devices)  # what ddp timed alone
        a[row, k : k + 2] = traffic.volume, traffic.hops
        b[row] = f.comm_s * factor[i]
        scale[row] = f.comm_s
        link_counts.add(f.config.num_devices)
    keep = list(range(a.shape[1]))
    latency_fitted = True
    if np.linalg.matrix_rank(a[:, keep]) < len(keep):
        keep.remove(k + 1)  # latency from the prior: b -= hops x latency, per draw
        latency_fitted = False
        if np.linalg.matrix_rank(a[:, keep]) < len(keep) or not a[:, k].any():
            keep.remove(k)  # no link to see
        if np.linalg.matrix_rank(a[:, keep]) < len(keep):
            keep = list(range(k))  # s(n) and c(m) confounded: fold s into c
    link = k in keep
    if not latency_fitted:
        b = b - a[:, k + 1 : k + 2] * prior_latency[None, :] * link
    weight = 1.0 / np.maximum(scale, 1e-12)[:, None]
    design = a[:, keep] * weight
    norm = np.abs(design).max(axis=0)
    norm[norm == 0] = 1.0
    solution = np.empty((len(keep), b.shape[1]))
    for d in range(b.shape[1]):
        solution[:, d] = nnls(design / norm, b[:, d] * weight[:, 0])[0] / norm
    at = {column: solution[j] for j, column in enumerate(keep)}
    floor = 1e-3 * float(np.min([_step_s(f) / f.config.grad_accum_steps for f in found]))
    compute: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}
    for variant in sorted({v for v, _ in groups}):
        js = [j for j, (v, _) in enumerate(groups) if v == variant]  # sorted by size
        sizes = np.array([groups[j][1] for j in js])
        compute[variant] = (sizes, np.maximum(np.array([at[j] for j in js]), floor))
    fitted = None
    if link:
        per_byte = np.maximum(at[k], 1e-15)
        fitted = Link(1.0 / per_byte, at[k + 1] if latency_fitted else prior_latency)
    folded = {key: np.maximum(at[k + 2 + j], 0.0) for j, key in enumerate(beyond)
              if k + 2 + j in at}  # fmt: skip
    return _Fitted(compute, fitted, latency_fitted and link, tuple(sorted(link_counts)), folded)


def _split_compute(
    found: Sequence[Observation],
    factor: np.ndarray,
    sync_s: Callable[[BatchConfig], np.ndarray],
    grad_bytes: int,
    sharding: str,
) -> dict[tuple, tuple[np.ndarray, np.ndarray]]:
    """Each split variant's seconds per micro-batch at each measured size, per draw: what
    its step times leave once the step's collectives are taken off (said apart by the
    trial, else ``sync_s``: every kind over the links), over its passes; where a size was
    measured at several device counts, their least squares relative to each time. A split
    model's tensor-parallel and pipeline traffic grows with its micro-batches as its
    compute does, so its step times cannot show the link: it is fitted without them."""
    rows: dict[tuple, list[int]] = {}
    for i, f in enumerate(found):
        rows.setdefault((f.config.variant, f.config.canonical_micro_batch_size), []).append(i)
    floor = 1e-3 * min(_step_s(f) / f.config.grad_accum_steps for f in found)
    at = {}
    for key, members in rows.items():
        num, den = 0.0, 0.0
        for i in members:
            f = found[i]
            apart = _said_apart(f, grad_bytes, sharding)
            left = _step_s(f) * factor[i] - (apart if apart is not None else sync_s(f.config))
            weight, passes = _step_s(f) ** -2, _passes(f.config)
            num, den = num + weight * passes * left, den + weight * passes**2
        at[key] = np.maximum(num / den, floor)
    return {
        variant: (np.array(sizes), np.array([at[variant, m] for m in sizes]))
        for variant in sorted({v for v, _ in at})
        for sizes in [sorted(m for v, m in at if v == variant)]
    }


_PRIOR_ALONE = "the link rests on the prior alone (plan.intra_node, plan.inter_node): "


def _why_not_fitted(
    found: Sequence[Observation],
    counts: tuple[int, ...],
    per_node: int,
    grad_bytes: int,
    link: Link | None,
) -> str:
    """Why the run's measurements say nothing of the intra-node link, in words."""
    if link is not None:
        return ""
    if len(counts) < 2:
        return _PRIOR_ALONE + f"the run measured a single device count ({counts[0]})"
    if grad_bytes <= 0:
        return _PRIOR_ALONE + "the model has no gradient to all-reduce"
    within = [f for f in found if 1 < f.config.num_devices <= per_node]
    if within and all(_split(f.config) for f in within):
        return _PRIOR_ALONE + (
            "the run measured no layout without tensor or pipeline parallelism from 2 devices "
            f"to a node's {per_node} (a split layout's collectives grow with its "
            "micro-batches as its compute does: its step times cannot show the link)"
        )
    within = [f for f in within if not _split(f.config)]
    if within and all(f.comm_s is not None and not f.comm_timed for f in within):
        return _PRIOR_ALONE + (
            "the run's collectives were modelled (trial.parallel: simulate), not measured"
        )
    if not within:
        return _PRIOR_ALONE + f"the run measured no device count from 2 to a node's {per_node}"
    return _PRIOR_ALONE + (
        "the run's step times cannot tell the collectives from the compute (no micro-batch "
        "size measured at two device counts)"
    )


def _fitted_basis(counts: tuple[int, ...], held: float, latency: bool) -> str:
    """What a fitted link rests on, in words."""
    at = ", ".join(map(str, counts))
    said = f"the intra-node link is fitted to the collectives measured at {at} devices"
    if not latency:
        said += " (bandwidth; the latency is the prior's: one device count cannot tell them apart)"
    if held < 0.5:
        said += ", to which the prior (plan.intra_node) yields"
    else:
        said += ", combined with the prior (plan.intra_node)"
    return said + "; the inter-node link is the prior (plan.inter_node)"
