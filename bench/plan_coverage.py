"""Honest intervals, measured: `mbtune plan`'s 90% intervals against a known cluster.

Method (issue 28, item 4). Each landscape is a two-tier cluster drawn at random:

- a model of P parameters (log-uniform, 20M to 2B; its fp32 gradient is 4 P bytes);
- a device whose seconds per micro-batch of m samples follow a power law the plan does
  not assume, c(m) = t0 + t1 x m^p: t0 log-uniform 0.3 to 5 ms, t1 from 6 P x 512 tokens
  of FLOPs per sample at 40% of 400 TFLOP/s (x 0.5 to 2), p uniform 0.8 to 1.1; an
  out-of-memory cliff above a micro-batch of 8, 16, 32 or 64;
- links drawn about the plan's default figures with the spread the prior claims
  (lognormal, sd 0.3): intra-node 370 GB/s and 5 us, inter-node 45 GB/s and 10 us per
  device, 8 devices a node;
- measurement noise: each step of 10 timed ones off by a lognormal of sd 1 to 5%
  (uniform), and each trial by a drift of sd 0 to 4% (uniform), the median step kept.

The generator's step time is g x c(m) + the two-tier ring all-reduce of 4 P bytes (the
plan's own form of the collectives: what is checked is the fit and the intervals, not
the ring model against NCCL). "mbtune measures at most 8 devices": every configuration of
the space (batch_size B of 512, 1024 or 2048, every micro-batch size from 1 to 64 the
split allows) at 1, 2, 4 and 8 devices, once, as a replayed table answers: the collectives
folded into each step time, as a search that measured its whole space would see them. The
plan (defaults; ``search.noise_floor`` 0.035, a real run's) then plans 64 and 256 devices,
and each row is compared with the generator's truth for the configuration it picked: does
its 90% interval of samples/s hold the truth, and is the pick within 5% of the truly best
configuration at that count?

``--family slow`` draws both tiers' links 5 to 50x slower than the prior's figures
(log-uniform; latencies as many times longer): a fabric far from the defaults, whose
collectives the step times show (8 devices barely faster than 4), where the plan must let
the measurements overrule its prior. ``--measured search`` measures a search's share of
the space (a third of it, at least one configuration at each count) instead of all of it.

Run: ``.venv/bin/python bench/plan_coverage.py [--landscapes 300] [--seed S] [--family
prior|slow] [--measured all|search]`` (a minute or two). Writes
bench/results/plan_coverage[_FAMILY][_MEASURED][_seedS].json and docs/img/plan-coverage*.png.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mbtune.config.load import parse_experiment  # noqa: E402
from mbtune.lattice import BatchConfig  # noqa: E402
from mbtune.plan.planner import make_plan  # noqa: E402
from mbtune.runs.record import TrialRecord  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FIGURE = Path(__file__).resolve().parent.parent / "docs" / "img" / "plan-coverage.png"
MEASURED = (1, 2, 4, 8)
PLANNED = (64, 256)
STEPS = 10


def landscape(rng: np.random.Generator, family: str = "prior") -> dict:
    params = math.exp(rng.uniform(math.log(20e6), math.log(2e9)))
    # "slow": a fabric 5 to 50x slower than the prior's figures (log-uniform), both tiers
    slow = math.exp(rng.uniform(math.log(5), math.log(50))) if family == "slow" else 1.0
    per_sample = 6 * params * 512 / (0.4 * 400e12) * math.exp(rng.uniform(-0.7, 0.7))
    return {
        "grad_bytes": int(4 * params),
        "t0": math.exp(rng.uniform(math.log(3e-4), math.log(5e-3))),
        "t1": per_sample,
        "p": rng.uniform(0.8, 1.1),
        "max_m": int(rng.choice([8, 16, 32, 64])),
        "batch": int(rng.choice([512, 1024, 2048])),
        "intra": (370e9 / slow * math.exp(0.3 * rng.standard_normal()),
                  5e-6 * slow * math.exp(0.3 * rng.standard_normal())),
        "inter": (45e9 / slow * math.exp(0.3 * rng.standard_normal()),
                  10e-6 * slow * math.exp(0.3 * rng.standard_normal())),
        "step_sd": rng.uniform(0.01, 0.05),
        "drift": rng.uniform(0.0, 0.04),
    }  # fmt: skip


def true_step_s(world: dict, config: BatchConfig) -> float:
    """The generator's step: the compute, then a ring all-reduce of the gradients over two
    tiers of 8 devices a node (written out here, apart from the code it checks)."""
    m = config.canonical_micro_batch_size
    compute = config.grad_accum_steps * (world["t0"] + world["t1"] * m ** world["p"])
    n = config.num_devices
    if n == 1:
        return compute
    (intra_bw, intra_lat), (inter_bw, inter_lat) = world["intra"], world["inter"]
    bandwidth, latency = (intra_bw, intra_lat) if n <= 8 else (
        min(intra_bw, 8 * inter_bw), max(intra_lat, inter_lat))
    return compute + 2 * ((n - 1) / n * world["grad_bytes"] / bandwidth + (n - 1) * latency)


def experiment(world: dict, devices: tuple[int, ...]):
    return parse_experiment({
        "name": "coverage",
        "model": {"name": "mlp"},
        "train_input": {"batch_size": world["batch"], "micro_batch_size": "auto"},
        "search": {"space": {"num_devices": list(devices),
                             "micro_batch_size": {"min": 1, "max": 64}},
                   "noise_floor": 0.035},
        "plan": {"samples": 1e9, "num_devices": list(PLANNED)},
    })  # fmt: skip


def measure(world: dict, rng: np.random.Generator, chosen: np.random.Generator | None = None
            ) -> list[TrialRecord]:
    """Every configuration of the space at the measured counts, as a replay answers; with
    ``chosen``, a search's share of them instead: each a third of the time (drawn from
    ``chosen``, apart from the measurements' draws), at least one at each device count."""
    configs = experiment(world, MEASURED).configs()
    if chosen is not None:
        keep = chosen.random(len(configs)) < 1 / 3
        for n in MEASURED:
            at = [i for i, c in enumerate(configs) if c.num_devices == n]
            keep[at[int(chosen.integers(len(at)))]] = True
        configs = [c for c, k in zip(configs, keep, strict=True) if k]
    records = []
    for i, c in enumerate(configs, start=1):
        if c.canonical_micro_batch_size > world["max_m"]:
            records.append(TrialRecord(trial=i, status="oom", batch_size=c.batch_size,
                                       num_devices=c.num_devices,
                                       micro_batch_size=c.micro_batch_size))  # fmt: skip
            continue
        drifted = true_step_s(world, c) * math.exp(world["drift"] * rng.standard_normal())
        steps = drifted * np.exp(world["step_sd"] * rng.standard_normal(STEPS))
        median = float(np.median(steps))
        q1, q3 = np.percentile(steps, [25, 75])
        records.append(
            TrialRecord(
                trial=i, status="ok", batch_size=c.batch_size, num_devices=c.num_devices,
                micro_batch_size=c.micro_batch_size, pipeline_stages=1,
                samples_per_s=c.batch_size / median, objective=c.batch_size / median,
                step_time_ms_median=median * 1e3,
                step_time_ms_iqr=float(q3 - q1) * 1e3,
                step_times_ms=tuple(float(s) * 1e3 for s in steps),
                comm_time_ms=0.0, backend="replay", parallel="simulate",
            )
        )  # fmt: skip
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--landscapes", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=("prior", "slow"), default="prior",
                        help="links drawn about the plan's prior, or 5 to 50x slower")
    parser.add_argument("--measured", choices=("all", "search"), default="all",
                        help="every configuration at 1-8 devices, or a search's third of them")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    rows = []
    start = time.perf_counter()
    for k in range(args.landscapes):
        world = landscape(rng, args.family)
        chosen = np.random.default_rng([args.seed, k]) if args.measured == "search" else None
        records = measure(world, rng, chosen)
        plan = make_plan(experiment(world, MEASURED), records, grad_bytes=world["grad_bytes"],
                         seed=k)  # fmt: skip
        for row in plan.rows:
            n = row.config.num_devices
            truth = row.config.batch_size / true_step_s(world, row.config)
            space = [c for c in experiment(world, (n,)).configs()
                     if c.canonical_micro_batch_size <= world["max_m"]]  # fmt: skip
            best = max(c.batch_size / true_step_s(world, c) for c in space)
            sps = row.samples_per_s
            rows.append({
                "landscape": k, "num_devices": n, "truth": truth, "value": sps.value,
                "low": sps.low, "high": sps.high, "covered": sps.low <= truth <= sps.high,
                "pick_vs_best": truth / best, "below": truth < sps.low,
                "comm_share": 1 - (row.config.grad_accum_steps * (world["t0"] + world["t1"]
                                   * row.config.canonical_micro_batch_size ** world["p"]))
                / true_step_s(world, row.config),
                "error": sps.value / truth - 1,
            })  # fmt: skip
    took = time.perf_counter() - start
    print(f"{args.landscapes} landscapes in {took:.0f} s")
    print(
        "| devices | rows | 90% interval covers the truth | truth below / above | "
        "median abs error | pick within 5% of the best |"
    )
    print("|---|---|---|---|---|---|")
    summary = {}
    for n in PLANNED:
        at = [r for r in rows if r["num_devices"] == n]
        covered = sum(r["covered"] for r in at) / len(at)
        below = sum(r["below"] for r in at) / len(at)
        above = 1 - covered - below
        within = sum(r["pick_vs_best"] >= 0.95 for r in at) / len(at)
        error = float(np.median([abs(r["error"]) for r in at]))
        summary[n] = {"rows": len(at), "coverage": covered, "below": below, "above": above,
                      "pick_within_5pct": within, "median_abs_error": error}  # fmt: skip
        print(
            f"| {n} | {len(at)} | {covered:.1%} | {below:.1%} / {above:.1%} | {error:.1%} | "
            f"{within:.1%} |"
        )
    RESULTS.mkdir(exist_ok=True)
    parts = ((args.family, "prior"), (args.measured, "all"), (f"seed{args.seed}", "seed0"))
    name = "".join(f"_{part}" for part, default in parts if part != default)
    out = RESULTS / f"plan_coverage{name}.json"
    raw = {"landscapes": args.landscapes, "seed": args.seed, "family": args.family,
           "measured": args.measured, "seconds": took, "summary": summary,
           "rows": rows}  # fmt: skip
    out.write_text(json.dumps(raw, indent=1))
    figure = FIGURE.with_name(f"plan-coverage{name.replace('_', '-')}.png")
    plot(rows, figure)
    print(f"wrote {out} and {figure}")


