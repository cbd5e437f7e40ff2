"""What the plan needs of the experiment's model: the bytes one step's collectives move
(its trainable parameters) and, where the run split it, its shape (the width between its
blocks and their number), each counted on torch's meta device (no memory, no weights: a 7B
model takes milliseconds), for a replay run too. The one module of the room that touches
torch and mbtune.models, and only inside its functions."""

from __future__ import annotations

from mbtune.config.schema import ModelConfig
from mbtune.lattice import ModelShape

__all__ = ["gradient_bytes", "split_shape"]


def gradient_bytes(model: ModelConfig) -> int:
    """Bytes of the gradients a data-parallel step all-reduces
    (:attr:`mbtune.models.spec.ModelSpec.gradient_bytes`), of the model built on the meta
    device."""
    import torch

    from mbtune.models.build import build_from_config

    with torch.device("meta"):
        return build_from_config(model).gradient_bytes


def split_shape(model: ModelConfig) -> ModelShape:
    """The model's shape (mbtune.models.shape.shape_of: built on the meta device), whose
    ``hidden`` and ``layers`` count a split model's tensor-parallel and pipeline traffic."""
    from mbtune.models.shape import shape_of

    return shape_of(model)
