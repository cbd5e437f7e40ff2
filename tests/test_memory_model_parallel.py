"""Memory before measuring where a configuration splits the model (mbtune.trial.predict_stage):
the activations in flight by schedule, rank 0's shard by part, the stages' blocks counted
from a few as the whole trace counts them, and the search's screen over layouts."""

import dataclasses
import functools
import json

import pytest
import yaml

from mbtune.cli import main
from mbtune.config.load import parse_experiment
from mbtune.lattice import BatchConfig
from mbtune.trial import predict, predict_stage
from mbtune.trial import screen as screening_module
from mbtune.trial.blocks import BASE_DEPTH
from mbtune.trial.blocks import cut as cut_blocks
from mbtune.trial.parallelize import ParallelDims, build_rank_model, model_parts
from mbtune.trial.predict import predict_memory
from mbtune.trial.predict_stage import chunks_in_flight, traced_micro_batches
from mbtune.trial.screen import predicted_oom, screen
from mbtune.trial.sharding import fake_process_group
from mbtune.trial.step import build_spec

TINY_GPT = {"name": "gpt", "n_layer": 4, "n_head": 2, "d_model": 32, "seq_len": 16,
            "vocab_size": 64}  # fmt: skip
LOGITS_GPT = {**TINY_GPT, "vocab_size": 4096, "seq_len": 64}
"""A large vocabulary: the last stage's logits outweigh the rest of a stage's activations."""


def raw(model: dict = TINY_GPT, *, t: int = 1, p: int = 1, n: int = 2, schedule="1f1b",
        b: int = 16, m: int = 2, **trial) -> dict:  # fmt: skip
    return {
        "name": "memory-mp",
        "model": model,
        "train_input": dict(
            batch_size=b, micro_batch_size=m, num_devices=n, tensor_parallel=t, pipeline_parallel=p
        ),
        "trial": dict(
            device="cpu", precision="fp32", compile=False, pipeline_schedule=schedule, **trial
        ),
    }


def config_of(exp) -> BatchConfig:
    t = exp.train_input
    return BatchConfig(t.batch_size, t.num_devices, t.micro_batch_size,
                       tensor_parallel=t.tensor_parallel, pipeline_parallel=t.pipeline_parallel,
                       pipeline_schedule=exp.trial.pipeline_schedule)  # fmt: skip


@pytest.mark.parametrize(
    ("schedule", "p", "g", "chunks"),
    [
        ("gpipe", 2, 8, 8),  # every forward first
        ("gpipe", 4, 16, 16),
        ("1f1b", 2, 8, 2),  # min(g, p)
        ("1f1b", 4, 16, 4),
        ("interleaved_1f1b", 2, 8, 5),  # 3p - 1 chunks of half the rank's layers
        ("interleaved_1f1b", 4, 16, 11),
        ("zbv", 2, 8, 4),  # 2p: the weight halves keep theirs
        ("zbv", 4, 16, 8),
        ("dualpipev", 2, 8, 5),  # 2p + 1
    ],
)
def test_the_chunks_in_flight_are_the_schedules(schedule, p, g, chunks):
    assert chunks_in_flight(ParallelDims(1, p, 1, schedule), g) == chunks


def test_the_last_pipeline_rank_holds_its_own_chunks_in_flight():
    """1f1b's last stage runs each backward right after its forward; the V schedules'
    last rank holds the middle of the V (stages p - 1 and p), dualpipev as many as rank 0
    (DualPipe balances them) once each weight half is paired with its own input half."""
    assert chunks_in_flight(ParallelDims(1, 2, 1, "1f1b"), 8, pp_rank=1) == 1
    assert chunks_in_flight(ParallelDims(1, 4, 1, "1f1b"), 16, pp_rank=3) == 1
    assert chunks_in_flight(ParallelDims(1, 2, 1, "gpipe"), 8, pp_rank=1) == 8
    assert chunks_in_flight(ParallelDims(1, 2, 1, "interleaved_1f1b"), 8, pp_rank=1) == 3
    assert chunks_in_flight(ParallelDims(1, 2, 1, "zbv"), 8, pp_rank=1) == 4
    assert chunks_in_flight(ParallelDims(1, 2, 1, "dualpipev"), 8, pp_rank=1) == 5
    assert chunks_in_flight(ParallelDims(1, 4, 1, "dualpipev"), 16, pp_rank=3) == 9


