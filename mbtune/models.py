"""The model zoo a trial measures: three small built-ins and the user's own models.

A model is a `ModelSpec`: the module, a function that makes a synthetic batch of n
samples directly on the device (a tensor, a tuple or list of tensors, or a mapping of
names to tensors; see mbtune.batch), and a loss that is the MEAN over the samples of the
batch. The trial scales each micro-batch loss by (micro-batch samples / P), so the
accumulated gradient equals the full-batch gradient exactly, unless the model mixes the
samples of a batch (BatchNorm, in-batch negatives): `ModelSpec.mixes_batch` says why.

Built-ins (small by default so CPU tests are fast, scalable through options):

    gpt     decoder-only transformer in the spirit of nanoGPT's model.py
    mlp     stack of Linear + ReLU layers, classification
    cnn_bn  small CNN with BatchNorm2d, classification (mixes the batch)

Hugging Face transformers models are named `hf:<model_type>` (see mbtune.hf). User
models are named `package.module:function`; see `experiments/user_model.py` for the
contract and an example.

Activation checkpointing (`build_model(..., activation_checkpointing=True)`) recomputes
each block's activations in the backward pass instead of keeping them: gpt's transformer
blocks, an hf: model's own layers (transformers' gradient checkpointing), and a user
model's blocks named by `model.checkpoint_blocks`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import math
import os
import re
import sys
import types
from collections import Counter
from collections.abc import Callable, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from mbtune.batch import batch_tensors, slice_batch
from mbtune.model_options import (
    HF_NAMES,
    MODEL_OPTIONS,
    ModelError,
    check_options,
    did_you_mean,
    hf_model_type,
    one_line,
    split_user_options,
)
from mbtune.model_spec import (
    Batch,
    LossFn,
    ModelSpec,
    batch_mixing_reason,
)

__all__ = [
    "BUILTIN_MODELS",
    "GPT",
    "MLP",
    "MODEL_OPTIONS",
    "ConvNetBN",
    "ModelError",
    "ModelSpec",
    "batch_mixing_reason",
    "build_model",
    "check_options",
    "slice_batch",
]


_BATCH_FORMS = "a tensor, a tuple or list of tensors, or a mapping of names to tensors"
_USER_CONTRACT = (
    "expected package.module:function where function(**options) returns "
    "(module, make_batch, loss): module a torch.nn.Module, make_batch(n, device) -> "
    f"{_BATCH_FORMS}, each with leading dimension n, loss(module, batch) -> "
    "scalar mean loss over the samples"
)
_USER_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


# -----------------------------------------------------------------------------
# gpt: nanoGPT-style decoder-only transformer


class CausalSelfAttention(nn.Module):
    def __init__(self, *, n_head: int, d_model: int, dropout: float):
        super().__init__()
        # key, query, value projections for all heads, in one matmul
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head = n_head
        self.d_model = d_model
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch, sequence length, d_model
        q, k, v = self.c_attn(x).split(self.d_model, dim=2)
        # (B, T, C) -> (B, n_head, T, head_dim): heads become a batch dimension
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble the heads
        return self.resid_dropout(self.c_proj(y))


class GPTMLP(nn.Module):
    def __init__(self, *, d_model: int, dropout: float):
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, *, n_head: int, d_model: int, dropout: float):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(n_head=n_head, d_model=d_model, dropout=dropout)
        self.ln_2 = nn.LayerNorm(d_model)
        self.mlp = GPTMLP(d_model=d_model, dropout=dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embedding, n_layer blocks, final LayerNorm, tied lm_head."""

    def __init__(
        self,
        *,
        n_layer: int,
        n_head: int,
        d_model: int,
        seq_len: int,
        vocab_size: int,
        dropout: float,
    ):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)  # token embedding
        self.wpe = nn.Embedding(seq_len, d_model)  # position embedding
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(n_head=n_head, d_model=d_model, dropout=dropout) for _ in range(n_layer)
        )
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        # weight tying: the output projection is the token embedding
        self.lm_head.weight = self.wte.weight

        # nanoGPT's init: N(0, 0.02), residual projections scaled down by the depth
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, d_model)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, vocab_size) logits


def _gpt_batch(n: int, device: torch.device, *, seq_len: int, vocab_size: int) -> Batch:
    # random tokens: throughput does not depend on what the tokens say
    idx = torch.randint(vocab_size, (n, seq_len), dtype=torch.long, device=device)
    targets = torch.randint(vocab_size, (n, seq_len), dtype=torch.long, device=device)
    return idx, targets


