"""The plan of the real run: for each planned device count the best configuration at that
size, its samples/s, hours, device-hours and cost, each with a 90% interval; then the
fastest, the cheapest, and the cheapest within ``plan.max_slowdown`` of the fastest.

hours = samples / samples_per_s / 3600 (samples: ``plan.samples``, ``plan.tokens`` over
the tokens of one sample, or ``plan.steps`` x the configuration's batch_size),
device_hours = hours x devices, cost = device_hours x ``plan.price_per_device_hour``. The
three follow from samples/s by monotone maps, so each interval is samples/s's, mapped.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from mbtune.config.experiment import Experiment
from mbtune.config.rules import ConfigError
from mbtune.config.schema import PlanConfig
from mbtune.config.search import IntRange
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig, ModelShape
from mbtune.plan.fit import DRAWS, StepModel, fit_step_model, observations
from mbtune.plan.layout import activations_of
from mbtune.plan.nccl import plan_links
from mbtune.recommend.confidence import MAX_SCORE, TOLERANCE
from mbtune.report.words import layout, layout_cell
from mbtune.runs.record import TrialRecord

__all__ = [
    "LEVEL",
    "Interval",
    "Plan",
    "PlanRow",
    "make_plan",
    "plan_lines",
]

LEVEL = 0.90
"""The intervals' coverage: the 5th to the 95th percentile of the draws."""


@dataclass(frozen=True)
class Interval:
    """A point estimate and its 90% interval (``low <= value <= high``)."""

    value: float
    low: float
    high: float

    @classmethod
    def of(cls, draws: np.ndarray) -> Interval:
        """Draw 0 as the value, the others' 5th to 95th percentiles as the interval
        (widened to hold the value where the draws lie all to one side of it)."""
        value = float(draws[0])
        rest = draws[1:] if draws.size > 1 else draws
        tail = (1 - LEVEL) / 2 * 100
        low, high = np.percentile(rest, [tail, 100 - tail])
        return cls(value, min(float(low), value), max(float(high), value))

    def times(self, factor: float) -> Interval:
        return Interval(self.value * factor, self.low * factor, self.high * factor)

    def into(self, amount: float) -> Interval:
        """``amount / self``: the interval of a time from that of a rate."""
        return Interval(amount / self.value, amount / self.high, amount / self.low)

    def as_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high}


