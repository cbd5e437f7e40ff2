"""Run-to-run noise of a search's own measurements: the quickstart grid, run again and again.

Method. `mbtune run experiments/quickstart.yaml` with `search.sampler=grid` (every one of
its 11 distinct configurations once, no confidence stop) runs ``--runs`` times (default
4) back to back, each a whole search as a user runs it: embedded Ray, one trial process
per configuration, one CPU thread per trial. For each configuration the spread of log
samples/s across the runs is taken robustly (1.4826 x the median absolute deviation from
its median: a few slow outliers do not decide it) and the median of those spreads over
the configurations is reported; also the quantiles of every measurement's deviation from
its configuration's median, and each run's best configuration.

This is the noise a search's confidence score must allow beyond what a trial's own step
times show (`search.noise_floor`): a trial's steps all run within a second or two, and
share whatever state the process and the machine are in.
Run: `.venv/bin/python bench/search_noise.py [--runs 4]`.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile

from _common import EXHAUSTIVE_GRID, machine, quickstart_run, save, trial_rows


def grid_run() -> dict[tuple[int, int], float]:
    with tempfile.TemporaryDirectory() as out:
        _, run_dir = quickstart_run(out, *EXHAUSTIVE_GRID, quiet=True)
        return {
            (int(r["num_devices"]), int(r["micro_batch_size"])): float(r["samples_per_s"])
            for r in trial_rows(run_dir)
            if r["status"] == "ok"
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    args = parser.parse_args()
    info = machine()
    runs = [grid_run() for _ in range(args.runs)]
    configs = sorted(set.intersection(*(set(r) for r in runs)))
    spreads, deviations = {}, []
    for c in configs:
        logs = [math.log(r[c]) for r in runs]
        centre = statistics.median(logs)
        spreads[c] = 1.4826 * statistics.median(abs(x - centre) for x in logs)
        deviations += [x - centre for x in logs]
    deviations.sort()
    quantiles = {q: deviations[round(q * (len(deviations) - 1))] for q in (0.05, 0.25, 0.75, 0.95)}
    result = {
        "runs": args.runs,
        "samples_per_s": {str(c): [r[c] for r in runs] for c in configs},
        "robust_sd_per_configuration": {str(c): s for c, s in spreads.items()},
        "median_robust_sd": statistics.median(spreads.values()),
        "deviation_quantiles": {str(q): v for q, v in quantiles.items()},
        "best_per_run": [str(max(r, key=r.__getitem__)) for r in runs],
    }
    print(json.dumps(result, indent=1))
    save("search_noise", info, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
