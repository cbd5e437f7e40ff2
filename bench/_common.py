"""Helpers shared by the benchmark scripts in bench/ (not a benchmark itself).

Each benchmark prints a table and writes its raw figures to bench/results/NAME.json.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
RESULTS = BENCH / "results"
QUICKSTART = ROOT / "experiments" / "quickstart.yaml"
MBTUNE = Path(sys.executable).with_name("mbtune")
EXHAUSTIVE_GRID = (
    "search.sampler=grid",
    "search.num_samples=100",
    "search.confidence_target=100",
    "search.max_repeats=1",
)
"""Overrides that make a search measure every configuration of its space once, and never
stop early on its confidence score."""


def loadavg() -> float | None:
    """The 1-minute load average: how busy the (shared) machine was."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs, from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return idle, sum(fields[:8])


def busy_cpu_s() -> float:
    """The CPU-seconds every CPU of the machine has been busy since boot (/proc/stat): read
    before and after a command, how much CPU it and everything beside it used."""
    idle, total = _cpu_times()
    return (total - idle) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(max_wait_s: float = 30.0, busy_below: float = 0.15) -> float | None:
    """Wait until the machine is nearly idle; return the busy share (0..1) last seen.

    The machine is shared: another job's load slows a CPU benchmark a lot. Each check
    samples /proc/stat over one second; after ``max_wait_s`` the benchmark goes on anyway
    and the busy share it saw is recorded with the measurement.
    """
    deadline = time.monotonic() + max_wait_s
    busy = None
    while True:
        try:
            idle0, total0 = _cpu_times()
            time.sleep(1.0)
            idle1, total1 = _cpu_times()
        except (OSError, ValueError, IndexError):
            return None
        busy = 1 - (idle1 - idle0) / max(1, total1 - total0)
        if busy < busy_below or time.monotonic() > deadline:
            return busy


def machine() -> dict[str, Any]:
    import torch

    return {
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_at_start": loadavg(),
    }


def cli_trial(args: Sequence[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    """``mbtune trial ... --json`` in a fresh process; its JSON plus the process's wall time.

    Waits for a quiet machine first (:func:`wait_for_quiet`).
    """
    command = [str(MBTUNE), "trial", str(QUICKSTART), *args, "--json"]
    busy = wait_for_quiet()
    load = loadavg()
    t0 = time.perf_counter()
    proc = subprocess.run(
        command, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True
    )
    process_s = time.perf_counter() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(
            f"{' '.join(command)} exited {proc.returncode} without a JSON result:\n"
            f"{proc.stderr[-2000:]}"
        )
    result = json.loads(lines[-1])
    if result["status"] != "ok":
        raise SystemExit(f"{' '.join(command)}: status {result['status']}: {result['reason']}")
    result["process_s"] = process_s
    result["loadavg_before"] = load
    result["busy_before"] = busy
    return result


def quickstart_run(output_dir: str, *overrides: str, quiet: bool = False) -> tuple[float, Path]:
    """``mbtune run experiments/quickstart.yaml`` with ``overrides``, its run directory
    under ``output_dir`` (empty before): the command's wall time and that directory."""
    sets = [x for o in (f"output_dir={output_dir}", *overrides) for x in ("--set", o)]
    started = time.perf_counter()
    subprocess.run([MBTUNE, "run", str(QUICKSTART), *sets], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL if quiet else None)  # fmt: skip
    wall = time.perf_counter() - started
    (run_dir,) = [p for p in Path(output_dir).iterdir() if p.is_dir()]
    return wall, run_dir


def trial_rows(run_dir: Path) -> list[dict[str, str]]:
    """The run's trials.csv, as text."""
    with (run_dir / "trials.csv").open() as f:
        return list(csv.DictReader(f))


def cv(values: Sequence[float]) -> float:
    """Coefficient of variation: sample standard deviation / mean."""
    return statistics.stdev(values) / statistics.mean(values) if len(values) > 1 else 0.0


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain text table, numbers right-aligned."""

    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:,.1f}"
        return "" if v is None else str(v)

    cells = [[cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    out = ["  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
    out.append("  ".join("-" * w for w in widths))
    out += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells]
    return "\n".join(out)


def save(name: str, info: dict[str, Any], data: dict[str, Any]) -> Path:
    """Write bench/results/NAME.json: ``info`` (from :func:`machine` at the start) and ``data``."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    data = {"benchmark": name, "machine": {**info, "loadavg_at_end": loadavg()}, **data}
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path
