"""Sharded (FSDP2) landscapes from the collectives' relations: is the search right on them,
and is its score calibrated, with and without the search model's communication term?
(issue 38)

Method. As bench/model_parallel.py, on another family: each seed draws a training job and
its machine, the landscape is the step time of every configuration of its lattice
(:func:`step_s`), and a search runs on it trial by trial in-process as
bench/confidence_calibration.py runs one (5 replayed steps with 3% noise a trial, with
`--drift` one factor more per trial), with the search model told the trials shard
(``trial.sharding: fsdp``, as `mbtune run` tells it). A recommendation is *right* when its
true throughput is within 2% of the landscape's best.

The job. A decoder of bench/model_parallel.py's shapes (7B, 13B, 34B), sequence 2048 or
4096, bf16 on 80 GB cards, 8 to a node, trained with FSDP2 on 8, 16, 32 and 64 devices (one
space: every count), a global batch of 256, 512 or 1024 samples; the lattice every (n, m)
with m in 1, 2, 4, 8, 16 that divides a device's batch, times every setting FSDP2 searches:
activation checkpointing, ``reshard_after_forward`` and ``grad_sync``, each measurement
once (``grad_sync`` every and last are one where a device runs one micro-batch:
``BatchConfig.canonical``): 124 to 156 configurations, 11 to 121 of them fit (136 to 160
and 12 to 123 with those pairs, as the first figures of docs/confidence.md were taken).

A configuration's step on a device, micro-batch by micro-batch (every figure drawn per
seed in the range given, log-uniform where it spans a factor):

- compute: m samples of 6 x parameters x s + 12 L s^2 h FLOPs (a third forward, two thirds
  backward; checkpointing runs the forward again in the backward) at 989 TFLOP/s times an
  efficiency e(m) = e_max w / (w + w0), w = m s h / 1e7 (e_max 0.45-0.6, w0 0.05-0.5);
- the collectives, counted by mbtune.comm (all_gather, reduce_scatter) over the two tiers
  (two_tier_s: the node's link 100-300 GB/s a device, the network's 3-50 GB/s, the slow end
  far below a GPU cluster's): the bf16 parameters all-gathered in every micro-batch's
  forward and, with ``reshard_after_forward``, again in its backward; the fp32 gradients
  reduce-scattered in the last micro-batch's backward (``grad_sync: last``) or in every
  one's (``every``);
- overlap: FSDP2 prefetches the next unit's gathers and reduces the last unit's gradients
  while computing, so a pass takes its compute plus its collectives less ``overlap`` (0.6-1)
  of the shorter of the two, plus the first unit's gather (1 / L of them), which nothing
  hides; and a fixed cost per micro-batch (2-10 ms: launches, the hooks);
- out of memory where a device holds more than 85-95% of 80 GB: its shard of the model's
  states (16 bytes a parameter over n: fp32 weights, gradients and Adam's two moments), the
  gathered bf16 parameters (two units, prefetching; every unit with
  ``reshard_after_forward`` off, held from the forward to the backward), the unsharded fp32
  gradients a ``grad_sync: last`` step accumulates over its micro-batches, and the
  activations: 34 s h bytes a sample and block, or with checkpointing the blocks' inputs
  (2 s h) and one block's whole.

So the settings trade memory for collectives, and the collectives' count depends on m
(gathers per micro-batch) and the settings together: what neither the curvature in n nor a
setting's own column carries. A seed's job is drawn again until at least 10 of its
configurations fit.

What is read, with the search model's communication term as `mbtune run` has it (`--comm
both`), with one of its two columns (`linear`: in units of the most the space sends;
`octaves`) or none (as before issue 38): the stops at 90 right (at least 95%), every
search's final recommendation within 2% of the best and the median trials, the calibration
bins (the verdicts of bench/confidence_calibration.py, on this family alone); and with
`--prediction K...`, the model's error on what it has not measured (:func:`prediction`).
Seeds 100-149 are where the term's form was chosen; 1000.. were first run after it. Run:
`.venv/bin/python bench/fsdp_search.py [--seeds 50] [--first-seed 100] [--drift 0.035]
[--comm both|linear|octaves|none] [--prediction 8 16 32] [--quick] [--describe]`.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
import warnings
from dataclasses import dataclass

from _common import BENCH, machine, save
from confidence_calibration import MIN_BIN
from model_parallel import (
    CARD_BYTES,
    DECODERS,
    PEAK_FLOPS,
    PER_NODE,
    QUICK_SEEDS,
    Decoder,
    calibrate,
    drawn,
    screened,
)

from mbtune.comm import Link, all_gather, reduce_scatter, two_tier_s
from mbtune.lattice import BatchConfig, enumerate_configs

DEVICES = (8, 16, 32, 64)
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
SETTINGS = [(ckpt, reshard, sync) for ckpt in (False, True) for reshard in (True, False)
            for sync in ("last", "every")]  # fmt: skip


@dataclass(frozen=True)
class Job:
    """What one seed draws: the model, the batch, and the machine."""

    model: Decoder
    seq: int
    batch_size: int
    e_max: float
    w0: float
    intra: Link
    inter: Link
    overlap: float
    per_micro_batch_s: float
    budget_bytes: float

    def lattice(self) -> list[BatchConfig]:
        sizes = enumerate_configs(
            mode="auto", batch_sizes=[self.batch_size], num_devices=DEVICES,
            micro_batch_sizes=MICRO_BATCH_SIZES,
        )  # fmt: skip
        # each measurement once: grad_sync every and last are one where g = 1 (canonical)
        return sorted({c.with_settings(s).canonical() for s in SETTINGS for c in sizes})


def draw_job(rng: random.Random) -> Job:
    def log_uniform(lo: float, hi: float) -> float:
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))

    return Job(
        model=rng.choice(DECODERS[:3]),
        seq=rng.choice([2048, 4096]),
        batch_size=rng.choice([256, 512, 1024]),
        e_max=rng.uniform(0.45, 0.6),
        w0=log_uniform(0.05, 0.5),
        intra=Link(log_uniform(100e9, 300e9), log_uniform(5e-6, 20e-6)),
        inter=Link(log_uniform(3e9, 50e9), log_uniform(10e-6, 40e-6)),
        overlap=rng.uniform(0.6, 1.0),
        per_micro_batch_s=log_uniform(2e-3, 10e-3),
        budget_bytes=CARD_BYTES * rng.uniform(0.85, 0.95),
    )


def peak_bytes(job: Job, c: BatchConfig) -> float:
    """A device's memory at its peak (module docstring)."""
    model, n = job.model, c.num_devices
    params = model.parameters
    states = 16 * params / n
    gathered = 2 * params * (2 / model.layers if c.reshard_after_forward else 1.0)
    accumulated = 4 * params if c.grad_sync == "last" and c.grad_accum_steps > 1 else 0.0
    block = 34 * job.seq * model.hidden
    if c.activation_checkpointing:
        activations = c.micro_batch_size * (2 * job.seq * model.hidden * model.layers + block)
    else:
        activations = c.micro_batch_size * block * model.layers
    return states + gathered + accumulated + activations


