"""The reporter: after every finished trial, what to use, how much faster, how sure.

Pure (neither torch nor ray): the search's Tune callback passes the run's trial records
(mbtune.runs.record) to :meth:`Reporter.update`, prints the line of the recommendation it
returns and appends its record to ``recommendations.jsonl``; at the end
:meth:`Reporter.summary` gives ``summary.json``.

    mbtune 19:41:11  recommended micro_batch_size: 4 (num_devices: 2, batch_size: 64),
    estimated performance: 1.23x base, confidence score: 90 (out of 100)

Base is the run's first recommendation (as Cerebras does), which the stream says in a
line under it (not the user's own configuration, which the summary compares with); the
estimated performance is the model's estimate of the recommended configuration's objective
over its estimate of base's, both as of now: the estimates the recommendation and the
table of the best rank by (:func:`_estimated`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mbtune import lattice
from mbtune.lattice import BatchConfig
from mbtune.recommend.confidence import Assessment, SearchModel
from mbtune.recommend.observation import observation
from mbtune.report import base_line, stream_line, tie_line
from mbtune.runs.record import TrialRecord

__all__ = ["Pooled", "Reporter", "StreamRecommendation", "in_order", "per_config", "ranking"]


@dataclass(frozen=True)
class StreamRecommendation:
    """The recommendation after a trial, as the search streams it: one line of the stream
    and one record of recommendations.jsonl (how much faster than the stream's first,
    how sure). Not :class:`mbtune.analysis.frames.RunRecommendation`, which is what a
    finished run recommends as ``mbtune analyze`` reads it back."""

    time: str
    trials: int
    config: BatchConfig
    objective: float
    samples_per_s: float | None
    estimated_performance: float
    confidence: int
    precision: str | None = None
    """The arithmetic the recommended configuration was measured with."""
    sharding: str | None = None
    """``fsdp`` where the trials shard (its settings are then named); None: they do not."""
    mfu: float | None = None
    tie: dict[str, Any] | None = None
    """Where the search cannot tell its contenders apart: the tie's record
    (mbtune.recommend.tie.Tie), which stops it."""
    drift: float | None = None
    """The relative drift between trials the score allowed for."""
    ranking: tuple[dict[str, Any], ...] = ()
    """Every configuration measured ok, best first as the recommendation ranks them
    (:func:`ranking`): what ``mbtune watch`` and ``mbtune analyze`` rank by."""
    opens: bool = False
    """The run's first recommendation: base, which its line says."""
    yours: bool | None = None
    """Whether it is the user's own configuration (None: the experiment fixes none)."""

    def record(self) -> dict[str, Any]:
        return {
            "time": self.time,
            "trials": self.trials,
            **self.config.sizes(),
            "samples_per_s": self.samples_per_s,
            "objective": self.objective,
            "estimated_performance": self.estimated_performance,
            "confidence": self.confidence,
            "precision": self.precision,
            **({"sharding": self.sharding} if self.sharding else {}),
            "mfu": self.mfu,
            **({"tie": self.tie} if self.tie else {}),
            "ranking": list(self.ranking),
        }

    def line(self) -> str:
        """The stream's line, below it what base is where it opens the run, and the tie
        where there is one."""
        line = stream_line(
            made_at=self.time,
            config=self.config,
            estimated_performance=self.estimated_performance,
            confidence=self.confidence,
            precision=self.precision,
            mfu=self.mfu,
            sharding=self.sharding,
        )
        base = f"\n{base_line(self.yours)}" if self.opens else ""
        return line + base + (f"\nmbtune: {tie_line(self.tie, self.drift)}" if self.tie else "")


