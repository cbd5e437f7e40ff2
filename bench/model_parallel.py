"""Model-parallel landscapes from Megatron's relations: is the search right on them, and is
its score calibrated? (issue 40, item 7)

Method. Each seed draws a training job and its machine, and the landscape is the step time
of every configuration of its lattice, computed from Megatron's relations
(:func:`megatron_landscape`); a search runs on it trial by trial in-process exactly as
bench/confidence_calibration.py runs one (its ``search``: `mbtune run`'s searcher, reporter
and stopping rule, 5 replayed steps with 3% noise a trial, with `--drift` one factor more
per trial), and a recommendation is *right* when its true throughput is within 2% of the
landscape's best.

The job. A decoder of one of four shapes (Llama-like 7B, 13B, 34B and 70B: layers, width,
heads, MLP width), sequence 2048 or 4096, bf16 on 80 GB cards, 8 to a node, on 16 or 32
devices (drawn), a global batch of 128, 256 or 512 samples; the lattice is every
(t, p, schedule, m) with t in 1, 2, 4, 8 (inside a node), p in 1, 2, 4, 8, the schedules
gpipe, 1f1b, interleaved_1f1b and zbv, m in 1, 2, 4, 8, 16, that Megatron's rules allow
(mbtune.lattice: n % (t p), g >= p for 1f1b, g % p interleaved; the model's: t divides the
heads and the MLP width, p v the layers): 170 to 240 configurations, of which the search
measures those its memory screen does not rule out (:data:`SCREEN_MARGIN`; `--no-screen`:
all): 21 to 216 on seeds 100-149, median 93.

A configuration's step, on its busiest device (every figure drawn per seed in the range
given, log-uniform where it spans a factor):

- compute: a replica's P samples of 6 x parameters x s + 12 L s^2 h FLOPs each, split over
  t p devices, at a peak of 989 TFLOP/s times an efficiency e(m, t) = e_max w / (w + w0)
  with w = m s h / t / 1e7, the work of one GEMM (e_max 0.45-0.6, w0 0.05-0.5): a larger
  micro-batch runs up to about 1.3x faster per device (Megatron's figure), a narrower
  tensor-parallel shard slower;
- tensor parallelism: mbtune.comm's tensor_parallel_traffic (4 all-reduces of a
  micro-batch's activations per block, s h 2 bytes a sample) over the node's link
  (100-300 GB/s a device, 5-20 us a hop), exposed 50-100%;
- the pipeline: mbtune.comm's pipeline_traffic (each micro-batch's activations sent on and
  their gradients back, per chunk), over the node's link, or the network's where a
  replica's t p devices span nodes (12.5-50 GB/s a device, 10-40 us a hop);
- the bubble: the micro-batch's stage time (compute, its all-reduces and sends) times
  g (1 + bubble_fraction(p, g, schedule)), Megatron's (p - 1) / (v g) (a third of it for
  zbv), and a schedule's own overhead (interleaved 0-3%, zbv 0-5%: more, smaller passes);
- data parallelism: the gradients of a device's share (4 bytes a parameter / (t p))
  all-reduced over d, through mbtune.comm's two_tier_s (the network where the replicas
  span nodes), exposed 20-100% (the rest overlaps the backward);
- out of memory where a device holds more than 85-95% of 80 GB: its share of the model
  (bf16 weights and fp32 gradients, 6 bytes a parameter, and the distributed optimizer's
  12 bytes a parameter over d) plus the first stage's activations in flight: 34 s h / t
  bytes a sample and block (sequence parallel, selective recompute: Korthikanti et al.)
  for its L / p blocks, times m and the micro-batches in flight: g for gpipe, min(g, p)
  for 1f1b and zbv, that times (1 + (p - 1) / (p v)) interleaved.

A seed's job is drawn again until at least 10 of its configurations fit.

What is read (the target of issue 40): of the searches that stop at 90, at least 95%
right, on seeds the model was not tuned on (the default range, 100.., was first run after
the model's last change; 0.. is where it was looked at); every search's final
recommendation within 2% of the best; the calibration bins as
bench/confidence_calibration.py reads them (its verdicts, on this family alone). Run:
`.venv/bin/python bench/model_parallel.py [--seeds 50] [--first-seed 100] [--drift 0.035]`
(`--quick`: 8 seeds, not saved; `--write N`: seed N's landscape as a replay CSV in
bench/landscapes/; `--measured`: the real landscape bench/measure_model_parallel.py
measured, 2 gloo processes, for every seed: its searches differ by their noise only;
`--blind`: the search model blind to the layout, as it was before).
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import statistics
import sys
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass

from _common import BENCH, machine, save
from confidence_calibration import MIN_BIN, TARGET, _print, _stops, _table, _ties, _verdicts
from confidence_calibration import search as calibrated_search
from search_efficiency import load_table, trials_to_near_best

from mbtune.comm import Link, pipeline_traffic, step_traffic, tensor_parallel_traffic, two_tier_s
from mbtune.lattice import (
    BatchConfig,
    ModelShape,
    bubble_fraction,
    enumerate_configs,
    model_rule,
    stages_per_rank,
)

PER_NODE = 8
CARD_BYTES = 80e9
PEAK_FLOPS = 989e12
"""An H100's dense bf16 peak."""
TENSOR_PARALLEL = (1, 2, 4, 8)
PIPELINE_PARALLEL = (1, 2, 4, 8)
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zbv")
MICRO_BATCH_SIZES = (1, 2, 4, 8, 16)
STOPS_RIGHT = 95
"""The target: stops at 90 right at least this often (%)."""
QUICK_SEEDS = 8
MEASURED = BENCH / "landscapes" / "gpt_cpu_model_parallel.csv"
"""The real landscape: bench/measure_model_parallel.py's (2 gloo processes, a small GPT)."""


