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
:class:`Measurement`, which mbtune.trial.trial turns into a TrialResult.

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

import contextlib
import dataclasses
import logging
import math
import re
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mbtune.config.experiment import Experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig, even_split
from mbtune.models.batch import batch_tensors, num_samples, slice_batch, split_batch
from mbtune.progress import PhaseHook
from mbtune.trial import memory
from mbtune.trial.collectives import Collectives
from mbtune.trial.flops import count_flops_per_sample, device_peak
from mbtune.trial.precision import for_device

__all__ = [
    "Measurement",
    "StepLoss",
    "accumulate_gradients",
    "build_spec",
    "device_timer",
    "full_batch_if_mixing",
    "gradient_bytes",
    "mean_loss",
    "measure",
    "no_phase",
    "rank_batch",
    "rank_micro_batches",
    "resolve_device",
    "synced_step",
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
    )
    try:
        return _timed_steps(exp, started, spec, precision, device, collectives, on_phase)
    except Exception as failure:
        if not collectives.simulated:
            raise  # inside a synchronised step: the other ranks cannot hear of it
        status, reason = collectives.agree(failure)  # type: ignore[misc]
        return dataclasses.replace(started, status=status, reason=reason)


def _timed_steps(
    exp: Experiment,
    started: Measurement,
    spec: Any,
    precision: Any,
    device: Any,
    group: Collectives,
    phase: PhaseHook,
) -> Measurement:
    import torch

    tr, config = exp.trial, started.config

    def stop(verdict: memory.Verdict) -> Measurement:
        return dataclasses.replace(started, status=verdict[0], reason=verdict[1])

    # 1. the model, its optimizer and this process's samples (one process: the busiest
    # device's P), made once, outside the timing; a failure here is agreed on
    sizes = rank_micro_batches(config, group.rank)
    failure = None
    try:
        module = group.place(spec.module, device)  # sharded: this rank's shard only
        module.train()
        batches = split_batch(rank_batch(spec, config, group, device, seed=exp.search.seed), sizes)
        if tr.compile and tr.dynamic:
            _mark_batch_dynamic(batches)
        # counted once, eagerly, before compiling and outside the timing (sharded: below,
        # once every rank is built, as its forward pass all-gathers)
        if not group.sharded:
            flops_per_sample = count_flops_per_sample(spec.loss_fn, module, batches[0], sizes[0])
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    except Exception as e:
        failure = e
    verdict = group.agree(failure)
    if verdict:
        return stop(verdict)

    wrapped = group.data_parallel(module)
    if group.sharded:  # its blocks compiled one by one as it was placed
        flops_per_sample = count_flops_per_sample(spec.loss_fn, module, batches[0], sizes[0])
    model = _compile(wrapped, tr) if tr.compile and not group.sharded else wrapped
    # each micro-batch's mean loss is weighted by its share of the process's samples; DDP
    # averages over the ranks, so there a share is of B / n (uneven ranks included)
    alone = group.world_size == 1 or group.simulated  # rank 0 of N alone: its own samples
    total = sum(sizes) if alone else config.batch_size / group.world_size
    step_loss = StepLoss(spec.loss_fn, total=total)  # unscaled: inside fp16's scaler
    loss_fn = precision.loss(step_loss)

    def local_step(first: bool = False) -> None:
        """A step without DDP's all-reduce (FSDP communicates in every pass: no step of
        it is local). ``first``: the step that compiles and allocates learns nothing (its
        gradients are zeroed before the optimizer's step, whose state it allocates), so
        that every trial's timed steps start from the same weights: with ddp the ranks'
        local gradients differ, and one process, ddp and fsdp give one loss."""
        if group.sharded:
            synced_step(loss_fn, model, batches, total=total,
                        no_sync=lambda: group.no_sync(wrapped))  # fmt: skip
        else:
            with group.no_sync(wrapped):
                accumulate_gradients(loss_fn, model, batches, total=total)
        if first:
            optimizer.zero_grad(set_to_none=False)
        _optimizer_step(precision, optimizer)

    def step() -> None:
        synced_step(loss_fn, model, batches, total=total, no_sync=lambda: group.no_sync(wrapped))
        _optimizer_step(precision, optimizer)

    timed = device_timer(torch, device)
    budget = memory.memory_budget(torch, device, tr.device_memory)

    def over() -> str | None:
        return memory.over_budget(tr, budget, memory.peak_memory(torch, device))

    with _fallback_watch() as fallback:
        # 2. the first step, local: it compiles every micro-batch shape of this split and
        # allocates every buffer (the optimizer's state too); agreed on
        phase("compiling" if tr.compile else "first step", 0, 0)
        first = None
        try:
            first = timed(lambda: local_step(first=True))
        except Exception as e:
            if group.sharded and not group.simulated:
                raise  # the other ranks wait in FSDP's collectives: no agreeing here
            failure = e
        verdict = group.agree(failure)
        if verdict:
            return stop(verdict)
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
                timed(step)
                continue
            if i == tr.warmup_steps:
                retries_before = memory.alloc_retries(torch, device)
            phase("timing", i + 1 - tr.warmup_steps, tr.measure_steps)
            step_loss.reset()
            steps.append(timed(step))
            last_loss = step_loss.value
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
                compute.append(timed(local_step))
        # 5. forward-only over the same micro-batches (no collective in it)
        eval_s = _eval_time(loss_fn, model, batches, timed) if tr.eval and not verdict else None
    peak = memory.peak_memory(torch, device)
    verdict = verdict or group.agree(None, memory.over_budget(tr, budget, peak))
    # 6. ddp: the gradient sync alone, of the gradient's bytes as one buffer (DDP's
    # all-reduce; sharded: FSDP's all-gather and reduce-scatter)
    grad_bytes = gradient_bytes(module)
    comm: list[float] = []
    if not group.simulated and verdict is None:
        params = [p for p in module.parameters() if p.requires_grad]
        dtype = params[0].dtype if params else torch.float32
        itemsize = torch.empty((), dtype=dtype).element_size()
        if group.sharded:  # unit by unit: a buffer of the whole model may not fit
            flat = group.timing_buffer(dtype, device)
        else:
            flat = torch.zeros(grad_bytes // itemsize, dtype=dtype, device=device)
        for _ in range(tr.measure_steps):
            group.agree(None)  # a barrier: every rank starts the all-reduce together
            comm.append(timed(lambda: group.sync_gradients(flat)))

    loss = mean_loss(last_loss, group)
    if verdict is None and loss is not None and not math.isfinite(loss):
        verdict = ("error", f"non-finite loss: {loss} in the last timed step (fp16 overflow "
                   "or a broken model)")  # fmt: skip

    # every figure is the slowest rank's (one collective for all of them)
    reserved = memory.peak_reserved(torch, device)
    n, m, c = len(steps), len(compute), len(comm)
    tail = [eval_s or 0.0, float(peak or 0), float(reserved or 0), float(retries or 0)]
    slowest = group.slowest([first or 0.0, *steps, *compute, *comm, *tail])
    return dataclasses.replace(
        started,
        status=verdict[0] if verdict else "ok",
        reason=verdict[1] if verdict else None,
        first_s=slowest[0],
        step_s=tuple(slowest[1 : 1 + n]),
        compute_s=tuple(slowest[1 + n : 1 + n + m]),
        comm_s=None if group.simulated else tuple(slowest[1 + n + m : 1 + n + m + c]),
        grad_bytes=grad_bytes,
        fsdp_units=getattr(group, "unit_bytes", ()) if group.simulated else (),
        eval_s=slowest[-4] or None,
        peak_memory_bytes=None if peak is None else int(slowest[-3]),
        peak_reserved_bytes=None if reserved is None else int(slowest[-2]),
        alloc_retries=None if retries is None else int(slowest[-1]),
        flops_per_sample=flops_per_sample,
        compile_fallback=fallback.reason,
        loss=loss if loss is not None and math.isfinite(loss) else None,
    )


def _optimizer_step(precision: Any, optimizer: Any) -> None:
    precision.step(optimizer)
    optimizer.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------
# the microbatched step


def build_spec(exp: Experiment, config: BatchConfig, *, meta: bool = False) -> Any:
    """The model of ``exp`` as ``config`` runs it: seeded, and with activation
    checkpointing where the configuration has it (a simulated trial and a ddp rank alike).
    ``meta``: built on torch's meta device, no memory and no values (a sharded rank
    materializes only its shard: mbtune.trial.sharding)."""
    import torch

    from mbtune.models.build import build_from_config

    with torch.device("meta") if meta else contextlib.nullcontext():
        return build_from_config(
            exp.model,
            seed=exp.search.seed,
            activation_checkpointing=config.activation_checkpointing,
        )


def full_batch_if_mixing(spec: Any, config: BatchConfig) -> tuple[BatchConfig, str | None]:
    """A model that mixes the samples of a batch (BatchNorm) is measured at m = P: its
    gradient depends on the micro-batch, so accumulation would train another model."""
    if not spec.mixes_batch or config.grad_accum_steps == 1:
        return config, None
    note = (
        f"{spec.mixes_batch}; measured at micro_batch_size {config.per_device_batch} "
        "(no accumulation) instead"
    )
    return dataclasses.replace(config, micro_batch_size=config.per_device_batch), note


def rank_micro_batches(config: BatchConfig, rank: int) -> list[int]:
    """The micro-batches rank ``rank`` runs per step: its share of B (the even split over
    the ranks) spread evenly over the configuration's g micro-batches (fewer where the
    share has fewer samples than g). Rank 0 has the busiest device's: P in g micro-batches."""
    share = config.device_batch_sizes[rank]
    return even_split(share, min(config.grad_accum_steps, share))


def rank_batch(
    spec: Any, config: BatchConfig, group: Collectives, device: Any, *, seed: int
) -> Any:
    """This process's samples of a step, drawn under ``seed``. One process draws its P
    samples (with n = 1 the global batch); a rank of several draws the whole global batch of
    B and keeps its own rows (the even split, rank 0's first), so that a step sees the same
    B samples however many ranks share them: the loss of one seed and B is the same with 1
    process and with n. The rows are copied, and the rest freed before anything is timed."""
    import torch

    torch.manual_seed(seed)
    if group.world_size == 1:
        return spec.make_batch(sum(rank_micro_batches(config, group.rank)), device)
    shares = config.device_batch_sizes
    start = sum(shares[: group.rank])
    mine = slice_batch(
        spec.make_batch(config.batch_size, device), start, start + shares[group.rank]
    )
    for t in batch_tensors(mine):
        t.set_(t.clone())  # storage of its own: the global batch is freed with this frame
    return mine


class StepLoss:
    """A loss function that also adds up one step's loss as its micro-batches' weighted
    means (each by its share of ``total``, as the gradients are): detached and on the
    device, so no step waits for it. Wrapped by the precision's scaler, it sees the loss
    unscaled."""

    def __init__(self, loss_fn: Callable, *, total: float) -> None:
        self.loss_fn, self.total = loss_fn, total
        self.value: Any = None
        """The step's loss so far: a tensor, or None before its first micro-batch."""

    def __call__(self, model: Any, batch: Any) -> Any:
        loss = self.loss_fn(model, batch)
        share = loss.detach().float() * (num_samples(batch) / self.total)
        self.value = share if self.value is None else self.value + share
        return loss

    def reset(self) -> None:
        self.value = None


def mean_loss(step_loss: Any, group: Collectives) -> float | None:
    """A step's mean loss over every process's samples: this process's weighted sum (a
    :class:`StepLoss`'s value) summed over the ranks and divided by their number (with ddp
    each rank's shares are of B / n, so this is the global batch's mean). Every rank calls
    it (a collective); None where no step was timed."""
    import torch

    if step_loss is None:
        return None
    value = step_loss.detach().to(torch.float64).reshape(1)
    group.all_reduce(value)
    return value.item() / (1 if group.simulated else group.world_size)


def accumulate_gradients(
    loss_fn: Callable, model: Any, batches: list[Any], *, total: float | None = None
) -> None:
    """One forward/backward pass per micro-batch, each mean loss weighted by its share.

    The weighted means sum to the mean loss of the whole per-device batch, so the
    accumulated gradient equals the full-batch gradient, uneven micro-batches included.
    ``total``: the samples the shares are of (default: these batches' own); a ddp rank
    passes B / n, so that DDP's average over ranks is the mean over all B samples.
    Each micro-batch reaches ``loss_fn`` in the form ``make_batch`` returned.
    """
    if total is None:
        total = sum(num_samples(batch) for batch in batches)
    for batch in batches:
        (loss_fn(model, batch) * (num_samples(batch) / total)).backward()


def synced_step(
    loss_fn: Callable,
    model: Any,
    batches: list[Any],
    *,
    total: float,
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]],
) -> None:
    """One step's gradients: every micro-batch but the last under ``no_sync()`` (DDP's:
    gradients accumulate locally), the last without, whose backward pass all-reduces the
    accumulated gradients once. ``total``: as :func:`accumulate_gradients`'."""
    *first, last = batches
    with no_sync():
        accumulate_gradients(loss_fn, model, first, total=total)
    accumulate_gradients(loss_fn, model, [last], total=total)


