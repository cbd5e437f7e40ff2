"""The simulated stage: rank 0's share of a tensor- or pipeline-parallel step, on one process.

With ``trial.parallel: simulate`` and t > 1 or p > 1, :func:`measure_stage` makes this
process rank 0 of the trial's ``num_devices`` on torch's fake process group
(mbtune.trial.sharding.fake_process_group: no communication), builds the (dp, pp, tp) mesh
over it and rank 0's stages of the model as a real rank would (mbtune.trial.parallelize:
the first stage, and with two stages a rank the schedule's second, with their
tensor-parallel shard and, with ``sharding: fsdp``, their FSDP2 shard), and runs its
micro-batches in the order the schedule runs them on rank 0: torch's own action list for
the schedule (``torch.distributed.pipelining``'s ``get_schedule_ops``), so the activations
it holds in flight are the schedule's (g micro-batches' for gpipe, about p for 1f1b). Rank 0
holds the most of them. Its compute and its memory are real.

What a peer would send is stood in for: a later stage on rank 0 takes, for its input, the
first stage's output of the same micro-batch, and the gradient a later rank would send
back is a constant tensor of the output's shape. The zero-bubble schedules' backward, split
into an input and a weight half, runs whole at the input half. The fake group's
collectives (the tensor-parallel all-reduces, FSDP's all-gathers and reduce-scatters) take
no time and the sends none: those, and the schedule's bubble, are modelled by the trial
(mbtune.comm). The loss of a stand-in's input is not the model's: none is reported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
from collections.abc import Callable
from typing import Any

from mbtune.config.experiment import Experiment
from mbtune.lattice import BatchConfig
from mbtune.models.batch import num_samples, split_batch
from mbtune.progress import PhaseHook
from mbtune.trial import memory
from mbtune.trial.measure import Measurement
from mbtune.trial.parallelize import SCHEDULES, ParallelDims, RankModel, build_rank_model
from mbtune.trial.pipeline import stage_loss_fn, started_measurement, timed_steps
from mbtune.trial.precision import for_device
from mbtune.trial.sharding import fake_process_group, gradient_sync_skipped
from mbtune.trial.step import build_spec, rank_batch, rank_micro_batches

__all__ = ["measure_stage", "rank_actions"]


def measure_stage(
    exp: Experiment, config: BatchConfig, device: Any, phase: PhaseHook
) -> Measurement:
    """Measure rank 0's share of ``config`` on this process (see the module's docstring).
    An out-of-memory or a failure of the model is the result's status."""
    import torch

    tr = exp.trial
    dims = ParallelDims.of(config)
    precision = for_device(tr.precision, device)
    phase("building", 0, 0)
    started = started_measurement(exp, config, device, precision.name)
    with fake_process_group(config.num_devices, who="a simulated model-parallel trial"):
        mesh = dims.mesh(device.type)
        spec = build_spec(exp, config)  # whole and seeded on the CPU: the stages copy it
        started = dataclasses.replace(started, tokens_per_sample=spec.tokens_per_sample)
        try:
            model = build_rank_model(spec.module, dims, mesh, tr, config, device)
            started = dataclasses.replace(started, grad_bytes=model.grad_bytes,
                                          fsdp_units=model.unit_bytes)  # fmt: skip
            rank0 = types.SimpleNamespace(rank=0, world_size=dims.dp)  # of d replicas
            batch = rank_batch(spec, config, rank0, device, seed=exp.search.seed)
            sizes = rank_micro_batches(config, 0)
            skip_sync = dims.dp > 1 and config.grad_sync == "last"
            runner = _Rank0Step(model, dims, batch, sizes, config.batch_size / dims.dp,
                                loss_fn=stage_loss_fn(model, spec.loss_fn),
                                skip_sync=skip_sync)  # fmt: skip
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            return _timed(exp, started, runner, optimizer, precision, device, phase)
        except Exception as failure:
            verdict = memory.verdict(failure)
            return dataclasses.replace(started, status=verdict[0], reason=verdict[1])
        finally:
            memory.release(torch, device)


