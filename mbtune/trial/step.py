"""The microbatched step, one optimizer step's parts as every path runs them: the model as a
configuration builds it, the micro-batches and samples of a rank, each micro-batch's loss
weighted by its share (so the accumulated gradient is the full batch's), the step whose
last micro-batch synchronises the gradients, and the step's mean loss over the ranks.
Shared by the measurement loop (mbtune.trial.measure), for one process and every ``ddp``
rank, and by the memory prediction on fake tensors (mbtune.trial.predict).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

from mbtune.config.experiment import Experiment
from mbtune.lattice import BatchConfig, even_split
from mbtune.models.batch import batch_tensors, num_samples, slice_batch
from mbtune.trial.collectives import Collectives

__all__ = [
    "StepLoss",
    "accumulate_gradients",
    "build_spec",
    "full_batch_if_mixing",
    "mean_loss",
    "rank_batch",
    "rank_micro_batches",
    "synced_step",
]


def build_spec(exp: Experiment, config: BatchConfig, *, meta: bool = False) -> Any:
    """The model of ``exp`` as ``config`` runs it: seeded, and with activation
    checkpointing where the configuration has it (a simulated trial and a ddp rank alike).
    ``meta``: built on torch's meta device, no memory and no values (a sharded rank
    materializes only its shard: mbtune.trial.sharding)."""
    import torch

    from mbtune.models.build import build_from_config

    with torch.device("meta") if meta else contextlib.nullcontext():
        return build_from_config(
            exp.model,
            seed=exp.search.seed,
            activation_checkpointing=config.activation_checkpointing,
        )


def full_batch_if_mixing(spec: Any, config: BatchConfig) -> tuple[BatchConfig, str | None]:
    """A model that mixes the samples of a batch (BatchNorm) is measured at m = P: its
    gradient depends on the micro-batch, so accumulation would train another model."""
    if not spec.mixes_batch or config.grad_accum_steps == 1:
        return config, None
    note = (
        f"{spec.mixes_batch}; measured at micro_batch_size {config.per_device_batch} "
        "(no accumulation) instead"
    )
    return dataclasses.replace(config, micro_batch_size=config.per_device_batch), note


def rank_micro_batches(config: BatchConfig, rank: int) -> list[int]:
    """The micro-batches rank ``rank`` runs per step: its share of B (the even split over
    the ranks) spread evenly over the configuration's g micro-batches (fewer where the
    share has fewer samples than g). Rank 0 has the busiest device's: P in g micro-batches."""
    share = config.device_batch_sizes[rank]
    return even_split(share, min(config.grad_accum_steps, share))


def rank_batch(
    spec: Any, config: BatchConfig, group: Collectives, device: Any, *, seed: int
) -> Any:
    """This process's samples of a step, drawn under ``seed``. One process draws its P
    samples (with n = 1 the global batch); a rank of several draws the whole global batch of
    B and keeps its own rows (the even split, rank 0's first), so that a step sees the same
    B samples however many ranks share them: the loss of one seed and B is the same with 1
    process and with n. The rows are copied, and the rest freed before anything is timed."""
    import torch

    torch.manual_seed(seed)
    if group.world_size == 1:
        return spec.make_batch(sum(rank_micro_batches(config, group.rank)), device)
    shares = config.device_batch_sizes
    start = sum(shares[: group.rank])
    mine = slice_batch(
        spec.make_batch(config.batch_size, device), start, start + shares[group.rank]
    )
    for t in batch_tensors(mine):
        t.set_(t.clone())  # storage of its own: the global batch is freed with this frame
    return mine


class StepLoss:
    """A loss function that also adds up one step's loss as its micro-batches' weighted
    means (each by its share of ``total``, as the gradients are): detached and on the
    device, so no step waits for it. Wrapped by the precision's scaler, it sees the loss
    unscaled."""

    def __init__(self, loss_fn: Callable, *, total: float) -> None:
        self.loss_fn, self.total = loss_fn, total
        self.value: Any = None
        """The step's loss so far: a tensor, or None before its first micro-batch."""

    def __call__(self, model: Any, batch: Any) -> Any:
        loss = self.loss_fn(model, batch)
        share = loss.detach().float() * (num_samples(batch) / self.total)
        self.value = share if self.value is None else self.value + share
        return loss

    def reset(self) -> None:
        self.value = None


def mean_loss(step_loss: Any, group: Collectives) -> float | None:
    """A step's mean loss over every process's samples: this process's weighted sum (a
    :class:`StepLoss`'s value) summed over the ranks and divided by their number (with ddp
    each rank's shares are of B / n, so this is the global batch's mean). Every rank calls
    it (a collective); None where no step was timed."""
    import torch

    if step_loss is None:
        return None
    value = step_loss.detach().to(torch.float64).reshape(1)
    group.all_reduce(value)
    return value.item() / (1 if group.simulated else group.world_size)


def accumulate_gradients(
    loss_fn: Callable, model: Any, batches: list[Any], *, total: float | None = None
) -> None:
    """One forward/backward pass per micro-batch, each mean loss weighted by its share.

    The weighted means sum to the mean loss of the whole per-device batch, so the
    accumulated gradient equals the full-batch gradient, uneven micro-batches included.
    ``total``: the samples the shares are of (default: these batches' own); a ddp rank
    passes B / n, so that DDP's average over ranks is the mean over all B samples.
    Each micro-batch reaches ``loss_fn`` in the form ``make_batch`` returned.
    """
    if total is None:
        total = sum(num_samples(batch) for batch in batches)
    for batch in batches:
        (loss_fn(model, batch) * (num_samples(batch) / total)).backward()


def synced_step(
    loss_fn: Callable,
    model: Any,
    batches: list[Any],
    *,
    total: float,
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]],
) -> None:
    """One step's gradients: every micro-batch but the last under ``no_sync()`` (DDP's:
    gradients accumulate locally), the last without, whose backward pass all-reduces the
    accumulated gradients once. ``total``: as :func:`accumulate_gradients`'."""
    *first, last = batches
    with no_sync():
        accumulate_gradients(loss_fn, model, first, total=total)
    accumulate_gradients(loss_fn, model, [last], total=total)