def plot(rows: list[dict], path: Path) -> None:
    """Each landscape's 90% interval and the truth, relative to the plan's point estimate,
    ordered by the interval's width: one panel per planned device count."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    for i, n in enumerate(PLANNED):
        ax = fig.add_subplot(1, len(PLANNED), i + 1)
        at = sorted((r for r in rows if r["num_devices"] == n),
                    key=lambda r: (r["high"] - r["low"]) / r["value"])  # fmt: skip
        x = np.arange(len(at))
        low = np.array([r["low"] / r["value"] for r in at])
        high = np.array([r["high"] / r["value"] for r in at])
        truth = np.array([r["truth"] / r["value"] for r in at])
        covered = np.array([r["covered"] for r in at])
        ax.fill_between(x, low, high, color="tab:blue", alpha=0.3, step="mid",
                        label="90% interval")  # fmt: skip
        ax.scatter(x[covered], truth[covered], s=4, color="black", label="truth, inside")
        ax.scatter(x[~covered], truth[~covered], s=10, color="tab:red", label="truth, outside")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_yscale("log")
        ax.set_title(f"{n} devices: {covered.mean():.1%} covered")
        ax.set_xlabel("landscape, by the interval's width")
        ax.set_ylabel("samples/s / the plan's point estimate")
        ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
