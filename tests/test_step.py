"""What a trial measures of the step people train: precision, FLOPs and MFU, memory
headroom (issue 17). On the CPU: bf16 autocast, FLOP counting and the headroom rule all
run here; the CUDA-only paths (tf32, fp16, the card's memory, allocator retries) are
checked by bench/gpu_check.py on a GPU."""

import json
import re

import pytest
import torch

from mbtune.cli import main
from mbtune.config.load import parse_experiment
from mbtune.config.rules import ConfigError
from mbtune.config.trial import TrialConfig
from mbtune.lattice import BatchConfig
from mbtune.models.batch import split_batch
from mbtune.models.build import build_model
from mbtune.trial.flops import attention_flops, count_flops_per_sample, peak_tflops
from mbtune.trial.precision import for_device
from mbtune.trial.step import accumulate_gradients
from mbtune.trial.trial import run_trial

GPT = {"name": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16, "vocab_size": 64}


def experiment(trial=None, model=None, **extra):
    return parse_experiment(
        {
            "name": "t",
            "model": model or GPT,
            "train_input": {"batch_size": 8, "micro_batch_size": 4},
            "trial": {"compile": False, "warmup_steps": 1, "measure_steps": 2, "device": "cpu",
                      **(trial or {})},
            **extra,
        }
    )  # fmt: skip


# -- precision -----------------------------------------------------------------------


def test_a_bf16_trial_runs_on_the_cpu_and_says_so():
    result = run_trial(experiment({"precision": "bf16"}), BatchConfig(8, 1, 4))
    assert result.status == "ok", result.reason
    assert result.precision == "bf16"


def test_auto_precision_is_fp32_on_the_cpu():
    result = run_trial(experiment(), BatchConfig(8, 1, 4))
    assert result.precision == "fp32"


def test_bf16_autocast_really_computes_in_bf16():
    spec = build_model("gpt", {k: v for k, v in GPT.items() if k != "name"})
    batch = spec.make_batch(2, torch.device("cpu"))
    seen = []
    hook = spec.module.lm_head.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
    for name in ("fp32", "bf16"):
        for_device(name, torch.device("cpu")).loss(spec.loss_fn)(spec.module, batch)
    hook.remove()
    assert seen == [torch.float32, torch.bfloat16]


def test_under_autocast_the_accumulated_gradient_equals_the_full_batch_one():
    # bf16 rounds each matmul, and a micro-batch rounds as the whole batch does row by row,
    # but not bit for bit: the two gradients agree to bf16's precision (8 bits of mantissa)
    spec = build_model("gpt", {k: v for k, v in GPT.items() if k != "name"}, seed=0)
    torch.manual_seed(1)
    data = spec.make_batch(8, torch.device("cpu"))
    loss = for_device("bf16", torch.device("cpu")).loss(spec.loss_fn)

    def gradient(sizes):
        spec.module.zero_grad()
        accumulate_gradients(loss, spec.module, split_batch(data, sizes))
        return torch.cat([p.grad.flatten() for p in spec.module.parameters()])

    full, micro = gradient([8]), gradient([3, 3, 2])
    # each element within 2% or one bf16 ulp (2**-8) of the largest gradient; the whole
    # vector within 2%
    assert torch.allclose(micro, full, rtol=2e-2, atol=2**-8 * full.abs().max().item())
    assert (micro - full).norm() / full.norm() < 0.02


