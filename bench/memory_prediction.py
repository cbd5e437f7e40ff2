"""Memory before measuring: `mbtune memory` against measured peaks, and what predicting costs.

Method. Accuracy: for each configuration below (none of them used to build or tune the
prediction: its only measured inputs are the process baselines, from a gpt of 28 thousand
parameters, and the library probe it runs itself), `mbtune memory EXP --json` in a fresh
process, then `mbtune trial EXP --json` on 2 gloo workers (`trial.parallel: ddp`, Ray
Train, the CPU): the measured peak is each worker's high-water mark (the largest of the
two), the predicted one rank 0's. Ratio = predicted / measured; the target is within
15%. Cost: `mbtune memory` for a 7B Llama (`hf:llama`, LlamaConfig's defaults: 6.7B
parameters, seq_len 128) at N = 64 on `trial.device: cuda`, sharded, bf16 (auto on a
card), on this CPU-only machine: the command's wall time and its peak resident set
(ru_maxrss of the child); the target is under two minutes and under 4 GB.
`--baseline` measures the process baselines again (the peak of a trial of the tiny gpt:
one process, and 2 gloo workers; eager and compiled; and one process forked from a warm
parent, as a search's trial runs), which mbtune.trial.predict's
CPU_PROCESS_BASELINE_BYTES and CPU_COMPILE_BYTES hold.

On a card (`--cuda`, needs only torch, transformers and mbtune: no Ray): the same
comparison for sharded configurations on the one lent GPU, `trial.parallel: simulate` with
`sharding: fsdp` (rank 0 of N on torch's fake process group: its shard, gathered units,
gradients, optimizer state and activations are real allocations on the card, its
collectives move nothing), the measured peak `max_memory_allocated`. It includes the 7B
Llama `mbtune init --model hf:llama --device cuda` writes (seq_len 64, bf16), which no
single GPU holds unsharded.

`--blocks` (issue 41): the prediction from a few of the model's repeated blocks (the
default, mbtune.trial.blocks) against the whole-model trace it replaces (``whole=True``),
in this process: gpt, hf:gpt2, hf:llama and hf:qwen2 of 8 layers, five configurations each
(one device; sharded over 2 on a card, bf16; sharded over 4 with ``grad_sync: every``;
activation checkpointing; 2 ddp workers, bf16), and with ``--large`` once the 12B
Qwen2 (``hf:qwen2``, its config's defaults, seq_len 128) that ``mbtune init --model
hf:qwen2 --device cuda`` sizes, sharded over 8 at micro_batch_size 1; each with both
predictions' seconds. The target is within 5%.

Run: `.venv/bin/python bench/memory_prediction.py [--baseline] [--quick]` (`--quick`:
the 7B cost alone); `python3 bench/memory_prediction.py --cuda` on a CUDA machine;
`.venv/bin/python bench/memory_prediction.py --blocks [--large]`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from _common import ROOT, machine, save, table

MIB = 2**20
MBTUNE_COMMAND = (sys.executable, "-m", "mbtune")  # on a lent card mbtune is not installed

_TRIAL = {"device": "cpu", "precision": "fp32", "compile": False, "warmup_steps": 1,
          "measure_steps": 2, "timeout_s": 400, "parallel": "ddp"}  # fmt: skip
_GPT = {"name": "gpt", "n_layer": 6, "d_model": 512, "n_head": 8, "seq_len": 128,
        "vocab_size": 4096}  # fmt: skip
_LLAMA = {"name": "hf:llama", "num_hidden_layers": 3, "hidden_size": 384,
          "intermediate_size": 1024, "num_attention_heads": 6, "num_key_value_heads": 2,
          "vocab_size": 6000, "seq_len": 96}  # fmt: skip
_GPT2 = {"name": "hf:gpt2", "n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8000,
         "seq_len": 128}  # fmt: skip

CONFIGS: list[tuple[str, dict[str, Any], dict[str, Any], tuple[int, int, int]]] = [
    ("gpt, whole", _GPT, {"sharding": "none"}, (8, 2, 2)),
    ("gpt, fsdp", _GPT, {"sharding": "fsdp"}, (8, 2, 2)),
    ("gpt, fsdp, ckpt", _GPT, {"sharding": "fsdp", "activation_checkpointing": True},
     (16, 2, 8)),
    ("hf:llama, fsdp", _LLAMA, {"sharding": "fsdp"}, (8, 2, 4)),
    ("hf:llama, whole", _LLAMA, {"sharding": "none"}, (8, 2, 4)),
    ("hf:gpt2, fsdp", _GPT2, {"sharding": "fsdp"}, (4, 2, 1)),
    ("gpt, fsdp, compiled", _GPT, {"sharding": "fsdp", "compile": True}, (8, 2, 4)),
    ("gpt, whole, compiled", _GPT, {"sharding": "none", "compile": True}, (8, 2, 4)),
]  # fmt: skip
"""(label, model, trial keys, (B, n, m)): configurations the prediction was not tuned on."""

_LLAMA_7B = {"name": "hf:llama", "seq_len": 64}  # LlamaConfig's defaults: 6.7B parameters
_LLAMA_156M = {"name": "hf:llama", "num_hidden_layers": 8, "hidden_size": 1024,
               "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 4,
               "vocab_size": 32000, "seq_len": 512}  # fmt: skip
_CUDA_TRIAL = {"device": "cuda", "precision": "auto", "compile": False, "warmup_steps": 1,
               "measure_steps": 2, "timeout_s": 400, "parallel": "simulate",
               "sharding": "fsdp"}  # fmt: skip
CUDA_CONFIGS: list[tuple[str, dict[str, Any], dict[str, Any], tuple[int, int, int]]] = [
    ("hf:llama 7B, fsdp", _LLAMA_7B, {}, (32, 2, 1)),
    ("hf:llama 7B, fsdp, m 4", _LLAMA_7B, {}, (32, 2, 4)),
    ("hf:llama 7B, fsdp, no reshard", _LLAMA_7B, {"reshard_after_forward": False}, (32, 2, 1)),
    ("hf:llama 7B, fsdp, grad_sync every", _LLAMA_7B, {"grad_sync": "every"}, (32, 2, 1)),
    ("hf:llama 7B, fsdp, 8 devices", _LLAMA_7B, {}, (32, 8, 4)),
    ("hf:llama 156M, fsdp", _LLAMA_156M, {}, (16, 2, 8)),
    ("hf:llama 156M, fsdp, ckpt", _LLAMA_156M, {"activation_checkpointing": True}, (16, 2, 8)),
    ("hf:llama 156M, fsdp, fp32, 4 devices", _LLAMA_156M, {"precision": "fp32"}, (16, 4, 4)),
]  # fmt: skip
"""On a card (``--cuda``): (label, model, trial keys over _CUDA_TRIAL, (B, n, m))."""

LLAMA_7B = {
    "name": "llama-7b",
    "model": {"name": "hf:llama"},
    "train_input": {"batch_size": 64, "micro_batch_size": 1, "num_devices": 64},
    "trial": {"device": "cuda", "parallel": "ddp", "sharding": "fsdp", "compile": False},
    "ray": {"gpus_per_trial": 1},
}


def experiment(
    model: dict[str, Any],
    trial: dict[str, Any],
    sizes: tuple[int, int, int],
    base: dict[str, Any] = _TRIAL,
):
    b, n, m = sizes
    return {
        "name": "memory-prediction",
        "model": model,
        "train_input": {"batch_size": b, "num_devices": n, "micro_batch_size": m},
        "trial": {**base, **trial},
    }


def mbtune(command: str, path: Path, cwd: str) -> tuple[dict[str, Any], float, int]:
    """`mbtune COMMAND PATH --json` in a fresh process: its JSON, wall time and peak RSS."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.run(
        [*MBTUNE_COMMAND, command, str(path), "--json"], cwd=cwd, capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        why = proc.stderr[-2000:]
        raise SystemExit(f"mbtune {command} {path} exited {proc.returncode}:\n{why}")
    # ru_maxrss of the children is the largest child so far: only a new maximum is this one's
    return json.loads(lines[-1]), wall, rss if rss > before * 1024 else -1


