"""The step people train, measured: precision, activation checkpointing, FLOPs and MFU.

On a CUDA machine (needs only torch and mbtune: no Ray, no Optuna, no network):

    python bench/gpu_check.py            # GPT-2-small-sized gpt, bf16 and fp32, compile on

sweeps the micro-batch size of a GPT-2-small-sized built-in ``gpt`` (12 layers, d_model 768,
seq_len 1024, vocab 50304) at batch_size 256 on one device, up to the real out-of-memory at
the top, in bf16 (autocast) and fp32, with and without activation checkpointing, and
prints samples/s, MFU, peak memory and the allocator's retries per configuration.

On the CPU (``--cpu``) the same comparison on a small gpt, compile off, as the figures of
docs/benchmarks.md: bf16 against fp32 and checkpointing against none, side by side. Every
configuration is measured in a fresh process (``python -m mbtune trial --json``), the
arms interleaved round by round, and the medians over rounds reported.

Writes bench/results/gpu_check.json (or gpu_check.cpu.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent

GPU_MODEL = {"name": "gpt", "n_layer": 12, "n_head": 12, "d_model": 768, "seq_len": 1024,
             "vocab_size": 50304}  # fmt: skip
CPU_MODEL = {"name": "gpt", "n_layer": 4, "n_head": 4, "d_model": 256, "seq_len": 256,
             "vocab_size": 1024}  # fmt: skip


def experiment(model: dict, batch_size: int, device: str, compile_: bool) -> dict:
    return {
        "name": "gpu-check",
        "model": model,
        "train_input": {"batch_size": batch_size, "micro_batch_size": "auto"},
        "search": {"space": {}},
        "trial": {"device": device, "compile": compile_, "warmup_steps": 2, "measure_steps": 5,
                  "timeout_s": 900},
    }  # fmt: skip


def trial(path: Path, m: int, precision: str, checkpointing: bool) -> dict:
    """One configuration in a fresh process, as `mbtune trial --json` reports it."""
    command = [
        sys.executable, "-m", "mbtune", "trial", str(path), "--json",
        "--micro-batch-size", str(m),
        "--set", f"trial.precision={precision}",
        "--set", f"trial.activation_checkpointing={str(checkpointing).lower()}",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": "error", "reason": tail}
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the small CPU comparison")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--micro", type=int, nargs="*", default=None)
    args = parser.parse_args()

    if args.cpu:
        model, device, compile_ = CPU_MODEL, "cpu", False
        batch = args.batch_size or 32
        micro = args.micro or [8, 32]
        precisions = ["fp32", "bf16"]
    else:
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: torch sees no CUDA device; use --cpu for the CPU comparison")
            return 2
        model, device, compile_ = GPU_MODEL, "cuda", True
        batch = args.batch_size or 256
        micro = args.micro or [1, 2, 4, 8, 16, 32, 64, 128, 256]
        precisions = ["bf16", "fp32"]
    arms = [(m, p, ac) for m in micro for p in precisions for ac in (False, True)]
    results: dict[str, list[dict]] = {f"{m} {p} {ac}": [] for m, p, ac in arms}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gpu_check.yaml"
        path.write_text(json.dumps(experiment(model, batch, device, compile_)))
        for r in range(args.rounds):
            for m, p, ac in arms:  # interleaved: each round measures every arm once
                key = f"{m} {p} {ac}"
                if r and results[key][-1].get("status") == "oom":
                    continue  # out of memory stays out of memory
                results[key].append(trial(path, m, p, ac))
                last = results[key][-1]
                print(f"round {r + 1}  m {m:>4}  {p}  checkpointing {str(ac):<5}  "
                      f"{last.get('status')}  {last.get('samples_per_s') or 0:,.1f} samples/s",
                      flush=True)  # fmt: skip

    def median(key: str, field: str) -> float | None:
        values = [x[field] for x in results[key]
                  if x.get("status") == "ok" and x.get(field) is not None]  # fmt: skip
        return statistics.median(values) if values else None

    rows = []
    print(f"\nmedians over {args.rounds} rounds; {model} batch_size {batch} on {device}")
    header = ("m", "precision", "ckpt", "status", "samples/s", "MFU", "peak MiB", "reserved",
              "retries", "compile_s")  # fmt: skip
    widths = (5, 9, 5, 6, 10, 6, 9, 9, 7, 9)
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    for m, p, ac in arms:
        key = f"{m} {p} {ac}"
        status = results[key][-1].get("status")
        row = {"micro_batch_size": m, "precision": p, "activation_checkpointing": ac,
               "status": status, "reason": results[key][-1].get("reason")}  # fmt: skip
        for field in (
            "samples_per_s",
            "mfu",
            "tflops_per_s",
            "peak_memory_bytes",
            "peak_reserved_bytes",
            "alloc_retries",
            "compile_s",
            "flops_per_sample",
        ):
            row[field] = median(key, field)  # fmt: skip
        rows.append(row)

        def show(v: float | None, fmt: str) -> str:
            return format(v, fmt) if v is not None else "-"

        mib = {k: row[k] / 2**20 if row[k] else None
               for k in ("peak_memory_bytes", "peak_reserved_bytes")}  # fmt: skip
        cells = (m, p, str(ac), status, show(row["samples_per_s"], ",.1f"),
                 show(row["mfu"], ".1%"), show(mib["peak_memory_bytes"], ",.0f"),
                 show(mib["peak_reserved_bytes"], ",.0f"), show(row["alloc_retries"], ".0f"),
                 show(row["compile_s"], ".1f"))  # fmt: skip
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths, strict=True)))
    out = BENCH / "results" / ("gpu_check.cpu.json" if args.cpu else "gpu_check.json")
    out.write_text(json.dumps({"model": model, "batch_size": batch, "device": device,
                               "rounds": args.rounds, "rows": rows, "raw": results},
                              indent=2) + "\n")  # fmt: skip
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