@dataclass(frozen=True, kw_only=True)
class PlanRow:
    """The best configuration at one planned device count."""

    config: BatchConfig
    samples: float
    """Samples the real run trains on with this configuration."""
    samples_per_s: Interval
    hours: Interval
    device_hours: Interval
    cost: Interval | None
    """None: the plan has no price."""
    confidence: int | None = None
    """For the best row of a device count: the probability, in percent (at most 99), that
    it is within 2% of the fastest configuration at that count, from the same draws as
    the intervals (which draw the link too: at a device count nobody measured, the link
    model's doubt is in it). None for a row that is not a pick."""

    def as_dict(self) -> dict[str, Any]:
        c = self.config
        return {
            "num_devices": c.num_devices,
            "batch_size": c.batch_size,
            "micro_batch_size": c.micro_batch_size,
            "activation_checkpointing": c.activation_checkpointing,
            "reshard_after_forward": c.reshard_after_forward,
            "grad_sync": c.grad_sync,
            "tensor_parallel": c.tensor_parallel,
            "pipeline_parallel": c.pipeline_parallel,
            "pipeline_schedule": c.pipeline_schedule,
            "confidence": self.confidence,
            "samples_per_s": self.samples_per_s.as_dict(),
            "hours": self.hours.as_dict(),
            "device_hours": self.device_hours.as_dict(),
            "cost": self.cost.as_dict() if self.cost is not None else None,
        }


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The plan: its rows, the three picks, and what it rests on."""

    rows: tuple[PlanRow, ...]
    fastest: PlanRow
    cheapest: PlanRow
    """The least cost (the fewest device-hours without a price)."""
    cheapest_within: PlanRow
    """The cheapest whose hours are within ``max_slowdown`` of the fastest's."""
    plan: PlanConfig
    skipped: tuple[tuple[int, str], ...]
    """Planned device counts without a configuration, and why."""
    link_basis: str
    """What the link model rests on, in words."""
    trials: int
    """The measured trials the fit used."""
    device_counts: tuple[int, ...]
    """The device counts the run measured."""
    grad_bytes: int
    model: StepModel
    """The fitted step model the rows were read from."""
    candidates: tuple[tuple[BatchConfig, ...], ...]
    """Every configuration considered at each row's device count (in the rows' order)."""
    layouts: tuple[tuple[PlanRow, ...], ...]
    """At each row's device count, the best configuration of each layout the run measured
    that divides it, fewest hours first (the first is the row itself)."""
    tokens_per_sample: float | None
    """What ``plan.tokens`` is divided by; None where the plan counts no tokens."""

    @property
    def amount(self) -> str:
        """What the real run trains on, in words: '2e+09 samples', '1e+12 tokens'."""
        p = self.plan
        if p.samples is not None:
            return f"{p.samples:,.4g} samples"
        return f"{p.tokens:,.4g} tokens" if p.tokens is not None else f"{p.steps:,} steps"

    def configurations(self) -> tuple[PlanRow, ...]:
        """Every configuration considered at each planned device count, fewest hours first
        within a count (the first of each count is its row)."""
        return tuple(
            row
            for configs in self.candidates
            for row in sorted(
                (_row_of(self.model, c, self.plan, self.tokens_per_sample) for c in configs),
                key=lambda r: r.hours.value,
            )
        )

    def as_frame(self) -> pd.DataFrame:
        """The plan as pandas: one row per planned device count and configuration of the
        search space there (:meth:`configurations`), ``best`` True on each count's row (and
        ``confidence``: how sure that pick is); its sizes, ``samples`` (to train on), and
        each of samples_per_s, hours, device_hours, cost as three columns (the value,
        ``_low`` and ``_high``: the 90% interval)."""
        records, best = [], {r.config: r.confidence for r in self.rows}
        for row in self.configurations():
            flat = {k: v for k, v in row.as_dict().items() if not isinstance(v, dict | None)}
            flat["best"] = row.config in best
            flat["confidence"] = best.get(row.config)
            flat["samples"] = row.samples
            for key in ("samples_per_s", "hours", "device_hours", "cost"):
                interval = getattr(row, key)
                for part in ("value", "low", "high"):
                    name = key if part == "value" else f"{key}_{part}"
                    flat[name] = getattr(interval, part) if interval is not None else None
            records.append(flat)
        return pd.DataFrame.from_records(records)

    def as_json(self) -> dict[str, Any]:
        """``mbtune plan --json``: the rows, the three picks, and at each row's count the
        best configuration of each layout measured there (the row first)."""
        return {
            "rows": [r.as_dict() for r in self.rows],
            "fastest": self.fastest.as_dict(),
            "cheapest": self.cheapest.as_dict(),
            "cheapest_within": self.cheapest_within.as_dict(),
            "layouts": [[r.as_dict() for r in rows] for rows in self.layouts],
        }


# ---------------------------------------------------------------------------
# the plan


