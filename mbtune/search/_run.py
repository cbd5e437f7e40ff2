"""The search: a Ray Tune ``Tuner`` whose trials run the trial engine, proposed by Optuna.

Each trial runs in a process of its own (``python -m mbtune.trial``), started by the Ray
trial actor, so an out-of-memory, a crash, a hang or a poisoned CUDA context in one trial
cannot touch another: the actor records what happened and the search goes on. With
``trial.parallel: ddp`` the trial actor instead fits a Ray Train run whose workers, one
process per device, are that trial's own (see mbtune.ddp).
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune import Callback
from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

from mbtune import progress
from mbtune.cluster import EXIT_CLUSTER_LOST, cluster_size, init_ray, token_note, watch_head
from mbtune.config import Experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.launch import measure_in_subprocess, measure_with_ray_train
from mbtune.report import summary_lines, trial_line
from mbtune.reporter import Reporter
from mbtune.rundir import TRIAL_COLUMNS, RunDir
from mbtune.trial import TrialRequest

__all__ = [
    "SearchOutcome",
    "measure_with_ray_train",
    "resume_search",
    "run_search",
    "search_points",
    "trial_resources",
]


def search_points(exp: Experiment) -> list[BatchConfig]:
    """The distinct measurements of the experiment's space (canonical micro-batch sizes)."""
    return sorted({c.canonical() for c in exp.configs()})


@dataclass(frozen=True)
class SearchOutcome:
    """A finished (or stopped) search: its run directory, every trials.csv row, summary."""

    run: RunDir
    rows: list[dict[str, str]]
    summary: dict[str, Any]

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
    echo: Any = None,
) -> SearchOutcome:
    """Search ``exp``'s space and return what was measured; writes a run directory."""
    from mbtune.searchers import make_searcher

    echo = echo or _echo
    points = search_points(exp)
    earlier = RunDir.open(warm_start, flag="--warm-start") if warm_start else None
    cluster = _start_ray(exp, address, dashboard, verbose, echo)
    run = RunDir.create(exp.output_dir, exp.name)
    run.write_experiment(exp.to_dict())
    s = exp.search
    searcher = make_searcher(
        s.sampler,
        points,
        seed=s.seed,
        storage=_optuna_storage(run),
        start_points=s.start_points,
        global_objective=s.objective == "samples_per_s",
        ledger=run.trials_file,
    )
    if earlier is not None:
        told = _warm_start(searcher, earlier, exp, points)
        echo(f"mbtune: warm start from {earlier.path}: the sampler learnt {told} results")
    echo(
        f"mbtune: searching {len(points)} distinct configurations of '{exp.name}' with "
        f"{s.sampler}, up to {s.num_samples} trials; run directory {run.path}"
    )
    reporter = _reporter_for(exp, points, run)
    log = TrialLog(run, echo, reporter)
    tuner = tune.Tuner(
        _trainable_for(exp),
        tune_config=tune.TuneConfig(
            search_alg=searcher,
            num_samples=s.num_samples,
            max_concurrent_trials=exp.ray.max_concurrent_trials,
            time_budget_s=s.time_budget_s,
            # isolation comes from the child process (or, for ddp, the Ray Train workers),
            # not the actor; a ddp trial's actor owns its workers, so it ends with its trial
            reuse_actors=exp.trial.parallel != "ddp",
        ),
        run_config=tune.RunConfig(
            name=RAY_DIR,
            storage_path=str(run.path.resolve()),
            verbose=1 if verbose else 0,
            # Tune's own per-trial result.json and progress.csv (see cluster.init_ray)
            callbacks=[TrialProgress(), log, JsonLoggerCallback(), CSVLoggerCallback()],
            stop=ConfidenceStop(log, s.confidence_target),
            failure_config=tune.FailureConfig(max_failures=0),
        ),
    )
    return _fit(tuner, run, exp, reporter, echo, cluster)


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
    state = (run.path / RAY_DIR).resolve()  # Tune reads a relative path as a bad URI
    if not tune.Tuner.can_restore(str(state)):
        raise MbtuneError(f"--resume: {run.path} holds no Ray experiment state to continue")
    cluster = _start_ray(exp, address, dashboard, verbose, _echo)
    _echo(f"mbtune: resuming {run.path} ({len(run.trials())} trials already finished)")
    reporter = _reporter_for(exp, search_points(exp), run)
    # the callbacks and the stopper come back with Ray's saved state; they keep theirs
    # in the run directory
    tuner = tune.Tuner.restore(
        str(state), trainable=_trainable_for(exp), resume_unfinished=True, restart_errored=False
    )
    return _fit(tuner, run, exp, reporter, _echo, cluster)


