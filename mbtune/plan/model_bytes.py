"""The bytes one step's collectives move: the model's trainable parameters, counted on
torch's meta device (no memory, no weights: a 7B model takes milliseconds), for a replay
run too. The one module of the room that touches torch, and only inside its function."""

from __future__ import annotations

from mbtune.config.schema import ModelConfig

__all__ = ["gradient_bytes"]


def gradient_bytes(model: ModelConfig) -> int:
    """Bytes of the gradients a data-parallel step all-reduces
    (:attr:`mbtune.models.spec.ModelSpec.gradient_bytes`), of the model built on the meta
    device."""
    import torch

    from mbtune.models.build import build_from_config

    with torch.device("meta"):
        return build_from_config(model).gradient_bytes
