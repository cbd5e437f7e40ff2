"""Memory before measuring (mbtune.trial.predict, ``mbtune memory``): the parts of the
prediction, a device that is not here, bad input in one line, the prediction against a
measured trial, and no model memory spent on predicting it."""

import dataclasses
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mbtune.cli import main
from mbtune.config.load import parse_experiment
from mbtune.lattice import BatchConfig
from mbtune.models.build import build_model
from mbtune.trial import predict
from mbtune.trial import screen as screening_module
from mbtune.trial.predict import CPU_PROCESS_BASELINE_BYTES, predict_memory
from mbtune.trial.screen import predicted_oom

TINY_GPT = {"name": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16,
            "vocab_size": 64}  # fmt: skip
PARTS = ["parameters_bytes", "gradients_bytes", "optimizer_state_bytes", "activations_bytes",
         "collective_buffers_bytes", "process_baseline_bytes"]  # fmt: skip


def raw(model: dict = TINY_GPT, **trial) -> dict:
    return {
        "name": "memory",
        "model": model,
        "train_input": {"batch_size": 4, "micro_batch_size": 2, "num_devices": 2},
        "trial": {"device": "cpu", "precision": "fp32", "compile": False, **trial},
    }


def write(tmp_path: Path, experiment: dict) -> Path:
    path = tmp_path / "e.yaml"
    path.write_text(yaml.safe_dump(experiment))
    return path


