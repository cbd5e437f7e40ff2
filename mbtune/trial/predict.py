"""Memory before measuring: one device's peak for a configuration, predicted without
allocating the model and without the device (``mbtune memory``); the configurations of a
search predicted over its budget (:func:`screen`, run in a Ray task before the first
trial, mbtune.search); and how ``mbtune init`` holds a starter's model (:func:`size_starter`).

How. The model is built on torch's meta device (no memory, as a sharded trial builds it),
and rank 0 of the configuration's N devices takes two steps of the trial protocol
(mbtune.trial.measure: the same micro-batches, the same loss weighting, AdamW, the
precision's autocast, activation checkpointing where the configuration has it) on *fake*
tensors: ``FakeTensorMode`` (``torch._subclasses.fake_tensor``) gives every tensor its
shape, dtype and size and no storage. Of a step's g micro-batches only the first (the
largest) and the last (the synced one) are run: those between repeat the first's sizes on
gradients already there, and the peak is the same, at a cost that no longer grows with g.
With ``trial.sharding: fsdp`` the model is cut with the trial's own units and FSDP2
``fully_shard`` (with the configuration's ``reshard_after_forward``, and its ``grad_sync``
in the steps) over a process group of N ranks made with torch's ``fake`` backend, which
does no communication: it is public in torch 2.13
(``torch.distributed.Backend.FAKE``, registered once ``torch.distributed.fsdp`` is
imported, which this module does first; older versions registered it only from
``torch.testing._internal``). The bytes are counted by
torch's memory trackers, ``FSDPMemTracker`` (sharding: fsdp) and ``MemTracker`` (none),
from ``torch.distributed._tools``: a private package, but the only tools that follow
every tensor of a step by the part it belongs to (parameters, gradients, optimizer state,
activations, FSDP's all-gather and reduce-scatter buffers), as torchtitan's memory
estimation uses them; the alternative, a hand count per model, is what mbtune avoids
(docs/STYLE: no formulas per model). A private path changed by torch raises one line.

What is modelled beyond the trackers, and why:

- ``parallel: ddp`` without sharding on N > 1 devices: DDP's gradient buckets, one more
  copy of the gradients (``gradient_as_bucket_view`` is off), as collective buffers.
- The process's own memory. A CUDA trial's peak is the allocator's
  (``max_memory_allocated``): no baseline. A CPU trial's peak is the process's
  high-water mark, libtorch, Python and (ddp) Ray's worker included: the prediction adds
  :data:`CPU_PROCESS_BASELINE_BYTES` of the trial's ``parallel``, figures measured, not
  fitted: the peak of a trial of a gpt of 28 thousand parameters (its step under 1 MiB),
  one process (``simulate``) and each of 2 gloo workers (``ddp``), on this repository's
  torch 2.13 and Ray (``bench/memory_prediction.py --baseline`` measures them again). A
  model whose code is not mbtune's (``hf:``, a user model) brings its library along
  (transformers' Llama: 133 MiB): what building it adds to a process that has torch is
  measured, in a fresh process (this one may have imported it long ago), and added. So
  is ``trial.compile``'s own (dynamo, inductor, the compiled kernels loaded):
  :data:`CPU_COMPILE_BYTES`, the same tiny trial's peak compiled less eager.
- A device that is not here: ``trial.device: cuda`` (or ``auto`` where torch sees a CUDA
  card) is predicted on fake CPU tensors, which have the same sizes; ``precision: auto``
  is then bf16, as on any card since Ampere. A card's AdamW is torch's multi-tensor one,
  whose step holds one more copy of the rank's parameters (see :func:`_steps_at_peak`).

Not modelled: what compiling does to the step's tensors (the step runs eagerly here; a
compiled one usually holds less), the CUDA allocator's cache and fragmentation
(``peak_reserved_bytes``), any CPU memory a library keeps beyond its tensors, and which
attention kernel a card picks where the CPU's differs: transformers calls a card's
attention with grouped key and value heads, which in fp32 only torch's math kernel takes,
keeping the score matrices (a 156M Llama in fp32 on an H200: predicted 16% under its
peak; in bf16, flash attention, within 2%).
"""

