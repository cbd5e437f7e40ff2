"""`mbtune run` on a real Ray cluster, and the ways a cluster goes away.

A cluster of `ray start` processes on this machine (tests/local_cluster.py): a head and a worker
node, one CPU each, so that two trials at a time run one on each node. The trials build a
model that holds while a file exists (the "hold"), so a test knows that a trial is in flight,
and on which node (its process is in that node's session), before it kills a node: no
timing is guessed. What the run prints and writes is read from the real `mbtune` command.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TextIO

import psutil
import pytest
import yaml
from local_cluster import LocalCluster, kill_session
from trial_gate import TrialGate

from mbtune.cluster import short_of
from mbtune.runs.rundir import RunDir

MBTUNE = [sys.executable, "-m", "mbtune.cli"]
ROOT = Path(__file__).resolve().parent.parent

# A model whose trial processes hold while gates/hold exists, announcing themselves first.
# The driver builds the model too (its check of a user model): it never holds.
HELD = """
import os, sys, time
import torch, torch.nn as nn

def build(gates):
    main = getattr(sys.modules["__main__"], "__spec__", None)
    if main is not None and main.name == "mbtune.trial.__main__":  # a trial, not the driver
        hold = os.path.join(gates, "hold")
        if os.path.exists(hold):
            open(os.path.join(gates, f"started-{os.getpid()}"), "w").close()
            deadline = time.monotonic() + 120
            while os.path.exists(hold) and time.monotonic() < deadline:
                time.sleep(0.05)
    return (nn.Linear(4, 1), lambda n, device: (torch.randn(n, 4, device=device),),
            lambda module, batch: module(batch[0]).pow(2).mean())
"""


class Output:
    """A command's output, in files in ``dir`` (stdout, stderr)."""

    def __init__(self, directory: Path) -> None:
        self.dir = directory

    def files(self) -> tuple[TextIO, TextIO]:
        """The files to start the command with (its stdout, its stderr)."""
        return (self.dir / "stdout").open("w"), (self.dir / "stderr").open("w")

    def out(self) -> str:
        return (self.dir / "stdout").read_text()

    def err(self) -> str:
        return (self.dir / "stderr").read_text()


class Held(Output):
    """An experiment of the held model (by default its four micro-batch sizes), its hold
    and its run directory."""

    def __init__(
        self, tmp_path: Path, concurrent: int = 2, sizes: tuple[int, ...] = (1, 2, 4, 8)
    ) -> None:
        super().__init__(tmp_path)
        self.gates = tmp_path / "gates"
        self.gates.mkdir()
        (tmp_path / "held.py").write_text(textwrap.dedent(HELD))
        spec = {
            "name": "held",
            "model": {"name": "held:build", "gates": str(self.gates)},
            "train_input": {"batch_size": 8, "micro_batch_size": "auto"},
            # every configuration once, whatever the confidence score
            "search": {"space": {"num_devices": [1], "micro_batch_size": list(sizes)},
                       "sampler": "grid", "confidence_target": 100, "max_repeats": 1},
            "trial": {"compile": False, "warmup_steps": 1, "measure_steps": 1,
                      "timeout_s": 150},
            "ray": {"max_concurrent_trials": concurrent},
            "output_dir": str(tmp_path / "runs"),
        }  # fmt: skip
        self.file = tmp_path / "held.yaml"
        self.file.write_text(yaml.safe_dump(spec))

    def hold(self) -> None:
        (self.gates / "hold").touch()

    def release(self) -> None:
        (self.gates / "hold").unlink(missing_ok=True)

    def started(self) -> set[int]:
        """The trial processes that found the hold (their pids)."""
        return {int(p.name.split("-")[1]) for p in self.gates.glob("started-*")}

    def run_dir(self) -> Path:
        return next((self.dir / "runs").glob("held-*"))

    def finished(self) -> int:
        """How many trials trials.csv holds so far."""
        runs = list((self.dir / "runs").glob("held-*"))
        return len(RunDir(runs[0]).trials()) if runs else 0

    def start(self, *args: str, env: dict[str, str]) -> subprocess.Popen:
        """`mbtune run` on this experiment; its output goes to files (read: out(), err())."""
        out, err = self.files()
        return subprocess.Popen([*MBTUNE, "run", *args], stdout=out, stderr=err, env=env,
                                cwd=self.dir, start_new_session=True)  # fmt: skip


