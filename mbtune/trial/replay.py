"""The replay backend: a trial answered from a table of measured throughputs.

``trial.backend: replay`` reads ``trial.table`` (a CSV) once per process and answers each
configuration from its row: the throughput as step times, with seeded relative noise per
step (``trial.noise``) and one seeded factor per trial (``trial.drift``, as a real machine
drifts between trials), and the row's status and peak memory, held to the memory budget
as a measured trial is. Searches, tests and benchmarks replay landscapes in milliseconds.
"""

from __future__ import annotations

import csv
import dataclasses
import random
import threading
from pathlib import Path
from typing import Any

from mbtune.config.experiment import Experiment
from mbtune.config.trial import STATUSES
from mbtune.errors import MbtuneError
from mbtune.lattice import LAYOUT, SETTINGS, BatchConfig
from mbtune.progress import PhaseHook
from mbtune.trial.measure import Measurement, no_phase
from mbtune.trial.memory import over_budget, reason_line

__all__ = ["ReplayTable", "replay"]


class ReplayTable:
    """Measured throughputs read from a CSV: batch_size, num_devices, micro_batch_size,
    samples_per_s, and optionally peak_memory_bytes, status, the settings of a step
    (activation_checkpointing and reshard_after_forward: true/false; grad_sync: last or
    every), the layout (tensor_parallel, pipeline_parallel, pipeline_schedule; each value a
    configuration of its own, an empty cell the default) and precision (what was
    measured). A trials.csv is such a table."""

    REQUIRED = ("batch_size", "num_devices", "micro_batch_size", "samples_per_s")
    OPTIONAL = ("peak_memory_bytes", "status", *SETTINGS, *LAYOUT, "precision")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: dict[BatchConfig, dict[str, Any]] = {}
        self.measured: dict[BatchConfig, dict[str, Any]] = {}
        """The rows by the measurement each is (``BatchConfig.canonical``)."""
        try:
            with path.open(newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                missing = [c for c in self.REQUIRED if c not in (reader.fieldnames or [])]
                if missing:
                    raise MbtuneError(
                        f"trial.table: {path} lacks the column(s) {', '.join(missing)}; it needs "
                        f"{', '.join(self.REQUIRED)} (optional: {', '.join(self.OPTIONAL)})"
                    )
                for line, row in enumerate(reader, start=2):
                    self._add(row, line)
        except OSError as e:
            raise MbtuneError(f"trial.table: cannot read {path}: {e.strerror}") from None
        except (UnicodeDecodeError, csv.Error) as e:
            raise MbtuneError(f"trial.table: {path} is not a CSV file ({e})") from None

    def _add(self, row: dict[str, str], line: int) -> None:
        try:
            config = BatchConfig.from_mapping(row)
            status = (row.get("status") or "ok").strip()
            speed = float(row["samples_per_s"]) if row["samples_per_s"] not in ("", None) else None
            peak = row.get("peak_memory_bytes")
            entry = {
                "precision": (row.get("precision") or "").strip() or None,
                "status": status,
                "samples_per_s": speed,
                "peak_memory_bytes": int(float(peak)) if peak not in ("", None) else None,
            }
        except (TypeError, ValueError) as e:
            raise MbtuneError(f"trial.table: {self.path} line {line}: {reason_line(e)}") from None
        if status not in STATUSES or (status == "ok" and (speed is None or speed <= 0)):
            raise MbtuneError(
                f"trial.table: {self.path} line {line}: status {status!r} with samples_per_s "
                f"{row['samples_per_s']!r}; status must be one of {', '.join(STATUSES)}, and "
                "an ok row needs a positive samples_per_s"
            )
        self.rows[config] = entry
        self.measured.setdefault(config.canonical(), entry)

    def lookup(self, config: BatchConfig) -> dict[str, Any]:
        row = self.rows.get(config) or self.measured.get(config.canonical())
        if row is None:
            raise MbtuneError(
                f"trial.table: {self.path} has no row for batch_size {config.batch_size}, "
                f"num_devices {config.num_devices}, micro_batch_size {config.micro_batch_size}"
                + "".join(
                    f", {k} {str(v).lower()}"
                    for k, v in config.sizes().items()
                    if k in SETTINGS or k in LAYOUT
                )
                + f"; it holds {len(self.rows)} configurations"
            )
        return row


_TABLES: dict[Path, ReplayTable] = {}
_TABLES_LOCK = threading.Lock()


def replay(
    exp: Experiment, config: BatchConfig, *, repeat: int = 0, on_phase: PhaseHook = no_phase
) -> Measurement:
    """Answer ``config`` from ``trial.table``: its throughput as step times, with
    ``trial.noise`` per step and ``trial.drift`` per trial; its status and peak memory,
    held to the memory budget. ``repeat``: which measurement of the configuration this is
    (0: its first)."""
    on_phase("replaying", 0, 0)
    tr = exp.trial
    assert tr.table is not None  # checked when the experiment was parsed
    with _TABLES_LOCK:
        table = _TABLES.get(tr.table) or _TABLES.setdefault(tr.table, ReplayTable(tr.table))
    row = table.lookup(config)
    peak = row["peak_memory_bytes"]
    base = Measurement(
        config=config, device="replay", peak_memory_bytes=peak, precision=row["precision"]
    )
    if row["status"] != "ok":
        return dataclasses.replace(base, status=row["status"], reason="as recorded in the table")
    over = over_budget(tr, tr.device_memory, peak)
    if over:
        return dataclasses.replace(base, status="oom", reason=over)
    step_s = config.batch_size / row["samples_per_s"] * _drift(exp, config, repeat)
    rng = _step_noise_rng(exp.search.seed, config, repeat)
    steps = [step_s * max(0.05, 1 + tr.noise * rng.gauss(0, 1)) for _ in range(tr.measure_steps)]
    # whole steps, as the table measured them: nothing to model, nothing compiled
    return dataclasses.replace(base, step_s=tuple(steps), compute_s=tuple(steps), comm_s=())


def _step_noise_rng(seed: int, config: BatchConfig, repeat: int) -> random.Random:
    """The step noise of one replayed trial: seeded per configuration and repeat, so a
    replayed trial is repeatable whatever ran before it, and a repeat draws afresh. A first
    measurement keeps the seed it always had (tests and benchmarks pin its step times)."""
    sizes = (seed, config.batch_size, config.num_devices, config.micro_batch_size)
    sizes += tuple(v for k, v in config.sizes().items() if k in LAYOUT)  # where split
    return random.Random(hash((*sizes, repeat) if repeat else sizes))


def _drift(exp: Experiment, config: BatchConfig, repeat: int) -> float:
    """The one factor every step of a replayed trial is multiplied by (``trial.drift``), as
    a real machine drifts between trials. From an rng of its own, seeded by text (stable
    across processes, unlike hash() of text), so drift 0 leaves the step noise's draws as
    they were."""
    if not exp.trial.drift:
        return 1.0
    rng = random.Random(
        f"drift/{exp.search.seed}/{config.batch_size}/{config.num_devices}/"
        f"{config.micro_batch_size}/{config.activation_checkpointing}/{repeat}"
        # sharded settings only where not the default: other tables keep their draws
        + "".join(
            f"/{k}={v}" for k, v in config.sizes().items() if k in SETTINGS[1:] or k in LAYOUT
        )  # fmt: skip
    )
    return max(0.05, 1 + exp.trial.drift * rng.gauss(0, 1))
