"""How ``mbtune init``'s starter holds its model (:func:`size_starter`): on one device where
its smallest configuration is predicted to fit (mbtune.trial.predict), else sharded over the
fewest devices that hold it, and where sharding alone cannot (one sample's activations are
more than a device holds), split over t devices as well (tensor parallelism);
mbtune.config.starter writes what was found. Here, not in mbtune.config, because predicting
builds the model with torch.
"""

from __future__ import annotations

from mbtune.config.experiment import Experiment
from mbtune.config.starter import Sizing
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig, ModelShape, model_rule
from mbtune.models.shape import model_shape
from mbtune.trial.predict import MemoryPrediction, has_cuda, predict_memory
from mbtune.trial.step import build_spec

__all__ = [
    "ASSUMED_CARD_BYTES",
    "MAX_STARTER_DEVICES",
    "MAX_TENSOR_PARALLEL",
    "STATE_BYTES_PER_PARAMETER",
    "size_starter",
    "split_peak_bytes",
]


ASSUMED_CARD_BYTES = 80 * 2**30
"""The memory a CUDA starter is sized for where no card is at hand (``mbtune init`` on a
laptop): an 80 GB card (H100, A100 80GB); the starter declares it as trial.device_memory."""

STATE_BYTES_PER_PARAMETER = 16
"""What a parameter holds in a trial at the least: its fp32 weight (the master copy under
autocast), its fp32 gradient and AdamW's two fp32 moments. Only to choose the first device
count to predict: the prediction decides."""

MAX_STARTER_DEVICES = 32
"""The most replicas a starter shards over: its batch_size (32), one sample each."""

MAX_TENSOR_PARALLEL = 8
"""The most devices a starter splits each layer over: a node's (Megatron keeps tensor
parallelism inside one: it all-reduces in every block, twice a pass)."""


