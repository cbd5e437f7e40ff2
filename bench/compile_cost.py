"""Compile cost of a micro-batch sweep: static shapes vs compile-once vs a warm cache.

Method: the quickstart's small GPT at batch_size 128 on one device is measured at eight
micro-batch sizes m = 1, 2, 4, ..., 128, each trial a fresh process
(``mbtune trial experiments/quickstart.yaml --batch-size 128 --micro-batch-size M
--json --set trial.dynamic=...``), as a search runs one process per trial. Compile on,
the quickstart's 2 warm-up + 5 timed steps. Three variants of the same sweep, in order:

  (a) static   ``trial.dynamic=false``, a fresh empty inductor cache
                (TORCHINDUCTOR_CACHE_DIR = a new temporary directory) for the sweep;
  (b) dynamic  ``trial.dynamic=true``, a fresh empty cache shared by the eight processes,
                so the shape-generic graph compiled by an early trial can be reused by
                the later ones through the on-disk FX graph / AOTAutograd caches;
  (c) warm     static shapes again, with the cache that (a) filled (a repeated or
                resumed search).

Before each trial the script waits (up to 30 s) for the shared machine to be nearly idle.

Reported: each trial's compile_s (its first step minus the median step: what the trial
itself reports), the sum over the sweep per variant and its ratio to (a); the processes'
wall time too. Steady-state samples/s per m for static (a) vs dynamic (b), from the
same run, and the ratio dynamic / static; (c) runs the same static code as (a), so
its samples/s are a second static reading (how much the machine drifted).

Target: the best of (b) and (c) costs <= 0.4x the compile time of (a).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from _common import cli_trial, machine, save, table

NAME = "compile_cost"
TARGET_RATIO = 0.4
SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


def sweep(label: str, batch_size: int, dynamic: bool, cache: str) -> list[dict]:
    runs = []
    for m in SIZES:
        args = ["--batch-size", str(batch_size), "--micro-batch-size", str(m)]
        args += ["--set", f"trial.dynamic={'true' if dynamic else 'false'}"]
        r = cli_trial(args, {"TORCHINDUCTOR_CACHE_DIR": cache})
        runs.append(r)
        print(
            f"  {label:8} m={m:<4} compile {r['compile_s']:6.2f} s  "
            f"{r['samples_per_s']:8,.1f} samples/s  process {r['process_s']:5.1f} s"
            + (f"  FALLBACK: {r['compile_fallback']}" if r["compile_fallback"] else ""),
            flush=True,
        )
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=128, help="global batch (128)")
    opts = parser.parse_args()
    b = opts.batch_size
    if b % SIZES[-1]:
        parser.error(f"--batch-size must be a multiple of {SIZES[-1]}")
    info = machine()

    with (
        tempfile.TemporaryDirectory(prefix="mbtune-bench-static-") as static_cache,
        tempfile.TemporaryDirectory(prefix="mbtune-bench-dynamic-") as dynamic_cache,
    ):
        print("(a) static shapes, fresh cache", flush=True)
        static = sweep("static", b, False, static_cache)
        print("(b) dynamic batch dimension (compile once), fresh shared cache", flush=True)
        dynamic = sweep("dynamic", b, True, dynamic_cache)
        print("(c) static shapes, the cache (a) filled", flush=True)
        warm = sweep("warm", b, False, static_cache)

    variants = {"static": static, "dynamic": dynamic, "warm": warm}
    totals = {k: sum(r["compile_s"] for r in v) for k, v in variants.items()}
    process = {k: sum(r["process_s"] for r in v) for k, v in variants.items()}
    ratios = {k: totals[k] / totals["static"] for k in variants}

    print(f"\ncompile seconds per trial, quickstart GPT, batch_size {b}, fresh process each")
    rows = [
        (m, static[i]["compile_s"], dynamic[i]["compile_s"], warm[i]["compile_s"])
        for i, m in enumerate(SIZES)
    ]
    rows.append(("total", totals["static"], totals["dynamic"], totals["warm"]))
    rows.append(("x static", ratios["static"], ratios["dynamic"], ratios["warm"]))
    rows.append(("process s", process["static"], process["dynamic"], process["warm"]))
    print(table(["m", "(a) static", "(b) dynamic", "(c) warm"], rows))

    steady = [
        {
            "m": m,
            "static": static[i]["samples_per_s"],
            "dynamic": dynamic[i]["samples_per_s"],
            "ratio": dynamic[i]["samples_per_s"] / static[i]["samples_per_s"],
            "static_again": warm[i]["samples_per_s"],
        }
        for i, m in enumerate(SIZES)
    ]
    print("\nsteady-state samples/s ((c) runs the same static code as (a): a second reading)")
    print(
        table(
            ["m", "(a) static", "(b) dynamic", "dyn/static", "(c) static again"],
            [(x["m"], x["static"], x["dynamic"], x["ratio"], x["static_again"]) for x in steady],
        )
    )
    dyn_ratio = statistics.median(x["ratio"] for x in steady)
    best = min(("dynamic", "warm"), key=lambda k: totals[k])
    met = ratios[best] <= TARGET_RATIO
    print(
        f"\nmedian dynamic/static throughput over the sweep: {dyn_ratio:.2f}x\n"
        f"best option: {best}, {ratios[best]:.2f}x static compile time "
        f"(target <= {TARGET_RATIO}x: {'met' if met else 'NOT met'}); "
        f"dynamic {ratios['dynamic']:.2f}x, warm {ratios['warm']:.2f}x"
    )
    path = save(
        NAME,
        info,
        {
            "command": "mbtune trial experiments/quickstart.yaml --batch-size "
            f"{b} --micro-batch-size M --json --set trial.dynamic=BOOL",
            "batch_size": b,
            "micro_batch_sizes": SIZES,
            "target_ratio": TARGET_RATIO,
            "compile_s_total": totals,
            "process_s_total": process,
            "ratio_to_static": ratios,
            "best": best,
            "target_met": met,
            "steady_state": steady,
            "median_dynamic_over_static": dyn_ratio,
            "trials": variants,
        },
    )
    print(f"raw figures: {path}")


if __name__ == "__main__":
    main()
