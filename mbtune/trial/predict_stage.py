"""Memory before measuring where a configuration splits the model (tensor_parallel t > 1 or
pipeline_parallel p > 1): the peak of its busiest device, for its stages and its shard
(mbtune.trial.predict reads it). That is rank 0, which holds the first stage and so the
most activations in flight, or the last pipeline rank, which holds the head and its
logits (in gpipe as many micro-batches' as rank 0; a gpt of 8,192 words at 256 tokens
peaks there under 1f1b too): both are predicted, and the larger is the device's, as a
trial's peak is the largest rank's.

How. The rank's share is made as a real rank makes it (mbtune.trial.parallelize.
build_rank_model: the model's split into stages, its tensor-parallel plan, FSDP2 or
``replicate`` over the data-parallel replicas), on the meta device, over a (dp, pp, tp)
device mesh of torch's fake process group (no communication; this process the rank
predicted, as mbtune.trial.sharding.fake_process_group makes rank 0); then its stages take
two steps on fake tensors, counted by torch's memory trackers (mbtune.trial.tracking),
their forward and backward passes in the order torch's own schedule runs them on that rank
(``torch.distributed.pipelining``'s action list: mbtune.trial.stage.rank_actions).

What torch's PipelineStage holds, the trace holds. What a peer sends arrives in receive
buffers made once for each of the step's g micro-batches and kept from the first step on
(``args_recv_info``: a stage's input from the stage before it on another rank;
``grad_recv_info``: its output's gradient from the stage after it), each of the first
stage's output's shape, found on fake tensors: collective buffers, g of each kind a
stage, whatever the schedule holds in flight. And to each micro-batch's backward pass a
stage keeps its output (``fwd_cache``): on the last stage the logits, which the loss
alone would not keep (it saves its log-probabilities), as many as it holds micro-batches
in flight. Without them the prediction of 2 gloo ranks' peaks read 5-12% low, more with
more micro-batches in flight (docs/benchmarks.md).

The activations in flight. The schedule's action list says how many: a micro-batch's
activations on a stage are held from its forward pass to its backward pass, or, where the
schedule splits the backward into an input and a weight half (zbv, dualpipev), to the
weight half, which still reads them (the trace runs the whole backward there). Rank 0 then
holds, at most (:func:`chunks_in_flight`), for g >= 2p: gpipe all g micro-batches (every
forward runs first); 1f1b min(g, p) (p - 1 warm-up forwards, then a forward and a
backward in turn); interleaved_1f1b 3p - 1 chunks of its v = 2 stages, each half of the
rank's layers: p + (p - 1) / 2 micro-batches of them, Megatron's p + (p - 1) / v; zbv 2p
chunks (p micro-batches of the rank's layers), dualpipev 2p + 1: the V's warm-up, the
weight halves still to run. The last rank holds 1 (1f1b), g (gpipe), p + 1
(interleaved_1f1b), 2p (zbv), 2p + 1 (dualpipev: every rank as many, as DualPipe
balances them).

Only a few micro-batches are traced: the fewest g' (the largest of the replica's) whose
schedule holds as many in flight on the rank as g's does, and, where g has more than that,
one more, so that a forward runs with gradients already there as in a long step's steady
state
(:func:`traced_micro_batches`); the schedule's own rules on g' hold (g' a multiple of p
for interleaved_1f1b, at least 2p for dualpipev). A stage of a deep model is cut as
mbtune.trial.blocks cuts one: the rank's stages traced with 3 blocks each and again with 4
(the model cut to 3 and 4 blocks a stage), each part counted from the difference to the
stage's depth, where its stages have more than 8 blocks (two cut traces are quicker than
one whole then). Each computation of the schedule is a phase of its own
(mbtune.trial.tracking.trace_steps): its peak scales with the depth on its own.

As the real pipeline (torch's PipelineStage) runs a sharded stage, its backward passes
keep the gathered parameters and reduce no gradient but the stage's last of the step's
(``set_reshard_after_backward(False)``, ``set_requires_gradient_sync(False)``); without a
pipeline (t > 1 alone) a sharded stage skips the sync with ``grad_sync: last`` as any
sharded step does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig, layout_rule
from mbtune.models.batch import split_batch
from mbtune.trial.blocks import BASE_DEPTH, cut, repeated_blocks, scaled_parts
from mbtune.trial.parallelize import (
    ParallelDims,
    RankModel,
    build_rank_model,
    model_parts,
)
from mbtune.trial.pipeline import stage_loss_fn
from mbtune.trial.precision import Precision
from mbtune.trial.sharding import fake_process_group, gradient_sync_skipped
from mbtune.trial.stage import rank_actions
from mbtune.trial.step import rank_micro_batches
from mbtune.trial.tracking import batch_tensor_list, to_empty_tied, trace_steps, trackers

__all__ = [
    "CUT_ABOVE",
    "HELD_SENDS",
    "RankShare",
    "chunks_in_flight",
    "stage_peaks",
    "traced_micro_batches",
]

HELD_SENDS = {"gpipe": ("B",), "interleaved_1f1b": ("F", "B"), "zbv": ("F", "B"),
              "dualpipev": ("F", "B")}  # fmt: skip
"""The sends a schedule keeps to the end of the step, by kind (``F``: a stage's output to
the stage after it, ``B``: its input's gradient to the stage before it, each on another
rank): a send's work holds its tensor until it is waited for, and torch's ScheduleGPipe
waits for its backward sends after its last backward pass, the schedules of two stages a
rank (``_PipelineScheduleRuntime``) for every send at the end of the step; Schedule1F1B
waits for each before the next (torch 2.13)."""

CUT_ABOVE = 2 * (BASE_DEPTH + 1)
"""The blocks a stage has beyond which its traces are cut (mbtune.trial.blocks): two cut
traces, of BASE_DEPTH and one more, are then quicker than one whole."""


@dataclass(frozen=True, kw_only=True)
class RankShare:
    """What the busiest rank of a split model holds, beside its bytes."""

    pipeline_rank: int
    """Its place in the pipeline: 0 (the first stage) or p - 1 (the last)."""
    stages: tuple[int, ...]
    """Its stages, of :attr:`num_stages`."""
    num_stages: int
    in_flight: int
    """Chunks (a stage's activations of one micro-batch) it holds at once, at most, by the
    schedule (:func:`chunks_in_flight`)."""
    traced_micro_batches: int
    """The micro-batches of a step traced (:func:`traced_micro_batches`)."""


def chunks_in_flight(dims: ParallelDims, microbatches: int, pp_rank: int = 0) -> int:
    """The most chunks pipeline rank ``pp_rank`` holds the activations of at once in one
    step of ``dims``'s schedule with ``microbatches``: each from its forward pass to its
    backward pass (its weight half, where the schedule splits it)."""
    held, most = 0, 0
    for kind, _, _ in _with_release(rank_actions(dims, microbatches, pp_rank)):
        if kind == "F":
            held += 1
            most = max(most, held)
        elif kind == "release":
            held -= 1
    return most


def traced_micro_batches(config: BatchConfig, microbatches: int, pp_rank: int = 0) -> int:
    """The fewest micro-batches g' <= g (``microbatches``) whose step holds as many chunks
    in flight on pipeline rank ``pp_rank`` as g's, one more where g has more (a forward with
    gradients already there), and that the schedule accepts (mbtune.lattice.layout_rule)."""
    dims = ParallelDims.of(config)
    most = chunks_in_flight(dims, microbatches, pp_rank)
    for g in range(1, microbatches):
        if g <= most or layout_rule(config.num_devices, *config.layout, microbatches=g):
            continue
        if chunks_in_flight(dims, g, pp_rank) == most:
            return g
    return microbatches


def stage_peaks(
    spec: Any, config: BatchConfig, trial: Any, precision: str, *, card: bool, whole: bool
) -> tuple[list[dict[str, int]], RankShare]:
    """The candidate peaks (parts, as mbtune.trial.predict's) of the busiest rank's share
    of ``config`` (see the module's docstring), and what it holds: rank 0's, or the last
    pipeline rank's where its candidates are larger. ``spec``: the model built on the meta
    device; ``precision``: resolved for the device predicted; ``card``: a CUDA device's
    foreach AdamW (mbtune.trial.tracking.trace_steps); ``whole``: every block of its
    stages traced."""
    dims = ParallelDims.of(config)
    found = [_rank_peaks(spec, config, trial, precision, pp_rank, card=card, whole=whole)
             for pp_rank in sorted({0, dims.pp - 1})]  # fmt: skip
    return max(found, key=lambda f: max(sum(c.values()) for c in f[0]))


def _rank_peaks(
    spec: Any, config: BatchConfig, trial: Any, precision: str, pp_rank: int, *, card: bool,
    whole: bool,
) -> tuple[list[dict[str, int]], RankShare]:  # fmt: skip
    """:func:`stage_peaks` of pipeline rank ``pp_rank`` (its first data- and tensor-parallel
    place: they hold the same)."""
    dims = ParallelDims.of(config)
    module = spec.module
    per_stage = model_parts(module, dims).num_blocks // dims.num_stages
    step = rank_micro_batches(config, 0)  # the step's g: each buffers a receive
    traced = traced_micro_batches(config, len(step), pp_rank)
    sizes = step[:traced]  # the largest come first
    # as a rank builds it, on the meta device: nothing compiled, the precision resolved
    as_built = dataclasses.replace(trial, compile=False, precision=precision)
    actions = rank_actions(dims, len(sizes), pp_rank)
    share: dict[str, Any] = {}

    def trace(depths: dict[str, int]) -> list[dict[str, int]]:
        """The candidate peaks of the rank's stages of a copy of the model, its runs of
        blocks cut to ``depths`` blocks a stage."""
        copied = cut(module, {name: depth * dims.num_stages for name, depth in depths.items()})
        with _fake_rank(dims, pp_rank) as mesh:
            rank = build_rank_model(copied, dims, mesh, as_built, config, _meta())
            share.update(stages=rank.indices, num_stages=rank.num_stages)
            steps = _RankSteps(rank, actions, spec, step, traced, precision,
                               trial.sharding == "fsdp", grad_sync=config.grad_sync,
                               pipeline=dims.pp > 1,
                               held_sends=HELD_SENDS.get(dims.schedule, ()))  # fmt: skip
            return steps.trace(card=card)

    # the run the stages share out, cut a stage at a time; a model with another run of
    # blocks is traced whole, and so is a stage too shallow for two cut traces to be
    # quicker than one whole
    runs = {} if whole else repeated_blocks(module)
    split = {name: per_stage for name, n in runs.items() if n == per_stage * dims.num_stages}
    peaks = None
    if len(split) == 1 and len(runs) == 1 and per_stage > CUT_ABOVE:
        try:
            peaks = _counted(split, trace)
        except MbtuneError:
            raise
        except Exception:  # a forward that does not take its blocks cut: traced whole below
            peaks = None
    peaks = peaks or trace({})
    in_flight = chunks_in_flight(dims, len(sizes), pp_rank)
    return peaks, RankShare(pipeline_rank=pp_rank, in_flight=in_flight,
                            traced_micro_batches=traced, **share)  # fmt: skip


def _counted(
    split: dict[str, int], trace: Callable[[dict[str, int]], list[dict[str, int]]]
) -> list[dict[str, int]] | None:
    """The candidate peaks of the rank's stages of ``split`` blocks, counted from cut traces
    (mbtune.trial.blocks.scaled_parts), or None where they cannot be: traced with BASE_DEPTH
    blocks a stage and one more, and where a computation's peak moved between them
    (:func:`_moved`), with one block more each (its peak then at the moment that outgrew
    the other, as with every block after), then no more. Each distinct cut is traced once
    (BASE_DEPTH + 1 blocks is the deeper trace of the first pair and the base of the second)."""
    traced: dict[tuple[tuple[str, int], ...], list[dict[str, int]]] = {}
    for shift in (0, 1):
        cuts: list[list[dict[str, int]]] = []  # the cut traces' candidates, in turn
        deeper = functools.partial(_deeper, trace, shift, cuts, traced)
        peaks = scaled_parts({name: n - shift for name, n in split.items()}, deeper)
        if not _moved(*cuts):
            return peaks
    return None


def _deeper(
    trace: Callable[[dict[str, int]], list[dict[str, int]]], shift: int,
    cuts: list[list[dict[str, int]]], traced: dict[tuple[tuple[str, int], ...], Any],
    depths: dict[str, int],
) -> list[dict[str, int]]:  # fmt: skip
    """``trace`` of ``shift`` blocks more a stage than ``depths``, kept in ``cuts``; a cut
    ``traced`` already is read from it (the candidates are only read, never changed)."""
    key = tuple(sorted((name, depth + shift) for name, depth in depths.items()))
    if key not in traced:
        traced[key] = trace(dict(key))
    cuts.append(traced[key])
    return cuts[-1]


def _moved(base: list[dict[str, int]], longer: list[dict[str, int]]) -> bool:
    """Whether a computation's peak fell at another moment of it with one more block a
    stage (a part of its peak smaller with more blocks): then its parts do not grow by a
    block's each, and counted from the cut traces they would be wrong (a sharded
    tensor-parallel 12B Qwen2 on 4 devices, t 2: 141 GiB counted from 3 and 4 blocks, 67
    traced whole, its last backward pass's peak moving from its activations to its
    gathered parameters)."""
    return any(after[part] < before[part]
               for before, after in zip(base, longer, strict=True) for part in before)  # fmt: skip


@contextlib.contextmanager
def _fake_rank(dims: ParallelDims, pp_rank: int) -> Iterator[Any]:
    """The (dp, pp, tp) mesh over torch's fake process group (no communication) with this
    process at pipeline rank ``pp_rank`` (its first data- and tensor-parallel place), as
    mbtune.trial.sharding.fake_process_group makes rank 0's."""
    if pp_rank == 0:
        with fake_process_group(dims.dp * dims.pp * dims.tp, who="mbtune memory"):
            yield dims.mesh("cpu")
        return
    import torch.distributed as dist

    with fake_process_group(1, who="mbtune memory"):
        pass  # the same checks and backend, then this rank's own group
    dist.init_process_group("fake", rank=pp_rank * dims.tp, world_size=dims.dp * dims.pp * dims.tp,
                            store=dist.HashStore())  # fmt: skip
    try:
        yield dims.mesh("cpu")
    finally:
        dist.destroy_process_group()


class _RankSteps:
    """A pipeline rank's computations of a step, in its schedule's order, on fake tensors,
    holding what torch's PipelineStage holds (see :meth:`_forward`)."""

    def __init__(
        self, rank: RankModel, actions: list[Any], spec: Any, step: list[int], traced: int,
        precision: str, sharded: bool, *, grad_sync: str, pipeline: bool,
        held_sends: tuple[str, ...],
    ) -> None:  # fmt: skip
        self.rank, self.spec, self.sharded, self.held_sends = rank, spec, sharded, held_sends
        self.step, self.sizes = step, step[:traced]  # every micro-batch's size; the traced
        self.pipeline, self.grad_sync = pipeline, grad_sync
        self.precision = Precision(precision, "cpu")
        self.actions = _with_release(actions)
        self.stages = dict(zip(rank.indices, rank.stages, strict=True))
        self.last = rank.num_stages - 1
        self.last_release = {  # each stage's last backward: the one that syncs its grads
            s: max(j for j, (kind, stage, _) in enumerate(self.actions)
                   if kind == "release" and stage == s)
            for s in self.stages
        }  # fmt: skip

    def trace(self, *, card: bool) -> list[dict[str, int]]:
        """The candidate peaks, each with the receive buffers (:meth:`_receive_buffers`)
        among its collective buffers: held from the first step on, they are in every one."""
        import torch

        tools = trackers()
        parts = self.rank.parts  # a stage of the first block: what a later stage receives
        split = self.rank.num_stages > 1
        first = parts.make_stage(0, 1, first=True, last=False) if split else None
        # meta tensors go into the fake mode as inputs (they hold nothing either)
        with tools.fake_mode(allow_non_fake_inputs=True):
            self.received = self._received_shapes(first) if first is not None else {}
            self.buffers = self._receive_buffers()
            for stage in self.rank.stages:
                to_empty_tied(stage, "cpu")
                stage.train()
            parameters = self.rank.parameters()
            optimizer = torch.optim.AdamW(parameters, lr=1e-4)
            batch = self.spec.make_batch(sum(self.sizes), torch.device("cpu"))
            self.batches = split_batch(batch, self.sizes)
            buffers = list(self.buffers.values())
            if self.sharded and len(self.rank.stages) == 1:
                self.tracker = tools.fsdp(self.rank.stages[0], optimizer)
                self.tracker.track_inputs(tuple(self.batches))
                self.tracker.track_external(*buffers)
            else:
                self.tracker = tools.plain()
                self.tracker.track_external(*self.rank.stages, optimizer, *buffers,
                                            *batch_tensor_list(self.batches))  # fmt: skip
            peaks = trace_steps(self.tracker, optimizer, parameters, self.phases, card=card)
        # held throughout, the buffers are in every candidate, where the trackers count
        # them with the batch (``Other``): moved to the collective buffers
        buffered = sum(t.numel() * t.element_size() for t in buffers)
        for peak in peaks:
            peak["activations_bytes"] -= buffered
            peak["collective_buffers_bytes"] += buffered
        return peaks

    def _received_shapes(self, first: Any) -> dict[int, Any]:
        """What a stage after the first receives for each micro-batch size, (shape, dtype):
        the output of ``first`` (a first stage of one block, on the meta device)."""
        import torch

        parts, found = self.rank.parts, {}
        to_empty_tied(first, "cpu")
        for n in set(self.step):
            inputs = parts.io(self.spec.make_batch(n, torch.device("cpu")))[0]
            with self.precision.autocast():
                out = first(*inputs)
            found[n] = (tuple(out.shape), out.dtype)
        return found

    def _receive_buffers(self) -> dict[tuple[str, int, int], Any]:
        """The buffers torch's PipelineStage receives into, made once for each of the step's
        g micro-batches and kept (``args_recv_info``, ``grad_recv_info``): ("F", stage, i),
        a stage's input from the stage before it on another rank, and ("B", stage, i), the
        gradient of its output from the stage after it on another rank (a stage fed by one
        on this rank, the V's middle, takes that one's output itself). Each of the shape a
        stage after the first receives: a pipeline's stages pass on one shape. Counted as
        collective buffers (:meth:`trace`)."""
        import torch

        found = {}
        for s in self.stages:
            for kind, peer in (("F", s - 1), ("B", s + 1)):  # whom each kind comes from
                if not self._elsewhere(peer):
                    continue
                for i, n in enumerate(self.step):
                    shape, dtype = self.received[n]
                    found[kind, s, i] = torch.empty(shape, dtype=dtype)
        return found

    def phases(self) -> list[Callable[[], None]]:
        """One step's forward and backward passes of the rank's stages, each a phase of its
        own (mbtune.trial.tracking.trace_steps), in the schedule's order."""
        self.held: dict[tuple[int, int], tuple[Any, Any, Any]] = {}
        self.passed: dict[tuple[int, int], Any] = {}  # gradients for a stage on this rank
        self.sent: list[Any] = []  # what the step's sends hold to its end (HELD_SENDS)
        return [functools.partial(self._run, j) for j in range(len(self.actions))]

    def _run(self, j: int) -> None:
        kind, s, i = self.actions[j]
        if j == 0:  # the step's micro-batches not traced: as if sent before the traced ones
            self.sent = self._untraced_sends()
        if kind == "F":
            self.held[s, i] = self._forward(s, i)
            if "F" in self.held_sends and self._elsewhere(s + 1):
                self.sent.append(self.held[s, i][1])
        else:
            self._backward(j, s, i)
        if j == len(self.actions) - 1:  # the step's end: its sends waited for
            self.sent.clear()

    def _backward(self, j: int, s: int, i: int) -> None:
        with self._sync(self.stages[s], last=j == self.last_release[s]):
            loss_or_out, _, received = self.held.pop((s, i))
            if s == self.last:
                loss_or_out.backward()
            else:
                grad = self.passed.pop((s, i), None)
                loss_or_out.backward(self.buffers["B", s, i] if grad is None else grad)
        if received is not None:  # the stage sends its input's gradient on and drops it
            if s - 1 in self.stages:
                self.passed[s - 1, i] = received.grad
            elif "B" in self.held_sends:
                self.sent.append(received.grad)
            received.grad = None

    def _untraced_sends(self) -> list[Any]:
        """What the sends of the step's micro-batches that are not traced hold
        (:data:`HELD_SENDS`), each of the shape a stage after the first receives: the
        traced micro-batches stand for the step's last ones (the first ones where they
        warm up), so that the end of the step, when the most sends are held and the
        schedule's steady state as many chunks in flight as the step's, is the real one's."""
        import torch

        to = {"F": 1, "B": -1}  # a send's kind: to the stage after, or before
        sent = []
        for s in self.stages:
            for kind in self.held_sends:
                if not self._elsewhere(s + to[kind]):
                    continue
                for n in self.step[len(self.sizes) :]:
                    shape, dtype = self.received[n]
                    sent.append(torch.empty(shape, dtype=dtype))
        return sent

    def _elsewhere(self, stage: int) -> bool:
        """Whether ``stage`` is a stage of the model on another rank."""
        return 0 <= stage <= self.last and stage not in self.stages

    def _forward(self, s: int, i: int) -> tuple[Any, Any, Any]:
        """Stage ``s``'s forward pass of micro-batch ``i``, and what it holds to its
        backward pass, as torch's PipelineStage (``fwd_cache``): what the backward starts
        from (the loss on the last stage), the stage's output (the last stage's logits
        too, until its backward pass) and its input where it received one (its receive
        buffer, or the output of the stage before it on this rank)."""
        stage, batch, parts = self.stages[s], self.batches[i], self.rank.parts
        for module in stage.modules():  # the trackers follow one forward pass per module
            self.tracker.memory_tracking.pop(module, None)
        with self.precision.autocast():
            if s == 0 and s == self.last:  # its own one stage (t > 1 alone): its loss
                return stage_loss_fn(self.rank, self.spec.loss_fn)(stage, batch), None, None
            if s == 0:
                return (out := stage(*parts.io(batch)[0])), out, None
            received = (self.held[s - 1, i][1].detach() if s - 1 in self.stages
                        else self.buffers["F", s, i]).requires_grad_()  # fmt: skip
            out = stage(received)
            if s == self.last:
                return parts.loss(out, parts.io(batch)[1]), out, received
            return out, out, received

    def _sync(self, stage: Any, *, last: bool) -> contextlib.AbstractContextManager[Any]:
        """A backward pass's FSDP2 settings (sharded, or replicated over d > 1 without
        sharding): a pipeline stage's as torch's PipelineStage sets them (gathered
        parameters kept, no reduce-scatter or all-reduce, until its last backward of the
        step); without a pipeline, the sync skipped but in the last with ``grad_sync:
        last``."""
        if not hasattr(stage, "set_requires_gradient_sync"):  # no data parallelism
            return contextlib.nullcontext()
        if not self.pipeline:
            return gradient_sync_skipped(stage, skip=self.grad_sync == "last" and not last)
        stage.set_reshard_after_backward(last)
        stage.set_requires_gradient_sync(last)
        return contextlib.nullcontext()


def _with_release(actions: list[tuple[str, int, int]]) -> list[tuple[str, int, int]]:
    """``actions`` (mbtune.trial.stage.rank_actions') as the forward passes and, for each
    chunk, the one action that frees its activations (``release``): its weight half where
    the schedule splits the backward, else its backward."""
    weighted = {(s, i) for kind, s, i in actions if kind == "W"}
    out = []
    for kind, s, i in actions:
        if kind == "F":
            out.append((kind, s, i))
        elif kind == "W" or (kind in "BI" and (s, i) not in weighted):
            out.append(("release", s, i))
    return out


def _meta() -> Any:
    import torch

    return torch.device("meta")
