"""Search efficiency: how many trials each sampler needs to find a near-best configuration.

Method. Each landscape is a replay table (samples/s per configuration, empty where out
of memory). For every sampler and 30 seeds, the very searcher `mbtune run` uses
(`mbtune.search.make_searcher`, deduplication included) is driven in-process, one
trial at a time; each trial reports 5 step times with 3% seeded noise each and their
median, as a replayed trial would (out-of-memory configurations report `oom`). We
record the number of trials until a configuration whose *true* throughput is within 2%
of the landscape's best has been measured, and report the median over seeds (a search
that never finds one counts as the lattice size + 1).

Landscapes:
- gpt_cpu: measured on this machine with the quickstart GPT (bench/landscapes/gpt_cpu.csv,
  written by `bench/measure_landscape.py`);
- saturating: throughput rises with m and saturates, devices scale with a communication
  cost, and large micro-batches run out of memory (a cliff);
- dip: like saturating but with a dip in the middle of the m range (e.g. a kernel that
  switches algorithm), so the best lies past a worse region;
- comm: like saturating but with a slow link (a cost that grows with the devices), so
  that 4 devices beat 8;
- bumpy: saturating with an independent 6% (log-normal) bump on every configuration,
  drawn anew for every seed, so that neighbours say less about each other than any
  smooth model assumes.

Target: the default sampler needs at most a quarter of the lattice and at most half of
what `random` needs. Run: `.venv/bin/python bench/search_efficiency.py [--seeds 30]`.
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

from _common import BENCH, machine, save
from ray.tune.search import Searcher

from mbtune.lattice import BatchConfig, enumerate_configs
from mbtune.search import METRIC, make_searcher

SAMPLERS = ("model", "tpe", "gp", "random", "grid", "halving", "doubling")
NOISE = 0.03
"""Relative noise of each replayed step time (as `trial.noise: 0.03`)."""
STEPS = 5
"""Timed steps per trial (`trial.measure_steps`' default)."""


def synthetic(
    kind: str,
    *,
    saturation: float = 6.0,
    oom_above: int = 64,
    all_reduce_s: float = 0.004,
    link_s: float = 0.03,
    dip_at: float = 3.0,
    dip_depth: float = 0.35,
) -> dict[BatchConfig, float | None]:
    """A landscape over B = 512, n in 1..8, m the divisors of P (34 configurations).

    ``saturation``: the micro-batch at which a device runs at half its peak speed;
    ``oom_above``: the largest micro-batch that fits; ``all_reduce_s``: the bandwidth term
    of the all-reduce; ``link_s`` (comm): a latency per extra device; ``dip_at`` and
    ``dip_depth`` (dip): where, in octaves of m, the dip is and how deep."""
    points = enumerate_configs(mode="auto", batch_sizes=[512], num_devices=[1, 2, 4, 8])
    table: dict[BatchConfig, float | None] = {}
    for c in points:
        m, n = c.micro_batch_size, c.num_devices
        if m > oom_above:  # out of memory: a cliff
            table[c] = None
            continue
        per_device = 1000 * m / (m + saturation)  # saturating compute efficiency
        if kind == "dip":
            per_device *= 1 - dip_depth * math.exp(-((math.log2(m) - dip_at) ** 2) / 0.8)
        step = c.per_device_batch / per_device + all_reduce_s * (n - 1) / n * 8  # all-reduce
        if kind == "comm":
            step += link_s * (n - 1)  # a slow link: the all-reduce's latency term dominates
        table[c] = c.batch_size / step
    return table


def bumpy(seed: int, amplitude: float = 0.06, **shape: float) -> dict[BatchConfig, float | None]:
    rng = random.Random(1000 + seed)
    base = synthetic("saturating", **shape)
    return {c: v * math.exp(amplitude * rng.gauss(0, 1)) if v else None for c, v in base.items()}


def landscapes() -> dict[str, Callable[[int], dict[BatchConfig, float | None]]]:
    """Every landscape, as a function of the seed (only ``bumpy`` changes with it)."""
    fixed = {kind: synthetic(kind) for kind in ("saturating", "dip", "comm")}
    measured = BENCH / "landscapes" / "gpt_cpu.csv"
    if measured.exists():
        fixed = {"gpt_cpu": load_table(measured), **fixed}
    else:
        print(f"note: {measured} missing; run bench/measure_landscape.py first", file=sys.stderr)
    out = {name: (lambda seed, t=table: t) for name, table in fixed.items()}
    return {**out, "bumpy": bumpy}


def drawn_landscapes() -> dict[str, Callable[[int], dict[BatchConfig, float | None]]]:
    """The synthetic landscapes as families: every seed draws its own shape (where the
    micro-batch saturates, where memory runs out, how dear the all-reduce and the link
    are, where the dip is), so that the searches of one family are different situations,
    not one situation with different noise. The ranges hold the fixed landscapes' values
    and reach past them: the link, for instance, makes 8, 4 or 2 devices the fastest."""

    def shape(seed: int) -> dict[str, float]:
        rng = random.Random(2000 + seed)
        return {
            "saturation": math.exp(rng.uniform(math.log(2), math.log(16))),
            "oom_above": rng.choice([16, 32, 64, 128]),
            "all_reduce_s": math.exp(rng.uniform(math.log(0.001), math.log(0.016))),
            "link_s": math.exp(rng.uniform(math.log(0.01), math.log(0.08))),
            "dip_at": rng.uniform(1.5, 4.5),
            "dip_depth": rng.uniform(0.2, 0.45),
        }

    def family(kind: str) -> Callable[[int], dict[BatchConfig, float | None]]:
        return lambda seed: synthetic(kind, **shape(seed))

    return {
        **{kind: family(kind) for kind in ("saturating", "dip", "comm")},
        "bumpy": lambda seed: bumpy(seed, **shape(seed)),
    }


def load_table(path: Path) -> dict[BatchConfig, float | None]:
    table: dict[BatchConfig, float | None] = {}
    with path.open() as f:
        for row in csv.DictReader(f):
            c = BatchConfig.from_mapping(row)
            ok = row.get("status", "ok") in ("ok", "") and row["samples_per_s"]
            table[c] = float(row["samples_per_s"]) if ok else None
    return table


def replayed(
    c: BatchConfig, true: float | None, rng: random.Random, noise: float = NOISE, drift: float = 0.0
):
    """What a replayed trial reports: ``STEPS`` step times with relative ``noise`` each, all
    of them off by one factor of relative sd ``drift`` (as `trial.drift` replays them)."""
    if not true:
        return {"status": "oom", METRIC: 0.0, **c.sizes()}
    factor = max(0.05, 1 + drift * rng.gauss(0, 1)) if drift else 1.0
    steps_ms = [c.batch_size / true * 1e3 * factor * max(0.05, 1 + noise * rng.gauss(0, 1))
                for _ in range(STEPS)]  # fmt: skip
    speed = c.batch_size / statistics.median(steps_ms) * 1e3
    return {"status": "ok", METRIC: speed, "samples_per_s": speed, "step_times_ms": steps_ms,
            **c.sizes()}  # fmt: skip


def replay_search(
    table, sampler: str, seed: int, *, drift: float = 0.0, noise_floor: float = 0.0,
    trials: int | None = None,
) -> Iterator[tuple[int, BatchConfig, dict]]:  # fmt: skip
    """(trial number, configuration, replayed result) of every trial of one search over
    ``table``, driven as `mbtune run` drives it: the searcher proposes, learns, proposes.
    ``trials``: at most this many (default: as many as the table has configurations)."""
    searcher = make_searcher(sampler, list(table), seed=seed, noise_floor=noise_floor)
    rng = random.Random(seed)
    for i in range(1, (trials or len(table)) + 1):
        params = searcher.suggest(f"t{i}")
        if params in (None, Searcher.FINISHED):
            return
        c = BatchConfig.from_mapping(params)
        result = replayed(c, table[c], rng, drift=drift)
        searcher.on_trial_complete(f"t{i}", result)
        yield i, c, result


def trials_to_near_best(table, sampler: str, seed: int) -> int:
    best = max(v for v in table.values() if v)
    good = {c for c, v in table.items() if v and v >= 0.98 * best}
    for i, c, _ in replay_search(table, sampler, seed):
        if c in good:
            return i
    return len(table) + 1  # never found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=30)
    parser.add_argument("--samplers", nargs="*", default=list(SAMPLERS))
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    info = machine()
    results: dict[str, dict[str, dict]] = {}
    for name, table_for in landscapes().items():
        results[name] = {}
        size = len(table_for(0))
        print(f"\n{name}: {size} configurations; target: default <= {size / 4:.1f} trials and "
              "<= half of random")  # fmt: skip
        print(f"  {'sampler':<9} {'median':>7} {'p75':>6} {'found':>6} {'s/search':>9}")
        for sampler in args.samplers:
            started = time.perf_counter()
            counts = [
                trials_to_near_best(table_for(seed), sampler, seed) for seed in range(args.seeds)
            ]
            seconds = (time.perf_counter() - started) / args.seeds
            found = sum(c <= size for c in counts)
            q = statistics.quantiles(counts, n=4) if len(counts) > 1 else counts * 3
            results[name][sampler] = {
                "median": statistics.median(counts), "p75": q[2], "found": found,
                "seeds": args.seeds, "size": size, "counts": counts,
                "seconds_per_search": seconds,
            }  # fmt: skip
            print(f"  {sampler:<9} {statistics.median(counts):>7.1f} {q[2]:>6.1f} "
                  f"{found:>3}/{args.seeds:<2} {seconds:>9.2f}")  # fmt: skip
    out = save("search_efficiency", info, results)
    print(f"\nraw figures: {out.relative_to(BENCH.parent)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
