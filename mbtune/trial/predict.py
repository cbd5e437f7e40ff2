"""Memory before measuring: one device's peak for a configuration, predicted without
allocating the model and without the device (``mbtune memory``). The search's boundary of
configurations predicted over its budget (mbtune.trial.screen) and ``mbtune init``'s sizing
of a starter (mbtune.trial.sizing) are read from it.

How. The model is built on torch's meta device (no memory, as a sharded trial builds it),
and rank 0 of the configuration's N devices takes two steps of the trial protocol
(mbtune.trial.step: the same micro-batches, the same loss weighting, AdamW, the
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
(docs/STYLE: no formulas per model). A private path changed by torch raises one line
(mbtune.trial.tracking holds them, and the steps they count).

A configuration that splits the model (``tensor_parallel`` t > 1 or ``pipeline_parallel``
p > 1) is predicted for rank 0's stages and tensor-parallel shard, made as a real rank
makes them, with the activations its schedule holds in flight (mbtune.trial.predict_stage):
the same parts, the same process baseline.

Not every block is traced. A deep model's layers are one run of identical blocks, and
each part at the peak grows by the same bytes with each of them: the steps are taken on a
copy cut to a few blocks of each run, and on one with a run a block longer, and the rest
counted from the difference (mbtune.trial.blocks). A 12B Qwen2 is predicted in the time of
7 of its 32 layers; on gpt, hf:gpt2, hf:llama and hf:qwen2 of 8 layers the result is the
whole trace's to the byte, sharded or not (``whole=True`` traces every block).

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
import dataclasses
import functools
import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mbtune.config.experiment import Experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.models.batch import split_batch
from mbtune.trial.blocks import cut, repeated_blocks, scaled_parts
from mbtune.trial.precision import Precision
from mbtune.trial.sharding import (
    fake_process_group,
    gradient_sync_skipped,
    mixed_precision,
    shard,
    shard_units,
)
from mbtune.trial.step import (
    accumulate_gradients,
    build_spec,
    full_batch_if_mixing,
    rank_micro_batches,
    synced_step,
)
from mbtune.trial.tracking import batch_tensor_list, to_empty_tied, trace_steps, trackers

if TYPE_CHECKING:  # its module imports the model-parallel trial: torch, never in the driver
    from mbtune.trial.predict_stage import RankShare

__all__ = [
    "CPU_COMPILE_BYTES",
    "CPU_PROCESS_BASELINE_BYTES",
    "MemoryPrediction",
    "has_cuda",
    "predict_memory",
    "prediction_lines",
]

CPU_PROCESS_BASELINE_BYTES = {"simulate": 278 * 2**20, "ddp": 475 * 2**20}
"""A CPU trial process's own memory before its model, by ``trial.parallel``: Python and
libtorch (``simulate``: a search's trial, a child forked from its actor's warm parent,
mbtune.trial.warm, resident with only the pages of libtorch it touches), and gloo and Ray
Train's worker (``ddp``). Measured: the peak of a trial of a 28-thousand-parameter gpt
(``bench/memory_prediction.py --baseline``), forked 278.6 MiB (three trials, 278.4 to
278.6; in a process of its own, as ``mbtune trial`` or a cold trial runs it, 330 MiB),
each of 2 gloo workers 475 MiB (491 when the forked figure was taken), less the model's
step (under 1 MiB)."""

CPU_COMPILE_BYTES = {"simulate": 60 * 2**20, "ddp": 66 * 2**20}
"""What ``trial.compile`` adds to a CPU trial process, by ``trial.parallel``: the tiny
trial of :data:`CPU_PROCESS_BASELINE_BYTES` compiled less eager: forked 338.7 MiB in three
trials against 278.6 (in a process of its own 419 against 330), a gloo worker 541 MiB in
two runs against 476 (557 against 491 when the forked figures were taken)."""


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
    share: RankShare | None = None
    """Where the configuration splits the model: the busiest rank's stages (the first
    pipeline rank's or the last's) and the activations it holds in flight
    (mbtune.trial.predict_stage); None where every device holds it whole."""

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
            "rank": dataclasses.asdict(self.share) if self.share else None,
        }


def predict_memory(
    exp: Experiment, config: BatchConfig, *, spec: Any = None, whole: bool = False
) -> MemoryPrediction:
    """The peak memory of one device (rank 0, the busiest) when ``config`` of ``exp`` is
    measured, predicted on fake tensors: nothing of the model's size is allocated, and the
    device need not be present (see the module's docstring). ``spec``: the model as
    ``build_spec(exp, config, meta=True)`` builds it, where the caller has it (it is left as
    it is). A few of the model's repeated blocks are traced and the rest counted from them
    (mbtune.trial.blocks); ``whole``: every block is traced (what that replaces, slower)."""
    tr = exp.trial
    device = "cuda" if tr.device == "cuda" or (tr.device == "auto" and has_cuda()) else "cpu"
    precision = _precision(tr.precision, device)
    spec = spec or build_spec(exp, config, meta=True)  # no memory: the meta device
    config, note = full_batch_if_mixing(spec, config)
    module = spec.module
    num_parameters = sum(p.numel() for p in module.parameters())
    sharded = tr.sharding == "fsdp"
    card = device == "cuda"
    share = None
    if config.tensor_parallel > 1 or config.pipeline_parallel > 1:  # rank 0's stages
        from mbtune.trial.predict_stage import stage_peaks  # torch: never in the driver

        peaks, share = stage_peaks(spec, config, tr, precision, card=card, whole=whole)
    else:
        peaks = _replica_peaks(spec, config, precision, sharded=sharded, card=card, whole=whole)
    parts = max(peaks, key=lambda candidate: sum(candidate.values()))
    if not sharded and tr.parallel == "ddp" and config.data_parallel > 1:
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
        share=share,
        **parts,
    )


def _replica_peaks(
    spec: Any, config: BatchConfig, precision: str, *, sharded: bool, card: bool, whole: bool
) -> list[dict[str, int]]:
    """The candidate peaks (parts) of rank 0 where every device holds the whole model (or
    its FSDP shard of it): a few of its repeated blocks traced, the rest counted from them
    (mbtune.trial.blocks), or every block where ``whole``."""
    module = spec.module

    def trace(depths: dict[str, int]) -> list[dict[str, int]]:
        """The candidate peaks (parts) of a copy of the model, its runs of blocks cut to
        ``depths``."""
        copied = dataclasses.replace(spec, module=cut(module, depths))
        group = fake_process_group(config.num_devices, who="mbtune memory") if sharded else None
        with group or contextlib.nullcontext() as mesh:
            if sharded:
                policy = mixed_precision(precision) or _plain_policy()
                shard(copied.module, shard_units(copied.module), mesh, policy,
                      reshard_after_forward=config.reshard_after_forward)  # fmt: skip
            return _steps_at_peak(copied, config, precision, sharded=sharded, card=card)

    runs = {} if whole else repeated_blocks(module)
    try:
        peaks = scaled_parts(runs, trace) if runs else None
    except Exception:  # a forward that does not take its blocks cut: traced whole below
        peaks = None
    return peaks or trace({})


def prediction_lines(p: MemoryPrediction) -> list[str]:
    """The prediction in a few lines, for ``mbtune memory``."""
    c = p.config
    mib = 2**20

    def part(label: str, value: int) -> str:
        return f"  {label:<20} {value / mib:>12,.1f} MiB"

    layout = ""
    if p.share:
        layout = f"t={c.tensor_parallel}, p={c.pipeline_parallel}, d={c.data_parallel}, "
    lines = [
        f"predicted peak memory of one {p.device} device: {p.peak_memory_bytes / mib:,.1f} MiB "
        f"(B={c.batch_size}, n={c.num_devices}, {layout}m={c.micro_batch_size}, "
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
    if p.share:
        lines.append(f"  {_share_line(p.share, c)}")
    if p.note:
        lines.append(f"  note: {p.note}")
    return lines


def _share_line(share: RankShare, c: BatchConfig) -> str:
    """What the busiest rank of a split model holds, in words."""
    held = " and ".join(str(s) for s in share.stages)
    schedule = f" ({c.pipeline_schedule})" if c.pipeline_parallel > 1 else ""
    each = ", each through one of its stages" * (len(share.stages) > 1)
    shard = f", its tensor-parallel shard of 1/{c.tensor_parallel}" * (c.tensor_parallel > 1)
    return (
        f"pipeline rank {share.pipeline_rank}: stage{'s' * (len(share.stages) > 1)} {held} "
        f"of {share.num_stages}{shard}; "
        f"activations of up to "
        f"{share.in_flight} micro-batch{'es' * (share.in_flight > 1)} in flight{each}{schedule}"
    )


# ---------------------------------------------------------------------------
# rank 0's steps on fake tensors


def _plain_policy() -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy()


def _steps_at_peak(
    spec: Any, config: BatchConfig, precision: str, *, sharded: bool, card: bool = False
) -> list[dict[str, int]]:
    """Two steps of rank 0 on fake tensors, as mbtune.trial.measure takes them; the
    trackers' bytes of each part at the peak, and with ``card`` a second candidate for the
    peak, a card's foreach AdamW (mbtune.trial.tracking.trace_steps; the larger is the
    device's; each is counted from a few blocks on its own, since which is larger may change
    with the depth)."""
    import torch

    tools = trackers()
    module = spec.module
    sizes = rank_micro_batches(config, 0)
    loss_fn = Precision(precision, "cpu").loss(spec.loss_fn)
    # each micro-batch's share, as the trial weighs it (a device's share of B / n)
    total = sum(sizes) if config.num_devices == 1 else config.batch_size / config.num_devices
    # meta tensors go into the fake mode as inputs (they hold nothing either)
    with tools.fake_mode(allow_non_fake_inputs=True):
        to_empty_tied(module, "cpu")
        module.train()
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-4)
        batches = split_batch(spec.make_batch(sum(sizes), torch.device("cpu")), sizes)
        if sharded:
            tracker = tools.fsdp(module, optimizer)
            tracker.track_inputs(tuple(batches))
        else:
            tracker = tools.plain()
            tracker.track_external(module, optimizer, *batch_tensor_list(batches))

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

        def backward() -> None:
            if sharded:  # as the trial: no reduce-scatter but the last (grad_sync last)
                synced_step(tracked_loss, module, run, total=total, no_sync=no_sync)
            else:
                accumulate_gradients(tracked_loss, module, run, total=total)

        return trace_steps(tracker, optimizer, list(module.parameters()), lambda: [backward],
                           card=card)  # fmt: skip


# ---------------------------------------------------------------------------
# the process


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


def has_cuda() -> bool:
    """Whether torch sees a CUDA card here."""
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