def make_plan(
    experiment: Experiment,
    records: Sequence[TrialRecord],
    *,
    grad_bytes: int,
    shape: ModelShape | None = None,
    draws: int = DRAWS,
    seed: int = 0,
) -> Plan:
    """Fit the step model to ``records`` and plan ``experiment.plan`` with it; ``shape``
    (else ``experiment.model_shape``): the model's, where the run split it (its ``hidden``
    and ``layers`` count the tensor-parallel and pipeline traffic)."""
    plan = experiment.plan
    if plan is None:
        raise ConfigError("plan", "the experiment has no plan section")
    sharding = experiment.trial.sharding
    found = observations(records)
    activations = None
    if any(o.config.layout[:2] != (1, 1) for o in found):
        activations = activations_of(shape or experiment.model_shape, records)
    (intra, inter), sources = plan_links(plan)
    model = fit_step_model(
        found,
        noise_floor=experiment.noise_floor,
        grad_bytes=grad_bytes,
        sharding=sharding,
        per_node=plan.devices_per_node,
        intra_prior=intra,
        inter_prior=inter,
        activations=activations,
        draws=draws,
        seed=seed,
    )
    per_sample = _tokens_per_sample(records) if plan.tokens is not None else None
    rows, skipped, considered, layouts = [], [], [], []
    for n in plan.num_devices:
        candidates = [c for c in _configs_at(experiment, n) if model.feasible(c)]
        if not candidates:
            skipped.append((n, _why_none(experiment, model, n)))
            continue
        rows.append(_best_row(model, candidates, plan, per_sample))
        considered.append(tuple(candidates))
        layouts.append(_layout_rows(model, candidates, plan, per_sample, rows[-1]))
    if not rows:
        _, why = skipped[0]
        raise ConfigError("plan.num_devices", f"no planned device count has a configuration: {why}")
    fastest = min(rows, key=lambda r: r.hours.value)
    cheapest = min(rows, key=lambda r: (r.device_hours.value, r.hours.value))
    bound = fastest.hours.value * (1 + plan.max_slowdown)
    within = [r for r in rows if r.hours.value <= bound * (1 + 1e-12)]
    return Plan(
        rows=tuple(rows),
        fastest=fastest,
        cheapest=cheapest,
        cheapest_within=min(within, key=lambda r: (r.device_hours.value, r.hours.value)),
        plan=plan,
        skipped=tuple(skipped),
        link_basis=model.link_basis + "".join(f"; {source}" for source in sources),
        trials=len(found),
        device_counts=model.device_counts,
        grad_bytes=grad_bytes,
        model=model,
        candidates=tuple(considered),
        layouts=tuple(layouts),
        tokens_per_sample=per_sample,
    )


def _configs_at(experiment: Experiment, n: int, batch_size: int | None = None) -> list[BatchConfig]:
    """The configurations the experiment's space holds at n devices (its batch sizes, or
    ``batch_size``, else ``plan.batch_size``, and its micro-batch sizes, its checkpointing
    settings); none where it holds none."""
    search = experiment.search
    plan = experiment.plan
    batch = batch_size or (plan.batch_size if plan is not None else None)
    space = dataclasses.replace(search.space, num_devices=(n,))
    if batch is not None:
        space = dataclasses.replace(space, batch_size=batch)
    try:
        at_n = dataclasses.replace(
            experiment,
            search=dataclasses.replace(search, space=space, start_points=()),
            plan=None,
        )
    except MbtuneError:
        return []
    return at_n.configs()


def _why_none(experiment: Experiment, model: StepModel, n: int) -> str:
    """Why no configuration at n devices can be planned, and the plan.batch_size that
    would plan one there, where one would."""
    if not _configs_at(experiment, n):
        why = (
            f"the search space holds no configuration at {n} devices: "
            f"{_batch_named(experiment)} cannot be split over {n}"
        )
    else:
        sizes = ", ".join(f"{m}" for m in sorted(set(model.largest_micro_batch.values())))
        why = (
            f"every configuration at {n} devices needs a micro-batch larger than the largest "
            f"that ran ({sizes}) or a layout or setting of the step (tensor_parallel, "
            "pipeline_parallel, activation checkpointing, sharding) the run did not measure "
            "at a count it divides"
        )
    batch = _plannable_batch(experiment, model, n)
    return why + (f"; plan.batch_size={batch} would plan it" if batch is not None else "")


def _batch_named(experiment: Experiment) -> str:
    """The batch the plan splits, as a reason names it."""
    batch = _batch_of(experiment)
    if experiment.plan is not None and experiment.plan.batch_size is not None:
        return f"plan.batch_size {batch}"
    if isinstance(batch, IntRange):
        return f"its batch_size ({batch.min} to {batch.max})"
    return f"its batch_size {batch}"


