"""A search's Ray metrics and the Grafana dashboard that shows them (docs/monitoring.md).

The gauges are read from the session Ray's own Prometheus endpoint, over HTTP, after a
replay search, and compared with the run directory's files; the dashboard is read as JSON
and its PromQL is checked against mbtune.metrics.METRICS. Neither Prometheus nor Grafana
is needed."""

from __future__ import annotations

import json
import re
import time
import urllib.request
from pathlib import Path

import pytest

from mbtune import metrics
from mbtune.config.load import parse_experiment
from mbtune.metrics import EXPORTED, METRICS, RunState
from mbtune.runs.record import CONFIG_KEY, TrialRecord, cell

ROOT = Path(__file__).resolve().parents[1]
SERVED = re.compile(r"\bray_(mbtune_\w+)")

# --- the dashboard ------------------------------------------------------------------------


def queries(node) -> list[str]:
    """Every PromQL text of a Grafana dashboard: the panels' targets and the variables'."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                found.append(value)
            elif key == "query" and isinstance(value, str | dict):
                found += [value] if isinstance(value, str) else queries(value)
            else:
                found += queries(value)
    elif isinstance(node, list):
        for item in node:
            found += queries(item)
    return found


def test_the_dashboard_queries_every_exported_metric_and_nothing_else():
    board = metrics.dashboard_json()
    assert board["title"] == "mbtune" and board["uid"]
    texts = [q for q in queries(board) if "mbtune" in q]
    assert texts, "the dashboard queries no mbtune metric"
    named = {m for q in texts for m in SERVED.findall(q)}
    assert named <= EXPORTED, f"not exported by mbtune: {sorted(named - EXPORTED)}"
    assert named == EXPORTED, f"exported, never shown: {sorted(EXPORTED - named)}"
    # Prometheus has them only as Ray serves them: with ray_ in front
    bare = [q for q in texts if re.search(r"(?<!ray_)\bmbtune_\w+", q)]
    assert not bare, bare
    # each configuration is every searched dimension: none is merged with another's
    (throughput,) = [q for q in texts if "trial_samples_per_s" in q]
    by = re.search(r"by \(([^)]*)\)", throughput)
    assert by and {d.strip() for d in by[1].split(",")} == set(CONFIG_KEY), throughput
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    assert all(p["targets"] and p["description"] for p in panels)
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "run"]


def test_the_docs_table_names_each_metric_as_prometheus_has_it():
    text = (ROOT / "docs" / "monitoring.md").read_text()
    assert set(SERVED.findall(text)) == EXPORTED
    for m in METRICS:
        assert f"`ray_{m.name}`" in text, m.name


def test_the_state_says_what_the_records_say():
    ok = TrialRecord(trial=1, status="ok", batch_size=32, num_devices=2, micro_batch_size=8,
                     samples_per_s=630.25)  # fmt: skip
    oom = TrialRecord(trial=2, status="oom", batch_size=32, num_devices=2, micro_batch_size=16)
    rec = {"confidence": 61, "estimated_performance": 2.1, "samples_per_s": 630.25,
           "batch_size": 32, "num_devices": 2, "micro_batch_size": 8}  # fmt: skip
    state = RunState.start("r-1", target=90, budget=20, records=[ok, oom], history=[rec])
    state.running = 1
    got = {(name, tuple(sorted(tags.items()))): value for name, value, tags in state.samples()}
    run = (("run", "r-1"),)
    assert got[("mbtune_confidence", run)] == 61 and got[("mbtune_confidence_target", run)] == 90
    assert got[("mbtune_recommended_speedup", run)] == 2.1
    assert got[("mbtune_recommended_micro_batch_size", run)] == 8
    # a setting at its default is not named in the record: its default is exported
    assert got[("mbtune_recommended_activation_checkpointing", run)] == 0
    assert (got[("mbtune_trials_finished", run)], got[("mbtune_trials_failed", run)],
            got[("mbtune_trials_running", run)]) == (2, 1, 1)  # fmt: skip
    trial_tags = {"run": "r-1", "trial": "1"} | {k: cell(getattr(ok, k)) for k in CONFIG_KEY}
    assert (
        trial_tags["micro_batch_size"] == "8" and trial_tags["activation_checkpointing"] == "False"
    )
    assert got[("mbtune_trial_samples_per_s", tuple(sorted(trial_tags.items())))] == 630.25
    assert set(trial_tags) == {"run", "trial", *CONFIG_KEY}
    assert {name for name, _ in got} == EXPORTED  # an oom trial has no samples/s
    # before the first recommendation: the trials only
    before = {name for name, _, _ in RunState("r-2", 90, 20).samples()}
    assert before == {f"mbtune_{n}" for n in ("confidence_target", "trials_budget",
                      "trials_finished", "trials_failed", "trials_running")}  # fmt: skip


# --- the endpoint -------------------------------------------------------------------------

TABLE = """batch_size,num_devices,micro_batch_size,samples_per_s,status
32,1,16,310.25,ok
32,2,16,,oom
"""


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """The mbtune gauges an endpoint serves: (name without ray_, tags) -> value, with
    only mbtune's tags (Ray adds its own)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    ours = {"run", "trial", *CONFIG_KEY}
    found = {}
    for line in text.splitlines():
        m = re.match(r"ray_(mbtune_\w+)\{(.*)\} (\S+)$", line)
        if m:
            tags = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m[2]))
            found[(m[1], frozenset((k, v) for k, v in tags.items() if k in ours))] = float(m[3])
    return found


