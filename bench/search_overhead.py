"""The overhead of Ray Tune and Optuna: `mbtune run` against a plain loop over the same trials.

Method. A fixed set of configurations (the quickstart GPT on one device, micro-batch sizes
2, 4, 8, 16 and 32, compiled as in the quickstart) is measured twice, interleaved in
that order: (1) a plain loop in one process calling `mbtune.trial.run_trial` for each
configuration (with `torch._dynamo.reset()` between trials, so every trial compiles as it
would in a fresh process), and (2) `mbtune run` with the `grid` sampler over exactly
those configurations: Ray started embedded, every trial in its own process. Two rounds
run interleaved; the faster wall time of each side is compared.

Target: at most 1.3x. Run: `.venv/bin/python bench/search_overhead.py`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MBTUNE = Path(sys.executable).with_name("mbtune")
SIZES = [2, 4, 8, 16, 32]
OVERRIDES = [
    "search.space.num_devices=[1]",
    f"search.space.micro_batch_size={SIZES}",
    "search.sampler=grid",
    "search.num_samples=100",
]


def plain_loop() -> float:
    import torch._dynamo

    from mbtune.config import load_experiment
    from mbtune.lattice import BatchConfig
    from mbtune.trial import run_trial

    started = time.perf_counter()
    exp = load_experiment(ROOT / "experiments" / "quickstart.yaml", OVERRIDES)
    for m in SIZES:
        torch._dynamo.reset()
        result = run_trial(exp, BatchConfig(exp.train_input.batch_size, 1, m))
        assert result.status == "ok", result.reason
    return time.perf_counter() - started


def with_mbtune() -> float:
    with tempfile.TemporaryDirectory() as out:
        sets = [x for o in (*OVERRIDES, f"output_dir={out}") for x in ("--set", o)]
        started = time.perf_counter()
        subprocess.run(
            [MBTUNE, "run", "experiments/quickstart.yaml", *sets],
            cwd=ROOT,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        return time.perf_counter() - started


def main() -> int:
    rounds = [(plain_loop(), with_mbtune()) for _ in range(2)]
    plain = min(p for p, _ in rounds)
    tuned = min(t for _, t in rounds)
    result = {
        "configurations": len(SIZES),
        "plain_loop_s": [p for p, _ in rounds],
        "mbtune_run_s": [t for _, t in rounds],
        "ratio_best_of_each": tuned / plain,
        "overhead_per_trial_s": (tuned - plain) / len(SIZES),
    }
    print(json.dumps(result, indent=1))
    (HERE / "results").mkdir(exist_ok=True)
    (HERE / "results" / "search_overhead.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
