"""Data-parallel trials (``trial.parallel: ddp``): one trial is one Ray Train run.

``num_devices`` workers of a Ray Train ``TorchTrainer`` (gloo on the CPU, NCCL on GPUs)
each take their share of the global batch as docs/design.md spreads it (B / n samples, the
first B % n ranks one more), split it into micro-batches as the even split does, and run
the trial protocol on a model wrapped in PyTorch's ``DistributedDataParallel``: the
micro-batches of a step accumulate under ``no_sync()`` but the last, whose backward pass
all-reduces the gradients once per step. Each step starts on every rank together and its
time is the slowest rank's, so what is reported is what the job would see.

Where the trainer runs. ``TorchTrainer.fit()`` is called in the process that asks for the
trial: the Tune trial actor in a search (Ray Train V2's documented pattern: a Tune function
trainable that builds and fits a trainer), the command itself for ``mbtune trial``. Not in
a child process as ``parallel: simulate`` does, because the isolation that child gives is
already there: no model code runs in the calling process at all. The model runs only in
Ray Train's worker actors, processes of their own that Ray Train creates for this one run
and ends with it (an out-of-memory, a crash or a poisoned CUDA context stays in them), and
that Ray ends too if the caller dies, since the caller owns them. A child process would add
a second Ray driver per trial (seconds to connect) and gain nothing.

What a rank runs is the one measurement loop (mbtune.trial.measure) over a torch.distributed
process group (mbtune.trial.collectives.ProcessGroup); this module is only the Ray Train run
around it. With ``trial.sharding: fsdp`` the rank's group is mbtune.trial.sharding's: each
worker holds only its shard of the model (FSDP2), and no DDP wrapper runs on top of it.
A configuration with tensor or pipeline parallelism (t > 1 or p > 1) runs
mbtune.trial.pipeline's step instead, on one (dp, pp, tp) device mesh over the same group.

Failures. Ranks agree on the status before going on wherever that is safe (mbtune.trial.measure
says where): an out-of-memory or error there becomes the whole trial's ``oom`` or
``error`` on every rank at once. A failure inside a synchronised step cannot be agreed on:
the rank raises, Ray Train's controller, which polls every worker, ends the whole worker
group within a second, and the trial's status is read from the rank's error (``oom`` for
an out-of-memory). A worker that dies (SIGKILL,
the kernel's OOM killer) is the same: an ``error`` naming the rank. ``trial.timeout_s``
holds from the call: every worker stops itself at the deadline (a watchdog thread ends
its process, wherever it is stuck), and the run's collectives time out there too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

from mbtune.config.experiment import Experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.trial.collectives import ProcessGroup
from mbtune.trial.measure import Measurement, measure, resolve_device
from mbtune.trial.memory import (
    find_oom,
    fixed_mmap_threshold,
    reason_line,
    release,
    short_reason,
)
from mbtune.trial.parallelize import model_parallel_problem
from mbtune.trial.sharding import FullyShardedGroup

__all__ = ["EXIT_TIMED_OUT", "FIT_GRACE_S", "HEALTH_CHECK_INTERVAL_S", "measure_ddp"]

HEALTH_CHECK_INTERVAL_S = 0.5
"""How often Ray Train's controller polls the workers (its default, 2 s, would add up to
2 s to every trial after its last step)."""

FIT_GRACE_S = 30.0
"""How long past ``timeout_s`` the caller waits for Ray Train to report workers that have
stopped themselves, before it gives the run up as timed out."""

EXIT_TIMED_OUT = 124
"""The exit code of a worker that stopped itself at the trial's deadline."""


# ---------------------------------------------------------------------------
# the caller's side: one Ray Train run per trial