def size_starter(exp: Experiment) -> Sizing:
    """How ``mbtune init``'s starter ``exp`` (one device, unsharded) must hold its model:
    as it is where its smallest configuration (micro_batch_size 1) is predicted to fit
    one device's memory (trial.device_memory; on CUDA without it, the card here, else
    :data:`ASSUMED_CARD_BYTES`), else sharded (``fsdp``) over the fewest devices, a power
    of two, at which it is predicted to fit: over that many replicas (``parallel: ddp``),
    or where sharding alone does not hold it there (one sample's activations too large, or
    more replicas needed than the batch has samples, :data:`MAX_STARTER_DEVICES`), each
    layer split over t of them as well (``tensor_parallel``, the fewest t up to
    :data:`MAX_TENSOR_PARALLEL` that the model's heads allow: :func:`split_peak_bytes`);
    what was found, in lines for a person. An error where nothing up to
    :data:`MAX_STARTER_DEVICES` x :data:`MAX_TENSOR_PARALLEL` devices holds it."""
    import dataclasses

    tr, t = exp.trial, exp.train_input
    cuda = tr.device == "cuda"
    budget = tr.device_memory or (_card_bytes() if cuda else None) or ASSUMED_CARD_BYTES
    usable = budget * (1 - tr.headroom(budget))
    spec = build_spec(exp, BatchConfig(t.batch_size, 1, 1), meta=True)
    shape = model_shape(spec.module)
    params = sum(p.numel() for p in spec.module.parameters())
    states = params * STATE_BYTES_PER_PARAMETER
    most = MAX_STARTER_DEVICES * MAX_TENSOR_PARALLEL
    n = 1
    while states / n > usable and n < most:
        n *= 2
    while True:
        sharded = n > 1
        split = max(1, n // t.batch_size)  # replicas no more than samples (predicted: below)
        trial = dataclasses.replace(tr, parallel="ddp", sharding="fsdp") if sharded else tr
        inputs = dataclasses.replace(t, num_devices=n, tensor_parallel=split)
        space = dataclasses.replace(exp.search.space, num_devices=(n,))
        at = dataclasses.replace(exp, trial=trial, train_input=inputs,
                                 search=dataclasses.replace(exp.search, space=space))  # fmt: skip
        # FSDP over all n devices holds what t x d of them hold split (1/n of the states);
        # one sample (m = 1) whatever the batch is
        p = predict_memory(at, BatchConfig(max(t.batch_size, n), n, 1), spec=spec)  # built once
        split = _fewest_split(p, n, shape, usable)
        if split is not None:
            break
        if n >= most:
            raise MbtuneError(
                f"init: {exp.model.name} ({params:,} parameters) is predicted at "
                f"{_gib(p.peak_memory_bytes)} per device even sharded over {n} devices at "
                f"micro_batch_size 1, each layer split over up to {MAX_TENSOR_PARALLEL} of "
                f"them, more than {_gib(usable)} of {_gib(budget)}; make it smaller (its "
                "config's keys under model:) and write the starter by hand"
            )
        n *= 2
    device = "cuda" if cuda else "cpu"
    peak = split_peak_bytes(p, split)
    held = (
        f"more than one {device} device's {_gib(usable)} usable: sharded (sharding: fsdp) over "
        f"{n} devices"
        if sharded
        else f"within one {device} device's {_gib(usable)} usable"
    )
    if split > 1:
        alone = "" if n > MAX_STARTER_DEVICES else f" ({_gib(p.peak_memory_bytes)} a device)"
        held += (
            f", more than sharding alone holds{alone}: each layer split over {split} of them "
            f"too (tensor_parallel: {split}, {n // split} replicas)"
        )
    how = "" if split == 1 else f", each layer over {split} (estimated from its parts)"
    lines = (
        f"mbtune: {exp.model.name}: {params:,} parameters; weights, gradients and AdamW's "
        f"states hold at least {_gib(states)}, {held}",
        f"mbtune: predicted peak memory of one {device} device at micro_batch_size 1 on "
        f"{_plural(n)}{how}: {_gib(peak)} (of trial.device_memory {_gib(budget)}"
        f"{'' if tr.device_memory else ', assumed: ' + _budget_source()}); "
        "`mbtune memory` names its parts",
    )
    declared = budget if tr.device_memory is None else None
    ts, ps = _searched(shape, split, n) if split > 1 else ((), ())
    return Sizing(
        num_devices=n,
        sharded=sharded,
        device_memory=declared,
        peak_memory_bytes=peak,
        lines=lines,
        tensor_parallel=split,
        searched_tensor_parallel=ts,
        searched_pipeline_parallel=ps,
    )


def split_peak_bytes(p: MemoryPrediction, tensor_parallel: int) -> int:
    """One device's peak where the model predicted as ``p`` (sharded over all of its n
    devices, or on one) has its layers split over ``tensor_parallel`` of them too,
    estimated from ``p``'s parts, as the prediction does not split a model yet: the
    weights, gradients and optimizer states as they are (FSDP over the d = n / t replicas
    of a 1/t shard holds 1/n of them, as FSDP over n does), the activations and the
    collective buffers (a block's gathered parameters) divided by t (Megatron's tensor
    parallelism with sequence parallelism splits every activation of a block over t), the
    process's own memory as it is."""
    t = tensor_parallel
    if t == 1:
        return p.peak_memory_bytes
    states = p.parameters_bytes + p.gradients_bytes + p.optimizer_state_bytes
    split = (p.activations_bytes + p.collective_buffers_bytes) / t
    return int(states + split + p.process_baseline_bytes)


def _fewest_split(p: MemoryPrediction, n: int, shape: ModelShape, usable: float) -> int | None:
    """The fewest devices t each layer is split over (1: none) at which n devices hold the
    model predicted as ``p``: a power of two up to :data:`MAX_TENSOR_PARALLEL` and n that
    the model's heads and MLP width allow, leaving at most :data:`MAX_STARTER_DEVICES`
    replicas (n / t)."""
    t = 1
    while t <= min(n, MAX_TENSOR_PARALLEL):
        fits = split_peak_bytes(p, t) <= usable and n // t <= MAX_STARTER_DEVICES
        if fits and not model_rule(t, 1, "1f1b", shape):
            return t
        t *= 2
    return None


def _searched(shape: ModelShape, t: int, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The t and p a starter split over t devices lists in its space: t and twice it (within
    a node), p 1 and 2, each where the model's shape allows it and 2 n devices hold it."""
    ts = tuple(k for k in (t, 2 * t) if k <= MAX_TENSOR_PARALLEL and 2 * n % k == 0
               and not model_rule(k, 1, "1f1b", shape))  # fmt: skip
    ps = tuple(k for k in (1, 2) if 2 * n % (t * k) == 0 and not model_rule(t, k, "1f1b", shape))
    return ts, ps


def _gib(nbytes: float) -> str:
    """GiB to a tenth, or MiB below one GiB."""
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def _plural(n: int) -> str:
    return f"{n} device{'s' if n != 1 else ''}"


def _card_bytes() -> int | None:
    """The memory of the CUDA card this process sees, to the GiB below; None: none."""
    if not has_cuda():
        return None
    import torch

    return int(torch.cuda.mem_get_info(0)[1]) // 2**30 * 2**30


def _budget_source() -> str:
    return "the card here" if has_cuda() else "an 80 GB card (H100)"
