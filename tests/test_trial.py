"""The trial engine: the microbatched step, the measurement, OOM, timeouts, replay."""

import json
import re
import statistics
import textwrap

import pytest
import torch

from mbtune.cli import main
from mbtune.comm import all_reduce, send
from mbtune.config.load import parse_experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.models.batch import split_batch
from mbtune.models.build import build_model
from mbtune.trial.collectives import OneProcess
from mbtune.trial.measure import Measurement, measure
from mbtune.trial.replay import ReplayTable
from mbtune.trial.step import accumulate_gradients, rank_batch
from mbtune.trial.trial import result_of, run_trial


def experiment(model="mlp", batch_size=16, micro="auto", trial=None, **train_input):
    options = {"in_features": 16, "hidden": 16, "n_layer": 1} if model == "mlp" else {}
    if isinstance(model, dict):
        options, model = {k: v for k, v in model.items() if k != "name"}, model["name"]
    return parse_experiment(
        {
            "name": "t",
            "model": {"name": model, **options},
            "train_input": {"batch_size": batch_size, "micro_batch_size": micro, **train_input},
            "search": {"space": {"num_devices": [1, 2, 4], "micro_batch_size": {"min": 1,
                                                                                "max": 64}}},
            "trial": {"compile": False, "warmup_steps": 1, "measure_steps": 3, **(trial or {})},
        }
    )  # fmt: skip


def user_module(tmp_path, monkeypatch, name, body):
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return f"{name}:build"


# -- the microbatched step --------------------------------------------------------


@pytest.mark.parametrize("model", ["gpt", "mlp"])
@pytest.mark.parametrize("sizes", [[4, 4], [3, 2, 2], [1] * 7])
def test_accumulated_gradients_equal_full_batch_gradients(model, sizes):
    options = (
        {"n_layer": 1, "d_model": 32, "seq_len": 8, "vocab_size": 64} if model == "gpt" else {}
    )
    spec = build_model(model, options, seed=0)
    module = spec.module.double()
    torch.manual_seed(1)
    batch = spec.make_batch(sum(sizes), torch.device("cpu"))
    data = tuple(t.double() if t.is_floating_point() else t for t in batch)
    spec.loss_fn(module, data).backward()
    full = [p.grad.clone() for p in module.parameters()]
    module.zero_grad(set_to_none=True)
    accumulate_gradients(spec.loss_fn, module, split_batch(data, sizes))
    for expected, p in zip(full, module.parameters(), strict=True):
        torch.testing.assert_close(p.grad, expected, rtol=1e-10, atol=1e-12)


def test_each_rank_takes_its_rows_of_one_global_batch_drawn_under_the_seed():
    """B = 7 on 2 ranks: rows 0-3 and 4-6 of the batch one process draws, copied (the
    global batch is not kept alive by a view)."""
    from types import SimpleNamespace

    spec = build_model("mlp", {"in_features": 3, "hidden": 4, "n_layer": 1})
    cpu = torch.device("cpu")
    whole = rank_batch(spec, BatchConfig(7, 1, 2), OneProcess(), cpu, seed=5)
    torch.manual_seed(5)
    assert all(torch.equal(a, b) for a, b in zip(whole, spec.make_batch(7, cpu), strict=True))
    ranks = [SimpleNamespace(rank=r, world_size=2) for r in (0, 1)]
    parts = [rank_batch(spec, BatchConfig(7, 2, 2), group, cpu, seed=5) for group in ranks]
    assert [len(x) for x, _ in parts] == [4, 3]
    for i, t in enumerate(whole):
        assert torch.equal(torch.cat([part[i] for part in parts]), t)
    x, y = parts[1]
    assert x.untyped_storage().nbytes() == x.nbytes and y.untyped_storage().nbytes() == y.nbytes


def test_split_batch_gives_consecutive_views():
    data = (torch.arange(7), torch.arange(7) * 10)
    parts = split_batch(data, [3, 2, 2])
    assert [p[0].tolist() for p in parts] == [[0, 1, 2], [3, 4], [5, 6]]
    assert parts[1][1].tolist() == [30, 40]


# -- measurement --------------------------------------------------------------------


