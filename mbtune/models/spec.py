"""What a trial measures of a model: its `ModelSpec`, and whether its loss mixes the
samples of a batch (then gradient accumulation is not exact).

Apart from mbtune.models.build so that the built-ins, user models and Hugging Face models
(mbtune.models.hf) all build specs without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from mbtune.config.model_options import ModelError

__all__ = ["MIXES_BATCH_ATTR", "Batch", "LossFn", "MakeBatch", "ModelSpec", "batch_mixing_reason"]

Batch = torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor] | Mapping[str, torch.Tensor]
MakeBatch = Callable[[int, torch.device], Batch]
LossFn = Callable[[nn.Module, Batch], torch.Tensor]

# the attribute a user module (or any of its submodules) sets to a sentence saying why
# its loss is not a sum over samples, e.g. "the loss uses in-batch negatives"
MIXES_BATCH_ATTR = "mbtune_mixes_batch"


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """Everything a trial needs to measure one model."""

    module: nn.Module
    """The model, on the CPU and in training mode; the trial moves and compiles it."""

    make_batch: MakeBatch
    """make_batch(n, device) -> a tensor, a tuple or list of tensors, or a mapping of names
    to tensors, dim 0 = sample, created on `device` from torch's global RNG (the trial
    seeds it)."""

    loss_fn: LossFn
    """loss_fn(module, batch) -> scalar MEAN loss over the samples of the batch, which
    comes in the form make_batch returned (a micro-batch too: mbtune.models.batch.slice_batch)."""

    tokens_per_sample: int | None
    """seq_len for language models (for tokens/s), None otherwise."""

    mixes_batch: str | None
    """None if gradient accumulation is exact; else a sentence saying why it is not."""

    @property
    def gradient_bytes(self) -> int:
        """The bytes of the gradients a data-parallel step all-reduces: every trainable
        parameter at its own width (fp32 master weights under autocast: 4 bytes each); on
        the meta device too (the plan counts them there)."""
        return sum(p.numel() * p.element_size() for p in self.module.parameters()
                   if p.requires_grad)  # fmt: skip


def batch_mixing_reason(module: nn.Module) -> str | None:
    """Why gradient accumulation is not exact for `module`, as a sentence; None if it is.

    BatchNorm layers (any `_BatchNorm`: 1d/2d/3d, SyncBatchNorm, lazy variants) normalise
    with statistics of the whole batch; a submodule may also declare
    `mbtune_mixes_batch = "reason"` (in-batch negatives, a contrastive loss, ...).
    """
    batchnorms: list[str] = []
    declared: list[str] = []
    for path, sub in module.named_modules():
        where = path or "model"
        if isinstance(sub, _BatchNorm):
            batchnorms.append(f"{where}: {type(sub).__name__}")
        reason = getattr(sub, MIXES_BATCH_ATTR, None)
        if reason is None:
            continue
        if not isinstance(reason, str) or not reason.strip():
            raise ModelError(
                f"model.{MIXES_BATCH_ATTR}: must be a non-empty sentence (str) saying why the "
                f"model mixes the samples of a batch, got {reason!r} on {where}"
            )
        declared.append(f"{reason.strip().rstrip('.')} (declared by {where})")

    reasons: list[str] = []
    if batchnorms:
        shown = ", ".join(batchnorms[:3])
        if len(batchnorms) > 3:
            shown += f", and {len(batchnorms) - 3} more"
        reasons.append(
            f"the model has BatchNorm layers ({shown}), whose statistics mix the samples of "
            "a batch, so gradient accumulation is not exact"
        )
    reasons += declared
    return "; ".join(reasons) if reasons else None
