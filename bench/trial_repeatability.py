"""Trial repeatability: does measuring the same configuration twice give the same answer?

Method: the quickstart's small GPT (batch_size 32, num_devices 1, micro_batch_size 8,
compile on, the quickstart's 2 warm-up + 5 timed steps) is measured in N = 5 separate
trials, each a fresh process running
``mbtune trial experiments/quickstart.yaml --micro-batch-size 8 --json``, as a search
runs one process per trial. All the processes share one private inductor cache
(TORCHINDUCTOR_CACHE_DIR, a new temporary directory) that an untimed priming trial
fills first, so every timed trial starts from the same state (a warm on-disk cache);
compile time is reported apart from throughput by the trial anyway. Before each trial
the script waits (up to 30 s) for the shared machine to be nearly idle and records the
busy share of the CPUs it saw ("busy").

Reported: each trial's samples/s (batch_size / median step time), their median, and the
coefficient of variation (sample stdev / mean) of samples/s across the trials.

Target: CV <= 5 %.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from _common import cli_trial, cv, machine, save, table

NAME = "trial_repeatability"
TARGET_CV = 0.05
ARGS = ["--micro-batch-size", "8"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5, help="timed trials (default 5)")
    opts = parser.parse_args()
    info = machine()

    with tempfile.TemporaryDirectory(prefix="mbtune-bench-inductor-") as cache:
        env = {"TORCHINDUCTOR_CACHE_DIR": cache}
        print("priming the inductor cache (untimed trial) ...", flush=True)
        priming = cli_trial(ARGS, env)
        runs = []
        for i in range(opts.trials):
            r = cli_trial(ARGS, env)
            runs.append(r)
            print(f"trial {i + 1}/{opts.trials}: {r['samples_per_s']:,.1f} samples/s", flush=True)

    speeds = [r["samples_per_s"] for r in runs]
    median = statistics.median(speeds)
    spread = cv(speeds)
    rows = [
        (
            i + 1,
            r["samples_per_s"],
            r["step_time_ms_median"],
            r["step_time_ms_iqr"],
            r["compile_s"],
            r["wall_s"],
            r["busy_before"],
        )
        for i, r in enumerate(runs)
    ]
    print()
    print("quickstart GPT, batch_size 32, micro_batch_size 8, compile on, fresh process each")
    print(
        table(
            ["trial", "samples/s", "step ms", "IQR ms", "compile s", "wall s", "busy"],
            rows,
        )
    )
    met = spread <= TARGET_CV
    print(
        f"\nmedian {median:,.1f} samples/s, min {min(speeds):,.1f}, max {max(speeds):,.1f}, "
        f"CV {spread:.1%} (target <= {TARGET_CV:.0%}: {'met' if met else 'NOT met'})"
    )
    path = save(
        NAME,
        info,
        {
            "command": "mbtune trial experiments/quickstart.yaml " + " ".join(ARGS) + " --json",
            "compile": True,
            "target_cv": TARGET_CV,
            "samples_per_s": speeds,
            "median_samples_per_s": median,
            "cv": spread,
            "target_met": met,
            "priming_trial": priming,
            "trials": runs,
        },
    )
    print(f"raw figures: {path}")


if __name__ == "__main__":
    main()