def test_a_trial_reports_every_figure_consistently():
    exp = experiment(trial={"measure_steps": 4})
    r = run_trial(exp, BatchConfig(16, 1, 4))
    assert r.status == "ok", r.reason
    assert (r.per_device_batch, r.grad_accum_steps, r.micro_batches) == (16, 4, (4, 4, 4, 4))
    assert len(r.step_times_ms) == 4
    assert r.step_time_ms_median == pytest.approx(statistics.median(r.step_times_ms))
    assert r.samples_per_s == pytest.approx(16 / (r.step_time_ms_median / 1e3))
    assert r.tokens_per_s is None and r.compile_s is None
    assert r.comm_time_ms == 0.0 and r.bubble_time_ms == 0.0
    assert r.peak_memory_bytes > 0 and r.micro_batch_sizes_tried == (4,)
    assert r.wall_s > 0 and r.device == "cpu"


def test_several_devices_add_the_modelled_all_reduce():
    exp = experiment(trial={"link_bandwidth": "1GB", "link_latency_us": 10})
    r = run_trial(exp, BatchConfig(16, 4, 2))
    spec = build_model("mlp", exp.model.options)
    grad_bytes = sum(p.numel() * 4 for p in spec.module.parameters())
    assert r.comm_time_ms == pytest.approx(all_reduce(grad_bytes, 4).seconds(1e9, 1e-5) * 1e3)
    assert r.per_device_batch == 4 and r.micro_batches == (2, 2)
    assert r.samples_per_s_per_device == pytest.approx(r.samples_per_s / 4)
    assert r.step_times_ms[0] > r.comm_time_ms


GPT4 = {"name": "gpt", "n_layer": 4, "d_model": 32, "n_head": 4, "seq_len": 8, "vocab_size": 64}
GPT8 = {**GPT4, "n_layer": 8}  # 4 stages of 2 chunks a rank: 8 blocks


@pytest.mark.parametrize(("schedule", "bubble"), [("1f1b", 3 / 8), ("interleaved_1f1b", 3 / 16),
                                                   ("zbv", 3 / 16 / 3)])  # fmt: skip
def test_a_simulated_pipeline_adds_its_schedules_bubble_and_sends(schedule, bubble):
    exp = experiment(model=GPT8, micro=2, num_devices=4, pipeline_parallel=4,
                     trial={"pipeline_schedule": schedule})  # fmt: skip
    config = BatchConfig(16, 4, 2, pipeline_parallel=4, pipeline_schedule=schedule)
    r = run_trial(exp, config)  # d = 1 replica of 4 stages: g = 8 micro-batches of 2
    assert (r.status, r.pipeline_parallel, r.pipeline_schedule, r.grad_accum_steps) == (
        "ok", 4, schedule, 8)  # fmt: skip
    assert r.bubble_time_ms == pytest.approx(r.compute_time_ms * bubble)
    # one replica: no all-reduce; each micro-batch's activations (8 tokens x 32 fp32) go
    # on and their gradients come back, once per stage a rank holds
    v = 1 if schedule == "1f1b" else 2
    sends = 2 * v * 8 * send(2 * 8 * 32 * 4)
    assert r.comm_time_ms == pytest.approx(sends.seconds(*exp.trial.link("cpu")) * 1e3)


def test_a_simulated_tensor_parallel_step_models_its_all_reduces():
    exp = experiment(model=GPT4, micro=4, num_devices=4, tensor_parallel=2)
    config = BatchConfig(16, 4, 4, tensor_parallel=2)  # d = 2 replicas: P 8, g 2
    r = run_trial(exp, config)
    spec = build_model("gpt", {k: v for k, v in GPT4.items() if k != "name"})
    grad_bytes = sum(p.numel() * 4 for p in spec.module.parameters())
    # each of 4 blocks all-reduces its activations (8 tokens x 32 fp32 of 4 samples) over
    # t = 2 four times a micro-batch, 2 micro-batches; the replicas all-reduce the shard's
    # gradients: more than nothing, less than the whole model's
    link = exp.trial.link("cpu")
    blocks = (4 * 4 * 2 * all_reduce(4 * 8 * 32 * 4, 2)).seconds(*link) * 1e3
    whole = all_reduce(grad_bytes, 2).seconds(*link) * 1e3
    assert r.status == "ok" and r.bubble_time_ms == 0
    assert blocks < r.comm_time_ms < blocks + whole


