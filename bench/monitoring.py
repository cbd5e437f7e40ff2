"""docs/monitoring.md done for real: a search submitted with `ray job submit` to a Ray head
started with a known metrics port, its Ray metrics read from that port while it runs.

Method. Starts `ray start --head --block` in a session of its own (a temporary directory of
its own, free ports, the dashboard on 127.0.0.1, token authentication with a token of its
own, the virtual environment's bin/ first on PATH so that the job finds `mbtune`), then
`ray job submit --no-wait -- mbtune run EXPERIMENT --set output_dir=ABSOLUTE`. Every second
until the job ends it reads the node's Prometheus endpoint (HTTP GET) and the run
directory, and checks the issue's rule: the served `ray_mbtune_confidence` equals the
confidence of a line of recommendations.jsonl that was the last one at most 15 s earlier,
and the served `ray_mbtune_trials_finished` a row count trials.csv had in the last 15 s.
It records how long each new recommendation took to be served. At the end: the job's
logs (`ray job logs`, the Jobs page's driver logs) hold the search's stream, the run
directory is under the output_dir given, and the Grafana dashboard is in the session's
metrics/grafana/dashboards.

With `--prometheus` it also runs Prometheus (a `prometheus` binary on PATH, e.g. Debian's
package) on Ray's service-discovery file, scraping every 2 s; with `--screenshot FILE` a
headless chromium (on PATH) then photographs Prometheus' graph page of mbtune's metrics.
Neither is needed by mbtune or its tests.

Run: `.venv/bin/python bench/monitoring.py [--experiment experiments/quickstart.yaml]
[--set KEY=VALUE ...] [--prometheus] [--screenshot docs/img/prometheus-mbtune.png]`.
Results: bench/results/monitoring.json. About a minute with the quickstart, on top of the
head's start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from _common import QUICKSTART, RESULTS, machine

BIN = Path(sys.executable).parent
RULE_S = 15.0
"""The issue's rule: what the endpoint serves is at most this old."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[str, dict[frozenset, float]]:
    """The ray_mbtune_ samples an endpoint serves: name -> {mbtune's tags -> value}."""
    try:
        text = urllib.request.urlopen(url, timeout=5).read().decode()
    except OSError:
        return {}
    found: dict[str, dict[frozenset, float]] = {}
    for line in text.splitlines():
        m = re.match(r"ray_(mbtune_\w+)\{(.*)\} (\S+)$", line)
        if m:
            tags = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m[2]))
            ours = frozenset((k, v) for k, v in tags.items() if k[0].islower())
            found.setdefault(m[1], {})[ours] = float(m[3])
    return found


def of_run(served: dict, name: str, run: str) -> float | None:
    values = [v for tags, v in served.get(name, {}).items() if ("run", run) in tags]
    return max(values) if values else None