def _gpt_loss(module: nn.Module, batch: Batch) -> torch.Tensor:
    idx, targets = batch
    logits = module(idx)  # (n, T, V)
    # mean over all n*T tokens; every sample has T tokens, so it is also the mean over samples
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _build_gpt(
    *, n_layer: int, n_head: int, d_model: int, seq_len: int, vocab_size: int, dropout: float
) -> ModelSpec:
    module = GPT(
        n_layer=n_layer,
        n_head=n_head,
        d_model=d_model,
        seq_len=seq_len,
        vocab_size=vocab_size,
        dropout=dropout,
    )
    return ModelSpec(
        module=module,
        make_batch=functools.partial(_gpt_batch, seq_len=seq_len, vocab_size=vocab_size),
        loss_fn=_gpt_loss,
        tokens_per_sample=seq_len,
        mixes_batch=batch_mixing_reason(module),
    )


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
    "gpt": (_build_gpt, MODEL_OPTIONS["gpt"]),
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

    Weights are reproducible: torch's global RNG is seeded with `seed` first.
    """
    if not isinstance(name, str):
        raise ModelError(f"model.name: must be a string, got {name!r}; {_valid_names()}")
    options = dict(options)
    model_type = hf_model_type(name)
    if model_type is not None:
        from mbtune.hf import build_hf_model  # imports transformers, an optional extra

        return build_hf_model(
            model_type, options, seed=seed, activation_checkpointing=activation_checkpointing
        )
    if name in BUILTIN_MODELS:
        builder, _ = BUILTIN_MODELS[name]
        kwargs = check_options(name, options)
        if activation_checkpointing and name not in _BUILTIN_BLOCKS:
            raise ModelError(
                f"trial.activation_checkpointing: the built-in model {name!r} has no blocks "
                "to checkpoint; turn it off, or measure gpt, an hf: model, or your own model "
                "with model.checkpoint_blocks"
            )
        torch.manual_seed(seed)
        spec = builder(**kwargs)
        if activation_checkpointing:
            checkpoint_blocks(spec.module, (_BUILTIN_BLOCKS[name].__name__,))
        return spec
    if ":" in name:
        return _build_user_model(
            name, options, seed=seed, activation_checkpointing=activation_checkpointing
        )
    hint = did_you_mean(name, BUILTIN_MODELS)
    raise ModelError(f"model.name: unknown model {name!r}; {_valid_names()}{hint}; or {HF_NAMES}")


def checkpoint_blocks(module: nn.Module, class_names: tuple[str, ...]) -> int:
    """Checkpoint every submodule of `module` whose class is named in `class_names`: in
    training, its forward keeps only its inputs for the backward pass and recomputes the
    rest there (torch.utils.checkpoint, non-reentrant). Returns how many it wraps."""
    blocks = [sub for sub in module.modules() if type(sub).__name__ in class_names]
    for block in blocks:
        # a bound method, not a closure: a deep copy of the module checkpoints its own blocks
        block.forward = types.MethodType(_checkpointed_forward, block)
    return len(blocks)


# -----------------------------------------------------------------------------
# helpers


def _valid_names() -> str:
    return f"valid: {', '.join(BUILTIN_MODELS)}, or package.module:function"


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    forward = type(self).forward
    if self.training and torch.is_grad_enabled():
        return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)
    return forward(self, *args, **kwargs)  # evaluation keeps nothing for a backward pass


def _build_user_model(
    name: str, options: dict[str, object], *, seed: int, activation_checkpointing: bool
) -> ModelSpec:
    if not _USER_NAME.match(name):
        raise ModelError(
            f"model.name: {name!r} is not of the form package.module:function; {_valid_names()}"
        )
    module_name, function_name = name.split(":")

    # `mbtune run` from the project directory must find the project's own modules
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    importlib.invalidate_caches()
    try:
        py_module = importlib.import_module(module_name)
    except Exception as exc:
        raise ModelError(
            f"model.name: cannot import {module_name!r} ({one_line(exc)}); "
            "expected package.module:function importable from the current directory"
        ) from exc

    if not hasattr(py_module, function_name):
        public = [a for a in dir(py_module) if not a.startswith("_")]
        raise ModelError(
            f"model.name: module {module_name!r} has no attribute {function_name!r}"
            f"{did_you_mean(function_name, public)}; {_USER_CONTRACT}"
        )
    function = getattr(py_module, function_name)
    if not callable(function):
        raise ModelError(
            f"model.name: {name!r} is a {type(function).__name__}, not a function; {_USER_CONTRACT}"
        )
    block_names, options = split_user_options(options)
    _check_user_options(name, function, options)

    torch.manual_seed(seed)
    try:
        returned = function(**options)
    except Exception as exc:
        raise ModelError(f"model.name: {name!r} raised {one_line(exc)}") from exc

    module, make_batch, loss_fn = _check_user_return(name, returned)
    _checkpoint_user_blocks(name, module, block_names, asked=activation_checkpointing)

    # one small batch, now, so a broken make_batch fails here and not in every trial;
    # on a forked RNG, so that validating does not shift the caller's random stream
    with torch.random.fork_rng(devices=[]):
        try:
            _check_batch(make_batch(2, torch.device("cpu")), 2, name)
        except ModelError:
            raise
        except Exception as exc:
            raise ModelError(
                f"model.name: make_batch(2, cpu) from {name!r} raised {one_line(exc)}"
            ) from exc

    return ModelSpec(
        module=module,
        make_batch=functools.partial(_user_batch, make_batch, name),
        loss_fn=loss_fn,
        tokens_per_sample=None,
        mixes_batch=batch_mixing_reason(module),
    )


def _check_user_options(name: str, function: Callable, options: dict[str, object]) -> None:
    """Options that the function's signature cannot take, named as `model.<key>`."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature to check (a C function): let the call tell
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    accepted = [
        p.name
        for p in params.values()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    ]
    for key in options:
        if key not in accepted:
            raise ModelError(
                f"model.{key}: unknown option for model {name!r}; valid: "
                f"{', '.join(accepted) or '(none)'}{did_you_mean(str(key), accepted)}"
            )


