"""Tensor- and pipeline-parallel trials (issue 40): the stage split and the tensor-parallel
plans (the built-in gpt, a transformers Llama, a user model's hooks), each stage's place in
the schedules, what a trial refuses, the loss of 2 and 4 gloo ranks against one process's
for t = 2 and for p = 2 with every schedule. (On Ray Train: tests/test_ddp.py's pipeline
search, whose rank 1 runs, raises, runs out of memory and dies.)"""

from __future__ import annotations

import dataclasses
import json
import textwrap

import pytest
import torch
from ranks import spawn_ranks

from mbtune.config.load import parse_experiment
from mbtune.config.model_options import ModelError
from mbtune.config.trial import TrialConfig
from mbtune.lattice import BatchConfig
from mbtune.models.build import build_model
from mbtune.trial.parallelize import ParallelDims, model_parallel_problem, model_parts

CPU = torch.device("cpu")
GPT = {"name": "gpt", "n_layer": 4, "d_model": 32, "n_head": 4, "seq_len": 8,
       "vocab_size": 64, "dropout": 0.0}  # fmt: skip
LLAMA = {"name": "hf:llama", "num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
         "seq_len": 16}  # fmt: skip

USER_MODEL = '''
"""A user model with mbtune's pipeline and tensor-parallel hooks: a stack of residual MLP
blocks regressing a smooth target. FAIL_ON_RANK: the global rank whose stages call fail."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

FAIL_ON_RANK = {fail}


def fail(x):
    """What the stages of rank FAIL_ON_RANK do with their input x."""
    raise RuntimeError("this stage fails on purpose")


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(x)))


class Stage(nn.Module):
    def __init__(self, model, start, stop, first, last):
        super().__init__()
        self.inp = copy.deepcopy(model.inp) if first else None
        self.blocks = nn.ModuleList(copy.deepcopy(model.blocks[i]) for i in range(start, stop))
        self.out = copy.deepcopy(model.out) if last else None

    def forward(self, x):
        if torch.distributed.is_initialized() and torch.distributed.get_rank() == FAIL_ON_RANK:
            fail(x)
        x = self.inp(x) if self.inp is not None else x
        for block in self.blocks:
            x = block(x)
        return self.out(x) if self.out is not None else x


class Stack(nn.Module):
    pipeline_blocks = 4
    tensor_parallel_plan = {{"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}}

    def __init__(self, width=16):
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(4))
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        return Stage.forward(self, x)

    def pipeline_stage(self, start, stop, *, first, last):
        return Stage(self, start, stop, first, last)

    def pipeline_io(self, batch):
        x, y = batch
        return (x,), y

    def pipeline_loss(self, output, target):
        return F.mse_loss(output, target)


def build():
    def make_batch(n, device):
        x = torch.randn(n, 8, device=device)
        return x, torch.sin(x.sum(dim=1, keepdim=True))

    return Stack(), make_batch, lambda module, batch: F.mse_loss(module(batch[0]), batch[1])
'''


def _experiment(model: dict, *, parallel: str = "ddp", num_devices: int = 2) -> object:
    """B = 8, m = 2, a warm-up step and 2 timed ones; the layout is the configuration's."""
    return parse_experiment(
        {
            "name": "model-parallel",
            "model": model,
            "train_input": {"batch_size": 8, "micro_batch_size": 2, "num_devices": num_devices},
            "trial": {
                "parallel": parallel,
                "sharding": "none",
                "device": "cpu",
                "precision": "fp32",
                "compile": False,
                "warmup_steps": 1,
                "measure_steps": 2,
                "timeout_s": 240,
            },  # fmt: skip
        }
    )


def _chain(stages, x):
    for stage in stages:
        x = stage(x)
    return x


# -- the split and the plans ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("gpipe", [(0,), (1,)]),
        ("1f1b", [(0,), (1,)]),
        ("interleaved_1f1b", [(0, 2), (1, 3)]),  # looped: r and r + p
        ("zbv", [(0, 3), (1, 2)]),  # the V: the first and the last stage on rank 0
        ("dualpipev", [(0, 3), (1, 2)]),
    ],
)
def test_each_rank_holds_the_stages_of_its_schedule(schedule, expected):
    dims = ParallelDims(dp=1, pp=2, tp=1, schedule=schedule)
    assert [dims.stage_indices(r) for r in range(2)] == expected
    assert dims.num_stages == 2 * len(expected[0])


