"""Data-parallel trials (trial.parallel: ddp): the DDP step's gradients, what ddp refuses,
the pieces that keep a failing run from hanging, and one whole search on Ray Train, of a
pipeline (p = 2), whose trials run, raise, run out of memory on one rank and lose a worker."""

from __future__ import annotations

import builtins
import csv
import dataclasses
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from ranks import spawn_ranks
from test_model_parallel import USER_MODEL

from mbtune.cli import main
from mbtune.config.load import parse_experiment
from mbtune.lattice import BatchConfig
from mbtune.search import run_search, trial_resources
from mbtune.trial import ddp
from mbtune.trial.step import rank_micro_batches, synced_step
from mbtune.trial.trial import run_trial

# -- the DDP step: gradients ------------------------------------------------------------

GRADIENT_CASES = [
    ("mlp", BatchConfig(8, 2, 2)),  # 4 samples a rank, 2 micro-batches of 2
    ("mlp", BatchConfig(7, 2, 2)),  # uneven ranks: 4 = 2 + 2 and 3 = 2 + 1
    ("gpt", BatchConfig(5, 2, 1)),  # P = 3, g = 3; rank 1 has 2 samples: 2 micro-batches
    ("gpt", BatchConfig(6, 2, 3)),  # g = 1: the step is one synchronised pass
]


def _gradient_rank(rank: int, world: int) -> None:
    """One rank: DDP + accumulation over its share must give the full-batch gradient."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from mbtune.models.build import build_model

    for name, config in GRADIENT_CASES:
        options = {"n_layer": 1, "d_model": 16, "seq_len": 4, "vocab_size": 32}
        spec = build_model(name, options if name == "gpt" else {}, seed=0)
        module = spec.module.double()
        torch.manual_seed(1)  # every rank makes the same global batch
        batch = spec.make_batch(config.batch_size, torch.device("cpu"))
        data = tuple(t.double() if t.is_floating_point() else t for t in batch)
        spec.loss_fn(module, data).backward()  # the single-process full-batch gradient
        full = [p.grad.clone() for p in module.parameters()]
        module.zero_grad(set_to_none=True)

        start = sum(config.device_batch_sizes[:rank])
        share = tuple(t[start : start + config.device_batch_sizes[rank]] for t in data)
        sizes = rank_micro_batches(config, rank)
        model = DistributedDataParallel(module)
        reduces = []

        def counting(state, bucket, reduces=reduces):
            # reduced here, a completed future handed back: no Python callback left for
            # gloo's threads to release (the group outlives the rank: tests/ranks.py)
            reduces.append(bucket.buffer().numel())
            dist.all_reduce(bucket.buffer())
            done = torch.futures.Future()
            done.set_result(bucket.buffer().div_(world))
            return done

        model.register_comm_hook(None, counting)
        batches = [tuple(t[a : a + m] for t in share) for a, m in _offsets(sizes)]
        total = config.batch_size / world
        synced_step(spec.loss_fn, model, batches, total=total, no_sync=model.no_sync)
        # the tiny models fit one bucket: one all-reduce per step, whatever g is
        assert len(reduces) == 1, (name, config, reduces)
        for expected, p in zip(full, module.parameters(), strict=True):
            torch.testing.assert_close(p.grad, expected, rtol=1e-10, atol=1e-12)


def _offsets(sizes):
    start = 0
    for m in sizes:
        yield start, m
        start += m


@pytest.mark.slow
def test_ddp_accumulation_gives_the_full_batch_gradient(tmp_path):
    # a rank's failed assertion is raised here, with the rank's own traceback
    spawn_ranks(_gradient_rank, (), nprocs=2, rendezvous=tmp_path / "pg")


def test_each_rank_takes_its_share_in_even_micro_batches():
    assert [rank_micro_batches(BatchConfig(7, 2, 2), r) for r in (0, 1)] == [[2, 2], [2, 1]]
    assert [rank_micro_batches(BatchConfig(5, 2, 1), r) for r in (0, 1)] == [[1, 1, 1], [1, 1]]
    assert rank_micro_batches(BatchConfig(32, 4, 8), 3) == [8]


def test_rank_0_runs_the_busiest_devices_micro_batches():
    """One loop measures a simulated trial as ddp's rank 0: the same micro-batches."""
    sizes = [(7, 2, 2), (5, 2, 1), (33, 4, 3), (16, 1, 5), (9, 4, 1), (64, 8, 64)]
    for config in (BatchConfig(*s) for s in sizes):
        assert rank_micro_batches(config, 0) == config.micro_batch_sizes, config


