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

The module also holds what the calibration benches share: the drawn families
(`drawn_landscapes`, `close_call`, `fewer_devices`), and `stopping_search`, one search
driven trial by trial as `mbtune run` drives it, up to where it would stop
(bench/confidence_calibration.py, bench/close_calls.py).

Target: the default sampler needs at most a quarter of the lattice and at most half of
what `random` needs. Run: `.venv/bin/python bench/search_efficiency.py [--seeds 30]`.
"""

from __future__ import annotations

import argparse
import csv
import inspect
import math
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import BENCH, machine, save
from ray.tune.search import Searcher

from mbtune.lattice import BatchConfig, enumerate_configs
from mbtune.recommend.confidence import Assessment
from mbtune.recommend.reporter import Reporter
from mbtune.runs.record import TrialRecord
from mbtune.search import METRIC, make_searcher
from mbtune.search._ledger import settled_after

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


def drawn_shape(seed: int) -> dict[str, float]:
    """The shape one seed draws for the drawn families (see :func:`drawn_landscapes`)."""
    rng = random.Random(2000 + seed)
    return {
        "saturation": math.exp(rng.uniform(math.log(2), math.log(16))),
        "oom_above": rng.choice([16, 32, 64, 128]),
        "all_reduce_s": math.exp(rng.uniform(math.log(0.001), math.log(0.016))),
        "link_s": math.exp(rng.uniform(math.log(0.01), math.log(0.08))),
        "dip_at": rng.uniform(1.5, 4.5),
        "dip_depth": rng.uniform(0.2, 0.45),
    }


def drawn_landscapes() -> dict[str, Callable[[int], dict[BatchConfig, float | None]]]:
    """The synthetic landscapes as families: every seed draws its own shape (where the
    micro-batch saturates, where memory runs out, how dear the all-reduce and the link
    are, where the dip is), so that the searches of one family are different situations,
    not one situation with different noise. The ranges hold the fixed landscapes' values
    and reach past them: the link, for instance, makes 8, 4 or 2 devices the fastest.
    Two more families (issue 29): ``fewer``, whose best is always at fewer devices than
    the most (:func:`fewer_devices`), and ``middle``, whose best is at a middle
    micro-batch size on every device count (:func:`middle_m`)."""

    def family(kind: str) -> Callable[[int], dict[BatchConfig, float | None]]:
        return lambda seed: synthetic(kind, **drawn_shape(seed))

    return {
        **{kind: family(kind) for kind in ("saturating", "dip", "comm")},
        "bumpy": lambda seed: bumpy(seed, **drawn_shape(seed)),
        "fewer": fewer_devices,
        "middle": middle_m,
    }


SYNTHETIC_POINTS = tuple(
    enumerate_configs(mode="auto", batch_sizes=[512], num_devices=[1, 2, 4, 8])
)
"""The synthetic landscapes' lattice: B = 512, n in 1, 2, 4, 8, m the divisors of P (34)."""
QUICKSTART_POINTS = tuple(enumerate_configs(mode="auto", batch_sizes=[32], num_devices=[1, 2]))
"""The quickstart's lattice (and close_call.csv's): B = 32, n in 1, 2 (11 configurations)."""


def shaped(
    points: Iterable[BatchConfig],
    *,
    saturation: float = 6.0,
    oom_above: int | None = 64,
    all_reduce_s: float = 0.004,
    peak_at: float | None = None,
    decline: float = 0.0,
) -> dict[BatchConfig, float | None]:
    """A smooth landscape over ``points``: a device's speed saturates with m (half its
    peak at m = ``saturation``) and, past m = 2 ** ``peak_at``, falls by a factor
    exp(-``decline`` * octaves**2) (a micro-batch that outgrows a cache); the all-reduce
    costs ``all_reduce_s`` * 8 (n - 1) / n per step; above ``oom_above``, out of memory."""
    table: dict[BatchConfig, float | None] = {}
    for c in points:
        m, n = c.micro_batch_size, c.num_devices
        if oom_above is not None and m > oom_above:
            table[c] = None
            continue
        per_device = 1000 * m / (m + saturation)
        if peak_at is not None:
            per_device *= math.exp(-decline * max(0.0, math.log2(m) - peak_at) ** 2)
        table[c] = c.batch_size / (c.per_device_batch / per_device + all_reduce_s * (n - 1) / n * 8)
    return table


def best_by_devices(table: dict[BatchConfig, float | None]) -> dict[int, BatchConfig]:
    """The fastest configuration at each device count."""
    out: dict[int, BatchConfig] = {}
    for c, v in table.items():
        if v and (c.num_devices not in out or v > table[out[c.num_devices]]):
            out[c.num_devices] = c
    return out