class Reporter:
    """Turns a run's finished trials into its recommendation, stream and summary.

    It keeps no history of its own: the run directory's recommendations.jsonl is the
    history (its first record is base), so a resumed run, or a restored copy of this
    object, carries on where the stream left off.
    """

    def __init__(
        self,
        model: SearchModel | Sequence[BatchConfig],
        *,
        user_config: BatchConfig | None = None,
        user_batch_size: int | None = None,
    ) -> None:
        """``model``: the search's model (confidence.SearchModel), which the searcher
        proposes with; or the space alone, for a model with its defaults."""
        if not isinstance(model, SearchModel):
            model = SearchModel(tuple(sorted({p.canonical() for p in model})))
        self.model = model
        self.user_config = user_config
        self.user_batch_size = user_batch_size

    def assess(self, records: Sequence[TrialRecord]) -> Assessment:
        return self.model.assess([observation(r) for r in records])

    def update(
        self, records: Sequence[TrialRecord], history: Sequence[Mapping[str, Any]] = ()
    ) -> StreamRecommendation | None:
        """The recommendation after ``records`` (every finished trial so far), or None yet.

        ``history`` is the stream so far (records); its first one is base."""
        a = self.assess(records)
        if a.recommended is None or a.value is None:
            return None
        value = _estimated(a, a.recommended, a.value)
        base = _base(history, a) or value
        pooled = per_config(records)
        best, user = pooled[a.recommended].record, self.user_config
        rec = StreamRecommendation(
            time=time.strftime("%Y-%m-%dT%H:%M:%S"),
            trials=len(records),
            config=a.recommended,
            objective=a.value,
            samples_per_s=_float(best.samples_per_s),
            estimated_performance=round(value / base, 2),
            confidence=a.confidence,
            precision=best.precision,
            sharding="fsdp" if self.model.sharded else None,
            mfu=_float(best.mfu),
            tie=a.tie.record() if a.tie else None,
            drift=a.drift,
            ranking=tuple(ranking(in_order(pooled, a), a)),
            opens=not history,
            yours=None if user is None else a.recommended == user.canonical(),
        )
        return rec

    def summary(
        self,
        records: Sequence[TrialRecord],
        status: str,
        history: Sequence[Mapping[str, Any]] = (),
    ) -> dict[str, Any]:
        """The end of the run: recommendation, speed-ups, top five, batch size, break-even."""
        a = self.assess(records)
        base = _base(history, a)
        out: dict[str, Any] = {"status": status, "trials": len(records), "recommended": None}
        pooled = per_config(records)
        ok = in_order(pooled, a)
        out["top"] = [_brief(p, a) for p in ok[:5]]
        out["ranking"] = ranking(ok, a)
        if a.recommended is None:
            return out
        best = pooled[a.recommended]
        value = _estimated(a, a.recommended, a.value)  # as the stream's recommendation has it
        user = pooled.get(self.user_config.canonical()) if self.user_config else None
        user_value = (
            _estimated(a, user.record.config.canonical(), _float(user.record.objective))
            if user
            else None
        )
        out.update(
            recommended=_brief(best, a),
            confidence=a.confidence,
            tie=a.tie.record() if a.tie else None,
            speedup_over_base=round(value / base, 3) if base else 1.0,
            user_config=self.user_config.sizes() if self.user_config else None,
            speedup_over_user=round(value / user_value, 3) if user_value else None,
            recommended_batch_size=self.recommended_batch_size(a.recommended),
            compile_break_even=_break_even(best, ok[:5], a),
            drift={
                "relative": round(a.drift, 4),
                "repeats": a.drift_dof,
                "prior": self.model.noise_floor,
            },
        )
        return out

    def recommended_batch_size(self, c: BatchConfig) -> int:
        """The strictly valid batch size for (n, m) nearest the user's (ties: the larger)."""
        wanted = self.user_batch_size or c.batch_size
        below, above = lattice.nearest_valid_batch_sizes(wanted, c.num_devices, c.micro_batch_size)
        if below is None or above - wanted <= wanted - below:
            return above
        return below


def _base(history: Sequence[Mapping[str, Any]], a: Assessment) -> float | None:
    """Base: the run's first recommendation (the stream's first record), as the model now
    estimates it."""
    if not history:
        return None
    first = history[0]
    try:
        config = BatchConfig.from_mapping(first).canonical()
    except (KeyError, TypeError, ValueError, lattice.LatticeError):  # a record without sizes
        return float(first["objective"])
    return _estimated(a, config, float(first["objective"]))


def _estimated(a: Assessment, c: BatchConfig, measured: float | None) -> float | None:
    """The model's estimate of ``c``'s objective, what the recommendation ranks by; its
    ``measured`` objective (every look pooled) where the model has none, as for a
    configuration that can no longer win."""
    return a.estimate.get(c, measured)


def _break_even(best: Pooled, top: Sequence[Pooled], a: Assessment) -> list[dict[str, Any]]:
    """For each top configuration that compiles faster than the recommendation: the
    training steps after which the recommendation's higher throughput (as the model
    estimates both, where it does) has paid back its longer compile (None: it never does,
    as the other is not slower). Like with like: a compile time whose graphs came from
    torch's compile cache is weighed against another such only (a cold compile against a
    load would count the cache's saving as the configuration's)."""
    out: list[dict[str, Any]] = []
    compile_best, speed_best = _float(best.record.compile_s), _speed(best, a)
    if compile_best is None or not speed_best:
        return out
    cached = bool(best.record.compile_from_cache)
    for other in top:
        r = other.record
        compile_other, speed_other = _float(r.compile_s), _speed(other, a)
        if other is best or compile_other is None or not speed_other:
            continue
        if bool(r.compile_from_cache) != cached:
            continue
        extra_s = compile_best - compile_other
        if extra_s <= 0:
            continue
        saved_per_sample_s = 1 / speed_other - 1 / speed_best
        steps = (
            math.ceil(extra_s / saved_per_sample_s / best.record.batch_size)
            if saved_per_sample_s > 0
            else None
        )
        out.append({"against": _brief(other), "extra_compile_s": round(extra_s, 2),
                    "break_even_steps": steps})  # fmt: skip
    return out