def accuracy(cwd: str, *, cuda: bool = False) -> list[dict[str, Any]]:
    rows = []
    base = _CUDA_TRIAL if cuda else _TRIAL
    for label, model, trial, sizes in CUDA_CONFIGS if cuda else CONFIGS:
        path = Path(cwd) / f"{len(rows)}.yaml"
        path.write_text(yaml.safe_dump(experiment(model, trial, sizes, base)))
        predicted, predict_s, _ = mbtune("memory", path, cwd)
        measured, _, _ = mbtune("trial", path, cwd)
        if measured["status"] != "ok":
            if not cuda:
                raise SystemExit(f"{label}: {measured['status']}: {measured['reason']}")
            print(f"{label}: {measured['status']}: {measured['reason']}", flush=True)
            continue  # on a lent card: record the rest
        row = {
            "label": label,
            "batch_size": sizes[0], "num_devices": sizes[1], "micro_batch_size": sizes[2],
            "num_parameters": predicted["num_parameters"],
            "predicted_bytes": predicted["peak_memory_bytes"],
            "measured_bytes": measured["peak_memory_bytes"],
            "parts": predicted["parts"],
            "predict_s": predict_s,
            "step_ms": measured.get("step_time_ms_median"),
            "precision": measured.get("precision"),
        }  # fmt: skip
        row["ratio"] = row["predicted_bytes"] / row["measured_bytes"]
        rows.append(row)
        predicted_mib, measured_mib = row["predicted_bytes"] / MIB, row["measured_bytes"] / MIB
        print(f"{label}: predicted {predicted_mib:,.0f} MiB, measured {measured_mib:,.0f} MiB, "
              f"ratio {row['ratio']:.3f}", flush=True)  # fmt: skip
    return rows


