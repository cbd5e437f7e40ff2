"""The experiment: its sections joined, the rules between them, and the lattice it searches.

An :class:`Experiment` is frozen and validated once, when it is built (from YAML by
mbtune.config.load, or in code); everything downstream takes it and trusts it, and a trial
receives it pickled.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mbtune import lattice
from mbtune.config.rules import ConfigError, check_fields
from mbtune.config.schema import ModelConfig, PlanConfig, RayConfig
from mbtune.config.search import DEFAULT_SPACE, IntRange, SearchConfig, SpaceConfig
from mbtune.config.train_input import TrainInput, lattice_rule, unused_values
from mbtune.config.trial import TrialConfig, unsharded_rule
from mbtune.lattice import (
    MAX_CONFIGS,
    SETTINGS,
    BatchConfig,
    ModelShape,
    model_rule,
)

__all__ = ["DEFAULT_NOISE_FLOOR", "Experiment"]

DEFAULT_NOISE_FLOOR = 0.035
"""Run-to-run drift assumed for real trials: bench/search_noise.py measured 3.4% (the
median over the quickstart's configurations of a robust sd across four whole searches)
on a shared 2-core CPU; a dedicated accelerator may drift less (set search.noise_floor)."""


@dataclass(frozen=True, kw_only=True)
class Experiment:
    """One experiment: the sections, and the rules between them (checked when built)."""

    name: str
    """Names the run directory: letters, digits, '_', '-', '.' (1-100); YAML: the file's
    name where the file gives none."""
    model: ModelConfig
    """The model a trial builds."""
    train_input: TrainInput
    """The user's own configuration."""
    search: SearchConfig = field(default_factory=SearchConfig)
    """How to search."""
    trial: TrialConfig = field(default_factory=TrialConfig)
    """How to measure one configuration."""
    ray: RayConfig = field(default_factory=RayConfig)
    """Where trials run."""
    plan: PlanConfig | None = None
    """The real run to plan (``mbtune plan``); None: no plan section."""
    output_dir: Path = Path("runs")
    """Where run directories are made."""
    source: Path | None = None
    """The YAML file this came from (None when built in code)."""
    model_shape: ModelShape | None = None
    """The model's layers, heads and widths, for Megatron's rules on a layout that splits
    it (mbtune.models.shape.shape_of; ``load_experiment(..., shape_of=...)`` finds it where
    a layout does); None: not known, and only the arithmetic of the sizes is checked."""

    def __post_init__(self) -> None:
        check_fields(self, "")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", self.name):
            raise ConfigError(
                "name",
                f"{self.name!r} is not a valid name: use letters, digits, '_', '-', '.' (1-100)",
            )
        if self.trial.backend == "replay" and self.trial.table is None:
            raise ConfigError("trial.table", "the replay backend needs trial.table: a CSV path")
        if self.trial.parallel == "ddp":
            self._check_ddp()
        self._check_layout()
        for key in ("reshard_after_forward", "grad_sync"):
            if key in self.search.space.settings and self.trial.sharding != "fsdp":
                raise ConfigError(f"search.space.{key}", unsharded_rule(key, self.trial.sharding))
        configs = self.configs()
        if not configs:
            why = "".join(f"; {line}" for line in self.unused_values(configs))
            raise ConfigError(
                "search.space", f"no valid configuration: {self._space_summary()}{why}"
            )
        space = set(configs)
        for i, point in enumerate(self.search.start_points):
            if point not in space:
                raise ConfigError(
                    f"search.start_points[{i}]",
                    ", ".join(
                        f"{k} {str(v).lower() if isinstance(v, bool) else v}"
                        for k, v in point.sizes().items()
                    )
                    + " is not in the search space; see `mbtune space` for the valid "
                    "configurations",
                )

    def _check_layout(self) -> None:
        """The user's own layout against Megatron's rules: its schedule's micro-batches,
        and the model."""
        t, tr = self.train_input, self.trial
        user = self.user_config
        why = user and user.schedule_problem
        if why:
            raise ConfigError("trial.pipeline_schedule", why)
        if self.model_shape is None or t.tensor_parallel * t.pipeline_parallel == 1:
            return
        why = model_rule(t.tensor_parallel, t.pipeline_parallel, tr.pipeline_schedule,
                         self.model_shape)  # fmt: skip
        if why:
            key = "tensor_parallel" if why.startswith("tensor") else "pipeline_parallel"
            valid = [k for k in range(1, 65) if not model_rule(
                *((k, 1) if key == "tensor_parallel" else (1, k)), tr.pipeline_schedule,
                self.model_shape)]  # fmt: skip
            raise ConfigError(
                f"train_input.{key}",
                f"{why}; valid {key} for this model: {', '.join(map(str, valid[:12]))}",
            )

    def _check_ddp(self) -> None:
        """What ``trial.parallel: ddp`` cannot do."""
        if self.trial.backend == "replay":
            raise ConfigError(
                "trial.parallel",
                "ddp runs real workers, but the replay backend answers from trial.table and "
                "runs nothing; use parallel: simulate with backend: replay",
            )
        gpus = self.gpus_per_trial
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
    def gpus_per_trial(self) -> float:
        """``ray.gpus_per_trial``, resolved for the trial's device where it is not set: a GPU
        for each trial (with ``parallel: ddp``, each worker) where ``trial.device`` is cuda,
        none otherwise. What a search and a ddp trial ask Ray for; `mbtune memory` and
        `mbtune validate` need no ``ray`` section for a cuda experiment."""
        if self.ray.gpus_per_trial is not None:
            return self.ray.gpus_per_trial
        return 1.0 if self.trial.device == "cuda" else 0.0

    @property
    def user_config(self) -> BatchConfig | None:
        """The user's own configuration (where the mode fixes m), with the trial's
        settings of a step (activation checkpointing, and sharded, FSDP's): the reference
        for "faster than yours"."""
        user = self.train_input.config
        if user is None:
            return None
        with lattice_rule("trial.pipeline_schedule"):
            return dataclasses.replace(
                user.with_settings(self.trial.settings),
                pipeline_schedule=self.trial.pipeline_schedule,
            )

    @property
    def noise_floor(self) -> float:
        """``search.noise_floor``, resolved for the backend (see SearchConfig): a replayed
        table does not drift unless ``trial.drift`` says it does, and then it stands for a
        real machine, whose drift the search does not know beforehand."""
        if self.search.noise_floor is not None:
            return self.search.noise_floor
        exact = self.trial.backend == "replay" and not self.trial.drift
        return 0.0 if exact else DEFAULT_NOISE_FLOOR

    # -- the lattice this experiment searches ------------------------------

    def configs(self) -> list[BatchConfig]:
        """Every configuration the search may try (see lattice.enumerate_configs), in the
        layouts Megatron's rules allow the model (:meth:`layouts`)."""
        return _enumerate(self.train_input, self.search.space, self.trial.settings,
                          self.layouts()[0])  # fmt: skip

    def layouts(self) -> tuple[list[tuple[int, int, str]], list[str]]:
        """The (t, p, schedule) the space lists (train_input's and trial's where it lists
        none) that split the model (all where its shape is not known), and a line for each
        that does not, why."""
        shape = self.model_shape
        s, t = self.search.space, self.train_input
        ts = _values(s.tensor_parallel) if s.tensor_parallel is not None else [t.tensor_parallel]
        ps = (_values(s.pipeline_parallel) if s.pipeline_parallel is not None
              else [t.pipeline_parallel])  # fmt: skip
        schedules = s.pipeline_schedule or (self.trial.pipeline_schedule,)
        kept: list[tuple[int, int, str]] = []
        dropped: list[str] = []
        for layout in dict.fromkeys(
            (tp, pp, sched if pp > 1 else "1f1b")
            for tp, pp, sched in itertools.product(ts, ps, schedules)
        ):
            why = model_rule(*layout, shape) if shape is not None else None
            if why:  # named by the value that breaks the rule: once for every layout with it
                tp, pp, sched = layout
                named = (f"tensor_parallel {tp}" if why.startswith("tensor_parallel")
                         else f"pipeline_parallel {pp} with {sched}")  # fmt: skip
                dropped.append(f"{named}: {why}")
            else:
                kept.append(layout)
        return kept, list(dict.fromkeys(dropped))

    def unused_values(self, configs: list[BatchConfig] | None = None) -> list[str]:
        """Each value the space lists that leaves no valid configuration, and why, one line
        per reason (config.train_input.unused_values): what `mbtune validate` and `mbtune
        space` say, and an empty space's error. ``configs``: :meth:`configs`, where the
        caller has them."""
        t, s = self.train_input, self.search.space
        layouts, dropped = self.layouts()
        if not layouts:  # no layout at all: that is why, whatever the sizes
            return dropped
        dropped += [
            f"{key} {value}: {why}"
            for key, value, why in _unused_layout_values(s, layouts, self.configs()
                                                          if configs is None else configs)
        ]  # fmt: skip
        batch: int | tuple[int, int] = t.batch_size if s.batch_size is None else (
            (s.batch_size.min, s.batch_size.max)
            if isinstance(s.batch_size, IntRange)
            else s.batch_size
        )  # fmt: skip
        ns = _values(s.num_devices) if s.num_devices is not None else None
        splits = sorted({tp * pp for tp, pp, _ in layouts})
        if ns is not None and splits != [1]:  # a count no layout divides: that is why
            undivided = [n for n in ns if all(n % k for k in splits)]
            ns = [n for n in ns if n not in undivided] or None
            dropped += [
                f"num_devices {n}: not a multiple of tensor_parallel x pipeline_parallel "
                f"({', '.join(map(str, splits))})"
                for n in undivided
            ]
        return dropped + unused_values(
            t,
            self.configs() if configs is None else configs,
            batch=batch,
            num_devices=ns,
            micro_batch_sizes=(
                s.micro_batch_size if isinstance(s.micro_batch_size, tuple) else None
            ),
            micro_batch_range=(  # one the user wrote: the default space's bounds the modes
                (s.micro_batch_size.min, s.micro_batch_size.max)
                if isinstance(s.micro_batch_size, IntRange) and s.source != DEFAULT_SPACE.source
                else None
            ),
        )

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
        """The resolved experiment, as YAML would spell it (for the run directory; the
        model's shape is the model's, found again)."""
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
                **({"plan": _plan_dict(self.plan)} if self.plan is not None else {}),
                "output_dir": self.output_dir,
            }
        )