def step_s(job: Job, c: BatchConfig) -> float:
    """The step time of ``c`` on ``job``'s machine (module docstring)."""
    model, n, m = job.model, c.num_devices, c.micro_batch_size
    work = m * job.seq * model.hidden / 1e7
    efficiency = job.e_max * work / (work + job.w0)
    compute = m * model.flops_per_sample(job.seq) / (PEAK_FLOPS * efficiency)
    forward, backward = compute / 3, 2 * compute / 3 + (compute / 3) * c.activation_checkpointing

    def over_link(traffic) -> float:
        return float(two_tier_s(traffic, n, min(n, PER_NODE), job.intra, job.inter))

    gather = over_link(all_gather(n, 2 * model.parameters))
    scatter = over_link(reduce_scatter(n, 4 * model.parameters))

    def hidden(work_s: float, comm_s: float) -> float:
        return work_s + comm_s - job.overlap * min(work_s, comm_s)

    first = gather / model.layers  # the first unit's gather: nothing to hide it behind
    g = c.grad_accum_steps
    total = 0.0
    for i in range(g):
        back_comm = gather * c.reshard_after_forward
        if c.grad_sync == "every" or i == g - 1:
            back_comm += scatter
        total += hidden(forward, gather) + first + hidden(backward, back_comm)
        total += job.per_micro_batch_s
    return total


def draw(seed: int) -> tuple[Job, dict[BatchConfig, float | None]]:
    """Seed ``seed``'s job and landscape (bench/model_parallel.py's ``drawn``)."""
    return drawn(random.Random(38_000 + seed), draw_job, peak_bytes, step_s)


TERMS = ("both", "linear", "octaves", "none")


def term(which: str) -> None:
    """The search model's communication term as ``which`` says: a column left out has its
    prior variance nil (its coefficient held at 0), the model as it would be without it."""
    from mbtune.recommend import gp

    if which in ("octaves", "none"):
        gp._COMM_SD = 0.0
    if which in ("linear", "none"):
        gp._COMM_OCTAVE_SD = 0.0


def landscape(seed: int) -> dict[BatchConfig, float | None]:
    """Seed ``seed``'s landscape without the configurations the memory screen rules out."""
    return screened(*draw(seed), peak_bytes)


def describe(seed: int) -> str:
    """What seed ``seed`` drew and where its best lies, in a line."""
    job, table = draw(seed)
    ranked = sorted((v, str(c)) for c, v in table.items() if v)
    (best, c), (second, _) = ranked[-1], ranked[-2]
    return (f"{job.model.name} s={job.seq} B={job.batch_size} network "
            f"{job.inter.bandwidth / 1e9:.0f} GB/s: {len(table)} configurations, "
            f"{len(ranked)} fit; best {c}, "
            f"runner-up {100 * (1 - second / best):.1f}% behind")  # fmt: skip


