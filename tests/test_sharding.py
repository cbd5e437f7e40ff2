"""Sharded trials (trial.sharding: fsdp): the units each model is cut into, the init that
equals the unsharded one, the step whose loss and gradients equal one process's (a built-in
gpt, a transformers Llama built from its config), and a trial on Ray Train whose workers
hold only their shards."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from ranks import spawn_ranks

from mbtune.config.load import parse_experiment
from mbtune.config.trial import TrialConfig
from mbtune.lattice import BatchConfig
from mbtune.models.batch import slice_batch, split_batch
from mbtune.models.build import build_model
from mbtune.trial.sharding import mixed_precision, shard_units
from mbtune.trial.trial import run_trial

CPU = torch.device("cpu")
GPT = {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 8, "vocab_size": 64, "dropout": 0.0}

# -- the units ---------------------------------------------------------------------------


def test_gpt_is_sharded_by_its_blocks_and_a_model_without_blocks_by_its_children():
    gpt = build_model("gpt", GPT).module
    assert shard_units(gpt) == list(gpt.blocks)
    tied = torch.nn.Module()
    tied.emb, tied.body, tied.head = (
        torch.nn.Embedding(4, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 4, bias=False)
    )  # fmt: skip
    tied.head.weight = tied.emb.weight
    tied.act = torch.nn.ReLU()  # no parameters: no unit
    assert shard_units(tied) == [tied.body]  # the tied pair stays with the root


def test_a_model_names_its_blocks_with_shard_blocks():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(torch.nn.Linear(2, 2)))
    model.shard_blocks = "Linear"
    assert shard_units(model) == [model[0], model[1][0]]
    model.shard_blocks = ("Blok",)
    with pytest.raises(Exception, match=r"^trial\.sharding: Sequential names its blocks Blok, "):
        shard_units(model)


def test_precision_becomes_fsdps_mixed_precision_policy():
    bf16 = mixed_precision("bf16")
    assert (bf16.param_dtype, bf16.reduce_dtype) == (torch.bfloat16, torch.float32)
    assert mixed_precision("fp16").param_dtype == torch.float16
    assert mixed_precision("fp32") is None and mixed_precision("tf32") is None


def test_the_gpt_built_on_the_meta_device_has_no_memory_and_the_same_init_after():
    with torch.device("meta"):
        meta = build_model("gpt", GPT, seed=3).module
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device=CPU)
    meta.lm_head.weight = meta.wte.weight
    torch.manual_seed(3)
    meta.init_weights()
    whole = build_model("gpt", GPT, seed=3).module
    for a, b in zip(meta.state_dict().values(), whole.state_dict().values(), strict=True):
        assert torch.equal(a, b)


# -- two gloo ranks: the init and the step -------------------------------------------------


LLAMA = {"num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 64,
         "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 128,
         "seq_len": 16}  # fmt: skip
"""A transformers Llama built from its config: sharded by its decoder layers."""


def _sharded_rank(rank: int, world: int) -> None:
    """FSDP on 2 ranks, 2 micro-batches each, against one process's full batch: the gpt,
    then a transformers Llama."""
    _sharded_step("gpt", GPT, rank, world)
    _sharded_step("hf:llama", LLAMA, rank, world)


def _sharded_step(model_name: str, options: dict, rank: int, world: int) -> None:
    """Built on meta, sharded and materialized as a trial's rank does (mbtune.trial.sharding):
    the gpt's shards are its unsharded init of the same seed, exactly (a transformers
    model's own init is not: its shards are given the one process's values); one step of 2
    micro-batches, the first unsynced, has one process's loss and gradients."""
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    from mbtune.trial.sharding import FullyShardedGroup
    from mbtune.trial.step import synced_step

    whole = build_model(model_name, options, seed=3)
    with torch.device("meta"):
        spec = build_model(model_name, options, seed=3)
    trial = TrialConfig(parallel="ddp", sharding="fsdp", compile=False, precision="fp32")
    group = FullyShardedGroup(CPU, trial, seed=3)
    model = group.data_parallel(group.place(spec.module, CPU))
    for (name, p), q in zip(model.named_parameters(), whole.module.parameters(), strict=True):
        assert p.to_local().numel() < q.numel(), name  # a shard, not the whole
        if model_name == "gpt":  # the init: the unsharded init of the same seed
            torch.testing.assert_close(p.full_tensor(), q, rtol=0, atol=0)
        else:
            with torch.no_grad():
                p.to_local().copy_(distribute_tensor(q, p.device_mesh, p.placements).to_local())
    if model_name == "gpt":
        assert model.lm_head.weight is model.wte.weight  # still tied

    # the step: B = 8 over 2 ranks, 2 micro-batches of 2 each; the others unsynced
    torch.manual_seed(1)
    batch = whole.make_batch(8, CPU)
    whole.loss_fn(whole.module, batch).backward()
    with torch.no_grad():
        full_loss = whole.loss_fn(whole.module, batch)
    micro = split_batch(slice_batch(batch, 4 * rank, 4 * rank + 4), [2, 2])
    losses = []

    def loss_fn(module, b):
        value = spec.loss_fn(module, b)
        losses.append(value.detach() * 2 / 8)  # its share of the global mean
        return value

    synced_step(loss_fn, model, micro, total=8 / world, no_sync=lambda: group.no_sync(model))
    loss = torch.stack(losses).sum()
    dist.all_reduce(loss)
    torch.testing.assert_close(loss, full_loss, rtol=1e-4, atol=0)
    for p, q in zip(model.parameters(), whole.module.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
def test_fsdp_on_two_ranks_inits_and_steps_as_one_process(tmp_path):
    pytest.importorskip("transformers")
    spawn_ranks(_sharded_rank, (), nprocs=2, rendezvous=tmp_path / "pg")


# -- trials on Ray Train -------------------------------------------------------------------


def _experiment(model: dict, sharding: str, batch_size: int = 4, parallel: str = "ddp") -> object:
    return parse_experiment(
        {
            "name": "sharded",
            "model": model,
            "train_input": {"batch_size": batch_size, "micro_batch_size": 2, "num_devices": 2},
            "trial": {
                "parallel": parallel,
                "sharding": sharding,
                "device": "cpu",
                "precision": "fp32",
                "compile": False,
                "warmup_steps": 0,
                "measure_steps": 1,
                "timeout_s": 240,
            },  # fmt: skip
        }
    )


@pytest.mark.ray
@pytest.mark.slow
def test_a_sharded_gpt_trial_has_one_processs_loss_and_each_worker_holds_much_less(ray_session):
    """58M parameters (8 blocks of width 768) dominate a worker's memory: sharded, each of
    the 2 workers holds half the weights, gradients and Adam states. And the same seed and
    B: the 2 workers' samples are the global batch's halves, their shards the one
    process's init, and the first step learns nothing on either, so the last timed step's
    loss is the one process's, all-reduced over the ranks."""
    gpt = {"name": "gpt", "n_layer": 8, "d_model": 768, "n_head": 8, "seq_len": 16,
           "vocab_size": 1024, "dropout": 0.0}  # fmt: skip
    sharded = run_trial(_experiment(gpt, "fsdp", batch_size=8), BatchConfig(8, 2, 2))
    assert (sharded.status, sharded.reason, sharded.sharding) == ("ok", None, "fsdp")
    assert sharded.grad_accum_steps == 2
    assert sharded.samples_per_s > 0 and sharded.comm_time_ms > 0
    one = run_trial(_experiment(gpt, "none", 8, parallel="simulate"), BatchConfig(8, 1, 2))
    assert (one.status, one.parallel, one.grad_accum_steps) == ("ok", "simulate", 4)
    assert sharded.loss == pytest.approx(one.loss, rel=1e-4)
    assert 6 < one.loss < 8  # about ln(1024): random tokens of a vocabulary of 1024
    whole = run_trial(_experiment(gpt, "none", batch_size=8), BatchConfig(8, 2, 2))
    assert (whole.status, whole.sharding) == ("ok", "none")
    ratio = sharded.peak_memory_bytes / whole.peak_memory_bytes
    print(f"peak fsdp {sharded.peak_memory_bytes / 2**20:.0f} MiB, none "
          f"{whole.peak_memory_bytes / 2**20:.0f} MiB: {ratio:.2f}")  # fmt: skip
    assert ratio <= 0.8


# -- simulate: rank 0 of N alone on the fake process group ------------------------------


def test_a_simulated_sharded_trial_holds_rank_0s_shard_and_models_fsdps_collectives():
    """N = 4 simulated: rank 0 alone on the fake process group holds a quarter of the
    weights, gradients and Adam states (the peak is below the unsharded simulated trial's),
    and its step is its compute plus the modelled all-gathers and reduce-scatters."""
    assert TrialConfig(sharding="fsdp").parallel == "simulate"  # no longer refused
    gpt = {"name": "gpt", "n_layer": 6, "d_model": 384, "n_head": 4, "seq_len": 8,
           "vocab_size": 256, "dropout": 0.0}  # fmt: skip

    def experiment(sharding: str) -> object:
        exp = _experiment(gpt, sharding, batch_size=8, parallel="simulate")
        trial = dataclasses.replace(exp.trial, measure_steps=2, link_bandwidth=10**9)
        return dataclasses.replace(exp, trial=trial)

    config = BatchConfig(8, 4, 1)  # 2 samples a device, g = 2
    sharded = run_trial(experiment("fsdp"), config)  # first: the peak is the process's
    assert (sharded.status, sharded.reason, sharded.sharding) == ("ok", None, "fsdp")
    assert sharded.loss is not None and 4 < sharded.loss < 7  # about ln(256)
    assert sharded.comm_time_ms > 0
    assert sharded.step_time_ms_median == pytest.approx(
        sharded.compute_time_ms + sharded.comm_time_ms, rel=0.05
    )
    whole = run_trial(experiment("none"), config)
    assert (whole.status, whole.sharding) == ("ok", "none")
    print(f"comm {sharded.comm_time_ms:.2f} ms (none: {whole.comm_time_ms:.2f}), compute "
          f"{sharded.compute_time_ms:.2f} ms; peak fsdp {sharded.peak_memory_bytes / 2**20:.0f}"
          f" MiB, none {whole.peak_memory_bytes / 2**20:.0f} MiB")  # fmt: skip
    # each block gathered twice a micro-batch (g = 2) and reduce-scattered once: more
    # traffic than DDP's one all-reduce
    assert sharded.comm_time_ms > whole.comm_time_ms
    assert sharded.peak_memory_bytes < whole.peak_memory_bytes
