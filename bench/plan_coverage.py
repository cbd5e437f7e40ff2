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

``--family mp`` is a model-parallel landscape (issue 40): a model of 16, 32 or 48 blocks
(its width from P = 12 L h^2), sequences of 1024 to 4096 tokens in bf16, measured at 1 to
8 devices in every layout of t and p in 1, 2, 4 (t p <= 8; 1f1b and interleaved_1f1b where
p > 1) that divides the count. One device's compute is the whole model's over t p, tensor
parallelism 5 to 20% less efficient a rank (drawn), with the schedule's bubble; its step
adds the data-parallel all-reduce of its gradients' share over d, Megatron's 4
tensor-parallel all-reduces a block a micro-batch over t and the pipeline's sends, each on
its tier as Megatron's rank order places it (t consecutive ranks, the ring over every t-th,
stages of t d ranks); the memory cliff grows with t. Planned at 64 and 256 devices, every
layout of the space there: the pick's truth is checked as for the other families.

``--family slow`` draws both tiers' links 5 to 50x slower than the prior's figures
(log-uniform; latencies as many times longer): a fabric far from the defaults, whose
collectives the step times show (8 devices barely faster than 4), where the plan must let
the measurements overrule its prior. ``--measured search`` measures a search's share of
the space (a third of it, at least one configuration at each count) instead of all of it.

Run: ``.venv/bin/python bench/plan_coverage.py [--landscapes 300] [--seed S] [--family
prior|slow|mp] [--measured all|search]`` (a minute or two). Writes
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
from mbtune.lattice import BatchConfig, ModelShape  # noqa: E402
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


def mp_landscape(rng: np.random.Generator) -> dict:
    """A model-parallel landscape (``--family mp``): a model of 1B to 30B parameters in L
    blocks of width h (P = 12 L h^2), its sequences, how much tensor parallelism costs."""
    world = landscape(rng)
    params = math.exp(rng.uniform(math.log(1e9), math.log(30e9)))
    layers = int(rng.choice([16, 32, 48]))
    seq = int(rng.choice([1024, 2048, 4096]))
    per_sample = 6 * params * seq / (0.4 * 400e12) * math.exp(rng.uniform(-0.7, 0.7))
    world.update(
        mp=True, grad_bytes=int(4 * params), t1=per_sample, layers=layers, seq=seq,
        hidden=max(128, round(math.sqrt(params / (12 * layers)) / 128) * 128),
        tp_loss=rng.uniform(0.05, 0.2), max_m=int(rng.choice([1, 2, 4, 8])),
        batch=int(rng.choice([256, 512, 1024])),
    )  # fmt: skip
    return world


def _ring_s(world: dict, nbytes: float, n: int, members_per_node: int) -> float:
    """A ring all-reduce over n devices, ``members_per_node`` of them to a node of 8."""
    if n == 1:
        return 0.0
    (intra_bw, intra_lat), (inter_bw, inter_lat) = world["intra"], world["inter"]
    bandwidth, latency = (
        (intra_bw, intra_lat)
        if n <= members_per_node
        else (min(intra_bw, members_per_node * inter_bw), max(intra_lat, inter_lat))
    )
    return 2 * ((n - 1) / n * nbytes / bandwidth + (n - 1) * latency)


def true_compute_s(world: dict, config: BatchConfig) -> float:
    """One device's compute of a step: g micro-batches, its share of a split model (and
    what tensor parallelism loses), the pipeline's bubble."""
    t, p, schedule = config.layout
    g, m = config.grad_accum_steps, config.canonical_micro_batch_size
    per_pass = world["t0"] + world["t1"] * m ** world["p"]
    if t * p == 1:
        return g * per_pass
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    share = per_pass / (t * p) * (1 + world["tp_loss"] * (t - 1))
    return g * share * (1 + (p - 1) / (v * g))


def largest_micro_batch(world: dict, config: BatchConfig) -> int:
    """The memory cliff: a device holding 1/t of each block's activations fits t x more."""
    return min(64, world["max_m"] * config.tensor_parallel)