# -- one measurement loop ------------------------------------------------------------


def test_on_one_process_the_collectives_do_nothing_and_a_failure_is_the_verdict():
    one = OneProcess()
    module = torch.nn.Linear(2, 1)
    assert (one.rank, one.world_size, one.simulated) == (0, 1, True)
    assert one.data_parallel(module) is module and one.slowest([2.0, 1.0]) == [2.0, 1.0]
    with one.no_sync(module):
        one.all_reduce(torch.ones(1))
    assert one.agree(None) is None
    assert one.agree(None, "peak memory 9 MiB is above") == ("oom", "peak memory 9 MiB is above")
    wrapped = RuntimeError("compile failed")
    wrapped.__cause__ = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
    assert one.agree(wrapped) == ("oom", "OutOfMemoryError: CUDA out of memory. Tried to "
                                  "allocate 2 GiB")  # fmt: skip
    assert one.agree(ValueError("bad shape")) == ("error", "ValueError: bad shape")


def test_a_simulated_measurement_times_the_busiest_devices_compute():
    exp = experiment(trial={"device": "cpu"})
    m = measure(exp, BatchConfig(15, 2, 3), torch.device("cpu"), OneProcess())
    assert (m.status, m.device, m.precision) == ("ok", "cpu", "fp32")
    assert len(m.step_s) == 3 and m.compute_s == m.step_s and m.comm_s is None
    assert m.grad_bytes == 442 * 4  # the mlp's 442 fp32 parameters
    assert m.first_s > 0 and m.flops_per_sample > 0 and m.peak_memory_bytes > 0


def test_a_measurement_with_its_all_reduce_measured_is_reported_as_measured():
    """ddp's figures (the slowest rank's): whole steps, the compute and the all-reduce
    timed apart; nothing modelled, whatever the pipeline stages."""
    exp = experiment(model=GPT4, trial={"compile": True}, num_devices=4, pipeline_parallel=2)
    config = BatchConfig(16, 2, 4)
    measured = Measurement(config=config, device="cpu", precision="fp32", first_s=2.5,
                           step_s=(0.2, 0.4, 0.3), compute_s=(0.1, 0.3, 0.2),
                           comm_s=(0.05, 0.01, 0.03), eval_s=0.08,
                           flops_per_sample=1e9, peak_tflops=1.0)  # fmt: skip
    r = result_of(exp, measured)
    assert (r.status, r.parallel, r.grad_accum_steps, r.micro_batches) == (
        "ok", "simulate", 2, (4, 4)
    )  # fmt: skip
    assert r.step_times_ms == pytest.approx((200.0, 400.0, 300.0))
    assert r.samples_per_s == pytest.approx(16 / 0.3)
    assert (r.compute_time_ms, r.comm_time_ms, r.bubble_time_ms) == pytest.approx((200, 30, 0))
    assert r.compile_s == pytest.approx(2.3) and r.eval_samples_per_s == pytest.approx(200)
    assert r.tflops_per_s == pytest.approx(1e9 * 16 / 0.3 / 2 / 1e12)
    assert r.mfu == pytest.approx(r.tflops_per_s)


def test_the_loss_is_the_last_timed_steps_mean_over_the_batch_at_any_micro_batch_size():
    """warm-up 0, 1 timed step: the loss after the first step, by hand. The first step
    (compile, allocation) learns nothing: its gradients are zeroed before AdamW's step,
    which then only decays the weights, as it does on every rank of ddp and fsdp."""
    exp = experiment(trial={"warmup_steps": 0, "measure_steps": 1})
    spec = build_model("mlp", exp.model.options, seed=exp.search.seed)
    torch.manual_seed(exp.search.seed)
    batch = spec.make_batch(16, torch.device("cpu"))
    spec.loss_fn(spec.module, batch).backward()
    optimizer = torch.optim.AdamW(spec.module.parameters(), lr=1e-4)
    optimizer.zero_grad(set_to_none=False)
    optimizer.step()
    with torch.no_grad():
        expected = spec.loss_fn(spec.module, batch).item()
    for m in (16, 4, 3):  # one pass, four, and uneven micro-batches (3 x 4 + 2 x 2)
        r = run_trial(exp, BatchConfig(16, 1, m))
        assert r.loss == pytest.approx(expected, rel=1e-5), m
    assert result_of(exp, Measurement(config=BatchConfig(16, 1, 4), device="cpu")).loss is None


