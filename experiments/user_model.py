"""An example user model for mbtune: a small regression MLP.

Name it in an experiment as `experiments.user_model:build`; every other key under
`model:` is passed to `build` as a keyword argument, e.g.

    model:
      name: experiments.user_model:build
      hidden: 128

The contract (checked when the model is built):

- `build(**options)` returns a 3-tuple `(module, make_batch, loss)`.
- `module` is a `torch.nn.Module`; mbtune moves it to the device and compiles it.
- `make_batch(n, device)` returns a tensor, a tuple or list of tensors, or a mapping of
  names to tensors (what a Hugging Face collator gives: {"input_ids": ..., "labels":
  ...}), every tensor with leading dimension n (one row per sample), created directly
  on `device` from torch's global RNG (mbtune seeds it).
- `loss(module, batch)` returns the scalar MEAN loss over the samples of `batch`, which
  arrives in the form make_batch returned: a micro-batch of a bare tensor is a bare
  tensor, of a dict a dict (so `module(**batch).loss` works). mbtune scales each
  micro-batch loss by (micro-batch samples / per-device batch), so the accumulated
  gradient equals the full-batch gradient.
- If the loss is not a sum over samples (BatchNorm, in-batch negatives, a contrastive
  loss), set `module.mbtune_mixes_batch = "a sentence saying why"`; mbtune then tries
  only micro_batch_size = per-device batch. BatchNorm layers are detected on their own.
- Activation checkpointing (`trial.activation_checkpointing`): name the class of the
  model's repeated block in the reserved key `model.checkpoint_blocks` (e.g. `Block`, or
  a list of class names; it is not passed to `build`). mbtune then recomputes the
  activations of every submodule of that class in the backward pass
  (torch.utils.checkpoint, non-reentrant). This model is too small to have blocks.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


def build(in_features: int = 16, hidden: int = 64):
    module = nn.Sequential(
        nn.Linear(in_features, hidden),
        nn.Tanh(),
        nn.Linear(hidden, 1),
    )

    def make_batch(n: int, device: torch.device):
        x = torch.randn(n, in_features, device=device)  # (n, in_features)
        y = torch.sin(x.sum(dim=1, keepdim=True))  # (n, 1): a smooth target to regress
        return x, y

    def loss(module: nn.Module, batch):
        x, y = batch
        return F.mse_loss(module(x), y)  # mean over the n samples

    return module, make_batch, loss