def wait_for(
    condition, what: str, proc: subprocess.Popen, output: Output, timeout: float = 120
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            pytest.fail(f"{what}: never happened\n{output.out()[-3000:]}\n{output.err()[-3000:]}")
        time.sleep(0.1)


def stop(proc: subprocess.Popen) -> None:
    """Kill what is left of an `mbtune run`: its session holds the driver and what it
    started (an embedded Ray's processes, its trial processes)."""
    kill_session(proc.pid, signal.SIGKILL)
    proc.wait()


def configs(rows: list[dict]) -> list[int]:
    return sorted(int(r["micro_batch_size"]) for r in rows)


@pytest.fixture(scope="module")
def cluster():
    c = LocalCluster()
    try:
        c.start_head()
        c.add_node()
        yield c
    finally:
        c.stop()


@pytest.mark.slow
def test_a_search_runs_on_the_cluster_with_the_token_at_hand_and_goes_on_when_a_worker_node_is_lost(
    cluster, tmp_path
):
    held = Held(tmp_path, sizes=(2, 4, 8))
    head, worker = cluster.nodes
    ids = cluster.alive_node_ids()
    head_id, worker_id = (next(i for i, is_head in ids.items() if is_head == h) for h in (1, 0))
    held.hold()
    # the token at hand where Ray's loader would find it, not in the environment: Ray reads
    # RAY_AUTH_MODE once, when it is imported, and the search's modules import it, so the
    # command checks the cluster RAY_ADDRESS names (and sets RAY_AUTH_MODE) before them, or
    # its Ray would join without the token and be refused
    token = tmp_path / "home" / ".ray" / "auth_token"
    token.parent.mkdir(parents=True)
    token.write_text(cluster.token)
    env = {k: v for k, v in cluster.env().items() if not k.startswith("RAY_AUTH_")}
    # --address auto with RAY_ADDRESS set: Ray's rule, as under `ray job submit`
    proc = held.start(str(held.file), "--address", "auto",
                      env={**env, "HOME": str(tmp_path / "home"),
                           "RAY_ADDRESS": cluster.address})  # fmt: skip
    try:
        # two trials in flight at once, one CPU per node: one runs on each node
        wait_for(lambda: len(held.started()) == 2, "two trials in flight", proc, held)
        on_head, on_worker = (held.started() & set(n.pids()) for n in (head, worker))
        assert len(on_head) == len(on_worker) == 1, (held.started(), head.pids(), worker.pids())
        cluster.kill(worker)  # the machine goes away, its trial with it
        held.release()
        assert proc.wait(timeout=240) == 0, held.err()[-3000:]
    finally:
        stop(proc)
    assert (f"mbtune: the Ray cluster at {cluster.address} requires token authentication: "
            f"using the token in {token}") in held.err().splitlines()  # fmt: skip
    # Ray names the head by the machine's address, not by the loopback one it was given
    assert f":{cluster.port}: 2 node(s), 2 CPUs, 0 GPUs" in held.out()
    rows = RunDir(held.run_dir()).trials()
    assert configs(rows) == [2, 4, 8]  # each configuration once, none lost
    lost = [r for r in rows if r["status"] != "ok"]
    assert len(lost) == 1 and lost[0]["status"] == "error", rows
    assert lost[0]["reason"].startswith("the node the trial ran on was lost: "), lost[0]["reason"]
    assert "Traceback" not in lost[0]["reason"]
    assert lost[0]["node_id"] == worker_id  # where it ran: the trial said so before measuring
    # the trial on the head, and the one after the loss, measured on the head
    assert [r["node_id"] for r in rows if r["status"] == "ok"] == [head_id] * 2
    assert all(float(r["samples_per_s"]) > 0 for r in rows if r["status"] == "ok")
    summary = json.loads((held.run_dir() / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["trials"] == 3


@pytest.mark.slow
def test_joining_a_cluster_without_its_token_is_a_one_line_error(cluster, tmp_path):
    held = Held(tmp_path)
    (tmp_path / "home").mkdir()  # no ~/.ray/auth_token: no token at hand
    env = {k: v for k, v in cluster.env().items() if not k.startswith("RAY_AUTH_")}
    env["HOME"] = str(tmp_path / "home")
    cases = [
        (env, "requires token authentication: set RAY_AUTH_TOKEN to its token, or write it "
              "to ~/.ray/auth_token"),
        ({**env, "RAY_AUTH_TOKEN": "0" * 64}, "refused the token in RAY_AUTH_TOKEN"),
        ({**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}, "refused this token"),
    ]  # fmt: skip
    command = [*MBTUNE, "run", str(held.file), "--address", cluster.address]
    runs = [  # at once: each is a whole mbtune start-up
        (subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=environment, cwd=tmp_path), says)
        for environment, says in cases
    ]  # fmt: skip
    for proc, says in runs:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, err
        assert err.startswith(f"mbtune: error: --address: the Ray cluster at {cluster.address} "
                              f"{says}")  # fmt: skip
        assert err.count("\n") == 1  # one line: Ray's own log of the refusal is not shown
    assert not (tmp_path / "runs").exists()  # nothing written


@pytest.mark.slow
def test_a_named_cluster_that_wants_a_token_gets_the_one_at_hand(cluster, tmp_path):
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text(cluster.token + "\n")
    env = {k: v for k, v in cluster.env().items() if not k.startswith("RAY_AUTH_")}
    joining = "import sys; from mbtune.cluster import init_ray; print(init_ray(sys.argv[1], 0, 0))"
    for environment, source in [
        ({**env, "RAY_AUTH_TOKEN": cluster.token}, "RAY_AUTH_TOKEN"),
        ({**env, "HOME": str(tmp_path)}, str(tmp_path / ".ray" / "auth_token")),
    ]:
        done = subprocess.run([sys.executable, "-c", joining, cluster.address], env=environment,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        # the lines meant, found among the others: the joined driver's Ray writes to both
        # streams at any moment (what the cluster publishes: the node a test before killed,
        # marked dead)
        said = [line for line in done.stderr.splitlines() if line.startswith("mbtune")]
        assert said == [f"mbtune: the Ray cluster at {cluster.address} requires token "
                        f"authentication: using the token in {source}"], done.stderr  # fmt: skip
        joined = rf"\('\S+:{cluster.port}', None\)"  # init_ray's answer: the GCS, no dashboard
        assert any(re.fullmatch(joined, line) for line in done.stdout.splitlines()), done.stdout


def test_a_token_is_at_hand_where_rays_loader_would_find_one(tmp_path):
    from mbtune.cluster import token_source

    default = tmp_path / ".ray" / "auth_token"
    assert token_source({}, tmp_path) is None
    assert token_source({"RAY_AUTH_TOKEN": " "}, tmp_path) is None
    default.parent.mkdir()
    default.write_text("\n")  # empty: no token
    assert token_source({}, tmp_path) is None
    default.write_text("abc\n")
    assert token_source({}, tmp_path) == str(default)
    assert token_source({"RAY_AUTH_TOKEN": "abc"}, tmp_path) == "RAY_AUTH_TOKEN"
    named = tmp_path / "named"
    # RAY_AUTH_TOKEN_PATH replaces ~/.ray/auth_token, as in Ray: a missing file is no token
    assert token_source({"RAY_AUTH_TOKEN_PATH": str(named)}, tmp_path) is None
    named.write_text("xyz")
    assert token_source({"RAY_AUTH_TOKEN_PATH": str(named)}, tmp_path) == str(named)
    assert token_source({"RAY_AUTH_TOKEN": "a", "RAY_AUTH_TOKEN_PATH": str(named)}, tmp_path) == (
        "RAY_AUTH_TOKEN"
    )


@pytest.mark.slow
def test_a_search_whose_head_node_goes_away_stops_cleanly_and_resumes(cluster, tmp_path):
    held = Held(tmp_path, concurrent=1, sizes=(4, 8))
    lonely = LocalCluster()
    # Ray ends a driver 12 s after its GCS went silent; mbtune ends the search at 6 s
    env = lonely.env(RAY_gcs_rpc_server_reconnect_timeout_s="12")
    proc = None
    try:
        lonely.start_head()
        proc = held.start(str(held.file), "--address", lonely.address, env=env)
        wait_for(lambda: held.finished() >= 1, "a first finished trial", proc, held)
        held.hold()
        wait_for(lambda: held.started(), "a trial in flight", proc, held)
        lost = time.monotonic()
        lonely.kill(lonely.nodes[0])
        code = proc.wait(timeout=60)
        waited = time.monotonic() - lost
    finally:
        if proc is not None:
            stop(proc)
        lonely.stop()
    # the line meant, wherever it is: Ray's own threads write to the same stream
    errors = [line for line in held.err().splitlines() if line.startswith("mbtune: error: ")]
    assert code == 75, held.err()[-3000:]
    port = lonely.port  # Ray names the head by the machine's address, not the loopback one
    assert len(errors) == 1, held.err()[-3000:]
    assert re.fullmatch(rf"mbtune: error: the Ray cluster's head node \(\S+:{port}\) has not "
                        rf"answered for \d+ s; \S+/trials.csv holds the \d finished trial\(s\); "
                        rf"continue with: mbtune run --resume \S+ \(and --address of a cluster\)",
                        errors[0]), errors[0]  # fmt: skip
    assert "Traceback" not in held.err()
    assert waited >= 6  # it waited for a head that might come back (Ray's exit code is 1)
    run = RunDir(held.run_dir())
    before = run.trials()
    assert len(before) == 1 and before[0]["status"] == "ok"  # the other was in flight
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["trials"] == len(before)
    assert re.fullmatch(rf"the Ray cluster's head node \(\S+:{port}\) went away", summary["reason"])
    # resume on another cluster (the module's): the trial lost in flight and the rest run now
    held.release()
    done = subprocess.run([*MBTUNE, "run", "--resume", str(run.path), "--address",
                           cluster.address], capture_output=True, text=True,
                          env=cluster.env(), cwd=tmp_path, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    after = run.trials()
    assert after[:1] == before and configs(after) == [4, 8]
    assert json.loads((run.path / "summary.json").read_text())["status"] == "finished"


def test_ray_client_addresses_are_refused_with_the_way_to_go(tmp_path, capsys, monkeypatch):
    from mbtune.cli import main

    held = Held(tmp_path)
    monkeypatch.chdir(tmp_path)  # the model is checked (imported from here) first
    assert main(["run", str(held.file), "--address", "ray://127.0.0.1:10001"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mbtune: error: --address: ray://127.0.0.1:10001: Ray Client (ray://)")
    assert "ray job submit --address http://HEAD:8265" in err and err.count("\n") == 1
    assert not (tmp_path / "runs").exists()


EMBEDDED_SEARCH = """
import json, sys
import mbtune.cluster as cluster
from_init_ray = {}
init_ray = cluster.init_ray

def recorded(*args, **kwargs):  # as `mbtune run` starts its embedded Ray: what it imported
    before = set(sys.modules)  # (Ray Tune, imported already, brings pydantic of its own)
    answer = init_ray(*args, **kwargs)
    from_init_ray["imported"] = [n for n in cluster.DASHBOARD_DEPENDENCIES
                                 if n in sys.modules and n not in before]
    return answer

cluster.init_ray = recorded  # before the search's modules import it
from mbtune.cli import main
code = main(["run", "experiments/quickstart.yaml", "--dashboard", *sys.argv[1:]])
print(json.dumps({"code": code, "torch": "torch" in sys.modules, **from_init_ray}))
"""


@pytest.mark.slow
def test_an_embedded_search_serves_its_dashboard_on_loopback_and_imports_no_torch(tmp_path):
    """`mbtune run --dashboard` on an embedded Ray, its one trial held (tests/trial_gate.py),
    forked from the warm parent the driver started ahead. The dashboard answers on 127.0.0.1
    only, with the token, and knows the search's driver.
    Only trial processes need torch (2 s to import): the driver that reads the experiment
    and runs Tune does not load it, nor does Tune's default TensorBoard logger. And Ray asks
    whether its dashboard can run by importing its dependencies into the driver; mbtune
    answers from what is installed (mbtune.cluster): none of them is imported in the
    driver, and Ray still starts its dashboard process and the node's agent in full (the
    agent exports the metrics of docs/monitoring.md), not minimal."""
    gate = TrialGate(tmp_path / "gate", passes=0)
    token = os.urandom(32).hex()
    # token authentication is Ray's default for an embedded Ray: this token, not ~/.ray's
    env = {k: v for k, v in gate.env().items() if not k.startswith("RAY_")}
    env["RAY_AUTH_TOKEN"] = token
    sets = ["search.num_samples=1", "trial.compile=false", "trial.warmup_steps=0",
            "trial.measure_steps=1", f"output_dir={tmp_path / 'runs'}"]  # fmt: skip
    output = Output(tmp_path)
    stdout, stderr = output.files()
    with stdout, stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", EMBEDDED_SEARCH, *(f"--set={s}" for s in sets)],
            stdout=stdout, stderr=stderr, env=env, cwd=ROOT, start_new_session=True,
        )  # fmt: skip

    def said(prefix: str) -> list[str]:
        return [x for x in output.out().splitlines() if x.startswith(prefix)]

    try:
        wait_for(lambda: said("mbtune dashboard: http://"), "the dashboard URL", proc, output,
                 timeout=180)  # fmt: skip
        [line] = said("mbtune dashboard: ")
        url = line.split()[2]
        host, port = url.removeprefix("http://").split(":")
        assert host == "127.0.0.1" and "`ray get-auth-token` prints it" in line
        wait_for(gate.held, "a trial held", proc, output, timeout=180)
        # the first trial of an embedded search is forked from the warm parent the driver
        # started ahead (Ray's and Tune's variables told apart: it fits the trial's actor)
        [held] = gate.held()
        parent = " ".join(psutil.Process(held).parent().cmdline())
        assert " -m mbtune.trial --warm-ahead " in parent, parent

        def get(path: str, with_token: bool = True):
            headers = {"Authorization": f"Bearer {token}"} if with_token else {}
            request = urllib.request.Request(url + path, headers=headers)
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read().decode()

        status, page = get("/", with_token=False)
        assert status == 200 and "<title>Ray Dashboard</title>" in page
        with pytest.raises(urllib.error.HTTPError, match="401"):
            get("/api/version", with_token=False)
        import ray

        status, version = get("/api/version")
        assert status == 200 and json.loads(version)["ray_version"] == ray.__version__
        # the search in flight is this Ray's: its driver is our process
        status, jobs = get("/api/jobs/")
        drivers = [j.get("driver_info") or {} for j in json.loads(jobs)]
        assert str(proc.pid) in [str(d.get("pid")) for d in drivers], jobs[:2000]
        assert proc.poll() is None and not list((tmp_path / "runs").glob("*/summary.json"))
        assert not answers_elsewhere(int(port))  # bound to loopback only
        started = [" ".join(p.cmdline()) for p in psutil.Process(proc.pid).children(True)]
        head, agent = ([c for c in started if f"/ray/dashboard/{name} " in c]
                       for name in ("dashboard.py", "agent.py"))  # fmt: skip
        assert len(head) == 1 and len(agent) == 1, started
        assert "--minimal" not in head[0] and "--minimal" not in agent[0]
        gate.release()
        assert proc.wait(timeout=240) == 0, output.err()[-3000:]
    finally:
        gate.release()
        stop(proc)
    [ended] = said('{"code": ')
    assert json.loads(ended) == {"code": 0, "torch": False, "imported": []}
    [run] = (tmp_path / "runs").iterdir()
    assert [r["status"] for r in RunDir(run).trials()] == ["ok"]


def answers_elsewhere(port: int) -> bool:
    """Does ``port`` answer on one of this machine's addresses other than loopback?"""
    addresses = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: the kernel picks the interface
            addresses.add(s.getsockname()[0])
        except OSError:
            pass
    for address in addresses - {"127.0.0.1", "0.0.0.0"}:
        try:
            socket.create_connection((address, port), timeout=2).close()
            return True
        except OSError:
            continue
    return False


# -- joining a cluster, without one -------------------------------------------------------


@pytest.fixture
def ray_init(monkeypatch):
    """ray.init replaced by a recorder, as if no Ray were running yet."""
    from types import SimpleNamespace

    import ray

    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        return SimpleNamespace(address_info={"webui_url": None})

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address="h:1"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


def test_a_cluster_runs_the_drivers_mbtune_and_an_embedded_ray_needs_no_shipping(
    ray_init, monkeypatch
):
    import mbtune
    from mbtune.cluster import init_ray

    assert init_ray("auto", False, False) == ("h:1", None)
    shipped = ray_init[-1]["runtime_env"]["py_modules"]
    assert (
        shipped == [str(Path(mbtune.__file__).parent)]
        and Path(shipped[0], "trial", "trial.py").is_file()
    )
    assert init_ray(None, False, False) == (None, None)
    assert "runtime_env" not in ray_init[-1] and "address" not in ray_init[-1]
    # no --address, RAY_ADDRESS set (as `ray job submit` does): ray.init's rule, said aloud
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    assert init_ray(None, False, False) == ("h:1", None)
    assert ray_init[-1]["address"] == "auto" and "runtime_env" in ray_init[-1]


def test_a_port_that_never_answers_does_not_hold_the_token_check(monkeypatch):
    import grpc  # imported before the clock starts: the check's wait alone is timed

    from mbtune import cluster as joining

    assert grpc
    monkeypatch.setattr(joining, "TOKEN_CHECK_S", 0.5)
    with socket.socket() as silent:  # accepts connections (the kernel does), answers nothing
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        started = time.monotonic()
        joining.check_reachable(f"127.0.0.1:{silent.getsockname()[1]}")
        # given up after its own 0.5 s: Ray's client alone waits 40 s here (the bound is
        # there to tell the two apart, sixty times the check's wait: not a speed)
        assert time.monotonic() - started < 30


def test_an_address_from_ray_address_is_named_so_in_errors(monkeypatch, tmp_path):
    from mbtune.cluster import init_ray
    from mbtune.errors import MbtuneError

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    for address in (None, "auto"):  # auto: RAY_ADDRESS first, as ray.init reads it
        with pytest.raises(MbtuneError, match=rf"^RAY_ADDRESS: nothing answers at 127.0.0.1:"
                           rf"{port} .*or unset RAY_ADDRESS for an embedded Ray$"):  # fmt: skip
            init_ray(address, False, False)
    monkeypatch.setenv("RAY_ADDRESS", "ray://127.0.0.1:10001")
    for address in (None, "auto"):
        with pytest.raises(MbtuneError, match=r"^RAY_ADDRESS: ray://127.0.0.1:10001: Ray Client"):
            init_ray(address, False, False)


def test_short_of_names_what_no_node_has_any_more():
    need = {"cpu": 2.0, "gpu": 1.0}
    assert short_of(need, [{"CPU": 8.0, "GPU": 1.0}]) is None
    assert short_of(need, [{"CPU": 1.0, "GPU": 1.0}]) == "2 CPU (no node has more than 1)"
    assert short_of(need, [{"CPU": 4.0}]) == "1 GPU (no node has more than 0)"
    # two CPUs in the cluster, but on two nodes: a trial is placed on one node
    assert short_of({"cpu": 2.0}, [{"CPU": 1.0}, {"CPU": 1.0}]) == "2 CPU (no node has more than 1)"
    # each part somewhere, never together
    assert short_of(need, [{"CPU": 4.0}, {"CPU": 1.0, "GPU": 1.0}]) == "one node with all of it"
    assert short_of({"cpu": 0, "gpu": 0, "memory": 1}, [{"memory": 5e9}]) is None


@pytest.mark.slow
def test_a_search_whose_only_node_that_fits_a_trial_is_lost_stops_cleanly_and_resumes(
    cluster, tmp_path
):
    held = Held(tmp_path, concurrent=1, sizes=(4, 8))
    spec = yaml.safe_load(held.file.read_text())
    spec["ray"].update(cpus_per_trial=2, resource_wait_s=3)  # only the big node fits a trial
    held.file.write_text(yaml.safe_dump(spec))
    proc = None
    big = cluster.add_node(num_cpus=2)  # beside the module's nodes of one CPU each
    try:
        held.hold()
        proc = held.start(str(held.file), "--address", cluster.address, env=cluster.env())
        wait_for(lambda: held.started(), "a trial in flight", proc, held)
        cluster.kill(big)
        code = proc.wait(timeout=180)
    finally:
        if proc is not None:
            stop(proc)
        if big.process.poll() is None:
            cluster.kill(big)
    said = [line for line in held.out().splitlines() if "no node with what one trial" in line]
    assert code == 130, held.err()[-3000:]
    assert said == [
        "mbtune: the Ray cluster has had no node with what one trial needs (2 CPU "
        "(no node has more than 1)) for 3 s; stopping the search"
    ], held.out()[-3000:]
    assert "Traceback" not in held.err()
    run = RunDir(held.run_dir())
    before = run.trials()
    assert [(r["micro_batch_size"], r["status"]) for r in before] == [("4", "error")]
    assert before[0]["reason"].startswith("the node the trial ran on was lost: ")
    summary = json.loads((run.path / "summary.json").read_text())
    assert summary["status"] == "interrupted"
    assert (
        summary["reason"]
        == "the Ray cluster no longer had what one trial needs: 2 CPU (no node has more than 1)"
    )
    # resume where a trial fits (here an embedded Ray of this machine's two CPUs)
    held.release()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    done = subprocess.run([*MBTUNE, "run", "--resume", str(run.path)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    after = run.trials()
    assert after[:1] == before and configs(after) == [4, 8] and after[1]["status"] == "ok"
