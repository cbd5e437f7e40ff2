"""A memory prediction that traces a few of a model's repeated blocks and counts the rest
(mbtune.trial.blocks) gives what tracing the whole model gives."""

from __future__ import annotations

import textwrap

import pytest

from mbtune.config.load import parse_experiment
from mbtune.lattice import BatchConfig
from mbtune.trial import predict
from mbtune.trial.blocks import BASE_DEPTH, cut, repeated_blocks
from mbtune.trial.predict import predict_memory
from mbtune.trial.step import build_spec

torch = pytest.importorskip("torch")

GPT = {"name": "gpt", "n_layer": 5, "n_head": 2, "d_model": 32, "seq_len": 16, "vocab_size": 64}


def experiment(model: dict, **trial) -> object:
    return parse_experiment(
        {
            "name": "x",
            "model": model,
            "train_input": {"batch_size": 16},
            "trial": {"compile": False, **trial},
        }  # fmt: skip
    )


def test_the_runs_of_identical_blocks_are_found_and_cut_in_a_copy():
    exp = experiment(GPT)
    module = build_spec(exp, BatchConfig(16, 1, 4), meta=True).module
    assert repeated_blocks(module) == {"blocks": 5}
    copied = cut(module, {"blocks": BASE_DEPTH})
    assert len(copied.blocks) == BASE_DEPTH and len(module.blocks) == 5
    assert copied.lm_head.weight is copied.wte.weight  # still tied in the copy
    short = build_spec(experiment({**GPT, "n_layer": BASE_DEPTH + 1}), BatchConfig(16, 1, 4),
                       meta=True).module  # fmt: skip
    assert repeated_blocks(short) == {}  # nothing to gain: traced whole


CASES = [
    ({}, BatchConfig(16, 1, 4)),
    ({}, BatchConfig(16, 1, 8, activation_checkpointing=True)),
    ({"parallel": "ddp", "precision": "bf16"}, BatchConfig(16, 2, 4)),
    ({"parallel": "ddp", "sharding": "fsdp", "device": "cuda"}, BatchConfig(16, 2, 2)),
    # with two blocks only, this one's FSDP buffers at the peak were one block's fewer
    ({"parallel": "ddp", "sharding": "fsdp"}, BatchConfig(16, 4, 1, grad_sync="every")),
]


@pytest.mark.slow
@pytest.mark.parametrize(("trial", "config"), CASES)
def test_a_few_blocks_predict_what_the_whole_model_does(trial, config):
    exp = experiment(GPT, **trial)
    blocks, whole = predict_memory(exp, config), predict_memory(exp, config, whole=True)
    assert blocks.as_dict() == whole.as_dict()


def test_a_deep_model_is_traced_at_a_few_blocks_only(monkeypatch):
    traced = []

    def traced_cut(module, depths):
        traced.append(depths)
        return cut(module, depths)

    monkeypatch.setattr(predict, "cut", traced_cut)
    p = predict_memory(experiment({**GPT, "n_layer": 48}), BatchConfig(16, 1, 4))
    assert traced == [{"blocks": BASE_DEPTH}, {"blocks": BASE_DEPTH + 1}]
    assert p.num_parameters == sum(
        x.numel()
        for x in build_spec(
            experiment({**GPT, "n_layer": 48}), BatchConfig(16, 1, 4), meta=True
        ).module.parameters()  # fmt: skip
    )


COUNTED = """
import torch, torch.nn as nn

class Counted(nn.Module):
    '''Indexes its blocks by a count it keeps: a copy cut to fewer blocks fails.'''
    def __init__(self):
        super().__init__()
        self.n = 5
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(self.n))

    def forward(self, x):
        for i in range(self.n):
            x = self.blocks[i](x).relu()
        return x

def build():
    return (Counted(), lambda n, device: (torch.randn(n, 8, device=device),),
            lambda module, batch: module(batch[0]).pow(2).mean())
"""


def test_a_model_that_cannot_be_cut_is_traced_whole(tmp_path, monkeypatch):
    (tmp_path / "counted.py").write_text(textwrap.dedent(COUNTED))
    monkeypatch.chdir(tmp_path)
    exp = experiment({"name": "counted:build"})
    config = BatchConfig(16, 1, 4)
    assert (
        predict_memory(exp, config).as_dict() == predict_memory(exp, config, whole=True).as_dict()
    )


@pytest.mark.slow
def test_a_transformers_models_layers_are_its_run():
    """Predicted for a card (fp32): a CPU's prediction adds the process's memory with
    transformers' own, measured in a fresh process (5 CPU-s), the same to both sides and
    none of the blocks' (tests/test_memory_prediction.py measures it)."""
    pytest.importorskip("transformers")
    llama = {"name": "hf:llama", "num_hidden_layers": 5, "hidden_size": 32,
             "num_attention_heads": 2, "num_key_value_heads": 1, "intermediate_size": 64,
             "vocab_size": 64, "seq_len": 16}  # fmt: skip
    exp = experiment(llama, parallel="ddp", sharding="fsdp", device="cuda", precision="fp32")
    module = build_spec(exp, BatchConfig(16, 2, 2), meta=True).module
    assert repeated_blocks(module) == {"model.layers": 5}
    config = BatchConfig(16, 2, 2)
    assert (
        predict_memory(exp, config).as_dict() == predict_memory(exp, config, whole=True).as_dict()
    )
