"""The plan of a split model against a generator it was not built with: bench/model_parallel.py's
Megatron landscapes (issue 40, item 7's), measured at 1 to 8 devices and planned at the
job's own 16 or 32.

bench/plan_coverage.py's model-parallel family checks the plan against a truth of the
plan's own form. This checks it against another session's: a Llama-like decoder of 7B to
70B parameters on H100s, 8 to a node, whose compute runs at an efficiency growing with
the GEMM's work (m s h / t), whose tensor-parallel all-reduces are 50 to 100% exposed and
whose data-parallel sync 20 to 100% (the rest overlapped), whose bubble stretches the
tensor-parallel and pipeline traffic as well as the compute, whose replica's stages sit
inside a node where t p <= 8 (Megatron's tp-pp-dp order, where the plan takes tp-dp-pp),
and whose memory rules out what does not fit (bench/model_parallel.py's docstring).

For each seed: every configuration of its space (t and p in 1, 2, 4, 8; gpipe, 1f1b,
interleaved_1f1b, zbv; m in 1 to 16; the job's batch) at 1, 2, 4 and 8 devices, measured
once as a replay answers (its step times 2% off the generator, a trial's drift 2%; out of
memory where the generator's peak is over its budget); seeds whose model fits in fewer
than 3 of them (the 34B and 70B mostly) are skipped. The plan (``search.noise_floor``
0.035) plans the job's device count, and its pick is compared with the generator's truth
there and with the generator's best configuration that fits.

Run: ``.venv/bin/python bench/plan_megatron.py [--first-seed 100] [--seeds 200]`` (about a
minute); writes bench/results/plan_megatron.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import model_parallel as mp  # noqa: E402
from _common import RESULTS  # noqa: E402

from mbtune.config.load import parse_experiment  # noqa: E402
from mbtune.lattice import BatchConfig, enumerate_configs, model_rule  # noqa: E402
from mbtune.plan.planner import make_plan  # noqa: E402
from mbtune.runs.record import TrialRecord  # noqa: E402

MEASURED = (1, 2, 4, 8)


def configs(job: mp.Job, counts: tuple[int, ...]) -> list[BatchConfig]:
    """The job's space (bench/model_parallel.py's layouts and sizes) at ``counts``."""
    layouts = [(t, p, s) for t in mp.TENSOR_PARALLEL for p in mp.PIPELINE_PARALLEL
               for s in (mp.SCHEDULES if p > 1 else ("1f1b",))
               if not model_rule(t, p, s, job.model.shape())]  # fmt: skip
    return enumerate_configs(mode="auto", batch_sizes=[job.batch_size], num_devices=list(counts),
                             micro_batch_sizes=mp.MICRO_BATCH_SIZES, layouts=layouts)  # fmt: skip


def experiment(job: mp.Job):
    return parse_experiment({
        "name": "megatron", "model": {"name": "mlp"},
        "train_input": {"batch_size": job.batch_size, "micro_batch_size": "auto"},
        "search": {"space": {"num_devices": list(MEASURED),
                             "micro_batch_size": list(mp.MICRO_BATCH_SIZES),
                             "tensor_parallel": list(mp.TENSOR_PARALLEL),
                             "pipeline_parallel": list(mp.PIPELINE_PARALLEL),
                             "pipeline_schedule": list(mp.SCHEDULES)},
                   "noise_floor": 0.035},
        "plan": {"samples": 1e9, "num_devices": [job.num_devices]},
    })  # fmt: skip


def measure(job: mp.Job, rng: np.random.Generator) -> list[TrialRecord]:
    records = []
    for i, c in enumerate(configs(job, MEASURED), start=1):
        layout = dict(zip(("tensor_parallel", "pipeline_parallel", "pipeline_schedule"),
                          c.layout, strict=True))  # fmt: skip
        sizes = {"batch_size": c.batch_size, "num_devices": c.num_devices,
                 "micro_batch_size": c.micro_batch_size, **layout}  # fmt: skip
        if mp.peak_bytes(job, c) > job.budget_bytes:
            records.append(TrialRecord(trial=i, status="oom", **sizes))
            continue
        drifted = mp.step_s(job, c) * math.exp(0.02 * rng.standard_normal())
        steps = drifted * np.exp(0.02 * rng.standard_normal(10))
        median = float(np.median(steps))
        records.append(TrialRecord(
            trial=i, status="ok", **sizes, samples_per_s=c.batch_size / median,
            objective=c.batch_size / median, step_time_ms_median=median * 1e3,
            step_times_ms=tuple(float(s) * 1e3 for s in steps), comm_time_ms=0.0,
            backend="replay", parallel="simulate", precision="bf16",
            tokens_per_s=c.batch_size / median * job.seq,
        ))  # fmt: skip
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--first-seed", type=int, default=100)
    parser.add_argument("--seeds", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(args.first_seed)
    rows = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        job, _ = mp.draw(seed)
        records = measure(job, rng)
        if sum(r.status == "ok" for r in records) < 3:
            continue
        plan = make_plan(experiment(job), records, grad_bytes=int(4 * job.model.parameters),
                         shape=job.model.shape(), seed=seed)  # fmt: skip
        for row in plan.rows:
            n = row.config.num_devices
            truth = row.config.batch_size / mp.step_s(job, row.config)
            best = max(c.batch_size / mp.step_s(job, c) for c in configs(job, (n,))
                       if mp.peak_bytes(job, c) <= job.budget_bytes)  # fmt: skip
            s = row.samples_per_s
            rows.append({
                "seed": seed, "model": job.model.name, "num_devices": n,
                "layout": list(row.config.layout), "micro_batch_size": row.config.micro_batch_size,
                "truth": truth, "value": s.value, "low": s.low, "high": s.high,
                "covered": s.low <= truth <= s.high, "below": truth < s.low,
                "error": s.value / truth - 1, "pick_vs_best": truth / best,
                "confidence": row.confidence,
            })  # fmt: skip
    covered = float(np.mean([r["covered"] for r in rows]))
    below = float(np.mean([r["below"] for r in rows]))
    error = float(np.median([abs(r["error"]) for r in rows]))
    bias = float(np.median([r["error"] for r in rows]))
    within = float(np.mean([r["pick_vs_best"] >= 0.95 for r in rows]))
    summary = {"plans": len(rows), "coverage": covered, "below": below,
               "above": 1 - covered - below, "median_abs_error": error,
               "median_error": bias, "pick_within_5pct": within}  # fmt: skip
    print(f"{len(rows)} plans of {args.seeds} seeds (the rest: too large to fit in 8 devices)")
    print("| plans | 90% interval holds the truth | truth below / above | median \\|error\\| | "
          "median error | pick within 5% |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    print(f"| {len(rows)} | {covered:.1%} | {below:.1%} / {1 - covered - below:.1%} | "
          f"{error:.1%} | {bias:+.1%} | {within:.1%} |")  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "plan_megatron.json"
    out.write_text(json.dumps({"first_seed": args.first_seed, "seeds": args.seeds,
                               "summary": summary, "rows": rows}, indent=1))  # fmt: skip
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
