"""The overhead of Ray Tune and Optuna: `mbtune run` against a plain loop over the same trials.

Method. A fixed set of configurations (the quickstart GPT on one device, micro-batch sizes
2, 4, 8, 16 and 32, compiled as in the quickstart) is measured four ways: (1) a plain
loop in one process calling `mbtune.trial.trial.run_trial` for each configuration (with
`torch._dynamo.reset()` between trials); (2) a plain loop that runs each trial in a
process of its own exactly as a search does (`mbtune.trial.launch.measure_in_subprocess`:
a child forked from a warm parent, mbtune.trial.warm), with no Ray and no Optuna; (2c)
the same loop with ``MBTUNE_COLD_TRIALS=1``, each trial a fresh Python (as every trial was
before warm parents); (3) `mbtune run` with the `grid` sampler over exactly those
configurations: Ray started embedded, Optuna's storage, every trial in its own process.
One untimed pass of (1) fills the compile cache first, so every arm compiles from a warm
cache. Five rounds (``--rounds``) run the arms side by side; the ratio is taken
within each round and the median of those ratios is reported (the machine is shared and
its speed drifts between rounds more than within one). (3)/(2)
is the cost of Ray Tune and Optuna; (3)/(1) adds the cost of one process per trial,
which the trial protocol requires (an OOM or a crash must not take the search down);
(2c)/(2) is what a warm parent saves.

Target: at most 1.3x. Run: `.venv/bin/python bench/search_overhead.py [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

from _common import EXHAUSTIVE_GRID, QUICKSTART, ROOT, loadavg, machine, quickstart_run, save

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


def subprocess_loop(cold: bool = False) -> float:
    """Arm (2), or with ``cold`` (2c: MBTUNE_COLD_TRIALS, a fresh Python per trial), in a
    fresh process, as a search's trial actor starts with no warm parent: the loop's time
    there (its warm parent's start included)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "MBTUNE_COLD_TRIALS"}
    if cold:
        env["MBTUNE_COLD_TRIALS"] = "1"
    done = subprocess.run([sys.executable, __file__, "--loop"], env=env, cwd=ROOT, check=True,
                          capture_output=True, text=True)  # fmt: skip
    return float(done.stdout.split()[-1])


def loop_here() -> None:
    """Arm (2) in this process: each trial through measure_in_subprocess; prints its time."""
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
    print(time.perf_counter() - started)


def with_mbtune() -> float:
    with tempfile.TemporaryDirectory() as out:
        return quickstart_run(out, *OVERRIDES, quiet=True)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loop", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.loop:
        loop_here()
        return 0
    info = machine()
    plain_loop()  # fills the compile cache: every arm below starts warm
    rounds = []
    for i in range(args.rounds):
        load = loadavg()
        rounds.append((plain_loop(), subprocess_loop(), subprocess_loop(cold=True),
                       with_mbtune(), load))  # fmt: skip
        print(f"round {i + 1} (load {load}): (1) {rounds[-1][0]:.1f} s, (2) {rounds[-1][1]:.1f} "
              f"s, (2c) {rounds[-1][2]:.1f} s, (3) {rounds[-1][3]:.1f} s", flush=True)  # fmt: skip
    plain, processes, cold, tuned = (statistics.median(r[i] for r in rounds) for i in range(4))
    result = {
        "configurations": len(SIZES),
        "loadavg_per_round": [r[4] for r in rounds],
        "in_process_loop_s": [r[0] for r in rounds],
        "process_per_trial_loop_s": [r[1] for r in rounds],
        "cold_process_per_trial_loop_s": [r[2] for r in rounds],
        "mbtune_run_s": [r[3] for r in rounds],
        "ray_and_optuna_ratio_per_round": [r[3] / r[1] for r in rounds],
        "ray_and_optuna_ratio": statistics.median(r[3] / r[1] for r in rounds),
        "total_ratio": statistics.median(r[3] / r[0] for r in rounds),
        "cold_over_warm_ratio": statistics.median(r[2] / r[1] for r in rounds),
        "ray_and_optuna_s_per_trial": (tuned - processes) / len(SIZES),
        "process_s_per_trial": (processes - plain) / len(SIZES),
        "cold_process_s_per_trial": (cold - plain) / len(SIZES),
    }
    print(json.dumps(result, indent=1))
    save("search_overhead", info, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
