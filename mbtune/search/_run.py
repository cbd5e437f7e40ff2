"""The search's run: a Ray Tune ``Tuner`` whose trials run the trial engine.

Each trial runs in a process of its own (``python -m mbtune.trial``), started by the Ray
trial actor, so an out-of-memory, a crash, a hang or a poisoned CUDA context in one trial
cannot touch another: the actor records what happened and the search goes on. With
``trial.parallel: ddp`` the trial actor instead fits a Ray Train run whose workers, one
process per device, are that trial's own (see mbtune.trial.ddp).
"""

from __future__ import annotations

import dataclasses
import functools
import multiprocessing
import os
import signal
import time
import warnings
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray import tune
from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback

from mbtune import metrics, progress
from mbtune.cluster import cluster_size, init_ray, token_note, watch_head, watch_resources
from mbtune.config.experiment import Experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.recommend.confidence import SearchModel
from mbtune.recommend.reporter import Reporter
from mbtune.report import summary_lines
from mbtune.runs.lock import RunLock
from mbtune.runs.record import TrialRecord
from mbtune.runs.rundir import SUMMARY_FILE, RunDir
from mbtune.search._ledger import (
    ConfidenceStop,
    TrialLog,
    TrialProgress,
    head_lost,
    print_line,
)
from mbtune.search._samplers import search_model, search_points
from mbtune.search._searcher import make_searcher
from mbtune.search._signals import graceful_stop
from mbtune.search._space import OptunaSpace
from mbtune.search._stopping import end_reason, one_look_reason, settled
from mbtune.search._study import STUDY_NAME, SearchStudy, records_of
from mbtune.trial.launch import WarmAhead, trial_actor
from mbtune.trial.screen import Screening, screen

__all__ = [
    "RAY_DIR",
    "SearchOutcome",
    "measured",
    "predict_out_of_memory",
    "resume_search",
    "run_search",
    "screen_beside",
    "start_ray",
    "trial_resources",
]


@dataclass(frozen=True)
class SearchOutcome:
    """A finished (or stopped) search: its run directory, every trial's record, summary."""

    run: RunDir
    records: list[TrialRecord]
    summary: dict[str, Any]

    @property
    def rows(self) -> list[dict[str, str]]:
        """Every trial as its row of trials.csv (text)."""
        return [r.to_row() for r in self.records]

    def best(self, k: int = 5) -> list[dict[str, str]]:
        """The ``k`` ok trials of the highest objective, as rows of trials.csv (text)."""
        ok = [r for r in self.records if r.status == "ok" and r.objective is not None]
        return [r.to_row() for r in sorted(ok, key=lambda r: -r.objective)[:k]]


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
    say = echo or print_line
    points = search_points(exp)
    earlier = RunDir.open(warm_start, flag="--warm-start") if warm_start else None
    screening = screen_beside(exp, points, say, verbose)  # while Ray starts
    embedded = (address or exp.ray.address) is None and not ray.is_initialized()
    ahead = WarmAhead.start(exp, os.getcwd()) if embedded else None  # for the first trial
    try:
        cluster = start_ray(exp, address, dashboard, verbose, say)
    except BaseException:
        if screening is not None:
            screening.cancel()
        if ahead is not None:
            ahead.close()
        raise
    run = RunDir.create(exp.output_dir, exp.name)
    lock = RunLock.take(run.path, command="mbtune run")  # a --resume of it waits its turn
    try:
        run.write_experiment(exp.to_dict())
        s = exp.search
        model = search_model(exp, points)
        # what Ray pickles names the directory whole: a resume may start anywhere
        kept = RunDir(run.path.absolute())
        searcher = _searcher_for(exp, model, kept, say)
        predicted = predict_out_of_memory(exp, points, kept, say, screening=screening)
        searcher.add_predicted(predicted)
        if earlier is not None:
            told = _warm_start(searcher, earlier, exp, points)
            say(f"mbtune: warm start from {earlier.path}: the sampler learnt {told} results")
        skipped = f" ({len(predicted)} predicted out of memory)" if predicted else ""
        say(
            f"mbtune: searching {len(points)} distinct configurations{skipped} of '{exp.name}' "
            f"with {s.sampler}, up to {s.num_samples} trials; run directory {run.path}"
        )
        reporter = _reporter_for(exp, model)
        log = TrialLog(kept, say, reporter, target=s.confidence_target, max_repeats=s.max_repeats)
        log.rows.extend(predicted)  # the run's first rows: the reporter assesses them too
        tuner = tune.Tuner(
            _trainable_for(exp, ahead.name if ahead is not None else None),
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
                stop=ConfidenceStop(log),
                failure_config=tune.FailureConfig(max_failures=0),
            ),
        )
        return _fit(tuner, run, exp, reporter, say, cluster)
    finally:
        lock.release()
        if ahead is not None:
            ahead.close()