def _unused_layout_values(
    s: SpaceConfig, layouts: list[tuple[int, int, str]], configs: list[BatchConfig]
) -> list[tuple[str, Any, str]]:
    """(key, value, why) for each tensor_parallel, pipeline_parallel or pipeline_schedule
    the space lists that the model takes (in ``layouts``) but no configuration has."""
    found = []
    for i, key in enumerate(("tensor_parallel", "pipeline_parallel")):
        listed = getattr(s, key)
        if listed is None:
            continue
        for value in _values(listed):
            if any(c.layout[i] == value for c in configs) or all(
                lay[i] != value for lay in layouts
            ):
                continue
            found.append((key, value, "no num_devices of the space is a multiple of "
                          "tensor_parallel x pipeline_parallel with it"))  # fmt: skip
    for schedule in s.pipeline_schedule or ():
        if any(lay[2] == schedule for lay in layouts) and not any(
            c.pipeline_schedule == schedule for c in configs
        ):
            found.append(("pipeline_schedule", schedule, "no configuration has the "
                          "micro-batches it needs (1f1b: g >= p, interleaved_1f1b: g a "
                          "multiple of p, dualpipev: g >= 2p)"))  # fmt: skip
    return found


def _plan_dict(plan: PlanConfig) -> dict[str, Any]:
    """The plan section as YAML spells it: the fields it sets (a tier: the keys it sets)."""
    return {
        k: {t: u for t, u in v.items() if u is not None} if isinstance(v, dict) else v
        for k, v in dataclasses.asdict(plan).items()
        if v is not None and v != ()
    }