NON_FINITE_MODEL = """
import torch
import torch.nn as nn

def build():
    return (nn.Linear(4, 1), lambda n, device: (torch.randn(n, 4, device=device),),
            lambda m, b: m(b[0]).pow(2).mean() + float("VALUE"))
"""


@pytest.mark.parametrize("value", ["inf", "nan"])
def test_a_non_finite_loss_makes_the_trial_an_error(tmp_path, monkeypatch, value):
    body = NON_FINITE_MODEL.replace("VALUE", value)
    name = user_module(tmp_path, monkeypatch, f"diverged_{value}", body)
    r = run_trial(experiment(model=name), BatchConfig(16, 1, 8))
    assert (r.status, r.loss) == ("error", None)
    assert r.reason == (
        f"non-finite loss: {value} in the last timed step (fp16 overflow or a broken model)"
    )
    assert len(r.step_times_ms) == 3  # measured, then refused


def test_gpt_reports_tokens_per_second():
    exp = experiment(model={"name": "gpt", "n_layer": 1, "d_model": 32, "seq_len": 16})
    r = run_trial(exp, BatchConfig(4, 1, 2))
    assert r.tokens_per_s == pytest.approx(r.samples_per_s * 16)


def test_eval_throughput_is_measured_when_asked():
    r = run_trial(experiment(trial={"eval": True}), BatchConfig(16, 1, 8))
    assert r.eval_samples_per_s > 0
    assert run_trial(experiment(), BatchConfig(16, 1, 8)).eval_samples_per_s is None


def test_batch_mixing_models_are_measured_at_the_full_per_device_batch():
    exp = experiment(model={"name": "cnn_bn", "image_size": 8, "width": 4})
    r = run_trial(exp, BatchConfig(8, 1, 2))
    assert r.status == "ok"
    assert (r.micro_batch_size, r.grad_accum_steps) == (8, 1)
    assert "BatchNorm" in r.note and "measured at micro_batch_size 8" in r.note


@pytest.mark.slow
def test_compiled_trial_reports_compile_time_apart_and_a_load_from_the_cache(
    tmp_path, monkeypatch
):
    import torch._dynamo

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # a cold on-disk cache
    torch._dynamo.reset()
    exp = experiment(trial={"compile": True})
    r = run_trial(exp, BatchConfig(8, 1, 4))
    assert r.status == "ok", r.reason
    assert r.compile_s > 0
    assert r.compile_s * 1e3 > max(r.step_times_ms)  # compile time is not in the steps
    assert r.compile_fallback is None and r.compile_from_cache is False
    # the same shapes again in a fresh compiler: inductor loads its graphs from the cache
    torch._dynamo.reset()
    again = run_trial(exp, BatchConfig(8, 2, 4))  # another configuration, one shape
    torch._dynamo.reset()
    assert again.status == "ok" and again.compile_from_cache is True
    assert again.compile_s < r.compile_s


@pytest.mark.slow
def test_fallback_to_eager_is_detected():
    import torch._dynamo

    torch._dynamo.reset()
    exp = experiment(batch_size=7, trial={"compile": True}, allow_uneven=True)
    with torch._dynamo.config.patch(recompile_limit=1):
        r = run_trial(exp, BatchConfig(7, 1, 3))  # micro-batches 3 + 2 + 2: two shapes
    torch._dynamo.reset()
    assert r.status == "ok", r.reason
    assert "recompile_limit (1)" in r.compile_fallback
    assert "trial.dynamic: true" in r.compile_fallback


@pytest.mark.slow
def test_dynamic_compiles_one_graph_for_every_micro_batch_size():
    import torch._dynamo

    torch._dynamo.reset()
    exp = experiment(batch_size=7, trial={"compile": True, "dynamic": True}, allow_uneven=True)
    with torch._dynamo.config.patch(recompile_limit=1):
        r = run_trial(exp, BatchConfig(7, 1, 3))  # 3 + 2 + 2: one graph, so no fallback
    torch._dynamo.reset()
    assert r.status == "ok", r.reason
    assert r.compile_fallback is None