def _rank(p: Pooled, a: Assessment) -> tuple:
    """The table of the best configurations in the order of the recommendation: the
    recommendation first (a tie's members in the tie's order), then by the model's
    estimate (the measured objective where it has none)."""
    c = p.record.config.canonical()
    if a.tie is not None and c in a.tie.members:
        return (0, a.tie.members.index(c))
    if c == a.recommended:
        return (0, 0)
    return (1, -a.estimate.get(c, p.record.objective))


def in_order(pooled: Mapping[BatchConfig, Pooled], a: Assessment) -> list[Pooled]:
    """The one order of "best": every configuration measured ok (:func:`per_config`), the
    recommendation first (a tie's members in the tie's order), then by the model's
    estimate (:func:`_rank`)."""
    return sorted(pooled.values(), key=lambda p: _rank(p, a))


def ranking(ordered: Sequence[Pooled], a: Assessment) -> list[dict[str, Any]]:
    """The ranking the stream's records and summary.json carry, which ``mbtune watch``,
    ``mbtune analyze`` and the frame's helpers read back: the configurations of
    :func:`in_order`, each with its sizes, the model's estimate of its samples/s, its
    measurements pooled (geometric mean) and how many there were."""
    return [
        {
            **p.record.config.canonical().sizes(),
            "estimated_samples_per_s": _estimated_samples_per_s(p, a),
            "samples_per_s": _float(p.record.samples_per_s),
            "measurements": p.measurements,
        }
        for p in ordered
    ]


def _estimated_samples_per_s(p: Pooled, a: Assessment | None) -> float | None:
    """The model's estimate of a configuration's samples/s (its estimate of the
    objective, in samples/s): what the table ranks by."""
    r, estimate = p.record, (a.estimate if a else {}).get(p.record.config.canonical())
    if estimate is None or not r.samples_per_s or not r.objective:
        return None
    return round(r.samples_per_s * estimate / r.objective, 3)


def _speed(p: Pooled, a: Assessment) -> float | None:
    """A configuration's samples/s as the model estimates it, or as measured (pooled)."""
    return _estimated_samples_per_s(p, a) or _float(p.record.samples_per_s)


def _brief(p: Pooled, a: Assessment | None = None) -> dict[str, Any]:
    r = p.record
    return {
        **r.config.sizes(),
        "grad_accum_steps": r.grad_accum_steps or None,
        "samples_per_s": _float(r.samples_per_s),
        "estimated_samples_per_s": _estimated_samples_per_s(p, a),
        "objective": _float(r.objective),
        "compile_s": _float(r.compile_s),
        "compile_from_cache": bool(r.compile_from_cache),
        "mfu": _float(r.mfu),
        "peak_memory_bytes": int(r.peak_memory_bytes) if r.peak_memory_bytes is not None else None,
        "precision": r.precision,
        "measurements": p.measurements,
    }


def _float(value: float | None) -> float | None:
    """A figure as summary.json and the stream write it: a float (also where a record read
    back from trials.csv holds a whole number), or None where it was not measured."""
    return None if value is None else float(value)


@dataclass(frozen=True)
class Pooled:
    """A configuration's ok trials as one (:func:`per_config`)."""

    record: TrialRecord
    """The last one's record, its throughput (samples/s, objective, TFLOP/s, MFU) the
    geometric mean over all of them and its compile time the longest of those that
    compiled: a look that loaded every graph from torch's on-disk cache (a second look, or
    a shape another configuration compiled) took less than a cold compile, and counts only
    where no look compiled (``compile_from_cache``)."""
    measurements: int
    """How many ok trials measured it."""


_POOLED = ("samples_per_s", "objective", "tflops_per_s", "mfu")


def per_config(records: Sequence[TrialRecord]) -> dict[BatchConfig, Pooled]:
    """Each configuration's ok trials pooled as one, by canonical configuration."""
    groups: dict[BatchConfig, list[TrialRecord]] = {}
    for r in records:
        o = observation(r)
        if o.status == "ok":
            groups.setdefault(o.config, []).append(r)
    out: dict[BatchConfig, Pooled] = {}
    for config, group in groups.items():
        means = {}
        for key in _POOLED:
            values = [v for v in (getattr(r, key) for r in group) if v]
            if values:
                means[key] = statistics.geometric_mean(values)
        looks = [r for r in group if r.compile_s is not None]
        compiled = [r for r in looks if not r.compile_from_cache] or looks
        if compiled:
            means["compile_s"] = max(r.compile_s for r in compiled)  # type: ignore[type-var]
            means["compile_from_cache"] = all(r.compile_from_cache for r in compiled)
        out[config] = Pooled(dataclasses.replace(group[-1], **means), len(group))
    return out
