"""The arithmetic of a training step: fp32, tf32, bf16 autocast or fp16 with a scaler.

A trial measures the step people train, and nobody trains a transformer in plain fp32 on a
GPU: ``trial.precision: auto`` is bf16 autocast on a CUDA device that supports it (with
TF32 for the matmuls left in fp32), fp32 elsewhere. The master weights and the optimizer
stay in fp32 in every mode (autocast), as in Composer's ``amp_bf16`` and Lightning's
``bf16-mixed``. torch is imported lazily: the search driver imports this module's callers
without torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mbtune.config.trial import CUDA_ONLY_PRECISIONS
from mbtune.errors import MbtuneError

__all__ = ["Precision", "for_device", "resolve"]


def resolve(name: str, device: Any) -> str:
    """``trial.precision`` for a torch device: ``auto`` decided, a precision the device
    cannot run refused (MbtuneError, one line naming trial.precision)."""
    import torch

    cuda = device.type == "cuda"
    if name == "auto":
        return "bf16" if cuda and torch.cuda.is_bf16_supported() else "fp32"
    if name in CUDA_ONLY_PRECISIONS and not cuda:
        raise MbtuneError(
            f"trial.precision: {name} runs on CUDA only, and this trial runs on {device.type} "
            "(torch sees no CUDA device); use bf16 or fp32 on the CPU, or auto"
        )
    if name == "bf16" and cuda and not torch.cuda.is_bf16_supported():
        raise MbtuneError(
            f"trial.precision: bf16 is not supported by {torch.cuda.get_device_name(device)}; "
            "use fp16 (with a gradient scaler) or fp32"
        )
    return name


@dataclass
class Precision:
    """How one step computes: what the loss runs under, and how the optimizer steps."""

    name: str
    """``fp32``, ``tf32``, ``bf16`` or ``fp16`` (resolved)."""
    device_type: str
    scaler: Any = None
    """fp16's GradScaler: scales each micro-batch's loss, unscales before the step."""

    def autocast(self) -> contextlib.AbstractContextManager:
        import torch

        if self.name in ("bf16", "fp16"):
            dtype = torch.bfloat16 if self.name == "bf16" else torch.float16
            return torch.autocast(self.device_type, dtype=dtype)
        return contextlib.nullcontext()

    def loss(self, loss_fn: Callable) -> Callable:
        """``loss_fn`` run under autocast; with fp16, its value scaled by the scaler (the
        accumulated gradient is then unscaled once, in :meth:`step`)."""

        def scaled(model: Any, batch: Any) -> Any:
            with self.autocast():
                value = loss_fn(model, batch)
            return self.scaler.scale(value) if self.scaler is not None else value

        return scaled

    def step(self, optimizer: Any) -> None:
        if self.scaler is None:
            optimizer.step()
        else:
            self.scaler.step(optimizer)
            self.scaler.update()


def for_device(name: str, device: Any) -> Precision:
    """The :class:`Precision` of ``trial.precision`` on ``device``, its global switches set
    (TF32 matmuls on CUDA for tf32 and for what bf16 leaves in fp32; off for fp32, so that
    fp32 measures fp32)."""
    import torch

    resolved = resolve(name, device)
    if device.type == "cuda":
        tf32 = resolved in ("tf32", "bf16")
        torch.backends.cuda.matmul.allow_tf32 = tf32
        torch.backends.cudnn.allow_tf32 = tf32
    scaler = torch.amp.GradScaler("cuda") if resolved == "fp16" else None
    return Precision(resolved, device.type, scaler)