# -- what ddp refuses ------------------------------------------------------------------

BASE = {
    "name": "d",
    "model": {"name": "mlp", "in_features": 8, "hidden": 8, "n_layer": 1},
    "train_input": {"batch_size": 16, "micro_batch_size": 4, "num_devices": 2},
    "trial": {"parallel": "ddp", "compile": False},
}


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["trial.backend=replay", "trial.table=t.csv"],
            r"trial\.parallel: ddp runs real workers, but the replay backend answers from "
            r"trial\.table and runs nothing",
        ),
        (
            ["trial.device=cuda", "ray.gpus_per_trial=0"],
            r"ray\.gpus_per_trial: ddp on cuda gives each worker its own GPU, and "
            r"ray\.gpus_per_trial is 0; set ray\.gpus_per_trial: 1",
        ),
        (
            ["ray.cpus_per_trial=0"],
            r"ray\.cpus_per_trial: ddp workers need resources of their own: ray\.cpus_per_trial "
            r"and ray\.gpus_per_trial are both 0",
        ),
        (
            ["ray.gpus_per_trial=0.5"],
            r"ray\.gpus_per_trial: ddp gives each worker whole GPUs .*, got 0\.5",
        ),
    ],
)
def test_what_ddp_cannot_do_is_one_line_and_exit_2(tmp_path, capsys, sets, message):
    import re

    import yaml

    (tmp_path / "t.csv").write_text("batch_size,num_devices,micro_batch_size,samples_per_s\n")
    (tmp_path / "e.yaml").write_text(yaml.safe_dump(BASE))
    code = main(["validate", str(tmp_path / "e.yaml"), *[f"--set={s}" for s in sets]])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(message, err), err


@pytest.mark.parametrize(
    ("address", "message"),
    [
        ("ray://127.0.0.1:1", r"--address: ray://127\.0\.0\.1:1: Ray Client \(ray://\) would run"),
        ("127.0.0.1:{port}", r"--address: nothing answers at 127\.0\.0\.1:\d+"),
    ],
)
def test_a_ddp_trial_joins_ray_as_a_search_does(tmp_path, capsys, address, message):
    """`mbtune trial` with ddp starts or joins Ray through the search's own door: a Ray
    Client address is refused and one where nothing listens fails at once, in one line."""
    import re
    import socket

    import yaml

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "e.yaml").write_text(yaml.safe_dump(BASE))
    sets = [f"--set=ray.address={address.format(port=port)}"]
    code = main(["trial", str(tmp_path / "e.yaml"), *sets])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert re.search(message, err), err


def test_a_ddp_trial_holds_no_cpu_of_its_own_its_workers_do():
    exp = parse_experiment({**BASE, "ray": {"cpus_per_trial": 1, "gpus_per_trial": 0}})
    assert trial_resources(exp) == {"cpu": 0, "gpu": 0, "memory": 1}
    simulate = parse_experiment({**BASE, "trial": {"compile": False}, "ray": {"cpus_per_trial": 2}})
    assert trial_resources(simulate) == {"cpu": 2, "gpu": 0.0}


@pytest.mark.ray
def test_too_many_workers_for_the_cluster_is_an_error_that_says_what_to_change(ray_session):
    exp = parse_experiment({**BASE, "ray": {"cpus_per_trial": 1}})
    r = run_trial(exp, BatchConfig(16, 4, 4))
    assert r.status == "error" and r.parallel == "ddp"
    assert r.reason == (
        "4 ddp workers need 4 CPU (ray.cpus_per_trial = 1 per worker), but the Ray cluster "
        "has 2; lower ray.cpus_per_trial (a fraction shares a core) or num_devices"
    )


