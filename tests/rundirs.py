"""Run directories made by hand for the analysis tests, written by the real RunDir writer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mbtune.lattice import BatchConfig
from mbtune.runs.rundir import RunDir

EXPERIMENT = {
    "name": "handmade",
    "model": {"name": "mlp"},
    "train_input": {"batch_size": 32, "micro_batch_size": "auto", "num_devices": 1,
                    "pipeline_parallel": 1},
    "search": {"objective": "samples_per_s", "confidence_target": 90},
    "trial": {"device_memory": 512 * 2**20},
}  # fmt: skip

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def trial_row(
    batch_size: int,
    num_devices: int,
    micro_batch_size: int,
    samples_per_s: float | None = None,
    status: str = "ok",
    *,
    objective: str = "samples_per_s",
    **extra: Any,
) -> dict[str, Any]:
    """One trials.csv row with figures that agree with each other."""
    config = BatchConfig(batch_size, num_devices, micro_batch_size)
    row: dict[str, Any] = {
        **config.as_dict(),
        "status": status,
        "pipeline_parallel": 1,
        "micro_batch_sizes_tried": [micro_batch_size],
        "peak_memory_bytes": 100 * 2**20 + micro_batch_size * 2**20,
        "objective": 0.0,
        "wall_s": 1.5,
        "finished_at": "2026-11-21T19:41:11",
        "reason": None if status == "ok" else f"{status} for the test",
    }
    if samples_per_s is not None:  # also a CPU oom: measured, but over the memory budget
        step_ms = batch_size / samples_per_s * 1e3
        comm_ms = 0.1 * (num_devices - 1)
        row.update(
            samples_per_s=samples_per_s,
            samples_per_s_per_device=samples_per_s / num_devices,
            step_time_ms_median=step_ms,
            step_time_ms_iqr=0.02 * step_ms,
            compute_time_ms=step_ms - comm_ms,
            comm_time_ms=comm_ms,
            bubble_time_ms=0.0,
            compile_s=2.5,
            step_times_ms=[step_ms * 0.99, step_ms, step_ms * 1.01],
            objective=samples_per_s / (num_devices if objective != "samples_per_s" else 1)
            if status == "ok"
            else 0.0,
        )
    row.update(extra)
    return row


def make_run(
    root: Path,
    rows: list[dict[str, Any]],
    *,
    name: str = "handmade-20261121-194111",
    experiment: dict[str, Any] | None = None,
    summary: dict[str, Any] | None = None,
    recommendations: list[dict[str, Any]] | None = None,
) -> Path:
    """A run directory holding ``rows`` as its finished trials (and, if given, a summary
    and a recommendation stream)."""
    run = RunDir(Path(root) / name)
    run.path.mkdir(parents=True)
    run.write_experiment(experiment or EXPERIMENT)
    for i, row in enumerate(rows, start=1):
        run.append_trial({"trial": i, "trial_id": f"t{i:04d}", **row})
    if summary is not None:
        run.write_json("summary.json", summary)
    if recommendations is not None:
        with (run.path / "recommendations.jsonl").open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recommendations)
    return run.path


def recommendation_record(trials: int, n: int, m: int, b: int, speed: float, confidence: int):
    return {
        "time": "2026-11-21T19:41:11", "trials": trials, "micro_batch_size": m,
        "num_devices": n, "batch_size": b, "samples_per_s": speed,
        "estimated_performance": round(speed / 100, 2), "confidence": confidence,
    }  # fmt: skip


FINISHED_ROWS = [
    trial_row(32, 1, 4, 300.0),
    trial_row(32, 2, 8, 630.0),
    trial_row(32, 2, 16, status="oom", peak_memory_bytes=700 * 2**20),
    trial_row(32, 1, 8, 320.0),
    trial_row(32, 2, 4, 590.0),
    trial_row(32, 1, 32, status="error", peak_memory_bytes=None),
]
"""A small finished run: the best is 2 devices x micro-batch 8 (630 samples/s)."""


def finished_run(root: Path, **kwargs: Any) -> Path:
    recs = [
        recommendation_record(1, 1, 4, 32, 300.0, 10),
        recommendation_record(2, 2, 8, 32, 630.0, 40),
        recommendation_record(5, 2, 8, 32, 630.0, 92),
    ]
    kwargs.setdefault("recommendations", recs)
    kwargs.setdefault(
        "summary",
        {
            "status": "confident",
            "recommended": {"batch_size": 32, "num_devices": 2, "micro_batch_size": 8,
                            "grad_accum_steps": 2, "samples_per_s": 630.0},
            "confidence": 92,
            "recommended_batch_size": 32,
        },
    )  # fmt: skip
    return make_run(root, FINISHED_ROWS, **kwargs)