def _enumerate(
    t: TrainInput, s: SpaceConfig, settings: tuple[Any, ...], layouts: list[tuple[int, int, str]]
) -> list[BatchConfig]:
    """The lattice of (B, n, m) and the ``layouts``, once per combination of the settings the
    space lists (the trial's own ``settings`` for those it does not)."""
    sizes = _enumerate_sizes(t, s, layouts)
    listed = s.settings
    choices = [listed.get(key, (own,)) for key, own in zip(SETTINGS, settings, strict=True)]
    combos = list(itertools.product(*choices))
    if len(sizes) * len(combos) > MAX_CONFIGS:
        raise ConfigError(
            "search.space",
            f"{len(sizes):,} sizes x {len(combos)} combinations of "
            f"{', '.join(listed)} are more than {MAX_CONFIGS:,} configurations; narrow its ranges",
        )
    return [c.with_settings(combo) for combo in combos for c in sizes]


def _enumerate_sizes(
    t: TrainInput, s: SpaceConfig, layouts: list[tuple[int, int, str]]
) -> list[BatchConfig]:
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
    with lattice_rule("search.space"):
        return lattice.enumerate_configs(
            mode=t.micro_batch_size,
            batch_sizes=batch_sizes,
            num_devices=ns,
            micro_batch_sizes=ms,
            batch_range=batch_range,
            allow_uneven=t.allow_uneven,
            layouts=layouts,
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
