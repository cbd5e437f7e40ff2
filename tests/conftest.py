"""Shared fixtures: Ray is started once per test session, and only by the tests that need
it; the modules that must stay light are imported once, in one fresh process.

`make test` runs the suite on two pytest-xdist workers (``-n 2 --dist loadgroup``). The
tests that use the session's Ray (``ray_session``, marked ``ray``) are one group, ``ray``:
they run one after another on one worker, which starts the one Ray they share (two Rays of
2 CPUs each would only fight over this machine's two cores); so are the tests that share a
module-scoped fixture (test_cluster's cluster), which is then started once. The workers
share the rest, the other slow tests included (searches run as commands start their own
Ray, as a user's `mbtune run` does; trials run in processes of their own)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

RAY_GROUP = "ray"
GATE_HOOK = Path(__file__).with_name("gate_hook")


@pytest.hookimpl(wrapper=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    for item in items:  # before the other hooks, xdist's among them
        uses_ray = "ray_session" in getattr(item, "fixturenames", ())  # directly or not
        if uses_ray and not item.get_closest_marker("ray"):
            raise pytest.UsageError(f"{item.nodeid} uses ray_session: mark it ray")
        if uses_ray:
            item.add_marker(pytest.mark.xdist_group(RAY_GROUP))
        elif shared := _module_fixtures(item):  # built once, for the tests on one worker
            item.add_marker(pytest.mark.xdist_group("+".join(shared)))
    yield
    # after them: what xdist's --dist loadgroup does on a worker, where xdist 3.8 cannot on
    # pytest 9: a test of a group gets the group's name after its id (``...::test@ray``),
    # by which the scheduler sends the whole group to one worker. xdist writes
    # ``item._nodeid``; pytest 9 reads a node's id from ``item._id`` (a NodeId)
    if getattr(config.option, "loadgroup", False):
        for item in items:
            groups = sorted({str(m.args[0]) for m in item.iter_markers("xdist_group") if m.args})
            if groups and "@" not in item.nodeid and hasattr(item, "_id"):
                item._id = type(item._id).parse(f"{item.nodeid}@{'_'.join(groups)}")


def _module_fixtures(item: pytest.Item) -> list[str]:
    """The module-scoped fixtures ``item`` uses (test_cluster's cluster of `ray start`
    nodes): the tests that share one are a group, so that it is started once."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return sorted(name for name, d in defs.items() if d and d[-1].scope == "module")


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """Torch computes on one thread in the test process, as a trial that holds one CPU does
    (mbtune sets a trial's threads from ``ray.cpus_per_trial``). The suite's two workers
    share two cores with the processes the tests start: with torch's default of a thread
    per core, each worker's OpenMP threads wait for a core the other holds, spinning: a
    test of real steps took twice the CPU beside one busy core (docs/benchmarks.md)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def ray_session(tmp_path_factory):
    """The session's Ray. Its processes, and so the trial processes of every search on it,
    import tests/gate_hook: the session's trial gate (tests/trial_gate.py), open until a
    test closes it (the tests of this Ray run one at a time, on one worker)."""
    import ray

    global _SESSION_GATE
    _SESSION_GATE = tmp_path_factory.mktemp("ray-gate")
    # Ray's processes keep the environment they start with; this process, its own
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PYTHONPATH", str(GATE_HOOK), prepend=os.pathsep)
        env.setenv("MBTUNE_TEST_GATE", str(_SESSION_GATE))
        # its log monitor looks for new worker log files every 0.5 s, not every 0.1 s, as
        # Ray's own does past 1,000 files: half its CPU (60 actors' logs, 30 s idle: 0.71 ->
        # 0.37 CPU-s); a driver joining this Ray still gets every line, at most 0.5 s later
        env.setenv("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
                 logging_level=logging.ERROR)  # fmt: skip
    yield ray
    ray.shutdown()


_SESSION_GATE: Path | None = None


@dataclass(frozen=True)
class SharedRay:
    """The session's Ray as a command joins it (``mbtune run --address``), and its gate."""

    address: str
    gate: Path


@pytest.fixture
def shared_ray(ray_session) -> SharedRay:
    """For a search run as a command where an embedded Ray's start-up is not what is tested:
    it joins the session's Ray (``--address``) instead of starting one of its own."""
    assert _SESSION_GATE is not None
    return SharedRay(ray_session.get_runtime_context().gcs_address, _SESSION_GATE)


# -- what the light modules import ------------------------------------------------------

LIGHT_IMPORTS = {
    "package": "import mbtune",
    "record": "import mbtune.runs.record, mbtune.runs.rundir, mbtune.recommend.reporter",
    "loaders": "from mbtune import load_run, load_runs",
    "analysis": "import mbtune.analysis.frames, mbtune.analysis.export, mbtune.analysis.plots",
    "cores": "import mbtune.lattice, mbtune.config.load, mbtune.recommend.confidence, "
    "mbtune.recommend.reporter",
    "batch": "import mbtune.models.batch",
    "plan": "import mbtune.plan",
    "hf_keys": "from mbtune.config.model_options import hf_config_key\n"
    "result = [hf_config_key(t, 'num_hidden_layers') for t in ('gpt2', 'llama', 'clip')]",
}
"""Steps run in this order in one fresh process, a test naming its step: first those that
must not bring pandas, then the loaders, which do. ``result``: a value a step hands back."""

WATCHED = ("torch", "ray", "pandas", "transformers")
"""The heavy libraries whose import is looked for."""

_RUNNER = """
import json, sys
steps, watched, found, ns = json.loads(sys.argv[1]), sys.argv[2].split(","), [], {}
for name, code in steps.items():
    before = {m for m in watched if m in sys.modules}
    exec(code, ns)
    new = sorted(m for m in watched if m in sys.modules and m not in before)
    found.append([name, new, ns.pop("result", None)])
print(json.dumps(found))
"""


class LightImports:
    """What :data:`LIGHT_IMPORTS`' steps imported, in one process, one after another."""

    def __init__(self, found: list[list]) -> None:
        self.found = found

    def loaded(self, step: str) -> dict[str, str]:
        """The watched libraries in the process once ``step`` has run (the steps before it
        ran too), each with the step that imported it."""
        seen: dict[str, str] = {}
        for name, new, _ in self.found:
            seen.update({m: name for m in new if m not in seen})
            if name == step:
                return seen
        raise KeyError(step)

    def result(self, step: str):
        return next(result for name, _, result in self.found if name == step)


@pytest.fixture(scope="session")
def light_imports() -> LightImports:
    """Each step of :data:`LIGHT_IMPORTS`, in one fresh process (one start-up for every
    test of what a module imports, not one each)."""
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, json.dumps(LIGHT_IMPORTS), ",".join(WATCHED)],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1], timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return LightImports(json.loads(done.stdout.splitlines()[-1]))