def test_ray_train_polls_often_waits_no_longer_than_the_trial_and_watches_no_preemption(
    monkeypatch,
):
    """What Ray Train reads from the caller's environment during a trial (and passes on to
    its controller): set for the run only, a user's own health check and watcher kept."""
    import time

    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)
    monkeypatch.delenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", raising=False)
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "60")
    with ddp._train_env(time.time() + 30):
        assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "0.5"
        assert os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "0"
        assert 25 <= float(os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"]) <= 30
    assert "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER" not in os.environ
    assert os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] == "60"
    monkeypatch.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2")
    monkeypatch.setenv("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "1")
    with ddp._train_env(time.time() + 30):
        assert os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] == "2"
        assert os.environ["RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"] == "1"


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Ray Data's, as a trainer is made
def test_a_trials_ray_train_run_starts_no_dataset_manager():
    """A trial feeds its workers no Ray Dataset: its trainer leaves out Ray Train's datasets
    callback (which starts a DatasetManager actor for every run) and keeps the rest. Ray's
    own trainer still has that callback, by that name: were it renamed, the trials would
    start the actor again, and this says so."""
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    def names(trainer: type) -> list[str]:
        made = trainer(lambda: None, scaling_config=ScalingConfig(num_workers=2))
        return [type(c).__name__ for c in made._create_default_callbacks()]

    ray_train = names(TorchTrainer)
    assert "DatasetsCallback" in ray_train
    assert names(ddp._trainer_without_datasets(TorchTrainer)) == [
        name for name in ray_train if name != "DatasetsCallback"
    ]


# -- no hang: the pieces ------------------------------------------------------------------


