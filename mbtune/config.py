"""The experiment: YAML in, frozen typed dataclasses out, validated once.

Everything downstream takes an :class:`Experiment` and trusts it. Every error raised
here is a :class:`ConfigError` whose one-line message names the field, the rule, the
value given and what would be valid.
"""

from __future__ import annotations

import bisect
import dataclasses
import difflib
import math
import re
import reprlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mbtune import lattice
from mbtune.errors import MbtuneError
from mbtune.lattice import MAX_CONFIGS, BatchConfig, LatticeError
from mbtune.model_options import (
    HF_NAMES,
    MODEL_OPTIONS,
    check_options,
    hf_model_type,
    split_hf_options,
    split_user_options,
)

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

__all__ = [
    "BACKENDS",
    "COMPILE_MODES",
    "DEVICES",
    "OBJECTIVES",
    "ON_OOM",
    "PARALLEL",
    "PRECISIONS",
    "SAMPLERS",
    "SEARCH_SPACES_DIR",
    "ConfigError",
    "Experiment",
    "IntRange",
    "ModelConfig",
    "RayConfig",
    "SearchConfig",
    "SpaceConfig",
    "TrainInput",
    "TrialConfig",
    "apply_overrides",
    "load_experiment",
    "parse_experiment",
    "parse_memory",
]

SAMPLERS = ("tpe", "gp", "random", "model", "grid", "halving", "doubling")
OBJECTIVES = ("samples_per_s", "samples_per_s_per_device")
BACKENDS = ("torch", "replay")
DEVICES = ("auto", "cpu", "cuda")
PARALLEL = ("simulate", "ddp")
PRECISIONS = ("auto", "fp32", "tf32", "bf16", "fp16")
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
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
ON_OOM = ("fail", "halve")
BUILTIN_MODELS = tuple(MODEL_OPTIONS)
SEARCH_SPACES_DIR = resources.files("mbtune") / "search_spaces"
"""The named search spaces: package data (mbtune/search_spaces/*.yaml), in a wheel too."""


class ConfigError(MbtuneError):
    """Bad input in an experiment; ``str()`` is the one line shown to the user."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where


# ---------------------------------------------------------------------------
# sections


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    name: str
    """``gpt``, ``mlp``, ``cnn_bn``, ``hf:<model_type>`` for a Hugging Face transformers
    model, or ``package.module:function`` for a user model."""
    options: Mapping[str, Any] = field(default_factory=dict)
    """Model-specific keys (every key under ``model:`` but ``name``)."""

    def __post_init__(self) -> None:
        if (
            self.name not in BUILTIN_MODELS
            and hf_model_type(self.name) is None
            and not _is_user_model(self.name)
        ):
            raise ConfigError(
                "model.name",
                f"unknown model {self.name!r}; valid: {', '.join(BUILTIN_MODELS)}, or "
                f"package.module:function{_did_you_mean(self.name, BUILTIN_MODELS)}; "
                f"or {HF_NAMES}",
            )

    @property
    def is_builtin(self) -> bool:
        return self.name in BUILTIN_MODELS


@dataclass(frozen=True, kw_only=True)
class TrainInput:
    """The user's own configuration: the reference for "faster than yours"."""

    batch_size: int
    """Global batch B: samples per optimizer step, all devices together."""
    micro_batch_size: int | str = "auto"
    """A positive int (use exactly this m), ``none``, ``auto`` or ``explore``."""
    num_devices: int = 1
    """Data-parallel devices n (YAML also accepts the Cerebras spelling ``num_csx``)."""
    allow_uneven: bool = False
    """Allow splits that differ by one sample where strict validity would refuse them."""
    pipeline_stages: int = 1
    """Pipeline stages p; p > 1 adds Megatron's bubble (p - 1) / micro-batches."""

    def __post_init__(self) -> None:
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
            with _lattice_rule("train_input.batch_size"):
                lattice.check_batch_size(
                    b, n, fixed, allow_uneven=uneven_ok and m != "auto", offer_uneven=offer_uneven
                )
        if fixed is not None:
            with _lattice_rule("train_input.micro_batch_size"):
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
    """An inclusive ``{min, max}`` range of integers."""

    min: int
    max: int

    def values(self) -> list[int]:
        return list(range(self.min, self.max + 1))


@dataclass(frozen=True, kw_only=True)
class SpaceConfig:
    """What may vary; a dimension left out stays at its train_input value."""

    num_devices: tuple[int, ...] | IntRange | None = None
    micro_batch_size: tuple[int, ...] | IntRange | None = None
    batch_size: int | IntRange | None = None
    activation_checkpointing: tuple[bool, ...] | None = None
    """``[false, true]`` searches with and without activation checkpointing."""
    source: str = "inline"
    """Where the space came from: ``inline``, a name from search_spaces/, or a path."""


