"""One trial: a configuration measured by the experiment's backend, as a TrialResult.

The trial is the measuring instrument of the whole tool. It follows docs/design.md's trial
protocol: one optimizer step = g forward/backward passes over micro-batches that differ
by at most one sample, each loss scaled by (micro-batch samples / P) so the accumulated
gradient equals the full-batch one, then the gradient all-reduce, then the optimizer
step. The steps are timed by one loop (mbtune.trial.measure): with ``trial.parallel: simulate``
one process measures one device's share and the all-reduce is modelled
(mbtune.comm; with ``trial.sharding: fsdp`` the process is rank 0 of N on a
fake process group, its shard real, and FSDP2's all-gathers and reduce-scatters are
modelled there too); with ``ddp`` every device is a real process of a Ray Train run
and the all-reduce is PyTorch's (mbtune.trial.ddp). ``trial.backend: replay`` answers from a
table instead (mbtune.trial.replay). Compile time is measured on its own and never mixed into
throughput; every step time is kept.

Out of memory is a result (status ``oom``), not a crash; so is a timeout. Bad input (a
model that does not import, a CUDA device that does not exist, a replay table without the
right columns) raises :class:`~mbtune.errors.MbtuneError`. ``python -m mbtune.trial`` runs
one trial for a search, in a process of its own (mbtune.trial.launch starts it).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from mbtune.comm import pipeline_traffic, step_traffic, tensor_parallel_traffic
from mbtune.config.experiment import Experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.models.shape import shape_of
from mbtune.progress import PhaseHook
from mbtune.trial.collectives import OneProcess
from mbtune.trial.flops import utilisation
from mbtune.trial.measure import (
    Measurement,
    measure,
    no_phase,
    resolve_device,
)
from mbtune.trial.memory import fixed_mmap_threshold, release, retry_note
from mbtune.trial.replay import replay
from mbtune.trial.sharding import SimulatedShards, fake_process_group

__all__ = [
    "TrialRequest",
    "TrialResult",
    "objective",
    "result_of",
    "run_trial",
    "trial_metrics",
]

_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class TrialResult:
    """What one trial measured. Times in ms unless the name says otherwise."""

    status: str
    """``ok``, ``oom``, ``error`` or ``timeout``."""
    batch_size: int
    num_devices: int
    micro_batch_size: int
    """The micro-batch size measured (after halving on OOM, or m = P for batch mixing)."""
    activation_checkpointing: bool = False
    reshard_after_forward: bool = True
    """Sharded: whether each block's parameters were freed after its forward pass."""
    grad_sync: str = "last"
    """When the gradients were synchronised: ``last`` or ``every`` micro-batch."""
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    pipeline_schedule: str = "1f1b"
    per_device_batch: int
    grad_accum_steps: int
    micro_batches: tuple[int, ...] = ()
    """The micro-batches one replica runs per step, e.g. (4, 4) or (3, 2, 2)."""
    precision: str | None = None
    """The arithmetic measured (``trial.precision`` resolved on the device): ``fp32``,
    ``tf32``, ``bf16`` or ``fp16``; None where nothing was measured."""
    samples_per_s: float | None = None
    """Global throughput: batch_size / median step time."""
    samples_per_s_per_device: float | None = None
    tokens_per_s: float | None = None
    step_time_ms_median: float | None = None
    step_time_ms_iqr: float | None = None
    """Spread: the interquartile range of the step times."""
    step_times_ms: tuple[float, ...] = ()
    """Every timed step, in order."""
    compute_time_ms: float | None = None
    """Median time of the forward/backward passes and optimizer step on one device."""
    comm_time_ms: float = 0.0
    """A step's collectives (zero on one device): modelled with ``simulate`` (the
    gradients' all-reduce, sharded the all-gathers and reduce-scatters, and with model
    parallelism the tensor-parallel all-reduces and the pipeline's sends: mbtune.comm);
    with ``ddp`` the median of standalone all-reduces of the gradient's bytes, measured."""
    bubble_time_ms: float = 0.0
    """Modelled pipeline bubble per step (zero without a pipeline)."""
    compile_s: float | None = None
    """Compile time: first steps minus their share of steady-state time; None: not compiled."""
    compile_fallback: str | None = None
    """Why compilation silently fell back to eager (recompile limit), if it did."""
    compile_from_cache: bool = False
    """Every graph of ``compile_s`` came from torch's on-disk compile cache (a shape an
    earlier trial or run compiled): less than a cold compile."""
    flops_per_sample: float | None = None
    """Model FLOPs of one sample's step (mbtune.trial.flops: 3 x the counted forward pass)."""
    tflops_per_s: float | None = None
    """Achieved model TFLOP/s of one device."""
    mfu: float | None = None
    """tflops_per_s / the device's peak at this precision; None where the peak is unknown."""
    peak_memory_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    """CUDA: the caching allocator's peak reservation."""
    alloc_retries: int | None = None
    """CUDA: times the allocator freed its cache and retried during the timed steps."""
    eval_samples_per_s: float | None = None
    """Forward-only throughput at the same micro-batch size (``trial.eval``)."""
    loss: float | None = None
    """The mean loss of the last timed step: over the global batch with ``ddp`` (every
    rank's, all-reduced), over the busiest device's samples with ``simulate``; None where
    nothing was timed, the loss was not finite (the trial is then ``error``) or the trial
    was replayed."""
    micro_batch_sizes_tried: tuple[int, ...] = ()
    """Every micro-batch size tried, in order (more than one after halving on OOM)."""
    device: str = "cpu"
    backend: str = "torch"
    parallel: str = "simulate"
    """``simulate`` (one device measured, all-reduce modelled) or ``ddp`` (every device a
    real process: step times, compute and all-reduce all measured)."""
    sharding: str = "none"
    """``none`` (each device held the whole model) or ``fsdp`` (each ddp worker its shard;
    with ``simulate``, rank 0's shard on a fake process group)."""
    reason: str | None = None
    """Why the status is not ok, in one line."""
    note: str | None = None
    """Something the user should know about the measurement (e.g. batch mixing)."""
    wall_s: float = 0.0
    """Wall time of the whole trial, build and compile included."""

    @property
    def config(self) -> BatchConfig:
        """The configuration measured (B, n, m as measured, and its settings)."""
        return BatchConfig.of(self)

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["micro_batches"] = list(self.micro_batches)
        d["step_times_ms"] = list(self.step_times_ms)
        d["micro_batch_sizes_tried"] = list(self.micro_batch_sizes_tried)
        return d


