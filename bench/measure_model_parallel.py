"""A real model-parallel landscape: every layout of 2 devices measured on 2 gloo processes.

Method. The configurations of a small GPT on 2 CPU devices (B = 16; t x p = 2, or 2
replicas; gpipe, 1f1b and interleaved_1f1b; m in 1, 2, 4, 8: the lattice of
`mbtune space`), each measured as a real trial measures one (mbtune.trial.pipeline's
`measure_model_parallel` on every rank: the stages and schedules of
torch.distributed.pipelining, the tensor-parallel plans; the unsplit replicas through the
same loop), on two processes of a gloo group spawned here rather than by Ray Train (on a
loaded machine Ray's start timed out: same code, fewer processes), 2 warm-up and 5 timed
steps each, `rounds` times in turn so that the machine's drift spreads over every
configuration; a configuration's samples/s is the median over its rounds. Written as a
replay table (trial.backend: replay, with the layout columns) to
bench/landscapes/gpt_cpu_model_parallel.csv and read by bench/model_parallel.py
`--measured` as a landscape of its own.

Run: `.venv/bin/python bench/measure_model_parallel.py [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import BENCH, loadavg, machine, save

from mbtune.config.load import parse_experiment
from mbtune.lattice import BatchConfig

MODEL = {"name": "gpt", "n_layer": 4, "n_head": 4, "d_model": 128, "seq_len": 64,
         "vocab_size": 512, "dropout": 0.0}  # fmt: skip
SPACE = {"num_devices": [2], "tensor_parallel": [1, 2], "pipeline_parallel": [1, 2],
         "pipeline_schedule": ["gpipe", "1f1b", "interleaved_1f1b"],
         "micro_batch_size": [1, 2, 4, 8]}  # fmt: skip
TABLE = BENCH / "landscapes" / "gpt_cpu_model_parallel.csv"


def experiment():
    return parse_experiment({
        "name": "model-parallel-landscape",
        "model": MODEL,
        "train_input": {"batch_size": 16, "micro_batch_size": "auto", "num_devices": 2},
        "search": {"space": SPACE},
        "trial": {"parallel": "ddp", "sharding": "none", "device": "cpu", "precision": "fp32",
                  "compile": False, "warmup_steps": 2, "measure_steps": 5, "timeout_s": 600},
    })  # fmt: skip


def _rank(rank: int, world: int, init: str, out: str, rounds: int) -> None:
    """One rank: every configuration in turn, ``rounds`` times; rank 0 writes each result."""
    import torch
    import torch.distributed as dist

    from mbtune.trial.pipeline import measure_model_parallel
    from mbtune.trial.trial import result_of

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    exp = experiment()
    configs = sorted({c.canonical() for c in exp.configs()})
    try:
        found = []
        for r in range(rounds):
            for c in configs:
                measured = measure_model_parallel(exp, c, torch.device("cpu"))
                result = result_of(exp, measured)
                found.append({"round": r, **c.as_dict(), "status": result.status,
                              "reason": result.reason, "samples_per_s": result.samples_per_s,
                              "loss": result.loss})  # fmt: skip
                if rank == 0:
                    print(f"round {r}: {c.sizes()} {result.status} "
                          f"{result.samples_per_s or 0:.1f} samples/s", flush=True)  # fmt: skip
        if rank == 0:
            Path(out).write_text(json.dumps(found))
    finally:
        dist.destroy_process_group()


def main() -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    info = machine()
    started, load = time.perf_counter(), loadavg()
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/found.json"
        mp.spawn(_rank, args=(2, f"file://{tmp}/pg", out, args.rounds), nprocs=2, join=True)
        found = json.loads(Path(out).read_text())
    by_config: dict[BatchConfig, list[dict]] = {}
    for row in found:
        by_config.setdefault(BatchConfig.from_mapping(row), []).append(row)
    columns = ["batch_size", "num_devices", "micro_batch_size", "tensor_parallel",
               "pipeline_parallel", "pipeline_schedule", "samples_per_s", "status"]  # fmt: skip
    table = {}
    with TABLE.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for c, rows in sorted(by_config.items()):
            ok = [r["samples_per_s"] for r in rows if r["status"] == "ok" and r["samples_per_s"]]
            value = statistics.median(ok) if len(ok) == len(rows) else None
            table[c] = value
            w.writerow([*(getattr(c, k) for k in columns[:6]), "" if value is None else value,
                        "ok" if value else rows[-1]["status"]])  # fmt: skip
    best = max((c for c, v in table.items() if v), key=lambda c: table[c])
    print(f"\n{TABLE.relative_to(BENCH.parent)}: {len(table)} configurations; best "
          f"{best.sizes()} at {table[best]:.1f} samples/s")  # fmt: skip
    for c, v in sorted(table.items(), key=lambda kv: -(kv[1] or 0)):
        spread = ", ".join(f"{r['samples_per_s'] or 0:.1f}" for r in by_config[c])
        print(f"  t={c.tensor_parallel} p={c.pipeline_parallel} {c.pipeline_schedule:<16} "
              f"m={c.micro_batch_size}: {v or 0:7.1f}  (rounds {spread})")  # fmt: skip
    seconds = time.perf_counter() - started
    figures = {"rows": found, "seconds": seconds, "load_before": load, "load_after": loadavg()}
    save("measure_model_parallel", info, figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