from __future__ import annotations

import contextlib
import functools
import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mbtune.config.experiment import Experiment
from mbtune.config.model_options import one_line
from mbtune.config.starter import Sizing
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.models.batch import split_batch
from mbtune.trial.measure import (
    accumulate_gradients,
    build_spec,
    full_batch_if_mixing,
    rank_micro_batches,
    synced_step,
)
from mbtune.trial.memory import Verdict, memory_budget, over_budget, short_reason
from mbtune.trial.precision import Precision
from mbtune.trial.sharding import (
    fake_process_group,
    gradient_sync_skipped,
    mixed_precision,
    shard,
    shard_units,
)

__all__ = [
    "CPU_COMPILE_BYTES",
    "CPU_PROCESS_BASELINE_BYTES",
    "MemoryPrediction",
    "Screening",
    "predict_memory",
    "predicted_oom",
    "prediction_lines",
    "screen",
    "size_starter",
]

CPU_PROCESS_BASELINE_BYTES = {"simulate": 314 * 2**20, "ddp": 475 * 2**20}
"""A CPU trial process's own memory before its model, by ``trial.parallel``: Python and
libtorch (``simulate``), and gloo and Ray Train's worker (``ddp``). Measured: the peak of
a trial of a 28-thousand-parameter gpt (``bench/memory_prediction.py --baseline``), one
process 315 MiB, each of 2 gloo workers 475 MiB, less the model's step (under 1 MiB)."""

CPU_COMPILE_BYTES = {"simulate": 74 * 2**20, "ddp": 66 * 2**20}
"""What ``trial.compile`` adds to a CPU trial process, by ``trial.parallel``: the tiny
trial of :data:`CPU_PROCESS_BASELINE_BYTES` compiled less eager: one process 401 and 376
MiB in two runs against 315 (their mean), a gloo worker 541 MiB in both against 476."""

_STEPS = 2
"""Steps simulated: the first allocates the optimizer's state, the second is a steady one."""


@dataclass(frozen=True, kw_only=True)
class MemoryPrediction:
    """One device's predicted peak memory for a configuration, in bytes, by part; the
    parts are what was held at the moment of the peak and sum to it."""

    config: BatchConfig
    """The configuration predicted (m = P where the model mixes the samples of a batch)."""
    device: str
    """The device predicted for: ``cpu`` or ``cuda``."""
    sharding: str
    precision: str
    """``trial.precision`` as it would resolve on the device."""
    num_parameters: int
    """The whole model's parameters (every device's shards together)."""
    parameters_bytes: int
    """Parameters held: the shard and, sharded, the unsharded blocks being used."""
    gradients_bytes: int
    optimizer_state_bytes: int
    activations_bytes: int
    """Activations kept for the backward pass, temporaries, and the batch."""
    collective_buffers_bytes: int
    """FSDP's all-gather and reduce-scatter buffers; DDP's gradient buckets."""
    process_baseline_bytes: int
    """The process's own memory (CPU only): :data:`CPU_PROCESS_BASELINE_BYTES`, what the
    model's library adds (``hf:``, a user model) and :data:`CPU_COMPILE_BYTES`."""
    peak_memory_bytes: int
    """Every part together: the figure a trial's ``peak_memory_bytes`` measures."""
    note: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            **self.config.as_dict(),
            "device": self.device,
            "sharding": self.sharding,
            "precision": self.precision,
            "num_parameters": self.num_parameters,
            "peak_memory_bytes": self.peak_memory_bytes,
            "parts": {
                "parameters_bytes": self.parameters_bytes,
                "gradients_bytes": self.gradients_bytes,
                "optimizer_state_bytes": self.optimizer_state_bytes,
                "activations_bytes": self.activations_bytes,
                "collective_buffers_bytes": self.collective_buffers_bytes,
                "process_baseline_bytes": self.process_baseline_bytes,
            },
            "note": self.note,
        }