def rank_actions(
    dims: ParallelDims, microbatches: int, pp_rank: int = 0
) -> list[tuple[str, int, int]]:
    """Pipeline rank ``pp_rank``'s computations in one step, in its schedule's order: (``F``
    forward, ``B`` backward, ``I`` its input half, ``W`` its weight half; stage;
    micro-batch), from torch's own schedule (without a pipeline: each micro-batch's forward,
    then its backward). Each stage's micro-batches are numbered in the order of its forward
    passes, its backward passes (whole, or their input halves) in the same order (every
    schedule runs a stage's backward passes in its forwards' order), a weight half as its
    input half: torch's visualizer numbers a later rank's
    forwards from 1 in 1f1b (1F1, 1B0, 1F2, 1B1 for two micro-batches, torch 2.13)."""
    if dims.pp == 1:
        return [(kind, 0, i) for i in range(microbatches) for kind in "FB"]
    from torch.distributed import pipelining
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    schedule = getattr(pipelining, SCHEDULES[dims.schedule])
    ops = get_schedule_ops(schedule, dims.pp, microbatches, dims.stages_per_rank)[pp_rank]

    def computations(action: Any) -> list[tuple[str, int]]:
        if action is None:
            return []
        if action.sub_actions:  # dualpipev's forward of one overlapped with a backward
            return [c for sub in action.sub_actions for c in computations(sub)]
        kind = action.computation_type.value
        return [(kind, action.stage_index)] if kind in ("F", "B", "I", "W") else []

    counted: dict[tuple[str, int], int] = {}  # (F or B, stage): its computations so far
    unweighted: dict[int, list[int]] = {}  # a stage's input halves still without weight half
    numbered = []
    for kind, stage in (c for action in ops for c in computations(action)):
        if kind == "W":  # the weight half of the stage's oldest input half without one
            i = unweighted[stage].pop(0)
        else:  # a forward, or a backward whole or its input half (dualpipev has both)
            key = ("F" if kind == "F" else "B", stage)
            i = counted.get(key, 0)
            counted[key] = i + 1
            if kind == "I":
                unweighted.setdefault(stage, []).append(i)
        numbered.append((kind, stage, i))
    return numbered


class _Rank0Step:
    """Rank 0's computations of one step over its stages, the schedule's order."""

    def __init__(
        self, model: RankModel, dims: ParallelDims, batch: Any, sizes: list[int],
        total: float, *, loss_fn: Callable, skip_sync: bool,
    ) -> None:  # fmt: skip
        self.model, self.skip_sync = model, skip_sync
        self.stages = dict(zip(model.indices, model.stages, strict=True))
        self.batches = split_batch(batch, sizes)
        self.total, self.loss_fn = total, loss_fn
        self.actions = rank_actions(dims, len(sizes))
        self.last_backward = {  # each stage's last backward: the one that syncs its grads
            stage: max(i for k, s, i in self.actions if s == stage and k in "BI")
            for stage in self.stages
        }

    def run(self) -> None:
        import torch

        parts, held, sent = self.model.parts, {}, {}
        for kind, s, i in self.actions:
            stage = self.stages[s]
            if kind == "F":
                batch = self.batches[i]
                share = num_samples(batch) / self.total
                if s == self.model.num_stages - 1 and s == 0:  # its own one stage: its loss
                    held[s, i] = (self.loss_fn(stage, batch) * share, None)
                    continue
                if s == 0:
                    out = stage(*parts.io(batch)[0])
                    sent[i] = out.detach()
                else:  # a later stage: the first stage's output stands in for its input
                    out = stage(sent[i].clone().requires_grad_())
                if s == self.model.num_stages - 1:
                    out = parts.loss(out, parts.io(batch)[1]) * share
                held[s, i] = (out, None if s == self.model.num_stages - 1 else out)
            elif kind in "BI":
                out, like = held.pop((s, i))
                grad = None if like is None else torch.full_like(like, 1e-3)
                with self._no_sync(stage, last=i == self.last_backward[s]):
                    out.backward(grad)

    def _no_sync(self, stage: Any, *, last: bool) -> contextlib.AbstractContextManager[Any]:
        if self.skip_sync and not last:
            return gradient_sync_skipped(stage)
        return contextlib.nullcontext()


def _timed(
    exp: Experiment, started: Measurement, runner: _Rank0Step, optimizer: Any, precision: Any,
    device: Any, phase: PhaseHook,
) -> Measurement:  # fmt: skip
    """The trial protocol's steps of rank 0's share; no one to agree with."""

    def run() -> None:
        with precision.autocast():
            runner.run()

    timed = timed_steps(exp.trial, device, run, optimizer, precision, memory.verdict, phase)
    verdict = timed.verdict or memory.verdict(
        None, memory.over_budget(exp.trial, timed.budget, timed.peak)
    )
    # comm_s None: modelled, as the fake group's collectives and the sends took no time
    return dataclasses.replace(timed, verdict=verdict).measured(started, comm_s=None)
