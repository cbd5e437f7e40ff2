"""One measurement loop: the timed steps of docs/design.md's trial protocol, written once.

:func:`measure` builds the model and its data, counts the FLOPs, compiles, takes the first
step (which compiles), the warm-up and the timed steps, and the forward-only pass, over a
collectives object (mbtune.trial.collectives): with ``OneProcess`` (``trial.parallel:
simulate``) every collective does nothing, and the one process stands for the busiest
device; with ``ProcessGroup`` (``ddp``, in each Ray Train worker) the model runs under
``DistributedDataParallel`` (or, with ``trial.sharding: fsdp``, sharded by FSDP2:
mbtune.trial.sharding) and the ranks agree; with ``simulate`` and ``fsdp`` the one process
is rank 0 of N on a fake process group (``SimulatedShards``): its shard is real, its
collectives are modelled. Either way the loop gives a
:class:`Measurement`, which mbtune.trial.trial turns into a TrialResult. The step it times
is mbtune.trial.step's.

Where ranks agree (ddp; on one process the same calls only classify a failure). After
building the model and data, and after the first step, which is local (no all-reduce) and
allocates every buffer, so where an out-of-memory shows: a failure there is the whole
trial's ``oom`` or ``error`` on every rank at once. Before each synchronised step, on the
memory budget: also the barrier that starts the step on every rank together. A failure
inside a synchronised step cannot be agreed on (the other ranks wait in DDP's all-reduce,
where no other collective can be matched): the rank raises, and mbtune.trial.ddp reads the
status from the rank's error. A sharded trial has collectives in every pass (FSDP's
all-gathers), its first step included: only the build is agreed on, a failure in any step
raises. On one process a failure anywhere is the result.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mbtune.config.experiment import Experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig, ModelShape
from mbtune.models.batch import split_batch
from mbtune.models.shape import model_shape
from mbtune.progress import PhaseHook
from mbtune.trial import memory
from mbtune.trial.collectives import Collectives
from mbtune.trial.compiling import compile_model, compile_watch, mark_batch_dynamic
from mbtune.trial.flops import count_flops_per_sample, device_peak
from mbtune.trial.memory import Verdict
from mbtune.trial.precision import for_device
from mbtune.trial.step import (
    StepLoss,
    accumulate_gradients,
    build_spec,
    full_batch_if_mixing,
    mean_loss,
    rank_batch,
    rank_micro_batches,
    synced_step,
)

__all__ = [
    "Measurement",
    "device_timer",
    "eval_time",
    "forward_passes",
    "measure",
    "no_phase",
    "resolve_device",
]


def no_phase(phase: str, done: int, total: int) -> None:
    """A :data:`PhaseHook` that tells no one."""


@dataclass(frozen=True, kw_only=True)
class Measurement:
    """What one trial measured, in seconds; with ddp every figure is the slowest rank's."""

    config: BatchConfig
    """The configuration measured (m = P where the model mixes the samples of a batch)."""
    device: str
    """Where: ``cpu`` or ``cuda`` (``replay`` for a replayed trial)."""
    status: str = "ok"
    """``ok``; ``oom`` or ``error`` as agreed (the figures up to there are kept)."""
    reason: str | None = None
    """Why the status is not ok, in one line."""
    note: str | None = None
    """Something the user should know (batch mixing)."""
    precision: str | None = None
    """The arithmetic of the step (``trial.precision`` resolved on the device)."""
    first_s: float | None = None
    """The first step, which compiles; None where nothing was compiled or timed."""
    step_s: tuple[float, ...] = ()
    """The timed steps. With ddp whole steps, DDP's all-reduce in them; on one process
    (``simulated``) the compute alone, the all-reduce modelled from ``grad_bytes``."""
    compute_s: tuple[float, ...] = ()
    """Steps without the all-reduce (one process: ``step_s`` itself)."""
    comm_s: tuple[float, ...] | None = None
    """Standalone all-reduces of the gradient's bytes (ddp); None: one process stood for
    every device, so the all-reduce and any pipeline bubble are to be modelled."""
    grad_bytes: int = 0
    """The bytes one all-reduce of the gradients moves (trainable parameters)."""
    fsdp_units: tuple[tuple[int, int], ...] = ()
    """A simulated sharded trial's FSDP units, the root last: each one's (all-gather,
    reduce-scatter) bytes, from which its collectives are modelled
    (mbtune.trial.trial.fsdp_sync_s); empty otherwise."""
    eval_s: float | None = None
    """A forward-only pass over the same micro-batches (``trial.eval``)."""
    shape: ModelShape | None = None
    """The model's layers and block width (mbtune.models.shape), from which a simulated
    trial models its tensor-parallel and pipeline traffic."""
    peak_memory_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    """CUDA: the caching allocator's peak reservation."""
    alloc_retries: int | None = None
    """CUDA: times the allocator freed its cache and retried during the timed steps."""
    flops_per_sample: float | None = None
    """Model FLOPs of one sample's step (mbtune.trial.flops)."""
    peak_tflops: float | None = None
    """The device's peak at this precision, for MFU; None where unknown."""
    tokens_per_sample: int | None = None
    compile_fallback: str | None = None
    """Why compilation silently fell back to eager (recompile limit), if it did."""
    compile_from_cache: bool = False
    """Every graph this process compiled came from torch's on-disk compile cache
    (mbtune.trial.compiling.CompileWatch): ``first_s`` loaded them, not compiled them."""
    loss: float | None = None
    """The mean loss of the last timed step (before its optimizer step): over the global
    batch with ddp (all-reduced over the ranks), over the one device's samples otherwise;
    None where no step was timed or the loss was not finite (then ``error``)."""


