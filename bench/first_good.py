"""The good configuration early: when does a search first measure a near-best configuration,
and where does it stop?

Method. On the replay landscapes of bench/search_efficiency.py (gpt_cpu, saturating, dip,
comm, bumpy), a search runs trial by trial as `mbtune run` drives it, up to where it would
stop (`search_efficiency.stopping_search`: the searcher of `search.sampler`, the run's
reporter after every trial, the trial log's rule for the stop): each trial reports 5 step
times with 3% seeded noise, all of them off by one factor of relative sd `--drift` (as
`trial.drift` replays them; 0.035 by default, the drift measured between a real search's
trials), with the search model's drift prior the real machine's (`search.noise_floor`
0.035; 0 where `--drift 0`, as a replay without drift), `search.max_repeats` the code's
default, and a budget of twice the lattice (the lattice alone without drift). Per
landscape, over the seeds: the trial at which a configuration whose true throughput is
within 2% of the best was first measured (median and 75th percentile; a search that
never measured one counts as its budget + 1), the trials to the end (median), and how
many searches stopped at 90 and were right (within 2% of the best).

With `--before REV [REV ...]` the same searches run with the code of each REV too (a git worktree of
it, its `mbtune` first on PYTHONPATH, these bench scripts), side by side: the first
within-2% trial was 4, 4, 3 and 3 trials on four landscapes before the careful stops of
issue 29 (`--before 'ffff2a8^'`), 7, 8, 5 and 3 after them (issue 39).

Run: `.venv/bin/python bench/first_good.py [--seeds 30] [--drift 0.035] [--before REV ...]
[--tag T]`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

from _common import BENCH, ROOT, machine, save
from search_efficiency import landscapes, replayed, stopping_search

from mbtune.config.experiment import DEFAULT_NOISE_FLOOR
from mbtune.search import make_searcher

try:
    from mbtune.config.search import SearchConfig
except ImportError:  # --before an older revision: the search section was in the schema
    from mbtune.config.schema import SearchConfig

TARGET = 90
RIGHT = 0.98
"""Right, and near-best: within 2% of the best."""


def search(table: dict, seed: int, drift: float) -> dict:
    """One search over ``table`` to where `mbtune run` would stop it: the trial of the
    first near-best measurement, the trials, and the stop."""
    best = max(v for v in table.values() if v)
    budget = 2 * len(table) if drift else len(table)
    searcher = make_searcher("model", list(table), seed=seed,
                             noise_floor=DEFAULT_NOISE_FLOOR if drift else 0.0, target=TARGET,
                             max_repeats=SearchConfig.max_repeats, budget=budget)  # fmt: skip
    rng = random.Random(seed)
    first, last = None, None
    trials = stopping_search(searcher, lambda c, _: replayed(c, table[c], rng, drift=drift),
                             budget=budget, target=TARGET,
                             max_repeats=SearchConfig.max_repeats)  # fmt: skip
    for t in trials:
        if first is None and (table[t.config.canonical()] or 0.0) >= RIGHT * best:
            first = t.number
        last = t
    stopped = last is not None and last.settled and not last.tie and last.confidence >= TARGET
    right = last is not None and last.recommended is not None and (
        (table[last.recommended] or 0.0) >= RIGHT * best)  # fmt: skip
    return {"seed": seed, "first_good": first or budget + 1, "trials": last.number if last else 0,
            "stopped_at_target": stopped, "right": right}  # fmt: skip


def measure(seeds: list[int], drift: float) -> dict[str, dict]:
    """Every landscape's searches, and their figures."""
    out = {}
    for name, table_for in landscapes().items():
        runs = [search(table_for(seed), seed, drift) for seed in seeds]
        firsts = [r["first_good"] for r in runs]
        stops = [r for r in runs if r["stopped_at_target"]]
        p75 = statistics.quantiles(firsts, n=4)[2] if len(firsts) > 1 else firsts[0]
        out[name] = {
            "first_good_median": statistics.median(firsts),
            "first_good_p75": p75,
            "trials_median": statistics.median(r["trials"] for r in runs),
            "stops_at_target": len(stops),
            "stops_right": sum(r["right"] for r in stops),
            "runs": runs,
        }
    return out


def before(rev: str, args: argparse.Namespace) -> dict[str, dict]:
    """The same searches with the code of ``rev``: this script in a child process whose
    ``mbtune`` is a worktree's."""
    with tempfile.TemporaryDirectory() as tmp:
        tree, out = Path(tmp) / "tree", Path(tmp) / "before.json"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT,
                       check=True, capture_output=True)  # fmt: skip
        try:
            env = {**os.environ, "PYTHONPATH": str(tree)}
            subprocess.run([sys.executable, __file__, "--seeds", str(args.seeds), "--drift",
                            str(args.drift), "--child", str(out)], check=True, env=env)  # fmt: skip
            return json.loads(out.read_text())
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           check=False, capture_output=True)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--drift", type=float, default=0.035)
    parser.add_argument("--before", metavar="REV", nargs="*", default=[],
                        help="the same searches with each REV's code")  # fmt: skip
    parser.add_argument("--tag", default="", help="appended to the raw figures' file name")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # --before's child: its figures
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    seeds = list(range(args.seeds))
    if args.child:
        Path(args.child).write_text(json.dumps(measure(seeds, args.drift)))
        return 0
    info = machine()
    sides = {rev: before(rev, args) for rev in args.before}
    sides["now"] = measure(seeds, args.drift)
    print(f"{args.seeds} seeds, drift {args.drift}; first within-2% trial median (p75), trials "
          f"to the end median, stops at {TARGET} right")  # fmt: skip
    for name in sides["now"]:
        cells = []
        for label, side in sides.items():
            r = side[name]
            cells.append(f"{label}: {r['first_good_median']:g} ({r['first_good_p75']:g}), "
                         f"{r['trials_median']:g} trials, {r['stops_right']}/"
                         f"{r['stops_at_target']} right")  # fmt: skip
        print(f"  {name:<11} " + "   ".join(cells))
    name = f"first_good_drift{args.drift}" + (f"_{args.tag}" if args.tag else "")
    out = save(name, info, {"settings": vars(args), **sides})
    print(f"raw figures: {out.relative_to(BENCH.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
