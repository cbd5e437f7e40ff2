"""What Megatron's rules need of a model (mbtune.lattice.ModelShape): its layers, heads,
key/value heads, MLP width and the width of what passes between its blocks, read off the
built module: the built-in GPT's, a Hugging Face model's config, or a user model's
``mbtune_shape`` attribute (a ModelShape, or a mapping of its fields). A model that says
nothing has an unknown shape, and only t = p = 1 runs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from mbtune.config.model_options import ModelError
from mbtune.config.schema import ModelConfig
from mbtune.lattice import ModelShape

__all__ = ["SHAPE_ATTR", "model_shape", "shape_of"]

SHAPE_ATTR = "mbtune_shape"
"""The attribute a user model sets to its shape: a ModelShape or a mapping of its fields
(``layers``, ``heads``, ``kv_heads``, ``mlp_width``, ``vocab``, ``hidden``)."""


def model_shape(module: Any) -> ModelShape:
    """The shape of a built ``module`` (on any device, the meta device too)."""
    declared = getattr(module, SHAPE_ATTR, None)
    if declared is not None:
        return _declared(declared)
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "num_hidden_layers"):  # a Hugging Face model
        heads = getattr(config, "num_attention_heads", None)
        return ModelShape(
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            mlp_width=getattr(config, "intermediate_size", None),
            hidden=getattr(config, "hidden_size", None),
        )
    blocks = getattr(module, "blocks", None)
    attention = getattr(blocks[0], "attn", None) if blocks is not None and len(blocks) else None
    if attention is not None and hasattr(attention, "c_proj"):  # the built-in GPT
        hidden = attention.c_proj.out_features
        head_dim = getattr(attention, "head_dim", None)
        heads = hidden // head_dim if head_dim else attention.n_head
        return ModelShape(
            layers=len(blocks),
            heads=heads,
            kv_heads=heads,
            mlp_width=blocks[0].mlp.c_fc.out_features,
            hidden=hidden,
        )
    return ModelShape()


def shape_of(model: ModelConfig) -> ModelShape:
    """The shape of an experiment's model, built on torch's meta device (no memory, no
    weights)."""
    import torch

    from mbtune.models.build import build_from_config

    with torch.device("meta"):
        return model_shape(build_from_config(model).module)


def _declared(value: Any) -> ModelShape:
    if isinstance(value, ModelShape):
        return value
    names = {f.name for f in dataclasses.fields(ModelShape)}
    if not isinstance(value, Mapping) or set(value) - names:
        raise ModelError(
            f"model.{SHAPE_ATTR}: expected a mbtune.lattice.ModelShape or a mapping of "
            f"{', '.join(sorted(names))}, got {value!r}"
        )
    return ModelShape(**value)
