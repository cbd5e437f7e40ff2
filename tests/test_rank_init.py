"""A split trial's rank built on the meta device (issue 40): it materialises its stages'
shards alone, each with the value the one-process model of the same seed has (the whole
model's init replayed: mbtune.trial.rank_init), and its steps report the forward-only pass
and torch.compile's fall back to eager as other trials do."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mbtune.config.load import parse_experiment
from mbtune.config.trial import TrialConfig
from mbtune.lattice import BatchConfig
from mbtune.trial.parallelize import ParallelDims, build_rank_model, rank_spec
from mbtune.trial.rank_init import initialise_kept, source_name
from mbtune.trial.sharding import fake_process_group
from mbtune.trial.step import build_spec

CPU = torch.device("cpu")
MODELS = {
    "gpt": {"name": "gpt", "n_layer": 4, "d_model": 32, "n_head": 4, "seq_len": 8,
            "vocab_size": 64, "dropout": 0.0},
    "llama": {"name": "hf:llama", "num_hidden_layers": 4, "hidden_size": 32,
              "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 128, "seq_len": 16},
}  # fmt: skip
MODELS["tied llama"] = {**MODELS["llama"], "tie_word_embeddings": True}
"""Its head is its embedding, as the build ties it at its end (drawn apart until then)."""
LAYOUTS = {
    "p 2, zbv": ("none", {"pipeline_parallel": 2, "pipeline_schedule": "zbv"}, 2),
    "p 2, 1f1b": ("none", {"pipeline_parallel": 2}, 2),
    "t 2": ("none", {"tensor_parallel": 2}, 2),
    "d 2 x t 2, fsdp": ("fsdp", {"tensor_parallel": 2}, 4),
    "d 2 x p 2, replicated": ("none", {"pipeline_parallel": 2}, 4),
}
"""(trial.sharding, layout, num_devices). Rank 0 of zbv holds the first and the last stage:
the tied embedding and head both."""


def _experiment(model: dict, sharding: str = "none", **trial) -> object:
    return parse_experiment(
        {
            "name": "rank-init",
            "model": model,
            "train_input": {"batch_size": 8, "micro_batch_size": 2, "num_devices": 1},
            "search": {"seed": 7},
            "trial": {
                "parallel": "ddp",
                "sharding": sharding,
                "device": "cpu",
                "precision": "fp32",
                "compile": False,
                **trial,
            },
        }  # fmt: skip
    )


def _expected(tensor, whole):
    """``whole``'s value as ``tensor`` holds it: a DTensor's shard of it (torch's own cut),
    else all of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(tensor, DTensor):
        return distribute_tensor(whole, tensor.device_mesh, tensor.placements,
                                 src_data_rank=None).to_local()  # fmt: skip
    return whole


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_a_rank_built_on_the_meta_device_holds_the_one_process_models_values(model, layout):
    """Every parameter and buffer of rank 0's stages equals (bit for bit) its part of the
    model built whole on the CPU with the same seed, though the rank built the model on
    the meta device and gave memory to its own shards alone."""
    if model.endswith("llama"):
        pytest.importorskip("transformers")
    sharding, split, n = LAYOUTS[layout]
    exp = _experiment(MODELS[model], sharding)
    config = BatchConfig(8, n, 2, **split)
    whole = build_spec(exp, config).module  # the one-process model
    dims = ParallelDims.of(config)
    with fake_process_group(n, who="the test"):
        spec = rank_spec(exp, config, dims)
        assert all(p.is_meta for p in spec.module.parameters())
        rank = build_rank_model(spec.module, dims, dims.mesh("cpu"), exp.trial, config, CPU,
                                seed=exp.search.seed)  # fmt: skip
        assert all(p.is_meta for p in spec.module.parameters())  # never materialised
        compared, wrong = 0, []
        for stage in rank.stages:
            tensors = [*stage.named_parameters(), *stage.named_buffers()]
            for name, tensor in tensors:
                source = whole.get_submodule(source_name(name, stage.copied_from).rpartition(
                    ".")[0])  # fmt: skip
                value = getattr(source, name.rpartition(".")[2])
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                compared += 1
                if not torch.equal(local, _expected(tensor, value.detach())):
                    wrong.append(name)
    assert compared > 10 and not wrong, wrong
    if layout == "p 2, zbv" and model == "gpt":  # the tied weight's two copies, equal
        first, last = rank.stages
        assert torch.equal(first.wte.weight, last.lm_head.weight)
    if layout == "t 2" and model == "gpt":  # one stage, first and last: still one weight
        (stage,) = rank.stages
        assert stage.wte.weight is stage.lm_head.weight


def test_the_stages_say_which_module_of_the_model_each_part_copies():
    spec = build_spec(_experiment(MODELS["gpt"]), BatchConfig(8, 1, 2), meta=True)
    from mbtune.trial.parallelize import model_parts

    stage = model_parts(spec.module, ParallelDims(1, 2, 1)).make_stage(2, 4, first=False,
                                                                       last=True)  # fmt: skip
    assert stage.copied_from == {"blocks.0": "blocks.2", "blocks.1": "blocks.3",
                                 "ln_f": "ln_f", "lm_head": "lm_head"}  # fmt: skip
    assert source_name("blocks.1.attn.q.weight", stage.copied_from) == "blocks.3.attn.q.weight"
    assert source_name("lm_head.weight", stage.copied_from) == "lm_head.weight"
    with pytest.raises(KeyError, match="wte.weight: no part of the stage"):
        source_name("wte.weight", stage.copied_from)


def test_an_init_that_writes_a_meta_value_into_a_kept_parameter_is_refused():
    """A value computed from the model's own (meta) weights has no value on the meta
    device: the rank cannot give its share one, and says so; nor a weight the init leaves
    alone."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(4, 4)

    with torch.device("meta"):
        whole = Model()
        stage = Model()
    stage.copied_from = {"a": "a"}
    with pytest.raises(RuntimeError, match="aten.copy_: the model's init writes a value"):
        initialise_kept(whole, [stage], lambda m: m.a.weight.copy_(m.a.weight * 2), CPU,
                        seed=0)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"the model's init left a\.bias unset"):
        initialise_kept(whole, [stage], lambda m: torch.nn.init.normal_(m.a.weight), CPU,
                        seed=0)  # fmt: skip


def test_a_parameter_the_rank_does_not_keep_still_draws_its_share_of_the_stream():
    """The rank keeps the last layer only: its values are the ones the whole model's init
    gives it after drawing the others' (dropped). trunc_normal_ and orthogonal_ do nothing
    on a meta tensor in torch: replayed, they draw as on the CPU."""

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.c = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
            self.b = torch.nn.Linear(8, 4)

        @torch.no_grad()
        def init(self):
            torch.nn.init.orthogonal_(self.c.weight)  # a QR of its draws
            for layer in (self.a, self.b):
                torch.nn.init.trunc_normal_(layer.weight, std=0.1)  # reads what it drew
                torch.nn.init.zeros_(layer.bias)
            torch.nn.init.zeros_(self.c.bias)
            self.b.weight[0].fill_(3.0)  # a row of it, after the layer was written
            torch.nn.init.orthogonal_(self.b.weight[1:])  # and the rest, again

    expected = Model()
    torch.manual_seed(3)  # the init's draws alone, as the replay's
    expected.init()
    with torch.device("meta"):
        whole = Model()
        stage = torch.nn.Module()
        stage.b = torch.nn.Linear(8, 4)
    stage.copied_from = {"b": "b"}
    initialise_kept(whole, [stage], Model.init, CPU, seed=3)
    assert torch.equal(stage.b.weight, expected.b.weight)
    assert torch.equal(stage.b.bias, expected.b.bias)


# -- the forward-only pass and the compile fall-back, as the split trial's steps run them ----


def _steps(trial: TrialConfig, *, recompile_limit: int):
    """timed_steps of a compiled layer (dynamo's eager backend: its guards, no inductor);
    the forward-only pass runs without gradients: a graph of its own."""
    import torch._dynamo

    from mbtune.trial.memory import verdict
    from mbtune.trial.pipeline import timed_steps
    from mbtune.trial.precision import for_device

    torch._dynamo.reset()
    layer = torch.nn.Linear(4, 4)
    model = torch.compile(layer, backend="eager")
    x = torch.randn(2, 4)

    def forward_only():
        with torch.no_grad():
            model(x)

    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    with torch._dynamo.config.patch(recompile_limit=recompile_limit):
        timed = timed_steps(trial, CPU, lambda: model(x).sum().backward(), optimizer,
                            for_device("fp32", CPU), verdict,
                            forward_only=forward_only)  # fmt: skip
    torch._dynamo.reset()
    return timed


def test_a_split_trials_steps_time_the_forward_only_pass_with_trial_eval():
    trial = TrialConfig(device="cpu", precision="fp32", warmup_steps=1, measure_steps=2)
    assert _steps(trial, recompile_limit=8).eval_s is None
    timed = _steps(dataclasses.replace(trial, eval=True), recompile_limit=8)
    assert timed.eval_s > 0 and len(timed.step_s) == 2
    assert timed.compile_fallback is None


def test_a_split_trials_steps_report_compiles_fall_back_to_eager():
    """With one graph allowed, the forward-only pass's graph is one too many: torch runs it
    eagerly and says so, and the steps report it as any trial does."""
    trial = TrialConfig(device="cpu", precision="fp32", warmup_steps=1, measure_steps=2,
                        eval=True)  # fmt: skip
    timed = _steps(trial, recompile_limit=1)
    assert "recompile_limit (1)" in timed.compile_fallback
    assert timed.eval_s > 0
