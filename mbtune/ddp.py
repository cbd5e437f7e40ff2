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

Failures. Ranks agree on the status before going on wherever that is safe: after building
the model and data, after the first (local, all-reduce-free) step that compiles the model
and allocates every buffer, and before each timed step (the memory budget, also the
barrier that starts a step on every rank together). An out-of-memory or error there
becomes the whole trial's ``oom`` or ``error`` on every rank at once. A failure inside a
synchronised step cannot be agreed on (the other ranks wait in DDP's all-reduce, where no
other collective can be matched): the rank raises, Ray Train's controller, which polls
every worker, ends the whole worker group within a second, and the trial's status is
read from the rank's error (``oom`` for an out-of-memory). A worker that dies (SIGKILL,
the kernel's OOM killer) is the same: an ``error`` naming the rank. ``trial.timeout_s``
holds from the call: every worker stops itself at the deadline (a watchdog thread ends
its process, wherever it is stuck), and the run's collectives time out there too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from mbtune.config import Experiment
from mbtune.flops import count_flops_per_sample, device_peak, utilisation
from mbtune.lattice import BatchConfig, even_split
from mbtune.precision import for_device
from mbtune.trial import (
    TrialResult,
    _base_result,
    _compile,
    _eval_time,
    _fallback_watch,
    _find_oom,
    _mark_batch_dynamic,
    _one_line,
    _over_budget,
    _peak_memory,
    _release,
    _reset_peak,
    _with_step_times,
    accumulate_gradients,
    build_spec,
    device_timer,
    full_batch_if_mixing,
    gradient_bytes,
    memory_budget,
    resolve_device,
    split_batch,
)

__all__ = ["ddp_accumulate", "measure_ddp", "rank_micro_batches"]

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


