"""A running search as Ray metrics, and the Grafana dashboard that shows them.

The search's progress board (the Ray actor of mbtune.progress, on the driver's node, alive
as long as the search) holds a :class:`RunState` and sets a ``ray.util.metrics.Gauge`` for
each of :data:`METRICS` from it. The driver tells the board each finished trial, as the
record it appended to trials.csv, with the record it appended to recommendations.jsonl
after it, and how many trials run: so what the node's Prometheus endpoint serves equals
the run directory's files. Ray serves each name with ``ray_`` before it
(``mbtune_confidence`` is scraped as ``ray_mbtune_confidence``) and adds tags of its own
(``SessionName``, ``NodeAddress``, ``WorkerId``, ...); every mbtune metric is tagged with
``run``, the run directory's name.

:data:`METRICS` is the one list of what is exported: the gauges are made from it,
docs/monitoring.md's table names them, and a test checks that the Grafana dashboard
(``grafana_dashboard.json`` beside this module, package data) queries only these.
:func:`install_dashboard` copies that dashboard where Grafana, set up as Ray's docs say,
reads its dashboards from. Ray is imported only inside functions.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from mbtune.lattice import BatchConfig
from mbtune.runs.record import COLUMNS, CONFIG_KEY, TrialRecord, cell

__all__ = [
    "DASHBOARD_FILE", "EXPORTED", "METRICS", "Metric", "RunGauges", "RunState",
    "dashboard_dir", "dashboard_json", "endpoint", "install_dashboard",
]  # fmt: skip

RUN_TAG = "run"


def _kind(name: str) -> str:
    return next(c.kind for c in COLUMNS if c.name == name)


NUMBERED = tuple(c.name for c in COLUMNS if c.searched and c.kind in ("int", "float", "bool"))
"""The searched dimensions a gauge can hold (a number; a bool as 1 or 0): each has a
``mbtune_recommended_<name>``. A setting of text (``grad_sync``) is a tag of each trial's
samples/s only."""
TRIAL_TAGS = (RUN_TAG, "trial", *CONFIG_KEY)
"""The tags of a trial's samples/s: its row in trials.csv and the configuration (every
searched dimension, as trials.csv writes it)."""


@dataclass(frozen=True)
class Metric:
    name: str
    meaning: str
    tags: tuple[str, ...] = (RUN_TAG,)


METRICS: tuple[Metric, ...] = (
    Metric("mbtune_confidence", "the confidence score of the current recommendation, 0 to 100"),
    Metric(
        "mbtune_confidence_target",
        "`search.confidence_target`: the score at which the search may stop",
    ),
    Metric(
        "mbtune_recommended_speedup",
        "the recommendation's estimated performance: the model's estimate of its objective "
        "over that of the run's first recommendation (`estimated_performance`, the stream's "
        "`1.23x base`)",
    ),
    Metric(
        "mbtune_recommended_samples_per_s",
        "the recommended configuration's measured samples/s (its best look)",
    ),
    *(
        Metric(
            f"mbtune_recommended_{key}",
            f"the recommended configuration's `{key}`"
            + (" (1: true, 0: false)" if _kind(key) == "bool" else ""),
        )
        for key in NUMBERED
    ),
    Metric("mbtune_trials_budget", "`search.num_samples`: the most trials the search runs"),
    Metric("mbtune_trials_finished", "trials finished (the rows of trials.csv), failed ones too"),
    Metric("mbtune_trials_failed", "finished trials whose status is not `ok`"),
    Metric("mbtune_trials_running", "trials running now"),
    Metric(
        "mbtune_trial_samples_per_s",
        "each finished trial's samples/s (`ok` trials), tagged with its row in trials.csv "
        f"(`trial`) and its configuration ({', '.join(f'`{k}`' for k in CONFIG_KEY)})",
        TRIAL_TAGS,
    ),
)
"""Every metric mbtune exports, by its name before Ray's ``ray_``."""

EXPORTED: frozenset[str] = frozenset(m.name for m in METRICS)

DASHBOARD_FILE = "grafana_dashboard.json"
"""The Grafana dashboard, package data of mbtune; installed as ``mbtune.json``."""

INSTALLED_AS = "mbtune.json"


