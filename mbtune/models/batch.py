"""The forms a batch takes, and how a batch is cut into micro-batches.

A model's ``make_batch(n, device)`` returns one of three forms, every tensor with the n
samples along dimension 0:

    a tensor                      x
    a tuple or list of tensors    (x, y)
    a mapping of names to tensors {"input_ids": ..., "attention_mask": ..., "labels": ...}

A micro-batch has the form of the batch it was cut from: a bare tensor stays a bare
tensor, a dict stays a dict (what ``module(**batch)`` expects), a tuple stays a tuple.

Pure Python: no torch import (the search driver imports the trial module, and through
it this one); a tensor is whatever is neither a mapping nor a tuple or list.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["batch_tensors", "num_samples", "slice_batch", "split_batch"]


def batch_tensors(batch: Any) -> list[Any]:
    """The tensors of ``batch``, in order (a mapping's in the order of its keys)."""
    if isinstance(batch, Mapping):
        return list(batch.values())
    if isinstance(batch, (tuple, list)):
        return list(batch)
    return [batch]


def num_samples(batch: Any) -> int:
    """The samples in ``batch``: the leading dimension of its first tensor (0 if none)."""
    tensors = batch_tensors(batch)
    return tensors[0].shape[0] if tensors else 0


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples [start, stop) of every tensor of ``batch``, in ``batch``'s form (views,
    no copies)."""
    n = num_samples(batch)
    if not 0 <= start < stop <= n:
        raise ValueError(
            f"slice_batch: need 0 <= start < stop <= {n} (the batch has {n} samples), "
            f"got start={start}, stop={stop}"
        )
    if isinstance(batch, Mapping):
        rows = {key: t[start:stop] for key, t in batch.items()}
        # a dict subclass (transformers' BatchEncoding) stays what it was
        return rows if type(batch) is dict else type(batch)(rows)
    if isinstance(batch, (tuple, list)):
        rows = [t[start:stop] for t in batch]
        if hasattr(batch, "_fields"):  # a namedtuple
            return type(batch)(*rows)
        return type(batch)(rows)
    return batch[start:stop]


def split_batch(batch: Any, sizes: Sequence[int]) -> list[Any]:
    """Consecutive micro-batches of the given sizes, each in the form of ``batch``: views of
    ``batch``, no copies."""
    bounds = [0, *itertools.accumulate(sizes)]
    return [slice_batch(batch, a, b) for a, b in itertools.pairwise(bounds)]
