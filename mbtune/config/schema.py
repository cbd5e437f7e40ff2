"""The experiment's sections: frozen keyword-only dataclasses, each rule in its class.

Every choice is a ``Literal``, every default is stated once (on its field) and every rule
runs in ``__post_init__``: a section built in code refuses what the YAML refuses, with the
same one-line :class:`~mbtune.config.rules.ConfigError`. mbtune.config.load only turns YAML into
these types; mbtune.config.experiment joins them into an Experiment.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Literal

from mbtune import lattice
from mbtune.config.model_options import (
    MODEL_OPTIONS,
    check_model_name,
    check_options,
    hf_model_type,
    split_hf_options,
    split_user_options,
)
from mbtune.config.rules import (
    Bounds,
    ConfigError,
    check_fields,
    check_number,
    memory,
    number,
    show,
)
from mbtune.lattice import (
    GRAD_SYNCS,
    MAX_CONFIGS,
    SETTINGS,
    BatchConfig,
    GradSync,
    LatticeError,
)

__all__ = [
    "BACKENDS",
    "BUILTIN_MODELS",
    "COMPILE_MODES",
    "CUDA_ONLY_PRECISIONS",
    "DEFAULT_MEMORY_HEADROOM",
    "DEFAULT_SPACE",
    "DEVICES",
    "LINKS",
    "MAX_MEMORY_HEADROOM",
    "OBJECTIVES",
    "ON_OOM",
    "PARALLEL",
    "PRECISIONS",
    "SAMPLERS",
    "STATUSES",
    "INTER_NODE",
    "INTRA_NODE",
    "IntRange",
    "LinkTier",
    "ModelConfig",
    "PlanConfig",
    "RayConfig",
    "SearchConfig",
    "SpaceConfig",
    "StartPoint",
    "TrainInput",
    "TrialConfig",
    "lattice_rule",
    "unsharded_rule",
]

Sampler = Literal["tpe", "gp", "random", "model", "grid", "halving", "doubling"]
Objective = Literal["samples_per_s", "samples_per_s_per_device"]
Backend = Literal["torch", "replay"]
Device = Literal["auto", "cpu", "cuda"]
Parallel = Literal["simulate", "ddp"]
Sharding = Literal["none", "fsdp"]
Precision = Literal["auto", "fp32", "tf32", "bf16", "fp16"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]
OnOom = Literal["fail", "halve"]
MicroBatchMode = Literal["auto", "explore", "none"]
"""lattice.MODES: how a search chooses m when train_input does not fix it."""
TrialStatus = Literal["ok", "oom", "error", "timeout"]
"""How a trial ends: measured, out of memory, failed, or still running at its timeout. A
replay table (``trial.table``) gives one per row, as trials.csv does; every room reads
them from here (the config is the one room the trial, the runs and the analysis share)."""

SAMPLERS = typing.get_args(Sampler)
OBJECTIVES = typing.get_args(Objective)
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
BUILTIN_MODELS = tuple(MODEL_OPTIONS)
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


@contextmanager
def lattice_rule(where: str) -> Iterator[None]:
    """Report a broken lattice rule as a config error at ``where``."""
    try:
        yield
    except LatticeError as e:
        raise ConfigError(where, str(e)) from None


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The model a trial builds: ``model:``."""

    name: str
    """``gpt``, ``mlp``, ``cnn_bn``, ``hf:<model_type>`` for a Hugging Face transformers
    model, or ``package.module:function`` for a user model."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Model-specific keys (every key under ``model:`` but ``name``), checked without
    building the model: a built-in's options, mbtune's own keys of the others."""

    def __post_init__(self) -> None:
        check_fields(self, "model")
        check_model_name(self.name)
        if not isinstance(self.options, Mapping):
            raise ConfigError("model", f"options must be a mapping, got {show(self.options)}")
        if self.is_builtin:
            check_options(self.name, self.options)
        elif hf_model_type(self.name) is not None:
            split_hf_options(self.options)  # the model type and the config's keys: when built
        else:
            split_user_options(self.options)

    @property
    def is_builtin(self) -> bool:
        return self.name in BUILTIN_MODELS


