"""The search section, ``search:``: how to search (the sampler, the objective, the budget,
the stop) and what may vary (``search.space``), as frozen keyword-only dataclasses with
their rules, as mbtune.config.schema states the others.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from mbtune.config.model_options import did_you_mean
from mbtune.config.rules import (
    SIZE,
    Bounds,
    ConfigError,
    check_fields,
    check_number,
    number,
    show,
)
from mbtune.config.train_input import lattice_rule
from mbtune.lattice import (
    GRAD_SYNCS,
    MAX_CONFIGS,
    PIPELINE_SCHEDULES,
    SETTINGS,
    BatchConfig,
    GradSync,
    PipelineSchedule,
)

__all__ = [
    "DEFAULT_SPACE",
    "OBJECTIVES",
    "SAMPLERS",
    "IntRange",
    "SearchConfig",
    "SpaceConfig",
    "StartPoint",
]

Sampler = Literal["tpe", "gp", "random", "model", "grid", "halving", "doubling"]
Objective = Literal["samples_per_s", "samples_per_s_per_device"]
SAMPLERS = typing.get_args(Sampler)
OBJECTIVES = typing.get_args(Objective)


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
    tensor_parallel: tuple[int, ...] | IntRange | None = None
    """Tensor-parallel degrees t to try: a list or a {min, max} range; each runs on the
    device counts t x p divides, where t divides the model's heads and MLP width."""
    pipeline_parallel: tuple[int, ...] | IntRange | None = None
    """Pipeline degrees p to try: a list or a {min, max} range; p x stages per rank must
    divide the model's layers."""
    pipeline_schedule: tuple[PipelineSchedule, ...] | None = None
    """Pipeline schedules to try, e.g. ``[1f1b, interleaved_1f1b]`` (where p > 1)."""
    source: str = "inline"
    """Where the space came from: ``inline``, a name from search_spaces/, or a path."""

    _WHERE: ClassVar[str] = "search.space"

    def __post_init__(self) -> None:
        for key in ("num_devices", "micro_batch_size", "tensor_parallel", "pipeline_parallel"):
            value, where = getattr(self, key), f"{self._WHERE}.{key}"
            if isinstance(value, tuple):
                if not value:
                    raise ConfigError(where, "the list is empty; give at least one size")
                for item in value:
                    check_number(item, where, SIZE, integer=True)
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
            ("pipeline_schedule", PIPELINE_SCHEDULES),
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
    wrong = [v for v in (values if isinstance(values, tuple) else ())
             if not any(v is c or (v == c and type(v) is type(c)) for c in choices)]  # fmt: skip
    if not isinstance(values, tuple) or not values or wrong:
        which = ""
        if wrong:  # a list with a value that is no choice: name it, and what it is near
            hint = did_you_mean(wrong[0], spelled)
            named = f"; {show(wrong[0])} is not one of them{hint}"
            which = hint if len(wrong) == len(values) else named
        raise ConfigError(
            where,
            f"expected {' or '.join(spelled)}, or a list of them such as "
            f"[{', '.join(spelled)}], got {show(given)}{which}",
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
    tensor_parallel: int = number(1)
    """t: the devices each layer is split over."""
    pipeline_parallel: int = number(1)
    """p: pipeline stages."""
    pipeline_schedule: PipelineSchedule = "1f1b"
    """The pipeline's schedule (where p > 1)."""

    def __post_init__(self) -> None:
        check_fields(self, "")
        with lattice_rule(""):  # BatchConfig's own rules: B >= d, n % (t x p) == 0
            self.config  # noqa: B018

    @property
    def config(self) -> BatchConfig:
        return BatchConfig(
            self.batch_size,
            self.num_devices,
            self.micro_batch_size,
            self.activation_checkpointing,
            self.reshard_after_forward,
            self.grad_sync,
            self.tensor_parallel,
            self.pipeline_parallel,
            self.pipeline_schedule,
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