def resume_search(
    path: str | Path,
    *,
    address: str | None = None,
    dashboard: bool | None = None,
    verbose: bool = False,
) -> SearchOutcome:
    """Continue an interrupted search: finished trials are kept, unfinished ones rerun."""
    from mbtune.config.load import load_experiment

    run = RunDir.open(path, flag="--resume")
    lock = RunLock.take(run.path, command="mbtune run --resume")  # before anything is written
    try:
        exp = load_experiment(run.experiment_file)
        state = (run.path / RAY_DIR).resolve()  # Tune reads a relative path as a bad URI
        if not tune.Tuner.can_restore(str(state)):
            raise MbtuneError(f"--resume: {run.path} holds no Ray experiment state to continue")
        (run.path / SUMMARY_FILE).unlink(missing_ok=True)  # the run goes on: no end to read yet
        cluster = start_ray(exp, address, dashboard, verbose, print_line)
        print_line(f"mbtune: resuming {run.path}")  # the searcher says what it kept, once restored
        reporter = _reporter_for(exp, search_model(exp))
        # the searcher, the callbacks and the stopper come back with Ray's saved state; they
        # read what finished since from the run directory
        tuner = tune.Tuner.restore(
            str(state), trainable=_trainable_for(exp), resume_unfinished=True, restart_errored=False
        )
        return _fit(tuner, run, exp, reporter, print_line, cluster)
    finally:
        lock.release()


RAY_DIR = "ray"
"""Ray Tune's own experiment state, inside the run directory."""


def _fit(
    tuner: Any, run: RunDir, exp: Experiment, reporter: Reporter, echo: Any, cluster: str | None
) -> SearchOutcome:
    lost = functools.partial(head_lost, cluster, run, reporter)
    gone: list[str] = []  # what the cluster no longer has for one trial, once it stopped

    def short(missing: str) -> bool:
        if signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None):
            return False  # Tune is not listening yet: its default would end the process
        gone.append(missing)
        echo(f"mbtune: the Ray cluster has had no node with what one trial needs ({missing}) "
             f"for {exp.ray.resource_wait_s:g} s; stopping the search")  # fmt: skip
        os.kill(os.getpid(), signal.SIGUSR1)  # Tune's graceful stop, as for a Ctrl-C
        return True

    # the study catches up with trials.csv (the rows a killed driver could not tell it)
    # and fails what a killed driver left running
    study = SearchStudy.at(run.optuna_url, OptunaSpace(search_points(exp)))
    study.catch_up(run.records())
    with (
        graceful_stop() as interrupted,
        watch_head(cluster, lost),
        watch_resources(cluster, trial_resources(exp), exp.ray.resource_wait_s, short),
        progress.shown(
            finished=sum(not r.predicted for r in run.records()), metrics=_metrics_for(run, exp)
        ),
    ):
        started = time.monotonic()
        tuner.fit()
        elapsed_s = time.monotonic() - started
    study.fail_interrupted()  # one in flight when the search was stopped
    records, history = run.records(), run.recommendations()
    target = exp.search.confidence_target
    a = reporter.assess(records)
    stop = bool(history) and settled(
        a, target=target, max_repeats=exp.search.max_repeats, noise_floor=exp.noise_floor
    )
    status = (
        "interrupted" if interrupted or gone
        else ("tie" if a.tie else "confident") if stop else "finished"
    )  # fmt: skip
    summary = reporter.summary(records, status, history)
    summary["predicted_oom"] = sum(r.predicted for r in records)
    s = exp.search
    summary["reason"] = end_reason(
        a, status=status, target=target, max_repeats=s.max_repeats, noise_floor=exp.noise_floor,
        budget=s.num_samples, measured=sum(not r.predicted for r in records),
        time_budget_s=s.time_budget_s, elapsed_s=elapsed_s,
    )  # fmt: skip
    if gone:
        summary["reason"] = f"the Ray cluster no longer had what one trial needs: {gone[0]}"
    if summary["recommended"] and summary["recommended"]["measurements"] == 1:
        reason = one_look_reason(max_repeats=s.max_repeats, noise_floor=exp.noise_floor)
        summary["measured_once_because"] = reason or "the search ended before a second look"
    run.write_json(SUMMARY_FILE, summary)
    if status == "interrupted":
        echo(f"mbtune: interrupted; every finished trial is in {run.trials_file}; continue "
             f"with: mbtune run --resume {run.path}")  # fmt: skip
    else:
        echo(f"mbtune: stopping: {summary['reason']}")
    outcome = SearchOutcome(run, records, summary)
    for line in summary_lines(records, summary, run.path):
        echo(line)
    return outcome