@dataclass(frozen=True)
class Decoder:
    """A Llama-like decoder's shape: blocks, width, heads, MLP width, vocabulary."""

    name: str
    layers: int
    hidden: int
    heads: int
    mlp: int
    vocab: int = 32000

    @property
    def parameters(self) -> float:
        """Attention (4 h^2), the gated MLP (3 h f) per block, the embedding and head."""
        block = 4 * self.hidden**2 + 3 * self.hidden * self.mlp
        return self.layers * block + 2 * self.vocab * self.hidden

    def flops_per_sample(self, seq: int) -> float:
        """Forward and backward: 6 per parameter and token, and attention's scores."""
        return 6 * self.parameters * seq + 12 * self.layers * seq**2 * self.hidden

    def shape(self) -> ModelShape:
        return ModelShape(layers=self.layers, heads=self.heads, kv_heads=self.heads,
                          mlp_width=self.mlp, hidden=self.hidden)  # fmt: skip


DECODERS = (
    Decoder("7B", 32, 4096, 32, 11008),
    Decoder("13B", 40, 5120, 40, 13824),
    Decoder("34B", 48, 8192, 64, 22016),
    Decoder("70B", 80, 8192, 64, 28672),
)


@dataclass(frozen=True)
class Job:
    """What one seed draws: the model, the devices, the batch, and the machine."""

    model: Decoder
    seq: int
    num_devices: int
    batch_size: int
    e_max: float
    w0: float
    intra: Link
    inter: Link
    tp_exposed: float
    dp_exposed: float
    overhead: dict[str, float]
    budget_bytes: float

    def lattice(self) -> list[BatchConfig]:
        """Every configuration Megatron's rules and the model's shape allow."""
        layouts = [(t, p, s) for t in TENSOR_PARALLEL for p in PIPELINE_PARALLEL
                   for s in (SCHEDULES if p > 1 else ("1f1b",))
                   if not model_rule(t, p, s, self.model.shape())]  # fmt: skip
        return enumerate_configs(mode="auto", batch_sizes=[self.batch_size],
                                 num_devices=[self.num_devices],
                                 micro_batch_sizes=MICRO_BATCH_SIZES, layouts=layouts)  # fmt: skip


def draw_job(rng: random.Random) -> Job:
    def log_uniform(lo: float, hi: float) -> float:
        return math.exp(rng.uniform(math.log(lo), math.log(hi)))

    return Job(
        model=rng.choice(DECODERS),
        seq=rng.choice([2048, 4096]),
        num_devices=rng.choice([16, 32]),
        batch_size=rng.choice([128, 256, 512]),
        e_max=rng.uniform(0.45, 0.6),
        w0=log_uniform(0.05, 0.5),
        intra=Link(log_uniform(100e9, 300e9), log_uniform(5e-6, 20e-6)),
        inter=Link(log_uniform(12.5e9, 50e9), log_uniform(10e-6, 40e-6)),
        tp_exposed=rng.uniform(0.5, 1.0),
        dp_exposed=rng.uniform(0.2, 1.0),
        overhead={"interleaved_1f1b": rng.uniform(0, 0.03), "zbv": rng.uniform(0, 0.05)},
        budget_bytes=CARD_BYTES * rng.uniform(0.85, 0.95),
    )