def measure(
    exp: Experiment,
    config: BatchConfig,
    device: Any,
    collectives: Collectives,
    on_phase: PhaseHook = no_phase,
) -> Measurement:
    """Measure ``config`` of ``exp`` on ``device``, as one of ``collectives``' processes.

    Bad input (a precision the device cannot run, a model that does not build) raises
    MbtuneError; an out-of-memory or any other failure of the model is the result's
    status (see the module's docstring for where ranks agree on one).
    """
    tr = exp.trial
    precision = for_device(tr.precision, device)
    spec = build_spec(exp, config, meta=collectives.sharded)
    config, note = full_batch_if_mixing(spec, config)
    started = Measurement(
        config=config,
        device=device.type,
        note=note,
        precision=precision.name,
        tokens_per_sample=spec.tokens_per_sample,
        peak_tflops=device_peak(device, precision.name, tr.peak_tflops),
        shape=model_shape(spec.module),
    )
    try:
        timed = _timed_steps(exp, config, spec, precision, device, collectives, on_phase)
        if timed.before_first_step:  # agreed by every rank: nothing was timed
            status, reason = timed.verdict  # type: ignore[misc]
            return dataclasses.replace(started, status=status, reason=reason)
        return timed.slowest(collectives).measured(started, collectives)
    except Exception as failure:
        if not collectives.simulated:
            raise  # inside a synchronised step: the other ranks cannot hear of it
        status, reason = collectives.agree(failure)  # type: ignore[misc]
        return dataclasses.replace(started, status=status, reason=reason)