def measure_ddp(exp: Experiment, config: BatchConfig, *, cwd: str) -> Measurement:
    """Measure ``config`` with ``config.num_devices`` DDP workers of a Ray Train run.

    Starts an embedded Ray (quiet) or joins ``ray.address`` unless Ray is running. ``cwd``
    is where the workers import a user model from.
    """
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from mbtune.cluster import init_ray

    tr = exp.trial
    refused = model_parallel_problem(tr, config) if _model_parallel(config) else None
    if refused:
        raise MbtuneError(refused)
    deadline = time.time() + tr.timeout_s  # from the call: worker start-up counts
    use_gpu = tr.device != "cpu" and exp.gpus_per_trial > 0
    base = Measurement(config=config, device="cuda" if use_gpu else "cpu")
    # as a search starts or joins Ray (a quiet embedded one unless ray.address names a
    # cluster); bad input there is a one-line MbtuneError, ray:// is refused
    init_ray(exp.ray.address, dashboard=False, verbose=False)
    problem = _resources_problem(exp, config.num_devices)
    if problem:
        return dataclasses.replace(base, status="error", reason=problem)

    resources = {"CPU": exp.ray.cpus_per_trial}
    if use_gpu:
        resources["GPU"] = exp.gpus_per_trial
    with tempfile.TemporaryDirectory(prefix="mbtune-ddp-") as storage, _train_env(deadline):
        trainer = _trainer_without_datasets(TorchTrainer)(
            _rank_main,
            train_loop_config={
                "experiment": exp,
                "config": config,
                "cwd": cwd,
                "deadline": deadline,
            },  # fmt: skip
            torch_config=TorchConfig(
                backend="nccl" if use_gpu else "gloo", timeout_s=max(1, int(tr.timeout_s))
            ),
            scaling_config=ScalingConfig(
                num_workers=config.num_devices, use_gpu=use_gpu, resources_per_worker=resources
            ),
            run_config=RunConfig(
                name="trial",
                storage_path=storage,  # Ray Train's own state; nothing in it is kept
                # one attempt: a failed trial is a result, never retried
                failure_config=FailureConfig(max_failures=0, controller_failure_limit=0),
            ),
        )
        try:
            outcome = _fit(trainer, wait_s=deadline + FIT_GRACE_S - time.time())
        except Exception as e:  # Ray Train's TrainingFailedError, or Ray itself failing
            return _failed(base, e, timed_out=time.time() >= deadline, timeout_s=tr.timeout_s)
    if outcome is None:
        return dataclasses.replace(
            base,
            status="timeout",
            reason=f"still running after trial.timeout_s = {tr.timeout_s:g} s (the Ray Train "
            f"run did not end within {FIT_GRACE_S:g} s more)",
        )
    return outcome.return_value


def _trainer_without_datasets(trainer: type) -> type:
    """Ray Train's ``trainer`` less its datasets callback: a trial feeds its workers no Ray
    Dataset, and the callback starts a DatasetManager actor for every run all the same (a
    process of its own that imports Ray Data: 1.7 CPU-s a trial on this machine). Ray
    builds its callbacks in a private method, so this leaves out only a callback of that
    name: if Ray renames either, the trial runs with Ray's callbacks, as before."""

    class Trainer(trainer):
        def _create_default_callbacks(self) -> list:
            callbacks = super()._create_default_callbacks()
            return [c for c in callbacks if type(c).__name__ != "DatasetsCallback"]

    return Trainer


def _resources_problem(exp: Experiment, workers: int) -> str | None:
    """Why the Ray cluster can never hold ``workers`` workers, or None.

    Ray Train would wait for them until the deadline; this says at once what to change.
    """
    import ray

    have = ray.cluster_resources()
    wanted = (("CPU", exp.ray.cpus_per_trial, "cpus_per_trial"),)
    if exp.trial.device != "cpu" and exp.gpus_per_trial > 0:
        wanted += (("GPU", exp.gpus_per_trial, "gpus_per_trial"),)
    for name, each, key in wanted:
        if each * workers > have.get(name, 0) + 1e-9:
            return (
                f"{workers} ddp workers need {each * workers:g} {name} (ray.{key} = {each:g} "
                f"per worker), but the Ray cluster has {have.get(name, 0):g}; lower ray.{key} "
                "(a fraction shares a core) or num_devices"
            )
    return None


