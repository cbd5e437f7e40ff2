"""The search: a Ray Tune ``Tuner`` whose trials run the trial engine, proposed by Optuna.

Each trial runs in a process of its own (``python -m mbtune.trial``), started by the Ray
trial actor, so an out-of-memory, a crash, a hang or a poisoned CUDA context in one trial
cannot touch another: the actor records what happened and the search goes on.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune import Callback

from mbtune.config import Experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.rundir import TRIAL_COLUMNS, RunDir

__all__ = ["SearchOutcome", "resume_search", "run_search", "search_points"]


def search_points(exp: Experiment) -> list[BatchConfig]:
    """The distinct measurements of the experiment's space (canonical micro-batch sizes)."""
    return sorted({c.canonical() for c in exp.configs()})


@dataclass(frozen=True)
class SearchOutcome:
    """A finished (or stopped) search: its run directory and every trials.csv row."""

    run: RunDir
    rows: list[dict[str, str]]

    def best(self, k: int = 5) -> list[dict[str, str]]:
        ok = [r for r in self.rows if r["status"] == "ok" and r["objective"]]
        return sorted(ok, key=lambda r: -float(r["objective"]))[:k]


def run_search(
    exp: Experiment,
    *,
    address: str | None = None,
    dashboard: bool | None = None,
    verbose: bool = False,
    warm_start: str | Path | None = None,
    echo: Any = print,
) -> SearchOutcome:
    """Search ``exp``'s space and return what was measured; writes a run directory."""
    from mbtune.searchers import make_searcher

    points = search_points(exp)
    earlier = RunDir.open(warm_start, flag="--warm-start") if warm_start else None
    _start_ray(exp, address, dashboard, verbose, echo)
    run = RunDir.create(exp.output_dir, exp.name)
    run.write_experiment(exp.to_dict())
    s = exp.search
    searcher = make_searcher(
        s.sampler, points, seed=s.seed, storage=_optuna_storage(run), start_points=s.start_points
    )
    if earlier is not None:
        told = _warm_start(searcher, earlier, exp, points)
        echo(f"mbtune: warm start from {earlier.path}: the sampler learnt {told} results")
    echo(
        f"mbtune: searching {len(points)} distinct configurations of '{exp.name}' with "
        f"{s.sampler}, up to {s.num_samples} trials; run directory {run.path}"
    )
    tuner = tune.Tuner(
        _trainable_for(exp),
        tune_config=tune.TuneConfig(
            search_alg=searcher,
            num_samples=s.num_samples,
            max_concurrent_trials=exp.ray.max_concurrent_trials,
            time_budget_s=s.time_budget_s,
            reuse_actors=True,  # isolation comes from the child process, not the actor
        ),
        run_config=tune.RunConfig(
            name=RAY_DIR,
            storage_path=str(run.path.resolve()),
            verbose=1 if verbose else 0,
            callbacks=[TrialLog(run, echo)],
            failure_config=tune.FailureConfig(max_failures=0),
        ),
    )
    return _fit(tuner, run, echo)


def resume_search(
    path: str | Path,
    *,
    address: str | None = None,
    dashboard: bool | None = None,
    verbose: bool = False,
) -> SearchOutcome:
    """Continue an interrupted search: finished trials are kept, unfinished ones rerun."""
    from mbtune.config import load_experiment

    run = RunDir.open(path, flag="--resume")
    exp = load_experiment(run.experiment_file)
    state = run.path / RAY_DIR
    if not tune.Tuner.can_restore(str(state)):
        raise MbtuneError(f"--resume: {run.path} holds no Ray experiment state to continue")
    _start_ray(exp, address, dashboard, verbose, print)
    print(f"mbtune: resuming {run.path} ({len(run.trials())} trials already finished)")
    tuner = tune.Tuner.restore(
        str(state), trainable=_trainable_for(exp), resume_unfinished=True, restart_errored=False
    )
    return _fit(tuner, run, print)


RAY_DIR = "ray"
"""Ray Tune's own experiment state, inside the run directory."""


def _fit(tuner: Any, run: RunDir, echo: Any) -> SearchOutcome:
    tuner.fit()
    outcome = SearchOutcome(run, run.trials())
    _print_best(outcome, echo)
    return outcome


