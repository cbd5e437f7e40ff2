"""The quickstart on this machine: time to the final recommendation, checked against grid.

Method. Runs `mbtune run experiments/quickstart.yaml` exactly as the README does (default
sampler, real compiled GPT trials, stopping at the confidence target) and takes the wall
time of the whole command and its recommendation (summary.json). Then runs the same
experiment with `search.sampler=grid` and no confidence stop (every distinct
configuration once) and compares. With `--save-landscape` the grid run's table becomes
the measured landscape `bench/landscapes/gpt_cpu.csv` that the search benchmarks replay.

Target: under 3 minutes, and the same recommendation as the exhaustive grid (or one
within the measurement noise of it, which the report states).
Run: `.venv/bin/python bench/quickstart.py [--save-landscape]`.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import BENCH, MBTUNE, ROOT, machine, save


def run(output_dir: str, *overrides: str) -> tuple[float, Path]:
    sets = [x for o in (f"output_dir={output_dir}", *overrides) for x in ("--set", o)]
    started = time.perf_counter()
    subprocess.run([MBTUNE, "run", "experiments/quickstart.yaml", *sets], cwd=ROOT, check=True)
    wall = time.perf_counter() - started
    (run_dir,) = [p for p in Path(output_dir).iterdir() if p.is_dir()]
    return wall, run_dir


def rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "trials.csv").open() as f:
        return list(csv.DictReader(f))


def best(table: list[dict[str, str]]) -> dict[str, str]:
    ok = [r for r in table if r["status"] == "ok"]
    return max(ok, key=lambda r: float(r["samples_per_s"]))


def key(r: dict[str, str]) -> tuple[int, int, int]:
    return int(r["batch_size"]), int(r["num_devices"]), int(r["micro_batch_size"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save-landscape", action="store_true")
    args = parser.parse_args()
    info = machine()
    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        wall, default_dir = run(a)
        grid_wall, grid_dir = run(
            b, "search.sampler=grid", "search.num_samples=100", "search.confidence_target=100"
        )
        default_rows, grid_rows = rows(default_dir), rows(grid_dir)
        summary = json.loads((default_dir / "summary.json").read_text())
    chosen, truth = summary["recommended"], best(grid_rows)
    grid_speed = {key(r): float(r["samples_per_s"]) for r in grid_rows if r["status"] == "ok"}
    ratio = grid_speed.get(key(chosen), 0.0) / float(truth["samples_per_s"])

    if args.save_landscape:
        landscape = BENCH / "landscapes" / "gpt_cpu.csv"
        landscape.parent.mkdir(exist_ok=True)
        with landscape.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(["batch_size", "num_devices", "micro_batch_size", "samples_per_s",
                             "peak_memory_bytes", "status"])  # fmt: skip
            for r in sorted(grid_rows, key=key):
                writer.writerow([*key(r), r["samples_per_s"], r["peak_memory_bytes"],
                                 r["status"]])  # fmt: skip

    result = {
        "default_wall_s": wall,
        "default_trials": len(default_rows),
        "default_choice": key(chosen),
        "default_confidence": summary["confidence"],
        "default_status": summary["status"],
        "grid_wall_s": grid_wall,
        "grid_trials": len(grid_rows),
        "grid_best": key(truth),
        "choice_over_grid_best": ratio,
        "same": key(chosen) == key(truth),
    }
    print(json.dumps(result, indent=1))
    save("quickstart", info, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
