"""Calibration of the confidence score: is a score of 90 right nine times in ten?

Method. On replay landscapes (samples/s per configuration; empty where out of memory),
a search runs trial by trial in-process, exactly as `mbtune run` would drive it: the
searcher of `search.sampler` (`mbtune.search.make_searcher`, deduplication included)
proposes, each trial reports 5 step times with 3% seeded noise each (as `trial.noise:
0.03` replays them), and after every trial the reporter's confidence model
(`mbtune.recommend.confidence.assess`, the function `mbtune run` calls) recommends a configuration
and scores it. A recommendation is *right* when its true throughput is within 2% of the
landscape's best. Every (score, right) pair of every trial of every seed goes into
10-point bins: the reliability table compares each bin's mean score with how often it was
right. We also record, for a search that would stop at `confidence_target: 90`, how many
trials it needed and whether its recommendation was right.

Landscapes, in two sets:
- drawn: the four synthetic landscapes of bench/search_efficiency.py (saturating, dip,
  comm, bumpy) as families: every seed draws its own shape (where the micro-batch
  saturates, where memory runs out, how dear the all-reduce and the link are, where the
  dip is; `search_efficiency.drawn_landscapes`), so the 100 searches of a family are 100
  situations. This is the set the target is read on.
- fixed: the five landscapes of bench/search_efficiency.py as they are, gpt_cpu (measured
  on this machine) among them. The `model` sampler is deterministic, so the searches of
  one fixed landscape differ only by their noise: they repeat one situation, and a bin
  there stands for a handful of situations however many readings it holds (and its
  interval below is the noise's alone). Reported to show how the score behaves on the
  real landscape, not to read the target on.

Target: every bin with at least 30 readings within 10 points of its score; at the moment
a search reaches 90, right at least 90% of the time. Each gap comes with a 90% interval
from a bootstrap over the seeds (whole seeds resampled, as one search's readings and the
families of one seed are not independent): a bin of a few dozen readings moves by more
than 10 points from one set of seeds to the next.
Run: `.venv/bin/python bench/confidence_calibration.py [--seeds 100] [--sampler model]
[--landscapes drawn|fixed|both]` (about 4 minutes).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import warnings
from collections import defaultdict
from collections.abc import Iterable

from _common import BENCH, machine, save
from search_efficiency import drawn_landscapes, landscapes, replay_search

from mbtune.config.experiment import DEFAULT_NOISE_FLOOR
from mbtune.recommend.confidence import SearchModel, observation
from mbtune.runs.record import TrialRecord
from mbtune.search import settled

TARGET = 90
MAX_REPEATS = 3
MIN_BIN = 30
BOOTSTRAP = 1000
"""Resamples of the seeds behind each gap's 90% interval."""


def search(table, sampler: str, seed: int, drift: float = 0.0) -> list[tuple[int, int, bool, bool]]:
    """(trials so far, score, right, settled) after every trial of one search over
    ``table``. With ``drift``, each trial is off by one factor of that relative sd, the
    search may measure a configuration again (up to twice the table's size in trials), and
    its drift prior is the real machine's (as `trial.drift` replays it)."""
    best = max(v for v in table.values() if v)
    floor = DEFAULT_NOISE_FLOOR if drift else 0.0
    model = SearchModel(tuple(sorted({c.canonical() for c in table})), floor, True, seed)
    trials = 2 * len(table) if drift else None
    observations, out = [], []
    for i, _, result in replay_search(table, sampler, seed, drift=drift, noise_floor=floor,
                                      trials=trials):  # fmt: skip
        observations.append(observation(TrialRecord.from_result({**result, "trial": i})))
        a = model.assess(observations)
        if a.recommended is not None:
            looks = a.looks.get(a.recommended, 0)
            done = settled(a.confidence, looks, target=TARGET, max_repeats=MAX_REPEATS,
                           noise_floor=floor)  # fmt: skip
            out.append((i, a.confidence, table[a.recommended] >= 0.98 * best, done))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--sampler", default="model")
    parser.add_argument("--landscapes", choices=("fixed", "drawn", "both"), default="both")
    parser.add_argument(
        "--drift",
        type=float,
        default=0.0,
        help="each trial off by one factor of this relative sd (trial.drift)",
    )
    parser.add_argument(
        "--min-bin",
        type=int,
        default=MIN_BIN,
        help="readings a bin needs before it is held to the target",
    )
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    sets = {"fixed": landscapes, "drawn": drawn_landscapes}
    results: dict[str, dict] = {"sampler": args.sampler}
    for kind, make in sets.items():
        if args.landscapes in (kind, "both"):
            print(f"\n=== {kind} landscapes ===")
            results[kind] = calibrate(make(), args.sampler, args.seeds, args.drift, args.min_bin)
    name = "confidence_calibration" + ("" if args.sampler == "model" else f"_{args.sampler}")
    name += f"_drift{args.drift}" if args.drift else ""
    out = save(name, machine(), results)
    print(f"\nraw figures: {out.relative_to(BENCH.parent)}")
    return 0


