"""How ``mbtune init``'s starter holds its model (:func:`size_starter`): on one device where
its smallest configuration is predicted to fit (mbtune.trial.predict), else sharded over the
fewest devices that hold it; mbtune.config.starter writes what was found. Here, not in
mbtune.config, because predicting builds the model with torch.
"""

from __future__ import annotations

from mbtune.config.experiment import Experiment
from mbtune.config.starter import Sizing
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.trial.predict import has_cuda, predict_memory
from mbtune.trial.step import build_spec

__all__ = ["ASSUMED_CARD_BYTES", "MAX_STARTER_DEVICES", "STATE_BYTES_PER_PARAMETER", "size_starter"]


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
        p = predict_memory(at, BatchConfig(t.batch_size, n, 1), spec=spec)  # built once
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
