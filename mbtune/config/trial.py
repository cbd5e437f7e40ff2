"""The trial section, ``trial:``: how one configuration is measured (the backend, the
device, ``parallel`` and ``sharding``, compiling, the steps, memory, the modelled link,
precision, the settings of a step), a frozen keyword-only dataclass with its rules, as
mbtune.config.schema states the others; and how a trial ends (``STATUSES``).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from mbtune.config.rules import ConfigError, check_fields, memory, number
from mbtune.lattice import GRAD_SYNCS, GradSync, PipelineSchedule

__all__ = [
    "BACKENDS",
    "COMPILE_MODES",
    "CUDA_ONLY_PRECISIONS",
    "DEFAULT_MEMORY_HEADROOM",
    "DEVICES",
    "LINKS",
    "MAX_MEMORY_HEADROOM",
    "ON_OOM",
    "PARALLEL",
    "PRECISIONS",
    "STATUSES",
    "TrialConfig",
    "unsharded_rule",
]

Backend = Literal["torch", "replay"]
Device = Literal["auto", "cpu", "cuda"]
Parallel = Literal["simulate", "ddp"]
Sharding = Literal["none", "fsdp"]
Precision = Literal["auto", "fp32", "tf32", "bf16", "fp16"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
OnOom = Literal["fail", "halve"]
TrialStatus = Literal["ok", "oom", "error", "timeout"]
"""How a trial ends: measured, out of memory, failed, or still running at its timeout. A
replay table (``trial.table``) gives one per row, as trials.csv does; every room reads
them from here (the config is the one room the trial, the runs and the analysis share)."""

BACKENDS = typing.get_args(Backend)
DEVICES = typing.get_args(Device)
PARALLEL = typing.get_args(Parallel)
PRECISIONS = typing.get_args(Precision)
COMPILE_MODES = typing.get_args(CompileMode)
ON_OOM = typing.get_args(OnOom)
STATUSES = typing.get_args(TrialStatus)
CUDA_ONLY_PRECISIONS = ("tf32", "fp16")
"""TF32 matmuls and fp16 with a gradient scaler exist on CUDA only; bf16 autocast runs on
the CPU too."""
DEFAULT_MEMORY_HEADROOM = 0.05
"""The share of a known memory budget a configuration must leave free to count as fitting:
allocator fragmentation grows over hours of training (trial.memory_headroom)."""
MAX_MEMORY_HEADROOM = 0.99
"""A larger headroom leaves no memory to measure anything in."""
LINKS = {"cpu": (1_850_000_000, 210.0), "cuda": (25 * 10**9, 10.0)}
"""The modelled all-reduce's link (bytes/s, latency per hop in microseconds) when the
experiment sets none. cpu: gloo between two processes on one host, fitted to measured
all-reduces (bench/allreduce_model.py, docs/benchmarks.md); cuda: one link of a GPU
interconnect (not measured: no GPU was at hand)."""


@dataclass(frozen=True, kw_only=True)
class TrialConfig:
    """How one configuration is measured: ``trial:``."""

    backend: Backend = "torch"
    """``torch`` (measure a real model) or ``replay`` (answer from ``table``)."""
    table: Path | None = None
    """CSV of measured throughputs, for the replay backend."""
    noise: float = number(0.0, minimum=0.0, maximum=1.0)
    """Relative noise added to each replayed step time (0.03 = 3%)."""
    drift: float = number(0.0, minimum=0.0, below=1.0)
    """Replay only: the relative sd of one seeded multiplicative factor drawn per replayed
    trial, on top of ``noise`` per step (0.035 = 3.5%), as a real machine drifts between
    trials; 0 <= drift < 1."""
    device: Device = "auto"
    """``auto`` (CUDA where there is one), ``cpu`` or ``cuda``."""
    parallel: Parallel = "simulate"
    """``simulate`` (one device's share plus a modelled all-reduce; with ``sharding: fsdp``
    rank 0's shard plus modelled all-gathers and reduce-scatters) or ``ddp`` (a Ray Train
    run of num_devices DistributedDataParallel workers; see mbtune.trial.ddp)."""
    sharding: Sharding = "none"
    """``none`` (every device holds the whole model) or ``fsdp`` (each ddp worker holds its
    shard: PyTorch's FSDP2, one unit per block; see mbtune.trial.sharding). With
    ``parallel: simulate``, rank 0 of N runs alone on torch's fake process group: its shard,
    memory and compute real, its all-gathers and reduce-scatters modelled from the link."""
    compile: bool = True
    """Compile the model with torch.compile; compile time is reported apart."""
    compile_mode: CompileMode = "default"
    """torch.compile's mode: ``default``, ``reduce-overhead``, ``max-autotune``, ..."""
    dynamic: bool = False
    """Compile once for every micro-batch size (a dynamic batch dimension)."""
    warmup_steps: int = number(2, minimum=0)
    """Untimed steps before the timed ones (compilation happens in the first)."""
    measure_steps: int = number(5)
    """Timed optimizer steps per trial."""
    eval: bool = False
    """Also measure forward-only (evaluation) throughput at the same micro-batch size."""
    device_memory: int | None = memory()
    """Memory budget per device in bytes (YAML: ``8GiB``, ``512MB`` or bytes); above it: oom."""
    on_oom: OnOom = "fail"
    """``fail`` (record oom) or ``halve`` (Composer: halve the micro-batch and retry)."""
    link_bandwidth: int | None = memory()
    """Bytes/s of one link of the modelled ring all-reduce (YAML: ``25GB`` or bytes);
    None: :data:`LINKS` for the trial's device."""
    link_latency_us: float | None = number(None, minimum=0.0)
    """Latency of one hop of the modelled ring all-reduce, in microseconds; None:
    :data:`LINKS` for the trial's device."""
    precision: Precision = "auto"
    """The arithmetic of the step: ``auto`` (bf16 autocast on a CUDA device that supports
    it, else fp32), ``fp32``, ``tf32`` (fp32 with TF32 matmuls; CUDA), ``bf16`` (autocast,
    fp32 master weights; CPU too) or ``fp16`` (autocast with a gradient scaler; CUDA)."""
    activation_checkpointing: bool = False
    """Recompute the model's blocks' activations in the backward pass (memory for
    compute); ``search.space.activation_checkpointing`` searches over it instead."""
    reshard_after_forward: bool | None = None
    """``sharding: fsdp`` only: free each block's gathered parameters after its forward
    pass and gather them again for the backward (true, FSDP2's default: ZeRO-3-like), or
    keep them until the backward (false: ZeRO-2-like, more memory, less all-gather traffic);
    None: true. ``search.space.reshard_after_forward`` searches over it instead."""
    grad_sync: GradSync | None = None
    """``sharding: fsdp`` only: reduce-scatter the gradients once per step, in the last
    micro-batch's backward pass (``last``), or in every micro-batch's (``every``: less peak
    memory, more traffic); None: last. ``search.space.grad_sync`` searches over it instead."""
    pipeline_schedule: PipelineSchedule = "1f1b"
    """How a pipeline (``train_input.pipeline_parallel`` > 1) orders its micro-batches:
    ``gpipe``, ``1f1b`` (the default), ``interleaved_1f1b``, ``zbv`` or ``dualpipev``
    (mbtune.lattice.PipelineSchedule); ``search.space.pipeline_schedule`` searches over it
    instead."""
    peak_tflops: float | None = number(None, positive=True)
    """The device's peak TFLOP/s for the trial's precision, for ``mfu``; None: from the
    table of known devices (mbtune.trial.flops), or no mfu where the device is not in it."""
    memory_headroom: float | None = number(None, minimum=0.0, maximum=MAX_MEMORY_HEADROOM)
    """The share of the memory budget a configuration must leave free to fit; None:
    DEFAULT_MEMORY_HEADROOM where a budget is known (trial.device_memory, or a CUDA
    card's memory), else 0."""
    timeout_s: float = number(600.0, minimum=1.0)
    """A trial still running after this many seconds is stopped and recorded as timeout."""

    def __post_init__(self) -> None:
        check_fields(self, "trial")
        if self.device == "cpu" and self.precision in CUDA_ONLY_PRECISIONS:
            raise ConfigError(
                "trial.precision",
                f"{self.precision} runs on CUDA only, and trial.device is cpu; use bf16 or "
                "fp32 on the CPU (or auto)",
            )
        for key in ("reshard_after_forward", "grad_sync"):
            if getattr(self, key) is not None and self.sharding != "fsdp":
                raise ConfigError(f"trial.{key}", unsharded_rule(key, self.sharding))
        if self.sharding == "fsdp" and self.precision == "fp16":
            # fp16's gradient scaler must agree on an overflow across the shards, which the
            # trial's plain GradScaler does not
            raise ConfigError(
                "trial.precision",
                "fp16 with trial.sharding: fsdp is not measured (its gradient scaler would "
                "not agree across the shards); use bf16, or sharding: none",
            )
        if self.drift and self.table is None:
            raise ConfigError(
                "trial.drift",
                f"drift {self.drift:g} applies to replayed trials only, and trial.table is not "
                "set; set trial.backend: replay with trial.table, or drift: 0",
            )

    @property
    def settings(self) -> tuple[bool, bool, str]:
        """The trial's own settings of a step (mbtune.lattice.BatchConfig.settings), for a
        space that lists none of them."""
        return (
            self.activation_checkpointing,
            True if self.reshard_after_forward is None else self.reshard_after_forward,
            self.grad_sync or "last",
        )

    def headroom(self, budget: int | None) -> float:
        """``memory_headroom`` resolved for a budget (None: no budget is known)."""
        if self.memory_headroom is not None:
            return self.memory_headroom
        return DEFAULT_MEMORY_HEADROOM if budget else 0.0

    def link(self, device_type: str) -> tuple[int, float]:
        """(bytes/s, latency in seconds) of the modelled link for a ``cpu`` or ``cuda`` trial."""
        bandwidth, latency_us = LINKS["cuda" if device_type == "cuda" else "cpu"]
        if self.link_bandwidth is not None:
            bandwidth = self.link_bandwidth
        if self.link_latency_us is not None:
            latency_us = self.link_latency_us
        return bandwidth, latency_us * 1e-6


def unsharded_rule(key: str, sharding: str) -> str:
    """Why ``key`` (reshard_after_forward, grad_sync) cannot be set with ``sharding``."""
    valid = "true or false" if key == "reshard_after_forward" else " or ".join(GRAD_SYNCS)
    return (
        f"{key} ({valid}) applies to sharded trials only, and trial.sharding is {sharding}; "
        f"set trial.sharding: fsdp (with trial.parallel: ddp), or leave {key} out"
    )