def test_the_gpt_stages_in_a_row_are_the_whole_model_and_its_tied_head_is_copied():
    spec = build_model("gpt", {k: v for k, v in GPT.items() if k != "name"}, seed=1)
    parts = model_parts(spec.module, ParallelDims(1, 4, 1))
    assert parts.num_blocks == 4 and parts.tied == (("wte.weight", "lm_head.weight"),)
    stages = [parts.make_stage(i, i + 1, first=i == 0, last=i == 3) for i in range(4)]
    assert [len(s.blocks) for s in stages] == [1, 1, 1, 1]
    assert stages[0].lm_head is None and stages[3].wte is None and stages[1].wte is None
    torch.manual_seed(0)
    idx, targets = spec.make_batch(3, CPU)
    assert torch.equal(_chain(stages, idx), spec.module(idx))
    assert torch.equal(stages[0].wte.weight, stages[3].lm_head.weight)
    assert stages[0].wte.weight is not stages[3].lm_head.weight  # a copy on each stage
    assert parts.loss(_chain(stages, idx), targets) == spec.loss_fn(spec.module, (idx, targets))
    # a stage that is first and last keeps the tie
    whole = parts.make_stage(0, 4, first=True, last=True)
    assert whole.wte.weight is whole.lm_head.weight


def test_the_gpt_query_key_and_value_are_the_rows_of_nanogpts_fused_draw():
    """Splitting c_attn keeps the quickstart's weights: q, k and v are drawn one after
    another from the RNG stream the fused (3d, d) projection was drawn from."""
    options = {k: v for k, v in GPT.items() if k != "name"}
    attn = build_model("gpt", options, seed=5).module.blocks[0].attn
    d, vocab, seq = options["d_model"], options["vocab_size"], options["seq_len"]
    torch.manual_seed(5)
    for shape in ((vocab, d), (seq, d)):  # wte, wpe come first
        torch.empty(shape).normal_(0.0, 0.02)
    fused = torch.empty(3 * d, d).normal_(0.0, 0.02)
    assert torch.equal(torch.cat([attn.q.weight, attn.k.weight, attn.v.weight]), fused)


def test_a_llama_splits_by_its_layers_and_shards_by_its_projection_names():
    pytest.importorskip("transformers")
    spec = build_model(LLAMA["name"], {k: v for k, v in LLAMA.items() if k != "name"}, seed=2)
    parts = model_parts(spec.module, ParallelDims(1, 2, 2))
    assert parts.num_blocks == 4 and parts.blocks_attr == "layers"
    assert parts.tp_plan["layers.*.self_attn.k_proj"] == "colwise"
    assert parts.tp_plan["layers.*.mlp.down_proj"] == "rowwise"
    assert parts.tp_divides["key/value heads (model.num_key_value_heads)"] == 2
    stages = [parts.make_stage(2 * i, 2 * i + 2, first=i == 0, last=i == 1) for i in range(2)]
    torch.manual_seed(0)
    batch = spec.make_batch(3, CPU)
    (inputs,), target = parts.io(batch)
    loss = parts.loss(_chain(stages, inputs), target)
    torch.testing.assert_close(loss, spec.loss_fn(spec.module, batch), rtol=1e-6, atol=0)


def test_a_user_model_without_the_hooks_says_which_it_lacks(tmp_path, monkeypatch):
    module = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ModelError, match=r"^train_input\.pipeline_parallel: the user model "
                       r"Sequential has no pipeline_blocks, pipeline_stage, "):  # fmt: skip
        model_parts(module, ParallelDims(1, 2, 1))
    with pytest.raises(ModelError, match=r"^train_input\.tensor_parallel: .* no tensor_paral"):
        model_parts(module, ParallelDims(1, 1, 2))
    module.tensor_parallel_plan = {"0": "diagonal"}
    with pytest.raises(ModelError, match=r"'0' has style 'diagonal'; valid: colwise, rowwise$"):
        model_parts(module, ParallelDims(1, 1, 2))
    module.tensor_parallel_plan = {"0": "colwise"}
    parts = model_parts(module, ParallelDims(1, 1, 2))  # t alone: the model is its stage
    assert parts.make_stage is None and parts.num_blocks == 1


def test_fp16_is_refused_for_a_split_model_before_any_worker_starts():
    from mbtune.errors import MbtuneError
    from mbtune.trial.trial import run_trial

    split = BatchConfig(8, 2, 2, pipeline_parallel=2)
    fp16 = TrialConfig(parallel="ddp", precision="fp16", device="cuda")
    assert model_parallel_problem(fp16, split).startswith("trial.precision: fp16's gradient ")
    assert model_parallel_problem(fp16, BatchConfig(8, 2, 2)) is None  # data parallel alone
    exp = _experiment(GPT)
    exp = dataclasses.replace(
        exp, trial=dataclasses.replace(exp.trial, device="cuda", precision="fp16")
    )
    with pytest.raises(MbtuneError, match=r"^trial\.precision: fp16's gradient scaler is not"):
        run_trial(exp, split)


