"""A real Ray cluster on this machine, for tests: a head and worker nodes, each one a
`ray start --block` process in a session of its own.

Each node's processes (raylet, GCS, agents, workers, the trial processes they start) stay
in the session of its `ray start`, so a node is stopped, or killed as a lost machine would
be, by signalling that session, and never by name: other Rays on the machine (another
test run, another user) are never touched. The cluster uses its own temporary directory
(short: Unix socket paths are limited to 107 bytes) and free ports, and token
authentication with a token of its own, as Ray 2.59+ does by default for clusters it
starts, without reading or writing ~/.ray.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

RAY = Path(sys.executable).with_name("ray")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Node:
    process: subprocess.Popen
    log: Path
    head: bool

    @property
    def session(self) -> int:
        return self.process.pid  # started with start_new_session: it leads its session

    def pids(self) -> list[int]:
        """Every live process of this node (its session)."""
        return session_pids(self.session)


@dataclass
class LocalCluster:
    """Start with :meth:`start_head`, add nodes with :meth:`add_node`, end with :meth:`stop`
    (always: a test's teardown)."""

    temp_dir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="mbt", dir="/tmp")))
    token: str = field(default_factory=lambda: secrets.token_hex(32))
    nodes: list[Node] = field(default_factory=list)
    port: int | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of a driver of the cluster: this one's, with the cluster's token."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token, RAY_USAGE_STATS_ENABLED="0")
        return {**env, **extra}

    def node_env(self, head: bool = False) -> dict[str, str]:
        """The environment of the nodes: without PYTHONPATH, so that what they run of mbtune
        is what the driver ships them (or what is installed), never this checkout by path.
        The head's GCS checks each node every second and calls a node dead after 3 failed
        checks (Ray's defaults, 3 s and 5, took 15-18 s to see a killed node): a lost node
        is the subject of these tests, not how long Ray takes to notice it. A check of a
        node that lives but is slow to answer fails only after Ray's 10 s timeout."""
        env = self.env()
        env.pop("PYTHONPATH", None)
        if head:
            env.update(RAY_health_check_period_ms="1000", RAY_health_check_failure_threshold="3")
        return env

    def start_head(self, *, num_cpus: int = 1, dashboard: bool = False) -> str:
        self.port = free_port()
        args = ["--head", f"--port={self.port}", f"--ray-client-server-port={free_port()}",
                f"--include-dashboard={str(dashboard).lower()}"]  # fmt: skip
        if dashboard:
            args += ["--dashboard-host=127.0.0.1", f"--dashboard-port={free_port()}"]
        self._start(args, num_cpus, head=True)
        return self.address

    def add_node(self, *, num_cpus: int = 1) -> Node:
        return self._start([f"--address={self.address}"], num_cpus, head=False)

    def _start(self, args: list[str], num_cpus: int, head: bool) -> Node:
        log = self.temp_dir / f"node{len(self.nodes)}.log"
        command = [
            str(RAY), "start", "--block", *args, "--node-ip-address=127.0.0.1",
            f"--num-cpus={num_cpus}", "--num-gpus=0", f"--temp-dir={self.temp_dir}",
            "--object-store-memory=100000000", "--disable-usage-stats",
            # every listening port chosen here: Ray's fixed defaults (52365, 10001, 8265)
            # would clash between two nodes on one machine, or with other Rays on it
            f"--dashboard-agent-listen-port={free_port()}",
            f"--dashboard-agent-grpc-port={free_port()}",
            f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
        ]  # fmt: skip
        for attempt in (1, 2):
            with log.open("w") as out:
                process = subprocess.Popen(
                    command, stdout=out, stderr=subprocess.STDOUT, env=self.node_env(head),
                    start_new_session=True, cwd=self.temp_dir,
                )  # fmt: skip
            node = Node(process, log, head)
            self.nodes.append(node)
            deadline = time.monotonic() + 90
            while "Ray runtime started" not in (text := log.read_text(errors="replace")):
                if process.poll() is not None or time.monotonic() > deadline:
                    # Ray gives its raylet a fixed 30 s to register: on a busy 2-core
                    # machine it sometimes needs longer; one more try, then fail
                    if attempt == 1 and "timed out during startup" in text:
                        kill_session(node.session, signal.SIGKILL)
                        process.wait(timeout=30)
                        self.nodes.remove(node)
                        break
                    raise RuntimeError(f"ray start failed:\n{text[-3000:]}")
                time.sleep(0.2)
            else:
                return node
        raise AssertionError("unreachable: the second try returns or raises")

    def query(self, code: str) -> str:
        """Run ``code`` in a driver connected to the cluster; return what it printed."""
        prelude = (
            "import logging, ray\n"
            f"ray.init(address={self.address!r}, logging_level=logging.ERROR, "
            "log_to_driver=False)\n"
        )
        done = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True,
                              text=True, env=self.env(), timeout=120)  # fmt: skip
        if done.returncode != 0:
            raise RuntimeError(f"query failed: {done.stderr[-3000:]}")
        return done.stdout

    def alive_node_ids(self) -> dict[str, bool]:
        """{node id: is it the head} for every node the cluster holds alive."""
        out = self.query(
            "for n in ray.nodes():\n"
            "    if n['Alive']:\n"
            "        print(n['NodeID'], n['Resources'].get('node:__internal_head__', 0) > 0)\n"
        )
        return {line.split()[0]: line.split()[1] == "True" for line in out.splitlines()}

    def kill(self, node: Node) -> None:
        """Kill every process of ``node`` at once, as a machine that goes away would."""
        kill_session(node.session, signal.SIGKILL)
        node.process.wait(timeout=30)

    def stop(self) -> None:
        """Stop every node (what is left of it) and remove the temporary directory."""
        for node in self.nodes:
            kill_session(node.session, signal.SIGKILL)
            if node.process.poll() is None:
                node.process.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(node.pids() for node in self.nodes) and time.monotonic() < deadline:
            time.sleep(0.1)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def session_pids(session: int) -> list[int]:
    """The live processes of a session (zombies, already dead, are left out)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp session ...: comm may hold spaces and parentheses
        state, _ppid, _pgrp, sid = stat[stat.rfind(")") + 2 :].split()[:4]
        if int(sid) == session and state != "Z":
            pids.append(int(entry.name))
    return pids


def kill_session(session: int, sig: int) -> None:
    for pid in session_pids(session):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
