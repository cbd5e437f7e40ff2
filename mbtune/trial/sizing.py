"""How ``mbtune init``'s starter holds its model (:func:`size_starter`): on one device where
its smallest configuration is predicted to fit (mbtune.trial.predict), else sharded over the
fewest devices that hold it, and where sharding alone cannot (one sample's activations are
more than a device holds), split over t devices as well (tensor parallelism);
mbtune.config.starter writes what was found. Here, not in mbtune.config, because predicting
builds the model with torch.
"""

from __future__ import annotations

import dataclasses
from typing import Any

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
    :data:`MAX_TENSOR_PARALLEL` that the model's heads allow, each predicted as split:
    :func:`_fewest_split`); what was found, in lines for a person. An error where nothing
    up to :data:`MAX_STARTER_DEVICES` x :data:`MAX_TENSOR_PARALLEL` devices holds it."""
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
    peaks: list[int] = []  # every peak predicted, at any n and t
    while True:
        tried = _fewest_split(exp, spec, shape, n, usable)
        peaks += [p.peak_memory_bytes for _, p in tried]
        if tried and tried[-1][1].peak_memory_bytes <= usable:
            break
        if n >= most:
            least = _gib(min(peaks, default=0))
            raise MbtuneError(
                f"init: {exp.model.name} ({params:,} parameters) is predicted at {least} per "
                f"device at the least (sharded over up to {n} devices at micro_batch_size 1, "
                f"each layer split over up to {MAX_TENSOR_PARALLEL} of them as its heads "
                f"allow), more than {_gib(usable)} of {_gib(budget)}; make it smaller (its "
                "config's keys under model:) and write the starter by hand"
            )
        n *= 2
    split, p = tried[-1]
    sharded = n > 1
    device = "cuda" if cuda else "cpu"
    held = (
        f"more than one {device} device's {_gib(usable)} usable: sharded (sharding: fsdp) over "
        f"{n} devices"
        if sharded
        else f"within one {device} device's {_gib(usable)} usable"
    )
    if split > 1:
        alone = f" ({_gib(tried[0][1].peak_memory_bytes)} a device)" * (tried[0][0] == 1)
        held += (
            f", more than sharding alone holds{alone}: each layer split over {split} of them "
            f"too (tensor_parallel: {split}, {n // split} replicas)"
        )
    how = "" if split == 1 else f", each layer over {split}"
    lines = (
        f"mbtune: {exp.model.name}: {params:,} parameters; weights, gradients and AdamW's "
        f"states hold at least {_gib(states)}, {held}",
        f"mbtune: predicted peak memory of one {device} device at micro_batch_size 1 on "
        f"{_plural(n)}{how}: {_gib(p.peak_memory_bytes)} (of trial.device_memory "
        f"{_gib(budget)}{'' if tr.device_memory else ', assumed: ' + _budget_source()}); "
        "`mbtune memory` names its parts",
    )
    declared = budget if tr.device_memory is None else None
    ts, ps = _searched(shape, split, n) if split > 1 else ((), ())
    return Sizing(
        num_devices=n,
        sharded=sharded,
        device_memory=declared,
        peak_memory_bytes=p.peak_memory_bytes,
        lines=lines,
        tensor_parallel=split,
        searched_tensor_parallel=ts,
        searched_pipeline_parallel=ps,
    )


def _fewest_split(
    exp: Experiment, spec: Any, shape: ModelShape, n: int, usable: float
) -> list[tuple[int, MemoryPrediction]]:
    """The predictions of n devices holding the model, each layer split over t of them (1:
    none; sharded with FSDP over the n / t replicas where n > 1), for t = 1, 2, 4 ... up to
    :data:`MAX_TENSOR_PARALLEL` and n, leaving at most :data:`MAX_STARTER_DEVICES` replicas,
    that the model's heads and MLP width allow, up to the first predicted within
    ``usable``: (t, its prediction) of each, in that order. ``spec``: the model built on
    the meta device, once for all (mbtune.trial.predict.predict_memory)."""
    tr, inputs = exp.trial, exp.train_input
    trial = dataclasses.replace(tr, parallel="ddp", sharding="fsdp") if n > 1 else tr
    search = dataclasses.replace(
        exp.search, space=dataclasses.replace(exp.search.space, num_devices=(n,))
    )
    tried: list[tuple[int, MemoryPrediction]] = []
    t = 1
    while t <= min(n, MAX_TENSOR_PARALLEL):
        if n // t <= MAX_STARTER_DEVICES and not model_rule(t, 1, "1f1b", shape):
            at = dataclasses.replace(
                exp,
                trial=trial,
                search=search,
                train_input=dataclasses.replace(inputs, num_devices=n, tensor_parallel=t),
            )
            # one sample (m = 1) whatever the batch is, a replica at least one
            config = BatchConfig(max(inputs.batch_size, n // t), n, 1, tensor_parallel=t)
            tried.append((t, predict_memory(at, config, spec=spec)))
            if tried[-1][1].peak_memory_bytes <= usable:
                break
        t *= 2
    return tried


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