THREAD_MODEL = """
import torch
import torch.nn as nn

SEEN = []

class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
    def forward(self, x):
        SEEN.append(torch.get_num_threads())
        return self.lin(x)

def build():
    return (Counting(), lambda n, device: (torch.randn(n, 4, device=device),),
            lambda m, b: m(b[0]).pow(2).mean())
"""


@pytest.mark.parametrize(("cpus", "threads"), [(3, 3), (0.5, 1), (1.9, 1)])
def test_a_trial_computes_with_the_cpus_it_holds(tmp_path, monkeypatch, cpus, threads):
    name = user_module(tmp_path, monkeypatch, f"threads{threads}{int(cpus * 10)}", THREAD_MODEL)
    exp = parse_experiment({**experiment(model=name).to_dict(), "ray": {"cpus_per_trial": cpus}})
    before = torch.get_num_threads()
    try:
        assert run_trial(exp, BatchConfig(16, 1, 8)).status == "ok"
    finally:
        torch.set_num_threads(before)
    import importlib

    assert set(importlib.import_module(name.split(":")[0]).SEEN) == {threads}


# -- out of memory and failures ----------------------------------------------------

FRAGILE_MODEL = """
import torch
import torch.nn as nn

class Fragile(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)
    def forward(self, x):
        if x.shape[0] > LIMIT:
            ACTION
        return self.lin(x)

def build():
    return (Fragile(), lambda n, device: (torch.randn(n, 4, device=device),),
            lambda m, b: m(b[0]).pow(2).mean())
"""
CUDA_OOM = (
    'raise RuntimeError("wrapped") from torch.OutOfMemoryError('
    '"CUDA out of memory. Tried to allocate 2.00 GiB")'
)


def fragile_model(limit: int, action: str = CUDA_OOM) -> str:
    """A user model that runs ``action`` on any micro-batch larger than ``limit``."""
    return FRAGILE_MODEL.replace("LIMIT", str(limit)).replace("ACTION", action)


def test_cuda_oom_is_a_result_and_halving_records_every_size(tmp_path, monkeypatch):
    name = user_module(tmp_path, monkeypatch, "fragile", fragile_model(4))
    exp = experiment(model=name, batch_size=16)
    r = run_trial(exp, BatchConfig(16, 1, 16))
    assert r.status == "oom" and "CUDA out of memory" in r.reason
    halving = experiment(model=name, batch_size=16, trial={"on_oom": "halve"})
    r = run_trial(halving, BatchConfig(16, 1, 16))
    assert r.status == "ok"
    assert r.micro_batch_sizes_tried == (16, 8, 4)
    assert (r.micro_batch_size, r.grad_accum_steps) == (4, 4)


def test_memory_budget_turns_a_cpu_trial_into_oom():
    exp = experiment(trial={"device_memory": "1MB", "on_oom": "halve"})
    r = run_trial(exp, BatchConfig(16, 1, 8))
    assert r.status == "oom" and "above the budget trial.device_memory 1 MiB" in r.reason
    assert r.micro_batch_sizes_tried == (8, 4, 2, 1)
    assert r.samples_per_s is not None  # measured, then judged against the budget


def test_errors_inside_a_trial_are_recorded(tmp_path, monkeypatch):
    body = fragile_model(1, 'raise ValueError("bad shape")')
    name = user_module(tmp_path, monkeypatch, "broken", body)
    r = run_trial(experiment(model=name), BatchConfig(16, 1, 8))
    assert r.status == "error" and r.reason.startswith("ValueError: bad shape")


def test_a_trial_past_its_timeout_is_stopped(tmp_path, monkeypatch):
    name = user_module(
        tmp_path, monkeypatch, "slow", fragile_model(0, "import time; time.sleep(60)")
    )
    r = run_trial(experiment(model=name, trial={"timeout_s": 1}), BatchConfig(16, 1, 8))
    # a timeout is the alarm's: it stopped the 60 s sleep (a sleep that ended is no timeout)
    assert r.status == "timeout" and "trial.timeout_s = 1 s" in r.reason