def peak_bytes(job: Job, c: BatchConfig) -> float:
    """The busiest device's memory: its share of the model's states and the first stage's
    activations in flight (module docstring)."""
    t, p, d, g = c.tensor_parallel, c.pipeline_parallel, c.data_parallel, c.grad_accum_steps
    states = job.model.parameters / (t * p) * (6 + 12 / d)
    per_sample = 34 * job.seq * job.model.hidden / t * job.model.layers / p
    v = stages_per_rank(c.pipeline_schedule)
    if p == 1:
        in_flight = 1.0
    elif c.pipeline_schedule == "gpipe":
        in_flight = g
    elif c.pipeline_schedule == "interleaved_1f1b":
        in_flight = min(g, p) * (1 + (p - 1) / (p * v))
    else:
        in_flight = min(g, p)
    return states + per_sample * c.micro_batch_size * in_flight


def step_s(job: Job, c: BatchConfig) -> float:
    """The step time of ``c`` on ``job``'s machine (module docstring)."""
    t, p, d, m = c.tensor_parallel, c.pipeline_parallel, c.data_parallel, c.micro_batch_size
    model, seq = job.model, job.seq
    work = m * seq * model.hidden / t / 1e7
    efficiency = job.e_max * work / (work + job.w0)
    compute = c.per_device_batch * model.flops_per_sample(seq) / (t * p)
    compute /= PEAK_FLOPS * efficiency
    activation = seq * model.hidden * 2  # one sample's, between blocks, bf16
    tp = tensor_parallel_traffic(c, layers=model.layers / p, activation_bytes=activation)
    tp_s = tp.seconds(job.intra.bandwidth, job.intra.latency_s) * job.tp_exposed
    link = job.inter if t * p > PER_NODE else job.intra
    pp_s = pipeline_traffic(c, activation_bytes=activation).seconds(link.bandwidth, link.latency_s)
    bubble = bubble_fraction(p, c.grad_accum_steps, c.pipeline_schedule)
    pipeline = (
        (compute + tp_s + pp_s) * (1 + bubble) * (1 + job.overhead.get(c.pipeline_schedule, 0))
    )
    grads = step_traffic(c, grad_bytes=4 * model.parameters / (t * p))
    dp_s = two_tier_s(grads, d, max(1, PER_NODE // (t * p)), job.intra, job.inter)
    return float(pipeline + dp_s * job.dp_exposed)  # two_tier_s's numpy scalar, as a float


def draw(seed: int) -> tuple[Job, dict[BatchConfig, float | None]]:
    """Seed ``seed``'s job and landscape (:func:`drawn`)."""
    return drawn(random.Random(40_000 + seed), draw_job, peak_bytes, step_s)


def drawn(rng: random.Random, draw_job, peak_bytes, step_s) -> tuple:
    """A job from ``draw_job(rng)`` and its landscape: samples/s of every configuration of
    its lattice (``step_s(job, c)``), None where ``peak_bytes(job, c)`` is over its budget;
    the job drawn again until at least 10 configurations fit (bench/fsdp_search.py's
    family too)."""
    while True:
        job = draw_job(rng)
        table = {c: None if peak_bytes(job, c) > job.budget_bytes else c.batch_size / step_s(job, c)
                 for c in job.lattice()}  # fmt: skip
        if sum(v is not None for v in table.values()) >= 10:
            return job, table


def screened(job, table: dict, peak_bytes) -> dict[BatchConfig, float | None]:
    """``table`` without the configurations the memory screen rules out
    (:data:`SCREEN_MARGIN`), as `mbtune run` never measures them."""
    over = job.budget_bytes * (1 + SCREEN_MARGIN)
    return {c: v for c, v in table.items() if v is not None or peak_bytes(job, c) <= over}


SCREEN_MARGIN = 0.15
"""The memory screen's error (issue 40, item 6: predictions within 15% of the measured
peak): a configuration whose peak is over the budget by more than this is one the search's
screen (mbtune.search's predict_out_of_memory) predicts out of memory before any trial;
nearer the budget it is measured."""


def megatron_landscape(seed: int, *, screen: bool = True) -> dict[BatchConfig, float | None]:
    """Seed ``seed``'s landscape (:func:`draw`); with ``screen``, without the configurations
    the memory screen rules out (:data:`SCREEN_MARGIN`), as `mbtune run` never measures
    them."""
    job, table = draw(seed)
    return screened(job, table, peak_bytes) if screen else table


def describe(seed: int) -> str:
    """What seed ``seed`` drew and where its best lies, in a line."""
    job, table = draw(seed)
    ranked = sorted((v, c) for c, v in table.items() if v)
    (best, c), (second, _) = ranked[-1], ranked[-2]
    fits = len(ranked)
    return (f"{job.model.name} s={job.seq} n={job.num_devices} B={job.batch_size}: "
            f"{len(table)} configurations, {fits} fit; best t={c.tensor_parallel} "
            f"p={c.pipeline_parallel} {c.pipeline_schedule} m={c.micro_batch_size}, "
            f"runner-up {100 * (1 - second / best):.1f}% behind")  # fmt: skip


def calibrate(
    seeds: range,
    sampler: str,
    drift: float,
    min_bin: int,
    landscape=None,
    name: str = "megatron",
    sharded: bool = False,
) -> dict:
    """Every seed's search, up to its stop: the bins, the stops, the final recommendations
    and the verdicts, printed as bench/confidence_calibration.py prints a family.
    ``landscape(seed)``: the table (default: :func:`megatron_landscape`); ``sharded``: the
    trials shard the model (bench/fsdp_search.py)."""
    landscape = landscape or megatron_landscape
    readings: dict[int, list[tuple[int, bool]]] = defaultdict(list)
    stops, ties, finals, lengths = [], [], [], []
    for seed in seeds:
        table = landscape(seed)
        s = calibrated_search(table, sampler, seed, drift, sharded)
        readings[seed] += s["readings"]
        lengths.append(len(s["readings"]))
        finals.append(bool(s["readings"]) and s["readings"][-1][1])
        stop = s["stop"]
        if stop and stop["tie"]:
            ties.append(stop)
        elif stop and stop["score"] >= TARGET:
            stops.append({**stop, "landscape": name})
        if stop and not stop["right"]:
            seen = describe(seed) if name == "megatron" else name
            print(f"  seed {seed}: stopped {100 * stop['shortfall']:.1f}% short at score "
                  f"{stop['score']} after {stop['trials']} trials ({seen})")  # fmt: skip
    r = {"size": len(landscape(seeds[0])), "seeds": len(seeds),
         "searches": len(seeds), "bins": _table(readings), **_stops(stops), **_ties(ties),
         "worst_stop": max(stops, key=lambda s: s["shortfall"]) if stops else None,
         "final_right": sum(finals), "trials_median": statistics.median(lengths)}  # fmt: skip
    _print(name, r, min_bin)
    r["verdicts"] = _verdicts(r, min_bin)
    right, n = r["stopped_right"], r["stopped"]
    met = n > 0 and 100 * right >= STOPS_RIGHT * n
    r["verdicts"]["stops_right_95"] = {
        "met": met,
        "line": f"{'MET    ' if met else 'NOT MET'} stops at {TARGET} right >= {STOPS_RIGHT}%: "
        f"{right}/{n} ({100 * right / max(n, 1):.1f}%)",
    }
    print(f"  final recommendation within 2% of the best: {sum(finals)}/{len(seeds)}; "
          f"median trials {r['trials_median']}")  # fmt: skip
    for v in r["verdicts"].values():
        print(v["line"])
    return r


def efficiency(seeds: range, samplers: list[str], landscape) -> dict:
    """bench/search_efficiency.py's reading on these landscapes: trials until a
    configuration within 2% of the best was measured (no stop), by sampler."""
    out = {}
    for sampler in samplers:
        counts, sizes = [], []
        for seed in seeds:
            table = landscape(seed)
            counts.append(trials_to_near_best(table, sampler, seed))
            sizes.append(len(table))
        q = statistics.quantiles(counts, n=4)
        out[sampler] = {"median": statistics.median(counts), "p75": q[2], "counts": counts,
                        "sizes": sizes}  # fmt: skip
        print(f"  {sampler:<8} median {statistics.median(counts):5.1f}  p75 {q[2]:5.1f}  "
              f"(lattices: median {statistics.median(sizes)} configurations)")  # fmt: skip
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=None, help=f"default 50 ({QUICK_SEEDS} quick)")
    parser.add_argument("--first-seed", type=int, default=100,
                        help="seeds first-seed.. (0..: where the model was looked at)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_SEEDS} seeds, not saved")
    parser.add_argument("--sampler", default="model")
    parser.add_argument("--drift", type=float, default=0.0,
                        help="each trial off by one factor of this relative sd")  # fmt: skip
    parser.add_argument("--min-bin", type=int, default=MIN_BIN)
    parser.add_argument("--write", type=int, default=None, metavar="SEED",
                        help="write SEED's landscape to bench/landscapes/")  # fmt: skip
    parser.add_argument("--no-screen", action="store_true",
                        help="measure every configuration, however far over budget")  # fmt: skip
    parser.add_argument("--blind", action="store_true",
                        help="the model blind to the layout (as before issue 40)")  # fmt: skip
    parser.add_argument("--measured", action="store_true",
                        help=f"the real landscape ({MEASURED.name}), every seed")  # fmt: skip
    parser.add_argument("--efficiency", nargs="*", default=None, metavar="SAMPLER",
                        help="trials to a near-best one, by sampler (no stops)")  # fmt: skip
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    if args.write is not None:
        return _write(args.write)
    warnings.simplefilter("ignore")
    if args.blind:
        _blind()
    seeds = range(
        args.first_seed, args.first_seed + (args.seeds or (QUICK_SEEDS if args.quick else 50))
    )
    info = machine()
    which = "the measured landscape" if args.measured else "megatron landscapes"
    print(f"=== {which}: seeds {seeds[0]}..{seeds[-1]}, drift {args.drift}, "
          f"sampler {args.sampler} ===")  # fmt: skip
    started = time.perf_counter()
    landscape = functools.partial(megatron_landscape, screen=not args.no_screen)
    if args.measured:  # one landscape: the searches differ by their noise only
        measured = load_table(MEASURED)
        landscape = lambda seed: measured  # noqa: E731
    name = "measured" if args.measured else "megatron"
    if args.efficiency is not None:
        r = efficiency(seeds, args.efficiency or ["model", "random", "tpe"], landscape)
        out = save(f"model_parallel_efficiency_seeds{seeds[0]}-{seeds[-1]}"
                   + ("_blind" if args.blind else ""), info, r)  # fmt: skip
        print(f"raw figures: {out.relative_to(BENCH.parent)}")
        return 0
    r = calibrate(seeds, args.sampler, args.drift, args.min_bin, landscape, name)
    r["seconds"] = round(time.perf_counter() - started, 1)
    if args.quick:
        print("--quick: raw figures not saved")
    else:
        name = f"model_parallel_seeds{seeds[0]}-{seeds[-1]}"
        name += (f"_drift{args.drift}" if args.drift else "") + (
            "_noscreen" if args.no_screen else ""
        )
        name += (
            ("_measured" if args.measured else "")
            + ("_blind" if args.blind else "")
            + (f"_{args.tag}" if args.tag else "")
        )
        out = save(name, info, {"settings": vars(args), "megatron": r})
        print(f"raw figures: {out.relative_to(BENCH.parent)}")
    return 0 if all(v["met"] for v in r["verdicts"].values()) else 1


def _blind() -> None:
    """The search model as it was before it knew the layout: its layout columns (t, p, the
    schedule, the bubble) zero for every configuration, so that configurations differing
    only in layout are one point to it (the collectives' column, issue 38, kept)."""
    from mbtune.recommend import gp

    seen = gp.features

    def features(c: BatchConfig, *, sharded: bool = False) -> tuple[float, ...]:
        f = seen(c, sharded=sharded)
        return (*f[:6], *(0.0 for _ in f[6:-1]), f[-1])

    gp.features = features


def _write(seed: int) -> int:
    """Seed ``seed``'s landscape as a replay table (trial.backend: replay, trial.table)."""
    import csv

    job, table = draw(seed)
    path = BENCH / "landscapes" / f"megatron_{seed}.csv"
    columns = ["batch_size", "num_devices", "micro_batch_size", "tensor_parallel",
               "pipeline_parallel", "pipeline_schedule", "samples_per_s", "status"]  # fmt: skip
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(columns)
        for c, v in sorted(table.items()):
            out.writerow([*(getattr(c, k) for k in columns[:6]), "" if v is None else repr(v),
                          "ok" if v else "oom"])  # fmt: skip
    print(f"{path.relative_to(BENCH.parent)}: {describe(seed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