def test_an_unknown_precision_is_one_line_naming_the_field(tmp_path, capsys):
    path = tmp_path / "e.yaml"
    path.write_text(json.dumps({"name": "t", "model": GPT, "train_input": {"batch_size": 8}}))
    code = main(["validate", str(path), "--set", "trial.precision=fp8"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("mbtune: error: trial.precision: 'fp8' is not one of: auto, fp32")
    assert len(err.strip().splitlines()) == 1


def test_the_dataclass_refuses_what_the_yaml_refuses():
    with pytest.raises(ConfigError, match=r"^trial\.precision: 'fp8' is not one of"):
        TrialConfig(precision="fp8")
    with pytest.raises(ConfigError, match=r"^trial\.precision: fp16 runs on CUDA only"):
        TrialConfig(precision="fp16", device="cpu")
    with pytest.raises(ConfigError, match=r"^trial\.memory_headroom: 1 is out of range"):
        TrialConfig(memory_headroom=1)
    with pytest.raises(ConfigError, match=r"^trial\.memory_headroom: 0\.995 is out of range"):
        TrialConfig(memory_headroom=0.995)  # the YAML's bound, 0.99, is the dataclass's
    with pytest.raises(ConfigError, match=r"^trial\.peak_tflops: must be positive"):
        TrialConfig(peak_tflops=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
@pytest.mark.parametrize("precision", ["fp16", "tf32"])
def test_a_cuda_precision_where_torch_sees_no_gpu_is_refused(tmp_path, capsys, precision):
    path = tmp_path / "e.yaml"
    body = {"name": "t", "model": GPT, "train_input": {"batch_size": 8},
            "trial": {"device": "auto", "compile": False}}  # fmt: skip
    path.write_text(json.dumps(body))
    code = main(["trial", str(path), "--set", f"trial.precision={precision}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"mbtune: error: trial.precision: {precision} runs on CUDA only")


# -- FLOPs and MFU ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "options",
    [
        {"n_layer": 2, "n_head": 4, "d_model": 128, "seq_len": 64, "vocab_size": 512},
        {"n_layer": 4, "n_head": 4, "d_model": 64, "seq_len": 256, "vocab_size": 256},
    ],
)
def test_the_gpt_flops_agree_with_nanogpts_estimate(options):
    # nanoGPT (estimate_mfu): 6 N + 12 L d T FLOPs per token, N without position embeddings;
    # the second model is attention-heavy (T = 4 d), which a count without attention misses
    spec = build_model("gpt", options)
    n = sum(p.numel() for p in spec.module.parameters()) - spec.module.wpe.weight.numel()
    L, d, T = options["n_layer"], options["d_model"], options["seq_len"]
    estimate = (6 * n + 12 * L * d * T) * T
    batch = spec.make_batch(2, torch.device("cpu"))
    counted = count_flops_per_sample(spec.loss_fn, spec.module, batch, 2)
    assert counted == pytest.approx(estimate, rel=0.10)


@pytest.mark.parametrize("kv_heads", [8, 2])
def test_attention_is_counted_with_fewer_key_value_heads(kv_heads):
    # grouped-query attention (a Llama's): torch before 2.13 refused to count its fused CUDA
    # kernels, which failed a bf16 Llama's trial on an H200; every kernel is counted by one
    # formula, the same as torch's where the heads are equal
    from torch.utils.flop_counter import sdpa_flop_count

    q, k = torch.randn(2, 8, 32, 16), torch.randn(2, kv_heads, 48, 16)

    def attend(module, batch):
        torch.nn.functional.scaled_dot_product_attention(q, k, k, enable_gqa=True)

    counted = count_flops_per_sample(attend, None, None, 1) / 3
    assert counted == attention_flops(q.shape, k.shape, k.shape) == 2 * 2 * 8 * 32 * 48 * 32
    assert attention_flops(q.shape, q.shape, q.shape) == sdpa_flop_count(q.shape, q.shape, q.shape)


def test_mfu_is_the_achieved_tflops_over_the_peak_given():
    result = run_trial(experiment({"peak_tflops": 0.5}), BatchConfig(8, 1, 4))
    assert result.flops_per_sample > 0
    achieved = result.flops_per_sample * result.samples_per_s / 1 / 1e12
    assert result.tflops_per_s == pytest.approx(achieved)
    assert result.mfu == pytest.approx(result.tflops_per_s / 0.5)


def test_mfu_is_none_where_the_peak_is_unknown():
    result = run_trial(experiment(), BatchConfig(8, 1, 4))
    assert result.tflops_per_s > 0 and result.mfu is None


def test_known_peaks_by_device_name_and_precision():
    assert peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == 756.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB", "tf32") == 156.0
    assert peak_tflops("NVIDIA L40S", "fp32") == 91.6
    assert peak_tflops("Tesla V100-SXM2-16GB", "bf16") is None  # V100 has no bf16
    assert peak_tflops("cpu", "fp32") is None


# -- memory headroom (replayed peaks: exact numbers) ------------------------------------


@pytest.fixture
def table(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(
        "batch_size,num_devices,micro_batch_size,samples_per_s,peak_memory_bytes\n"
        f"8,1,4,100,{1000 * 2**20}\n"
    )
    return path


@pytest.mark.parametrize(
    ("budget_mib", "headroom", "status", "reason"),
    [
        (1100, None, "ok", None),  # 1000 <= 0.95 x 1100
        (1030, None, "oom", r"fits in the budget trial\.device_memory 1030 MiB but leaves "
                            r"less than trial\.memory_headroom 0\.05 of it free"),
        (1030, 0.0, "ok", None),
        (1030, 0.02, "ok", None),  # 1000 <= 0.98 x 1030
        (1050, 0.1, "oom", r"trial\.memory_headroom 0\.1"),
        (990, 0.0, "oom", r"is above the budget trial\.device_memory 990 MiB"),
    ],
)  # fmt: skip
def test_a_peak_inside_the_headroom_is_oom_naming_it(table, budget_mib, headroom, status, reason):
    trial = {"backend": "replay", "table": str(table), "device_memory": budget_mib * 2**20}
    if headroom is not None:
        trial["memory_headroom"] = headroom
    result = run_trial(experiment(trial), BatchConfig(8, 1, 4))
    assert result.status == status
    if reason:
        assert result.reason is not None and re.search(reason, result.reason)


def test_without_a_budget_there_is_no_headroom():
    assert TrialConfig().headroom(None) == 0.0
    assert TrialConfig().headroom(8 * 2**30) == 0.05
    assert TrialConfig(memory_headroom=0.2).headroom(None) == 0.2


# -- activation checkpointing, as a trial measures it -----------------------------------


@pytest.mark.slow
def test_checkpointing_lowers_the_peak_of_a_4_layer_gpt_at_m_32(tmp_path):
    # each in a fresh process: the CPU's peak is the process's peak resident set. Width 128
    # (a third of width 256's compute): 706 MiB without, 469 with (0.66 of it; width 256,
    # 1,001 and 572: 0.57)
    import subprocess
    import sys

    model = {"name": "gpt", "n_layer": 4, "n_head": 4, "d_model": 128, "seq_len": 256,
             "vocab_size": 1024}  # fmt: skip
    path = tmp_path / "e.yaml"
    path.write_text(json.dumps({
        "name": "t", "model": model, "train_input": {"batch_size": 32, "micro_batch_size": 32},
        "trial": {"device": "cpu", "compile": False, "warmup_steps": 0, "measure_steps": 1},
    }))  # fmt: skip

    def peak(checkpointing):
        out = subprocess.run(
            [sys.executable, "-m", "mbtune", "trial", str(path), "--json", "--set",
             f"trial.activation_checkpointing={str(checkpointing).lower()}"],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        result = json.loads(out.splitlines()[-1])
        assert result["status"] == "ok" and result["activation_checkpointing"] is checkpointing
        return result["peak_memory_bytes"]

    without, with_ = peak(False), peak(True)
    assert with_ <= 0.85 * without, (with_, without)


@pytest.mark.slow
@pytest.mark.parametrize("form", ["tensor", "dict"])
def test_a_dynamic_compile_marks_the_sample_dimension_of_any_batch_form(tmp_path, form):
    # trial.dynamic marked `for t in batch`: a dict's keys, a bare tensor's rows
    body = {
        "tensor": "lambda n, device: torch.randn(n, 4, device=device)",
        "dict": "lambda n, device: {'x': torch.randn(n, 4, device=device)}",
    }[form]
    take = "batch" if form == "tensor" else "batch['x']"
    (tmp_path / f"dyn_{form}.py").write_text(
        "import torch\n"
        "def build():\n"
        "    module = torch.nn.Linear(4, 1)\n"
        f"    return module, {body}, lambda m, batch: m({take}).pow(2).mean()\n"
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        exp = experiment({"compile": True, "dynamic": True}, model={"name": f"dyn_{form}:build"})
        result = run_trial(exp, BatchConfig(8, 1, 3))
    finally:
        sys.path.remove(str(tmp_path))
    assert result.status == "ok", result.reason
    assert result.compile_fallback is None