@pytest.mark.ray
@pytest.mark.slow
def test_the_gauges_reach_rays_endpoint_with_the_values_of_the_run_files(ray_session, tmp_path):
    from mbtune.search import run_search

    (tmp_path / "t.csv").write_text(TABLE)
    exp = parse_experiment({
        "name": "metrics", "model": "mlp",
        "train_input": {"batch_size": 32, "micro_batch_size": "auto"},
        "search": {"space": {"num_devices": [1, 2], "micro_batch_size": [16]},
                   "sampler": "grid", "confidence_target": 100, "max_repeats": 1},
        "trial": {"backend": "replay", "table": str(tmp_path / "t.csv")},
        "output_dir": str(tmp_path / "runs"),
    })  # fmt: skip
    run = run_search(exp, echo=lambda line: None).run
    rows, last = run.trials(), run.recommendations()[-1]
    name = run.path.name
    expected = {
        ("mbtune_trials_finished", frozenset({("run", name)})): float(len(rows)),
        ("mbtune_trials_failed", frozenset({("run", name)})): 1.0,
        ("mbtune_trials_running", frozenset({("run", name)})): 0.0,
        ("mbtune_trials_budget", frozenset({("run", name)})): float(exp.search.num_samples),
        ("mbtune_confidence", frozenset({("run", name)})): float(last["confidence"]),
        ("mbtune_recommended_speedup", frozenset({("run", name)})): last["estimated_performance"],
        ("mbtune_recommended_samples_per_s", frozenset({("run", name)})): last["samples_per_s"],
        ("mbtune_recommended_micro_batch_size", frozenset({("run", name)})): float(
            last["micro_batch_size"]
        ),
    }
    for row in rows:
        if row["status"] == "ok":
            tags = frozenset({("run", name), ("trial", row["trial"])}
                             | {(k, row[k]) for k in CONFIG_KEY})  # fmt: skip
            expected[("mbtune_trial_samples_per_s", tags)] = float(row["samples_per_s"])
    assert len(rows) == 2 and sum(k[0] == "mbtune_trial_samples_per_s" for k in expected) == 1
    url = ray_session_endpoint()
    # the board flushes its gauges as it ends with the search; Ray serves them a while after
    deadline, got = time.monotonic() + 30, {}
    while time.monotonic() < deadline:
        got = scrape(url)
        if all(got.get(key) == value for key, value in expected.items()):
            break
        time.sleep(0.25)
    wrong = {k: (v, got.get(k)) for k, v in expected.items() if got.get(k) != v}
    assert not wrong, f"expected, served: {wrong}"


def ray_session_endpoint() -> str:
    url = metrics.endpoint()
    assert url is not None and url.startswith("http://") and url.endswith("/metrics")
    return url


@pytest.mark.ray
def test_the_dashboard_is_installed_into_the_ray_sessions_grafana_directory(
    ray_session, tmp_path, monkeypatch
):
    monkeypatch.delenv("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", raising=False)
    context = ray_session.get_runtime_context()
    session = Path(context.get_temp_dir()) / context.get_session_name()
    assert session.is_dir()
    grafana = session / "metrics" / "grafana"
    if not grafana.exists():  # the session Ray runs no dashboard, which would make it
        assert metrics.install_dashboard() is None
    made = not grafana.exists()
    (grafana / "dashboards").mkdir(parents=True, exist_ok=True)
    try:
        installed = metrics.install_dashboard()
        assert installed == grafana / "dashboards" / "mbtune.json"
        assert json.loads(installed.read_text()) == metrics.dashboard_json()
    finally:
        if made:
            import shutil

            shutil.rmtree(grafana)
    # Ray's own setting of where the dashboards go, honoured
    monkeypatch.setenv("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR", str(tmp_path))
    assert metrics.install_dashboard() == tmp_path / "mbtune.json"
