"""A split trial's rank builds its share of the model: its host's peak memory, with the whole
model built on the CPU and copied (before issue 40's last part) and built on the meta device
with only the rank's shards materialised (mbtune.trial.rank_init).

Method. For each layout, 2 gloo ranks (fresh processes, torch.multiprocessing.spawn), each
as a ``trial.parallel: ddp`` rank builds it (mbtune.trial.pipeline): the process group and
the (dp, pp, tp) mesh, glibc's mmap threshold fixed at 1 MiB (so freed tensors leave the
resident set), then the model. ``whole``: ``build_spec`` on the CPU (seeded), then
``build_rank_model`` copies this rank's stages and moves the whole model to the meta device;
``meta``: ``rank_spec`` (the meta device) and ``build_rank_model`` with the seed (to_empty
and the init replayed). Per rank: the resident set before the build, its high-water mark
(VmHWM) after, and the difference, the build's own peak; the parameters the rank keeps.
The arms alternate, each round a fresh pair of processes. A gpt of 134M parameters (537 MB
in fp32): 8 blocks, width 1024, 16 heads, 128 tokens, 32,768 words.

Run: `.venv/bin/python bench/split_build_memory.py [--rounds 2]`; raw figures in
bench/results/split_build_memory.json.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from pathlib import Path
from typing import Any

from _common import ROOT, machine, save, table

MIB = 2**20
MODEL = {"name": "gpt", "n_layer": 8, "n_head": 16, "d_model": 1024, "seq_len": 128,
         "vocab_size": 32768, "dropout": 0.0}  # fmt: skip
LAYOUTS = {"p 2 (1f1b)": {"pipeline_parallel": 2}, "t 2": {"tensor_parallel": 2}}
ARMS = ("whole", "meta")


def _status(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(rf"{key}:\s+(\d+) kB", text)[1]) * 1024  # type: ignore[index]


def _rank(rank: int, init: str, out: str, arm: str, layout: dict[str, Any]) -> None:
    import torch
    import torch.distributed as dist

    from mbtune.config.load import parse_experiment
    from mbtune.lattice import BatchConfig
    from mbtune.trial.memory import fixed_mmap_threshold
    from mbtune.trial.parallelize import ParallelDims, build_rank_model, rank_spec
    from mbtune.trial.step import build_spec

    torch.set_num_threads(1)
    fixed_mmap_threshold()
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    exp = parse_experiment({
        "name": "split-build", "model": MODEL,
        "train_input": {"batch_size": 8, "micro_batch_size": 2, "num_devices": 2},
        "trial": {"parallel": "ddp", "sharding": "none", "device": "cpu", "precision": "fp32",
                  "compile": False},
    })  # fmt: skip
    config = BatchConfig(8, 2, 2, **layout)
    dims = ParallelDims.of(config)
    mesh = dims.mesh("cpu")
    dist.barrier()
    before = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here
    cpu = torch.device("cpu")
    if arm == "whole":
        spec = build_spec(exp, config)
        whole = spec.gradient_bytes  # before the split (moved to meta, its tie is undone)
        model = build_rank_model(spec.module, dims, mesh, exp.trial, config, cpu)
    else:
        spec = rank_spec(exp, config, dims)
        whole = spec.gradient_bytes
        model = build_rank_model(spec.module, dims, mesh, exp.trial, config, cpu,
                                 seed=exp.search.seed)  # fmt: skip
    peak = _status("VmHWM")
    kept = sum(
        (p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in model.parameters()
    )
    found = {"rank": rank, "before": before, "peak": peak, "build": peak - before,
             "kept": kept, "model": whole}  # fmt: skip
    Path(out, f"{rank}.json").write_text(json.dumps(found))
    dist.barrier()
    dist.destroy_process_group()


def one(arm: str, layout: dict[str, Any]) -> list[dict[str, int]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(f"file://{tmp}/pg", tmp, arm, layout), nprocs=2, join=True)
        return [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(2)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    info = machine()
    runs: dict[str, dict[str, list]] = {name: {arm: [] for arm in ARMS} for name in LAYOUTS}
    for _ in range(args.rounds):
        for name, layout in LAYOUTS.items():
            for arm in ARMS:
                runs[name][arm].append(one(arm, layout))
    rows = []
    for name in LAYOUTS:
        for arm in ARMS:
            for rank in range(2):
                got = [run[rank] for run in runs[name][arm]]
                rows.append([
                    name, arm, rank,
                    statistics.median(g["before"] for g in got) / MIB,
                    statistics.median(g["peak"] for g in got) / MIB,
                    statistics.median(g["build"] for g in got) / MIB,
                    got[0]["kept"] / MIB, got[0]["model"] / MIB,
                ])  # fmt: skip
    print(table(["layout", "build", "rank", "RSS before MiB", "VmHWM MiB", "build's peak MiB",
                 "kept MiB", "whole model MiB"], rows))  # fmt: skip
    path = save("split_build_memory", info, {"model": MODEL, "rounds": args.rounds,
                                             "runs": runs})  # fmt: skip
    print(f"raw: {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
