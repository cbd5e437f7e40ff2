"""The reporter: after every finished trial, what to use, how much faster, how sure.

Pure (neither torch nor ray): the search's Tune callback passes trials.csv rows through
:meth:`Reporter.update`, prints the line it returns and appends its record to
``recommendations.jsonl``; at the end :meth:`Reporter.summary` gives ``summary.json``.

    mbtune 19:41:11  recommended micro_batch_size: 4 (num_devices: 2, batch_size: 64),
    estimated performance: 1.23x base, confidence score: 90 (out of 100)

Base is the objective of the run's first recommendation (as Cerebras does); the
estimate is the recommended configuration's measured objective over base.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mbtune import lattice
from mbtune.lattice import BatchConfig
from mbtune.recommend.confidence import Assessment, SearchModel, as_number, observation
from mbtune.report import stream_line

__all__ = ["Recommendation", "Reporter", "per_config"]

Row = Mapping[str, Any]


@dataclass(frozen=True)
class Recommendation:
    """One line of the stream (and one record of recommendations.jsonl)."""

    time: str
    trials: int
    config: BatchConfig
    objective: float
    samples_per_s: float | None
    estimated_performance: float
    confidence: int
    precision: str | None = None
    """The arithmetic the recommended configuration was measured with."""
    mfu: float | None = None

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
            "mfu": self.mfu,
        }

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Recommendation:
        return cls(
            time=record["time"],
            trials=int(record["trials"]),
            config=BatchConfig.from_mapping(record),
            objective=float(record["objective"]),
            samples_per_s=record.get("samples_per_s"),
            estimated_performance=float(record["estimated_performance"]),
            confidence=int(record["confidence"]),
            precision=record.get("precision"),
            mfu=as_number(record.get("mfu")),
        )

    def line(self) -> str:
        return stream_line(self)


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

    def assess(self, rows: Sequence[Row]) -> Assessment:
        return self.model.assess([o for o in map(observation, rows) if o is not None])

    def update(
        self, rows: Sequence[Row], history: Sequence[Mapping[str, Any]] = ()
    ) -> Recommendation | None:
        """The recommendation after ``rows`` (every finished trial so far), or None yet.

        ``history`` is the stream so far (records); its first one is base."""
        a = self.assess(rows)
        if a.recommended is None or a.value is None:
            return None
        base = _base(history) or a.value
        best = per_config(rows)[a.recommended]
        rec = Recommendation(
            time=time.strftime("%Y-%m-%dT%H:%M:%S"),
            trials=len(rows),
            config=a.recommended,
            objective=a.value,
            samples_per_s=as_number(best.get("samples_per_s")),
            estimated_performance=round(a.value / base, 2),
            confidence=a.confidence,
            precision=best.get("precision") or None,
            mfu=as_number(best.get("mfu")),
        )
        return rec

    def summary(
        self, rows: Sequence[Row], status: str, history: Sequence[Mapping[str, Any]] = ()
    ) -> dict[str, Any]:
        """The end of the run: recommendation, speed-ups, top five, batch size, break-even."""
        a = self.assess(rows)
        base = _base(history)
        out: dict[str, Any] = {"status": status, "trials": len(rows), "recommended": None}
        pooled = per_config(rows)
        ok = sorted(pooled.values(), key=lambda r: -float(r["objective"]))
        out["top"] = [_brief(r) for r in ok[:5]]
        if a.recommended is None:
            return out
        best = pooled[a.recommended]
        value = a.value  # every look pooled, as the stream's recommendation has it
        user = pooled.get(self.user_config.canonical(), {}) if self.user_config else {}
        user_value = as_number(user.get("objective"))
        out.update(
            recommended=_brief(best),
            confidence=a.confidence,
            speedup_over_base=round(value / base, 3) if base else 1.0,
            user_config=self.user_config.sizes() if self.user_config else None,
            speedup_over_user=round(value / user_value, 3) if user_value else None,
            recommended_batch_size=self.recommended_batch_size(a.recommended),
            compile_break_even=_break_even(best, ok[:5]),
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


def _base(history: Sequence[Mapping[str, Any]]) -> float | None:
    return float(history[0]["objective"]) if history else None


def _break_even(best: Row, top: Sequence[Row]) -> list[dict[str, Any]]:
    """For each top configuration that compiles faster than the recommendation: the
    training steps after which the recommendation's higher throughput has paid back its
    longer compile (None: it never does, as the other is not slower)."""
    out = []
    compile_best = as_number(best.get("compile_s"))
    speed_best = as_number(best.get("samples_per_s"))
    if compile_best is None or not speed_best:
        return out
    for other in top:
        compile_other = as_number(other.get("compile_s"))
        speed_other = as_number(other.get("samples_per_s"))
        if other is best or compile_other is None or not speed_other:
            continue
        extra_s = compile_best - compile_other
        if extra_s <= 0:
            continue
        saved_per_sample_s = 1 / speed_other - 1 / speed_best
        steps = (
            math.ceil(extra_s / saved_per_sample_s / int(best["batch_size"]))
            if saved_per_sample_s > 0
            else None
        )
        out.append({"against": _brief(other), "extra_compile_s": round(extra_s, 2),
                    "break_even_steps": steps})  # fmt: skip
    return out


def _brief(row: Row) -> dict[str, Any]:
    peak = as_number(row.get("peak_memory_bytes"))
    return {
        **BatchConfig.from_mapping(row).sizes(),
        "grad_accum_steps": int(row["grad_accum_steps"]) if row.get("grad_accum_steps") else None,
        **{k: as_number(row.get(k)) for k in ("samples_per_s", "objective", "compile_s", "mfu")},
        "peak_memory_bytes": int(peak) if peak is not None else None,
        "precision": row.get("precision") or None,
        "measurements": int(row.get("measurements") or 1),
    }


def per_config(rows: Sequence[Row]) -> dict[BatchConfig, Row]:
    """Each configuration's ok trials as one row: the last one's fields, its throughput
    (samples/s, objective, TFLOP/s, MFU) the geometric mean over its ``measurements``."""
    groups: dict[BatchConfig, list[Row]] = {}
    for row in rows:
        o = observation(row)
        if o is not None and o.status == "ok":
            groups.setdefault(o.config, []).append(row)
    out: dict[BatchConfig, Row] = {}
    for config, group in groups.items():
        pooled = {**group[-1], "measurements": len(group)}
        for key in ("samples_per_s", "objective", "tflops_per_s", "mfu"):
            values = [v for v in (as_number(r.get(key)) for r in group) if v]
            if values:
                pooled[key] = statistics.geometric_mean(values)
        out[config] = pooled
    return out