def test_a_step_is_traced_with_the_fewest_micro_batches_that_hold_as_many():
    def traced(g: int, **layout) -> int:
        c = BatchConfig(16 * g, 2 * layout.get("pipeline_parallel", 1), 16, **layout)
        return traced_micro_batches(c, g)

    assert traced(16, pipeline_parallel=2) == 3  # 2 in flight, and one more
    assert traced(2, pipeline_parallel=2) == 2  # no more than the step has
    assert traced(8, pipeline_parallel=2, pipeline_schedule="gpipe") == 8  # all in flight
    # 5 in flight, and g' a multiple of p: 6
    assert traced(16, pipeline_parallel=2, pipeline_schedule="interleaved_1f1b") == 6
    assert traced(16, tensor_parallel=2) == 2  # one at a time: the first and one more


def stage_parameter_bytes(exp, config, stage: int) -> int:
    """Stage ``stage``'s parameters as the model splits (its ParallelParts), tensor
    parallelism's shard of each as the real build makes it (mbtune.trial.parallelize)."""
    import torch

    dims = ParallelDims.of(config)
    spec = build_spec(exp, config, meta=True)
    if dims.tp == 1:
        parts = model_parts(spec.module, dims)
        per, last = parts.num_blocks // dims.num_stages, dims.num_stages - 1
        built = parts.make_stage(stage * per, (stage + 1) * per, first=stage == 0,
                                 last=stage == last)  # fmt: skip
        return 4 * sum(p.numel() for p in built.parameters())
    with fake_process_group(config.num_devices, who="the test"):
        rank = build_rank_model(spec.module, dims, dims.mesh("cpu"), exp.trial, config,
                                torch.device("meta"))  # fmt: skip
    return rank.grad_bytes


@pytest.mark.parametrize("layout", [{"t": 2}, {"p": 2}])
def test_mbtune_memory_gives_the_busiest_ranks_shard_and_stages(
    tmp_path, capsys, monkeypatch, split_p2, layout
):
    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump(raw(**layout)))
    exp = parse_experiment(raw(**layout))
    asked = []
    if "p" in layout:  # the schedule test's prediction of this experiment (1f1b), made once

        def known(given, config):
            assert (given.model, given.trial, config) == (exp.model, exp.trial, config_of(exp))
            asked.append(config)
            return split_p2(TINY_GPT, "1f1b")

        monkeypatch.setattr(predict, "predict_memory", known)
    assert main(["memory", str(path), "--json"]) == 0
    assert len(asked) == ("p" in layout)
    got = json.loads(capsys.readouterr().out)
    rank = got["rank"]
    assert rank["num_stages"] == layout.get("p", 1)
    assert rank["stages"] == [rank["pipeline_rank"]]  # 1f1b: a stage a rank
    assert rank["in_flight"] == (2 if rank["pipeline_rank"] == 0 and "p" in layout else 1)
    shard = stage_parameter_bytes(exp, config_of(exp), rank["pipeline_rank"])
    parts = got["parts"]
    # its own share of the weights, their gradients and AdamW's two moments (and steps)
    assert parts["parameters_bytes"] == parts["gradients_bytes"] == shard
    assert shard < 4 * got["num_parameters"] * 0.8
    assert 2 * shard <= parts["optimizer_state_bytes"] <= 2 * shard + 8 * 64
    # a pipeline stage's receive buffers, one a micro-batch (g = 8) of its input or its
    # output's gradient (2 samples of 16 tokens of width 32, fp32), kept from the first step
    buffers = 8 * 2 * 16 * 32 * 4 if "p" in layout else 0
    assert parts["collective_buffers_bytes"] == buffers
    assert got["peak_memory_bytes"] == sum(parts.values())
    assert (got["tensor_parallel"], got["pipeline_parallel"]) == (
        layout.get("t", 1),
        layout.get("p", 1),
    )


@pytest.fixture(scope="module")
def split_p2():
    """A gpt (TINY_GPT, LOGITS_GPT) over p = 2 of 2 devices (B 16, m 2: g 8) predicted under
    a schedule, each once for the tests that read it: ``split_p2(model, schedule)``."""

    @functools.cache
    def predicted(model: tuple, schedule: str):
        exp = parse_experiment(raw(dict(model), p=2, schedule=schedule))
        return predict_memory(exp, config_of(exp))

    return lambda model, schedule: predicted(tuple(model.items()), schedule)