@dataclass(frozen=True, kw_only=True)
class TrialRequest:
    """What a search asks of one trial process (``python -m mbtune.trial``), pickled on its
    stdin by mbtune.trial.launch."""

    experiment: Experiment
    """The experiment, validated once by the driver: the trial never parses it again."""
    config: BatchConfig
    """The configuration to measure."""
    repeat: int = 0
    """Which measurement of this configuration the trial is (0: its first); a replayed
    trial draws its noise from it."""


def run_trial(
    exp: Experiment,
    config: BatchConfig,
    *,
    cwd: str | None = None,
    repeat: int = 0,
    on_phase: PhaseHook | None = None,
) -> TrialResult:
    """Measure one configuration of ``exp`` with its backend.

    With ``trial.on_oom: halve`` an out-of-memory result is retried at half the
    micro-batch size (Composer's behaviour) until it fits or the size reaches one.
    ``cwd`` is where a user model is imported from (default: the current directory); it
    matters only to ``parallel: ddp``, whose workers run in other processes. ``repeat``:
    which measurement of the configuration this is (0: its first; replay draws its noise
    from it). ``on_phase`` hears of each phase of the trial (see :data:`PhaseHook`), for a
    progress display.
    """
    phase = on_phase or no_phase
    tr = exp.trial
    started = time.perf_counter()
    tried: list[int] = []
    while True:
        tried.append(config.micro_batch_size)
        if tr.backend == "torch" and tr.parallel == "ddp":
            from mbtune.trial.ddp import measure_ddp

            phase("starting workers", 0, 0)
            # ddp keeps its own deadline: its workers stop themselves at timeout_s, where an
            # alarm here would leave them running
            measured = measure_ddp(exp, config, cwd=cwd or os.getcwd())
        elif tr.backend == "replay":
            measured = _with_timeout(
                tr.timeout_s, lambda c=config: replay(exp, c, repeat=repeat, on_phase=phase)
            )
        else:
            measured = _with_timeout(tr.timeout_s, lambda c=config: _measure_here(exp, c, phase))
        if measured is None:
            result = dataclasses.replace(
                _base_result(exp, config, device=tr.device, note=None),
                status="timeout",
                reason=f"still running after trial.timeout_s = {tr.timeout_s:g} s",
            )
        else:
            result = result_of(exp, measured)
        if result.status != "oom" or tr.on_oom != "halve" or config.micro_batch_size == 1:
            break
        config = dataclasses.replace(config, micro_batch_size=config.micro_batch_size // 2)
    return dataclasses.replace(
        result, micro_batch_sizes_tried=tuple(tried), wall_s=time.perf_counter() - started
    )


def _measure_here(exp: Experiment, config: BatchConfig, phase: PhaseHook) -> Measurement:
    """``trial.parallel: simulate``: this process stands for the busiest device."""
    phase("building", 0, 0)
    import torch

    # the CPUs the trial holds, whoever runs it: a search's trial process (Ray sets
    # OMP_NUM_THREADS from them) and `mbtune trial` then measure the same thing
    torch.set_num_threads(exp.cpu_threads)
    device = resolve_device(exp.trial.device)
    if device.type == "cpu":
        # as a ddp rank: the peak is what the trial held, not what glibc's heap kept
        # (its dynamic threshold left a checkpointed step's freed blocks resident)
        fixed_mmap_threshold()
    if config.tensor_parallel * config.pipeline_parallel > 1:
        # rank 0's stages and shard on torch's fake process group; the rest is modelled
        from mbtune.trial.stage import measure_stage

        try:
            measured = measure_stage(exp, config, device, phase)
        finally:
            release(torch, device)
        shape = measured.shape or exp.model_shape or shape_of(exp.model)
        return dataclasses.replace(measured, shape=shape)
    if exp.trial.sharding != "fsdp":
        try:
            return measure(exp, config, device, OneProcess(), phase)
        finally:
            release(torch, device)
    # rank 0 of N alone: FSDP2 over torch's fake process group (no communication)
    with fake_process_group(config.num_devices, who="a simulated sharded trial"):
        group = SimulatedShards.for_config(device, exp.trial, config, seed=exp.search.seed)
        try:
            return measure(exp, config, device, group, phase)
        finally:
            release(torch, device)


def result_of(exp: Experiment, measured: Measurement) -> TrialResult:
    """The TrialResult of a measurement: step times, throughput, compute, all-reduce and
    pipeline bubble, compile time, FLOPs and MFU. Where one process stood for every device
    (``comm_s`` None), the all-reduce and the bubble are modelled here."""
    tr, config = exp.trial, measured.config
    base = dataclasses.replace(
        _base_result(exp, config, device=measured.device, note=measured.note),
        status=measured.status,
        reason=measured.reason,
        precision=measured.precision,
        peak_memory_bytes=measured.peak_memory_bytes,
        loss=measured.loss,
    )
    if not measured.step_s:
        return base
    bubble_share, steps = 0.0, list(measured.step_s)
    if measured.comm_s is None:  # one device's steps (its stage and shard): the rest modelled
        comm = _modelled_comm_s(exp, measured)
        # the pipeline's fill and drain idle: (p - 1) / g of the ideal time for 1f1b (by
        # schedule: BatchConfig.bubble)
        bubble_share = config.bubble
        steps = [c * (1 + bubble_share) + comm for c in steps]
    else:
        comm = statistics.median(measured.comm_s) if measured.comm_s else 0.0
    compute = statistics.median(measured.compute_s) if measured.compute_s else None
    result = _with_step_times(base, config, steps)
    tflops, mfu = utilisation(
        measured.flops_per_sample, result.samples_per_s, config.num_devices, measured.peak_tflops
    )
    tokens = measured.tokens_per_sample
    compiled = tr.compile and compute is not None and measured.first_s is not None
    return dataclasses.replace(
        result,
        note=_join(result.note, retry_note(measured.alloc_retries)),
        flops_per_sample=measured.flops_per_sample,
        tflops_per_s=tflops,
        mfu=mfu,
        peak_reserved_bytes=measured.peak_reserved_bytes,
        alloc_retries=measured.alloc_retries,
        tokens_per_s=result.samples_per_s * tokens if tokens else None,
        compute_time_ms=compute * 1e3 if compute is not None else None,
        comm_time_ms=comm * 1e3,
        bubble_time_ms=compute * bubble_share * 1e3 if compute is not None else 0.0,
        compile_s=max(0.0, measured.first_s - compute) if compiled else None,
        compile_fallback=measured.compile_fallback,
        compile_from_cache=compiled and measured.compile_from_cache,
        eval_samples_per_s=config.batch_size / measured.eval_s if measured.eval_s else None,
    )


def _modelled_comm_s(exp: Experiment, measured: Measurement) -> float:
    """The collectives of one device's step where one process stood for every device
    (mbtune.comm): the data-parallel sync of its gradients (its stage's and shard's with
    model parallelism; sharded: FSDP2's, unit by unit), and with model parallelism the
    tensor-parallel all-reduces and the pipeline's sends of its blocks' activations."""
    config, shape = measured.config, measured.shape
    units = tuple(measured.fsdp_units)
    traffic = step_traffic(config, grad_bytes=measured.grad_bytes,
                           sharding="fsdp" if units else "none", units=units)  # fmt: skip
    if config.tensor_parallel * config.pipeline_parallel > 1:
        if shape is None or shape.hidden is None or shape.layers is None:
            raise MbtuneError(
                "trial.parallel: simulate models a split model's traffic from its block width "
                "and layers, which this model does not say; set its mbtune_shape (docs/"
                "model_parallel.md) or use trial.parallel: ddp"
            )
        itemsize = 2 if measured.precision in ("bf16", "fp16") else 4
        activation = (measured.tokens_per_sample or 1) * shape.hidden * itemsize
        traffic += tensor_parallel_traffic(
            config, layers=shape.layers / config.pipeline_parallel, activation_bytes=activation
        ) + pipeline_traffic(config, activation_bytes=activation)
    return traffic.seconds(*exp.trial.link(measured.device))


def _base_result(
    exp: Experiment, config: BatchConfig, *, device: str, note: str | None
) -> TrialResult:
    return TrialResult(
        status="error",
        batch_size=config.batch_size,
        num_devices=config.num_devices,
        micro_batch_size=config.micro_batch_size,
        activation_checkpointing=config.activation_checkpointing,
        reshard_after_forward=config.reshard_after_forward,
        grad_sync=config.grad_sync,
        tensor_parallel=config.tensor_parallel,
        pipeline_parallel=config.pipeline_parallel,
        pipeline_schedule=config.pipeline_schedule,
        per_device_batch=config.per_device_batch,
        grad_accum_steps=config.grad_accum_steps,
        micro_batches=tuple(config.micro_batch_sizes),
        device=device,
        backend=exp.trial.backend,
        parallel=exp.trial.parallel,
        sharding=exp.trial.sharding,
        note=note,
    )


def _with_step_times(base: TrialResult, config: BatchConfig, steps: list[float]) -> TrialResult:
    """Every step time (seconds), their median and IQR, and the throughput they give."""
    median = statistics.median(steps)
    q = statistics.quantiles(steps, n=4) if len(steps) > 1 else [median, median, median]
    speed = config.batch_size / median
    return dataclasses.replace(
        base,
        samples_per_s=speed,
        samples_per_s_per_device=speed / config.num_devices,
        step_time_ms_median=median * 1e3,
        step_time_ms_iqr=(q[2] - q[0]) * 1e3,
        step_times_ms=tuple(s * 1e3 for s in steps),
    )


def _join(*notes: str | None) -> str | None:
    return "; ".join(n for n in notes if n) or None


def _with_timeout(timeout_s: float, fn: Callable[[], _T]) -> _T | None:
    """Run ``fn``; past ``timeout_s`` stop it (main thread only) and return None."""
    if threading.current_thread() is not threading.main_thread():
        # no alarm off the main thread; the search's trial process is killed from outside
        # at timeout_s + 60 s instead (launch.measure_in_subprocess)
        return fn()

    def on_alarm(signum: int, frame: Any) -> None:
        raise _TrialTimeout

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return fn()
    except _TrialTimeout:
        return None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class _TrialTimeout(BaseException):
    """Raised by the alarm; a BaseException so that the trial's own handlers let it pass."""


def objective(exp: Experiment, result: TrialResult) -> float:
    """The value the search maximises: the experiment's objective, 0 unless ok."""
    if result.status != "ok" or result.samples_per_s is None:
        return 0.0
    if exp.search.objective == "samples_per_s_per_device":
        return result.samples_per_s / result.num_devices
    return result.samples_per_s


def trial_metrics(
    exp: Experiment,
    config: BatchConfig,
    *,
    cwd: str | None = None,
    repeat: int = 0,
    on_phase: PhaseHook | None = None,
) -> dict:
    """Measure ``config`` and give what the search reports to Tune: the result as a dict,
    its objective, and whether the model's batch mixing changed the micro-batch size. Bad
    input (MbtuneError) is an ``error`` result here: the search goes on."""
    try:
        result = run_trial(exp, config, cwd=cwd, repeat=repeat, on_phase=on_phase)
    except MbtuneError as e:
        result = dataclasses.replace(
            _base_result(exp, config, device=exp.trial.device, note=None), reason=str(e)
        )
    metrics = result.as_dict()
    metrics["objective"] = objective(exp, result)
    metrics["mixes_batch"] = result.micro_batch_size != config.micro_batch_size and bool(
        result.note
    )
    return metrics