def test_cuda_asked_for_where_there_is_none():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(MbtuneError, match=r"^trial\.device: cuda was asked for, but torch .* "
                       r"sees no CUDA device; use device: cpu or auto"):  # fmt: skip
        run_trial(experiment(trial={"device": "cuda"}), BatchConfig(16, 1, 8))


# -- replay ------------------------------------------------------------------------

TABLE = """batch_size,num_devices,micro_batch_size,samples_per_s,peak_memory_bytes,status
16,1,4,100.0,1000,ok
16,1,8,200.0,5000000,ok
16,1,16,,,oom
16,2,4,150.0,,
"""


def replay(tmp_path, table=TABLE, **trial):
    (tmp_path / "t.csv").write_text(table)
    return experiment(trial={"backend": "replay", "table": str(tmp_path / "t.csv"), **trial})


def test_replay_answers_from_the_table(tmp_path):
    exp = replay(tmp_path)
    r = run_trial(exp, BatchConfig(16, 1, 8))
    assert (r.status, r.backend, r.samples_per_s, r.peak_memory_bytes) == (
        "ok", "replay", 200.0, 5000000
    )  # fmt: skip
    assert r.step_times_ms == (80.0, 80.0, 80.0)
    assert r.loss is None  # a table has no loss: not measured, never 0
    assert run_trial(exp, BatchConfig(16, 1, 16)).status == "oom"
    assert run_trial(exp, BatchConfig(16, 2, 4)).samples_per_s == 150.0


def test_replay_noise_is_seeded_and_relative(tmp_path):
    exp = replay(tmp_path, noise=0.03, measure_steps=50)
    a = run_trial(exp, BatchConfig(16, 1, 4))
    b = run_trial(exp, BatchConfig(16, 1, 4))
    assert a.step_times_ms == b.step_times_ms
    spread = statistics.stdev(a.step_times_ms) / statistics.mean(a.step_times_ms)
    assert 0.015 < spread < 0.05


def test_a_first_replayed_measurement_keeps_its_step_times_and_a_repeat_draws_afresh(tmp_path):
    exp = replay(tmp_path, noise=0.03)
    first = run_trial(exp, BatchConfig(16, 1, 4))
    # the step times every replayed search and benchmark has had (seed, B, n, m)
    assert first.step_times_ms == (161.29450109398007, 157.28852962389809, 168.32307224479223)
    again = run_trial(exp, BatchConfig(16, 1, 4), repeat=1)
    assert again.step_times_ms == (160.3773008390896, 155.26853142722842, 160.9819302624009)
    assert run_trial(exp, BatchConfig(16, 1, 4), repeat=1).step_times_ms == again.step_times_ms


def test_replay_drift_moves_a_whole_trial_by_one_factor(tmp_path):
    noisy = run_trial(replay(tmp_path, noise=0.03), BatchConfig(16, 1, 4))
    drifted = run_trial(replay(tmp_path, noise=0.03, drift=0.035), BatchConfig(16, 1, 4))
    # the same step noise (drift has its own rng), every step times one factor
    pairs = zip(drifted.step_times_ms, noisy.step_times_ms, strict=True)
    assert {round(d / n, 12) for d, n in pairs} == {0.996317775297}
    assert drifted.samples_per_s == pytest.approx(noisy.samples_per_s / 0.996317775297)


def test_replay_drift_spreads_trial_medians_by_about_its_value(tmp_path):
    exp = replay(tmp_path, drift=0.035)  # no step noise: each median is one drawn factor
    medians = [run_trial(exp, BatchConfig(16, 1, 4), repeat=k).step_time_ms_median
               for k in range(400)]  # fmt: skip
    spread = statistics.stdev(medians) / statistics.mean(medians)
    assert round(spread, 6) == 0.033924
    assert round(statistics.mean(medians), 3) == 160.068  # about the table's 160 ms


def test_replay_honours_the_memory_budget(tmp_path):
    exp = replay(tmp_path, device_memory="1MB")
    assert run_trial(exp, BatchConfig(16, 1, 8)).status == "oom"
    assert run_trial(exp, BatchConfig(16, 1, 4)).status == "ok"