def memory(capsys, *argv) -> tuple[int, str, str]:
    code = main(["memory", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


TINY_CONFIG = BatchConfig(4, 2, 2)  # raw's train_input


@pytest.fixture(scope="module")
def tiny_predicted():
    """raw(**trial)'s experiment predicted at TINY_CONFIG, once for each ``trial`` (as
    given) for the tests that read it."""

    @functools.cache
    def predicted(**trial) -> predict.MemoryPrediction:
        return predict_memory(parse_experiment(raw(**trial)), TINY_CONFIG)

    return predicted


def answer_with(monkeypatch, module, prediction, **trial) -> list:
    """``module``'s predict_memory answers ``prediction`` (tiny_predicted's, made once),
    having checked that it was asked for that one: raw(**trial)'s model and trial, its
    budget apart (a prediction does not read it), at TINY_CONFIG. The calls it answered."""
    expected = parse_experiment(raw(**trial))
    asked = []

    def known(exp, config):
        budgetless = dataclasses.replace(exp.trial, device_memory=None, memory_headroom=None)
        assert (exp.model, budgetless, config) == (expected.model, expected.trial, TINY_CONFIG)
        asked.append(config)
        return prediction

    monkeypatch.setattr(module, "predict_memory", known)
    return asked


def test_the_command_prints_one_object_with_the_parts_that_sum_to_the_peak(tmp_path, capsys):
    code, out, err = memory(capsys, write(tmp_path, raw()), "--json", "--batch-size", "8")
    assert code == 0
    got = json.loads(out)
    assert (got["batch_size"], got["num_devices"], got["micro_batch_size"]) == (8, 2, 2)
    assert (got["grad_accum_steps"], got["device"], got["sharding"]) == (2, "cpu", "none")
    whole = build_model("gpt", {k: v for k, v in TINY_GPT.items() if k != "name"}).module
    assert got["num_parameters"] == sum(p.numel() for p in whole.parameters())
    assert list(got["parts"]) == PARTS
    assert got["peak_memory_bytes"] == sum(got["parts"].values())
    # what the step adds over the process: fp32 weights and their gradients, AdamW's two
    # moments (and its step counts), the activations of a micro-batch
    parts, n = got["parts"], got["num_parameters"]
    assert parts["parameters_bytes"] == parts["gradients_bytes"] == 4 * n
    assert parts["optimizer_state_bytes"] == pytest.approx(8 * n, rel=0.01)
    assert parts["activations_bytes"] > 0
    assert parts["collective_buffers_bytes"] == 0  # one process: nothing all-reduced
    assert parts["process_baseline_bytes"] > 0  # and the CPU process's own memory


def test_the_lines_name_every_part(tmp_path, capsys, monkeypatch, tiny_predicted):
    # the command's own prediction is the compiling test's, made once
    asked = answer_with(monkeypatch, predict, tiny_predicted(parallel="simulate"))
    code, out, _ = memory(capsys, write(tmp_path, raw()))
    assert (code, len(asked)) == (0, 1)
    assert out.startswith("predicted peak memory of one cpu device: ")
    for label in ["parameters", "gradients", "optimizer state", "activations",
                  "collective buffers", "process baseline"]:  # fmt: skip
        assert f"\n  {label} " in out


def test_a_cuda_device_is_predicted_without_one_in_bf16_and_without_a_process_baseline():
    exp = parse_experiment(raw(device="cuda", precision="auto"))
    p = predict_memory(exp, BatchConfig(4, 2, 2))
    assert (p.device, p.precision, p.process_baseline_bytes) == ("cuda", "bf16", 0)
    states = p.parameters_bytes + p.gradients_bytes + p.optimizer_state_bytes
    assert p.peak_memory_bytes == states + p.activations_bytes + p.collective_buffers_bytes


def test_a_cuda_ddp_fsdp_experiment_needs_no_ray_section(tmp_path, capsys):
    """ray.gpus_per_trial follows the device (a GPU for each worker on cuda): neither
    `mbtune validate` nor `mbtune memory` asks for a Ray setting that predicting does not
    use."""
    experiment = raw(device="cuda", precision="auto", parallel="ddp", sharding="fsdp")
    path = write(tmp_path, experiment)
    assert "ray" not in yaml.safe_load(path.read_text())
    assert main(["validate", str(path)]) == 0
    assert capsys.readouterr().err == ""
    code, out, err = memory(capsys, path, "--json")
    assert (code, err) == (0, "")
    got = json.loads(out)
    assert (got["device"], got["sharding"], got["precision"]) == ("cuda", "fsdp", "bf16")
    assert got["num_devices"] == 2 and got["parts"]["process_baseline_bytes"] == 0
    assert got["peak_memory_bytes"] == sum(got["parts"].values()) > 0
    assert parse_experiment(experiment).gpus_per_trial == 1


@pytest.mark.slow
@pytest.mark.parametrize(("sharding", "shards", "layers"), [("none", 1, 4), ("fsdp", 2, 8)])
def test_a_cards_optimizer_step_holds_a_temporary_the_size_of_the_parameters(
    sharding, shards, layers
):
    # a card's AdamW is the multi-tensor one: its step holds the second moments' square
    # roots, one more copy of this rank's parameters (a 7B Llama on an H200 peaked there);
    # a model whose parameters dwarf its activations peaks in that step. Sharded, a block's
    # all-gather is not divided: 4 blocks peak in the backward pass (AdamW's two moments
    # alone at it), 8 in the step; unsharded, 4 (traced whole, not cut: half the time)
    heavy = {**TINY_GPT, "n_layer": layers, "d_model": 256, "vocab_size": 64, "seq_len": 2}
    experiment = raw(heavy, precision="fp32", parallel="ddp", sharding=sharding)
    cpu = predict_memory(parse_experiment(experiment), BatchConfig(4, 2, 2))
    experiment["trial"]["device"] = "cuda"
    card = predict_memory(parse_experiment(experiment), BatchConfig(4, 2, 2))
    rank_parameters = 4 * card.num_parameters / shards  # fp32 bytes of this rank's shard
    assert card.optimizer_state_bytes == pytest.approx(3 * rank_parameters, rel=0.02)
    assert cpu.optimizer_state_bytes < 2.5 * rank_parameters
    states = card.parameters_bytes + card.gradients_bytes + card.optimizer_state_bytes
    assert card.peak_memory_bytes == states + card.activations_bytes + card.collective_buffers_bytes


def test_sharding_over_more_devices_divides_the_optimizer_state(tiny_predicted):
    """FSDP2 on a fake process group: rank 0's shard of N, and its all-gather buffers."""
    exp = parse_experiment(raw(parallel="ddp", sharding="fsdp"))
    two = predict_memory(exp, TINY_CONFIG)
    four = predict_memory(exp, BatchConfig(8, 4, 2))
    whole = tiny_predicted(parallel="ddp")  # the compiling test's eager ddp
    assert (two.sharding, whole.sharding) == ("fsdp", "none")
    assert two.num_parameters == four.num_parameters == whole.num_parameters
    assert two.optimizer_state_bytes == pytest.approx(2 * four.optimizer_state_bytes, rel=0.1)
    assert whole.optimizer_state_bytes == pytest.approx(2 * two.optimizer_state_bytes, rel=0.1)
    assert two.collective_buffers_bytes > 0
    # ddp without sharding: DDP's buckets, a second copy of the gradients
    assert whole.collective_buffers_bytes == 4 * whole.num_parameters


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--micro-batch-size", "3"], r"^mbtune: error: --micro-batch-size: micro_batch_size 3 "),
        (["--set", "trial.sharding=zero"], r"^mbtune: error: trial\.sharding: "),
        (["--set", "trial.precision=fp16"], r"^mbtune: error: trial\.precision: fp16 runs on "),
        (["--bogus"], r"^mbtune: error: unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_exits_2_with_one_line(tmp_path, capsys, argv, message):
    try:
        code = main(["memory", str(write(tmp_path, raw())), *argv])
    except SystemExit as e:  # argparse's usage error
        code = e.code
    err = capsys.readouterr().err
    assert code == 2
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err


def test_a_missing_experiment_exits_2_with_one_line(tmp_path, capsys):
    code, _, err = memory(capsys, tmp_path / "nope.yaml")
    assert code == 2 and err == f"mbtune: error: experiment file not found: {tmp_path}/nope.yaml\n"


@pytest.mark.slow
def test_the_prediction_is_within_15_percent_of_a_measured_trial(tmp_path):
    """One process on the CPU (its peak the process's high-water mark), a gpt of 8M
    parameters: what its step adds over the process's own memory, predicted (weights,
    gradients, Adam's states and activations: 138 MiB) against measured, the peak of its
    trial less the peak of a trial of a tiny gpt (as the bench measures the baseline; here
    about 157 MiB over 342). The whole peak would agree far better, and say nothing: most
    of it is the process. The ddp figures, 2 gloo workers, sharded and not, are
    bench/memory_prediction.py's."""

    def measure(model: dict, name: str) -> int:
        experiment = raw(model, warmup_steps=1, measure_steps=2)
        experiment["train_input"] = {"batch_size": 8, "micro_batch_size": 2, "num_devices": 2}
        (tmp_path / name).mkdir()
        path = write(tmp_path / name, experiment)
        done = subprocess.run(
            [sys.executable, "-m", "mbtune", "trial", str(path), "--json"],
            capture_output=True, text=True, cwd=tmp_path, timeout=120, check=True,
        )  # fmt: skip
        return json.loads(done.stdout.splitlines()[-1])["peak_memory_bytes"]

    gpt = {"name": "gpt", "n_layer": 4, "d_model": 384, "n_head": 4, "seq_len": 64,
           "vocab_size": 2048}  # fmt: skip
    tiny = {"name": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16,
            "vocab_size": 64}  # fmt: skip

    def predicted_step(model: dict) -> int:
        """The prediction less the process's own memory: what the step adds."""
        p = predict_memory(parse_experiment(raw(model)), BatchConfig(8, 2, 2))
        return p.peak_memory_bytes - p.process_baseline_bytes

    measured = measure(gpt, "gpt") - measure(tiny, "tiny")
    predicted = predicted_step(gpt) - predicted_step(tiny)
    assert predicted > 100 * 2**20  # the model's step, not the process, is compared
    assert predicted / measured == pytest.approx(1, abs=0.15), (predicted, measured)


def test_predicting_allocates_no_model_memory():
    """A gpt of 113M parameters: 430 MiB of weights, 1.7 GiB with gradients and Adam's
    states; predicting its step raises this process's high-water mark by far less."""
    from mbtune.trial.memory import peak_memory

    torch = pytest.importorskip("torch")
    gpt = {"name": "gpt", "n_layer": 8, "d_model": 1024, "n_head": 8, "seq_len": 16,
           "vocab_size": 1024}  # fmt: skip
    exp = parse_experiment(raw(gpt))
    cpu = torch.device("cpu")
    # the high-water mark from here on, not pytest's whole life's: a reset that does not
    # happen would compare with a peak the prediction cannot reach, and prove nothing
    try:
        Path("/proc/self/clear_refs").write_text("5")  # Linux: resets the peak resident set
    except OSError as e:
        pytest.skip(f"this process's peak resident set cannot be reset here: {e}")
    before = peak_memory(torch, cpu)
    resident = int(re.search(r"VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text())[1])
    assert before <= resident * 1024 + 16 * 2**20, "the peak was not reset"
    p = predict_memory(exp, BatchConfig(4, 2, 2))
    rise = peak_memory(torch, cpu) - before
    weights = 4 * p.num_parameters
    assert p.num_parameters > 100_000_000
    assert p.peak_memory_bytes - p.process_baseline_bytes > 3 * weights  # predicted, whole
    assert rise < weights / 10, f"{rise / 2**20:.0f} MiB"


def test_a_configuration_predicted_over_the_budget_is_an_oom_without_measuring(
    monkeypatch, tiny_predicted
):
    """The tiny gpt's step is under 1 MiB over the 278 MiB baseline of one CPU process (a
    search's trial, forked from a warm parent). Both budgets' verdicts read the compiling
    test's prediction (made once: a prediction does not read the budget)."""
    asked = answer_with(monkeypatch, screening_module, tiny_predicted(parallel="simulate"))
    config = TINY_CONFIG
    fits = parse_experiment(raw(device_memory="320MiB", memory_headroom=0.1))
    assert predicted_oom(fits, config) is None
    tight = parse_experiment(raw(device_memory="300MiB", memory_headroom=0.1))
    status, reason = predicted_oom(tight, config)
    assert status == "oom"
    assert reason.startswith("predicted: peak memory 278 MiB fits in the budget "), reason
    assert predicted_oom(parse_experiment(raw()), config) is None  # no budget on the CPU
    assert asked == [config, config]  # fits and tight: each predicted


@pytest.mark.slow
def test_a_transformers_model_adds_its_librarys_memory_to_the_cpu_baseline():
    """transformers' Llama code costs a trial process about 130 MiB beyond torch: measured
    in a fresh process, since this one may have imported it long ago."""
    pytest.importorskip("transformers")
    llama = {"name": "hf:llama", "num_hidden_layers": 1, "hidden_size": 32,
             "intermediate_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2,
             "vocab_size": 128, "seq_len": 16}  # fmt: skip
    exp = parse_experiment(raw(llama, parallel="ddp", sharding="fsdp"))
    p = predict_memory(exp, BatchConfig(4, 2, 2))
    assert p.process_baseline_bytes - CPU_PROCESS_BASELINE_BYTES["ddp"] > 50 * 2**20


@pytest.mark.parametrize("parallel", ["simulate", "ddp"])
def test_compiling_adds_to_the_process_and_nothing_to_the_step(parallel, tiny_predicted):
    """Compiling costs a CPU process memory of its own (CPU_COMPILE_BYTES, measured by
    bench/memory_prediction.py --baseline); what the step adds over the process, the
    model's states and activations, is predicted the same compiled or not (each predicted
    on its own: the eager one is shared with the tests that read it)."""
    eager = tiny_predicted(parallel=parallel)
    compiled = tiny_predicted(parallel=parallel, compile=True)
    assert compiled.process_baseline_bytes > eager.process_baseline_bytes
    step = [p.peak_memory_bytes - p.process_baseline_bytes for p in (eager, compiled)]
    assert step[0] == step[1] > 0