@dataclass
class RunState:
    """What the gauges say of one run: set from the run directory's records as the board
    starts (a resumed run's earlier trials too), then from each finished trial."""

    run: str
    target: int
    budget: int
    finished: int = 0
    failed: int = 0
    running: int = 0
    recommendation: dict[str, Any] | None = None
    """The last record of recommendations.jsonl (None before the first)."""
    trials: list[tuple[dict[str, str], float]] = field(default_factory=list)
    """Each ok trial's tags and samples/s."""

    @classmethod
    def start(
        cls,
        run: str,
        *,
        target: int,
        budget: int,
        records: Sequence[TrialRecord] = (),
        history: Sequence[Mapping[str, Any]] = (),
    ) -> RunState:
        state = cls(run, target, budget)
        for record in records:
            state.add(record)
        if history:
            state.recommend(history[-1])
        return state

    def add(self, record: TrialRecord, recommendation: Mapping[str, Any] | None = None) -> None:
        """One finished trial (its trials.csv record), and the recommendation after it."""
        self.finished += 1
        self.failed += record.status != "ok"
        if record.status == "ok" and record.samples_per_s is not None:
            tags = {RUN_TAG: self.run, "trial": str(record.trial)}
            tags |= {key: cell(getattr(record, key)) for key in CONFIG_KEY}
            self.trials.append((tags, float(record.samples_per_s)))
        if recommendation is not None:
            self.recommend(recommendation)

    def recommend(self, recommendation: Mapping[str, Any]) -> None:
        self.recommendation = dict(recommendation)

    def samples(self) -> list[tuple[str, float, dict[str, str]]]:
        """(metric, value, tags) of every gauge as this state sets it."""
        run = {RUN_TAG: self.run}
        out = [
            ("mbtune_confidence_target", float(self.target), run),
            ("mbtune_trials_budget", float(self.budget), run),
            ("mbtune_trials_finished", float(self.finished), run),
            ("mbtune_trials_failed", float(self.failed), run),
            ("mbtune_trials_running", float(self.running), run),
        ]
        rec = self.recommendation
        if rec is not None:
            out.append(("mbtune_confidence", float(rec["confidence"]), run))
            out.append(("mbtune_recommended_speedup", float(rec["estimated_performance"]), run))
            if rec.get("samples_per_s") is not None:
                out.append(("mbtune_recommended_samples_per_s", float(rec["samples_per_s"]), run))
            # a setting at its default is not in the record (BatchConfig.sizes): read it back
            config = BatchConfig.from_mapping(rec)
            out += [
                (f"mbtune_recommended_{key}", float(getattr(config, key)), run) for key in NUMBERED
            ]
        out += [("mbtune_trial_samples_per_s", value, tags) for tags, value in self.trials]
        return out


class RunGauges:
    """The Ray gauges of :data:`METRICS`, in the process that sets them (the board)."""

    def __init__(self) -> None:
        from ray.util.metrics import Gauge

        self.gauges = {m.name: Gauge(m.name, description=m.meaning, tag_keys=m.tags)
                       for m in METRICS}  # fmt: skip

    def publish(self, state: RunState) -> None:
        for name, value, tags in state.samples():
            self.gauges[name].set(value, tags=tags)


# ---------------------------------------------------------------------------
# where to look: the node's Prometheus endpoint, Grafana's dashboards


def endpoint() -> str | None:
    """This node's Prometheus endpoint (``http://HOST:PORT/metrics``), where the board's
    gauges are served (it runs on the driver's node); None where the node exports none, or
    Ray does not say."""
    import ray

    if not ray.is_initialized():  # ray.nodes() would start one
        return None
    try:
        here = ray.get_runtime_context().get_node_id()
        nodes = ray.nodes()
    except Exception:  # noqa: BLE001 - where to look is never worth a failed search
        return None
    for node in nodes:
        if node.get("NodeID") == here and node.get("MetricsExportPort"):
            return f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
    return None


def dashboard_json() -> dict[str, Any]:
    """The Grafana dashboard mbtune ships."""
    return json.loads(resources.files("mbtune").joinpath(DASHBOARD_FILE).read_text())


def dashboard_dir() -> Path | None:
    """Where Grafana, set up as Ray's docs say, reads extra dashboards: this node's Ray
    session's ``metrics/grafana/dashboards`` (or ``RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR``,
    Ray's own setting of it), which the Ray dashboard makes on the head node; None where
    that directory does not exist."""
    import ray

    named = os.environ.get("RAY_METRICS_GRAFANA_DASHBOARD_OUTPUT_DIR")
    if named:
        path = Path(named)
    elif not ray.is_initialized():
        return None
    else:
        try:
            context = ray.get_runtime_context()
            session = Path(context.get_temp_dir()) / context.get_session_name()
        except Exception:  # noqa: BLE001 - Ray not started, or it does not say
            return None
        path = session / "metrics" / "grafana" / "dashboards"
    return path if path.is_dir() else None


def install_dashboard() -> Path | None:
    """Copy mbtune's Grafana dashboard into :func:`dashboard_dir`; the file written, or
    None where there is no such directory (or it cannot be written: a dashboard is never
    worth a failed search)."""
    where = dashboard_dir()
    if where is None:
        return None
    target = where / INSTALLED_AS
    try:
        with resources.as_file(resources.files("mbtune").joinpath(DASHBOARD_FILE)) as source:
            shutil.copyfile(source, target)
    except OSError:
        return None
    return target