def predict_memory(exp: Experiment, config: BatchConfig) -> MemoryPrediction:
    """The peak memory of one device (rank 0, the busiest) when ``config`` of ``exp`` is
    measured, predicted on fake tensors: nothing of the model's size is allocated, and the
    device need not be present (see the module's docstring)."""
    tr = exp.trial
    device = "cuda" if tr.device == "cuda" or (tr.device == "auto" and _has_cuda()) else "cpu"
    precision = _precision(tr.precision, device)
    spec = build_spec(exp, config, meta=True)  # no memory: the meta device
    config, note = full_batch_if_mixing(spec, config)
    module = spec.module
    num_parameters = sum(p.numel() for p in module.parameters())
    sharded = tr.sharding == "fsdp"
    group = fake_process_group(config.num_devices, who="mbtune memory") if sharded else None
    with group or contextlib.nullcontext() as mesh:
        if sharded:
            policy = mixed_precision(precision) or _plain_policy()
            shard(module, shard_units(module), mesh, policy,
                  reshard_after_forward=config.reshard_after_forward)  # fmt: skip
        parts = _steps_at_peak(spec, config, precision, sharded=sharded, card=device == "cuda")
    if not sharded and tr.parallel == "ddp" and config.num_devices > 1:
        # DDP's buckets: a second copy of the gradients, held from its construction on
        parts["collective_buffers_bytes"] += sum(
            p.numel() * p.element_size() for p in module.parameters() if p.requires_grad
        )
    baseline = 0
    if device == "cpu":
        baseline = CPU_PROCESS_BASELINE_BYTES[tr.parallel] + _library_bytes(exp)
        baseline += CPU_COMPILE_BYTES[tr.parallel] if tr.compile else 0
    return MemoryPrediction(
        config=config,
        device=device,
        sharding=tr.sharding,
        precision=precision,
        num_parameters=num_parameters,
        process_baseline_bytes=baseline,
        peak_memory_bytes=sum(parts.values()) + baseline,
        note=note,
        **parts,
    )


def predicted_oom(exp: Experiment, config: BatchConfig) -> Verdict | None:
    """``("oom", "predicted: ...")`` where ``config``'s predicted peak leaves less than
    ``trial.memory_headroom`` of ``trial.device_memory`` free (mbtune.trial.memory's rule
    for a measured peak), so that a search can record it without measuring; None where it
    fits, or where no budget is given (a card's memory is known only on the card)."""
    budget = exp.trial.device_memory
    if budget is None:
        return None
    over = over_budget(exp.trial, budget, predict_memory(exp, config).peak_memory_bytes)
    return None if over is None else ("oom", f"predicted: {over}")


@dataclass(frozen=True)
class Screening:
    """What predicting a search's configurations found, before its first trial
    (:func:`screen`): the configurations predicted over the budget, each with its reason."""

    budget: int | None
    """The memory budget of one device, in bytes (``trial.device_memory``, else a CUDA
    card's); None: none is known, and nothing was predicted."""
    over: tuple[tuple[BatchConfig, str], ...] = ()
    """(configuration, reason) of each one predicted over the budget, less the headroom;
    the reason starts with ``predicted:`` (mbtune.runs.record.PREDICTED)."""
    predictions: int = 0
    """Configurations whose memory was predicted (the others followed from them)."""
    seconds: float = 0.0
    failed: str | None = None
    """Why nothing could be predicted (one line), where the prediction failed."""