class Head:
    """A Ray head of its own: a `ray start --block` in a session of its own."""

    def __init__(self, env: dict[str, str]) -> None:
        self.temp = Path(tempfile.mkdtemp(prefix="mbtmon", dir="/tmp"))
        self.env = env
        self.dashboard, self.metrics = free_port(), free_port()
        self.log = self.temp / "head.log"
        command = [
            str(BIN / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={free_port()}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={self.dashboard}",
            f"--metrics-export-port={self.metrics}",
            f"--temp-dir={self.temp}",
            "--num-gpus=0",
            "--disable-usage-stats",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--runtime-env-agent-port={free_port()}",
        ]
        with self.log.open("w") as out:
            self.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                cwd=self.temp,
            )
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in self.log.read_text(errors="replace"):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"ray start failed:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard}"

    def session(self) -> Path:
        return (self.temp / "session_latest").resolve()

    def stop(self) -> None:
        """Its whole session (raylet, GCS, agents, workers, the job): never Ray by name."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                continue
        shutil.rmtree(self.temp, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", default=str(QUICKSTART))
    parser.add_argument("--set", action="append", default=[], dest="overrides")
    parser.add_argument("--prometheus", action="store_true")
    parser.add_argument("--screenshot", type=Path)
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
        RAY_USAGE_STATS_ENABLED="0",
        PATH=f"{BIN}:{env.get('PATH', '')}",
    )
    work = Path(tempfile.mkdtemp(prefix="mbtmon-runs", dir="/tmp"))
    output_dir = work / "runs"
    t0 = time.monotonic()
    head = Head(env)
    started_s = time.monotonic() - t0
    prometheus, job_id = None, None
    try:
        endpoint = f"http://127.0.0.1:{head.metrics}/metrics"
        if args.prometheus or args.screenshot:
            prometheus = start_prometheus(head, work)
        sets = [x for kv in [*args.overrides, f"output_dir={output_dir}"] for x in ("--set", kv)]
        submit = [
            str(BIN / "ray"),
            "job",
            "submit",
            "--address",
            head.address,
            "--no-wait",
            "--",
            "mbtune",
            "run",
            str(Path(args.experiment).resolve()),
            *sets,
        ]
        done = subprocess.run(
            submit, env=env, capture_output=True, text=True, timeout=120, cwd=work
        )
        job = re.search(r"raysubmit_\w+", done.stdout + done.stderr)
        if done.returncode != 0 or job is None:
            raise SystemExit(f"ray job submit failed:\n{done.stdout}\n{done.stderr}")
        job_id = job[0]
        checks, latencies = follow(head, env, job_id, output_dir, endpoint)
        logs = subprocess.run(
            [str(BIN / "ray"), "job", "logs", "--address", head.address, job_id],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        status = subprocess.run(
            [str(BIN / "ray"), "job", "status", "--address", head.address, job_id],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        status = status.stdout + status.stderr
        (run_dir,) = output_dir.iterdir()
        rows = len((run_dir / "trials.csv").read_text().splitlines()) - 1
        stream = [line for line in logs.splitlines() if line.startswith("mbtune")]
        installed = head.session() / "metrics" / "grafana" / "dashboards" / "mbtune.json"
        result = {
            "benchmark": "monitoring",
            "machine": machine(),
            "head_start_s": round(started_s, 1),
            "job": job_id,
            "job_succeeded": re.search(r"Job '\S+' succeeded", status) is not None,
            "run_dir_under_output_dir": run_dir.parent == output_dir,
            "trials": rows,
            "polls": len(checks),
            "polls_within_rule": sum(c["ok"] for c in checks),
            "served_latency_s": latencies,
            "max_served_latency_s": max(latencies) if latencies else None,
            "job_log_stream_lines": len(stream),
            "job_log_names_the_endpoint": any("mbtune metrics (Prometheus)" in x for x in stream),
            "grafana_dashboard_installed": installed.is_file(),
            "first_stream_lines": stream[:6],
            "failed_polls": [c for c in checks if not c["ok"]][:5],
        }
        if args.screenshot and prometheus is not None:
            minutes = int((time.monotonic() - t0) // 60) + 1  # the run's whole time
            shoot(prometheus[1], run_dir.name, args.screenshot, minutes)
            result["screenshot"] = str(args.screenshot)
    finally:
        if prometheus is not None:
            os.killpg(prometheus[0].pid, signal.SIGTERM)
            prometheus[0].wait(timeout=30)
        if job_id is not None:  # its driver runs in a session of its own: stopped by Ray
            ray_job = [str(BIN / "ray"), "job", "stop", "--address", head.address, job_id]
            subprocess.run(ray_job, env=env, capture_output=True, timeout=60)
        head.stop()
        shutil.rmtree(work, ignore_errors=True)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "monitoring.json").write_text(json.dumps(result, indent=2) + "\n")
    for key in (
        "job_succeeded",
        "run_dir_under_output_dir",
        "trials",
        "polls",
        "polls_within_rule",
        "max_served_latency_s",
        "job_log_stream_lines",
        "job_log_names_the_endpoint",
        "grafana_dashboard_installed",
    ):
        print(f"{key:28} {result[key]}")
    ok = (
        result["job_succeeded"]
        and result["polls"] == result["polls_within_rule"]
        and result["grafana_dashboard_installed"]
        and result["run_dir_under_output_dir"]
    )
    return 0 if ok else 1


def follow(head: Head, env: dict, job: str, output_dir: Path, endpoint: str):
    """Poll until the job ends: each poll's check of the rule, and how long each new
    recommendation took to be served."""
    # (first seen, value); None: nothing yet, as the endpoint says before the board's first
    # report, which comes up to Ray's report interval after it starts
    start = time.monotonic()
    seen_recs: list[tuple[float, float | None]] = [(start, None)]
    seen_rows: list[tuple[float, int | None]] = [(start, None)]
    checks, latencies, pending = [], [], []
    status_every, last_status, finished = 5.0, 0.0, False
    while not finished:
        now = time.monotonic()
        if now - last_status > status_every:
            last_status = now
            done = subprocess.run(
                [str(BIN / "ray"), "job", "status", "--address", head.address, job],
                env=env,
                capture_output=True,
                text=True,
            )
            out = done.stdout + done.stderr  # Ray's CLI says it on stderr
            finished = re.search(r"Job '\S+' (succeeded|failed|stopped)", out) is not None
        runs = list(output_dir.glob("*/recommendations.jsonl")) if output_dir.is_dir() else []
        run_dirs = list(output_dir.iterdir()) if output_dir.is_dir() else []
        if run_dirs:
            run = run_dirs[0]
            lines = runs[0].read_text().splitlines() if runs else []
            for line in lines[len(seen_recs) - 1 :]:
                if line.endswith("}"):
                    seen_recs.append((now, float(json.loads(line)["confidence"])))
                    pending.append((now, seen_recs[-1][1], len(seen_recs)))
            trials = run / "trials.csv"
            rows = len(trials.read_text().splitlines()) - 1 if trials.is_file() else 0
            if seen_rows[-1][1] != rows and rows:
                seen_rows.append((now, rows))
            served = scrape(endpoint)
            confidence = of_run(served, "mbtune_confidence", run.name)
            count = of_run(served, "mbtune_trials_finished", run.name)
            if len(seen_recs) > 1 and not finished:
                # the lines that were the last one at some moment of the last RULE_S
                recent = [c for t, c in seen_recs if t >= now - RULE_S]
                before = [c for t, c in seen_recs if t < now - RULE_S][-1:]
                counts = {r for t, r in seen_rows if t >= now - RULE_S}
                counts |= set([r for t, r in seen_rows if t < now - RULE_S][-1:])
                if None in counts:
                    counts.add(0)  # the board says 0 finished from its first report
                ok = confidence in set(recent + before) and count in counts
                checks.append(
                    {
                        "t": round(now, 1),
                        "served": confidence,
                        "files": recent + before,
                        "served_trials": count,
                        "trials": sorted(counts - {None}),
                        "ok": ok,
                    }
                )
            for item in list(pending):
                t, c, n = item
                # served once this line's value (or a later one's) is served
                if confidence is not None and confidence in {x for _, x in seen_recs[n - 1 :]}:
                    latencies.append(round(now - t, 1))
                    pending.remove(item)
        time.sleep(1.0)
    return checks, latencies


def start_prometheus(head: Head, work: Path):
    binary = shutil.which("prometheus")
    if binary is None:
        raise SystemExit("--prometheus: no prometheus on PATH (Debian: apt-get install prometheus)")
    # Ray's generated configuration (metrics/prometheus/prometheus.yml), scraping every 2 s
    ray_config = (head.session() / "metrics" / "prometheus" / "prometheus.yml").read_text()
    config = work / "prometheus.yml"
    config.write_text(re.sub(r"scrape_interval: \d+s", "scrape_interval: 2s", ray_config))
    port = free_port()
    log = (work / "prometheus.log").open("w")
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={work / 'prometheus-data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return process, f"http://127.0.0.1:{port}"


PANELS = [
    (
        'max by (__name__) ({__name__=~"ray_mbtune_confidence|ray_mbtune_confidence_target",'
        ' run="RUN"})',
        0,
    ),
    (
        "sort_desc(max by (num_devices, batch_size, micro_batch_size) "
        '(last_over_time(ray_mbtune_trial_samples_per_s{run="RUN"}[1h])))',
        1,
    ),
    (
        'max by (__name__) (last_over_time({__name__=~"ray_mbtune_recommended_.*|'
        'ray_mbtune_confidence", run="RUN"}[1h]))',
        1,
    ),
    (
        'max by (__name__) ({__name__=~"ray_mbtune_trials_(finished|failed|running|budget)",'
        ' run="RUN"})',
        0,
    ),
]
"""Prometheus' graph page: (expression, tab: 0 graph, 1 table)."""


def shoot(prometheus: str, run: str, path: Path, minutes: int) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("--screenshot: no chromium on PATH")
    query = {}
    for i, (expr, tab) in enumerate(PANELS):
        query |= {
            f"g{i}.expr": expr.replace("RUN", run),
            f"g{i}.tab": str(tab),
            f"g{i}.range_input": f"{minutes}m",
            f"g{i}.stacked": "0",
        }
    url = f"{prometheus}/graph?{urllib.parse.urlencode(query)}"
    profile = tempfile.mkdtemp(prefix="mbtmon-chromium")
    try:
        subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--screenshot={path.resolve()}",
                "--window-size=1400,2640",
                "--virtual-time-budget=20000",
                url,
            ],
            check=True,
            capture_output=True,
            timeout=120,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