@dataclass(frozen=True, kw_only=True)
class TrainInput:
    """The user's own configuration: the reference for "faster than yours"."""

    batch_size: int = number()
    """Global batch B: samples per optimizer step, all devices together."""
    micro_batch_size: int | MicroBatchMode = number("auto", also="'auto', 'explore' or 'none'")
    """A positive int (use exactly this m), ``none``, ``auto`` or ``explore``."""
    num_devices: int = number(1)
    """Data-parallel devices n (YAML also accepts the Cerebras spelling ``num_csx``)."""
    allow_uneven: bool = False
    """Allow splits that differ by one sample where strict validity would refuse them."""
    pipeline_stages: int = number(1)
    """Pipeline stages p; p > 1 adds Megatron's bubble (p - 1) / micro-batches."""

    def __post_init__(self) -> None:
        check_fields(self, "train_input")
        b, n, m = self.batch_size, self.num_devices, self.micro_batch_size
        fixed = m if isinstance(m, int) else None
        uneven_ok = self.allow_uneven or m == "explore"
        if self.pipeline_stages > 1 and uneven_ok:  # first: what else it says assumes p = 1
            raise ConfigError(
                "train_input.pipeline_stages" if m == "explore" else "train_input.allow_uneven",
                (
                    f"pipeline_stages {self.pipeline_stages} cannot explore uneven micro-batches"
                    if m == "explore"
                    else "uneven splits cannot be pipelined: Megatron requires batch_size = "
                    "num_devices x micro_batch_size x micro-batches"
                )
                + f"; {self._even_pipeline_fix()}",
            )
        # auto tries the divisors of P only, and a pipeline splits evenly: there
        # allow_uneven makes no uneven split run, so no message offers it
        offer_uneven = m != "auto" and self.pipeline_stages == 1
        if b < n or (b % n and not uneven_ok):
            with lattice_rule("train_input.batch_size"):
                lattice.check_batch_size(
                    b, n, fixed, allow_uneven=uneven_ok and m != "auto", offer_uneven=offer_uneven
                )
        if fixed is not None:
            with lattice_rule("train_input.micro_batch_size"):
                lattice.check_micro_batch_size(
                    b, n, fixed, allow_uneven=uneven_ok, offer_uneven=offer_uneven
                )

    def _even_pipeline_fix(self) -> str:
        """What makes an uneven-split mode valid with a pipeline: the even mode and sizes it
        needs, or one stage where the sizes run unevenly."""
        b, n, m = self.batch_size, self.num_devices, self.micro_batch_size
        fixed = m if isinstance(m, int) else None
        p = lattice.per_device_batch(b, n)
        even = b >= n and b % n == 0 and (fixed is None or p % fixed == 0)
        changes = ["micro_batch_size: auto or none"] * (m == "explore")
        changes += ["allow_uneven: false"] * self.allow_uneven
        fix = "set " + " and ".join(changes)
        if not even:
            fix += f" with {lattice.nearest_batch_sizes_text(b, n, fixed)}"
        if b >= n and (fixed is None or fixed <= p) and (m != "auto" or even):
            fix += ", or set pipeline_stages: 1"
        return fix

    @property
    def mode(self) -> str:
        """``int``, ``none``, ``auto`` or ``explore``."""
        return "int" if isinstance(self.micro_batch_size, int) else self.micro_batch_size

    @property
    def config(self) -> BatchConfig | None:
        """The user's own (B, n, m), where the mode fixes m."""
        b, n, m = self.batch_size, self.num_devices, self.micro_batch_size
        if isinstance(m, int):
            return BatchConfig(b, n, m)
        if m == "none":
            return BatchConfig(b, n, lattice.per_device_batch(b, n))
        return None


@dataclass(frozen=True)
class IntRange:
    """An inclusive ``{min, max}`` range of integers (a field of search.space; its
    errors name ``min``, ``max`` or the range itself, under the field that holds it)."""

    min: int = number()
    """The smallest value, at least 1."""
    max: int = number()
    """The largest value, at least ``min``, fewer than MAX_CONFIGS values above it."""

    def __post_init__(self) -> None:
        check_fields(self, "")
        if self.min > self.max:
            raise ConfigError("", f"min {self.min} is greater than max {self.max}")
        if self.max - self.min >= MAX_CONFIGS:
            raise ConfigError(
                "", f"range {self.min}..{self.max} is too wide: at most {MAX_CONFIGS} values"
            )

    def values(self) -> list[int]:
        return list(range(self.min, self.max + 1))


_SIZES = Bounds()
"""A size listed in the space: a whole number from 1."""