@dataclass(frozen=True, kw_only=True)
class SearchConfig:
    space: SpaceConfig = field(default_factory=SpaceConfig)
    sampler: str = "model"
    """``model`` (default), ``tpe``, ``gp``, ``random``, ``grid``, or the baselines ``halving``
    and ``doubling``."""
    objective: str = "samples_per_s"
    """``samples_per_s`` (global throughput) or ``samples_per_s_per_device``."""
    num_samples: int = 20
    """Most trials to run (a trial is one measured configuration)."""
    time_budget_s: float | None = None
    """Stop starting trials after this many seconds; None: no limit."""
    confidence_target: int = 90
    """Stop once the confidence score reaches this (1..99; 100, which the score never
    reaches, never stops on confidence)."""
    noise_floor: float | None = None
    """Relative run-to-run drift of a measurement that its own step times cannot show
    (0.02 = 2%); None: 0.035 for real trials (DEFAULT_NOISE_FLOOR says where from), 0 for
    replayed ones, whose only noise is in their step times."""
    seed: int = 0
    max_repeats: int = 3
    """Most times one configuration is measured (1: never measure one again)."""
    start_points: tuple[BatchConfig, ...] = ()
    """Configurations to measure first, before the sampler proposes."""


@dataclass(frozen=True, kw_only=True)
class TrialConfig:
    backend: str = "torch"
    """``torch`` (measure a real model) or ``replay`` (answer from ``table``)."""
    table: Path | None = None
    """CSV of measured throughputs, for the replay backend."""
    noise: float = 0.0
    """Relative noise added to each replayed step time (0.03 = 3%)."""
    drift: float = 0.0
    """Replay only: the relative sd of one seeded multiplicative factor drawn per replayed
    trial, on top of ``noise`` per step (0.035 = 3.5%), as a real machine drifts between
    trials; 0 <= drift < 1."""
    device: str = "auto"
    """``auto`` (CUDA where there is one), ``cpu`` or ``cuda``."""
    parallel: str = "simulate"
    """``simulate`` (one device's share plus a modelled all-reduce) or ``ddp`` (a Ray Train
    run of num_devices DistributedDataParallel workers; see mbtune.ddp)."""
    compile: bool = True
    """Compile the model with torch.compile; compile time is reported apart."""
    compile_mode: str = "default"
    """torch.compile's mode: ``default``, ``reduce-overhead``, ``max-autotune``, ..."""
    dynamic: bool = False
    """Compile once for every micro-batch size (a dynamic batch dimension)."""
    warmup_steps: int = 2
    measure_steps: int = 5
    eval: bool = False
    """Also measure forward-only (evaluation) throughput at the same micro-batch size."""
    device_memory: int | None = None
    """Memory budget per device in bytes (YAML: ``8GiB``, ``512MB`` or bytes); above it: oom."""
    on_oom: str = "fail"
    """``fail`` (record oom) or ``halve`` (Composer: halve the micro-batch and retry)."""
    link_bandwidth: int | None = None
    """Bytes/s of one link of the modelled ring all-reduce (YAML: ``25GB`` or bytes);
    None: :data:`LINKS` for the trial's device."""
    link_latency_us: float | None = None
    """Latency of one hop of the modelled ring all-reduce, in microseconds; None:
    :data:`LINKS` for the trial's device."""
    precision: str = "auto"
    """The arithmetic of the step: ``auto`` (bf16 autocast on a CUDA device that supports
    it, else fp32), ``fp32``, ``tf32`` (fp32 with TF32 matmuls; CUDA), ``bf16`` (autocast,
    fp32 master weights; CPU too) or ``fp16`` (autocast with a gradient scaler; CUDA)."""
    activation_checkpointing: bool = False
    """Recompute the model's blocks' activations in the backward pass (memory for
    compute); ``search.space.activation_checkpointing`` searches over it instead."""
    peak_tflops: float | None = None
    """The device's peak TFLOP/s for the trial's precision, for ``mfu``; None: from the
    table of known devices (mbtune.flops), or no mfu where the device is not in it."""
    memory_headroom: float | None = None
    """The share of the memory budget a configuration must leave free to fit; None:
    DEFAULT_MEMORY_HEADROOM where a budget is known (trial.device_memory, or a CUDA
    card's memory), else 0."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(
                "trial.precision",
                f"{_show(self.precision)} is not one of: {', '.join(PRECISIONS)}"
                f"{_did_you_mean(self.precision, PRECISIONS)}",
            )
        if self.device == "cpu" and self.precision in CUDA_ONLY_PRECISIONS:
            raise ConfigError(
                "trial.precision",
                f"{self.precision} runs on CUDA only, and trial.device is cpu; use bf16 or "
                "fp32 on the CPU (or auto)",
            )
        if (
            self.memory_headroom is not None
            and not 0 <= self.memory_headroom <= MAX_MEMORY_HEADROOM
        ):
            raise ConfigError(
                "trial.memory_headroom",
                f"{_show(self.memory_headroom)} is out of range; expected a share from 0 "
                f"(none) to {MAX_MEMORY_HEADROOM}, e.g. 0.05",
            )
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError(
                "trial.peak_tflops", f"must be positive, got {_show(self.peak_tflops)}"
            )
        if not 0 <= self.drift < 1:
            raise ConfigError(
                "trial.drift",
                f"{_show(self.drift)} is out of range; expected a number from 0 up to (not "
                "including) 1, e.g. 0.035",
            )
        if self.drift and self.table is None:
            raise ConfigError(
                "trial.drift",
                f"drift {self.drift:g} applies to replayed trials only, and trial.table is not "
                "set; set trial.backend: replay with trial.table, or drift: 0",
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

    timeout_s: float = 600.0
    """A trial still running after this many seconds is stopped and recorded as timeout."""


@dataclass(frozen=True, kw_only=True)
class RayConfig:
    address: str | None = None
    """None: start an embedded local Ray (or join RAY_ADDRESS, as ray.init does); ``auto``
    or ``host:port`` (the head's GCS port): join a cluster. ``ray://`` is refused."""
    dashboard: bool = False
    cpus_per_trial: float = 1.0
    """CPUs of one trial. With ``trial.parallel: ddp``: of each of its num_devices workers
    (the trial itself, which only waits for them, takes none)."""
    gpus_per_trial: float = 0.0
    """GPUs of one trial; with ``trial.parallel: ddp``, of each worker (a whole number)."""
    max_concurrent_trials: int = 1


DEFAULT_NOISE_FLOOR = 0.035
"""Run-to-run drift assumed for real trials: bench/search_noise.py measured 3.4% (the
median over the quickstart's configurations of a robust sd across four whole searches)
on a shared 2-core CPU; a dedicated accelerator may drift less (set search.noise_floor)."""


@dataclass(frozen=True, kw_only=True)
class Experiment:
    name: str
    model: ModelConfig
    train_input: TrainInput
    search: SearchConfig = field(default_factory=SearchConfig)
    trial: TrialConfig = field(default_factory=TrialConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    output_dir: Path = Path("runs")
    source: Path | None = None
    """The YAML file this came from (None when built in code)."""

    def __post_init__(self) -> None:
        if self.trial.backend == "replay" and self.trial.table is None:
            raise ConfigError("trial.table", "the replay backend needs trial.table: a CSV path")
        if self.trial.parallel == "ddp":
            self._check_ddp()
        configs = self.configs()
        if not configs:
            raise ConfigError("search.space", f"no valid configuration: {self._space_summary()}")
        space = set(configs)
        for i, point in enumerate(self.search.start_points):
            if point not in space:
                raise ConfigError(
                    f"search.start_points[{i}]",
                    f"batch_size {point.batch_size}, num_devices {point.num_devices}, "
                    f"micro_batch_size {point.micro_batch_size} is not in the search space; "
                    "see `mbtune space` for the valid configurations",
                )

    def _check_ddp(self) -> None:
        """What ``trial.parallel: ddp`` cannot do."""
        if self.train_input.pipeline_stages > 1:
            raise ConfigError(
                "trial.parallel", "ddp does not run pipelines; use parallel: simulate"
            )
        if self.trial.backend == "replay":
            raise ConfigError(
                "trial.parallel",
                "ddp runs real workers, but the replay backend answers from trial.table and "
                "runs nothing; use parallel: simulate with backend: replay",
            )
        gpus = self.ray.gpus_per_trial
        if self.trial.device == "cuda" and gpus == 0:
            raise ConfigError(
                "ray.gpus_per_trial",
                "ddp on cuda gives each worker its own GPU, and ray.gpus_per_trial is 0; "
                "set ray.gpus_per_trial: 1",
            )
        if gpus == 0 and self.ray.cpus_per_trial == 0:
            raise ConfigError(
                "ray.cpus_per_trial",
                "ddp workers need resources of their own: ray.cpus_per_trial and "
                "ray.gpus_per_trial are both 0; set ray.cpus_per_trial: 1 (0.5 puts two "
                "workers on one core)",
            )
        if gpus != int(gpus):
            raise ConfigError(
                "ray.gpus_per_trial",
                f"ddp gives each worker whole GPUs (NCCL ranks cannot share one), got {gpus:g}; "
                "use 1 (or 0 with device: cpu)",
            )

    @property
    def cpu_threads(self) -> int:
        """The threads one trial (one ddp worker) computes with: the whole CPUs it holds,
        ``ray.cpus_per_trial``, at least one (Ray's rule for OMP_NUM_THREADS), also in
        `mbtune trial`, so that it measures what a search measures."""
        return max(1, int(self.ray.cpus_per_trial))

    @property
    def user_config(self) -> BatchConfig | None:
        """The user's own configuration (where the mode fixes m), with the trial's
        activation checkpointing: the reference for "faster than yours"."""
        user = self.train_input.config
        if user is None:
            return None
        return dataclasses.replace(
            user, activation_checkpointing=self.trial.activation_checkpointing
        )

    @property
    def noise_floor(self) -> float:
        """``search.noise_floor``, resolved for the backend (see SearchConfig)."""
        if self.search.noise_floor is not None:
            return self.search.noise_floor
        return 0.0 if self.trial.backend == "replay" else DEFAULT_NOISE_FLOOR

    # -- the lattice this experiment searches ------------------------------

    def configs(self) -> list[BatchConfig]:
        """Every configuration the search may try (see lattice.enumerate_configs)."""
        return _enumerate(self.train_input, self.search.space, self.trial.activation_checkpointing)

    def _space_summary(self) -> str:
        t, s = self.train_input, self.search.space
        return (
            f"micro_batch_size {t.micro_batch_size!r}, batch_size "
            f"{_describe(s.batch_size) if s.batch_size is not None else t.batch_size}, "
            f"num_devices {_describe(s.num_devices) if s.num_devices else t.num_devices}, "
            f"space micro_batch_size {_describe(s.micro_batch_size)}"
            + ("" if t.allow_uneven else ", allow_uneven false")
        )

    def to_dict(self) -> dict[str, Any]:
        """The resolved experiment, as YAML would spell it (for the run directory)."""
        return _plain(
            {
                "name": self.name,
                "model": {"name": self.model.name, **self.model.options},
                "train_input": dataclasses.asdict(self.train_input),
                "search": {
                    **{
                        k: v
                        for k, v in dataclasses.asdict(self.search).items()
                        if k not in ("space", "start_points")
                    },
                    "start_points": [p.sizes() for p in self.search.start_points],
                    "space": {
                        k: v
                        for k, v in dataclasses.asdict(self.search.space).items()
                        if v is not None and k != "source"
                    },
                },
                "trial": dataclasses.asdict(self.trial),
                "ray": dataclasses.asdict(self.ray),
                "output_dir": self.output_dir,
            }
        )


def _enumerate(t: TrainInput, s: SpaceConfig, checkpointing: bool) -> list[BatchConfig]:
    """The lattice of (B, n, m), once per activation checkpointing setting of the space."""
    sizes = _enumerate_sizes(t, s)
    flags = s.activation_checkpointing or (checkpointing,)
    return [dataclasses.replace(c, activation_checkpointing=f) for f in flags for c in sizes]


def _enumerate_sizes(t: TrainInput, s: SpaceConfig) -> list[BatchConfig]:
    ns = _values(s.num_devices) if s.num_devices is not None else [t.num_devices]
    ms = _values(s.micro_batch_size) if s.micro_batch_size is not None else None
    batch_range = isinstance(s.batch_size, IntRange)
    if batch_range:
        batch_sizes: Any = (s.batch_size.min, s.batch_size.max)  # type: ignore[union-attr]
    else:
        batch_sizes = [s.batch_size if s.batch_size is not None else t.batch_size]
    if isinstance(t.micro_batch_size, int) and ms is not None and not batch_range:
        ms = None  # an explicit m is the user's choice; the space cannot vary it
    range_ms = [t.micro_batch_size] if isinstance(t.micro_batch_size, int) else ms
    if batch_range and range_ms is not None:
        _check_range_work(ns, range_ms, s.batch_size.max)  # type: ignore[union-attr]
    with _lattice_rule("search.space"):
        return lattice.enumerate_configs(
            mode=t.micro_batch_size,
            batch_sizes=batch_sizes,
            num_devices=ns,
            micro_batch_sizes=ms,
            batch_range=batch_range,
            allow_uneven=t.allow_uneven,
        )


def _check_range_work(ns: list[int], ms: list[int], batch_max: int) -> None:
    """Refuse a batch_size range whose enumeration would visit too many (n, m) pairs.

    With B free, the lattice visits every pair with n x m <= max B, even where no B of the
    range fits; huge device and micro-batch ranges would take minutes to find nothing.
    """
    ms = sorted(ms)
    pairs = sum(bisect.bisect_right(ms, batch_max // n) for n in ns)
    if pairs > MAX_CONFIGS:
        raise ConfigError(
            "search.space",
            f"with a batch_size range, num_devices ({len(ns)} values) x micro_batch_size "
            f"({len(ms)} values) gives {pairs:,} pairs to try, more than {MAX_CONFIGS:,}; "
            "narrow num_devices or micro_batch_size",
        )


def _values(v: tuple[int, ...] | IntRange) -> list[int]:
    return v.values() if isinstance(v, IntRange) else list(v)


def _describe(v: Any) -> str:
    if isinstance(v, IntRange):
        return f"{v.min}..{v.max}"
    if isinstance(v, tuple):
        return "[" + ", ".join(map(str, v)) + "]"
    return "not listed" if v is None else str(v)


def _plain(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_plain(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    return obj


@contextmanager
def _lattice_rule(where: str) -> Iterator[None]:
    """Report a broken lattice rule as a config error at ``where``."""
    try:
        yield
    except LatticeError as e:
        raise ConfigError(where, str(e)) from None


# ---------------------------------------------------------------------------
# loading


def load_experiment(path: str | Path, overrides: Sequence[str] = ()) -> Experiment:
    """Read an experiment YAML (safe loader only), apply ``--set`` overrides, validate."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError("", f"experiment file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError("", f"{path} is a directory; expected an experiment YAML file") from None
    except UnicodeDecodeError:
        raise ConfigError("", f"{path}: not a text file (expected UTF-8 YAML)") from None
    except OSError as e:
        raise ConfigError("", f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:  # a path no file system accepts, e.g. with a NUL character
        raise ConfigError("", f"cannot read {_show(str(path))}: {e}") from None
    raw = _safe_load(text, str(path))
    raw = apply_overrides(raw, overrides)
    return parse_experiment(raw, source=path)


MAX_YAML_VALUES = 100_000
"""Most values (aliases expanded) an experiment may hold: a few dozen is typical. Bounds
the work of every later step against "billion laughs" alias bombs and cycles."""
MAX_YAML_DEPTH = 50
"""Deepest nesting an experiment may have: four levels is typical."""


def _safe_load(text: str, where: str) -> Any:
    """YAML with the safe loader only (no tags that build Python objects), size-checked."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError("", f"{where}: invalid YAML{at}: {problem}") from None
    except RecursionError:
        raise ConfigError("", f"{where}: YAML nested too deeply") from None
    except Exception as e:  # a scalar its tag cannot build: !!int x, 2001-02-30, 10**5000
        problem = " ".join(str(e).split())[:200] or type(e).__name__
        raise ConfigError("", f"{where}: invalid YAML: {problem}") from None
    _check_size(data, where)
    return data


def _check_size(data: Any, where: str) -> None:
    """Refuse a document that expands to too many values or nests too deeply.

    Walks the document as later steps will, aliases expanded, but stops at the limits:
    a "billion laughs" or a cycle (``&a [*a]``) costs at most MAX_YAML_VALUES steps.
    """
    stack = [(data, 0)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_YAML_VALUES:
            raise ConfigError(
                "",
                f"{where}: more than {MAX_YAML_VALUES:,} values once YAML aliases are "
                "expanded; an experiment holds a few dozen (repeated aliases or a cycle?)",
            )
        if depth > MAX_YAML_DEPTH:
            raise ConfigError(
                "",
                f"{where}: YAML nested more than {MAX_YAML_DEPTH} levels deep; an "
                "experiment needs a few",
            )
        if isinstance(node, Mapping):
            stack.extend((v, depth + 1) for v in node.values())
            stack.extend((k, depth + 1) for k in node if not isinstance(k, str))
        elif isinstance(node, list | tuple | set | frozenset):
            stack.extend((v, depth + 1) for v in node)


def apply_overrides(raw: Any, overrides: Sequence[str]) -> Any:
    """Apply ``key.path=value`` overrides; values are parsed as YAML scalars or lists."""
    if not overrides:
        return raw
    raw = dict(raw) if isinstance(raw, Mapping) else raw
    if not isinstance(raw, dict):
        return raw  # parse_experiment reports the real problem
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(
                "--set", f"expected KEY.PATH=VALUE, e.g. train_input.batch_size=128, got {item!r}"
            )
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, Mapping) else {}
            node[part] = child
            node = child
        node[parts[-1]] = _safe_load(value, f"--set {key}")
    return raw


def parse_experiment(raw: Any, *, source: Path | None = None) -> Experiment:
    """Build a validated Experiment from the mapping a YAML file holds."""
    base = source.parent if source is not None else Path.cwd()
    _check_size(raw, str(source) if source is not None else "the experiment")
    top = _Section(raw, "", _EXPERIMENT_KEYS, what="the experiment")
    name = top.str("name", default=source.stem if source else None, required=source is None)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", name):
        raise ConfigError(
            "name", f"{name!r} is not a valid name: use letters, digits, '_', '-', '.' (1-100)"
        )
    return Experiment(
        name=name,
        model=_parse_model(top.get("model", required=True)),
        train_input=_parse_train_input(top.get("train_input", required=True)),
        search=_parse_search(top.get("search", default={}), base),
        trial=_parse_trial(top.get("trial", default={}), base),
        ray=_parse_ray(top.get("ray", default={})),
        output_dir=Path(top.path("output_dir", default="runs")),
        source=source,
    )


_EXPERIMENT_KEYS = ("name", "model", "train_input", "search", "trial", "ray", "output_dir")


def _parse_model(raw: Any) -> ModelConfig:
    if isinstance(raw, str):
        raw = {"name": raw}
    sec = _Section(raw, "model", None)
    name = sec.str("name", required=True)
    options = {k: v for k, v in sec.data.items() if k != "name"}
    model = ModelConfig(name=name, options=options)
    if model.is_builtin:
        check_options(name, options)
    elif hf_model_type(name) is not None:
        split_hf_options(options)  # the model type and the config's keys: when it is built
    else:
        split_user_options(options)
    return model


def _parse_train_input(raw: Any) -> TrainInput:
    sec = _Section(raw, "train_input", ("num_csx", *_field_names(TrainInput)))
    if "num_csx" in sec.data and "num_devices" in sec.data:
        raise ConfigError(
            "train_input.num_csx",
            "give num_devices or its Cerebras alias num_csx, not both",
        )
    devices_key = "num_csx" if "num_csx" in sec.data else "num_devices"
    mbs = sec.get("micro_batch_size", default="auto")
    if isinstance(mbs, str) and mbs.lower() in lattice.MODES:
        mbs = mbs.lower()
    else:
        mbs = _number(
            mbs,
            "train_input.micro_batch_size",
            minimum=1,
            integer=True,
            also="'auto', 'explore' or 'none'",
        )
    return TrainInput(
        batch_size=sec.int("batch_size", required=True),
        micro_batch_size=mbs,
        num_devices=sec.int(devices_key, default=1),
        allow_uneven=sec.bool("allow_uneven", default=False),
        pipeline_stages=sec.int("pipeline_stages", default=1),
    )


def _parse_search(raw: Any, base: Path) -> SearchConfig:
    sec = _Section(raw, "search", _field_names(SearchConfig))
    space_raw = sec.get("space", default="default")
    sampler = sec.choice("sampler", SAMPLERS, default="model")
    objective = sec.choice("objective", OBJECTIVES, default="samples_per_s")
    return SearchConfig(
        space=_parse_space(space_raw, base),
        sampler=sampler,
        objective=objective,
        num_samples=sec.int("num_samples", default=20),
        time_budget_s=sec.float("time_budget_s", default=None, minimum=0.0),
        confidence_target=sec.int("confidence_target", default=90, maximum=100),
        noise_floor=sec.float("noise_floor", default=None, minimum=0.0, maximum=1.0),
        seed=sec.int("seed", default=0, minimum=0),
        max_repeats=sec.int("max_repeats", default=3),
        start_points=_parse_points(sec.get("start_points", default=[]), "search.start_points"),
    )


def _parse_points(raw: Any, where: str) -> tuple[BatchConfig, ...]:
    if not isinstance(raw, list):
        raise ConfigError(where, f"expected a list of configurations, got {_kind(raw)}")
    points = []
    for i, item in enumerate(raw):
        sec = _Section(
            item,
            f"{where}[{i}]",
            ("batch_size", "num_devices", "micro_batch_size", "activation_checkpointing"),
        )
        b = sec.int("batch_size", required=True)
        n = sec.int("num_devices", default=1)
        m = sec.int("micro_batch_size", required=True)
        if b < n:
            raise ConfigError(f"{where}[{i}]", f"batch_size {b} is smaller than num_devices {n}")
        checkpointing = sec.bool("activation_checkpointing", default=False)
        points.append(BatchConfig(b, n, m, checkpointing))
    return tuple(points)


def _parse_space(raw: Any, base: Path) -> SpaceConfig:
    where = "search.space"
    source = "inline"
    if isinstance(raw, str):
        path = _space_path(raw, base)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(where, f"cannot read space file {path}: {e}") from None
        source = raw
        raw = _safe_load(text, str(path))
        if raw is None:
            raw = {}
    sec = _Section(
        raw, where, ("num_devices", "micro_batch_size", "batch_size", "activation_checkpointing")
    )
    return SpaceConfig(
        num_devices=sec.int_list_or_range("num_devices"),
        micro_batch_size=sec.int_list_or_range("micro_batch_size"),
        batch_size=sec.int_or_range("batch_size"),
        activation_checkpointing=sec.bool_list("activation_checkpointing"),
        source=source,
    )


def _space_path(value: str, base: Path) -> Path | Traversable:
    """A space is a name from search_spaces/ (package data) or a path (relative to the
    experiment file)."""
    if value.endswith((".yaml", ".yml")) or "/" in value:
        for candidate in (base / value, Path(value)):
            if candidate.is_file():
                return candidate
        raise ConfigError("search.space", f"space file not found: {value}")
    names = sorted(p.name[: -len(".yaml")] for p in SEARCH_SPACES_DIR.iterdir()
                   if p.name.endswith(".yaml"))  # fmt: skip
    if value not in names:
        raise ConfigError(
            "search.space",
            f"unknown space {value!r}; valid: {', '.join(names)}, a path to a YAML file, or "
            f"an inline mapping{_did_you_mean(value, names)}",
        )
    return SEARCH_SPACES_DIR / f"{value}.yaml"


def _parse_trial(raw: Any, base: Path) -> TrialConfig:
    sec = _Section(raw, "trial", _field_names(TrialConfig))
    table = sec.path("table", default=None)
    memory = sec.get("device_memory", default=None)
    bandwidth = sec.get("link_bandwidth", default=None)
    return TrialConfig(
        backend=sec.choice("backend", BACKENDS, default="torch"),
        table=_resolve(base / table, "trial.table") if table is not None else None,
        noise=sec.float("noise", default=0.0, minimum=0.0, maximum=1.0),
        drift=sec.float("drift", default=0.0, minimum=0.0, maximum=1.0),
        device=sec.choice("device", DEVICES, default="auto"),
        parallel=sec.choice("parallel", PARALLEL, default="simulate"),
        compile=sec.bool("compile", default=True),
        compile_mode=sec.choice("compile_mode", COMPILE_MODES, default="default"),
        dynamic=sec.bool("dynamic", default=False),
        warmup_steps=sec.int("warmup_steps", default=2, minimum=0),
        measure_steps=sec.int("measure_steps", default=5),
        eval=sec.bool("eval", default=False),
        device_memory=parse_memory(memory, "trial.device_memory") if memory is not None else None,
        on_oom=sec.choice("on_oom", ON_OOM, default="fail"),
        link_bandwidth=parse_memory(bandwidth, "trial.link_bandwidth")
        if bandwidth is not None
        else None,
        link_latency_us=sec.float("link_latency_us", default=None, minimum=0.0),
        timeout_s=sec.float("timeout_s", default=600.0, minimum=1.0),
        precision=sec.choice("precision", PRECISIONS, default="auto"),
        activation_checkpointing=sec.bool("activation_checkpointing", default=False),
        peak_tflops=sec.float("peak_tflops", default=None, minimum=1e-6),
        memory_headroom=sec.float(
            "memory_headroom", default=None, minimum=0.0, maximum=MAX_MEMORY_HEADROOM
        ),
    )


def _parse_ray(raw: Any) -> RayConfig:
    sec = _Section(raw, "ray", _field_names(RayConfig))
    return RayConfig(
        address=sec.str("address", default=None),
        dashboard=sec.bool("dashboard", default=False),
        cpus_per_trial=sec.float("cpus_per_trial", default=1.0, minimum=0.0),
        gpus_per_trial=sec.float("gpus_per_trial", default=0.0, minimum=0.0),
        max_concurrent_trials=sec.int("max_concurrent_trials", default=1),
    )


def _resolve(path: Path, where: str) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise ConfigError(where, f"cannot resolve {_show(str(path))}: {e}") from None


_MEMORY_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip


def parse_memory(value: Any, where: str = "trial.device_memory") -> int:
    """``8GiB``, ``512MB``, ``1.5GB`` or a number of bytes -> bytes (a rate may end in /s)."""
    rule = "expected bytes or a size such as 8GiB, 512MB, 1.5GB"
    if isinstance(value, int) and not isinstance(value, bool):
        size: float = value
    else:
        match = isinstance(value, str) and re.fullmatch(
            r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)(?:/s)?\s*", value
        )
        if not match or match[2].lower() not in _MEMORY_UNITS:
            raise ConfigError(where, f"{_show(value)} is not a memory size; {rule}")
        size = float(match[1]) * _MEMORY_UNITS[match[2].lower()]  # inf for 400 digits
    if not size >= 1:
        raise ConfigError(where, f"must be positive, got {_show(value)}; {rule}")
    if size > _MAX_BYTES:
        raise ConfigError(where, f"{_show(value)} is too large; {rule}, at most 1EiB")
    return int(size)


_MAX_BYTES = 2**60
"""1 EiB: a larger memory size or bandwidth is a typo."""


# ---------------------------------------------------------------------------
# typed access to one mapping of the YAML


class _Section:
    """One mapping of the YAML: checks its type, its keys, and each value's type."""

    def __init__(
        self, raw: Any, where: str, known: Sequence[str] | None, *, what: str | None = None
    ) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(
                where, f"{what or 'this section'} must be a mapping of keys, got {_kind(raw)}"
            )
        self.where = where
        self.data = dict(raw)
        for key in self.data:
            if not isinstance(key, str):
                raise ConfigError(self._at(str(key)), f"keys must be text, got {_kind(key)}")
            if known is not None and key not in known:
                raise ConfigError(
                    self._at(key),
                    f"unknown key; valid keys: {', '.join(known)}{_did_you_mean(key, known)}",
                )

    def _at(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, *, default: Any = None, required: bool = False) -> Any:
        if key not in self.data:
            if required:
                raise ConfigError(self._at(key), "required key is missing")
            return default
        return self.data[key]

    def str(self, key: str, *, default: Any = None, required: bool = False) -> Any:
        value = self.get(key, default=default, required=required)
        if value is None and not required:
            return default  # an explicit null (``output_dir:``) means the default
        if isinstance(value, str) and value:
            return value
        raise ConfigError(self._at(key), f"expected non-empty text, got {_show(value)}")

    def path(self, key: str, *, default: Any = None) -> Any:
        """Non-empty text that a file system can take as a path (no NUL character)."""
        value = self.str(key, default=default)
        if value is not None and "\0" in value:
            raise ConfigError(
                self._at(key), f"{_show(value)} is not a valid path: it holds a NUL character"
            )
        return value

    def choice(self, key: str, choices: Sequence[str], *, default: str) -> str:
        value = self.get(key, default=default)
        if isinstance(value, str) and value.lower() in choices:
            return value.lower()
        suggestion = _did_you_mean(value, choices) if isinstance(value, str) else ""
        raise ConfigError(
            self._at(key), f"{_show(value)} is not one of: {', '.join(choices)}{suggestion}"
        )

    def bool(self, key: str, *, default: bool) -> bool:
        value = self.get(key, default=default)
        if isinstance(value, bool):
            return value
        raise ConfigError(self._at(key), f"expected true or false, got {_show(value)}")

    def bool_list(self, key: str) -> tuple[bool, ...] | None:
        """A list of true/false (or one of them), as a sorted tuple without repeats."""
        value = self.get(key)
        if value is None:
            return None
        items = value if isinstance(value, list) else [value]
        if not items or not all(isinstance(v, bool) for v in items):
            raise ConfigError(
                self._at(key), f"expected true, false or [false, true], got {_show(value)}"
            )
        return tuple(sorted(set(items)))

    def int(
        self, key: str, *, default: int | None = None, required: bool = False,
        minimum: int = 1, maximum: int | None = None,
    ) -> int:  # fmt: skip
        value = self.get(key, default=default, required=required)
        return _number(value, self._at(key), minimum=minimum, maximum=maximum, integer=True)

    def float(
        self, key: str, *, default: float | None, minimum: float, maximum: float | None = None
    ) -> float | None:
        value = self.get(key, default=default)
        if value is None:
            return None
        return _number(value, self._at(key), minimum=minimum, maximum=maximum, integer=False)

    def int_or_range(self, key: str) -> int | IntRange | None:
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, Mapping):
            return self._range(key, value)
        return _number(value, self._at(key), minimum=1, integer=True, also="a {min, max} range")

    def int_list_or_range(self, key: str) -> tuple[int, ...] | IntRange | None:
        value = self.get(key)
        if value is None:
            return None
        if isinstance(value, Mapping):
            return self._range(key, value)
        if isinstance(value, list):
            if not value:
                raise ConfigError(self._at(key), "the list is empty; give at least one size")
            items = [_number(v, self._at(key), minimum=1, integer=True) for v in value]
            return tuple(sorted(set(items)))
        value = _number(value, self._at(key), minimum=1, integer=True, also="a list or {min, max}")
        return (value,)

    def _range(self, key: str, value: Mapping[Any, Any]) -> IntRange:
        sub = _Section(value, self._at(key), ("min", "max"))
        lo = sub.int("min", required=True)
        hi = sub.int("max", required=True)
        if lo > hi:
            raise ConfigError(self._at(key), f"min {lo} is greater than max {hi}")
        if hi - lo >= MAX_CONFIGS:
            raise ConfigError(
                self._at(key), f"range {lo}..{hi} is too wide: at most {MAX_CONFIGS} values"
            )
        return IntRange(lo, hi)


_INT_LIMIT = 2**31 - 1
"""No real batch or device count comes near this; refusing larger keeps the arithmetic fast."""


def _number(
    value: Any, where: str, *, minimum: float, integer: bool,
    maximum: float | None = None, also: str = "",
) -> Any:  # fmt: skip
    if maximum is None:
        maximum = _INT_LIMIT
    kind = "a whole number" if integer else "a number"
    valid = f"{kind} from {minimum} to {maximum}" + (f", or {also}" if also else "")
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if (
        isinstance(value, bool)
        or not ok_type
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise ConfigError(where, f"expected {valid}, got {_show(value)}")
    if not minimum <= value <= maximum:
        raise ConfigError(where, f"{_show(value)} is out of range; expected {valid}")
    return value


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _is_user_model(name: str) -> bool:
    return re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", name) is not None


def _did_you_mean(value: Any, choices: Sequence[str]) -> str:
    close = difflib.get_close_matches(str(value).lower(), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _kind(value: Any) -> str:
    return {list: "a list", str: "text", dict: "a mapping"}.get(type(value), type(value).__name__)


def _show(value: Any) -> str:
    """A value as the message shows it: on one line, and never pages long.

    reprlib bounds the work too: a list of a billion aliased items is shown in microseconds.
    """
    try:
        text = _REPR.repr(value)
    except ValueError:  # an int too long to print
        text = f"<a {type(value).__name__} too long to show>"
    text = text.replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 60