def cost(cwd: str) -> dict[str, Any]:
    path = Path(cwd) / "llama-7b.yaml"
    path.write_text(yaml.safe_dump(LLAMA_7B))
    predicted, wall, rss = mbtune("memory", path, cwd)
    return {"prediction": predicted, "wall_s": wall, "max_rss_bytes": rss}


FORKED_TRIALS = 3
"""Trials of the tiny gpt forked from one warm parent, as a search's trial actor runs them."""


def baseline(cwd: str) -> dict[str, int]:
    """The peak of a trial of the tiny gpt: ``mbtune trial`` (the command's own process; 2
    gloo workers of a Ray Train run for ddp), and for ``simulate`` also as a search runs
    it, a child forked from a warm parent (mbtune.trial.warm), the median of
    FORKED_TRIALS."""
    tiny = {"name": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "seq_len": 16,
            "vocab_size": 64}  # fmt: skip
    peaks = {}
    for parallel in ("simulate", "ddp"):
        for compile in (False, True):
            key = f"{parallel}{', compiled' if compile else ''}"
            path = Path(cwd) / f"tiny-{parallel}-{compile}.yaml"
            trial = {"parallel": parallel, "compile": compile}
            path.write_text(yaml.safe_dump(experiment(tiny, trial, (4, 2, 2))))
            measured, _, _ = mbtune("trial", path, cwd)
            peaks[key] = measured["peak_memory_bytes"]
            print(f"baseline {key}: {peaks[key] / MIB:.1f} MiB", flush=True)
            if parallel == "simulate":
                forked = subprocess.run(
                    [sys.executable, __file__, "--forked", str(path)],
                    cwd=cwd, capture_output=True, text=True, check=True,
                )  # fmt: skip
                found = json.loads(forked.stdout.splitlines()[-1])
                peaks[f"{key}, forked"] = sorted(found)[len(found) // 2]
                print(f"baseline {key}, forked: {[round(b / MIB, 1) for b in found]} MiB",
                      flush=True)  # fmt: skip
    return peaks


def forked_peaks(path: str) -> None:
    """In a fresh process: FORKED_TRIALS trials of the experiment at ``path``, each a child
    of one warm parent (as a search's trial actor runs them); their peaks, as JSON."""
    from mbtune.config.load import load_experiment
    from mbtune.lattice import BatchConfig
    from mbtune.trial.launch import measure_in_subprocess, warm_trials
    from mbtune.trial.trial import TrialRequest

    if not warm_trials():
        raise SystemExit("trials are not forked here (off Linux, or MBTUNE_COLD_TRIALS set)")
    exp = load_experiment(path)
    t = exp.train_input
    config = BatchConfig(t.batch_size, t.num_devices, t.micro_batch_size)
    peaks = []
    for _ in range(FORKED_TRIALS):
        result = measure_in_subprocess(TrialRequest(experiment=exp, config=config), cwd=os.getcwd())
        if result["status"] != "ok":
            raise SystemExit(f"{path}: {result['status']}: {result['reason']}")
        peaks.append(result["peak_memory_bytes"])
    print(json.dumps(peaks))


_SMALL = {"seq_len": 64, "vocab_size": 512}
_BLOCK_MODELS = {
    "gpt": {"name": "gpt", "n_layer": 8, "n_head": 4, "d_model": 128, **_SMALL},
    "hf:gpt2": {"name": "hf:gpt2", "n_layer": 8, "n_embd": 128, "n_head": 4, **_SMALL},
    **{name: {"name": name, "num_hidden_layers": 8, "hidden_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256,
              **_SMALL} for name in ("hf:llama", "hf:qwen2")},
}  # fmt: skip
_BLOCK_CASES = [
    ("one device", {}, (16, 1, 4), {}),
    ("fsdp/2 cuda bf16", {"parallel": "ddp", "sharding": "fsdp", "device": "cuda"}, (16, 2, 2), {}),
    ("fsdp/4 every", {"parallel": "ddp", "sharding": "fsdp"}, (16, 4, 1), {"grad_sync": "every"}),
    ("checkpointing", {}, (16, 1, 8), {"activation_checkpointing": True}),
    ("ddp/2 bf16", {"parallel": "ddp", "precision": "bf16"}, (16, 2, 4), {}),
]  # fmt: skip


def blocks(large: bool) -> list[dict[str, Any]]:
    """Each model and configuration predicted from a few blocks and from all of them."""
    from mbtune.config.load import parse_experiment
    from mbtune.lattice import BatchConfig
    from mbtune.trial.predict import predict_memory

    cases = [(name, *case) for name in _BLOCK_MODELS for case in _BLOCK_CASES]
    if large:
        sharded = {"parallel": "ddp", "sharding": "fsdp", "device": "cuda"}
        cases.append(("hf:qwen2 12B", "fsdp/8 cuda bf16", sharded, (32, 8, 1), {}))
    rows = []
    for name, label, trial, (b, n, m), settings in cases:
        model = _BLOCK_MODELS.get(name) or {"name": "hf:qwen2", "seq_len": 128}
        exp = parse_experiment({"name": "blocks", "model": model, "train_input": {"batch_size": b},
                                "trial": {"compile": False, **trial}})  # fmt: skip
        config = BatchConfig(b, n, m, **settings)
        t0 = time.perf_counter()
        few = predict_memory(exp, config)
        t1 = time.perf_counter()
        whole = predict_memory(exp, config, whole=True)
        t2 = time.perf_counter()
        rows.append({"model": name, "configuration": label, "num_parameters": few.num_parameters,
                     "blocks_bytes": few.peak_memory_bytes, "whole_bytes": whole.peak_memory_bytes,
                     "ratio": few.peak_memory_bytes / whole.peak_memory_bytes,
                     "blocks_s": t1 - t0, "whole_s": t2 - t1,
                     "blocks": few.as_dict(), "whole": whole.as_dict()})  # fmt: skip
        r = rows[-1]
        print(f"{name} {label}: {r['ratio']:.4f} ({r['blocks_s']:.1f} s / {r['whole_s']:.1f} s)",
              flush=True)  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", action="store_true", help="measure the baselines too")
    parser.add_argument("--quick", action="store_true", help="the 7B cost alone")
    parser.add_argument("--cuda", action="store_true", help="sharded, on the CUDA card here")
    parser.add_argument("--blocks", action="store_true", help="a few blocks against the whole")
    parser.add_argument("--large", action="store_true", help="with --blocks: the 12B Qwen2 too")
    parser.add_argument("--forked", metavar="EXPERIMENT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.forked:
        return forked_peaks(args.forked)
    info = machine()
    data: dict[str, Any] = {}
    if args.blocks:
        data["blocks"] = rows = blocks(args.large)
        print(table(
            ["model", "configuration", "blocks MiB", "whole MiB", "ratio", "blocks s", "whole s"],
            [[r["model"], r["configuration"], r["blocks_bytes"] / MIB, r["whole_bytes"] / MIB,
              r["ratio"], r["blocks_s"], r["whole_s"]] for r in rows],
        ))  # fmt: skip
        print(f"\nwrote {save('memory_prediction.blocks', info, data).relative_to(ROOT)}")
        return
    if args.cuda:
        import torch

        props = torch.cuda.get_device_properties(0)
        info["card"] = f"{props.name}, {props.total_memory / MIB:,.0f} MiB"
        with tempfile.TemporaryDirectory() as cwd:
            data["accuracy"] = rows = accuracy(cwd, cuda=True)
        print(table(
            ["configuration", "B", "n", "m", "precision", "predicted MiB", "measured MiB",
             "ratio", "step ms"],
            [[r["label"], r["batch_size"], r["num_devices"], r["micro_batch_size"],
              r["precision"], r["predicted_bytes"] / MIB, r["measured_bytes"] / MIB,
              r["ratio"], r["step_ms"] or 0] for r in rows],
        ))  # fmt: skip
        print(f"\nwrote {save('memory_prediction.cuda', info, data).relative_to(ROOT)}")
        return
    with tempfile.TemporaryDirectory() as cwd:
        os.environ.setdefault("RAY_DEDUP_LOGS", "0")
        if args.baseline:
            data["baseline_bytes"] = baseline(cwd)
        data["cost_7b"] = c = cost(cwd)
        p = c["prediction"]
        peak_mib, rss_mib = p["peak_memory_bytes"] / MIB, c["max_rss_bytes"] / MIB
        print(f"7B Llama, N=64, {p['device']}, {p['sharding']}, {p['precision']}: "
              f"{p['num_parameters']:,} parameters, predicted {peak_mib:,.0f} MiB in "
              f"{c['wall_s']:.1f} s, max RSS {rss_mib:,.0f} MiB", flush=True)  # fmt: skip
        if not args.quick:
            data["accuracy"] = rows = accuracy(cwd)
            print()
            print(table(
                ["configuration", "B", "n", "m", "parameters", "predicted MiB", "measured MiB",
                 "ratio", "predict s"],
                [[r["label"], r["batch_size"], r["num_devices"], r["micro_batch_size"],
                  f"{r['num_parameters']:,}", r["predicted_bytes"] / MIB,
                  r["measured_bytes"] / MIB, r["ratio"], r["predict_s"]] for r in rows],
            ))  # fmt: skip
    # --baseline --quick: the baselines and the 7B cost alone, beside the accuracy run's file
    name = "memory_prediction.baseline" if args.baseline and args.quick else "memory_prediction"
    print(f"\nwrote {save(name, info, data).relative_to(ROOT)}")


if __name__ == "__main__":
    sys.exit(main())