@dataclass(frozen=True, kw_only=True)
class SpaceConfig:
    """What may vary; a dimension left out stays at its train_input value."""

    num_devices: tuple[int, ...] | IntRange | None = None
    """Device counts n to try: a list or a {min, max} range."""
    micro_batch_size: tuple[int, ...] | IntRange | None = None
    """Micro-batch sizes m to try (within what the mode allows)."""
    batch_size: int | IntRange | None = None
    """One global batch, or a {min, max} range: B is then free, B = n x m x g."""
    activation_checkpointing: tuple[bool, ...] | None = None
    """``[false, true]`` searches with and without activation checkpointing."""
    reshard_after_forward: tuple[bool, ...] | None = None
    """``[true, false]`` searches FSDP2 freeing each block's parameters after the forward
    pass (ZeRO-3-like) and keeping them (ZeRO-2-like); needs ``trial.sharding: fsdp``."""
    grad_sync: tuple[GradSync, ...] | None = None
    """``[last, every]`` searches reducing gradients once per step and in every
    micro-batch (mbtune.lattice.GradSync); needs ``trial.sharding: fsdp``."""
    source: str = "inline"
    """Where the space came from: ``inline``, a name from search_spaces/, or a path."""

    _WHERE: ClassVar[str] = "search.space"

    def __post_init__(self) -> None:
        for key in ("num_devices", "micro_batch_size"):
            value, where = getattr(self, key), f"{self._WHERE}.{key}"
            if isinstance(value, tuple):
                if not value:
                    raise ConfigError(where, "the list is empty; give at least one size")
                for item in value:
                    check_number(item, where, _SIZES, integer=True)
            elif value is not None and not isinstance(value, IntRange):
                bounds = Bounds(also="a list or {min, max}")
                check_number(value, where, bounds, integer=True)
                raise ConfigError(where, f"expected a tuple of sizes, got {show(value)}")
        if self.batch_size is not None and not isinstance(self.batch_size, IntRange):
            bounds = Bounds(also="a {min, max} range")
            check_number(self.batch_size, f"{self._WHERE}.batch_size", bounds, integer=True)
        for key, choices in (
            ("activation_checkpointing", (False, True)),
            ("reshard_after_forward", (True, False)),
            ("grad_sync", GRAD_SYNCS),
        ):
            _check_choices(getattr(self, key), f"{self._WHERE}.{key}", choices)

    @property
    def settings(self) -> dict[str, tuple[Any, ...]]:
        """The settings of a step (mbtune.lattice.BatchConfig.settings) the space lists."""
        return {k: getattr(self, k) for k in SETTINGS if getattr(self, k) is not None}


def _check_choices(values: Any, where: str, choices: tuple[Any, ...]) -> None:
    """A setting listed in the space: a non-empty tuple of its ``choices``."""
    if values is None:
        return
    spelled = [str(c).lower() for c in choices]  # as YAML writes them
    given = list(values) if isinstance(values, tuple) else values
    if (
        not isinstance(values, tuple)
        or not values
        or not all(any(v is c or (v == c and type(v) is type(c)) for c in choices) for v in values)
    ):
        raise ConfigError(
            where,
            f"expected {' or '.join(spelled)}, or a list of them such as "
            f"[{', '.join(spelled)}], got {show(given)}",
        )


DEFAULT_SPACE = SpaceConfig(micro_batch_size=IntRange(1, 4096), source="default")
"""The space of an experiment that names none (``search_spaces/default.yaml`` holds the
same, for ``space: default``): every micro-batch size the mode allows, up to 4096, at
train_input's batch_size and num_devices."""