def prediction(seeds: range, measured: int) -> dict:
    """The search model's error on what it has not measured: per seed, ``measured``
    configurations that fit, drawn at random, measured exactly; the model (gp.Scale with
    the trials sharded, gp.Mixture) fitted to their log samples/s per device predicts every
    other configuration that fits. Read: the median and 90th percentile of |log error|
    over every prediction of every seed, and how often the best unmeasured configuration
    by the model's mean is within 2% of the best unmeasured one."""
    import numpy as np

    from mbtune.recommend import gp

    errors, picks, used = [], 0, 0
    for seed in seeds:
        fits = [(c, v) for c, v in draw(seed)[1].items() if v]
        if len(fits) < 2 * measured:  # too few left to predict: the seed is not read
            continue
        used += 1
        rng = random.Random(seed)
        rng.shuffle(fits)
        seen, unseen = fits[:measured], fits[measured:]
        scale = gp.Scale([c for c, _ in fits], sharded=True)
        y = np.log([v / c.num_devices for c, v in seen])
        model = gp.Mixture(scale([c for c, _ in seen]), y, np.full(len(seen), 1e-4))
        mean = model.mean(scale([c for c, _ in unseen]))
        truth = np.log([v / c.num_devices for c, v in unseen])
        errors += list(np.abs(mean - truth))
        picked = unseen[int(np.argmax(mean + np.log([c.num_devices for c, _ in unseen])))][1]
        picks += picked >= 0.98 * max(v for _, v in unseen)
    q = np.quantile(errors, [0.5, 0.9])
    r = {"measured": measured, "predictions": len(errors),
         "median_abs_log_error": float(q[0]), "p90_abs_log_error": float(q[1]),
         "best_unmeasured_picked": picks, "seeds": used}  # fmt: skip
    print(f"  {measured} measured: |log error| median {q[0]:.3f}, p90 {q[1]:.3f} over "
          f"{len(errors)} predictions; the best unmeasured picked within 2% in "
          f"{picks}/{used} seeds")  # fmt: skip
    return r


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=None, help=f"default 50 ({QUICK_SEEDS} quick)")
    parser.add_argument("--first-seed", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_SEEDS} seeds, not saved")
    parser.add_argument("--drift", type=float, default=0.0,
                        help="each trial off by one factor of this relative sd")  # fmt: skip
    parser.add_argument("--min-bin", type=int, default=MIN_BIN)
    parser.add_argument("--comm", choices=TERMS, default="both",
                        help="the search model's communication term: both columns (as "
                        "mbtune runs), one of them, or none (as before issue 38)")  # fmt: skip
    parser.add_argument("--describe", action="store_true", help="each seed's job, in a line")
    parser.add_argument("--prediction", type=int, nargs="*", default=None, metavar="K",
                        help="the model's error on the unmeasured, K measured "
                        "(default 8 16)")  # fmt: skip
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    seeds = range(
        args.first_seed, args.first_seed + (args.seeds or (QUICK_SEEDS if args.quick else 50))
    )
    if args.describe:
        for seed in seeds:
            print(seed, describe(seed))
        return 0
    term(args.comm)
    info = machine()
    suffix = ("" if args.comm == "both" else f"_comm-{args.comm}") + (
        f"_{args.tag}" if args.tag else ""
    )
    if args.prediction is not None:
        print(f"=== fsdp landscapes, prediction: seeds {seeds[0]}..{seeds[-1]}, "
              f"communication term: {args.comm} ===")  # fmt: skip
        r = {"prediction": [prediction(seeds, k) for k in args.prediction or (8, 16)]}
        out = save(f"fsdp_prediction_seeds{seeds[0]}-{seeds[-1]}{suffix}", info,
                   {"settings": vars(args), **r})  # fmt: skip
        print(f"raw figures: {out.relative_to(BENCH.parent)}")
        return 0
    print(f"=== fsdp landscapes: seeds {seeds[0]}..{seeds[-1]}, drift {args.drift}, "
          f"communication term: {args.comm} ===")  # fmt: skip
    started = time.perf_counter()
    r = calibrate(seeds, "model", args.drift, args.min_bin, landscape, "fsdp", sharded=True)
    r["seconds"] = round(time.perf_counter() - started, 1)
    if args.quick:
        print("--quick: raw figures not saved")
    else:
        drift = f"_drift{args.drift}" if args.drift else ""
        out = save(f"fsdp_search_seeds{seeds[0]}-{seeds[-1]}{drift}{suffix}", info,
                   {"settings": vars(args), "fsdp": r})  # fmt: skip
        print(f"raw figures: {out.relative_to(BENCH.parent)}")
    return 0 if all(v["met"] for v in r["verdicts"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
