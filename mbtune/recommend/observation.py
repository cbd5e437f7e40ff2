"""A finished trial as the models read it (:class:`Observation`), converted from its record
once (:func:`observation`). Pure: no torch, no ray.
"""

from __future__ import annotations

from dataclasses import dataclass

from mbtune.lattice import BatchConfig
from mbtune.runs.record import TrialRecord

__all__ = ["Observation", "observation"]


@dataclass(frozen=True)
class Observation:
    """One finished trial, as the models read it: the search's (the confidence math) and
    the plan's (mbtune.plan.fit), converted from its record once (:func:`observation`)."""

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
    samples_per_s: float | None = None
    """The global throughput, for ``ok`` (the plan's step time is B over it)."""
    comm_s: float | None = None
    """The step's collectives where the trial said them apart (0 on one device; modelled
    with ``simulate``; with ``ddp``, one all-reduce of the gradients, timed alone); None
    where they are folded into the step time (a replayed table's throughput)."""
    comm_timed: bool = False
    """``comm_s`` was timed (``ddp``), not modelled: a measurement of the link."""


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
    comm = None
    if record.num_devices == 1:
        comm = 0.0
    elif record.comm_time_ms is not None and record.backend != "replay":  # a replay's is folded
        comm = record.comm_time_ms / 1e3
    ok = status == "ok"
    return Observation(
        config=record.config.canonical(),
        status=status,
        value=float(value) if ok else None,
        step_times_ms=record.step_times_ms,
        oom_micro_batch_sizes=tried if status == "oom" else tried[:-1],
        samples_per_s=float(record.samples_per_s) if ok and record.samples_per_s else None,
        comm_s=comm if ok else None,
        comm_timed=ok and record.num_devices > 1 and comm is not None and record.parallel == "ddp",
    )
