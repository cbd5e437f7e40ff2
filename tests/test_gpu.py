"""On a CUDA card (`pytest -m gpu`): a trial on the card, the memory prediction against the
card's measured peak, and a compiled bf16 step. Where torch sees no CUDA device each test
skips itself.

Each runs as a user would, `python -m mbtune COMMAND EXPERIMENT --json` in a fresh process
from the checkout (the card's peak is then that trial's alone), as bench/gpu_check.py and
bench/memory_prediction.py --cuda do; no Ray is involved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GPT = {"name": "gpt", "n_layer": 4, "n_head": 4, "d_model": 256, "seq_len": 256,
       "vocab_size": 1024}  # fmt: skip
"""bench/gpu_check.py's CPU gpt: small enough for any card, big enough to time."""

LLAMA_156M = {"name": "hf:llama", "num_hidden_layers": 8, "hidden_size": 1024,
              "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 4,
              "vocab_size": 32000, "seq_len": 512}  # fmt: skip
"""bench/memory_prediction.py's 156M Llama: sharded over 2 in bf16 at m 8, predicted
4,274 MB and measured 4,212 on an H200."""


def experiment(model: dict, sizes: tuple[int, int, int], **trial: Any) -> dict:
    b, n, m = sizes
    return {
        "name": "gpu",
        "model": model,
        "train_input": {"batch_size": b, "num_devices": n, "micro_batch_size": m},
        "trial": {"device": "cuda", "warmup_steps": 2, "measure_steps": 5, "timeout_s": 600,
                  **trial},
    }  # fmt: skip


def mbtune(command: str, spec: dict, tmp_path: Path) -> dict:
    """`python -m mbtune COMMAND --json` on ``spec`` in a fresh process: its JSON."""
    path = tmp_path / f"{command}.yaml"
    path.write_text(yaml.safe_dump(spec))
    done = subprocess.run([sys.executable, "-m", "mbtune", command, str(path), "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=900)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


def test_a_trial_on_the_card_measures_its_steps_memory_and_mfu(tmp_path):
    got = mbtune("trial", experiment(GPT, (32, 1, 8), precision="auto", compile=False), tmp_path)
    assert got["status"] == "ok", got["reason"]
    assert (got["device"], got["precision"]) == ("cuda", "bf16")  # auto, on a card
    assert len(got["step_times_ms"]) == 5 and min(got["step_times_ms"]) > 0
    assert got["samples_per_s"] == pytest.approx(32 / (got["step_time_ms_median"] / 1e3))
    assert got["grad_accum_steps"] == 4
    # the allocator's peak: at least the fp32 weights, their gradients and Adam's moments
    parameters = mbtune("memory", experiment(GPT, (32, 1, 8), precision="auto"), tmp_path)
    assert got["peak_memory_bytes"] > 16 * parameters["num_parameters"]
    assert got["peak_reserved_bytes"] >= got["peak_memory_bytes"]
    assert got["tflops_per_s"] > 0
    assert got["mfu"] is None or 0 < got["mfu"] < 1  # None: a card of unknown peak


def test_the_memory_prediction_holds_the_cards_measured_peak(tmp_path):
    """Rank 0 of 2, sharded (FSDP2 on torch's fake process group: its allocations are
    real, its collectives move nothing), bf16. On a card there is no process baseline:
    the whole prediction is what the step adds, against max_memory_allocated."""
    pytest.importorskip("transformers")
    spec = experiment(LLAMA_156M, (16, 2, 8), precision="auto", compile=False,
                      parallel="simulate", sharding="fsdp", warmup_steps=1, measure_steps=2)
    predicted = mbtune("memory", spec, tmp_path)
    assert predicted["device"] == "cuda" and predicted["parts"]["process_baseline_bytes"] == 0
    measured = mbtune("trial", spec, tmp_path)
    assert measured["status"] == "ok", measured["reason"]
    ratio = predicted["peak_memory_bytes"] / measured["peak_memory_bytes"]
    assert ratio == pytest.approx(1, abs=0.15), (predicted, measured["peak_memory_bytes"])


def test_a_compiled_bf16_step_runs_compiled_on_the_card(tmp_path):
    spec = experiment(GPT, (32, 1, 8), precision="bf16", compile=True)
    compiled = mbtune("trial", spec, tmp_path)
    assert compiled["status"] == "ok", compiled["reason"]
    assert compiled["precision"] == "bf16"
    assert compiled["compile_fallback"] is None  # compiled, not eager after a failed compile
    assert compiled["compile_s"] > 0  # measured apart from the steps
    assert compiled["samples_per_s"] > 0 and compiled["tflops_per_s"] > 0