def _batch_of(experiment: Experiment) -> int | IntRange:
    """The batch the plan splits: ``plan.batch_size``, else the run's (its space's)."""
    plan, space = experiment.plan, experiment.search.space
    if plan is not None and plan.batch_size is not None:
        return plan.batch_size
    return space.batch_size if space.batch_size is not None else experiment.train_input.batch_size


def _plannable_batch(experiment: Experiment, model: StepModel, n: int) -> int | None:
    """The global batch nearest the plan's (on a log scale) that n devices split into a
    configuration the fit predicts: a multiple of n, a power of two times n; None where
    none of them does (a setting the run did not measure)."""
    batch = _batch_of(experiment)
    batch = batch.max if isinstance(batch, IntRange) else batch
    candidates = {n * 2**i for i in range(20)} | {n * -(-batch // n)}
    for b in sorted(candidates, key=lambda b: (abs(math.log(b / batch)), b)):
        if b != batch and any(model.feasible(c) for c in _configs_at(experiment, n, b)):
            return b
    return None


def _best_row(
    model: StepModel,
    candidates: list[BatchConfig],
    plan: PlanConfig,
    per_sample: float | None,
) -> PlanRow:
    """The candidate with the fewest predicted hours (draw 0), with its intervals and how
    sure the pick is: the share of draws in which it is within the tolerance of the
    fastest candidate of that draw."""
    hours = {c: _samples_of(c, plan, per_sample) * model.step_s(c) / c.batch_size
             for c in candidates}  # fmt: skip
    best = min(candidates, key=lambda c: float(hours[c][0]))
    fastest = np.min(np.vstack(list(hours.values())), axis=0)
    within = float(np.mean(hours[best] * (1 - TOLERANCE) <= fastest))  # as a recommendation
    row = _row_of(model, best, plan, per_sample)
    return dataclasses.replace(row, confidence=min(MAX_SCORE, int(within * 100)))


def _layout_rows(
    model: StepModel,
    candidates: list[BatchConfig],
    plan: PlanConfig,
    per_sample: float | None,
    best: PlanRow,
) -> tuple[PlanRow, ...]:
    """The best candidate of each layout (fewest hours, draw 0), the count's own ``best``
    row for its layout; fewest hours first."""
    rows: dict[tuple, PlanRow] = {}
    for config in candidates:
        row = best if config == best.config else _row_of(model, config, plan, per_sample)
        held = rows.get(config.layout)
        if held is None or _rank(row, best) < _rank(held, best):
            rows[config.layout] = row
    return tuple(sorted(rows.values(), key=lambda r: (r is not best, r.hours.value)))


def _rank(row: PlanRow, best: PlanRow) -> tuple[float, bool]:
    return row.hours.value, row is not best


def _row_of(
    model: StepModel, config: BatchConfig, plan: PlanConfig, per_sample: float | None
) -> PlanRow:
    """``config``'s samples/s, hours, device-hours and cost, with their intervals."""
    speed = Interval.of(config.batch_size / model.step_s(config))
    samples = _samples_of(config, plan, per_sample)
    hours = speed.into(samples / 3600)
    device_hours = hours.times(config.num_devices)
    price = plan.price_per_device_hour
    return PlanRow(
        config=config,
        samples=samples,
        samples_per_s=speed,
        hours=hours,
        device_hours=device_hours,
        cost=device_hours.times(price) if price is not None else None,
    )


def _samples_of(config: BatchConfig, plan: PlanConfig, per_sample: float | None) -> float:
    """The samples the real run trains on with ``config``."""
    if plan.steps is not None:
        return float(plan.steps * config.batch_size)
    if plan.tokens is not None:
        return plan.tokens / per_sample  # type: ignore[operator]
    return float(plan.samples)  # type: ignore[arg-type]


def _tokens_per_sample(records: Sequence[TrialRecord]) -> float:
    ratios = [
        r.tokens_per_s / r.samples_per_s
        for r in records
        if r.status == "ok" and r.tokens_per_s and r.samples_per_s
    ]
    if not ratios:
        raise ConfigError(
            "plan.tokens",
            "the run's trials counted no tokens (its model has no seq_len); give "
            "plan.samples or plan.steps",
        )
    return statistics.median(ratios)


# ---------------------------------------------------------------------------
# in words


def plan_lines(plan: Plan) -> list[str]:
    """The plan as ``mbtune plan`` and the end of ``mbtune run`` print it: a row for each
    planned device count, and where the run split its model a column for the layout and,
    under each count's row, the best configuration of each other layout measured there."""
    p = plan.plan
    counts = ", ".join(map(str, plan.device_counts))
    split = any(c.layout[:2] != (1, 1) for configs in plan.candidates for c in configs)
    lines = [
        f"plan: {plan.amount} on {', '.join(map(str, p.num_devices))} devices, from "
        f"{plan.trials} measured trials at {counts} devices "
        f"({plan.grad_bytes / 1e6:,.1f} MB of gradients a step); 90% intervals; sure: the % "
        f"of the model's draws in which the row is within {TOLERANCE:.0%} of its count's "
        "fastest",
        f"  {plan.link_basis}",
        f"  {'devices':>7}  " + f"{'t x p':>22}  " * split + f"{'batch':>6}  {'micro':>5}  "
        f"{'ckpt':>4}  {'sure':>4}  {'samples/s':>28}  {'hours':>26}  {'device-hours':>30}  "
        + (f"{'cost':>30}" if p.price_per_device_hour is not None else ""),
    ]
    for row, layouts in zip(plan.rows, plan.layouts, strict=True):
        for other in layouts if split else (row,):
            c = other.config
            tp = layout_cell(*c.layout)
            devices = c.num_devices if other is row else ""
            lines.append(
                f"  {devices:>7}  " + f"{tp:>22}  " * split + f"{c.batch_size:>6}  "
                f"{c.micro_batch_size:>5}  "
                f"{'yes' if c.activation_checkpointing else 'no':>4}  "
                f"{other.confidence if other.confidence is not None else '-':>4}  "
                f"{_interval(other.samples_per_s):>28}  {_interval(other.hours):>26}  "
                f"{_interval(other.device_hours):>30}  "
                + (f"{_interval(other.cost):>30}" if other.cost is not None else "")
            )
    for n, why in plan.skipped:
        lines.append(f"  {n:>7}  no plan: {why}")
    lines.append(f"  fastest: {_pick(plan.fastest)}")
    lines.append(f"  cheapest: {_pick(plan.cheapest)}")
    lines.append(
        f"  cheapest within {p.max_slowdown:.0%} of the fastest: {_pick(plan.cheapest_within)}"
    )
    return [line.rstrip() for line in lines]


def _interval(i: Interval) -> str:
    return f"{_num(i.value)} ({_num(i.low)} to {_num(i.high)})"


def _num(x: float) -> str:
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    digits = max(0, 2 - int(math.floor(math.log10(abs(x)))))
    return f"{x:,.{digits}f}"


def _pick(row: PlanRow) -> str:
    c = row.config
    devices = f"{c.num_devices} device{'s' * (c.num_devices != 1)}"
    text = (
        f"{devices}{layout(c, ' ')}, batch_size {c.batch_size}, micro_batch_size "
        f"{c.micro_batch_size}"
        f"{', activation checkpointing' if c.activation_checkpointing else ''}"
        f": {_num(row.hours.value)} hours ({_num(row.hours.low)} to {_num(row.hours.high)}), "
        f"{_num(row.device_hours.value)} device-hours"
    )
    if row.cost is not None:
        text += f", cost {_num(row.cost.value)} ({_num(row.cost.low)} to {_num(row.cost.high)})"
    return text