def fewer_devices(
    seed: int, *, fastest: int | None = None, slower: Sequence[float] | None = None
) -> dict[BatchConfig, float | None]:
    """A slow link past k of 8 devices (issue 29): k devices are the fastest and every
    doubling past k is slower, by a per-step cost that every micro-batch size at that
    device count pays alike. Drawn per seed: k in 1, 2, 4; the first doubling past k
    4-12% slower than the best, each further one 15-30 points more; the rest of the
    shape (saturation, memory, all-reduce) as the drawn families'. ``fastest`` and
    ``slower`` fix k and the slowdowns (fractions: ``fastest=2, slower=(0.08, 0.32)``
    makes 4 and 8 devices 8% and 32% slower than 2)."""
    rng = random.Random(3000 + seed)
    s = drawn_shape(seed)
    base = shaped(SYNTHETIC_POINTS, saturation=s["saturation"], oom_above=int(s["oom_above"]),
                  all_reduce_s=s["all_reduce_s"])  # fmt: skip
    k = fastest if fastest is not None else rng.choice([1, 2, 4])
    past = [n for n in (2, 4, 8) if n > k]
    if slower is None:
        drawn = [rng.uniform(0.04, 0.12)]
        while len(drawn) < len(past):
            drawn.append(drawn[-1] + rng.uniform(0.15, 0.30))
        slower = drawn
    leaders = best_by_devices(base)
    best_k = base[leaders[k]]
    assert best_k and all(base[leaders[n]] < best_k for n in leaders if n < k), "not fastest at k"
    table = dict(base)
    for n, slow in zip(past, slower, strict=True):
        fastest_step = 512 / base[leaders[n]]
        extra = max(0.0, 512 / ((1 - slow) * best_k) - fastest_step)  # the link's cost
        for c, v in base.items():
            if v and c.num_devices == n:
                table[c] = c.batch_size / (c.batch_size / v + extra)
    return table


def middle_m(seed: int) -> dict[BatchConfig, float | None]:
    """The best at a middle micro-batch size on every device count: a device's speed
    rises with m, peaks (m = 2.5 to 16, drawn) and falls past it (a micro-batch that
    outgrows a cache), with memory for at least m = 64 so that sizes past the peak run.
    Drawn again until, at every n, the fastest m is neither the smallest nor the largest
    that runs."""
    rng = random.Random(4000 + seed)
    s = drawn_shape(seed)
    while True:
        table = shaped(
            SYNTHETIC_POINTS,
            saturation=math.exp(rng.uniform(0.0, math.log(4))),
            oom_above=rng.choice([64, 128, None]),
            all_reduce_s=s["all_reduce_s"],
            peak_at=rng.uniform(1.3, 4.0),
            decline=rng.uniform(0.08, 0.2),
        )
        runs = [c for c, v in table.items() if v]
        if all(
            min(c.micro_batch_size for c in runs if c.num_devices == n)
            < leader.micro_batch_size
            < max(c.micro_batch_size for c in runs if c.num_devices == n)
            for n, leader in best_by_devices(table).items()
        ):
            return table


def with_gaps(
    table: dict[BatchConfig, float | None], gaps: Sequence[float]
) -> dict[BatchConfig, float | None]:
    """``table`` made a close call: its best kept, the next ones ``gaps`` below it
    (fractions of the best, in order), and the rest scaled down alike, where needed,
    to at least 2% below the last of those."""
    ranked = sorted((c for c, v in table.items() if v), key=lambda c: -(table[c] or 0.0))
    best = table[ranked[0]] or 0.0
    out = dict(table)
    for c, gap in zip(ranked[1:], gaps, strict=False):  # a lattice may hold fewer
        out[c] = best * (1 - gap)
    rest = ranked[1 + len(gaps) :]
    if rest:
        scale = min(1.0, best * (1 - gaps[-1] - 0.02) / (table[rest[0]] or 1.0))
        out.update({c: (table[c] or 0.0) * scale for c in rest})
    return out


def close_call(seed: int) -> dict[BatchConfig, float | None]:
    """A close call drawn per seed on the quickstart's lattice (issue 29): a smooth shape
    (saturating in m, or peaking at a middle m; an all-reduce that makes 1 or 2 devices
    the fastest; sometimes memory for m <= 8 or 16 only), drawn again until its four
    fastest configurations lie within 15% (a close call is between neighbours), so that
    which configuration is best varies; then the runner-up 3-5% below the best, the next
    two 5.5-7% and 8-12% below it (:func:`with_gaps`)."""
    rng = random.Random(5000 + seed)
    while True:
        peak = rng.random() < 0.5
        table = shaped(
            QUICKSTART_POINTS,
            saturation=math.exp(rng.uniform(math.log(0.5), math.log(8))),
            oom_above=rng.choice([8, 16, None, None]),
            all_reduce_s=math.exp(rng.uniform(math.log(0.0005), math.log(0.012))),
            peak_at=rng.uniform(1.0, 3.5) if peak else None,
            decline=rng.uniform(0.05, 0.2),
        )
        values = sorted((v for v in table.values() if v), reverse=True)
        if values[3] >= 0.85 * values[0]:
            break
    gaps = (rng.uniform(0.03, 0.05), rng.uniform(0.055, 0.07), rng.uniform(0.08, 0.12))
    return with_gaps(table, gaps)