def _check_user_return(name: str, returned: object) -> tuple[nn.Module, Callable, LossFn]:
    def fail(what: str) -> ModelError:
        return ModelError(f"model.name: {name!r} returned {what}; {_USER_CONTRACT}")

    if not isinstance(returned, tuple) or len(returned) != 3:
        size = f" of {len(returned)} items" if isinstance(returned, (tuple, list)) else ""
        raise fail(f"a {type(returned).__name__}{size}, not a 3-tuple")
    module, make_batch, loss_fn = returned
    if not isinstance(module, nn.Module):
        raise fail(f"a {type(module).__name__} as first item, not a torch.nn.Module")
    if not callable(make_batch):
        raise fail(f"a {type(make_batch).__name__} as make_batch, not a function")
    if not callable(loss_fn):
        raise fail(f"a {type(loss_fn).__name__} as loss, not a function")
    return module, make_batch, loss_fn


def _check_batch(value: object, n: int, name: str) -> Batch:
    """The user's batch, unchanged, once it is checked: a tensor, a tuple or list of
    tensors, or a mapping of names to tensors, each with leading dimension n."""
    where = f"model.name: make_batch({n}, device) from {name!r} returned"
    expected = f"expected {_BATCH_FORMS}, each with leading dimension {n}"
    if isinstance(value, Mapping):
        for key, t in value.items():
            if not isinstance(key, str) or not isinstance(t, torch.Tensor):
                raise ModelError(
                    f"{where} a {type(value).__name__} whose {key!r} is a "
                    f"{type(t).__name__}, not a tensor named by a string; {expected}"
                )
    elif isinstance(value, (tuple, list)):
        for i, t in enumerate(value):
            if not isinstance(t, torch.Tensor):
                raise ModelError(
                    f"{where} a {type(value).__name__} whose item {i} is a "
                    f"{type(t).__name__}, not a tensor; {expected}"
                )
    elif not isinstance(value, torch.Tensor):
        raise ModelError(f"{where} a {type(value).__name__}; {expected}")
    tensors = batch_tensors(value)
    if not tensors:
        raise ModelError(f"{where} an empty {type(value).__name__}; {expected}")
    if any(t.dim() == 0 or t.shape[0] != n for t in tensors):
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise ModelError(
            f"{where} tensors of shapes {shapes}; every tensor must have leading "
            f"dimension {n} (one row per sample)"
        )
    return value


def _user_batch(make_batch: Callable, name: str, n: int, device: torch.device) -> Batch:
    return _check_batch(make_batch(n, device), n, name)


def _checkpoint_user_blocks(
    name: str, module: nn.Module, block_names: tuple[str, ...], *, asked: bool
) -> None:
    """Checkpoint the blocks `model.checkpoint_blocks` names, if asked; a name that matches
    no submodule fails either way (a search may turn checkpointing on later)."""
    prefix = "trial.activation_checkpointing" if asked else "model.checkpoint_blocks"
    repeated = Counter(type(sub).__name__ for sub in module.modules() if any(sub.children()))
    blocks = ", ".join(f"{c} (x{k})" for c, k in repeated.most_common(4) if k > 1) or "none"
    if not block_names:
        if asked:
            raise ModelError(
                f"{prefix}: user model {name!r} does not say what to checkpoint; set "
                "model.checkpoint_blocks to the class name of its repeated block "
                f"(its repeated submodules: {blocks}), or turn checkpointing off"
            )
        return
    classes = {type(sub).__name__ for sub in module.modules()}
    for block in block_names:
        if block not in classes:
            raise ModelError(
                f"{prefix}: model.checkpoint_blocks {block!r} matches no submodule of "
                f"{name!r}{did_you_mean(block, classes)}; its repeated submodules: {blocks}"
            )
    if asked:
        checkpoint_blocks(module, block_names)