def _start_ray(
    exp: Experiment, address: str | None, dashboard: bool | None, verbose: bool, echo: Any
) -> None:
    address = address if address is not None else exp.ray.address
    dashboard = dashboard if dashboard is not None else exp.ray.dashboard
    _init_ray(address, dashboard, verbose)
    if dashboard and not address:
        echo(f"mbtune dashboard: http://{ray.get_runtime_context().dashboard_url}")


def _trainable_for(exp: Experiment) -> Any:
    return tune.with_resources(
        tune.with_parameters(
            _trainable, experiment=exp.to_dict(), cwd=os.getcwd(), timeout_s=exp.trial.timeout_s
        ),
        {"cpu": exp.ray.cpus_per_trial, "gpu": exp.ray.gpus_per_trial},
    )


def _warm_start(searcher: Any, earlier: RunDir, exp: Experiment, points: list) -> int:
    """Teach the sampler an earlier run's results (they are not counted as measured here)."""
    space = set(points)
    told = 0
    for row in earlier.trials():
        try:
            config = BatchConfig.from_mapping(row).canonical()
        except (KeyError, ValueError):
            continue
        if config not in space:
            continue
        speed = float(row["samples_per_s"]) if row.get("status") == "ok" else 0.0
        if exp.search.objective == "samples_per_s_per_device":
            speed /= config.num_devices
        searcher.tell(config, speed)
        told += 1
    return told


def _optuna_storage(run: RunDir) -> Any:
    import optuna

    return optuna.storages.RDBStorage(run.optuna_url)


def _init_ray(address: str | None, dashboard: bool, verbose: bool) -> None:
    if address and address != "auto":
        _check_reachable(address)
    if ray.is_initialized():
        return
    quiet = {"log_to_driver": verbose, "logging_level": logging.INFO if verbose else logging.ERROR}
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    try:
        if address:
            ray.init(address=address, **quiet)
        else:
            ray.init(include_dashboard=dashboard, dashboard_host="127.0.0.1", **quiet)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = address or "an embedded local Ray"
        raise MbtuneError(f"--address: cannot start or reach {where}: {_first_line(e)}") from None


def _check_reachable(address: str) -> None:
    """Fail in seconds, not minutes, when nothing listens at ``address`` (host:port)."""
    import socket

    host, _, port = address.removeprefix("ray://").rpartition(":")
    host = host.removeprefix("[").removesuffix("]")  # an IPv6 address: [::1]:6379
    if not host or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536:
        raise MbtuneError(
            f"--address: {address!r} is not 'auto', host:port or ray://host:port "
            "(a port from 1 to 65535)"
        )
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except (OSError, ValueError) as e:  # ValueError: a host name IDNA cannot encode
        raise MbtuneError(
            f"--address: nothing answers at {address} ({getattr(e, 'strerror', None) or e}); "
            "start a cluster with `ray start --head`, or leave out --address for an embedded Ray"
        ) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


# ---------------------------------------------------------------------------
# one trial, inside a Ray actor


def _trainable(
    config: dict[str, Any], *, experiment: dict[str, Any], cwd: str, timeout_s: float
) -> None:
    """Run one trial in a fresh process and report what it measured to Tune."""
    batch = BatchConfig.from_mapping(config)
    tune.report(measure_in_subprocess(experiment, batch, cwd=cwd, timeout_s=timeout_s))


KILL_GRACE_S = 60.0
"""How long past ``timeout_s`` a trial process that did not stop itself (stuck in C code,
its alarm blocked) runs before the search kills it."""