def write_table(table: dict[BatchConfig, float | None], path: Path) -> Path:
    """``table`` as a replay CSV (trial.table): empty samples_per_s where out of memory."""
    with path.open("w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["batch_size", "num_devices", "micro_batch_size", "samples_per_s", "status"])
        for c, v in sorted(table.items()):
            out.writerow([c.batch_size, c.num_devices, c.micro_batch_size,
                          "" if v is None else repr(v), "ok" if v else "oom"])  # fmt: skip
    return path


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


@dataclass(frozen=True)
class Trial:
    """One finished trial of a search, and what the run made of it after it."""

    number: int
    config: BatchConfig
    """What the searcher proposed."""
    result: dict
    recommended: BatchConfig | None
    """The run's recommendation after this trial (None while nothing ran ok)."""
    confidence: int
    looks: int
    """How often the recommendation was measured."""
    settled: bool
    """Whether the run stops here (on its confidence score, or on a tie)."""
    assessment: Assessment | None = None
    """The search model's view after this trial."""
    tie: bool = False
    """Whether the search model names a tie (issue 29): a stop, but not on the target."""
    target: int = 90

    @property
    def on_target(self) -> bool:
        """A stop on the score's target (not on a tie)."""
        return self.settled and not self.tie and self.confidence >= self.target


def stopping_search(
    searcher: Any,
    measure: Callable[[BatchConfig, int], dict],
    *,
    budget: int,
    target: int,
    max_repeats: int,
) -> Iterator[Trial]:
    """Every trial of one search, driven as `mbtune run` drives it, up to where it would
    stop. ``searcher`` (from `mbtune.search.make_searcher`) proposes and learns each
    result; ``measure(config, repeat)`` gives a trial's result. After every trial the
    run's reporter, on the searcher's own search model, recommends and scores, and the
    search stops where the run's trial log stops it (``settled_after``, the rule
    `mbtune run` applies: `mbtune.search.settled` on the score and the leader's looks),
    where the searcher has nothing left to propose, or after ``budget`` trials. Whatever
    the searcher or that rule comes to do before a stop (another look at the leader or a
    rival), this loop does too: it decides nothing itself."""
    reporter = Reporter(searcher.model)
    rows: list[TrialRecord] = []
    history: list[dict] = []
    for i in range(1, budget + 1):
        params = searcher.suggest(f"t{i}")
        if params is None or params == Searcher.FINISHED:
            return
        config = BatchConfig.from_mapping(params)
        result = measure(config, int(params.get("repeat", 0)))
        searcher.on_trial_complete(f"t{i}", result)
        rows.append(TrialRecord.from_result({**config.sizes(), **result, "trial": i,
                                             "trial_id": f"t{i}"}))  # fmt: skip
        rec = reporter.update(rows, history)
        if rec is None:
            yield Trial(i, config, result, None, 0, 0, False)
            continue
        history.append(rec.record())
        done = _settled_after(reporter, rows, rec, target=target, max_repeats=max_repeats)
        a = reporter.assess(rows)
        looks = a.looks.get(rec.config.canonical(), 0)
        tie = getattr(a, "tie", None) is not None
        yield Trial(i, config, result, rec.config.canonical(), rec.confidence, looks, done, a,
                    tie, target)  # fmt: skip
        if done:
            return


def _settled_after(reporter: Reporter, rows: list[TrialRecord], rec: Any, **rule: int) -> bool:
    """The run's trial log's rule (``settled_after``), called as the code at hand takes
    it: before issue 29 with the recommendation's score and configuration, after it with
    the rows alone (the rule reads the assessment itself). The benches measure both."""
    if "confidence" in inspect.signature(settled_after).parameters:
        return settled_after(reporter, rows, rec.confidence, rec.config, **rule)
    return settled_after(reporter, rows, **rule)


def by_thirds(stops: list[dict], order: Callable[[dict], Any]) -> dict[str, dict]:
    """Stops split by search length: the shortest third (in ``order``), the middle and the
    longest, each with how many, how many right, and its range of trials."""
    ordered = sorted(stops, key=order)
    n = len(ordered)
    cuts = [0, round(n / 3), round(2 * n / 3), n]
    thirds = {}
    for i, label in enumerate(("shortest", "middle", "longest")):
        part = ordered[cuts[i] : cuts[i + 1]]
        thirds[label] = {
            "searches": len(part),
            "right": sum(s["right"] for s in part),
            "trials": [part[0]["trials"], part[-1]["trials"]] if part else None,
        }
    return thirds


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