@dataclass(frozen=True, kw_only=True)
class StartPoint:
    """One of ``search.start_points`` as YAML spells it (its errors name its own keys,
    under the list entry that holds it); :attr:`config` is what the search takes."""

    batch_size: int = number()
    """Global batch B."""
    num_devices: int = number(1)
    """Data-parallel devices n."""
    micro_batch_size: int = number()
    """Micro-batch size m."""
    activation_checkpointing: bool = False
    """Whether the model recomputes its blocks' activations."""
    reshard_after_forward: bool = True
    """Sharded: whether each block's parameters are freed after the forward pass."""
    grad_sync: GradSync = "last"
    """When the gradients are synchronised: ``last`` or ``every`` micro-batch."""

    def __post_init__(self) -> None:
        check_fields(self, "")
        with lattice_rule(""):  # BatchConfig's own rules: B >= n
            BatchConfig(self.batch_size, self.num_devices, self.micro_batch_size)

    @property
    def config(self) -> BatchConfig:
        return BatchConfig(
            self.batch_size,
            self.num_devices,
            self.micro_batch_size,
            self.activation_checkpointing,
            self.reshard_after_forward,
            self.grad_sync,
        )


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    """How to search: ``search:``."""

    space: SpaceConfig = DEFAULT_SPACE
    """What may vary (see SpaceConfig)."""
    sampler: Sampler = "model"
    """``model`` (default), ``tpe``, ``gp``, ``random``, ``grid``, or the baselines ``halving``
    and ``doubling``."""
    objective: Objective = "samples_per_s"
    """``samples_per_s`` (global throughput) or ``samples_per_s_per_device``."""
    num_samples: int = number(20)
    """Most trials to run (a trial is one measured configuration)."""
    time_budget_s: float | None = number(None, minimum=0.0)
    """Stop starting trials after this many seconds; None: no limit."""
    confidence_target: int = number(90, maximum=100)
    """Stop once the confidence score reaches this (1..99; 100, which the score never
    reaches, never stops on confidence)."""
    noise_floor: float | None = number(None, minimum=0.0, maximum=1.0)
    """The prior of the relative run-to-run drift of a measurement that its own step times
    cannot show (0.02 = 2%); the search estimates the drift from its repeats and this
    counts as four of them. None: 0.035 for real trials and replays with ``trial.drift``
    (DEFAULT_NOISE_FLOOR says where from), 0 for other replays, whose only noise is in their
    step times. 0 also lets the search stop on one measurement of its leader."""
    seed: int = number(0, minimum=0)
    """Seeds the sampler (and a replay's noise)."""
    max_repeats: int = number(5)
    """Most times one configuration is measured (1: never measure one again). With five,
    two configurations 3-5% apart on a machine drifting 3.5% are told apart in about 93%
    of searches; with three, about 75%, the rest ending on a tie (docs/confidence.md)."""
    start_points: tuple[BatchConfig, ...] = ()
    """Configurations to measure first, before the sampler proposes."""
    predict_memory: bool = True
    """Before the first trial, predict each configuration's peak memory (``mbtune memory``,
    on fake tensors) where the budget is known (``trial.device_memory``, or a CUDA card's
    memory) and record those predicted over it, less ``trial.memory_headroom``, as ``oom``
    with the reason ``predicted: ...``, without a trial (they do not count against
    ``num_samples``); false: measure them. Not for replayed trials."""

    def __post_init__(self) -> None:
        check_fields(self, "search")
        if not isinstance(self.space, SpaceConfig):
            raise ConfigError("search.space", f"expected a SpaceConfig, got {show(self.space)}")
        if not all(isinstance(p, BatchConfig) for p in self.start_points):
            raise ConfigError(
                "search.start_points", "expected a list of configurations (BatchConfig)"
            )


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


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    """Where trials run: ``ray:``."""

    address: str | None = None
    """None: start an embedded local Ray (or join RAY_ADDRESS, as ray.init does); ``auto``
    or ``host:port`` (the head's GCS port): join a cluster. ``ray://`` is refused."""
    dashboard: bool = False
    """Start the Ray dashboard on 127.0.0.1 and print its URL."""
    cpus_per_trial: float = number(1.0, minimum=0.0)
    """CPUs of one trial. With ``trial.parallel: ddp``: of each of its num_devices workers
    (the trial itself, which only waits for them, takes none)."""
    gpus_per_trial: float = number(0.0, minimum=0.0)
    """GPUs of one trial; with ``trial.parallel: ddp``, of each worker (a whole number)."""
    max_concurrent_trials: int = number(1)
    """Trials run at once."""
    resource_wait_s: float = number(120.0, minimum=0.0)
    """On a cluster: how long the search waits, once the cluster no longer has what one
    trial needs (its nodes with them went away), for them to come back (an autoscaler's
    replacement node); then it stops, as an interrupted search that ``--resume`` continues."""

    def __post_init__(self) -> None:
        check_fields(self, "ray")


@dataclass(frozen=True, kw_only=True)
class LinkTier:
    """One tier of the planned cluster's links: ``plan.intra_node`` or ``plan.inter_node``
    (its errors name its own keys, under the tier that holds it). A field left unset takes
    the tier's default (:data:`INTRA_NODE`, :data:`INTER_NODE`; docs/plan.md says where
    they come from)."""

    bandwidth: int | None = memory()
    """Bytes/s (YAML: ``370GB`` or bytes). intra_node: the all-reduce bus bandwidth one
    node reaches (nccl-tests' busbw); inter_node: each device's own bandwidth off the node
    (its NIC): a ring across nodes runs at the slower of intra_node and devices_per_node x
    this."""
    latency_us: float | None = number(None, minimum=0.0)
    """Latency of one hop of the ring, in microseconds."""
    uncertainty: float | None = number(None, minimum=0.0, maximum=3.0)
    """The sd of the log of the bandwidth and of the latency (0.3: about 30%): how far the
    real link may be from these figures. The plan draws the link from it."""

    def __post_init__(self) -> None:
        check_fields(self, "")

    def resolved(self, default: LinkTier) -> tuple[float, float, float]:
        """(bytes/s, latency in seconds, uncertainty), each unset field from ``default``."""
        bandwidth = self.bandwidth if self.bandwidth is not None else default.bandwidth
        latency_us = self.latency_us if self.latency_us is not None else default.latency_us
        spread = self.uncertainty if self.uncertainty is not None else default.uncertainty
        return float(bandwidth or 0), float(latency_us or 0) / 1e6, float(spread or 0)