def measure_in_subprocess(
    experiment: dict[str, Any], config: BatchConfig, *, cwd: str, timeout_s: float
) -> dict[str, Any]:
    """Measure ``config`` in a child process; a crash, a kill or a hang is a result too."""
    payload = json.dumps({"experiment": experiment, "config": config.as_dict()})
    started = time.perf_counter()
    base = {**config.as_dict(), "objective": 0.0, "reason": None}
    kill_after = timeout_s + KILL_GRACE_S  # the child stops itself at timeout_s: a backstop
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "mbtune.trial"],
            input=payload,
            capture_output=True,
            text=True,
            cwd=cwd,
            timeout=kill_after,
        )
    except subprocess.TimeoutExpired:
        reason = f"killed after {kill_after:g} s: it did not stop itself at {timeout_s:g} s"
        return {**base, "status": "timeout", "reason": reason,
                "wall_s": time.perf_counter() - started}  # fmt: skip
    result = _last_json_object(proc.stdout) if proc.returncode == 0 else None
    if result is not None:
        return result
    if proc.returncode == -9:
        reason = "the trial process was killed (SIGKILL: the kernel's out-of-memory killer?)"
    elif proc.returncode < 0:
        reason = f"the trial process was killed by signal {-proc.returncode}"
    elif proc.returncode == 0:
        reason = "the trial process printed no result"
    else:
        tail = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        reason = tail[-1] if tail else f"the trial process exited with {proc.returncode}"
    return {**base, "status": "error", "reason": reason,
            "wall_s": time.perf_counter() - started}  # fmt: skip


def _last_json_object(stdout: str) -> dict[str, Any] | None:
    """The trial's result: the last line of its stdout that is a JSON object (a user model
    may print, even after the result, from an exit handler)."""
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


# ---------------------------------------------------------------------------
# what the user sees


class TrialLog(Callback):
    """Appends every finished trial to trials.csv (flushed) and prints one line."""

    def __init__(self, run: RunDir, echo: Any) -> None:
        self.run, self.echo = run, echo
        self.results: dict[str, dict[str, Any]] = {}

    def on_trial_result(self, iteration, trials, trial, result, **info):
        self.results[trial.trial_id] = result

    def on_trial_complete(self, iteration, trials, trial, **info):
        self._finish(trial, self.results.pop(trial.trial_id, None))

    def on_trial_error(self, iteration, trials, trial, **info):
        self._finish(trial, self.results.pop(trial.trial_id, None), crashed=True)

    def _finish(self, trial: Any, result: dict | None, crashed: bool = False) -> None:
        finished = self.run.trials()
        if any(r.get("trial_id") == trial.trial_id for r in finished):
            return  # recorded before an interruption; Ray's state had not caught up
        row: dict[str, Any] = {
            **BatchConfig.from_mapping(trial.config).sizes(),
            "status": "error",
            "reason": "the trial actor failed" if crashed else "no result",
        }
        row.update({k: v for k, v in (result or {}).items() if k in TRIAL_COLUMNS})
        row["trial"] = len(finished) + 1
        row["trial_id"] = trial.trial_id
        row["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        self.run.append_trial(row)
        self.echo(_trial_line(row))


def _trial_line(row: dict[str, Any]) -> str:
    speed = row.get("samples_per_s")
    figure = f"{float(speed):,.1f} samples/s" if speed not in (None, "") else "-"
    status = row["status"] + (f" ({row['reason']})" if row.get("reason") else "")
    return (
        f"mbtune {time.strftime('%H:%M:%S')}  trial {row['trial']:>3}  num_devices "
        f"{row['num_devices']}, batch_size {row['batch_size']}, micro_batch_size "
        f"{row['micro_batch_size']}: {figure}  {status}"
    )


def _print_best(outcome: SearchOutcome, echo: Any) -> None:
    best = outcome.best()
    rows = outcome.rows
    failed = sum(r["status"] != "ok" for r in rows)
    echo(f"mbtune: {len(rows)} trials finished ({failed} not ok); results in {outcome.run.path}")
    if not best:
        echo("mbtune: no configuration ran successfully")
        return
    echo("best configurations:")
    echo(f"  {'rank':>4}  {'num_devices':>11}  {'batch_size':>10}  {'micro_batch_size':>16}  "
         f"{'grad_accum':>10}  {'samples/s':>10}")  # fmt: skip
    for i, r in enumerate(best, start=1):
        echo(
            f"  {i:>4}  {r['num_devices']:>11}  {r['batch_size']:>10}  "
            f"{r['micro_batch_size']:>16}  {r['grad_accum_steps']:>10}  "
            f"{float(r['samples_per_s']):>10,.1f}"
        )