def test_a_rank_stops_itself_at_the_deadline():
    """The watchdog ends the worker's process wherever the rank is stuck."""
    # the rank never returns by itself: the exit code says that the watchdog ended it
    script = (
        "import threading, time\nfrom mbtune.trial import ddp\n"
        "ddp._run_rank = lambda exp, config: threading.Event().wait()\n"
        "ddp._rank_main({'deadline': time.time() + 1, 'cwd': '.', 'experiment': None, "
        "'config': None})\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert proc.returncode == ddp.EXIT_TIMED_OUT, proc.stderr


def test_a_run_that_never_ends_is_given_up():
    ended = threading.Event()

    class Stuck:
        def fit(self):
            ended.wait()  # until the test ends it: given up, never waited for
            return "fitted"

    try:
        assert ddp._fit(Stuck(), wait_s=0.5) is None  # while fit() still runs
    finally:
        ended.set()


def test_an_out_of_memory_on_any_rank_outranks_a_dead_worker_and_collateral_errors():
    from ray.exceptions import RayActorError

    class HealthCheckFailed(Exception):  # what Ray Train hands back for a dead worker
        def __init__(self):
            super().__init__("A worker health check failed.\nWorker info: ...")
            self.health_check_failure = RayActorError()

    gloo = RuntimeError("[gloo] Connection closed by peer")
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert ddp._worker_failure({0: gloo, 1: HealthCheckFailed()}) == (
        "error",
        "rank 1: the worker process died (SIGKILL: the kernel's out-of-memory killer?) "
        "(and 1 other rank failed with it)",
    )
    assert ddp._worker_failure({0: gloo, 2: HealthCheckFailed(), 3: oom}) == (
        "oom",
        "rank 3: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (and 2 "
        "other ranks failed with it)",
    )
    assert ddp._worker_failure({1: ValueError("bad shape")}) == (
        "error",
        "rank 1: ValueError: bad shape",
    )


# -- a whole search on Ray Train ----------------------------------------------------------

# tests/test_model_parallel.py's stack model, split in two pipeline stages (1f1b); rank 1's
# stage fails differently at each micro-batch size, in its forward pass, while rank 0 waits
# for its gradient in a receive: raises at 1, runs at 2, runs out of memory at 4 and is
# SIGKILLed at 8.
FAULTY_STAGE = (
    USER_MODEL.format(fail=1)
    + """

import os, signal


def fail(x):
    if x.shape[0] == 1:
        raise RuntimeError("this stage fails on purpose")
    if x.shape[0] == 4:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    if x.shape[0] == 8:
        os.kill(os.getpid(), signal.SIGKILL)
"""
)


@pytest.mark.ray
@pytest.mark.slow
def test_a_pipeline_search_measures_and_records_an_error_an_oom_and_a_dead_worker_on_one_rank(
    ray_session, tmp_path, monkeypatch
):
    """Every way a Ray Train trial ends, in one search of four trials at once on 2 ranks
    (p = 2): ok, with the one process's loss; an error, an out-of-memory and a dead worker
    on rank 1 alone, each ending the whole group (a peer left hanging in its receive would
    end only at the timeout), each a recorded row naming rank 1."""
    (tmp_path / "faulty_stage.py").write_text(textwrap.dedent(FAULTY_STAGE))
    monkeypatch.chdir(tmp_path)  # the workers import the user model from here
    exp = parse_experiment(
        {
            "name": "ddp",
            "model": {"name": "faulty_stage:build"},
            "train_input": {"batch_size": 16, "micro_batch_size": "auto", "num_devices": 2},
            "search": {
                "space": {
                    "num_devices": [2],
                    "micro_batch_size": [1, 2, 4, 8],
                    "pipeline_parallel": [2],
                    "pipeline_schedule": ["1f1b"],
                },
                "sampler": "grid",
                "confidence_target": 100,  # every configuration, once
                "max_repeats": 1,
            },  # fmt: skip
            "trial": {
                "parallel": "ddp",
                "device": "cpu",
                "precision": "fp32",
                "compile": False,
                "eval": True,
                "warmup_steps": 1,
                "measure_steps": 2,
                # a bound no correct trial nears: four fits share two cores, over 120 s
                # each with one more busy process (a slower machine); a peer left hanging
                # would reach it, a 'timeout' where the test wants rank 1's error
                "timeout_s": 300,
            },  # fmt: skip
            # all four at once, their eight workers sharing the two cores
            "ray": {"max_concurrent_trials": 4, "cpus_per_trial": 0.25},
            "output_dir": str(tmp_path / "runs"),
        }
    )
    lines = []
    print_before = builtins.print
    outcome = run_search(exp, echo=lines.append)
    with outcome.run.trials_file.open(newline="") as f:
        rows = {int(r["micro_batch_size"]): r for r in csv.DictReader(f)}
    assert sorted(rows) == [1, 2, 4, 8] and len({r["trial_id"] for r in rows.values()}) == 4

    ok = rows[2]
    assert ok["status"] == "ok", ok
    steps = [float(x) for x in ok["step_times_ms"].split()]
    assert len(steps) == 2 and all(s > 0 for s in steps)
    assert float(ok["samples_per_s"]) == pytest.approx(
        16 / (float(ok["step_time_ms_median"]) / 1e3)
    )
    assert int(ok["grad_accum_steps"]) == 8 and float(ok["peak_memory_bytes"]) > 0
    assert float(ok["eval_samples_per_s"]) > 0 and not ok["compile_fallback"]
    trial = dataclasses.replace(exp.trial, parallel="simulate")
    one = run_trial(dataclasses.replace(exp, trial=trial), BatchConfig(16, 1, 2))
    assert float(ok["loss"]) == pytest.approx(one.loss, rel=1e-4)

    assert rows[1]["status"] == "error"
    raised = rows[1]["reason"]
    assert raised.startswith("rank 1: ") and "this stage fails on purpose" in raised, raised
    assert (rows[4]["status"], rows[4]["reason"]) == (
        "oom", "rank 1: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    )  # fmt: skip
    assert rows[8]["status"] == "error"
    assert rows[8]["reason"].startswith("rank 1: the worker process died (SIGKILL")
    best = outcome.summary["recommended"]
    assert (best["micro_batch_size"], best["num_devices"]) == (2, 2)
    assert any("4 trials finished (3 not ok)" in line for line in lines)
    # Ray showed the dead worker's message without replacing print, which Tune's saved
    # state holds through the callbacks (its state could not be saved for --resume)
    assert builtins.print is print_before