# -- 2 gloo ranks against one process --------------------------------------------------------

CASES = [
    ("gpt", {"tensor_parallel": 2}),
    ("gpt", {"pipeline_parallel": 2, "pipeline_schedule": "gpipe"}),
    ("gpt", {"pipeline_parallel": 2, "pipeline_schedule": "1f1b"}),
    ("gpt", {"pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b"}),
    ("gpt", {"pipeline_parallel": 2, "pipeline_schedule": "zbv"}),
    ("gpt", {"pipeline_parallel": 2, "pipeline_schedule": "dualpipev"}),
    ("llama", {"tensor_parallel": 2}),
    ("llama", {"pipeline_parallel": 2, "pipeline_schedule": "1f1b"}),
    ("user", {"tensor_parallel": 2}),
    ("user", {"pipeline_parallel": 2, "pipeline_schedule": "1f1b"}),
]
"""(model, layout) at B = 8, m = 2 on 2 ranks: g = 4 micro-batches, enough for dualpipev."""


def _models(tmp_path) -> dict[str, dict]:
    (tmp_path / "stack_model.py").write_text(textwrap.dedent(USER_MODEL.format(fail=-1)))
    return {"gpt": GPT, "llama": LLAMA, "user": {"name": "stack_model:build"}}


def _rank(rank: int, world: int, tmp_path, cases: list) -> None:
    """One rank: each (model, trial.sharding, configuration) measured in turn with
    ``trial.eval``, rank 0's figures written out."""
    import os

    from mbtune.trial.pipeline import measure_model_parallel

    os.chdir(tmp_path)  # a user model is imported from here
    found = []
    for model, sharding, config in cases:
        exp = _experiment(model, num_devices=config.num_devices)
        exp = dataclasses.replace(exp, trial=dataclasses.replace(exp.trial, sharding=sharding,
                                                                 eval=True))  # fmt: skip
        m = measure_model_parallel(exp, config, CPU)
        found.append({"status": m.status, "reason": m.reason, "loss": m.loss,
                      "eval_s": m.eval_s, "compile_fallback": m.compile_fallback})  # fmt: skip
    if rank == 0:
        (tmp_path / "found.json").write_text(json.dumps(found))


def _spawn(tmp_path, world: int, cases: list) -> list[dict]:
    spawn_ranks(_rank, (tmp_path, cases), nprocs=world, rendezvous=tmp_path / "pg")
    return json.loads((tmp_path / "found.json").read_text())


@pytest.mark.slow
def test_two_ranks_give_one_processs_loss_with_tensor_parallel_and_every_schedule(
    tmp_path, monkeypatch
):
    """The same seed and B: the stages are copies of the one model (built on the meta
    device, each rank's shards given the one-process model's values), the micro-batches the
    one process's, each weighted by its share; after a warm-up step and a timed one (the
    optimizer has stepped twice, the tied head kept tied) the last step's loss is the one
    process's to fp32 rounding. The forward-only pass (``trial.eval``) runs with every
    schedule, and nothing fell back to eager (compile off)."""
    pytest.importorskip("transformers")
    from mbtune.trial.collectives import OneProcess
    from mbtune.trial.measure import measure

    monkeypatch.chdir(tmp_path)
    models = _models(tmp_path)
    cases = [(models[name], "none", BatchConfig(8, 2, 2, **layout)) for name, layout in CASES]
    found = _spawn(tmp_path, 2, cases)
    simulated = {
        name: _experiment(model, parallel="simulate", num_devices=1)
        for name, model in models.items()
    }
    one = {
        name: measure(exp, BatchConfig(8, 1, 2), CPU, OneProcess())
        for name, exp in simulated.items()
    }
    wrong = []
    for (name, layout), got in zip(CASES, found, strict=True):
        expected = one[name].loss
        if got["status"] != "ok" or got["loss"] != pytest.approx(expected, rel=1e-4):
            wrong.append(f"{name} {layout}: {got} against {expected}")
        elif not got["eval_s"] or got["eval_s"] <= 0 or got["compile_fallback"] is not None:
            wrong.append(f"{name} {layout}: forward-only {got['eval_s']}, fall-back "
                         f"{got['compile_fallback']}")  # fmt: skip
    assert not wrong, "\n".join(wrong)


FOUR_RANKS = [
    ("none", {"pipeline_parallel": 2}),  # d = 2: FSDP2's replicate per stage (DDP would fail)
    ("none", {"tensor_parallel": 2}),
    ("fsdp", {"pipeline_parallel": 2}),
    ("none", {"pipeline_parallel": 4}),  # the tied head 3 stages from its embedding
    ("none", {"tensor_parallel": 2, "pipeline_parallel": 2}),
    ("fsdp", {"tensor_parallel": 2}),  # FSDP2 over TP's shards: 2-D DTensors, built on meta
]
"""(trial.sharding, layout) on 4 ranks, B = 8, m = 2."""