def screen_beside(
    exp: Experiment, points: list[BatchConfig], say: Any, verbose: bool = False
) -> Future[Screening] | None:
    """The memory screen (:func:`predict_out_of_memory`) started in a process of its own
    (spawned: this process never imports torch, and a fork of it would carry its threads),
    to run while Ray starts; what it will find. None where there is nothing to screen, or
    where the budget is known only on a CUDA card of the cluster (``trial.device_memory``
    unset): that screen is a Ray task once Ray runs. Its process ends once it has answered;
    without ``verbose`` its warnings are not shown (those of a Ray task are not either)."""
    tr = exp.trial
    if not exp.search.predict_memory or tr.backend == "replay" or tr.device_memory is None:
        return None
    say(f"mbtune: predicting the memory of {len(points)} configurations (search.predict_memory)")
    quiet = {} if verbose else {"initializer": warnings.simplefilter, "initargs": ("ignore",)}
    pool = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"), **quiet)
    try:
        return pool.submit(screen, exp, points)
    finally:
        pool.shutdown(wait=False)  # the screen submitted runs on; the process ends after it


def predict_out_of_memory(
    exp: Experiment,
    points: list[BatchConfig],
    run: RunDir,
    say: Any,
    *,
    screening: Future[Screening] | None = None,
) -> list[TrialRecord]:
    """Before the first trial: the configurations predicted not to fit the memory budget
    (mbtune.trial.screen.screen, in a process of its own: this one never imports torch),
    each recorded in trials.csv as an ``oom`` whose reason starts with ``predicted:``,
    without a trial; their records. ``screening``: the screen started while Ray started
    (:func:`screen_beside`), else a Ray task screens now. Nothing where
    ``search.predict_memory`` is false, for replayed trials, and where no budget is known
    (a CPU without ``trial.device_memory``; a CUDA card's memory is read in the task, on a
    GPU of the cluster). A model that cannot be predicted is said in one line, and
    measured."""
    tr = exp.trial
    if not exp.search.predict_memory or tr.backend == "replay":
        return []
    if screening is not None:
        try:
            found = screening.result()
        except Exception as e:  # noqa: BLE001 - its process died (the machine's memory), or
            # what it answered did not come back whole: the search measures instead
            found = Screening(None, failed=" ".join(f"{type(e).__name__}: {e}".split())[:300])
    else:
        gpus = 0
        if tr.device_memory is None:
            if tr.device == "cpu" or not exp.gpus_per_trial:
                return []  # no budget: a CPU trial has none, a CUDA card's is read on the card
            if ray.cluster_resources().get("GPU", 0) < 1:
                return []  # no card to read it from (nor to run a trial on)
            gpus = 1
        say(f"mbtune: predicting the memory of {len(points)} configurations "
            "(search.predict_memory)")  # fmt: skip
        # a process of its own (max_calls): torch and what the model imported go with it
        task = ray.remote(num_cpus=0, num_gpus=gpus, max_calls=1)(screen)
        try:
            found = ray.get(task.remote(exp, points))
        except ray.exceptions.RayError as e:  # its process died (the machine's own memory)
            found = Screening(None, failed=" ".join(str(e).split())[:300])
    if found.failed:
        say(f"mbtune: memory prediction failed, every configuration is measured: {found.failed}")
        return []
    records = [_predicted_record(exp, c, reason, i) for i, (c, reason) in enumerate(found.over, 1)]
    for record in records:
        run.append_trial(record)
    if found.budget is not None:
        usable = found.budget * (1 - tr.headroom(found.budget)) / 2**20
        say(
            f"mbtune: {len(records)} of {len(points)} configurations predicted over "
            f"{usable:,.0f} MiB per device (trial.device_memory less trial.memory_headroom; "
            f"{found.predictions} of them predicted in {found.seconds:.0f} s, the rest "
            "bounded by those): recorded as oom without a trial"
        )
    return records