@pytest.mark.slow
def test_the_last_stage_is_predicted_where_it_holds_more(split_p2):
    """The last stage's logits outweigh the first stage's two micro-batches in flight under
    1f1b; under gpipe the last holds all of them too."""
    for schedule in ("1f1b", "gpipe"):
        predicted = split_p2(LOGITS_GPT, schedule)
        assert predicted.share.pipeline_rank == 1, schedule
        assert predicted.share.stages == (1,)


def test_the_schedule_sets_the_activations_the_busiest_rank_holds(split_p2):
    """gpipe holds all 8 micro-batches' activations (its last stage, with the logits, the
    busiest), 1f1b two on its first stage."""
    gpipe, one = (split_p2(TINY_GPT, schedule) for schedule in ("gpipe", "1f1b"))
    assert (gpipe.share.in_flight, one.share.in_flight) == (8, 2)
    assert (gpipe.share.pipeline_rank, one.share.pipeline_rank) == (1, 0)
    assert gpipe.activations_bytes > 2 * one.activations_bytes


def cut_traces(monkeypatch) -> list[dict[str, int]]:
    """The depths each trace of a split model's prediction cuts its runs of blocks to (the
    whole model's, all its stages'), in the order they are traced."""
    depths = []

    def seen_cut(module, to: dict[str, int]):
        depths.append(to)
        return cut_blocks(module, to)

    monkeypatch.setattr(predict_stage, "cut", seen_cut)
    return depths


@pytest.mark.slow
def test_a_deep_stage_counted_from_a_few_blocks_is_its_whole_trace(monkeypatch):
    """10 blocks: 5 a stage, traced with 3 and 4 and counted to it, here above 4 blocks
    (CUT_ABOVE, 8 by default, would take 18 blocks and a third more time); 4 micro-batches
    of 2: few to trace."""
    monkeypatch.setattr(predict_stage, "CUT_ABOVE", BASE_DEPTH + 1)
    traced = cut_traces(monkeypatch)
    exp = parse_experiment(raw({**TINY_GPT, "n_layer": 10}, b=8, p=2))
    config = config_of(exp)
    cut = predict_memory(exp, config)
    assert traced == [{"blocks": 6}, {"blocks": 8}] * 2  # the first rank's, the last's
    assert cut.as_dict() == predict_memory(exp, config, whole=True).as_dict()


@pytest.mark.slow
def test_interleaved_stages_counted_from_a_few_blocks_are_their_whole_trace(monkeypatch):
    """interleaved_1f1b's rank holds two stages of the four, and more chunks in flight than
    1f1b's (4 against 2 at g = 2): 20 blocks, 5 a stage, traced with 3 and 4 blocks a stage
    and counted to 5, here above 4 blocks (CUT_ABOVE, 8 by default, would take 36 blocks
    and 2 minutes). What it holds beyond the process's own memory is the whole trace's,
    part by part: the buffers of three of its stages' neighbours on the other rank, g each;
    the activations of 4 chunks in flight."""
    monkeypatch.setattr(predict_stage, "CUT_ABOVE", BASE_DEPTH + 1)
    traced = cut_traces(monkeypatch)
    model = {**TINY_GPT, "n_layer": 20}
    exp = parse_experiment(raw(model, b=4, p=2, schedule="interleaved_1f1b"))
    config = config_of(exp)
    cut = predict_memory(exp, config)
    assert traced == [{"blocks": 12}, {"blocks": 16}] * 2  # 3 and 4 a stage, on each rank
    assert cut.as_dict() == predict_memory(exp, config, whole=True).as_dict()
    assert cut.share.num_stages == 4 and len(cut.share.stages) == 2
    assert cut.collective_buffers_bytes == 3 * 2 * (2 * 16 * 32 * 4)
    assert (cut.share.pipeline_rank, cut.share.in_flight) == (0, 4)
    assert chunks_in_flight(ParallelDims(1, 2, 1, "1f1b"), 2) == 2


