"""Driver memory over a long search: does the `mbtune run` process grow without bound?

Method. One replay search of N trials (default 500) runs in this process, exactly as
`mbtune run` runs it (`mbtune.search.run_search`: embedded Ray, the Tune loop, the
deduplicating TPE searcher with its Optuna study in SQLite, the trial log), two trials at a
time. The replay table covers a free batch_size range, 3,738 configurations, so the
sampler never runs out of new ones. The trials answer from the table and take no time:
only the driver's own bookkeeping is left, at its fastest pace.

Memory is read from /proc: the driver's resident set (VmRSS) each time a trial finishes
(from the search's own per-trial line, which the driver prints), and every 0.25 s from a
thread for the peak; also, at each finish, the summed RSS of the Ray processes the driver
started (GCS, raylet, workers; not the short-lived trial processes). Growth is the slope
of a least-squares line through the driver's RSS over the second half of the trials (after
warm-up), in KiB per trial, and the RSS added from the quarter point to the end.

Target: no growth without bound: the second half's slope extrapolates to under 100 MiB
per 10,000 trials. Run: `.venv/bin/python bench/driver_memory.py [--trials 500]`.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from _common import machine, save, table

from mbtune.config.load import parse_experiment
from mbtune.search import run_search, search_points


def rss_kib(pid: int | str = "self") -> int:
    """Resident set size of a process, KiB (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def ray_processes_kib(root: int) -> tuple[int, int]:
    """(summed RSS in KiB, count) of the long-lived processes under ``root`` (not trials)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        except (OSError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    total, count, stack = 0, 0, list(children.get(root, []))
    while stack:
        pid = stack.pop()
        stack += children.get(pid, [])
        try:
            if b"mbtune.trial.trial" in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
        except OSError:
            continue
        total += rss_kib(pid)
        count += 1
    return total, count


def experiment(workdir: Path, trials: int, sampler: str):
    raw = {
        "name": "driver-memory",
        "model": "replay_only:unused",  # replay never builds it; keeps torch out of trials
        "train_input": {"batch_size": 256, "micro_batch_size": "auto"},
        "search": {
            "space": {
                "batch_size": {"min": 16, "max": 1024},
                "num_devices": [1, 2, 4, 8],
                "micro_batch_size": [1, 2, 4, 8, 16, 32],
            },
            "sampler": sampler,
            "num_samples": trials,
        },
        "trial": {"backend": "replay", "table": str(workdir / "table.csv"), "noise": 0.03},
        "ray": {"max_concurrent_trials": 2},
        "output_dir": str(workdir / "runs"),
    }
    (workdir / "table.csv").write_text("")
    exp = parse_experiment(raw)
    with (workdir / "table.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["batch_size", "num_devices", "micro_batch_size", "samples_per_s"])
        for c in search_points(exp):
            speed = 1000 * c.num_devices**0.9 * c.micro_batch_size / (c.micro_batch_size + 6)
            writer.writerow([c.batch_size, c.num_devices, c.micro_batch_size, round(speed, 2)])
    return exp


def optuna_trials(db: Path) -> int | None:
    """Trials in the search's Optuna study (each repeated proposal answered from the cache
    is one too), or None without a study (a run from before every run kept one)."""
    import sqlite3

    if not db.exists():
        return None
    with sqlite3.connect(db) as con:
        return con.execute("SELECT COUNT(*) FROM trials").fetchone()[0]


def slope(xs: list[float], ys: list[float]) -> float:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=500)
    parser.add_argument("--sampler", default="tpe")
    parser.add_argument(
        "--save-as", default="driver_memory", help="results file name (bench/results/NAME.json)"
    )
    args = parser.parse_args()
    info = machine()
    me = os.getpid()
    samples: list[dict[str, float]] = []
    peak = {"kib": rss_kib()}
    started = time.perf_counter()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.25):
            peak["kib"] = max(peak["kib"], rss_kib())

    def on_line(line: str) -> None:  # the search's echo: one line per finished trial
        if " trial " in line and line.startswith("mbtune "):
            ray_kib, ray_count = ray_processes_kib(me)
            samples.append(
                {
                    "trial": len(samples) + 1,
                    "elapsed_s": round(time.perf_counter() - started, 2),
                    "driver_rss_kib": rss_kib(),
                    "ray_rss_kib": ray_kib,
                    "ray_processes": ray_count,
                }
            )

    before_kib = rss_kib()
    threading.Thread(target=watch, daemon=True).start()
    with tempfile.TemporaryDirectory() as workdir:
        exp = experiment(Path(workdir), args.trials, args.sampler)
        points = len(search_points(exp))
        outcome = run_search(exp, echo=on_line)
        recorded = len(outcome.rows)
        study_trials = optuna_trials(outcome.run.path / "optuna.db")
    done.set()
    wall_s = time.perf_counter() - started

    n = len(samples)
    rss = [s["driver_rss_kib"] for s in samples]
    half = samples[n // 2 :]
    growth = slope([s["trial"] for s in half], [s["driver_rss_kib"] for s in half])
    quarter = rss[n // 4 - 1] if n >= 4 else rss[0]
    checkpoints = [max(1, round(n * f)) for f in (0.01, 0.1, 0.25, 0.5, 0.75, 1.0)]
    rows = [
        [
            k,
            samples[k - 1]["elapsed_s"],
            samples[k - 1]["driver_rss_kib"] / 1024,
            samples[k - 1]["ray_rss_kib"] / 1024,
            samples[k - 1]["ray_processes"],
        ]
        for k in checkpoints
    ]
    print(table(["trial", "elapsed s", "driver MiB", "ray MiB", "ray procs"], rows))
    result = {
        "trials_requested": args.trials,
        "trials_recorded": recorded,
        "sampler": args.sampler,
        "configurations": points,
        "max_concurrent_trials": 2,
        "wall_s": round(wall_s, 1),
        "optuna_study_trials": study_trials,
        "driver_rss_before_search_kib": before_kib,
        "driver_rss_peak_kib": peak["kib"],
        "driver_rss_at_quarter_kib": quarter,
        "driver_rss_at_end_kib": rss[-1],
        "second_half_slope_kib_per_trial": round(growth, 2),
        "second_half_slope_mib_per_10k_trials": round(growth * 10_000 / 1024, 1),
        "samples": samples,
    }
    print(
        f"{recorded} trials recorded in {wall_s:.0f} s; driver RSS {before_kib / 1024:.0f} MiB "
        f"before, {quarter / 1024:.0f} MiB at trial {n // 4}, {rss[-1] / 1024:.0f} MiB at "
        f"the end (peak {peak['kib'] / 1024:.0f} MiB); second half: {growth:.1f} KiB per trial "
        f"= {growth * 10_000 / 1024:.0f} MiB per 10,000 trials"
    )
    if study_trials is not None:
        print(f"the Optuna study holds {study_trials} trials for {recorded} measured")
    save(args.save_as, info, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
