"""One trial: build, compile, warm up and time a microbatched training step.

The trial is the measuring instrument of the whole tool. It follows docs/design.md's trial
protocol: one optimizer step = g forward/backward passes over micro-batches that differ
by at most one sample, each loss scaled by (micro-batch samples / P) so the accumulated
gradient equals the full-batch one, then the gradient all-reduce, then the optimizer
step. With ``trial.parallel: simulate`` one device's share is measured and the all-reduce
is modelled (:func:`ring_allreduce_s`); with ``ddp`` every device is a real process of a
Ray Train run and the all-reduce is PyTorch's (:mod:`mbtune.ddp`). Compile time is
measured on its own and never mixed into throughput; every step time is kept.

Out of memory is a result (status ``oom``), not a crash. Bad input (a model that does not
import, a CUDA device that does not exist, a replay table without the right columns)
raises :class:`~mbtune.errors.MbtuneError`.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import gc
import itertools
import logging
import os
import random
import re
import signal
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mbtune import lattice
from mbtune.config import Experiment
from mbtune.errors import MbtuneError
from mbtune.flops import count_flops_per_sample, device_peak, utilisation
from mbtune.lattice import BatchConfig
from mbtune.precision import for_device

__all__ = [
    "STATUSES",
    "PhaseHook",
    "ReplayTable",
    "TrialRequest",
    "TrialResult",
    "accumulate_gradients",
    "build_spec",
    "memory_budget",
    "resolve_device",
    "ring_allreduce_s",
    "run_trial",
    "split_batch",
    "trial_metrics",
]

STATUSES = ("ok", "oom", "error", "timeout")


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
    per_device_batch: int
    grad_accum_steps: int
    micro_batches: tuple[int, ...] = ()
    """The micro-batches one device runs per step, e.g. (4, 4) or (3, 2, 2)."""
    pipeline_stages: int = 1
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
    """Ring all-reduce time per step (zero on one device): modelled with ``simulate``;
    with ``ddp`` the median of standalone all-reduces of the gradient's bytes, measured."""
    bubble_time_ms: float = 0.0
    """Modelled pipeline bubble per step (zero without pipeline stages)."""
    compile_s: float | None = None
    """Compile time: first steps minus their share of steady-state time; None: not compiled."""
    compile_fallback: str | None = None
    """Why compilation silently fell back to eager (recompile limit), if it did."""
    flops_per_sample: float | None = None
    """Model FLOPs of one sample's step (mbtune.flops: 3 x the counted forward pass)."""
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
    micro_batch_sizes_tried: tuple[int, ...] = ()
    """Every micro-batch size tried, in order (more than one after halving on OOM)."""
    device: str = "cpu"
    backend: str = "torch"
    parallel: str = "simulate"
    """``simulate`` (one device measured, all-reduce modelled) or ``ddp`` (every device a
    real process: step times, compute and all-reduce all measured)."""
    reason: str | None = None
    """Why the status is not ok, in one line."""
    note: str | None = None
    """Something the user should know about the measurement (e.g. batch mixing)."""
    wall_s: float = 0.0
    """Wall time of the whole trial, build and compile included."""

    @property
    def config(self) -> BatchConfig:
        return BatchConfig(
            self.batch_size, self.num_devices, self.micro_batch_size, self.activation_checkpointing
        )

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["micro_batches"] = list(self.micro_batches)
        d["step_times_ms"] = list(self.step_times_ms)
        d["micro_batch_sizes_tried"] = list(self.micro_batch_sizes_tried)
        return d


def ring_allreduce_s(
    grad_bytes: int, num_devices: int, bandwidth: float, latency_s: float
) -> float:
    """Time of a ring all-reduce of ``grad_bytes`` over ``num_devices``.

    A ring all-reduce is a reduce-scatter then an all-gather, each n - 1 steps that move
    S / n bytes per link: t = 2 (n - 1) / n * S / bandwidth + 2 (n - 1) * latency.
    """
    if num_devices <= 1:
        return 0.0
    n = num_devices
    return 2 * (n - 1) / n * grad_bytes / bandwidth + 2 * (n - 1) * latency_s


PhaseHook = Callable[[str, int, int], None]
"""``on_phase(phase, done, total)``: told as a trial moves through its phases: ``building``,
``compiling`` (the first step, which compiles), ``warm-up`` and ``timing`` (``done`` of
``total`` steps), ``replaying``, ``starting workers`` (ddp). ``done``/``total`` are 0
where a phase has no steps to count."""


