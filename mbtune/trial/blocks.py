"""A model's repeated blocks, for a memory prediction that traces a few of them instead of
all (mbtune.trial.predict).

A transformer is a few modules around a run of identical blocks (its layers: a
``ModuleList`` or ``Sequential`` of one class, one shape), and every part of a step's
memory at its peak (parameters, gradients, optimizer state, the activations kept for the
backward pass, FSDP's buffers) is the same for each block of a run. So the peak is traced
on a copy of the model cut to :data:`BASE_DEPTH` blocks of every run, and again with one
run one block longer, for each run; each part grows by what that one block added, times
the blocks left out. A run of up to :data:`BASE_DEPTH` + 1 blocks is traced whole, and a
model with no such run (a user model whose forward indexes its blocks by a count it keeps
elsewhere fails the cut and is traced whole too) costs what the whole trace costs.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

__all__ = ["BASE_DEPTH", "cut", "repeated_blocks", "scaled_parts"]

BASE_DEPTH = 3
"""The blocks of each run a cut copy keeps: a first, a middle and a last, so that the block
a longer copy adds is a middle one, with a neighbour on each side, as most of a deep
model's are (FSDP holds the next block's all-gather while it runs one: with two blocks
only, a gpt sharded over 4 devices holds one all-gather buffer fewer at its peak, and the
extrapolation was 10% over)."""


def repeated_blocks(module: Any) -> dict[str, int]:
    """The runs of ``module`` worth cutting: each container (``ModuleList``, ``Sequential``)
    of more than ``BASE_DEPTH + 1`` blocks of one class whose parameters and buffers have the
    same names and shapes, by its dotted name, with its length; the outermost only (a run
    inside a block of another is cut with it)."""
    import torch.nn as nn

    runs: dict[str, int] = {}
    for name, container in module.named_modules():
        if not name or any(name.startswith(f"{run}.") for run in runs):
            continue
        if not isinstance(container, nn.ModuleList | nn.Sequential):
            continue
        blocks = list(container)
        if len(blocks) > BASE_DEPTH + 1 and len({_shape(b) for b in blocks}) == 1:
            runs[name] = len(blocks)
    return runs


def _shape(block: Any) -> tuple:
    return (
        type(block),
        tuple((n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()),
        tuple((n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()),
    )


def cut(module: Any, depths: dict[str, int]) -> Any:
    """A deep copy of ``module`` whose named runs keep only their first ``depths[name]``
    blocks; ``module`` itself is left whole."""
    import torch.nn as nn

    whole = {}
    for name, depth in depths.items():
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        container = getattr(owner, attr)
        whole[name] = (owner, attr, container)
        kept = list(container.named_children())[:depth]
        if isinstance(container, nn.Sequential):
            setattr(owner, attr, nn.Sequential(OrderedDict(kept)))
        else:
            setattr(owner, attr, nn.ModuleList(block for _, block in kept))
    try:
        return copy.deepcopy(module)
    finally:
        for owner, attr, container in whole.values():
            setattr(owner, attr, container)


def scaled_parts(
    runs: dict[str, int], trace: Callable[[dict[str, int]], list[dict[str, int]]]
) -> list[dict[str, int]]:
    """The parts of each candidate peak of the whole model from ``trace(depths)`` (those of
    a copy cut to ``depths``, candidate by candidate): traced at ``BASE_DEPTH`` blocks of
    every run, and with each run one block longer in turn; a part grows by what that block
    added, times the blocks cut."""
    base_depths = dict.fromkeys(runs, BASE_DEPTH)
    base = trace(base_depths)
    peaks = [dict(candidate) for candidate in base]
    for name, length in runs.items():
        longer = trace({**base_depths, name: BASE_DEPTH + 1})
        for peak, before, after in zip(peaks, base, longer, strict=True):
            for part, nbytes in after.items():
                peak[part] += (length - BASE_DEPTH) * (nbytes - before[part])
    return [{part: max(0, nbytes) for part, nbytes in peak.items()} for peak in peaks]
