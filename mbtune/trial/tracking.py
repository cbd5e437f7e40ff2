"""torch's memory trackers over steps on fake tensors: what a memory prediction
(mbtune.trial.predict, and for a split model mbtune.trial.predict_stage) counts, part by
part, at a step's peak.

The tools are torch's: ``FakeTensorMode`` (``torch._subclasses.fake_tensor``: every tensor
its shape, dtype and size, and no storage), ``FSDPMemTracker`` and ``MemTracker``
(``torch.distributed._tools``): private modules, but the only tools that follow every
tensor of a step by the part it belongs to, as torchtitan's memory estimation uses them. A
torch that moved them is one line, not a traceback.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from mbtune.errors import MbtuneError

__all__ = [
    "PARTS",
    "STEPS",
    "Trackers",
    "batch_tensor_list",
    "peak_parts",
    "to_empty_tied",
    "trace_steps",
    "trackers",
]

STEPS = 2
"""Steps traced: the first allocates the optimizer's state, the second is a steady one."""

PARTS = {
    "parameters_bytes": ("Parameter", "Sharded Param", "Unsharded Param", "Buffer"),
    "gradients_bytes": ("Gradient", "Sharded Grad", "Unsharded Grad"),
    "optimizer_state_bytes": ("Optstate", "OptState"),
    "activations_bytes": ("Activation", "Temp", "Inputs", "Other"),
    "collective_buffers_bytes": ("All Gather", "Reduce Scatter"),
}
"""The trackers' categories (by their values) in the parts a prediction names."""


@dataclass(frozen=True)
class Trackers:
    fake_mode: Any
    fsdp: Any
    plain: Any


def trackers() -> Trackers:
    """torch's fake tensors and memory trackers, from their private modules (see the
    module's docstring); a torch that moved them is one line, not a traceback."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
        from torch.distributed._tools.mem_tracker import MemTracker
    except ImportError as e:
        import torch

        raise MbtuneError(
            f"mbtune memory needs torch's FakeTensorMode and memory trackers, which torch "
            f"{torch.__version__} does not have where mbtune looks ({e}); use torch 2.13"
        ) from None
    return Trackers(FakeTensorMode, _global_peak(FSDPMemTracker), _global_peak(MemTracker))


@functools.cache
def _global_peak(tracker: type) -> type:
    """``tracker`` keeping the step's peak alone, which is all a prediction reads
    (``get_tracker_snapshot``), not each module's too: torch's trackers update every module
    they have seen at each operation, more than half of the time of a trace of a 20-block
    model's stages (cProfile). The same peak, to the byte; where a torch names the
    trackers' state otherwise, its own update."""

    class GlobalPeak(tracker):
        def _update_peak_stats(self, peak_state: Any) -> None:
            try:
                current, peak, snaps = self._curr_mem_snap, self._peak_mem, self._peak_mem_snap
            except AttributeError:
                return super()._update_peak_stats(peak_state)
            for device, snap in current.items():
                if peak.get(device, 0) < snap["Total"]:
                    peak[device] = snap["Total"]
                    snaps[device] = copy.deepcopy(snap)

    GlobalPeak.__name__ = GlobalPeak.__qualname__ = tracker.__name__
    return GlobalPeak


def trace_steps(
    tracker: Any, optimizer: Any, parameters: list[Any],
    phases: Callable[[], Iterable[Callable[[], None]]], *, card: bool,
) -> list[dict[str, int]]:  # fmt: skip
    """:data:`STEPS` steps under ``tracker``: the step's ``phases()`` (its forward and
    backward passes: one, or each computation of a pipeline's schedule), one after
    another, then the optimizer's step. The candidates for the peak, each the bytes of every
    part at a moment of the last step: the peak of each phase, and of the optimizer's step
    (the tracker left and entered again between them: entering starts its peak anew, and
    what it tracks stays tracked), and with ``card`` one more. Apart, because a prediction
    counts each part of a deep model from a few blocks (mbtune.trial.blocks): one peak of
    the whole step may fall in one phase at one depth and in another at the next, and the
    difference of two such would mean nothing.

    ``card``: a CUDA device's AdamW is torch's multi-tensor (foreach) one by default, whose
    step holds a temporary as large as this rank's ``parameters`` (the second moments'
    square roots) that the CPU's step, one tensor at a time, does not; it is added to what
    the last step began with, and counted as optimizer state. Without it a 7B Llama sharded
    over 2 with ``grad_sync: every`` (its peak in the optimizer's step) was predicted 15%
    under its peak on an H200 (bench/memory_prediction.py --cuda). The foreach step is not
    run on the fake tensors themselves: the trackers lose count of its temporaries (9 times
    the parameters)."""
    for _ in range(STEPS):
        peaks = []
        for phase in phases():
            with tracker:
                phase()
            peaks.append(peak_parts(tracker.get_tracker_snapshot("peak")))
        with tracker:
            before_step = peak_parts(tracker.get_tracker_snapshot("current"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        peaks.append(peak_parts(tracker.get_tracker_snapshot("peak")))
    if not card:
        return peaks
    local = (getattr(p, "_local_tensor", p) for p in parameters if p.requires_grad)
    before_step["optimizer_state_bytes"] += sum(t.numel() * t.element_size() for t in local)
    return [*peaks, before_step]


def peak_parts(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """The bytes of each part of :data:`PARTS` in a tracker's snapshot, summed over its
    devices."""
    parts = dict.fromkeys(PARTS, 0)
    owner = {category: part for part, categories in PARTS.items() for category in categories}
    for by_category in snapshot.values():
        for category, nbytes in by_category.items():
            name = getattr(category, "value", category)
            if name != "Total":
                parts[owner.get(name, "activations_bytes")] += int(nbytes)
    return parts


def to_empty_tied(module: Any, device: Any) -> None:
    """``module.to_empty(device)``, its tied parameters (an embedding shared with the
    output layer) still one: from meta to fake tensors (a prediction) or to a rank's real
    memory (mbtune.trial.rank_init), which torch cannot swap in place, ``to_empty`` makes
    each module's parameter anew, and a tied weight would count twice. A name that still
    holds its first's parameter (FSDP2 keeps its own tied) is left as it is."""
    owners = [
        (m, name, id(p))
        for m in module.modules()
        for name, p in m.named_parameters(recurse=False, remove_duplicate=False)
    ]
    module.to_empty(device=device)
    first: dict[int, Any] = {}
    for m, name, key in owners:
        if key not in first:
            first[key] = getattr(m, name)
        elif getattr(m, name) is not first[key]:
            setattr(m, name, first[key])


def batch_tensor_list(batches: Iterable[Any]) -> list[Any]:
    """Every tensor of ``batches`` (micro-batches in any of a model's batch forms)."""
    from mbtune.models.batch import batch_tensors

    return [t for batch in batches for t in batch_tensors(batch)]