RAY_DIR = "ray"
"""Ray Tune's own experiment state, inside the run directory."""


def _echo(line: str) -> None:
    """Print one line now. Not ``print`` itself: Tune pickles the callbacks with its
    experiment state, and once Ray has replaced ``builtins.print`` (it does to show worker
    output, on a cluster or with --verbose) the original no longer pickles. Above the
    progress line, where one is shown (mbtune.progress)."""
    progress.echo(line)


def _fit(
    tuner: Any, run: RunDir, exp: Experiment, reporter: Reporter, echo: Any, cluster: str | None
) -> SearchOutcome:
    lost = functools.partial(_head_lost, cluster, run, reporter)
    with (
        _graceful_stop() as interrupted,
        watch_head(cluster, lost),
        progress.shown(finished=len(run.trials())),
    ):
        tuner.fit()
    rows, history = run.trials(), run.recommendations()
    target = exp.search.confidence_target
    confident = bool(history) and history[-1]["confidence"] >= target
    status = "interrupted" if interrupted else "confident" if confident else "finished"
    summary = reporter.summary(rows, status, history)
    run.write_json("summary.json", summary)
    if status == "confident":
        echo(f"mbtune: stopping: the confidence score reached its target {target}")
    if status == "interrupted":
        echo(f"mbtune: interrupted; every finished trial is in {run.trials_file}; continue "
             f"with: mbtune run --resume {run.path}")  # fmt: skip
    outcome = SearchOutcome(run, rows, summary)
    for line in summary_lines(rows, summary, run.path):
        echo(line)
    return outcome


_LEDGER = threading.Lock()
"""Held while a finished trial is written, so that a search ended by a lost head never
leaves one half-written."""