def screen(exp: Experiment, configs: list[BatchConfig]) -> Screening:
    """Predict which of ``configs`` (a search's points) cannot fit the memory budget, as a
    trial would judge its measured peak (mbtune.trial.memory.over_budget), without
    predicting each: memory grows with the micro-batch a device runs, and with the batch
    at the same micro-batch, so for each (n, settings of a step), from the smallest batch
    up, a search over m from the largest down finds the smallest m predicted over the
    budget: it and every larger m are over, as is every m at least as large at a larger
    batch. Runs
    where torch may be imported (a search's Ray task); never raises for a model that
    cannot be predicted: ``failed`` says why."""
    import time

    import torch

    started = time.perf_counter()
    torch.set_num_threads(exp.cpu_threads)
    budget = _known_budget(exp)
    if budget is None:
        return Screening(None)
    usable = budget * (1 - exp.trial.headroom(budget))
    peaks: dict[BatchConfig, int] = {}

    def over(c: BatchConfig) -> bool:
        if c not in peaks:
            peaks[c] = predict_memory(exp, c).peak_memory_bytes
        return peaks[c] > usable

    groups: dict[tuple[Any, ...], dict[int, list[BatchConfig]]] = {}
    for c in sorted({c.canonical() for c in configs}):
        groups.setdefault((c.num_devices, *c.settings), {}).setdefault(c.batch_size, []).append(c)
    found: list[tuple[BatchConfig, str]] = []
    try:
        for by_batch in groups.values():
            bound: BatchConfig | None = None  # the smallest m over, at a smaller batch
            for batch in sorted(by_batch):
                ms = sorted(by_batch[batch], key=lambda c: c.micro_batch_size)
                top = len(ms)
                if bound is not None:  # at least as large an m as one over: over too
                    top = next((i for i, c in enumerate(ms)
                                if c.micro_batch_size >= bound.micro_batch_size), top)  # fmt: skip
                # from the largest m down, in growing steps (a large m has few micro-batches
                # to simulate), to one that fits; then halving: ms[:lo] fit, ms[hi:top] over
                lo, hi, step = 0, top, 1
                while lo < hi:
                    i = max(lo, hi - step)
                    if not over(ms[i]):
                        lo = i + 1
                        break
                    hi, step = i, step * 2
                while lo < hi:
                    mid = (lo + hi) // 2
                    if over(ms[mid]):
                        hi = mid
                    else:
                        lo = mid + 1
                for first, over_ms in ((ms[lo] if lo < top else None, ms[lo:top]),
                                       (bound, ms[top:])):  # fmt: skip
                    found += [(c, _reason(exp.trial, budget, first, peaks.get(first), c))
                              for c in over_ms if first is not None]  # fmt: skip
                bound = ms[lo] if lo < top else bound
    except Exception as e:  # noqa: BLE001 - a model mbtune cannot predict is measured instead
        return Screening(budget, failed=short_reason(one_line(e)), predictions=len(peaks),
                         seconds=time.perf_counter() - started)  # fmt: skip
    return Screening(budget, tuple(found), len(peaks), time.perf_counter() - started)


def _reason(tr: Any, budget: int, first: BatchConfig, peak: int | None, config: BatchConfig) -> str:
    """``predicted: ...``: the rule a measured peak would break (over_budget's words), for
    the configuration predicted, or for a larger one, named by the one it follows from."""
    if config == first and peak is not None:
        return f"predicted: {over_budget(tr, budget, peak)}"
    shown = f" ({peak / 2**20:.0f} MiB)" if peak is not None else ""
    return (
        f"predicted: more memory than micro_batch_size {first.micro_batch_size} at "
        f"batch_size {first.batch_size}{shown}, which leaves less than "
        f"trial.memory_headroom {tr.headroom(budget):g} of the budget "
        f"{budget / 2**20:.0f} MiB free"
    )


def _known_budget(exp: Experiment) -> int | None:
    """The budget a trial of ``exp`` must fit in, where it is known here: trial.device_memory,
    else the memory of the CUDA card this process sees (a CUDA trial's own budget); None
    on a CPU without trial.device_memory (nothing there says oom but the kernel)."""
    tr = exp.trial
    if tr.device_memory is not None:
        return tr.device_memory
    if tr.device in ("cuda", "auto") and _has_cuda():
        import torch

        return memory_budget(torch, torch.device("cuda"), None)
    return None


ASSUMED_CARD_BYTES = 80 * 2**30
"""The memory a CUDA starter is sized for where no card is at hand (``mbtune init`` on a
laptop): an 80 GB card (H100, A100 80GB); the starter declares it as trial.device_memory."""

STATE_BYTES_PER_PARAMETER = 16
"""What a parameter holds in a trial at the least: its fp32 weight (the master copy under
autocast), its fp32 gradient and AdamW's two fp32 moments. Only to choose the first device
count to predict: the prediction decides."""