@dataclass(frozen=True, kw_only=True)
class _TimedSteps:
    """What :func:`_timed_steps` measured on this process, in seconds (the figures of
    :class:`Measurement` of the same names); :meth:`slowest` makes them the slowest rank's."""

    verdict: Verdict | None = None
    """Why the steps stopped short (``oom`` or ``error``, as agreed); None: they ran."""
    first_s: float | None = None
    """The first step; None: the steps stopped before it ended, and nothing was timed."""
    step_s: tuple[float, ...] = ()
    compute_s: tuple[float, ...] = ()
    comm_s: tuple[float, ...] = ()
    eval_s: float | None = None
    peak_memory_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    alloc_retries: int | None = None
    grad_bytes: int = 0
    flops_per_sample: float | None = None
    compile_fallback: str | None = None
    compile_from_cache: bool = False
    loss: float | None = None
    """The last timed step's mean loss, where finite (over every rank's samples)."""

    @property
    def before_first_step(self) -> bool:
        """Stopped (agreed) before the first step ended: nothing was timed."""
        return self.first_s is None

    def slowest(self, group: Collectives) -> _TimedSteps:
        """Every figure the slowest rank's, in one collective for all of them (a figure
        that is None here travels as 0)."""
        n, m, c = len(self.step_s), len(self.compute_s), len(self.comm_s)
        tail = [self.eval_s or 0.0, float(self.peak_memory_bytes or 0),
                float(self.peak_reserved_bytes or 0), float(self.alloc_retries or 0)]  # fmt: skip
        values = [self.first_s or 0.0, *self.step_s, *self.compute_s, *self.comm_s, *tail]
        slowest = group.slowest(values)

        def whole(value: float, own: int | None) -> int | None:
            return None if own is None else int(value)

        return dataclasses.replace(
            self,
            first_s=slowest[0],
            step_s=tuple(slowest[1 : 1 + n]),
            compute_s=tuple(slowest[1 + n : 1 + n + m]),
            comm_s=tuple(slowest[1 + n + m : 1 + n + m + c]),
            eval_s=slowest[-4] or None,
            peak_memory_bytes=whole(slowest[-3], self.peak_memory_bytes),
            peak_reserved_bytes=whole(slowest[-2], self.peak_reserved_bytes),
            alloc_retries=whole(slowest[-1], self.alloc_retries),
        )

    def measured(self, started: Measurement, group: Collectives) -> Measurement:
        """``started`` with these figures: the trial's measurement."""
        figures = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        status, reason = figures.pop("verdict") or ("ok", None)
        if group.simulated:  # one process stood for every device: its collectives modelled
            figures["comm_s"] = None
        units = getattr(group, "unit_bytes", ()) if group.simulated else ()
        return dataclasses.replace(started, **figures, status=status, reason=reason,
                                   fsdp_units=units)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class _Step:
    """One process's optimizer step, ready to run: its model as the step calls it
    (``wrapped`` by the collectives, ``model`` compiled where it is), its micro-batches and
    the loss that weighs them, and its optimizer."""

    group: Collectives
    module: Any
    wrapped: Any
    model: Any
    batches: list[Any]
    total: float
    step_loss: StepLoss
    loss_fn: Callable
    precision: Any
    optimizer: Any

    def local(self, first: bool = False) -> None:
        """A step without DDP's all-reduce (FSDP communicates in every pass: no step of
        it is local). ``first``: the step that compiles and allocates learns nothing (its
        gradients are zeroed before the optimizer's step, whose state it allocates), so
        that every trial's timed steps start from the same weights: with ddp the ranks'
        local gradients differ, and one process, ddp and fsdp give one loss."""
        if self.group.sharded:
            self._synced_gradients()
        else:
            with self.group.no_sync(self.wrapped):
                accumulate_gradients(self.loss_fn, self.model, self.batches, total=self.total)
        if first:
            self.optimizer.zero_grad(set_to_none=False)
        self._optimizer_step()

    def synced(self) -> None:
        """A step whose last micro-batch synchronises the gradients."""
        self._synced_gradients()
        self._optimizer_step()

    def _synced_gradients(self) -> None:
        synced_step(self.loss_fn, self.model, self.batches, total=self.total,
                    no_sync=lambda: self.group.no_sync(self.wrapped))  # fmt: skip

    def _optimizer_step(self) -> None:
        self.precision.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)