@pytest.mark.slow
def test_four_ranks_give_one_processs_loss_with_replicas_and_deeper_pipelines(tmp_path):
    """4 ranks. d = 2: each replica's half of the global batch, its gradients all-reduced
    (replicate) or reduce-scattered (fsdp) over dp after the pipeline's or the shard's
    backward passes. p = 4: the tied embedding's and head's gradients summed over a group
    of the first and the last rank. t 2 x p 2. After two optimizer steps the loss is the
    one process's."""
    from mbtune.trial.collectives import OneProcess
    from mbtune.trial.measure import measure

    cases = [(GPT, sharding, BatchConfig(8, 4, 2, **layout)) for sharding, layout in FOUR_RANKS]
    found = _spawn(tmp_path, 4, cases)
    exp = _experiment(GPT, parallel="simulate", num_devices=1)
    expected = measure(exp, BatchConfig(8, 1, 2), CPU, OneProcess()).loss
    wrong = [
        f"{case}: {got} against {expected}"
        for case, got in zip(FOUR_RANKS, found, strict=True)
        if got["status"] != "ok"
        or got["loss"] != pytest.approx(expected, rel=1e-4)
        or not got["eval_s"]  # the forward-only pass through replicas and FSDP2 too
    ]
    assert not wrong, "\n".join(wrong)


# -- on Ray Train: tests/test_ddp.py's search of a pipeline whose rank 1 runs, raises, runs
# out of memory and dies, each trial's group ended whole; the ok trial has one process's loss


# -- simulate: rank 0's share alone ---------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "expected"),
    [
        ("gpipe", "F0 F1 F2 F3 B0 B1 B2 B3"),  # every micro-batch in flight
        ("1f1b", "F0 F1 B0 F2 B1 F3 B2 B3"),  # at most p = 2 in flight
    ],
)
def test_rank_0_runs_its_micro_batches_in_the_order_of_its_schedule(schedule, expected):
    from mbtune.trial.stage import rank_actions

    actions = rank_actions(ParallelDims(1, 2, 1, schedule), 4)
    assert " ".join(f"{kind}{mb}" for kind, stage, mb in actions) == expected
    zbv = rank_actions(ParallelDims(1, 2, 1, "zbv"), 4)
    assert {stage for _, stage, _ in zbv} == {0, 3}  # the V: the first and the last stage
    assert sorted(k for k, _, _ in zbv) == ["F"] * 8 + ["I"] * 8 + ["W"] * 8


@pytest.mark.slow
def test_a_simulated_stage_holds_rank_0s_share_and_the_schedules_activations():
    """Rank 0 of p = 2 alone: its stage (half the blocks) is measured, the schedule's order
    kept: gpipe holds all g = 8 micro-batches' activations at its peak, 1f1b at most 2 (a
    micro-batch's are about 17 MiB here). With t = 2 it holds its shard of the weights."""
    from mbtune.trial.stage import measure_stage

    gpt = {"name": "gpt", "n_layer": 4, "d_model": 256, "n_head": 4, "seq_len": 128,
           "vocab_size": 256, "dropout": 0.0}  # fmt: skip
    exp = _experiment(gpt, parallel="simulate", num_devices=1)

    def stage(**layout):
        m = measure_stage(exp, BatchConfig(32, 2, 4, **layout), CPU, lambda *a: None)
        assert (m.status, m.reason, m.comm_s) == ("ok", None, None)
        assert len(m.step_s) == 2 and m.loss is None
        return m

    one_f_one_b = stage(pipeline_parallel=2, pipeline_schedule="1f1b")
    gpipe = stage(pipeline_parallel=2, pipeline_schedule="gpipe")
    held = (gpipe.peak_memory_bytes - one_f_one_b.peak_memory_bytes) / 2**20
    print(f"peak gpipe {gpipe.peak_memory_bytes / 2**20:.0f} MiB, 1f1b "
          f"{one_f_one_b.peak_memory_bytes / 2**20:.0f} MiB")  # fmt: skip
    assert held > 40  # 6 micro-batches' activations more, give or take
    whole = build_model("gpt", {k: v for k, v in gpt.items() if k != "name"}).gradient_bytes
    sharded = stage(tensor_parallel=2)
    # q, k, v, the projections and the MLP halved; embeddings, norms and biases of the
    # row-wise layers whole
    assert 0.5 * whole < sharded.grad_bytes < 0.6 * whole