def _predicted_record(exp: Experiment, config: BatchConfig, reason: str, trial: int) -> TrialRecord:
    """The row of a configuration predicted out of memory: an ``oom`` with no trial."""
    return TrialRecord.from_result({
        **config.as_dict(), "micro_batches": config.micro_batch_sizes, "trial": trial,
        "status": "oom", "reason": reason, "objective": 0.0,
        "micro_batch_sizes_tried": [config.micro_batch_size],
        "sharding": exp.trial.sharding,
        "backend": exp.trial.backend, "parallel": exp.trial.parallel,
        "note": "not measured: set search.predict_memory: false to measure it",
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    })  # fmt: skip


def _searcher_for(exp: Experiment, model: SearchModel, run: RunDir, say: Any) -> Any:
    s = exp.search
    return make_searcher(
        s.sampler,
        model.points,
        seed=s.seed,
        model=model,
        url=run.optuna_url,
        start_points=s.start_points,
        ledger=run.trials_file,
        target=s.confidence_target,
        max_repeats=s.max_repeats,
        announce=say,
        budget=s.num_samples,
    )


def _reporter_for(exp: Experiment, model: SearchModel) -> Reporter:
    return Reporter(model, user_config=exp.user_config, user_batch_size=exp.train_input.batch_size)


def start_ray(
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
        if url:  # the cluster's own: where it listens is the cluster's say
            echo(f"mbtune dashboard (the cluster's): http://{url}")
        elif dashboard:
            echo("mbtune: the cluster runs no dashboard (ray start --head --include-dashboard)")
    elif dashboard:
        echo(f"mbtune dashboard: http://{url}{token_note()}" if url else
             "mbtune: Ray did not start its dashboard (see --verbose)")  # fmt: skip
    # the run's Ray metrics (docs/monitoring.md); an embedded Ray's port is new each time
    served = metrics.endpoint() if cluster is not None or dashboard else None
    if served:
        echo(f"mbtune metrics (Prometheus): {served}")
    installed = metrics.install_dashboard()
    if installed:
        echo(f"mbtune: Grafana dashboard 'mbtune' installed in {installed.parent}")
    return cluster


def _metrics_for(run: RunDir, exp: Experiment) -> metrics.RunState:
    """The run as it stands (a resumed run's earlier trials too), for the board's metrics."""
    s = exp.search
    return metrics.RunState.start(
        run.path.name, target=s.confidence_target, budget=s.num_samples,
        records=run.records(), history=run.recommendations(),
    )  # fmt: skip


def _trainable_for(exp: Experiment, warm_ahead: str | None = None) -> Any:
    # Tune puts the Experiment itself in Ray's object store (pickled): trials get it typed
    return tune.with_resources(
        tune.with_parameters(trial_actor, experiment=exp, cwd=os.getcwd(), warm_ahead=warm_ahead),
        trial_resources(exp),
    )


def trial_resources(exp: Experiment) -> dict[str, float]:
    """What one Tune trial holds. A ddp trial only waits for its Ray Train workers, which
    ask for ``ray.cpus_per_trial`` and ``ray.gpus_per_trial`` each, so it holds no CPU: on
    two cores, two one-CPU workers can run. Tune needs some resource to place an actor, so
    it holds one byte of Ray's memory resource instead."""
    if exp.trial.parallel == "ddp":
        return {"cpu": 0, "gpu": 0, "memory": 1}
    return {"cpu": exp.ray.cpus_per_trial, "gpu": exp.gpus_per_trial}


def _warm_start(searcher: Any, earlier: RunDir, exp: Experiment, points: list) -> int:
    """Teach the sampler an earlier run's results, as its study holds them (they are not
    counted as measured here)."""
    space = set(points)
    told = 0
    for record in measured(earlier, OptunaSpace(points)):
        config = record.config.canonical()
        if config not in space:
            continue
        speed = float(record.samples_per_s or 0.0) if record.status == "ok" else 0.0
        if exp.search.objective == "samples_per_s_per_device":
            speed /= config.num_devices
        searcher.teach(dataclasses.replace(record, objective=speed),
                       f"{earlier.path.name}, trial {record.trial}")  # fmt: skip
        told += 1
    return told


def measured(run: RunDir, space: OptunaSpace) -> list[TrialRecord]:
    """What ``run`` measured, read from its study, in the order it learnt it; from its
    trials.csv where it kept none (a run from before every run kept a study). Read only:
    the run may be another's."""
    import optuna

    if not (run.path / "optuna.db").exists():
        return run.records()
    try:
        study = optuna.load_study(study_name=STUDY_NAME, storage=run.optuna_url)
    except KeyError:
        return run.records()
    return records_of(study.get_trials(deepcopy=False), space)