@contextlib.contextmanager
def _train_env(deadline: float) -> Iterator[None]:
    """Ray Train reads these from the caller's environment and passes them on to its
    controller: poll the workers often, wait for their resources no longer than the trial
    may run, and start no preemption watcher (an actor per run that watches for draining
    nodes so that a job can save a checkpoint and restart: a trial is one attempt that
    saves nothing; 1.3 CPU-s a trial on this machine). A user's own setting of the
    health check or the watcher is kept."""
    values = {
        key: os.environ.get(key, default)
        for key, default in (
            ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(HEALTH_CHECK_INTERVAL_S)),
            ("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0"),
        )
    }
    values["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = f"{max(1.0, deadline - time.time()):.0f}"
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _fit(trainer: Any, *, wait_s: float) -> Any:
    """``trainer.fit()``, given up (None) after ``wait_s``.

    In a thread of its own: so that a run that never ends cannot hold the caller (the
    workers stop themselves at the deadline; this is the backstop), and so that fit()
    registers no SIGINT handler of its own in the command's main thread.
    """
    box: dict[str, Any] = {}

    def fit() -> None:
        try:
            box["result"] = trainer.fit()
        except BaseException as e:  # handed to the caller below
            box["error"] = e

    thread = threading.Thread(target=fit, name="mbtune-ddp-fit", daemon=True)
    thread.start()
    thread.join(max(0.0, wait_s))
    if thread.is_alive():
        return None
    if "error" in box:
        raise box["error"]
    return box["result"]


def _failed(
    base: Measurement, error: BaseException, *, timed_out: bool, timeout_s: float
) -> Measurement:
    """The trial's result when the Ray Train run failed: oom, timeout or error."""
    if timed_out:
        return dataclasses.replace(
            base, status="timeout", reason=f"still running after trial.timeout_s = {timeout_s:g} s"
        )
    failures = getattr(error, "worker_failures", None)
    if not failures:  # the controller failed, or Ray itself
        cause = getattr(error, "controller_failure", None) or error
        return dataclasses.replace(
            base, status="error", reason=short_reason(f"Ray Train: {_describe(cause)}")
        )
    status, reason = _worker_failure(failures)
    return dataclasses.replace(base, status=status, reason=reason)


def _worker_failure(failures: dict[int, BaseException]) -> tuple[str, str]:
    """(status, reason) from the errors of the ranks that failed (Ray Train hands back each
    rank's own exception, or its failed health check when the process is gone).

    An out-of-memory on any rank makes the trial ``oom``; else a rank whose process died
    is the cause (the others fail after it, in a collective); else the first rank's error.
    """
    ranked = sorted(failures.items())
    oom = [(r, find_oom(e)) for r, e in ranked if find_oom(e) is not None]
    died = [r for r, e in ranked if _died(e)]
    if oom:
        rank, e = oom[0]
        status, what = "oom", reason_line(e)
    elif died:
        rank, status = died[0], "error"
        what = "the worker process died (SIGKILL: the kernel's out-of-memory killer?)"
    else:
        rank, e = ranked[0]
        status, what = "error", _describe(e)
    others = len(ranked) - 1
    also = f" (and {others} other rank{'s' if others > 1 else ''} failed with it)" if others else ""
    return status, short_reason(f"rank {rank}: {what}{also}")


def _died(error: BaseException) -> bool:
    """Whether Ray lost the worker's process (a failed health check of a dead actor)."""
    from ray.exceptions import RayActorError

    return isinstance(getattr(error, "health_check_failure", None), RayActorError)


def _describe(error: BaseException) -> str:
    """One line for an error: its own, or the last line of a (remote) traceback's text."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if len(lines) > 1 else reason_line(error)


# ---------------------------------------------------------------------------
# one rank (runs in a Ray Train worker)


def _rank_main(cfg: dict[str, Any]) -> Measurement:
    """Ray Train's train_loop_per_worker: one rank of the trial."""
    watchdog = threading.Timer(max(0.0, cfg["deadline"] - time.time()), _stop_at_deadline)
    watchdog.daemon = True
    watchdog.start()
    try:
        os.chdir(cfg["cwd"])  # Ray Train moved the worker to its storage; user models are here
        return _run_rank(cfg["experiment"], cfg["config"])
    finally:
        watchdog.cancel()


def _stop_at_deadline() -> None:
    # the only way out of a step stuck in C code (a collective, a kernel, a sleeping user
    # model); Ray Train sees the process gone and ends the run
    os._exit(EXIT_TIMED_OUT)


def _run_rank(exp: Experiment, config: BatchConfig) -> Measurement:
    """One rank: the measurement loop over the run's process group."""
    import torch

    torch.set_num_threads(exp.cpu_threads)  # as a simulated trial: the CPUs it holds
    device = _rank_device(torch, exp.trial.device)
    if device.type == "cpu":
        fixed_mmap_threshold()  # the peak is the process's: count what it held
    if _model_parallel(config):
        from mbtune.trial.pipeline import measure_model_parallel

        measured = measure_model_parallel(exp, config, device)
        if measured.status != "ok":
            release(torch, device)
        return measured
    if exp.trial.sharding == "fsdp":
        group = FullyShardedGroup.for_config(device, exp.trial, config, seed=exp.search.seed)
    else:
        group = ProcessGroup(device)
    measured = measure(exp, config, device, group)
    if measured.status != "ok":
        release(torch, device)  # the rank stops here; an OOM leaves tensors behind
    return measured


def _model_parallel(config: BatchConfig) -> bool:
    return config.tensor_parallel > 1 or config.pipeline_parallel > 1


def _rank_device(torch: Any, name: str) -> Any:
    device = resolve_device(name)
    if device.type == "cuda":  # the GPU Ray gave this worker
        import ray.train.torch

        device = ray.train.torch.get_device()
        torch.cuda.set_device(device)
    return device
