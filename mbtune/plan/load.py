"""The plan of a run directory, as ``mbtune plan`` (:func:`plan_run`: its experiment with
``--set plan.KEY=VALUE``, its trials, its model's gradient bytes) and ``mbtune.load_plan``
(:func:`load_plan`: the plan.csv written into the run, or the run planned anew with Python
values) read it; mbtune.plan.planner makes the plan.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import yaml

from mbtune.config.load import load_experiment
from mbtune.config.rules import ConfigError
from mbtune.errors import MbtuneError
from mbtune.lattice import ModelShape
from mbtune.plan.fit import DRAWS
from mbtune.plan.planner import Plan, make_plan
from mbtune.runs.rundir import RunDir, read_trials

__all__ = ["load_plan", "plan_run"]


def plan_run(
    run_dir: str | Path,
    overrides: Sequence[str] = (),
    *,
    grad_bytes: int | None = None,
    shape: ModelShape | None = None,
    draws: int = DRAWS,
    give: str = "--set, e.g. --set plan.samples=1e9 --set plan.num_devices=[8,64,256]",
) -> Plan:
    """The plan of a run directory, its experiment's plan section with ``--set``
    ``overrides``; ``grad_bytes`` None: counted from the model on the meta device, and so
    its ``shape`` where the run split the model (tensor_parallel or pipeline_parallel > 1);
    ``give``: how the error of a run without a plan section says to give one."""
    for item in overrides:
        if not item.startswith("plan."):
            raise ConfigError(
                "--set",
                f"mbtune plan sets the plan's keys only (plan.KEY=VALUE), got {item!r}: the "
                "run's trials were measured with its own experiment",
            )
    overrides = [_from_here(item) for item in overrides]
    run = RunDir.open(run_dir)
    experiment = load_experiment(run.experiment_file, overrides)
    if experiment.plan is None:
        raise ConfigError(
            "plan",
            f"the run's experiment has no plan section; give one with {give} (docs/plan.md)",
        )
    records = read_trials(run.trials_file).records
    if not any(r.status == "ok" and r.samples_per_s for r in records):
        raise MbtuneError(
            f"RUN_DIR: {run.path} has no measured trial (status ok) to plan from; "
            "run or resume the search first"
        )
    if grad_bytes is None:
        from mbtune.plan.model_bytes import gradient_bytes  # imports torch

        grad_bytes = gradient_bytes(experiment.model)
    split = any(r.status == "ok" and r.config.layout[:2] != (1, 1) for r in records)
    if split and shape is None and experiment.model_shape is None:
        from mbtune.plan.model_bytes import split_shape  # imports torch

        shape = split_shape(experiment.model)
    return make_plan(experiment, records, grad_bytes=grad_bytes, shape=shape, draws=draws)


def load_plan(
    run_dir: str | Path, *, grad_bytes: int | None = None, **plan_keys: Any
) -> pd.DataFrame:
    """``mbtune.load_plan``: the plan of a run directory as pandas (:meth:`Plan.as_frame`:
    one row per planned device count and configuration, with 90% intervals).

    Without ``plan_keys``, the plan.csv that ``mbtune plan`` or ``mbtune analyze`` wrote
    into the run, where there is one; else the run planned anew: its experiment's plan
    section with ``plan_keys`` set to Python values, e.g. ``load_plan(run, samples=1e9,
    num_devices=[8, 64])`` or ``inter_node={"bandwidth": "25GB"}`` (the keys of docs/plan.md,
    checked as ``--set plan.KEY=VALUE`` is). ``grad_bytes``: as :func:`plan_run` (given,
    the run is planned anew)."""
    run = RunDir.open(run_dir)
    if not plan_keys and grad_bytes is None and run.plan_file.is_file():
        return pd.read_csv(run.plan_file)
    overrides = [f"plan.{k}={json.dumps(v, default=_plain)}" for k, v in plan_keys.items()]
    give = "its keys, e.g. mbtune.load_plan(run, samples=1e9, num_devices=[8, 64, 256])"
    return plan_run(run.path, overrides, grad_bytes=grad_bytes, give=give).as_frame()


def _plain(value: Any) -> Any:
    """A value JSON does not write, as one it does: a numpy number or array, a path."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


def _from_here(item: str) -> str:
    """``plan.nccl_tests=PATH`` with PATH made absolute from the current directory: the
    command line's paths are the user's, not the run directory's (where the experiment
    file, which relative paths follow, lives)."""
    key, _, value = item.partition("=")
    if key != "plan.nccl_tests" or not value.strip():
        return item
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return item  # the loader reports it
    items = [parsed] if isinstance(parsed, str) else parsed
    if not isinstance(items, list) or not all(isinstance(p, str) and p for p in items):
        return item
    return f"{key}={json.dumps([str(Path(p).absolute()) for p in items])}"
