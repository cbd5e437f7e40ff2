"""Close calls: does a search on a drifting machine reach its target, and is it right?

Method. A search runs in-process exactly as `mbtune run` drives one, with the real
pieces (`search_efficiency.stopping_search`): the searcher of `search.sampler`
(`mbtune.search.make_searcher`, re-measurement included), each trial replayed by the
trial engine (`mbtune.trial.trial.trial_metrics`, `backend: replay`) with `trial.noise`
per step and `trial.drift` (one seeded factor per trial), and after every trial the
run's reporter scores the recommendation; the search stops where `mbtune run` stops it
(`mbtune.search.settled`, via the trial log's rule: the score at its target and the
leader measured twice), when the searcher has nothing left, or at `search.num_samples`.
Whatever stopping logic the searcher gains is picked up as it is. A recommendation is
*right* when its true throughput is within 2% of the landscape's best. Seeds vary the
replay's noise and drift and the sampler (and, for drawn landscapes, the landscape).

Landscapes (`--landscape`; each with its own defaults for seeds, noise and drift):
- measured (default): bench/landscapes/close_call.csv, the quickstart GPT measured on
  this machine (gpt_cpu.csv) with its runner-up moved to exactly 4% below the best
  (num_devices 2, micro_batch_size 4: 834.8 samples/s; then micro_batch_size 8: 802.7).
  10 seeds, noise 0.03, drift 0.035. Target (issue 19): at least 8 of 10 seeds reach
  confidence 90, and at least 90% of those are right.
- close: issue 29's close call with drift: close_call.csv with the top two 4% apart and
  the next two 6% and 10% below the best; 50 seeds, noise 0.01, drift 0.035.
- drawn-close: close calls you did not tune on: every seed draws its own landscape on
  the quickstart's lattice (`search_efficiency.close_call`: which configuration is best
  varies, the runner-up 3-5% below it, the next two 5.5-7% and 8-12%); 50 seeds, noise
  0.01, drift 0.035. Use `--first-seed 1000` (say) for a held-out range.
  Target for close and drawn-close (issue 29): at least 90% of seeds reach 90, and at
  least 95% of the searches that reach 90 are right; the hit rate among the shortest
  third of those searches (by trials to the stop) is reported with the others.
- fewer-devices: the best at 2 of 8 devices, a slow link making 4 and 8 devices 8% and
  32% slower (`search_efficiency.fewer_devices`; the rest of the shape drawn per seed),
  34 configurations; 20 seeds, noise 0.03, drift 0.035. Target (issue 29): no search
  stops at 90 on a configuration more than 2% off the best (each such stop is listed).
- rivals: several near rivals (issue 39): one dimension (the micro-batch size, 1 to 64,
  on 2 devices at batch_size 128), drawn per seed (`rivals`: a smooth shape saturating or
  peaking in m), the best 3-7% ahead of two or three rivals (drawn), the rest at least 2%
  below the last of them; 50 seeds, noise 0.01, drift 0.035. The issue's case (the best
  4% and 6% ahead of two rivals) is one draw of it; `--gaps 0.04 0.06` fixes the gaps.
  Target: as close (at least 95% of the stops at 90 right), read on seeds not tuned on
  (`--first-seed 1000`).
- busy: issue 29's quickstart on a busy machine: the quickstart's lattice measured on
  this machine (close_call.csv's n = 1 as it is) with every micro-batch size on 2 devices
  within 2% of the best (drawn per seed), the step noise and the drift of a machine with
  another job on its cores (noise 0.05, drift 0.07), `search.num_samples` 16 as the
  quickstart's; 30 seeds. Target (issue 29): every search ends within 12 trials, at 90
  or on a tie it names.
`search.num_samples` is 24, or twice the lattice's size where that is more (busy: 16).

Run: `.venv/bin/python bench/close_calls.py [--landscape measured|close|drawn-close|
fewer-devices|busy|rivals] [--gaps F F] [--seeds N] [--first-seed 0] [--noise F]
[--drift F] [--sampler model] [--max-repeats N] [--tag T]`; `--quick` (10 seeds, raw
figures not saved) to iterate.
The exit status is 1 where the target is missed.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from _common import BENCH, machine, save
from search_efficiency import (
    by_thirds,
    close_call,
    fewer_devices,
    load_table,
    shaped,
    stopping_search,
    with_gaps,
    write_table,
)

from mbtune.config.load import parse_experiment
from mbtune.config.search import SearchConfig
from mbtune.lattice import BatchConfig, enumerate_configs
from mbtune.search import make_searcher, search_points
from mbtune.trial.trial import trial_metrics

TABLE = BENCH / "landscapes" / "close_call.csv"
TARGET = 90
RIGHT = 0.98
"""Right: within 2% of the best."""
QUICK_SEEDS = 10

Table = dict[BatchConfig, float | None]

LANDSCAPES: dict[str, dict] = {
    "measured": {"seeds": 10, "noise": 0.03, "drift": 0.035},
    "close": {"seeds": 50, "noise": 0.01, "drift": 0.035, "gaps": (0.04, 0.06, 0.10)},
    "drawn-close": {"seeds": 50, "noise": 0.01, "drift": 0.035},
    "fewer-devices": {"seeds": 20, "noise": 0.03, "drift": 0.035},
    "busy": {"seeds": 30, "noise": 0.05, "drift": 0.07, "num_samples": 16},
    "rivals": {"seeds": 50, "noise": 0.01, "drift": 0.035},
}
RIVALS_POINTS = tuple(enumerate_configs(mode="auto", batch_sizes=[128], num_devices=[2]))
"""The rivals' one dimension: m = 1, 2, 4, ..., 64 on 2 devices, batch_size 128."""
BUSY_TRIALS = 12
"""The busy quickstart ends within this many trials (issue 29)."""


