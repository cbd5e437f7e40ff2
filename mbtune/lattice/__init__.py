"""The batch lattice: which (batch_size, num_devices, micro_batch_size) can run, and how.

Pure integer arithmetic (no torch, no ray), in the vocabulary of docs/design.md:

    B  batch_size         global batch, samples per optimizer step, all devices together
    n  num_devices        every device of the trial: n = d x t x p
    t  tensor_parallel    devices one layer's weights are split over (Megatron's tp)
    p  pipeline_parallel  pipeline stages, each its own devices (Megatron's pp)
    d  data_parallel      n / (t x p): replicas of the model, each with its share of B
    P  per_device_batch   ceil(B / d): one replica's batch; replicas differ by at most one
    m  micro_batch_size   samples in one forward/backward pass
    g  grad_accum_steps   ceil(P / m): a replica's micro-batches, a pipeline's too

A configuration is *strictly valid* (what Cerebras requires of an explicit
micro_batch_size) when B >= d, B % d == 0 and (B / d) % m == 0. Uneven splits are
allowed only where the mode or ``allow_uneven`` says so, and never with a pipeline or
tensor parallelism (Megatron's B = d x m x g). A layout (t, p and the pipeline's schedule)
keeps Megatron's rules too (:func:`layout_rule`, :func:`model_rule`). The rules in words,
for a person, with the nearest values that keep them, are mbtune.config.train_input's.
"""

from mbtune.lattice.arithmetic import (
    GRAD_SYNCS,
    LAYOUT,
    MAX_CONFIGS,
    MODES,
    PIPELINE_SCHEDULES,
    SETTINGS,
    GradSync,
    LatticeError,
    ModelShape,
    PipelineSchedule,
    bubble_fraction,
    canonical_micro_batch_size,
    divisors,
    even_split,
    grad_accum_steps,
    is_strictly_valid,
    layout_rule,
    model_rule,
    nearest_valid_batch_sizes,
    per_device_batch,
    stages_per_rank,
    valid_micro_batch_sizes,
    valid_num_devices,
)
from mbtune.lattice.configs import BatchConfig, as_flag, enumerate_configs

__all__ = [
    "BatchConfig",
    "GRAD_SYNCS",
    "GradSync",
    "LAYOUT",
    "LatticeError",
    "MAX_CONFIGS",
    "MODES",
    "ModelShape",
    "PIPELINE_SCHEDULES",
    "PipelineSchedule",
    "SETTINGS",
    "as_flag",
    "bubble_fraction",
    "canonical_micro_batch_size",
    "divisors",
    "enumerate_configs",
    "even_split",
    "grad_accum_steps",
    "is_strictly_valid",
    "layout_rule",
    "model_rule",
    "nearest_valid_batch_sizes",
    "per_device_batch",
    "stages_per_rank",
    "valid_micro_batch_sizes",
    "valid_num_devices",
]