def _head_lost(cluster: str, run: RunDir, reporter: Reporter, silent_s: float) -> None:
    """The cluster's head went away: Tune's loop waits on it and cannot return. Every
    finished trial is in trials.csv already; write the summary (interrupted, and why), say
    so in one line and exit. The trial in flight was not measured: --resume runs it."""
    with _LEDGER:  # no row is being written now, and none will be
        rows = run.trials()
        summary = reporter.summary(rows, "interrupted", run.recommendations())
        summary["reason"] = f"the Ray cluster's head node ({cluster}) went away"
        run.write_json("summary.json", summary)
        sys.stdout.flush()
        print(
            f"mbtune: error: the Ray cluster's head node ({cluster}) has not answered for "
            f"{silent_s:.0f} s; {run.trials_file} holds the {len(rows)} finished trial(s); "
            f"continue with: mbtune run --resume {run.path} (and --address of a cluster)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(EXIT_CLUSTER_LOST)  # Tune's loop waits on the dead cluster: it cannot return


@contextlib.contextmanager
def _graceful_stop() -> Iterator[list[int]]:
    """SIGINT or SIGTERM stop the search as Tune's own Ctrl-C does: running trials end,
    Ray's state is saved for --resume, and fit() returns. A second signal stops at once.
    Yields a list that holds the signal once one came."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received  # signals reach only the main thread: nothing to catch here
        return

    def stop(signum: int, frame: Any) -> None:
        if received:
            raise KeyboardInterrupt
        received.append(signum)
        os.kill(os.getpid(), signal.SIGUSR1)  # Tune's graceful stop, as for its Ctrl-C

    # a signal the process was started ignoring (a background job's SIGINT) stays ignored
    old = {
        s: signal.signal(s, stop)
        for s in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(s) is not signal.SIG_IGN
    }
    was = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # SIGINT is ours; SIGUSR1 stays Tune's
    try:
        yield received
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if was is None:
            os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
        else:
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = was


def _reporter_for(exp: Experiment, points: list[BatchConfig], run: RunDir) -> Reporter:
    return Reporter(
        points,
        user_config=exp.user_config,
        user_batch_size=exp.train_input.batch_size,
        noise_floor=exp.noise_floor,
        global_objective=exp.search.objective == "samples_per_s",
        seed=exp.search.seed,
    )


def _start_ray(
    exp: Experiment, address: str | None, dashboard: bool | None, verbose: bool, echo: Any
) -> str | None:
    """Start or join Ray; the cluster's GCS address once joined, None for an embedded Ray."""
    address = address if address is not None else exp.ray.address
    dashboard = dashboard if dashboard is not None else exp.ray.dashboard
    started = init_ray(address, dashboard, verbose)
    if started is None:
        return None  # the caller's own Ray (the tests' session Ray): theirs to show
    cluster, url = started
    if cluster is not None:
        echo(f"mbtune: joined the Ray cluster at {cluster}: {cluster_size()}")
        if dashboard and url:  # the cluster's own: where it listens is the cluster's say
            echo(f"mbtune dashboard (the cluster's): http://{url}")
        elif dashboard:
            echo("mbtune: the cluster runs no dashboard (ray start --head --include-dashboard)")
    elif dashboard:
        echo(f"mbtune dashboard: http://{url}{token_note()}" if url else
             "mbtune: Ray did not start its dashboard (see --verbose)")  # fmt: skip
    return cluster


def _trainable_for(exp: Experiment) -> Any:
    # Tune puts the Experiment itself in Ray's object store (pickled): trials get it typed
    return tune.with_resources(
        tune.with_parameters(_trainable, experiment=exp, cwd=os.getcwd()),
        trial_resources(exp),
    )


def trial_resources(exp: Experiment) -> dict[str, float]:
    """What one Tune trial holds. A ddp trial only waits for its Ray Train workers, which
    ask for ``ray.cpus_per_trial`` and ``ray.gpus_per_trial`` each, so it holds no CPU: on
    two cores, two one-CPU workers can run. Tune needs some resource to place an actor, so
    it holds one byte of Ray's memory resource instead."""
    if exp.trial.parallel == "ddp":
        return {"cpu": 0, "gpu": 0, "memory": 1}
    return {"cpu": exp.ray.cpus_per_trial, "gpu": exp.ray.gpus_per_trial}


def _is_ddp(exp: Experiment) -> bool:
    return exp.trial.parallel == "ddp"


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


# ---------------------------------------------------------------------------
# one trial, inside a Ray actor


def _trainable(config: dict[str, Any], *, experiment: Experiment, cwd: str) -> None:
    """Run one trial in a fresh process (ddp: a fresh Ray Train run) and report what it
    measured, and where, to Tune. ``config["repeat"]``: which measurement of the
    configuration this is (0: its first)."""
    from mbtune.searchers import pack_result

    request = TrialRequest(
        experiment=experiment,
        config=BatchConfig.from_mapping(config),
        repeat=int(config.get("repeat", 0)),
    )
    measure = measure_with_ray_train if _is_ddp(experiment) else measure_in_subprocess
    result = measure(request, cwd=cwd, on_phase=progress.forwarder())  # the driver's line
    tune.report(pack_result({**result, "node_id": ray.get_runtime_context().get_node_id()}))


# ---------------------------------------------------------------------------
# what the user sees


class TrialLog(Callback):
    """After every finished trial: append it to trials.csv (flushed), print its line, then
    the reporter's recommendation (printed and appended to recommendations.jsonl)."""

    def __init__(self, run: RunDir, echo: Any, reporter: Reporter) -> None:
        self.run, self.echo, self.reporter = run, echo, reporter
        self.results: dict[str, dict[str, Any]] = {}
        self.confidence = 0

    def on_trial_result(self, iteration, trials, trial, result, **info):
        from mbtune.searchers import unpack_result

        self.results[trial.trial_id] = unpack_result(result)

    def on_trial_complete(self, iteration, trials, trial, **info):
        result = self.results.pop(trial.trial_id, None)
        if result is not None:  # None: stopped before it reported, e.g. once confident
            self._finish(trial, result)

    def on_trial_error(self, iteration, trials, trial, **info):
        self._finish(trial, self.results.pop(trial.trial_id, None), crashed=True)

    def _finish(self, trial: Any, result: dict | None, crashed: bool = False) -> None:
        with _LEDGER:  # a finished trial is written whole (row, recommendation) or not at all
            row = self._record(trial, result, crashed)
            if row is None:
                return
            self.echo(trial_line(row))
            rec = self.reporter.update(self.run.trials(), self.run.recommendations())
            if rec is not None:
                self.run.append_recommendation(rec.record())
                self.confidence = rec.confidence
                self.echo(rec.line())

    def _record(self, trial: Any, result: dict | None, crashed: bool) -> dict[str, Any] | None:
        finished = self.run.trials()
        if any(r.get("trial_id") == trial.trial_id for r in finished):
            return None  # recorded before an interruption; Ray's state had not caught up
        row: dict[str, Any] = {
            **BatchConfig.from_mapping(trial.config).sizes(),
            "status": "error",
            "reason": "no result",
        }
        if crashed and result is None:
            row["reason"], row["node_id"] = _actor_failure(trial)
        row.update({k: v for k, v in (result or {}).items() if k in TRIAL_COLUMNS})
        row["trial"] = len(finished) + 1
        row["trial_id"] = trial.trial_id
        row["finished_at"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        self.run.append_trial(row)
        return row


def _actor_failure(trial: Any) -> tuple[str, str | None]:
    """Why a trial's Ray actor failed (its node lost, the actor killed), in one line, from
    the error Tune recorded; and the node that ran it, where the cluster still knows."""
    path = getattr(trial, "error_file", None)
    try:
        text = Path(path).read_text(errors="replace") if path else ""
    except OSError:
        text = ""
    last = text.rsplit("Failure # ", 1)[-1].splitlines()[1:]  # Tune's header line, then Ray's
    words = " ".join(line.strip() for line in last if line.strip())
    reason = "the trial actor failed" + (f": {words[:300]}" if words else "")
    node = None
    actor = re.search(r"\b[Aa]ctor ([0-9a-f]{32})\b", words)
    if actor:
        try:
            node = ray._private.state.actors(actor.group(1))["Address"]["NodeID"] or None
        except Exception:  # noqa: BLE001 - Ray's debugging API: the reason is what matters
            node = None
    return reason, node


class TrialProgress(Callback):
    """Tells the progress display (mbtune.progress) which trials run; it keeps no state,
    so that it pickles with Tune's."""

    def on_trial_start(self, iteration, trials, trial, **info):
        progress.started(trial.trial_id, BatchConfig.from_mapping(trial.config))

    def on_trial_complete(self, iteration, trials, trial, **info):
        progress.ended(trial.trial_id)

    def on_trial_error(self, iteration, trials, trial, **info):
        progress.ended(trial.trial_id)


class ConfidenceStop(tune.Stopper):
    """Stops the search once the reporter's confidence score reaches the target."""

    def __init__(self, log: TrialLog, target: int) -> None:
        self.log, self.target = log, target

    def __call__(self, trial_id: str, result: dict) -> bool:
        return False  # a trial reports once; only the whole search is stopped

    def stop_all(self) -> bool:
        return self.log.confidence >= self.target