def busy(seed: int) -> Table:
    """The quickstart's landscape on a busy machine: 1 device as measured, every
    micro-batch size on 2 devices within 2% of the best (drawn per seed)."""
    rng = random.Random(4000 + seed)
    table = load_table(TABLE)
    on_two = [c for c, v in table.items() if v and c.num_devices == 2]
    top = max(table[c] or 0.0 for c in on_two)
    for c in on_two:
        table[c] = top * (1 - rng.uniform(0.0, 0.02))
    return table


def rivals(seed: int, gaps: Sequence[float] | None = None) -> Table:
    """Several near rivals in one dimension (issue 39): a smooth shape over m (saturating,
    or peaking at a middle m; sometimes memory for m <= 16 or 32 only), drawn again until
    its four fastest lie within 15%, then the best 3-7% ahead of two or three rivals (the
    next fastest, drawn gaps in order; ``gaps`` fixes them) and the rest at least 2%
    below the last (:func:`with_gaps`)."""
    rng = random.Random(6000 + seed)
    while True:
        table = shaped(
            RIVALS_POINTS,
            saturation=math.exp(rng.uniform(math.log(0.5), math.log(16))),
            oom_above=rng.choice([16, 32, None, None]),
            all_reduce_s=0.002,
            peak_at=rng.uniform(1.0, 4.5) if rng.random() < 0.5 else None,
            decline=rng.uniform(0.05, 0.2),
        )
        values = sorted((v for v in table.values() if v), reverse=True)
        if len(values) >= 4 and values[3] >= 0.85 * values[0]:
            break
    drawn = sorted(rng.uniform(0.03, 0.07) for _ in range(rng.choice([2, 3])))
    return with_gaps(table, gaps or drawn)


def table_for(landscape: str, gaps: Sequence[float] | None = None) -> Callable[[int], Table]:
    """The landscape as a function of the seed."""
    if landscape == "measured":
        measured = load_table(TABLE)
        return lambda seed: measured
    if landscape == "close":
        gapped = with_gaps(load_table(TABLE), LANDSCAPES["close"]["gaps"])
        return lambda seed: gapped
    if landscape == "drawn-close":
        return close_call
    if landscape == "busy":
        return busy
    if landscape == "rivals":
        return lambda seed: rivals(seed, gaps)
    return lambda seed: fewer_devices(seed, fastest=2, slower=(0.08, 0.32))


def experiment(table: Path, points: list[BatchConfig], seed: int, args: argparse.Namespace):
    (batch_size,) = {c.batch_size for c in points}
    return parse_experiment(
        {
            "name": "close-call",
            "model": "mlp",
            "train_input": {"batch_size": batch_size, "micro_batch_size": "auto"},
            "search": {
                "space": {
                    "num_devices": sorted({c.num_devices for c in points}),
                    "micro_batch_size": {"min": 1, "max": batch_size},
                },
                "sampler": args.sampler,
                "seed": seed,
                "confidence_target": TARGET,
                "max_repeats": args.max_repeats,
                "num_samples": args.num_samples
                or LANDSCAPES[args.landscape].get("num_samples", max(24, 2 * len(points))),
            },
            "trial": {
                "backend": "replay",
                "table": str(table),
                "noise": args.noise,
                "drift": args.drift,
                "measure_steps": 5,
            },  # fmt: skip
        }
    )