def _timed_steps(
    exp: Experiment,
    config: BatchConfig,
    spec: Any,
    precision: Any,
    device: Any,
    group: Collectives,
    phase: PhaseHook,
) -> _TimedSteps:
    """The trial protocol's steps on this process: the build, the first step, the warm-up
    and timed steps, the compute alone, the forward-only pass, the gradient sync alone and
    the loss; its own figures (the module's docstring says where the ranks agree)."""
    import torch

    tr = exp.trial
    # 1. the model, its optimizer and this process's samples (one process: the busiest
    # device's P), made once, outside the timing; a failure here is agreed on
    sizes = rank_micro_batches(config, group.rank)
    failure = None
    try:
        module = group.place(spec.module, device)  # sharded: this rank's shard only
        module.train()
        batches = split_batch(rank_batch(spec, config, group, device, seed=exp.search.seed), sizes)
        if tr.compile and tr.dynamic:
            mark_batch_dynamic(batches)
        # counted once, eagerly, before compiling and outside the timing (sharded: below,
        # once every rank is built, as its forward pass all-gathers)
        if not group.sharded:
            flops_per_sample = count_flops_per_sample(spec.loss_fn, module, batches[0], sizes[0])
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    except Exception as e:
        failure = e
    verdict = group.agree(failure)
    if verdict:
        return _TimedSteps(verdict=verdict)

    wrapped = group.data_parallel(module)
    if group.sharded:  # its blocks compiled one by one as it was placed
        flops_per_sample = count_flops_per_sample(spec.loss_fn, module, batches[0], sizes[0])
    model = compile_model(wrapped, tr) if tr.compile and not group.sharded else wrapped
    # each micro-batch's mean loss is weighted by its share of the process's samples; DDP
    # averages over the ranks, so there a share is of B / n (uneven ranks included)
    alone = group.world_size == 1 or group.simulated  # rank 0 of N alone: its own samples
    total = sum(sizes) if alone else config.batch_size / group.world_size
    step_loss = StepLoss(spec.loss_fn, total=total)  # unscaled: inside fp16's scaler
    step = _Step(
        group=group, module=module, wrapped=wrapped, model=model, batches=batches, total=total,
        step_loss=step_loss, loss_fn=precision.loss(step_loss), precision=precision,
        optimizer=optimizer,
    )  # fmt: skip

    timed = device_timer(torch, device)
    budget = memory.memory_budget(torch, device, tr.device_memory)

    def over() -> str | None:
        return memory.over_budget(tr, budget, memory.peak_memory(torch, device))

    with compile_watch() as watch:
        # 2. the first step, local: it compiles every micro-batch shape of this split and
        # allocates every buffer (the optimizer's state too); agreed on
        phase("compiling" if tr.compile else "first step", 0, 0)
        first = None
        try:
            first = timed(lambda: step.local(first=True))
        except Exception as e:
            if group.sharded and not group.simulated:
                raise  # the other ranks wait in FSDP's collectives: no agreeing here
            failure = e
        verdict = group.agree(failure)
        if verdict:
            return _TimedSteps(verdict=verdict)
        memory.reset_peak(torch, device)

        # 3. warm-up and timed steps; with ddp each started on every rank together
        steps: list[float] = []
        last_loss = None
        retries_before = None
        for i in range(tr.warmup_steps + tr.measure_steps):
            verdict = None if group.simulated else group.agree(None, over())
            if verdict:
                break
            if i < tr.warmup_steps:
                phase("warm-up", i + 1, tr.warmup_steps)
                timed(step.synced)
                continue
            if i == tr.warmup_steps:
                retries_before = memory.alloc_retries(torch, device)
            phase("timing", i + 1 - tr.warmup_steps, tr.measure_steps)
            step.step_loss.reset()
            steps.append(timed(step.synced))
            last_loss = step.step_loss.value
        retries = memory.alloc_retries(torch, device)
        if retries is not None and retries_before is not None:
            retries -= retries_before
        # 4. the compute alone: one process's steps are that; ddp's again, without DDP's
        # all-reduce; a sharded step's collectives overlap its compute and cannot be taken
        # out of it: its compute is the whole step
        compute = list(steps)
        if not group.simulated and not group.sharded:
            compute = []
            for _ in range(tr.measure_steps if verdict is None else 0):
                verdict = group.agree(None, over())
                if verdict:
                    break
                compute.append(timed(step.local))
        # 5. forward-only over the same micro-batches (no collective in it)
        eval_s = None
        if tr.eval and not verdict:
            forward = functools.partial(forward_passes, step.loss_fn, step.model, step.batches)
            eval_s = eval_time(forward, timed)
    peak = memory.peak_memory(torch, device)
    verdict = verdict or group.agree(None, memory.over_budget(tr, budget, peak))
    # 6. ddp: the gradient sync alone
    grad_bytes = spec.gradient_bytes
    comm: list[float] = []
    if not group.simulated and verdict is None:
        comm = _sync_times(step, grad_bytes, tr.measure_steps, timed, device)

    loss = mean_loss(last_loss, group)
    if verdict is None and loss is not None and not math.isfinite(loss):
        verdict = ("error", f"non-finite loss: {loss} in the last timed step (fp16 overflow "
                   "or a broken model)")  # fmt: skip
    return _TimedSteps(
        verdict=verdict,
        first_s=first,
        step_s=tuple(steps),
        compute_s=tuple(compute),
        comm_s=tuple(comm),
        eval_s=eval_s,
        peak_memory_bytes=peak,
        peak_reserved_bytes=memory.peak_reserved(torch, device),
        alloc_retries=retries,
        grad_bytes=grad_bytes,
        flops_per_sample=flops_per_sample,
        compile_fallback=watch.reason,
        compile_from_cache=watch.from_cache,
        loss=loss if loss is not None and math.isfinite(loss) else None,
    )