INTRA_NODE = LinkTier(bandwidth=370 * 10**9, latency_us=5.0, uncertainty=0.3)
"""One node of 8 H100 SXM on NVLink: the ring all-reduce's bus bandwidth nccl-tests
reports there, about 370 GB/s (docs/plan.md cites the published figures)."""
INTER_NODE = LinkTier(bandwidth=45 * 10**9, latency_us=10.0, uncertainty=0.3)
"""One 400 Gb/s InfiniBand NIC per device (50 GB/s line rate) at the 85-95% of line
rate published nccl-tests runs reach across nodes (docs/plan.md)."""


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """The real run to plan: ``plan:`` (optional; ``mbtune plan RUN_DIR``)."""

    samples: float | None = number(None, positive=True)
    """Samples the real run trains on (give one of samples, tokens, steps)."""
    tokens: float | None = number(None, positive=True)
    """Tokens the real run trains on: samples = tokens / the tokens of one sample, which
    the run's trials counted (a model with a seq_len)."""
    steps: int | None = number(None)
    """Optimizer steps of the real run: samples = steps x each configuration's batch_size."""
    num_devices: tuple[int, ...] = (8, 64, 256)
    """The device counts to plan for."""
    devices_per_node: int = number(8)
    """Devices in one node: a device count above it crosses the inter-node tier."""
    price_per_device_hour: float | None = number(None, minimum=0.0, maximum=1e6)
    """The price of one device for one hour, in your currency; None: no cost."""
    max_slowdown: float = number(0.10, minimum=0.0, maximum=100.0)
    """"The cheapest within 10% of the fastest": 0.10."""
    intra_node: LinkTier = LinkTier()
    """The links within a node (see LinkTier; unset fields: INTRA_NODE)."""
    inter_node: LinkTier = LinkTier()
    """The links between nodes (see LinkTier; unset fields: INTER_NODE)."""
    nccl_tests: tuple[Path, ...] = ()
    """nccl-tests ``all_reduce_perf`` outputs to read the tiers from (YAML: a path or a
    list, relative to the experiment file): one run within a node gives intra_node, one
    across nodes inter_node (its bus bandwidth over the devices of a node). A tier's own
    keys win over what a file says."""

    def __post_init__(self) -> None:
        check_fields(self, "plan")
        given = [k for k in ("samples", "tokens", "steps") if getattr(self, k) is not None]
        if not given:
            raise ConfigError(
                "plan",
                "give one of samples, tokens or steps: how much the real run trains "
                "(e.g. --set plan.samples=1e9)",
            )
        if len(given) > 1:
            raise ConfigError(
                f"plan.{given[1]}",
                f"give one of samples, tokens or steps, not {' and '.join(given)}",
            )
        where = "plan.num_devices"
        if not isinstance(self.num_devices, tuple) or not self.num_devices:
            raise ConfigError(
                where, f"expected a list of device counts, got {show(self.num_devices)}"
            )
        for item in self.num_devices:
            check_number(item, where, _SIZES, integer=True)
        paths = self.nccl_tests
        if not isinstance(paths, tuple) or not all(
            isinstance(p, Path) and str(p) and "\0" not in str(p) for p in paths
        ):
            raise ConfigError(
                "plan.nccl_tests",
                f"expected a path or a list of paths of nccl-tests outputs, got {show(paths)}",
            )
        for key in ("intra_node", "inter_node"):
            if not isinstance(getattr(self, key), LinkTier):
                raise ConfigError(
                    f"plan.{key}", f"expected a LinkTier, got {show(getattr(self, key))}"
                )

    def links(self) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
        """(intra-node, inter-node) tiers resolved: (bytes/s, latency s, uncertainty)."""
        return self.intra_node.resolved(INTRA_NODE), self.inter_node.resolved(INTER_NODE)