def search(exp, truth: Table) -> dict:
    """One search, trial by trial, to where `mbtune run` would stop it; what it
    recommended, when it stopped and why."""
    s = exp.search
    points = search_points(exp)
    assert set(points) == {c.canonical() for c in truth}, "the space is not the table's"
    searcher = make_searcher(
        s.sampler, points, seed=s.seed, noise_floor=exp.noise_floor,
        target=s.confidence_target, max_repeats=s.max_repeats, budget=s.num_samples,
    )  # fmt: skip

    def measure(config: BatchConfig, repeat: int) -> dict:
        return trial_metrics(exp, config, repeat=repeat)

    rule = {"target": s.confidence_target, "max_repeats": s.max_repeats}
    trials = list(stopping_search(searcher, measure, budget=s.num_samples, **rule))
    last = trials[-1]
    assert last.recommended is not None and last.assessment is not None
    best = max(v for v in truth.values() if v)
    value = truth[last.recommended] or 0.0
    configs = [t.config.canonical() for t in trials]
    why = ("tie" if last.tie else "settled") if last.settled else (
        "num_samples" if len(trials) >= s.num_samples else "nothing left")  # fmt: skip
    return {
        "trials": len(trials),
        "repeats": len(configs) - len(set(configs)),
        "confidence": last.confidence,
        "reached": last.on_target,
        "stopped": why,
        "recommended": last.recommended.sizes(),
        "best": max((c for c in truth if truth[c]), key=lambda c: truth[c] or 0.0).sizes(),
        "right": value >= RIGHT * best,
        "shortfall": round(1 - value / best, 4),
        "device_counts_measured": sorted({c.num_devices for c in configs}),
        "drift_estimate": round(last.assessment.drift, 4),
        "leader_looks": last.looks,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--landscape", choices=list(LANDSCAPES), default="measured")
    parser.add_argument("--seeds", type=int, default=None, help="default: the landscape's")
    parser.add_argument("--first-seed", type=int, default=0,
                        help="seeds first-seed.. (a held-out range: e.g. 1000)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_SEEDS} seeds")
    parser.add_argument("--noise", type=float, default=None, help="default: the landscape's")
    parser.add_argument("--drift", type=float, default=None, help="default: the landscape's")
    parser.add_argument("--sampler", default="model")
    parser.add_argument("--tag", default="", help="appended to the raw figures' file name")
    parser.add_argument("--gaps", type=float, nargs="+", default=None,
                        help="rivals: their gaps below the best (default: drawn)")  # fmt: skip
    parser.add_argument("--max-repeats", type=int, default=SearchConfig.max_repeats,
                        help="default: search.max_repeats's")  # fmt: skip
    parser.add_argument("--num-samples", type=int, default=None,
                        help="default 24, or twice the lattice where that is more")  # fmt: skip
    args = parser.parse_args()
    defaults = LANDSCAPES[args.landscape]
    args.noise = defaults["noise"] if args.noise is None else args.noise
    args.drift = defaults["drift"] if args.drift is None else args.drift
    n_seeds = args.seeds or (QUICK_SEEDS if args.quick else defaults["seeds"])
    seeds = range(args.first_seed, args.first_seed + n_seeds)
    warnings.simplefilter("ignore")
    info = machine()
    landscape = table_for(args.landscape, args.gaps)
    runs = []
    print(f"{args.landscape}: seeds {seeds[0]}..{seeds[-1]}, noise {args.noise}, drift "
          f"{args.drift}, sampler {args.sampler}")  # fmt: skip
    print(f"{'seed':>5} {'trials':>6} {'repeats':>7} {'score':>5} {'right':>5} {'short':>6} "
          f"{'recommended':>11} {'best':>6} {'n measured':>10} {'drift':>6}  stop")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            truth = landscape(seed)
            path = TABLE if args.landscape == "measured" else (
                write_table(truth, Path(tmp) / f"{args.landscape}-{seed}.csv"))  # fmt: skip
            r = search(experiment(path, sorted(truth), seed, args), truth)
            runs.append({"seed": seed, **r})
            rec, best = r["recommended"], r["best"]
            rec_text = f"n={rec['num_devices']} m={rec['micro_batch_size']}"
            best_text = f"{best['num_devices']},{best['micro_batch_size']}"
            print(f"{seed:>5} {r['trials']:>6} {r['repeats']:>7} {r['confidence']:>5} "
                  f"{'yes' if r['right'] else 'NO':>5} {100 * r['shortfall']:>5.1f}% "
                  f"{rec_text:>11} {best_text:>6} "
                  f"{','.join(map(str, r['device_counts_measured'])):>10} "
                  f"{r['drift_estimate']:>6.3f}  {r['stopped']}")  # fmt: skip
    summary = summarize(runs)
    ok = verdict(args.landscape, summary, runs)
    print(f"\nreached {TARGET}: {summary['reached_target']}/{len(runs)}; right when reached: "
          f"{summary['right_when_reached']}/{summary['reached_target']}; median trials "
          f"{summary['median_trials']}, repeats {summary['median_repeats']}")  # fmt: skip
    for label, t in summary["thirds"].items():
        if t["searches"]:
            print(f"  {label + ' third':<15} of those (trials {t['trials'][0]}-{t['trials'][1]}): "
                  f"right {t['right']}/{t['searches']}")  # fmt: skip
    if summary["tie_stops"]:
        print(f"  stopped on a tie instead: {len(summary['tie_stops'])} (seeds "
              f"{', '.join(map(str, summary['tie_stops']))})")  # fmt: skip
    worst = summary["worst_stop"]
    if worst:
        print(
            f"  worst stop at {TARGET}: {100 * worst['shortfall']:.1f}% short of the best "
            f"(seed {worst['seed']}, {worst['trials']} trials, score {worst['confidence']})"
        )
    for r in summary["off_stops"]:
        rec = r["recommended"]
        print(f"  stop at {TARGET} more than 2% off: seed {r['seed']}, n={rec['num_devices']} "
              f"m={rec['micro_batch_size']} at "
              f"{100 * (1 - r['shortfall']):.0f}% of the best after {r['trials']} trials, "
              f"score {r['confidence']}, device counts measured "
              f"{r['device_counts_measured']}")  # fmt: skip
    for line in summary["verdicts"]:
        print(line)
    default = args.landscape == "measured" and args.drift == 0.035 and args.sampler == "model"
    name = "close_calls" + (
        "" if default else f"_{args.landscape}_{args.sampler}_drift{args.drift}"
    )
    name += f"_seeds{seeds[0]}-{seeds[-1]}" if args.first_seed else ""
    name += f"_{args.tag}" if args.tag else ""
    if args.quick:
        print("\n--quick: raw figures not saved")
        return 0 if ok else 1
    out = save(name, info, {"settings": vars(args), "summary": summary, "runs": runs})
    print(f"raw figures: {out.relative_to(BENCH.parent)}")
    return 0 if ok else 1


def summarize(runs: list[dict]) -> dict:
    reached = [r for r in runs if r["reached"]]
    n = len(reached)
    thirds = by_thirds(reached, lambda r: (r["trials"], r["seed"]))
    return {
        "seeds": len(runs),
        "reached_target": n,
        "right_when_reached": sum(r["right"] for r in reached),
        "thirds": thirds,
        "worst_stop": max(reached, key=lambda r: r["shortfall"]) if reached else None,
        "off_stops": [r for r in reached if not r["right"]],
        "tie_stops": [r["seed"] for r in runs if r["stopped"] == "tie"],
        "median_trials": statistics.median(r["trials"] for r in runs),
        "median_repeats": statistics.median(r["repeats"] for r in runs),
    }


def verdict(landscape: str, summary: dict, runs: list[dict]) -> bool:
    """The landscape's target met or not; its lines go into ``summary['verdicts']``."""
    seeds = len(runs)
    reached, right = summary["reached_target"], summary["right_when_reached"]
    short = summary["thirds"]["shortest"]
    if landscape == "measured":
        checks = [
            (reached >= 0.8 * seeds, f"reach {TARGET} in >= 80% of seeds: {reached}/{seeds}"),
            (right >= 0.9 * reached, f"right in >= 90% of those: {right}/{reached}"),
        ]
    elif landscape == "busy":
        done = sum((r["reached"] or r["stopped"] == "tie") and r["trials"] <= BUSY_TRIALS
                   for r in runs)  # fmt: skip
        checks = [(done == seeds, f"end within {BUSY_TRIALS} trials at {TARGET} or on a tie: "
                                  f"{done}/{seeds}")]  # fmt: skip
    elif landscape == "fewer-devices":
        off = len(summary["off_stops"])
        checks = [(off == 0, f"no stop at {TARGET} more than 2% off the best: {off} such stops "
                             f"of {reached}")]  # fmt: skip
    else:
        checks = [
            (reached >= 0.9 * seeds, f"reach {TARGET} in >= 90% of seeds: {reached}/{seeds}"),
            (right >= 0.95 * reached, f"right in >= 95% of those: {right}/{reached}"),
        ]
    lines = [f"{'MET    ' if ok else 'NOT MET'} {text}" for ok, text in checks]
    if short["searches"]:
        lines.append(f"(reported) right in the shortest third of those: {short['right']}/"
                     f"{short['searches']}")  # fmt: skip
    summary["verdicts"] = lines
    return all(ok for ok, _ in checks)


if __name__ == "__main__":
    sys.exit(main())