MAX_STARTER_DEVICES = 32
"""The most devices a starter shards over: its batch_size (32), one sample each."""


def size_starter(exp: Experiment) -> Sizing:
    """How ``mbtune init``'s starter ``exp`` (one device, unsharded) must hold its model:
    as it is where its smallest configuration (micro_batch_size 1) is predicted to fit
    one device's memory (trial.device_memory; on CUDA without it, the card here, else
    :data:`ASSUMED_CARD_BYTES`), else sharded (``fsdp`` over ``parallel: ddp``) over the
    fewest devices, a power of two, at which it is predicted to fit; what was found, in
    lines for a person. An error where even :data:`MAX_STARTER_DEVICES` do not suffice."""
    import dataclasses

    tr, t = exp.trial, exp.train_input
    cuda = tr.device == "cuda"
    budget = tr.device_memory or (_card_bytes() if cuda else None) or ASSUMED_CARD_BYTES
    usable = budget * (1 - tr.headroom(budget))
    spec = build_spec(exp, BatchConfig(t.batch_size, 1, 1), meta=True)
    params = sum(p.numel() for p in spec.module.parameters())
    states = params * STATE_BYTES_PER_PARAMETER
    n = 1
    while states / n > usable and n < MAX_STARTER_DEVICES:
        n *= 2
    while True:
        sharded = n > 1
        trial = dataclasses.replace(tr, parallel="ddp", sharding="fsdp") if sharded else tr
        inputs = dataclasses.replace(t, num_devices=n)
        at = dataclasses.replace(exp, trial=trial, train_input=inputs)
        with _quiet_transformers():
            p = predict_memory(at, BatchConfig(t.batch_size, n, 1))
        if p.peak_memory_bytes <= usable:
            break
        if n >= MAX_STARTER_DEVICES:
            raise MbtuneError(
                f"init: {exp.model.name} ({params:,} parameters) is predicted at "
                f"{_gib(p.peak_memory_bytes)} per device even sharded over {n} devices at "
                f"micro_batch_size 1, more than {_gib(usable)} of {_gib(budget)}; make it "
                "smaller (its config's keys under model:) and write the starter by hand"
            )
        n *= 2
    device = "cuda" if cuda else "cpu"
    held = (
        f"more than one {device} device's {_gib(usable)} usable: sharded (sharding: fsdp) over "
        f"{n} devices"
        if sharded
        else f"within one {device} device's {_gib(usable)} usable"
    )
    lines = (
        f"mbtune: {exp.model.name}: {params:,} parameters; weights, gradients and AdamW's "
        f"states hold at least {_gib(states)}, {held}",
        f"mbtune: predicted peak memory of one {device} device at micro_batch_size 1 on "
        f"{_plural(n)}: {_gib(p.peak_memory_bytes)} (of trial.device_memory {_gib(budget)}"
        f"{'' if tr.device_memory else ', assumed: ' + _budget_source()}); "
        "`mbtune memory` names its parts",
    )
    declared = budget if tr.device_memory is None else None
    return Sizing(
        num_devices=n,
        sharded=sharded,
        device_memory=declared,
        peak_memory_bytes=p.peak_memory_bytes,
        lines=lines,
    )