def _sync_times(
    step: _Step, grad_bytes: int, count: int, timed: Callable, device: Any
) -> list[float]:
    """ddp: the gradient sync alone, ``count`` times, of the gradient's bytes as one buffer
    (DDP's all-reduce; sharded: FSDP's all-gather and reduce-scatter)."""
    import torch

    group = step.group
    params = [p for p in step.module.parameters() if p.requires_grad]
    dtype = params[0].dtype if params else torch.float32
    itemsize = torch.empty((), dtype=dtype).element_size()
    if group.sharded:  # unit by unit: a buffer of the whole model may not fit
        flat = group.timing_buffer(dtype, device)
    else:
        flat = torch.zeros(grad_bytes // itemsize, dtype=dtype, device=device)
    times = []
    for _ in range(count):
        group.agree(None)  # a barrier: every rank starts the all-reduce together
        times.append(timed(lambda: group.sync_gradients(flat)))
    return times


# ---------------------------------------------------------------------------
# the device and the clock


def resolve_device(name: str) -> Any:
    """``auto``: CUDA where torch sees one, else the CPU."""
    import torch

    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise MbtuneError(
            f"trial.device: cuda was asked for, but torch {torch.__version__} sees no CUDA "
            "device; use device: cpu or auto"
        )
    return torch.device("cuda")


def device_timer(torch: Any, device: Any) -> Callable[[Callable[[], None]], float]:
    """A function that runs ``fn`` and returns its wall time, the device synchronised
    before and after (CUDA runs asynchronously)."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed(fn: Callable[[], None]) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    return timed


def forward_passes(loss_fn: Callable, model: Any, batches: list[Any]) -> None:
    """The forward passes alone of ``batches``, with the loss (``trial.eval``)."""
    import torch

    with torch.no_grad():
        for batch in batches:
            loss_fn(model, batch)


def eval_time(forward: Callable[[], None], timed: Callable) -> float:
    """Median time of a forward-only pass (``forward``), run once first to compile and set
    up its no-grad graph; ``timed``: a :func:`device_timer`."""
    timed(forward)
    return statistics.median(timed(forward) for _ in range(3))