@dataclass(frozen=True, kw_only=True)
class TrialRequest:
    """What a search asks of one trial process (``python -m mbtune.trial``), pickled on its
    stdin by mbtune.launch."""

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
    phase = on_phase or _no_phase
    started = time.perf_counter()
    tried: list[int] = []
    while True:
        tried.append(config.micro_batch_size)
        if exp.trial.backend == "torch" and exp.trial.parallel == "ddp":
            from mbtune.ddp import measure_ddp

            phase("starting workers", 0, 0)
            # ddp keeps its own deadline: its workers stop themselves at timeout_s, where an
            # alarm here would leave them running
            result = measure_ddp(exp, config, cwd=cwd or os.getcwd())
        elif exp.trial.backend == "replay":
            result = _with_timeout(
                exp.trial.timeout_s, lambda c=config: _replay(exp, c, repeat, phase)
            )
        else:
            result = _with_timeout(
                exp.trial.timeout_s, lambda c=config: _measure_torch(exp, c, phase)
            )
        if result is None:
            result = dataclasses.replace(
                _base_result(exp, config, device=exp.trial.device, note=None),
                status="timeout",
                reason=f"still running after trial.timeout_s = {exp.trial.timeout_s:g} s",
            )
        if result.status != "oom" or exp.trial.on_oom != "halve" or config.micro_batch_size == 1:
            break
        config = dataclasses.replace(config, micro_batch_size=config.micro_batch_size // 2)
    return dataclasses.replace(
        result, micro_batch_sizes_tried=tuple(tried), wall_s=time.perf_counter() - started
    )


# ---------------------------------------------------------------------------
# the torch backend


def _no_phase(phase: str, done: int, total: int) -> None:
    pass


def _measure_torch(exp: Experiment, config: BatchConfig, phase: PhaseHook) -> TrialResult:
    phase("building", 0, 0)
    import torch

    tr = exp.trial
    # the CPUs the trial holds, whoever runs it: a search's trial process (Ray sets
    # OMP_NUM_THREADS from them) and `mbtune trial` then measure the same thing
    torch.set_num_threads(exp.cpu_threads)
    device = resolve_device(tr.device)
    precision = for_device(tr.precision, device)
    spec = build_spec(exp, config)
    config, note = full_batch_if_mixing(spec, config)
    base = dataclasses.replace(
        _base_result(exp, config, device=str(device), note=note), precision=precision.name
    )
    try:
        return _timed_steps(exp, config, spec, device, precision, base, phase)
    except Exception as exc:  # a failed trial is a recorded result
        oom = _find_oom(exc)
        if oom is not None:
            return dataclasses.replace(base, status="oom", reason=_one_line(oom))
        return dataclasses.replace(base, status="error", reason=_one_line(exc))
    finally:
        _release(torch, device)


def build_spec(exp: Experiment, config: BatchConfig) -> Any:
    """The model of ``exp`` as ``config`` runs it: seeded, and with activation
    checkpointing where the configuration has it (a simulated trial and a ddp rank alike)."""
    from mbtune.models import build_model

    return build_model(
        exp.model.name,
        exp.model.options,
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


def split_batch(data: Any, sizes: list[int]) -> list[Any]:
    """Consecutive micro-batches of the given sizes, each in the form of ``data`` (a
    tensor, a tuple or list of tensors, or a mapping of names to tensors; see
    mbtune.batch): views of ``data``, no copies."""
    from mbtune.batch import slice_batch  # pure, like this module

    bounds = [0, *itertools.accumulate(sizes)]
    return [slice_batch(data, a, b) for a, b in itertools.pairwise(bounds)]


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
    from mbtune.batch import num_samples

    if total is None:
        total = sum(num_samples(batch) for batch in batches)
    for batch in batches:
        (loss_fn(model, batch) * (num_samples(batch) / total)).backward()


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


def _timed_steps(
    exp: Experiment,
    config: BatchConfig,
    spec: Any,
    device: Any,
    precision: Any,
    base: TrialResult,
    phase: PhaseHook,
) -> TrialResult:
    import torch

    tr = exp.trial
    torch.manual_seed(exp.search.seed)
    module = spec.module.to(device)
    module.train()
    # Synthetic data for the busiest device (P samples), made once, outside the timing.
    data = spec.make_batch(config.per_device_batch, device)
    batches = split_batch(data, config.micro_batch_sizes)
    if tr.compile and tr.dynamic:
        _mark_batch_dynamic(batches)
    # counted once, eagerly, before compiling and outside the timing
    flops_per_sample = count_flops_per_sample(
        spec.loss_fn, module, batches[0], config.micro_batch_sizes[0]
    )
    model = _compile(module, tr) if tr.compile else module
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
    grad_bytes = gradient_bytes(module)
    loss_fn = precision.loss(spec.loss_fn)

    def step() -> None:
        accumulate_gradients(loss_fn, model, batches)
        precision.step(optimizer)
        optimizer.zero_grad(set_to_none=True)

    timed = device_timer(torch, device)

    with _fallback_watch() as fallback:
        phase("compiling" if tr.compile else "first step", 0, 0)
        first = timed(step)  # compiles every micro-batch shape of this split
        _reset_peak(torch, device)
        for k in range(tr.warmup_steps):
            phase("warm-up", k + 1, tr.warmup_steps)
            timed(step)
        retries_before = _alloc_retries(torch, device)
        compute = []
        for k in range(tr.measure_steps):
            phase("timing", k + 1, tr.measure_steps)
            compute.append(timed(step))
        retries = _alloc_retries(torch, device)
        eval_s = _eval_time(loss_fn, model, batches, timed) if tr.eval else None
    peak = _peak_memory(torch, device)

    p = max(1, exp.train_input.pipeline_stages)
    comm = ring_allreduce_s(grad_bytes // p, config.num_devices, *tr.link(device.type))
    # a pipeline of p stages: each stage does 1/p of the work of every micro-batch, and the
    # p - 1 fill/drain slots idle: bubble = (p - 1) / g of the ideal time
    bubble_share = lattice.bubble_fraction(p, config.grad_accum_steps)
    steps = [c / p * (1 + bubble_share) + comm for c in compute]
    compute_median = statistics.median(compute)
    result = _with_step_times(base, config, steps)
    over = _over_budget(tr, memory_budget(torch, device, tr.device_memory), peak)
    tflops, mfu = utilisation(
        flops_per_sample,
        result.samples_per_s,
        config.num_devices,
        device_peak(device, precision.name, tr.peak_tflops),
    )
    if retries is not None:
        retries -= retries_before
    return dataclasses.replace(
        result,
        status="oom" if over else "ok",
        reason=over,
        note=_join(result.note, _retry_note(retries)),
        flops_per_sample=flops_per_sample,
        tflops_per_s=tflops,
        mfu=mfu,
        peak_reserved_bytes=_peak_reserved(torch, device),
        alloc_retries=retries,
        tokens_per_s=result.samples_per_s * spec.tokens_per_sample
        if spec.tokens_per_sample
        else None,
        compute_time_ms=compute_median / p * 1e3,
        comm_time_ms=comm * 1e3,
        bubble_time_ms=compute_median / p * bubble_share * 1e3,
        compile_s=max(0.0, first - compute_median) if tr.compile else None,
        compile_fallback=fallback.reason,
        peak_memory_bytes=peak,
        eval_samples_per_s=config.batch_size / eval_s if eval_s else None,
    )


def gradient_bytes(module: Any) -> int:
    """The bytes one all-reduce of ``module``'s gradients moves (trainable parameters)."""
    return sum(p.numel() * p.element_size() for p in module.parameters() if p.requires_grad)


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

    from mbtune.batch import batch_tensors

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


# ---------------------------------------------------------------------------
# memory


def _reset_peak(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):  # Linux: "5" resets the peak resident set size
        Path("/proc/self/clear_refs").write_text("5")


def _peak_memory(torch: Any, device: Any) -> int | None:
    """CUDA: the allocator's peak; CPU: this process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) * 1024  # type: ignore[index]
    except (OSError, TypeError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _peak_reserved(torch: Any, device: Any) -> int | None:
    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None


def _alloc_retries(torch: Any, device: Any) -> int | None:
    """CUDA: how often the allocator has freed its cache to retry an allocation so far."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def _retry_note(retries: int | None) -> str | None:
    if not retries:
        return None
    return (
        f"the CUDA allocator freed its cache and retried {retries} time(s) during the timed "
        "steps: this configuration is at the edge of memory and may slow down or fail later "
        "in training"
    )


def memory_budget(torch: Any, device: Any, device_memory: int | None) -> int | None:
    """The memory a trial must fit in: ``trial.device_memory``, else on CUDA the card's
    memory, else None (no budget): a simulated trial and a ddp rank alike."""
    if device_memory is not None:
        return device_memory
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return None


def _join(*notes: str | None) -> str | None:
    return "; ".join(n for n in notes if n) or None


def _find_oom(exc: BaseException) -> BaseException | None:
    """The out-of-memory error in ``exc``'s chain (e.g. wrapped by a compile error), if any."""
    import torch

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.OutOfMemoryError | MemoryError) or re.search(
            r"CUDA out of memory|OutOfMemoryError", str(e)
        ):
            return e
        e = e.__cause__ or e.__context__
    return None


def _release(torch: Any, device: Any) -> None:
    """Give CUDA memory back after a trial (an OOM leaves tensors behind in frames).

    Not on the CPU: there the trial's process ends with the trial, and a full collection
    costs ~0.1 s, a fifth of a short eager trial (docs/benchmarks.md).
    """
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------
# the replay backend


class ReplayTable:
    """Measured throughputs read from a CSV: batch_size, num_devices, micro_batch_size,
    samples_per_s, and optionally peak_memory_bytes, status, activation_checkpointing
    (true/false: a configuration of its own) and precision (what was measured)."""

    REQUIRED = ("batch_size", "num_devices", "micro_batch_size", "samples_per_s")
    OPTIONAL = ("peak_memory_bytes", "status", "activation_checkpointing", "precision")

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rows: dict[BatchConfig, dict[str, Any]] = {}
        try:
            with path.open(newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                missing = [c for c in self.REQUIRED if c not in (reader.fieldnames or [])]
                if missing:
                    raise MbtuneError(
                        f"trial.table: {path} lacks the column(s) {', '.join(missing)}; it needs "
                        f"{', '.join(self.REQUIRED)} (optional: {', '.join(self.OPTIONAL)})"
                    )
                for line, row in enumerate(reader, start=2):
                    self._add(row, line)
        except OSError as e:
            raise MbtuneError(f"trial.table: cannot read {path}: {e.strerror}") from None
        except (UnicodeDecodeError, csv.Error) as e:
            raise MbtuneError(f"trial.table: {path} is not a CSV file ({e})") from None

    def _add(self, row: dict[str, str], line: int) -> None:
        try:
            config = BatchConfig.from_mapping(row)
            status = (row.get("status") or "ok").strip()
            speed = float(row["samples_per_s"]) if row["samples_per_s"] not in ("", None) else None
            peak = row.get("peak_memory_bytes")
            entry = {
                "precision": (row.get("precision") or "").strip() or None,
                "status": status,
                "samples_per_s": speed,
                "peak_memory_bytes": int(float(peak)) if peak not in ("", None) else None,
            }
        except (TypeError, ValueError) as e:
            raise MbtuneError(f"trial.table: {self.path} line {line}: {_one_line(e)}") from None
        if status not in STATUSES or (status == "ok" and (speed is None or speed <= 0)):
            raise MbtuneError(
                f"trial.table: {self.path} line {line}: status {status!r} with samples_per_s "
                f"{row['samples_per_s']!r}; status must be one of {', '.join(STATUSES)}, and "
                "an ok row needs a positive samples_per_s"
            )
        self.rows[config] = entry

    def lookup(self, config: BatchConfig) -> dict[str, Any]:
        row = self.rows.get(config) or self.rows.get(config.canonical())
        if row is None:
            raise MbtuneError(
                f"trial.table: {self.path} has no row for batch_size {config.batch_size}, "
                f"num_devices {config.num_devices}, micro_batch_size {config.micro_batch_size}"
                f"{', activation_checkpointing true' if config.activation_checkpointing else ''}; "
                f"it holds {len(self.rows)} configurations"
            )
        return row


_TABLES: dict[Path, ReplayTable] = {}
_TABLES_LOCK = threading.Lock()


def _replay(exp: Experiment, config: BatchConfig, repeat: int, phase: PhaseHook) -> TrialResult:
    phase("replaying", 0, 0)
    tr = exp.trial
    assert tr.table is not None  # checked when the experiment was parsed
    with _TABLES_LOCK:
        table = _TABLES.get(tr.table) or _TABLES.setdefault(tr.table, ReplayTable(tr.table))
    row = table.lookup(config)
    base = _base_result(exp, config, device="replay", note=None)
    peak = row["peak_memory_bytes"]
    base = dataclasses.replace(
        base, backend="replay", peak_memory_bytes=peak, precision=row["precision"]
    )
    if row["status"] != "ok":
        return dataclasses.replace(base, status=row["status"], reason="as recorded in the table")
    over = _over_budget(tr, tr.device_memory, peak)
    if over:
        return dataclasses.replace(base, status="oom", reason=over)
    step_s = config.batch_size / row["samples_per_s"] * _drift(exp, config, repeat)
    rng = _step_noise_rng(exp.search.seed, config, repeat)
    steps = [step_s * max(0.05, 1 + tr.noise * rng.gauss(0, 1)) for _ in range(tr.measure_steps)]
    result = _with_step_times(base, config, steps)
    return dataclasses.replace(result, status="ok", compute_time_ms=result.step_time_ms_median)


def _step_noise_rng(seed: int, config: BatchConfig, repeat: int) -> random.Random:
    """The step noise of one replayed trial: seeded per configuration and repeat, so a
    replayed trial is repeatable whatever ran before it, and a repeat draws afresh. A first
    measurement keeps the seed it always had (tests and benchmarks pin its step times)."""
    sizes = (seed, config.batch_size, config.num_devices, config.micro_batch_size)
    return random.Random(hash((*sizes, repeat) if repeat else sizes))


def _drift(exp: Experiment, config: BatchConfig, repeat: int) -> float:
    """The one factor every step of a replayed trial is multiplied by (``trial.drift``), as
    a real machine drifts between trials. From an rng of its own, seeded by text (stable
    across processes, unlike hash() of text), so drift 0 leaves the step noise's draws as
    they were."""
    if not exp.trial.drift:
        return 1.0
    rng = random.Random(
        f"drift/{exp.search.seed}/{config.batch_size}/{config.num_devices}/"
        f"{config.micro_batch_size}/{config.activation_checkpointing}/{repeat}"
    )
    return max(0.05, 1 + exp.trial.drift * rng.gauss(0, 1))


# ---------------------------------------------------------------------------
# shared


def _base_result(
    exp: Experiment, config: BatchConfig, *, device: str, note: str | None
) -> TrialResult:
    return TrialResult(
        status="error",
        batch_size=config.batch_size,
        num_devices=config.num_devices,
        micro_batch_size=config.micro_batch_size,
        activation_checkpointing=config.activation_checkpointing,
        per_device_batch=config.per_device_batch,
        grad_accum_steps=config.grad_accum_steps,
        micro_batches=tuple(config.micro_batch_sizes),
        pipeline_stages=exp.train_input.pipeline_stages,
        device=device,
        backend=exp.trial.backend,
        parallel=exp.trial.parallel,
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


def _over_budget(tr: Any, budget: int | None, peak: int | None) -> str | None:
    """Why the peak memory means out of memory, or None: a configuration fits when its peak
    leaves ``trial.memory_headroom`` of the budget free (``trial.device_memory``, else a
    CUDA card's memory)."""
    if budget is None or peak is None:
        return None
    headroom = tr.headroom(budget)
    usable = budget * (1 - headroom)
    if peak <= usable:
        return None
    source = "trial.device_memory" if tr.device_memory is not None else "the card's memory"
    if peak <= budget:
        return (
            f"peak memory {peak / 2**20:.0f} MiB fits in the budget {source} "
            f"{budget / 2**20:.0f} MiB but leaves less than trial.memory_headroom "
            f"{headroom:g} of it free (at most {usable / 2**20:.0f} MiB)"
        )
    return (
        f"peak memory {peak / 2**20:.0f} MiB is above the budget {source} {budget / 2**20:.0f} MiB"
    )


def _with_timeout(timeout_s: float, fn: Callable[[], TrialResult]) -> TrialResult | None:
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


def _worker_main() -> int:
    """``python -m mbtune.trial``: one trial in a process of its own, for the search.

    Reads a pickled :class:`TrialRequest` on stdin (from mbtune.launch, in the search's own
    trial actor) and prints the result (with the objective) as one JSON line on stdout.
    With ``--phase-fd N``, writes each phase to file descriptor N as it happens
    (mbtune.progress).
    """
    import json
    import pickle
    import sys

    from mbtune.progress import PHASE_FD_FLAG, phase_writer

    request: TrialRequest = pickle.load(sys.stdin.buffer)
    on_phase = None
    if PHASE_FD_FLAG in sys.argv:
        on_phase = phase_writer(int(sys.argv[sys.argv.index(PHASE_FD_FLAG) + 1]))
    metrics = trial_metrics(
        request.experiment, request.config, repeat=request.repeat, on_phase=on_phase
    )
    print(json.dumps(metrics))
    return 0


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


def _one_line(exc: BaseException) -> str:
    """model_options.one_line, cut at 300 characters for a row of trials.csv."""
    from mbtune.model_options import one_line

    text = one_line(exc)
    return text if len(text) <= 300 else text[:297] + "..."


if __name__ == "__main__":
    raise SystemExit(_worker_main())
