"""The overhead of Ray Tune and Optuna: `mbtune run` against a plain loop over the same trials.

Method. A fixed set of configurations (the quickstart GPT on one device, micro-batch sizes
2, 4, 8, 16 and 32, compiled as in the quickstart) is measured three ways: (1) a plain
loop in one process calling `mbtune.trial.trial.run_trial` for each configuration (with
`torch._dynamo.reset()` between trials); (2) a plain loop that runs each trial in a
fresh process exactly as a search does (`mbtune.trial.launch.measure_in_subprocess`), with no
Ray and no Optuna; (3) `mbtune run` with the `grid` sampler over exactly those
configurations: Ray started embedded, Optuna's storage, every trial in its own process.
One untimed pass of (1) fills the compile cache first, so every arm compiles from a warm
cache. Five rounds (``--rounds``) run the three arms side by side; the ratio is taken
within each round and the median of those ratios is reported (the machine is shared and
its speed drifts between rounds more than within one). (3)/(2)
is the cost of Ray Tune and Optuna; (3)/(1) adds the cost of one process per trial,
which the trial protocol requires (an OOM or a crash must not take the search down).

Target: at most 1.3x. Run: `.venv/bin/python bench/search_overhead.py [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

from _common import EXHAUSTIVE_GRID, QUICKSTART, ROOT, machine, quickstart_run, save

SIZES = [2, 4, 8, 16, 32]
OVERRIDES = [
    "search.space.num_devices=[1]",
    f"search.space.micro_batch_size={SIZES}",
    *EXHAUSTIVE_GRID,  # every one of SIZES, as the loops run them: no stop on confidence
]


def plain_loop() -> float:
    import torch._dynamo

    from mbtune.config.load import load_experiment
    from mbtune.lattice import BatchConfig
    from mbtune.trial.trial import run_trial

    started = time.perf_counter()
    exp = load_experiment(QUICKSTART, OVERRIDES)
    for m in SIZES:
        torch._dynamo.reset()
        result = run_trial(exp, BatchConfig(exp.train_input.batch_size, 1, m))
        assert result.status == "ok", result.reason
    return time.perf_counter() - started


def subprocess_loop() -> float:
    from mbtune.config.load import load_experiment
    from mbtune.lattice import BatchConfig
    from mbtune.trial.launch import measure_in_subprocess
    from mbtune.trial.trial import TrialRequest

    started = time.perf_counter()
    exp = load_experiment(QUICKSTART, OVERRIDES)
    for m in SIZES:
        config = BatchConfig(exp.train_input.batch_size, 1, m)
        request = TrialRequest(experiment=exp, config=config)
        result = measure_in_subprocess(request, cwd=str(ROOT))
        assert result["status"] == "ok", result["reason"]
    return time.perf_counter() - started


def with_mbtune() -> float:
    with tempfile.TemporaryDirectory() as out:
        return quickstart_run(out, *OVERRIDES, quiet=True)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    info = machine()
    plain_loop()  # fills the compile cache: every arm below starts warm
    rounds = [(plain_loop(), subprocess_loop(), with_mbtune()) for _ in range(args.rounds)]
    plain, processes, tuned = (statistics.median(r[i] for r in rounds) for i in range(3))
    result = {
        "configurations": len(SIZES),
        "in_process_loop_s": [r[0] for r in rounds],
        "process_per_trial_loop_s": [r[1] for r in rounds],
        "mbtune_run_s": [r[2] for r in rounds],
        "ray_and_optuna_ratio_per_round": [r[2] / r[1] for r in rounds],
        "ray_and_optuna_ratio": statistics.median(r[2] / r[1] for r in rounds),
        "total_ratio": statistics.median(r[2] / r[0] for r in rounds),
        "ray_and_optuna_s_per_trial": (tuned - processes) / len(SIZES),
        "process_s_per_trial": (processes - plain) / len(SIZES),
    }
    print(json.dumps(result, indent=1))
    save("search_overhead", info, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
