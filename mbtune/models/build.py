"""The model zoo a trial measures: three small built-ins, Hugging Face models and the
user's own, built by `build_model` (a caller's name and options, checked) or by
`build_from_config` (an Experiment's, which its config checked), and checked in the
driver by `check_model`.

A model is a `ModelSpec` (mbtune.models.spec): the module, a function that makes a
synthetic batch of n samples directly on the device (a tensor, a tuple or list of
tensors, or a mapping of names to tensors; see mbtune.models.batch), and a loss that is the MEAN
over the samples of the batch. The trial scales each micro-batch loss by (micro-batch
samples / P), so the accumulated gradient equals the full-batch gradient exactly, unless
the model mixes the samples of a batch (BatchNorm, in-batch negatives): `ModelSpec.mixes_batch`
says why.

Built-ins (small by default so CPU tests are fast, scalable through options):

    gpt     decoder-only transformer in the spirit of nanoGPT's model.py (mbtune.models.gpt)
    mlp     stack of Linear + ReLU layers, classification
    cnn_bn  small CNN with BatchNorm2d, classification (mixes the batch)

Hugging Face transformers models are named `hf:<model_type>` (mbtune.models.hf). User models
are named `package.module:function` (mbtune.models.user; `experiments/user_model.py` is
an example).

Activation checkpointing (`build_model(..., activation_checkpointing=True)`) recomputes
each block's activations in the backward pass instead of keeping them: gpt's transformer
blocks, an hf: model's own layers (transformers' gradient checkpointing), and a user
model's blocks named by `model.checkpoint_blocks` (mbtune.models.checkpointing).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
import torch.nn.functional as F

from mbtune.config.model_options import (
    MODEL_OPTIONS,
    ModelError,
    check_model_name,
    check_options,
    hf_model_type,
    with_defaults,
)
from mbtune.models.checkpointing import checkpoint_blocks
from mbtune.models.gpt import Block, build_gpt
from mbtune.models.spec import Batch, ModelSpec, batch_mixing_reason
from mbtune.models.user import build_user_model

if TYPE_CHECKING:
    from mbtune.config.schema import ModelConfig

__all__ = [
    "BUILTIN_MODELS",
    "MLP",
    "ConvNetBN",
    "build_from_config",
    "build_model",
    "check_model",
]


# -----------------------------------------------------------------------------
# mlp and cnn_bn: classification on random inputs


class MLP(nn.Module):
    """in_features -> hidden, (n_layer - 1) x hidden -> hidden, each + ReLU; -> num_classes."""

    def __init__(self, *, in_features: int, hidden: int, n_layer: int, num_classes: int):
        super().__init__()
        layers: list[nn.Module] = []
        width = in_features
        for _ in range(n_layer):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # (n, in_features) -> (n, num_classes) logits


class ConvNetBN(nn.Module):
    """Two conv + BatchNorm2d + ReLU stages, global average pool, linear classifier."""

    def __init__(self, *, channels: int, width: int, num_classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(channels, width, 3, padding=1, bias=False),  # (n, width, H, W)
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, stride=2, padding=1, bias=False),  # (n, 2w, H/2, W/2)
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),  # (n, 2w, 1, 1)
            nn.Flatten(),  # (n, 2w)
        )
        self.classifier = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))  # (n, num_classes) logits


def _classification_batch(
    n: int, device: torch.device, *, shape: tuple[int, ...], num_classes: int
) -> Batch:
    x = torch.randn((n, *shape), device=device)
    y = torch.randint(num_classes, (n,), dtype=torch.long, device=device)
    return x, y


def _classification_loss(module: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(module(x), y)  # mean over the samples


def _build_mlp(*, in_features: int, hidden: int, n_layer: int, num_classes: int) -> ModelSpec:
    module = MLP(in_features=in_features, hidden=hidden, n_layer=n_layer, num_classes=num_classes)
    return ModelSpec(
        module=module,
        make_batch=functools.partial(
            _classification_batch, shape=(in_features,), num_classes=num_classes
        ),
        loss_fn=_classification_loss,
        tokens_per_sample=None,
        mixes_batch=batch_mixing_reason(module),
    )


def _build_cnn_bn(*, image_size: int, channels: int, width: int, num_classes: int) -> ModelSpec:
    module = ConvNetBN(channels=channels, width=width, num_classes=num_classes)
    return ModelSpec(
        module=module,
        make_batch=functools.partial(
            _classification_batch,
            shape=(channels, image_size, image_size),
            num_classes=num_classes,
        ),
        loss_fn=_classification_loss,
        tokens_per_sample=None,
        mixes_batch=batch_mixing_reason(module),
    )


BUILTIN_MODELS: dict[str, tuple[Callable[..., ModelSpec], Mapping[str, object]]] = {
    "gpt": (build_gpt, MODEL_OPTIONS["gpt"]),
    "mlp": (_build_mlp, MODEL_OPTIONS["mlp"]),
    "cnn_bn": (_build_cnn_bn, MODEL_OPTIONS["cnn_bn"]),
}
"""name -> (builder, default options); builder(**options) -> ModelSpec."""

_BUILTIN_BLOCKS: dict[str, type[nn.Module]] = {"gpt": Block}
"""The built-ins that can checkpoint activations -> the block each checkpoints."""


# -----------------------------------------------------------------------------
# public functions


def build_model(
    name: str,
    options: Mapping[str, object],
    *,
    seed: int = 0,
    activation_checkpointing: bool = False,
) -> ModelSpec:
    """Build the model `name` (a built-in, `hf:<model_type>` or `package.module:function`)
    with `options`; with `activation_checkpointing`, its blocks recompute their
    activations in the backward pass (ModelError where the model has none to name).

    For a caller with a name and options of its own: the name and a built-in's options are
    checked first (ModelError). An Experiment's model, which the config checked, is built
    by `build_from_config`. Weights are reproducible: torch's global RNG is seeded with
    `seed` first.
    """
    check_model_name(name)
    if name in BUILTIN_MODELS:
        options = check_options(name, options)
    return _build(name, options, seed=seed, activation_checkpointing=activation_checkpointing)


def build_from_config(
    model: ModelConfig, *, seed: int = 0, activation_checkpointing: bool = False
) -> ModelSpec:
    """`build_model` for an Experiment's model, whose name and options its `ModelConfig`
    checked when it was made: a built-in's options are overlaid on its defaults without
    being checked again."""
    options = model.options
    if model.name in BUILTIN_MODELS:
        options = with_defaults(model.name, options)
    return _build(model.name, options, seed=seed, activation_checkpointing=activation_checkpointing)


def check_model(model: ModelConfig) -> None:
    """Check what only building an Experiment's model can tell, in the driver, before
    anything is measured: a user model is imported and called and its contract checked
    (its code runs; it is built for real); an ``hf:`` model is built on torch's meta
    device (every check of its config and head, but no memory and no weights, so a 7B
    model takes milliseconds); a built-in's options the config has checked already."""
    model_type = hf_model_type(model.name)
    if model_type is not None:
        from mbtune.models.hf import build_hf_model  # imports transformers, an optional extra

        build_hf_model(
            model_type, dict(model.options), seed=0, activation_checkpointing=False, meta=True
        )
    elif model.name not in BUILTIN_MODELS:
        build_user_model(model.name, model.options, seed=0, activation_checkpointing=False)


# -----------------------------------------------------------------------------
# helpers


def _build(
    name: str, options: Mapping[str, object], *, seed: int, activation_checkpointing: bool
) -> ModelSpec:
    """The model `name` with `options`, a built-in's complete (its defaults overlaid)."""
    model_type = hf_model_type(name)
    if model_type is not None:
        from mbtune.models.hf import build_hf_model  # imports transformers, an optional extra

        return build_hf_model(
            model_type, dict(options), seed=seed, activation_checkpointing=activation_checkpointing
        )
    if name not in BUILTIN_MODELS:
        return build_user_model(
            name, options, seed=seed, activation_checkpointing=activation_checkpointing
        )
    if activation_checkpointing and name not in _BUILTIN_BLOCKS:
        raise ModelError(
            f"trial.activation_checkpointing: the built-in model {name!r} has no blocks "
            "to checkpoint; turn it off, or measure gpt, an hf: model, or your own model "
            "with model.checkpoint_blocks"
        )
    builder, _ = BUILTIN_MODELS[name]
    torch.manual_seed(seed)
    spec = builder(**options)
    if activation_checkpointing:
        checkpoint_blocks(spec.module, (_BUILTIN_BLOCKS[name].__name__,))
    return spec