def measure_ddp(exp: Experiment, config: BatchConfig, *, cwd: str) -> TrialResult:
    """Measure ``config`` with ``config.num_devices`` DDP workers of a Ray Train run.

    Starts an embedded Ray (quiet) or joins ``ray.address`` unless Ray is running. ``cwd``
    is where the workers import a user model from.
    """
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from mbtune.cluster import init_ray

    tr = exp.trial
    deadline = time.time() + tr.timeout_s  # from the call: worker start-up counts
    use_gpu = tr.device != "cpu" and exp.ray.gpus_per_trial > 0
    base = _base_result(exp, config, device="cuda" if use_gpu else "cpu", note=None)
    # as a search starts or joins Ray (a quiet embedded one unless ray.address names a
    # cluster); bad input there is a one-line MbtuneError, ray:// is refused
    init_ray(exp.ray.address, dashboard=False, verbose=False)
    problem = _resources_problem(exp, config.num_devices)
    if problem:
        return dataclasses.replace(base, status="error", reason=problem)

    resources = {"CPU": exp.ray.cpus_per_trial}
    if use_gpu:
        resources["GPU"] = exp.ray.gpus_per_trial
    with tempfile.TemporaryDirectory(prefix="mbtune-ddp-") as storage, _train_env(deadline):
        trainer = TorchTrainer(
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
    return _result(exp, config, outcome.return_value)


def _resources_problem(exp: Experiment, workers: int) -> str | None:
    """Why the Ray cluster can never hold ``workers`` workers, or None.

    Ray Train would wait for them until the deadline; this says at once what to change.
    """
    import ray

    have = ray.cluster_resources()
    wanted = (("CPU", exp.ray.cpus_per_trial, "cpus_per_trial"),)
    if exp.trial.device != "cpu" and exp.ray.gpus_per_trial > 0:
        wanted += (("GPU", exp.ray.gpus_per_trial, "gpus_per_trial"),)
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
    controller: poll the workers often, and wait for their resources no longer than the
    trial may run. A user's own health-check setting is kept."""
    values = {
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ.get(
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", str(HEALTH_CHECK_INTERVAL_S)
        ),
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": f"{max(1.0, deadline - time.time()):.0f}",
    }
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


def _failed(base: TrialResult, error: BaseException, *, timed_out: bool, timeout_s: float):
    """The trial's result when the Ray Train run failed: oom, timeout or error."""
    if timed_out:
        return dataclasses.replace(
            base, status="timeout", reason=f"still running after trial.timeout_s = {timeout_s:g} s"
        )
    failures = getattr(error, "worker_failures", None)
    if not failures:  # the controller failed, or Ray itself
        cause = getattr(error, "controller_failure", None) or error
        return dataclasses.replace(
            base, status="error", reason=_short(f"Ray Train: {_describe(cause)}")
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
    oom = [(r, _find_oom(e)) for r, e in ranked if _find_oom(e) is not None]
    died = [r for r, e in ranked if _died(e)]
    if oom:
        rank, e = oom[0]
        status, what = "oom", _one_line(e)
    elif died:
        rank, status = died[0], "error"
        what = "the worker process died (SIGKILL: the kernel's out-of-memory killer?)"
    else:
        rank, e = ranked[0]
        status, what = "error", _describe(e)
    others = len(ranked) - 1
    also = f" (and {others} other rank{'s' if others > 1 else ''} failed with it)" if others else ""
    return status, _short(f"rank {rank}: {what}{also}")


def _died(error: BaseException) -> bool:
    """Whether Ray lost the worker's process (a failed health check of a dead actor)."""
    from ray.exceptions import RayActorError

    return isinstance(getattr(error, "health_check_failure", None), RayActorError)


def _describe(error: BaseException) -> str:
    """One line for an error: its own, or the last line of a (remote) traceback's text."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if len(lines) > 1 else _one_line(error)


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:297] + "..."


def _result(exp: Experiment, config: BatchConfig, out: dict[str, Any]) -> TrialResult:
    """The TrialResult from what rank 0 returned (every rank's figures, the slowest taken)."""
    tr = exp.trial
    measured = dataclasses.replace(config, micro_batch_size=out["micro_batch_size"])
    base = _base_result(exp, measured, device=out["device"], note=out["note"])
    base = dataclasses.replace(
        base, peak_memory_bytes=out["peak_memory_bytes"], precision=out.get("precision")
    )
    if not out["step_s"]:
        return dataclasses.replace(base, status=out["status"], reason=out["reason"])
    result = _with_step_times(base, measured, out["step_s"])
    compute = statistics.median(out["compute_s"]) if out["compute_s"] else None
    comm = statistics.median(out["comm_s"]) if out["comm_s"] else 0.0
    tokens = out["tokens_per_sample"]
    flops = out.get("flops_per_sample")
    tflops, mfu = utilisation(flops, result.samples_per_s, config.num_devices, out["peak_tflops"])
    return dataclasses.replace(
        result,
        flops_per_sample=flops,
        tflops_per_s=tflops,
        mfu=mfu,
        status=out["status"],
        reason=out["reason"],
        tokens_per_s=result.samples_per_s * tokens if tokens else None,
        compute_time_ms=compute * 1e3 if compute is not None else None,
        comm_time_ms=comm * 1e3,
        compile_s=max(0.0, out["first_s"] - compute)
        if tr.compile and compute is not None
        else None,
        compile_fallback=out["compile_fallback"],
        eval_samples_per_s=config.batch_size / out["eval_s"] if out["eval_s"] else None,
    )


# ---------------------------------------------------------------------------
# one rank (runs in a Ray Train worker)


def rank_micro_batches(config: BatchConfig, rank: int) -> list[int]:
    """The micro-batches rank ``rank`` runs per step: its share of B (the even split over
    the ranks) spread evenly over the configuration's g micro-batches (fewer where the
    share has fewer samples than g)."""
    share = config.device_batch_sizes[rank]
    return even_split(share, min(config.grad_accum_steps, share))


def ddp_accumulate(
    loss_fn: Callable, model: Any, ddp: Any, batches: list[tuple[Any, ...]], *, total: float
) -> None:
    """One step's gradients on one rank: every micro-batch but the last under DDP's
    ``no_sync()`` (gradients accumulate locally), the last with it, whose backward pass
    all-reduces the accumulated gradients once.

    ``model`` is what is called (``ddp`` itself, or it compiled); ``total`` is B / n, the
    samples each micro-batch's mean loss is a share of, so that DDP's average over the
    ranks is the gradient of the mean loss over all B samples (uneven shares included).
    """
    *first, last = batches
    with ddp.no_sync():
        accumulate_gradients(loss_fn, model, first, total=total)
    accumulate_gradients(loss_fn, model, [last], total=total)


def _rank_main(cfg: dict[str, Any]) -> dict[str, Any]:
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


class _Rank:
    """The ranks' collectives of the trial protocol (not the gradients': DDP's)."""

    def __init__(self, torch: Any, device: Any) -> None:
        import torch.distributed as dist

        self.torch, self.dist, self.device = torch, dist, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def agree(self, failure: BaseException | None, over_budget: str | None = None):
        """Every rank's status, agreed: None if all are fine, else (status, reason) of the
        worst (an out-of-memory before an error), the same on every rank.

        Also a barrier: no rank leaves before every rank has arrived.
        """
        code, reason = 0, None
        if failure is not None:
            oom = _find_oom(failure)
            code, reason = (2, _one_line(oom)) if oom is not None else (1, _one_line(failure))
        elif over_budget:
            code, reason = 2, over_budget
        flag = self.torch.tensor([float(code)], device=self.device)
        self.dist.all_reduce(flag, op=self.dist.ReduceOp.MAX)
        worst = int(flag.item())
        if worst == 0:
            return None
        every: list[Any] = [None] * self.world
        self.dist.all_gather_object(every, (code, reason))
        rank = next(r for r, (c, _) in enumerate(every) if c == worst)
        return ("oom" if worst == 2 else "error"), f"rank {rank}: {every[rank][1]}"

    def slowest(self, values: list[float]) -> list[float]:
        """Each value's maximum over the ranks (one collective for all of them)."""
        if not values:
            return []
        t = self.torch.tensor(values, dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return t.tolist()


def _run_rank(exp: Experiment, config: BatchConfig) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel

    tr = exp.trial
    torch.set_num_threads(exp.cpu_threads)  # as a simulated trial: the CPUs it holds
    device = _rank_device(torch, tr.device)
    ranks = _Rank(torch, device)
    cuda = device.type == "cuda"

    # 1. build the model, its optimizer and this rank's data (local: a failure is agreed on)
    precision = for_device(tr.precision, device)
    spec = build_spec(exp, config)
    config, note = full_batch_if_mixing(spec, config)
    loss_fn = precision.loss(spec.loss_fn)
    out: dict[str, Any] = {
        "status": "ok", "reason": None, "note": note, "micro_batch_size":
        config.micro_batch_size, "device": device.type, "first_s": 0.0, "step_s": [],
        "compute_s": [], "comm_s": [], "eval_s": None, "peak_memory_bytes": None,
        "tokens_per_sample": spec.tokens_per_sample, "compile_fallback": None,
        "precision": precision.name, "flops_per_sample": None,
        "peak_tflops": device_peak(device, precision.name, tr.peak_tflops),
    }  # fmt: skip
    share = config.batch_size / config.num_devices  # each micro-batch's loss is a share of it
    failure: BaseException | None = None
    try:
        module = spec.module.to(device)
        module.train()
        torch.manual_seed(exp.search.seed + ranks.rank)  # each rank its own samples
        data = spec.make_batch(sum(rank_micro_batches(config, ranks.rank)), device)
        batches = split_batch(data, rank_micro_batches(config, ranks.rank))
        out["flops_per_sample"] = count_flops_per_sample(
            spec.loss_fn, module, batches[0], rank_micro_batches(config, ranks.rank)[0]
        )
        if tr.compile and tr.dynamic:
            _mark_batch_dynamic(batches)
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        params = [p for p in module.parameters() if p.requires_grad]
    except Exception as e:
        failure = e
    if _stop(out, ranks.agree(failure), torch, device):
        return out

    # DDP broadcasts rank 0's weights here (every rank arrives: all built). No buffer
    # broadcast before each forward pass: it would put a collective into the local steps
    # below, where a failing rank must not leave the others waiting.
    ddp = DistributedDataParallel(
        module, device_ids=[device.index] if cuda else None, **_no_forward_buffer_sync()
    )
    model = _compile(ddp, tr) if tr.compile else ddp

    timed = device_timer(torch, device)

    def local_step(*, keep_weights: bool = False) -> None:
        with ddp.no_sync():
            accumulate_gradients(loss_fn, model, batches, total=share)
        if keep_weights:  # zero gradients: every rank's weights stay equal
            for p in params:
                if p.grad is not None:
                    p.grad.zero_()
        precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    def step() -> None:
        ddp_accumulate(loss_fn, model, ddp, batches, total=share)
        precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    with _fallback_watch() as fallback:
        # 2. the first step, local: it compiles and allocates every buffer (the optimizer's
        # state too), so this is where an out-of-memory shows; agreed on
        try:
            out["first_s"] = timed(lambda: local_step(keep_weights=True))
        except Exception as e:
            failure = e
        if _stop(out, ranks.agree(failure), torch, device):
            return out
        _reset_peak(torch, device)

        def over_budget() -> str | None:
            budget = memory_budget(torch, device, tr.device_memory)
            return _over_budget(tr, budget, _peak_memory(torch, device))

        # 3. warm-up and timed steps, each started on every rank together
        verdict = None
        for i in range(tr.warmup_steps + tr.measure_steps):
            verdict = ranks.agree(None, over_budget())
            if verdict:
                break
            seconds = timed(step)
            if i >= tr.warmup_steps:
                out["step_s"].append(seconds)
        # 4. compute alone: the same steps without the all-reduce
        for _ in range(tr.measure_steps if verdict is None else 0):
            verdict = ranks.agree(None, over_budget())
            if verdict:
                break
            out["compute_s"].append(timed(local_step))
        peak = _peak_memory(torch, device)
        verdict = verdict or ranks.agree(None, over_budget())
        # 5. the all-reduce alone: the gradient's bytes, as one buffer
        if verdict is None:
            grad_bytes = gradient_bytes(module)
            dtype = params[0].dtype if params else torch.float32
            flat = torch.zeros(grad_bytes // _itemsize(torch, dtype), dtype=dtype, device=device)
            for _ in range(tr.measure_steps):
                ranks.agree(None)  # a barrier: every rank starts the all-reduce together
                out["comm_s"].append(timed(lambda: ranks.dist.all_reduce(flat)))
            if tr.eval:
                # forward-only over this rank's micro-batches (no collective in it)
                out["eval_s"] = _eval_time(spec.loss_fn, model, batches, timed)
    out["compile_fallback"] = fallback.reason
    if verdict:
        out["status"], out["reason"] = verdict

    # every figure is the slowest rank's
    n_step, n_compute, n_comm = len(out["step_s"]), len(out["compute_s"]), len(out["comm_s"])
    values = ranks.slowest(
        [out["first_s"], *out["step_s"], *out["compute_s"], *out["comm_s"],
         out["eval_s"] or 0.0, float(peak or 0)]
    )  # fmt: skip
    out["first_s"] = values[0]
    out["step_s"] = values[1 : 1 + n_step]
    out["compute_s"] = values[1 + n_step : 1 + n_step + n_compute]
    out["comm_s"] = values[1 + n_step + n_compute : 1 + n_step + n_compute + n_comm]
    out["eval_s"] = values[-2] or None
    out["peak_memory_bytes"] = int(values[-1]) if peak is not None else None
    return out


def _stop(out: dict[str, Any], verdict: tuple[str, str] | None, torch: Any, device: Any) -> bool:
    """Record an agreed failure in ``out``; True if the rank must stop."""
    if verdict is None:
        return False
    out["status"], out["reason"] = verdict
    _release(torch, device)
    return True


def _rank_device(torch: Any, name: str) -> Any:
    device = resolve_device(name)
    if device.type == "cuda":  # the GPU Ray gave this worker
        import ray.train.torch

        device = ray.train.torch.get_device()
        torch.cuda.set_device(device)
    return device


def _no_forward_buffer_sync() -> dict[str, bool]:
    """DDP's option that turns off the buffer broadcast before each forward pass (named
    ``forward_sync_buffers`` from torch 2.13, ``broadcast_buffers`` before)."""
    from torch.nn.parallel import DistributedDataParallel

    names = inspect.signature(DistributedDataParallel).parameters
    key = "forward_sync_buffers" if "forward_sync_buffers" in names else "broadcast_buffers"
    return {key: False}


def _itemsize(torch: Any, dtype: Any) -> int:
    return torch.empty((), dtype=dtype).element_size()
