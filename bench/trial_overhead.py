"""Trial overhead: a trial's wall time vs the model's bare timed loop for the same steps.

Method: in one process, compile off, the quickstart's small GPT at batch_size 32,
num_devices 1, micro_batch_size 8 (4 micro-batches per step). Two ways to do the same
work, alternated for R = 5 rounds (the order flips every round, so drift on the shared
machine hits both alike), after one untimed run of each (lazy imports, allocator):

  trial  ``run_trial(exp, BatchConfig(32, 1, 8))``; its ``TrialResult.wall_s``
         (build, data, the first step, warm-up and timed steps, bookkeeping);
  bare   a minimal hand-written loop timed with perf_counter from the start: build the
         same model with ``mbtune.models.build.build_model``, make the same data, slice the same
         micro-batches, AdamW, then 1 + warmup_steps untimed steps (the trial's first step
         plus its warm-up) and measure_steps timed ones, each micro-batch loss weighted by
         its share of the batch.

Before each round the script waits (up to 30 s) for the shared machine to be nearly idle.

Reported: the median wall time of each, their ratio (trial / bare), the median of the
per-round ratios, and both median step times (a check that both time the same work).
As a diagnostic, each round also times one full ``gc.collect()`` in this process: a CUDA
trial ends with one (``mbtune.trial.memory.release``; a CPU trial's process ends instead) and
the bare loop does not.

Target: trial wall time <= 1.2x the bare loop (compile off, so there is no compile time
to set aside).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from _common import QUICKSTART, machine, save, table, wait_for_quiet

from mbtune.config.load import load_experiment
from mbtune.lattice import BatchConfig
from mbtune.models.build import build_model
from mbtune.trial.trial import run_trial

NAME = "trial_overhead"
TARGET_RATIO = 1.2
CONFIG = BatchConfig(32, 1, 8)


def bare_loop(exp, config: BatchConfig) -> tuple[float, float]:
    """(wall seconds, median timed step seconds) of the hand-written loop."""
    t0 = time.perf_counter()
    spec = build_model(exp.model.name, exp.model.options, seed=exp.search.seed)
    module = spec.module
    module.train()
    p = config.per_device_batch
    data = spec.make_batch(p, torch.device("cpu"))
    batches, start = [], 0
    for m in config.micro_batch_sizes:
        batches.append(tuple(t[start : start + m] for t in data))
        start += m
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)

    def step() -> None:
        for batch in batches:
            (spec.loss_fn(module, batch) * (len(batch[0]) / p)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(1 + exp.trial.warmup_steps):
        step()
    steps = []
    for _ in range(exp.trial.measure_steps):
        s0 = time.perf_counter()
        step()
        steps.append(time.perf_counter() - s0)
    return time.perf_counter() - t0, statistics.median(steps)


def trial(exp, config: BatchConfig) -> tuple[float, float]:
    r = run_trial(exp, config)
    if r.status != "ok":
        raise SystemExit(f"trial failed: {r.status}: {r.reason}")
    return r.wall_s, r.step_time_ms_median / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each (default 5)")
    opts = parser.parse_args()
    info = machine()
    exp = load_experiment(QUICKSTART, ["trial.compile=false"])

    trial(exp, CONFIG)  # untimed: first-use costs of either path
    bare_loop(exp, CONFIG)
    runs: dict[str, list[tuple[float, float]]] = {"trial": [], "bare": []}
    gc_s, busy = [], []
    for i in range(opts.rounds):
        busy.append(wait_for_quiet())
        g0 = time.perf_counter()
        gc.collect()
        gc_s.append(time.perf_counter() - g0)
        order = ("trial", "bare") if i % 2 == 0 else ("bare", "trial")
        for name in order:
            runs[name].append((trial if name == "trial" else bare_loop)(exp, CONFIG))
        print(
            f"round {i + 1}/{opts.rounds}: trial {runs['trial'][-1][0]:.3f} s, "
            f"bare {runs['bare'][-1][0]:.3f} s",
            flush=True,
        )

    wall = {k: [w for w, _ in v] for k, v in runs.items()}
    step = {k: [s for _, s in v] for k, v in runs.items()}
    med = {k: statistics.median(v) for k, v in wall.items()}
    med_step = {k: statistics.median(v) for k, v in step.items()}
    ratio = med["trial"] / med["bare"]
    paired = statistics.median(t / b for t, b in zip(wall["trial"], wall["bare"], strict=True))
    med_gc = statistics.median(gc_s)
    met = ratio <= TARGET_RATIO

    print(
        f"\nquickstart GPT, batch_size {CONFIG.batch_size}, micro_batch_size "
        f"{CONFIG.micro_batch_size}, compile off, {exp.trial.warmup_steps} warm-up + "
        f"{exp.trial.measure_steps} timed steps (+1 first step), {opts.rounds} rounds"
    )
    rows = [
        (
            i + 1,
            wall["trial"][i],
            wall["bare"][i],
            wall["trial"][i] / wall["bare"][i],
            step["trial"][i] * 1e3,
            step["bare"][i] * 1e3,
            gc_s[i],
        )
        for i in range(opts.rounds)
    ]
    rows.append(
        (
            "median",
            med["trial"],
            med["bare"],
            ratio,
            med_step["trial"] * 1e3,
            med_step["bare"] * 1e3,
            med_gc,
        )
    )
    headers = [
        "round",
        "trial wall s",
        "bare wall s",
        "ratio",
        "trial step ms",
        "bare step ms",
        "gc s",
    ]
    print(table(headers, rows))
    print(
        f"\ntrial / bare: {ratio:.3f}x of medians, {paired:.3f}x median per-round ratio "
        f"(target <= {TARGET_RATIO}x: {'met' if met else 'NOT met'})\n"
        f"one gc.collect() here: {med_gc:.3f} s median; trial - bare: "
        f"{med['trial'] - med['bare']:.3f} s; (trial - gc.collect) / bare: "
        f"{(med['trial'] - med_gc) / med['bare']:.3f}x"
    )
    path = save(
        NAME,
        info,
        {
            "config": CONFIG.as_dict(),
            "compile": False,
            "rounds": opts.rounds,
            "target_ratio": TARGET_RATIO,
            "wall_s": wall,
            "step_s_median": step,
            "median_wall_s": med,
            "median_step_s": med_step,
            "ratio_of_medians": ratio,
            "median_paired_ratio": paired,
            "target_met": met,
            "gc_collect_s": gc_s,
            "median_gc_collect_s": med_gc,
            "busy_before_round": busy,
        },
    )
    print(f"raw figures: {path}")


if __name__ == "__main__":
    main()