def _gib(nbytes: float) -> str:
    """GiB to a tenth, or MiB below one GiB."""
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Without transformers' warnings (its loss's note on every model built from a config):
    ``mbtune init`` says what it found in its own lines."""
    import logging

    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _plural(n: int) -> str:
    return f"{n} device{'s' if n != 1 else ''}"


def _card_bytes() -> int | None:
    """The memory of the CUDA card this process sees, to the GiB below; None: none."""
    if not _has_cuda():
        return None
    import torch

    return int(torch.cuda.mem_get_info(0)[1]) // 2**30 * 2**30


def _budget_source() -> str:
    return "the card here" if _has_cuda() else "an 80 GB card (H100)"


def prediction_lines(p: MemoryPrediction) -> list[str]:
    """The prediction in a few lines, for ``mbtune memory``."""
    c = p.config
    mib = 2**20

    def part(label: str, value: int) -> str:
        return f"  {label:<20} {value / mib:>12,.1f} MiB"

    lines = [
        f"predicted peak memory of one {p.device} device: {p.peak_memory_bytes / mib:,.1f} MiB "
        f"(B={c.batch_size}, n={c.num_devices}, m={c.micro_batch_size}, "
        f"g={c.grad_accum_steps}, sharding {p.sharding}, {p.precision}, "
        f"{p.num_parameters:,} parameters)",
        part("parameters", p.parameters_bytes),
        part("gradients", p.gradients_bytes),
        part("optimizer state", p.optimizer_state_bytes),
        part("activations", p.activations_bytes),
        part("collective buffers", p.collective_buffers_bytes),
    ]
    if p.process_baseline_bytes:
        lines.append(part("process baseline", p.process_baseline_bytes))
    if p.note:
        lines.append(f"  note: {p.note}")
    return lines


# ---------------------------------------------------------------------------
# rank 0's steps on fake tensors


def _plain_policy() -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy()


def _steps_at_peak(
    spec: Any, config: BatchConfig, precision: str, *, sharded: bool, card: bool = False
) -> dict[str, int]:
    """Two steps of rank 0 on fake tensors, as mbtune.trial.measure takes them; the
    trackers' bytes of each part at the peak. ``card``: for a CUDA device, whose AdamW is
    torch's multi-tensor (foreach) one by default: its step holds a temporary as large as
    this rank's parameters (the second moments' square roots) that the CPU's step, one
    tensor at a time, does not; it is added to what the last step began with, and counted
    as optimizer state. Without it a 7B Llama sharded over 2 with ``grad_sync: every``
    (its peak in the optimizer's step) was predicted 15% under its peak on an H200
    (bench/memory_prediction.py --cuda). The foreach step is not run on the fake tensors
    themselves: the trackers lose count of its temporaries (9 times the parameters)."""
    import torch

    trackers = _trackers()
    module = spec.module
    sizes = rank_micro_batches(config, 0)
    loss_fn = Precision(precision, "cpu").loss(spec.loss_fn)
    # each micro-batch's share, as the trial weighs it (a device's share of B / n)
    total = sum(sizes) if config.num_devices == 1 else config.batch_size / config.num_devices
    # meta tensors go into the fake mode as inputs (they hold nothing either)
    with trackers.fake_mode(allow_non_fake_inputs=True):
        _to_empty_tied(module, "cpu")
        module.train()
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        batches = split_batch(spec.make_batch(sum(sizes), torch.device("cpu")), sizes)
        if sharded:
            tracker = trackers.fsdp(module, optimizer)
            tracker.track_inputs(tuple(batches))
        else:
            tracker = trackers.plain()
            tracker.track_external(module, optimizer, *_tensors(batches))

        def tracked_loss(model: Any, batch: Any) -> Any:
            # the trackers follow one forward pass per module: each micro-batch's anew
            # (the peak over all of them is kept)
            tracker.reset_mod_stats()
            return loss_fn(model, batch)

        skip = config.grad_sync == "last"

        def no_sync() -> Any:
            return gradient_sync_skipped(module, skip=skip)

        # a step's peak is reached in its first micro-batch (the largest) or its last (the
        # synced one): those between repeat the first's sizes on gradients already there
        run = batches if len(batches) <= 2 else [batches[0], batches[-1]]
        with tracker:
            for _ in range(_STEPS):
                if sharded:  # as the trial: no reduce-scatter but the last (grad_sync last)
                    synced_step(tracked_loss, module, run, total=total, no_sync=no_sync)
                else:
                    accumulate_gradients(tracked_loss, module, run, total=total)
                if card:  # what the step begins with: the foreach temporary comes on top
                    before_step = _parts(tracker.get_tracker_snapshot("current"))
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        parts = _parts(tracker.get_tracker_snapshot("peak"))
        if card:
            local = (getattr(p, "_local_tensor", p) for p in module.parameters() if p.requires_grad)
            before_step["optimizer_state_bytes"] += sum(t.numel() * t.element_size() for t in local)
            if sum(before_step.values()) > sum(parts.values()):
                return before_step
        return parts


# ---------------------------------------------------------------------------
# the parts


_PARTS = {
    "parameters_bytes": ("Parameter", "Sharded Param", "Unsharded Param", "Buffer"),
    "gradients_bytes": ("Gradient", "Sharded Grad", "Unsharded Grad"),
    "optimizer_state_bytes": ("Optstate", "OptState"),
    "activations_bytes": ("Activation", "Temp", "Inputs", "Other"),
    "collective_buffers_bytes": ("All Gather", "Reduce Scatter"),
}
"""The trackers' categories (by their values) in the parts a prediction names."""


def _parts(snapshot: dict[Any, dict[Any, int]]) -> dict[str, int]:
    """The bytes of each part at the peak, summed over the snapshot's devices."""
    parts = dict.fromkeys(_PARTS, 0)
    owner = {category: part for part, categories in _PARTS.items() for category in categories}
    for by_category in snapshot.values():
        for category, nbytes in by_category.items():
            name = getattr(category, "value", category)
            if name != "Total":
                parts[owner.get(name, "activations_bytes")] += int(nbytes)
    return parts


def _to_empty_tied(module: Any, device: str) -> None:
    """``module.to_empty(device)``, its tied parameters (an embedding shared with the
    output layer) still one: from meta to fake tensors, which torch cannot swap in place,
    ``to_empty`` makes each module's parameter anew, and a tied weight would count twice."""
    owners = [
        (m, name, id(p))
        for m in module.modules()
        for name, p in m.named_parameters(recurse=False, remove_duplicate=False)
    ]
    module.to_empty(device=device)
    first: dict[int, Any] = {}
    for m, name, key in owners:
        if key in first:
            setattr(m, name, first[key])
        else:
            first[key] = getattr(m, name)


_LIBRARY_PROBE = """
import pickle, re, sys
from pathlib import Path

def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+) kB", Path("/proc/self/status").read_text())[1]) * 1024

import torch
from mbtune.models.build import build_from_config

model = pickle.load(sys.stdin.buffer)
before = rss()
with torch.device("meta"):
    build_from_config(model, seed=0)
print(rss() - before)
"""
"""Run in a fresh process: the bytes that building the model (on the meta device, its code
imported) adds to a process that has torch and mbtune's models."""


def _library_bytes(exp: Experiment) -> int:
    """What the model's own library (transformers, a user's package) adds to a trial
    process's memory; 0 for mbtune's built-in models, which the baseline includes."""
    if exp.model.is_builtin:
        return 0
    return _probe(pickle.dumps(exp.model))


@functools.cache
def _probe(model: bytes) -> int:
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _LIBRARY_PROBE],
        input=model, capture_output=True, cwd=os.getcwd(), timeout=300,
    )  # fmt: skip
    lines = done.stdout.decode(errors="replace").split()
    if done.returncode != 0 or not lines:
        why = done.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["no output"]
        raise MbtuneError(f"mbtune memory: measuring the model's library failed: {why[0]}")
    return max(0, int(lines[-1]))


def _tensors(batches: list[Any]) -> list[Any]:
    from mbtune.models.batch import batch_tensors

    return [t for batch in batches for t in batch_tensors(batch)]


# ---------------------------------------------------------------------------
# torch's tools


@dataclass(frozen=True)
class _Trackers:
    fake_mode: Any
    fsdp: Any
    plain: Any


def _trackers() -> _Trackers:
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
    return _Trackers(FakeTensorMode, FSDPMemTracker, MemTracker)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _precision(name: str, device: str) -> str:
    """``trial.precision`` as it would resolve on ``device``, without the device: ``auto``
    is bf16 on CUDA (any card since Ampere), fp32 on the CPU; tf32 holds fp32's bytes."""
    if name == "auto":
        return "bf16" if device == "cuda" else "fp32"
    if name == "fp16" and device == "cpu":
        raise MbtuneError(
            "trial.precision: fp16 runs on CUDA only, and this configuration runs on cpu; "
            "use bf16 or fp32 on the CPU, or auto"
        )
    return name