def true_step_s(world: dict, config: BatchConfig) -> float:
    """The generator's step: the compute, then a ring all-reduce of the gradients over two
    tiers of 8 devices a node (written out here, apart from the code it checks)."""
    compute = true_compute_s(world, config)
    n = config.num_devices
    if world.get("mp"):
        return compute + _mp_traffic_s(world, config)
    if n == 1:
        return compute
    (intra_bw, intra_lat), (inter_bw, inter_lat) = world["intra"], world["inter"]
    bandwidth, latency = (
        (intra_bw, intra_lat)
        if n <= 8
        else (min(intra_bw, 8 * inter_bw), max(intra_lat, inter_lat))
    )
    return compute + 2 * ((n - 1) / n * world["grad_bytes"] / bandwidth + (n - 1) * latency)


def _mp_traffic_s(world: dict, config: BatchConfig) -> float:
    """A split model's step traffic on Megatron's placement: the gradients' share over the
    d replicas (every t-th rank: per 8 / t to a node), 4 all-reduces a block a micro-batch
    over the t consecutive ranks, 2 sends a micro-batch and chunk to the next stage's block
    of t d ranks (one device's inter-node link where t d >= 8)."""
    t, p, schedule = config.layout
    d, g, m = config.data_parallel, config.grad_accum_steps, config.canonical_micro_batch_size
    activation = m * world["seq"] * world["hidden"] * 2  # bf16
    data = _ring_s(world, world["grad_bytes"] / (t * p), d, max(1, 8 // t))
    tensor = 4 * world["layers"] / p * g * _ring_s(world, activation, t, 8)
    if p == 1:
        return data + tensor
    (intra_bw, intra_lat), (inter_bw, inter_lat) = world["intra"], world["inter"]
    bandwidth, latency = (
        (intra_bw, intra_lat) if t * d < 8 else (min(intra_bw, inter_bw), max(intra_lat, inter_lat))
    )
    v = 1 if schedule in ("gpipe", "1f1b") else 2
    return data + tensor + 2 * v * g * (activation / t / bandwidth + latency)


def experiment(world: dict, devices: tuple[int, ...]):
    layouts = (
        {
            "tensor_parallel": [1, 2, 4],
            "pipeline_parallel": [1, 2, 4],
            "pipeline_schedule": ["1f1b", "interleaved_1f1b"],
        }
        if world.get("mp")
        else {}
    )
    return parse_experiment({
        "name": "coverage",
        "model": {"name": "mlp"},
        "train_input": {"batch_size": world["batch"], "micro_batch_size": "auto"},
        "search": {"space": {"num_devices": list(devices),
                             "micro_batch_size": {"min": 1, "max": 64}, **layouts},
                   "noise_floor": 0.035},
        "plan": {"samples": 1e9, "num_devices": list(PLANNED)},
    })  # fmt: skip


def measure(
    world: dict, rng: np.random.Generator, chosen: np.random.Generator | None = None
) -> list[TrialRecord]:
    """Every configuration of the space at the measured counts, as a replay answers; with
    ``chosen``, a search's share of them instead: each a third of the time (drawn from
    ``chosen``, apart from the measurements' draws), at least one at each device count."""
    configs = [c for c in experiment(world, MEASURED).configs()
               if c.tensor_parallel * c.pipeline_parallel <= 8]  # fmt: skip
    if chosen is not None:
        keep = chosen.random(len(configs)) < 1 / 3
        for n in MEASURED:
            at = [i for i, c in enumerate(configs) if c.num_devices == n]
            keep[at[int(chosen.integers(len(at)))]] = True
        configs = [c for c, k in zip(configs, keep, strict=True) if k]
    records = []
    for i, c in enumerate(configs, start=1):
        layout = dict(zip(("tensor_parallel", "pipeline_parallel", "pipeline_schedule"),
                          c.layout, strict=True))  # fmt: skip
        if c.canonical_micro_batch_size > largest_micro_batch(world, c):
            records.append(TrialRecord(trial=i, status="oom", batch_size=c.batch_size,
                                       num_devices=c.num_devices,
                                       micro_batch_size=c.micro_batch_size, **layout))  # fmt: skip
            continue
        drifted = true_step_s(world, c) * math.exp(world["drift"] * rng.standard_normal())
        steps = drifted * np.exp(world["step_sd"] * rng.standard_normal(STEPS))
        median = float(np.median(steps))
        q1, q3 = np.percentile(steps, [25, 75])
        records.append(
            TrialRecord(
                trial=i, status="ok", batch_size=c.batch_size, num_devices=c.num_devices,
                micro_batch_size=c.micro_batch_size,
                samples_per_s=c.batch_size / median, objective=c.batch_size / median,
                step_time_ms_median=median * 1e3,
                step_time_ms_iqr=float(q3 - q1) * 1e3,
                step_times_ms=tuple(float(s) * 1e3 for s in steps),
                comm_time_ms=0.0, backend="replay", parallel="simulate", **layout,
                tokens_per_s=c.batch_size / median * world.get("seq", 0) or None,
                precision="bf16" if world.get("mp") else None,
            )
        )  # fmt: skip
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--landscapes", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--family",
        choices=("prior", "slow", "mp"),
        default="prior",
        help="links drawn about the plan's prior, or 5 to 50x slower, or a "
        "model-parallel landscape (layouts of t and p)",
    )
    parser.add_argument(
        "--measured",
        choices=("all", "search"),
        default="all",
        help="every configuration at 1-8 devices, or a search's third of them",
    )
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    rows = []
    start = time.perf_counter()
    for k in range(args.landscapes):
        world = mp_landscape(rng) if args.family == "mp" else landscape(rng, args.family)
        chosen = np.random.default_rng([args.seed, k]) if args.measured == "search" else None
        records = measure(world, rng, chosen)
        shape = (
            ModelShape(layers=world["layers"], hidden=world["hidden"]) if world.get("mp") else None
        )
        plan = make_plan(experiment(world, MEASURED), records, grad_bytes=world["grad_bytes"],
                         shape=shape, seed=k)  # fmt: skip
        for row in plan.rows:
            n = row.config.num_devices
            truth = row.config.batch_size / true_step_s(world, row.config)
            space = [c for c in experiment(world, (n,)).configs()
                     if c.canonical_micro_batch_size <= largest_micro_batch(world, c)
                     and c.tensor_parallel * c.pipeline_parallel <= 8]  # fmt: skip
            best = max(c.batch_size / true_step_s(world, c) for c in space)
            sps = row.samples_per_s
            rows.append({
                "landscape": k, "num_devices": n, "truth": truth, "value": sps.value,
                "low": sps.low, "high": sps.high, "covered": sps.low <= truth <= sps.high,
                "pick_vs_best": truth / best, "below": truth < sps.low,
                "comm_share": 1 - true_compute_s(world, row.config)
                / true_step_s(world, row.config),
                "layout": list(row.config.layout),
                "confidence": row.confidence,
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
        sure = [r for r in at if r["confidence"] >= 90]
        missed = [r["confidence"] for r in at if r["pick_vs_best"] < 0.95]
        summary[n] = {"rows": len(at), "coverage": covered, "below": below, "above": above,
                      "pick_within_5pct": within, "median_abs_error": error,
                      "sure_picks": len(sure),
                      "sure_picks_within_5pct": sum(r["pick_vs_best"] >= 0.95 for r in sure),
                      "missed_picks_median_sure": float(np.median(missed)) if missed else None,
                      }  # fmt: skip
        print(
            f"| {n} | {len(at)} | {covered:.1%} | {below:.1%} / {above:.1%} | {error:.1%} | "
            f"{within:.1%} |"
        )
    for n, s in summary.items():
        print(f"{n} devices: {s['sure_picks_within_5pct']} of {s['sure_picks']} picks sure at 90 "
              f"or more within 5% of the best; the misses' median sure "
              f"{s['missed_picks_median_sure']}")  # fmt: skip
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
