"""Where the test suite's CPU goes (issue 38): the suite's wall time, the machine's busy
CPU-s while it runs, and the CPU time of every process it started, by what the process is.

Method: runs COMMAND (by default the suite as ``make test`` runs it: ``python -m pytest
-n 2 --dist loadgroup -q``, from the checkout) while a thread samples every process on the
machine every ``--every`` seconds (psutil: its command line, and its user + system CPU time
since it started). A process is counted from its last sample (what it used after that, up
to a sampling period, is lost: a few percent for short processes); a process that started
before the command is counted from its first sample only. Each is put in a kind by its
command line (a Ray actor by its class name, ``ray::RayTrainWorker``; a Ray system process
by its program; a trial process, an ``mbtune`` command, a child started by multiprocessing,
pytest's workers). The machine's busy CPU-s come from /proc/stat around the command (as
the other benches read how busy the machine is). The sampling itself costs: the suite took
about 5% longer under it (496 s against 461-465 s without it, at the same tests).

The suite is CPU-bound on a 2-core machine: its wall time is about its CPU time over the
cores it keeps busy, so this is where to look for what to cut. Run it on a quiet machine
(other jobs are counted as the machine's, not as the suite's processes).

    python bench/suite_cpu.py                       # the suite
    python bench/suite_cpu.py -- python -m pytest -q -n 0 tests/test_search.py

Figures: docs/benchmarks.md, "The test suite's time".
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, busy_cpu_s, machine, save, table  # noqa: E402

SUITE = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q"]

KINDS = [  # (kind, a pattern its command line matches), the first that matches
    ("ray actor", re.compile(r"^ray::(\w+)")),
    ("pytest worker", re.compile(r"execnet|exec\(eval\(sys\.stdin")),
    ("pytest", re.compile(r"-m pytest")),
    (
        "multiprocessing child (gloo ranks, the screen)",
        re.compile(r"multiprocessing\.spawn|multiprocessing\.forkserver"),
    ),
    ("warm trial parent (started ahead)", re.compile(r"-m mbtune\.trial --warm-ahead")),
    ("trial (forked from a warm parent)", re.compile(r"-m mbtune\.trial --warm")),
    ("trial (a process of its own)", re.compile(r"-m mbtune\.trial")),
    ("mbtune command", re.compile(r"bin/mbtune |-m mbtune(\.cli)? ")),
    ("ray: gcs", re.compile(r"gcs_server")),
    ("ray: raylet", re.compile(r"/raylet ")),
    ("ray: dashboard", re.compile(r"dashboard/dashboard\.py")),
    ("ray: agents", re.compile(r"dashboard/agent\.py|runtime_env/agent")),
    ("ray: log monitor", re.compile(r"log_monitor\.py")),
    ("ray: autoscaler monitor", re.compile(r"autoscaler/_private/monitor\.py")),
    ("ray: client server", re.compile(r"ray\.util\.client\.server")),
    ("ray start", re.compile(r"bin/ray start")),
    ("other python -c", re.compile(r"python\S* -c ")),
]


def kind(cmdline: str) -> str:
    for name, pattern in KINDS:
        found = pattern.search(cmdline)
        if found:
            return f"ray::{found[1]}" if name == "ray actor" else name
    return "other"


class Sampler(threading.Thread):
    """Every process's CPU time and command line, sampled until stopped."""

    def __init__(self, every_s: float) -> None:
        super().__init__(daemon=True)
        self.every_s, self.stop = every_s, threading.Event()
        self.seen: dict[tuple[int, float], list] = {}  # (pid, start): [first, last, cmdline]

    def run(self) -> None:
        while not self.stop.is_set():
            for p in psutil.process_iter(["pid", "create_time", "cpu_times", "cmdline"]):
                info = p.info
                if info["cpu_times"] is None:
                    continue
                cpu = info["cpu_times"].user + info["cpu_times"].system
                cmd = " ".join(info["cmdline"] or [])[:300]
                row = self.seen.setdefault((info["pid"], info["create_time"]), [cpu, cpu, cmd])
                row[1] = cpu
                row[2] = cmd or row[2]  # Ray renames its workers once they hold an actor
            self.stop.wait(self.every_s)

    def by_kind(self, since: float) -> tuple[Counter, Counter]:
        """CPU-s and process count by kind, of what ran after ``since`` (a process that
        started before it counts from its first sample)."""
        cpu, count = Counter(), Counter()
        for (_, start), (first, last, cmd) in self.seen.items():
            used = last - (first if start < since else 0.0)
            if used > 0:
                k = kind(cmd)
                cpu[k] += used
                count[k] += 1
        return cpu, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--every", type=float, default=0.3, help="seconds between samples")
    parser.add_argument("--top", type=int, default=25, help="kinds shown")
    parser.add_argument("command", nargs="*", help="the command (default: the suite)")
    args = parser.parse_args()
    command = args.command or SUITE
    info = machine()
    sampler = Sampler(args.every)
    since, busy0 = time.time(), busy_cpu_s()
    sampler.start()
    started = time.monotonic()
    code = subprocess.run(command, cwd=ROOT).returncode
    wall = time.monotonic() - started
    busy = busy_cpu_s() - busy0
    sampler.stop.set()
    sampler.join()
    cpu, count = sampler.by_kind(since)
    found = sum(cpu.values())
    print(f"\n{' '.join(command)}: exit {code}, {wall:.0f} s, the machine busy {busy:.0f} CPU-s "
          f"({busy / wall / psutil.cpu_count():.0%} of {psutil.cpu_count()} cores); its "
          f"processes {found:.0f} CPU-s, by kind:")  # fmt: skip
    rows = [(k, count[k], round(v, 1), round(v / max(1, count[k]), 2))
            for k, v in cpu.most_common(args.top)]  # fmt: skip
    print(table(["kind", "processes", "CPU-s", "each"], rows))
    path = save("suite_cpu", info, {
        "command": command, "exit": code, "wall_s": wall, "busy_cpu_s": busy,
        "found_cpu_s": found, "by_kind": {k: [count[k], v] for k, v in cpu.most_common()},
    })  # fmt: skip
    print(f"raw figures: {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