def gradient_bytes(module: Any) -> int:
    """The bytes one all-reduce of ``module``'s gradients moves (trainable parameters)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


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


def _eval_time(loss_fn: Callable, model: Any, batches: list[Any], timed: Callable) -> float:
    """Median time of a forward-only pass over the same micro-batches."""
    import torch

    def forward() -> None:
        with torch.no_grad():
            for batch in batches:
                loss_fn(model, batch)

    timed(forward)  # compiles the no-grad graph
    return statistics.median(timed(forward) for _ in range(3))


# ---------------------------------------------------------------------------
# compiling


def _compile(module: Any, tr: Any) -> Any:
    # trial.dynamic marks only the batch dimension dynamic (see _mark_batch_dynamic), which
    # compiles one graph for every micro-batch size; dynamic=True would also make every
    # other size symbolic and merge equal ones ("duck sizing"), so a micro-batch size that
    # happens to equal seq_len would get a graph of its own
    import torch

    return torch.compile(module, mode=tr.compile_mode, dynamic=None if tr.dynamic else False)


def _mark_batch_dynamic(batches: list[Any]) -> None:
    """Mark the sample dimension of every tensor of every micro-batch dynamic, whatever the
    batch's form (a tensor, a sequence or a mapping of tensors)."""
    import torch

    for batch in batches:
        for t in batch_tensors(batch):
            torch._dynamo.mark_dynamic(t, 0)


class _FallbackWatch(logging.Handler):
    """Catches torch._dynamo's warning that it hit the recompile limit and ran eager."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reason: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "hit config." in message and self.reason is None:
            limit = re.search(r"hit config\.(\w+) \((\d+)\)", message)
            what = f"{limit[1]} ({limit[2]})" if limit else "a recompile limit"
            self.reason = (
                f"torch.compile hit {what} and ran the model eagerly; set trial.dynamic: true "
                "to compile once for every micro-batch size"
            )


@contextlib.contextmanager
def _fallback_watch() -> Iterator[_FallbackWatch]:
    watch = _FallbackWatch()
    logger = logging.getLogger("torch._dynamo")
    logger.addHandler(watch)
    try:
        yield watch
    finally:
        logger.removeHandler(watch)