def test_replay_refuses_what_it_cannot_answer(tmp_path):
    with pytest.raises(MbtuneError, match=r"has no row for batch_size 16, num_devices 2, "
                       r"micro_batch_size 8"):  # fmt: skip
        run_trial(replay(tmp_path), BatchConfig(16, 2, 8))
    bad = tmp_path / "bad.csv"
    bad.write_text("batch_size,num_devices,samples_per_s\n16,1,3\n")
    with pytest.raises(MbtuneError, match=r"lacks the column\(s\) micro_batch_size; it needs "
                       r"batch_size, num_devices, micro_batch_size, samples_per_s"):  # fmt: skip
        ReplayTable(bad)
    bad.write_text("batch_size,num_devices,micro_batch_size,samples_per_s\n16,1,x,3\n")
    with pytest.raises(MbtuneError, match=r"bad\.csv line 2: ValueError"):
        ReplayTable(bad)
    bad.write_text("batch_size,num_devices,micro_batch_size,samples_per_s,status\n16,1,4,,ok\n")
    with pytest.raises(MbtuneError, match=r"an ok row needs a positive samples_per_s"):
        ReplayTable(bad)


# -- the command ----------------------------------------------------------------------


def write_experiment(tmp_path, exp_raw):
    import yaml

    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump(exp_raw))
    return str(path)


BASE = {
    "name": "t",
    "model": {"name": "mlp", "in_features": 8, "hidden": 8, "n_layer": 1},
    "train_input": {"batch_size": 16, "micro_batch_size": 4},
    "trial": {"compile": False, "warmup_steps": 0, "measure_steps": 2},
}


def test_trial_command_prints_json(tmp_path, capsys):
    path = write_experiment(tmp_path, BASE)
    code = main(["trial", path, "--num-devices", "2", "--micro-batch-size", "2", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert (data["batch_size"], data["num_devices"], data["micro_batch_size"]) == (16, 2, 2)
    assert data["grad_accum_steps"] == 4 and len(data["step_times_ms"]) == 2
    for key in ("samples_per_s", "step_time_ms_median", "step_time_ms_iqr", "compile_s",
                "peak_memory_bytes", "status", "tokens_per_s", "comm_time_ms"):  # fmt: skip
        assert key in data
    assert data["loss"] > 0


def test_trial_command_prints_a_readable_result(tmp_path, capsys):
    code = main(["trial", write_experiment(tmp_path, BASE)])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("batch_size 16, num_devices 1, micro_batch_size 4: per device 16 "
                          "samples as 4 x 4 (4 micro-batches) on cpu (1 CPU thread)")  # fmt: skip
    assert "  status       ok" in out and "samples/s" in out
    assert re.search(r"\n  loss         \d\.\d+ \(the last timed step's mean\)\n", out)


BAD_TRIALS = {
    "model does not import": (
        {**BASE, "model": {"name": "no_such_pkg.mod:build"}}, [],
        r"model\.name: cannot import 'no_such_pkg\.mod'",
    ),
    "function returns the wrong things": (
        {**BASE, "model": {"name": "wrong_return:build"}}, [],
        r"model\.name: 'wrong_return:build' returned a int, not a 3-tuple",
    ),
    "replay table lacks columns": (
        {**BASE, "trial": {"backend": "replay", "table": "bad.csv"}}, [],
        r"trial\.table: .*bad\.csv lacks the column\(s\) samples_per_s",
    ),
    "micro-batch does not divide": (
        BASE, ["--micro-batch-size", "3"],
        r"--micro-batch-size: micro_batch_size 3 does not divide the per-device batch 16 .* "
        r"\(or set allow_uneven: true\)",
    ),
    "micro-batch too large": (BASE, ["--micro-batch-size", "32"], r"--micro-batch-size: "
                              r"micro_batch_size 32 exceeds the per-device batch 16"),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(BAD_TRIALS))
def test_trial_bad_input_exits_2(tmp_path, capsys, monkeypatch, case):
    raw, argv, message = BAD_TRIALS[case]
    (tmp_path / "wrong_return.py").write_text("def build():\n    return 3\n")
    (tmp_path / "bad.csv").write_text("batch_size,num_devices,micro_batch_size\n16,1,4\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["trial", write_experiment(tmp_path, raw), *argv])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(message, err), err
