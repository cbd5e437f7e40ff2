"""FLOPs of a training step, and how much of the device's peak a trial achieved (MFU).

The FLOPs are counted, not estimated per model: torch's ``FlopCounterMode`` counts the
matmuls, convolutions and attention of one forward pass of any model, once per trial and
outside the timing. A training step is three times its forward pass (the backward pass
computes the gradients of inputs and of weights, each as much as the forward), which is
the convention of MFU (PaLM, nanoGPT): activation checkpointing's recompute is work the
hardware does, not progress of the model, so it is not counted.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

__all__ = [
    "PEAK_TFLOPS",
    "attention_flops",
    "count_flops_per_sample",
    "device_peak",
    "peak_tflops",
    "utilisation",
]

PEAK_TFLOPS: tuple[tuple[str, dict[str, float]], ...] = (
    (r"H100.*PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0}),
    (r"H100.*NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    (r"H100|H200|GH200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),
    (r"A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    (r"L40S", {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6}),
    (r"\bL4\b", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    (r"\bA10\b", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    (r"V100", {"fp16": 125.0, "fp32": 15.7}),
)
"""Dense peak TFLOP/s of one device by precision (NVIDIA's datasheets, without sparsity;
SXM figures where a card comes in several forms, unless the name says otherwise), matched
against torch.cuda.get_device_name in this order. A device or precision not here has no
known peak: set ``trial.peak_tflops``."""


def peak_tflops(device_name: str, precision: str) -> float | None:
    """The known dense peak of ``device_name`` at ``precision``, or None."""
    for pattern, peaks in PEAK_TFLOPS:
        if re.search(pattern, device_name):
            return peaks.get(precision)
    return None


def device_peak(device: Any, precision: str, given: float | None = None) -> float | None:
    """The peak a trial on ``device`` is measured against: ``given`` (trial.peak_tflops)
    where set, else the table's for a CUDA card, else None (a CPU's is not known)."""
    if given:
        return given
    if device.type != "cuda":
        return None
    import torch

    return peak_tflops(torch.cuda.get_device_name(device), precision)


def attention_flops(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    """FLOPs of one fused attention's forward pass, from the shapes (batch, heads, tokens,
    width) of its query, key and value: the scores (q k^T) and their product with v, over
    the query's heads; key and value may have fewer heads (grouped-query attention), each
    shared by a group of the query's. Causal masking is not discounted (as torch's count)."""
    b, heads, s_q, d = query
    s_k, d_v = key[-2], value[-1]
    return 2 * b * heads * s_q * s_k * (d + d_v)


def count_flops_per_sample(loss_fn: Callable, module: Any, batch: Any, samples: int) -> float:
    """Model FLOPs of one sample's training step: 3 x the forward pass of ``batch`` (of
    ``samples`` samples), counted by FlopCounterMode on ``module`` run eagerly, without
    gradients (so no activation is kept, and no checkpoint recomputes)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    # every fused attention kernel counted by one formula: the CPU's has none of its own
    # (torch 2.13: an attention-heavy model's FLOPs were a third short), and before torch
    # 2.13 the CUDA ones refused grouped-query attention (key and value with fewer heads:
    # a bf16 Llama's trial failed on an H200 with torch 2.11)
    kernels = (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    mapping = {op: attention_flops for name in kernels
               if (op := getattr(torch.ops.aten, name, None)) is not None}  # fmt: skip
    counter = FlopCounterMode(display=False, custom_mapping=mapping)
    with torch.no_grad(), counter:
        loss_fn(module, batch)
    return 3 * counter.get_total_flops() / samples


def utilisation(
    flops_per_sample: float | None,
    samples_per_s: float | None,
    num_devices: int,
    peak: float | None,
) -> tuple[float | None, float | None]:
    """(achieved TFLOP/s of one device, MFU = achieved / peak); None where unknown."""
    if not flops_per_sample or not samples_per_s:
        return None, None
    achieved = flops_per_sample * samples_per_s / num_devices / 1e12
    return achieved, (achieved / peak if peak else None)