def calibrate(
    tables: dict, sampler: str, seeds: int, drift: float = 0.0, min_bin: int = MIN_BIN
) -> dict[str, dict]:
    """The reliability table of every landscape and of them all, and where searches stop."""
    results: dict[str, dict] = {}
    # readings by seed: a bin's interval resamples whole seeds (one seed's readings are
    # one search's trials, and the drawn families of one seed share their shape)
    everything: dict[int, list[tuple[int, bool]]] = defaultdict(list)
    for name, table_for in tables.items():
        readings: dict[int, list[tuple[int, bool]]] = defaultdict(list)
        stops = []
        for seed in range(seeds):
            trace = search(table_for(seed), sampler, seed, drift)
            for _, score, right, _ in trace:
                readings[seed].append((score, right))
                everything[seed].append((score, right))
            stop = next(((i, right) for i, _, right, done in trace if done), None)
            stops.append(stop)
        reached = [s for s in stops if s]
        results[name] = {
            "size": len(table_for(0)),
            "bins": _table(readings),
            "stop_reached": len(reached),
            "stop_right": sum(right for _, right in reached),
            "stop_trials_median": statistics.median(i for i, _ in reached) if reached else None,
            "seeds": seeds,
        }
        _print(name, results[name], min_bin)
    results["all"] = {"bins": _table(everything)}
    _print("all landscapes", results["all"], min_bin)
    return results


def _bin(score: int) -> int:
    return min(score // 10, 9)


def _gaps(readings: Iterable[tuple[int, bool]]) -> dict[int, tuple[int, float, float]]:
    """Per bin: readings, mean score, and right minus mean score (points)."""
    bins: dict[int, list[tuple[int, bool]]] = defaultdict(list)
    for score, right in readings:
        bins[_bin(score)].append((score, right))
    out = {}
    for b, pairs in bins.items():
        mean_score = statistics.fmean(s for s, _ in pairs)
        out[b] = (len(pairs), mean_score, 100 * statistics.fmean(r for _, r in pairs) - mean_score)
    return out


def _table(by_seed: dict[int, list[tuple[int, bool]]]) -> list[dict]:
    """The reliability table, with each gap's 90% interval from a bootstrap over seeds."""
    seeds = sorted(by_seed)
    point = _gaps(r for s in seeds for r in by_seed[s])
    rng = random.Random(0)
    resampled: dict[int, list[float]] = defaultdict(list)
    for _ in range(BOOTSTRAP):
        drawn = rng.choices(seeds, k=len(seeds))
        for b, (_, _, gap) in _gaps(r for s in drawn for r in by_seed[s]).items():
            resampled[b].append(gap)
    rows = []
    for b in sorted(point):
        samples, mean_score, gap = point[b]
        gaps = sorted(resampled[b])
        low, high = (gaps[int(q * (len(gaps) - 1))] for q in (0.05, 0.95))
        right = gap + mean_score
        rows.append({"bin": f"{10 * b}-{10 * b + 9}", "samples": samples,
                     "mean_score": round(mean_score, 1), "right_percent": round(right, 1),
                     "gap": round(gap, 1), "gap_90": [round(low, 1), round(high, 1)]})  # fmt: skip
    return rows


def _print(name: str, r: dict, min_bin: int) -> None:
    print(f"\n{name}" + (f": {r['size']} configurations" if "size" in r else ""))
    head = f"{'score':>6} {'samples':>8} {'mean score':>11} {'right %':>8} {'gap':>6}"
    print(f"  {head} {'90% interval':>14}")
    for row in r["bins"]:
        flag = "" if row["samples"] < min_bin or abs(row["gap"]) <= 10 else "  <- off by > 10"
        low, high = row["gap_90"]
        print(f"  {row['bin']:>6} {row['samples']:>8} {row['mean_score']:>11.1f} "
              f"{row['right_percent']:>8.1f} {row['gap']:>+6.1f} {low:>+6.1f} to {high:>+5.1f}"
              f"{flag}")  # fmt: skip
    if "stop_reached" in r:
        print(f"  reached {TARGET} in {r['stop_reached']}/{r['seeds']} searches, median "
              f"{r['stop_trials_median']} trials; right at that moment in {r['stop_right']}"
              f"/{r['stop_reached']}")  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