def test_the_last_stage_holds_its_logits_to_their_backward_pass(split_p2):
    """gpipe's last stage holds all 8 micro-batches to their backward passes: each one's
    logits (as torch's PipelineStage keeps a stage's output) and the loss's log-probabilities
    of them, 2 x 64 x 4,096 fp32 each (more than the rest of its activations)."""
    predicted = split_p2(LOGITS_GPT, "gpipe")
    assert (predicted.share.pipeline_rank, predicted.share.in_flight) == (1, 8)
    logits = 2 * 64 * 4096 * 4
    assert 2 * 8 * logits <= predicted.activations_bytes < 3 * 8 * logits


@pytest.mark.slow
def test_a_stage_whose_peak_moves_with_its_depth_is_counted_from_deeper_cuts(monkeypatch):
    """A small Qwen2 split over t = 4 of 4 devices, sharded: its last backward pass's peak
    falls at another moment with 4 blocks than with 3 (its gathered parameters outgrow its
    activations), so the cut traces' parts do not grow by a block's each (of 12 blocks,
    counted from 3 and 4 they read 67.3 MiB; from 4 and 5, the whole trace's 53.9). 6
    blocks, cut above 4 (CUT_ABOVE, 8 by default, would take 9 blocks): counted from 4 and
    5, once the peak moved from 3 to 4 and not from 4 to 5."""
    pytest.importorskip("transformers")
    monkeypatch.setattr(predict_stage, "CUT_ABOVE", BASE_DEPTH + 1)
    traced = cut_traces(monkeypatch)
    model = {"name": "hf:qwen2", "task": "causal-lm", "seq_len": 64, "num_hidden_layers": 6,
             "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 4,
             "intermediate_size": 512, "vocab_size": 2048}  # fmt: skip
    written = raw(model, t=4, n=4, b=32, m=1, sharding="fsdp", parallel="ddp")
    written["trial"].update(device="cuda", precision="auto")  # bf16 gathered parameters
    exp = parse_experiment(written)
    config = config_of(exp)
    cut = predict_memory(exp, config)
    # moved from 3 blocks to 4, so counted from 4 and 5, where it did not move again (the
    # cut of 4 traced once, for both pairs)
    assert traced == [{"model.layers": depth} for depth in (3, 4, 5)]
    assert cut.as_dict() == predict_memory(exp, config, whole=True).as_dict()


@pytest.mark.slow
def test_the_screen_finds_every_layout_over_the_budget_and_no_other(monkeypatch):
    """Each (n, layout)'s configurations on their own scale: the screen's verdicts are those
    of predicting every configuration (each predicted once: the screen and the verdict
    below read the same predictions, its budget apart, which a prediction does not read)."""
    sizes = {"b": 16, "m": 1, "n": 2}  # LOGITS_GPT: the logits grow with m
    space = {"search": {"space": {"micro_batch_size": [1, 4, 16], "tensor_parallel": [1, 2],
                                  "pipeline_parallel": [1, 2]}}}  # fmt: skip
    free = parse_experiment({**raw(LOGITS_GPT, **sizes), **space})
    configs = free.configs()
    assert {c.layout[:2] for c in configs} == {(1, 1), (2, 1), (1, 2)}
    predicted = {c: predict_memory(free, c) for c in configs}
    peaks = {c: p.peak_memory_bytes for c, p in predicted.items()}

    def known(exp, config):
        budgetless = dataclasses.replace(exp.trial, device_memory=None, memory_headroom=None)
        assert (exp.model, budgetless) == (free.model, free.trial)
        if config not in predicted:  # one the screen names otherwise (BatchConfig.canonical)
            predicted[config] = predict_memory(exp, config)
        return predicted[config]

    monkeypatch.setattr(screening_module, "predict_memory", known)
    split = [peaks[c] for c in configs if c.layout[:2] != (1, 1)]
    budget = (min(split) + max(split)) // 2  # some of the split configurations over, some not
    exp = parse_experiment({**raw(LOGITS_GPT, **sizes, device_memory=budget,
                                  memory_headroom=0.0), **space})  # fmt: skip
    screening = screen(exp, configs)
    assert screening.failed is None
    over = {c for c, _ in screening.over}
    assert over == {c for c in configs if peaks[c] > budget}
    assert any(c.layout[:2] != (1, 1) for c in over)
    assert over != set(configs)
    # one configuration's own verdict, as a search records it without a trial
    c = max(over, key=lambda c: peaks[c])
    verdict = predicted_oom(exp, c)
    assert verdict is not None and verdict[0] == "oom" and verdict[1].startswith("predicted:")
