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

A split trial on CUDA (``--split``, issue 40; a smaller gpt, 8 layers, d_model 1024, 16
heads, 512 tokens, bf16, B 16, m 2): with two GPUs or more, 2 NCCL ranks (spawned here, no
Ray) each run mbtune.trial.pipeline.measure_model_parallel, as a ``trial.parallel: ddp``
rank does, at t 2 and at p 2 under 1f1b, gpipe and interleaved_1f1b, with ``trial.eval``:
each rank built on the meta device and given only its shards; every loss is checked against
the one-process trial's (``mbtune trial`` on one GPU, the same seed: within 1e-2 relative in
bf16) and the rank's peak, the forward-only throughput and any compile fall-back printed.
With one GPU, the stage simulation instead: ``mbtune trial --set trial.parallel=simulate``
at t 2 and at p 2 (rank 0's stages and tensor-parallel shard on torch's fake process group,
on the card) against ``mbtune memory``'s prediction of the same configuration. Writes
bench/results/gpu_check.split.json. Not yet run on a GPU: the machine it was written on
has none.
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
    return command([
        "trial", str(path), "--json",
        "--micro-batch-size", str(m),
        "--set", f"trial.precision={precision}",
        "--set", f"trial.activation_checkpointing={str(checkpointing).lower()}",
    ])  # fmt: skip


SPLIT_MODEL = {"name": "gpt", "n_layer": 8, "n_head": 16, "d_model": 1024, "seq_len": 512,
               "vocab_size": 50304, "dropout": 0.0}  # fmt: skip
SPLIT_LAYOUTS = {
    "t 2": {"tensor_parallel": 2},
    "p 2, 1f1b": {"pipeline_parallel": 2, "pipeline_schedule": "1f1b"},
    "p 2, gpipe": {"pipeline_parallel": 2, "pipeline_schedule": "gpipe"},
    "p 2, interleaved_1f1b": {"pipeline_parallel": 2, "pipeline_schedule": "interleaved_1f1b"},
}


def split_experiment(compile_: bool, **train: object) -> dict:
    return {
        "name": "gpu-check-split",
        "model": SPLIT_MODEL,
        "train_input": {"batch_size": 16, "micro_batch_size": 2, "num_devices": 2, **train},
        "search": {"space": {}},
        "trial": {"device": "cuda", "precision": "bf16", "compile": compile_, "eval": True,
                  "sharding": "none", "warmup_steps": 2, "measure_steps": 5,
                  "timeout_s": 900},
    }  # fmt: skip


def _split_rank(rank: int, init: str, out: str, compile_: bool) -> None:
    """One NCCL rank: every layout of :data:`SPLIT_LAYOUTS` measured in turn."""
    import torch
    import torch.distributed as dist

    from mbtune.config.load import parse_experiment
    from mbtune.lattice import BatchConfig
    from mbtune.trial.pipeline import measure_model_parallel

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=2)
    base = split_experiment(compile_)
    exp = parse_experiment({**base, "trial": {**base["trial"], "parallel": "ddp"}})
    found = {}
    for name, layout in SPLIT_LAYOUTS.items():
        m = measure_model_parallel(exp, BatchConfig(16, 2, 2, **layout), torch.device("cuda", rank))
        found[name] = {"status": m.status, "reason": m.reason, "loss": m.loss,
                       "step_s": list(m.step_s), "eval_s": m.eval_s,
                       "peak_memory_bytes": m.peak_memory_bytes,
                       "compile_fallback": m.compile_fallback}  # fmt: skip
    if rank == 0:
        Path(out).write_text(json.dumps(found))
    dist.destroy_process_group()


def split_check(compile_: bool) -> int:
    """``--split``: the module docstring's split trial on CUDA."""
    import torch

    if not torch.cuda.is_available():
        print("gpu_check --split: torch sees no CUDA device")
        return 2
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        whole = Path(tmp) / "whole.yaml"  # the one-process trial of the same B, m and seed
        one = split_experiment(compile_, num_devices=1)
        whole.write_text(json.dumps(one))
        reference = command(["trial", str(whole), "--json"])
        print(f"one process: {reference.get('status')} loss {reference.get('loss')}")
        if torch.cuda.device_count() >= 2:
            import torch.multiprocessing as mp

            out = Path(tmp) / "found.json"
            mp.spawn(_split_rank, args=(f"file://{tmp}/pg", str(out), compile_), nprocs=2)
            for name, got in json.loads(out.read_text()).items():
                ok = (
                    got["status"] == "ok"
                    and reference.get("loss") is not None
                    and abs(got["loss"] - reference["loss"]) <= 1e-2 * abs(reference["loss"])
                )
                rows[name] = {**got, "loss_matches": ok}  # fmt: skip
                step = statistics.median(got["step_s"]) if got["step_s"] else None
                print(f"{name:<24} {got['status']:<6} loss {got['loss']} (matches: {ok})  "
                      f"step {step}  eval {got['eval_s']}  peak "
                      f"{(got['peak_memory_bytes'] or 0) / 2**20:,.0f} MiB  "
                      f"fallback {got['compile_fallback']}")  # fmt: skip
            mode = "nccl, 2 ranks"
        else:
            for name, layout in SPLIT_LAYOUTS.items():
                path = Path(tmp) / "split.yaml"
                exp = split_experiment(compile_, **{k: v for k, v in layout.items()
                                                    if k != "pipeline_schedule"})  # fmt: skip
                exp["trial"] = {
                    **exp["trial"],
                    "parallel": "simulate",
                    "pipeline_schedule": layout.get("pipeline_schedule", "1f1b"),
                }
                path.write_text(json.dumps(exp))
                measured = command(["trial", str(path), "--json"])
                predicted = command(["memory", str(path), "--json"])
                peak, guess = measured.get("peak_memory_bytes"), predicted.get("peak_memory_bytes")
                ratio = guess / peak if peak and guess else None
                rows[name] = {"measured": measured, "predicted": predicted, "ratio": ratio}
                print(f"{name:<24} {measured.get('status')}  measured peak "
                      f"{(peak or 0) / 2**20:,.0f} MiB, predicted {(guess or 0) / 2**20:,.0f} "
                      f"MiB (ratio {ratio})")  # fmt: skip
            mode = "one card: rank 0's stage simulated"
    out = BENCH / "results" / "gpu_check.split.json"
    out.write_text(json.dumps({"model": SPLIT_MODEL, "mode": mode, "reference": reference,
                               "rows": rows}, indent=2) + "\n")  # fmt: skip
    print(f"wrote {out}")
    return 0


def command(args: list[str]) -> dict:
    """``mbtune ARGS`` in a fresh process: its last JSON line (or the error's last line)."""
    done = subprocess.run([sys.executable, "-m", "mbtune", *args], capture_output=True,
                          text=True, cwd=ROOT)  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": "error", "reason": tail}
    return json.loads(lines[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the small CPU comparison")
    parser.add_argument("--split", action="store_true",
                        help="a split trial (t 2, p 2) on CUDA: 2 NCCL ranks, or one card's "
                        "simulated stage")  # fmt: skip
    parser.add_argument("--compile", action="store_true", help="with --split: compile on")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--micro", type=int, nargs="*", default=None)
    args = parser.parse_args()
    if args.split:
        return split_check(args.compile)

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
