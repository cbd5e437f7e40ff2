"""The communication model, checked: measured gloo all-reduces against the ring's
(mbtune.comm.all_reduce).

Method. For n = 2, 3 and 4 processes (``torch.multiprocessing`` spawned, gloo over TCP on
this host, one intra-op thread each: what a ``parallel: ddp`` trial's workers are on the
CPU), all-reduce one float32 buffer of each size S: the gradient of the quickstart GPT,
and 4 KiB, 64 KiB, 1 MiB and 16 MiB around it. The sizes are interleaved within each
round, so that drift on the shared machine hits them alike; each all-reduce starts after a
barrier, and its time is the slowest rank's (as the ddp trial times its all-reduce). After
5 untimed rounds, ``--reps`` (default 30) timed ones; every figure is the median.

The model is the trial engine's ring all-reduce,
t = 2 (n - 1) / n * S / bandwidth + 2 (n - 1) * latency,
(1) with the GPU interconnect figures (25 GB/s, 10 us: mbtune.config.trial.LINKS['cuda'], the
default for every device before this benchmark set the CPU's) and
(2) with bandwidth and latency fitted to the n = 2 medians (least squares on the relative
error, so that the small sizes count as much as the large). The fitted model is then also
checked at n = 3 and 4, which a 2-core machine can only run oversubscribed.

Then the same in whole trials: the quickstart GPT, batch_size 32 on 2 devices, micro-batch
8 and 16, compile off, 2 warm-up + 10 timed steps, measured three ways in this one run:
``parallel: simulate`` with the default link figures and with the fitted ones (one
device's share measured in this process with one intra-op thread, as each ddp worker has
one CPU), and ``parallel: ddp`` (two Ray Train workers of one CPU each). Reported: the
median step, the modelled or measured all-reduce, and the trial's wall time.

Run: ``.venv/bin/python bench/allreduce_model.py`` (about two minutes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from _common import QUICKSTART, machine, save, table, wait_for_quiet

from mbtune.comm import all_reduce
from mbtune.config.load import load_experiment
from mbtune.models.build import build_model

NAME = "allreduce_model"
DEFAULT_BANDWIDTH = 25e9
DEFAULT_LATENCY_S = 10e-6
WARMUP_ROUNDS = 5


def quickstart_grad_bytes() -> int:
    exp = load_experiment(QUICKSTART)
    spec = build_model(exp.model.name, exp.model.options)
    return sum(p.numel() * p.element_size() for p in spec.module.parameters() if p.requires_grad)


def _rank(rank: int, world: int, init: str, sizes: list[int], reps: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    buffers = [torch.ones(size // 4, dtype=torch.float32) for size in sizes]
    times = [[] for _ in sizes]
    for r in range(WARMUP_ROUNDS + reps):
        for i, buf in enumerate(buffers):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            seconds = time.perf_counter() - t0
            if r >= WARMUP_ROUNDS:
                times[i].append(seconds)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    if rank == 0:
        Path(out).write_text(json.dumps(slowest.tolist()))
    dist.destroy_process_group()


def measure(world: int, sizes: list[int], reps: int) -> list[list[float]]:
    """Per size, every timed all-reduce (seconds, the slowest rank's)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/times.json"
        mp.spawn(_rank, args=(world, f"file://{tmp}/pg", sizes, reps, out), nprocs=world, join=True)
        return json.loads(Path(out).read_text())


def fit(points: list[tuple[int, int, float]]) -> tuple[float, float]:
    """(bandwidth B/s, latency s) minimising the relative error of the ring model."""
    a = np.array([[2 * (n - 1) / n * s / t, 2 * (n - 1) / t] for n, s, t in points])
    inverse_bandwidth, latency = np.linalg.lstsq(a, np.ones(len(points)), rcond=None)[0]
    return 1 / inverse_bandwidth, latency


def compare_trials(bandwidth: float, latency: float) -> list[dict]:
    """simulate (default and fitted link figures) against ddp, on the quickstart GPT."""
    import logging

    import ray
    import torch

    from mbtune.lattice import BatchConfig
    from mbtune.trial.trial import run_trial

    base = ["trial.compile=false", "trial.warmup_steps=2", "trial.measure_steps=10"]
    arms = {
        "simulate, default link": [],
        "simulate, fitted link": [
            f"trial.link_bandwidth={bandwidth:.0f}",
            f"trial.link_latency_us={latency * 1e6:.1f}",
        ],
        "ddp": ["trial.parallel=ddp", "ray.cpus_per_trial=1"],
    }
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    torch.set_num_threads(1)  # one core per simulated device, as each ddp worker has
    rows, results = [], []
    for m in (8, 16):
        config = BatchConfig(32, 2, m)
        for arm, sets in arms.items():
            wait_for_quiet()
            r = run_trial(load_experiment(QUICKSTART, base + sets), config)
            if r.status != "ok":
                raise SystemExit(f"{arm}, micro_batch_size {m}: {r.status}: {r.reason}")
            results.append({"arm": arm, "micro_batch_size": m, **r.as_dict()})
            rows.append(
                (m, arm, r.step_time_ms_median, r.step_time_ms_iqr, r.compute_time_ms,
                 r.comm_time_ms, r.samples_per_s, r.peak_memory_bytes / 2**20, r.wall_s)
            )  # fmt: skip
            print(f"micro_batch_size {m}, {arm}: done", flush=True)
    ray.shutdown()
    print("\nquickstart GPT, batch_size 32, num_devices 2, compile off, 10 timed steps")
    print(
        table(
            ["m", "trial", "step ms", "IQR ms", "compute ms", "all-reduce ms", "samples/s",
             "peak MiB", "wall s"],
            rows,
        )
    )  # fmt: skip
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30, help="timed rounds (default 30)")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument(
        "--no-trials", dest="trials", action="store_false", help="skip the whole trials"
    )
    opts = parser.parse_args()
    info = machine()
    quickstart = quickstart_grad_bytes()
    sizes = sorted({4 * 2**10, 64 * 2**10, 2**20, quickstart, 16 * 2**20})

    medians: dict[int, list[float]] = {}
    spread: dict[int, list[float]] = {}
    raw: dict[int, list[list[float]]] = {}
    busy = {}
    for world in opts.worlds:
        busy[world] = wait_for_quiet()
        raw[world] = measure(world, sizes, opts.reps)
        medians[world] = [statistics.median(t) for t in raw[world]]
        spread[world] = [(q[2] - q[0]) for q in (statistics.quantiles(t, n=4) for t in raw[world])]
        print(f"n = {world}: measured", flush=True)

    bandwidth, latency = fit([(2, s, t) for s, t in zip(sizes, medians[2], strict=True)])
    rows, errors = [], {"default": {}, "fitted": {}}
    for world in opts.worlds:
        for size, t, iqr in zip(sizes, medians[world], spread[world], strict=True):
            default = all_reduce(size, world).seconds(DEFAULT_BANDWIDTH, DEFAULT_LATENCY_S)
            fitted = all_reduce(size, world).seconds(bandwidth, latency)
            errors["default"].setdefault(world, []).append(default / t - 1)
            errors["fitted"].setdefault(world, []).append(fitted / t - 1)
            label = f"{size / 2**10:,.0f} KiB" + (" (quickstart)" if size == quickstart else "")
            rows.append(
                (world, label, t * 1e3, iqr * 1e3, default * 1e3, f"{default / t - 1:+.0%}",
                 fitted * 1e3, f"{fitted / t - 1:+.0%}")
            )  # fmt: skip
    print(
        f"\ngloo all-reduce of one float32 buffer, {opts.reps} timed rounds, medians "
        f"(quickstart GPT gradient: {quickstart:,} bytes)"
    )
    print(
        table(
            ["n", "size", "measured ms", "IQR ms", "default ms", "default err",
             "fitted ms", "fitted err"],
            rows,
        )
    )  # fmt: skip
    print(
        f"\nfitted to n = 2: link_bandwidth {bandwidth / 1e9:.2f} GB/s, link_latency_us "
        f"{latency * 1e6:.0f} (defaults: {DEFAULT_BANDWIDTH / 1e9:g} GB/s, "
        f"{DEFAULT_LATENCY_S * 1e6:g} us)"
    )
    print(
        f"for parallel: simulate on this machine: --set trial.link_bandwidth="
        f"{bandwidth / 1e9:.2f}GB --set trial.link_latency_us={latency * 1e6:.0f}"
    )
    for which in ("default", "fitted"):
        for world, errs in errors[which].items():
            print(
                f"{which} model, n = {world}: median |error| "
                f"{statistics.median(abs(e) for e in errs):.0%}, worst {max(errs, key=abs):+.0%}"
            )
    trials = compare_trials(bandwidth, latency) if opts.trials else []
    path = save(
        NAME,
        info,
        {
            "sizes_bytes": sizes,
            "quickstart_grad_bytes": quickstart,
            "reps": opts.reps,
            "busy_before": busy,
            "median_s": medians,
            "iqr_s": spread,
            "times_s": raw,
            "fitted_bandwidth": bandwidth,
            "fitted_latency_s": latency,
            "default_bandwidth": DEFAULT_BANDWIDTH,
            "default_latency_s": DEFAULT_LATENCY_S,
            "relative_error": errors,
            "trials": trials,
        },
    )
    print(f"raw figures: {path}")


if __name__ == "__main__":
    main()
