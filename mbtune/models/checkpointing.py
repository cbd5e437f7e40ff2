"""Activation checkpointing of a model's blocks: in training, each block keeps only its
inputs for the backward pass and recomputes the rest there (torch.utils.checkpoint,
non-reentrant). The built-in gpt checkpoints its `Block`s and a user model the classes
named by ``model.checkpoint_blocks``; an ``hf:`` model uses transformers' own switch
(mbtune.models.hf)."""

from __future__ import annotations

import types

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

__all__ = ["checkpoint_blocks"]


def checkpoint_blocks(module: nn.Module, class_names: tuple[str, ...]) -> int:
    """Checkpoint every submodule of `module` whose class is named in `class_names`: in
    training, its forward keeps only its inputs for the backward pass and recomputes the
    rest there (torch.utils.checkpoint, non-reentrant). Returns how many it wraps."""
    blocks = [sub for sub in module.modules() if type(sub).__name__ in class_names]
    for block in blocks:
        # a bound method, not a closure: a deep copy of the module checkpoints its own blocks
        block.forward = types.MethodType(_checkpointed_forward, block)
    return len(blocks)


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    forward = type(self).forward
    if self.training and torch.is_grad_enabled():
        return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)
    return forward(self, *args, **kwargs)  # evaluation keeps nothing for a backward pass
