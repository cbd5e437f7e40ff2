"""The sharding knobs as searched dimensions (reshard_after_forward, grad_sync), and the
configurations a search skips because their memory is predicted over the budget."""

import json
import warnings

import pytest
from ranks import spawn_ranks

from mbtune.cli import main
from mbtune.config.load import parse_experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.recommend.confidence import assess
from mbtune.recommend.observation import Observation
from mbtune.runs.record import CONFIG_KEY, TrialRecord
from mbtune.search import run_search, search_points
from mbtune.trial.replay import ReplayTable

GIB = 2**30
MS = (2, 4, 8, 16)


def _row(m: int, reshard: bool, sync: str) -> dict:
    """A landscape where each knob trades memory for speed: keeping the parameters after
    the forward pass is 10% faster and holds 40% more; syncing every micro-batch is 5%
    slower and holds 25% less. The fastest that fits 4 GiB less 5%: m = 8, both traded."""
    speed = 200 * m / (m + 2) * (1.10 if not reshard else 1) * (0.95 if sync == "every" else 1)
    peak = (1 + 0.3 * m * (1.4 if not reshard else 1) * (0.75 if sync == "every" else 1)) * GIB
    return {"batch_size": 32, "num_devices": 2, "micro_batch_size": m,
            "reshard_after_forward": str(reshard).lower(), "grad_sync": sync,
            "samples_per_s": round(speed, 3), "peak_memory_bytes": int(peak)}  # fmt: skip


def _sharded_replay(tmp_path, **search):
    rows = [_row(m, r, s) for m in MS for r in (True, False) for s in ("last", "every")]
    table = tmp_path / "sharded.csv"
    table.write_text(",".join(rows[0]) + "\n" + "".join(
        ",".join(str(v) for v in row.values()) + "\n" for row in rows
    ))  # fmt: skip
    return parse_experiment({
        "name": "sharded",
        "model": "gpt",
        "train_input": {"batch_size": 32, "num_devices": 2, "micro_batch_size": "auto"},
        "search": {"space": {"micro_batch_size": list(MS), "reshard_after_forward": [True, False],
                             "grad_sync": ["last", "every"]}, **search},
        "trial": {"backend": "replay", "table": str(table), "sharding": "fsdp",
                  "device_memory": "4GiB"},
        "output_dir": str(tmp_path / "runs"),
    }), rows  # fmt: skip


@pytest.mark.ray
@pytest.mark.slow
def test_a_search_over_the_sharding_knobs_recommends_them_and_exports_them(ray_session, tmp_path):
    transformers = pytest.importorskip("transformers")
    from mbtune.analysis.analyze import export_run
    from mbtune.runs.load import load_run, run_info

    exp, rows = _sharded_replay(tmp_path, sampler="grid")
    assert len(exp.configs()) == 16
    # 14 measurements: at m = 16 a device runs one micro-batch, and grad_sync every and last
    # synchronise its gradients once, in that micro-batch (BatchConfig.canonical)
    assert len(search_points(exp)) == 14
    lines: list[str] = []
    outcome = run_search(exp, echo=lines.append)
    best = outcome.summary["recommended"]
    assert (best["micro_batch_size"], best["reshard_after_forward"], best["grad_sync"]) == (
        8, False, "every"
    )  # fmt: skip
    assert len(outcome.records) == 14 and {r.sharding for r in outcome.records} == {"fsdp"}
    measured = [r for r in rows if r["micro_batch_size"] < 16 or r["grad_sync"] == "last"]
    over = sum(r["peak_memory_bytes"] > 0.95 * 4 * GIB for r in measured)
    assert sum(r.status == "oom" for r in outcome.records) == over == 3
    assert any(line.startswith("recommended: micro_batch_size 8") and
               "fsdp, reshard_after_forward false, grad_sync every" in line
               for line in lines)  # fmt: skip
    # trials.csv and the frame: each knob a column of its own, typed, part of the key
    frame = load_run(outcome.run.path)
    assert {"reshard_after_forward", "grad_sync"} <= set(CONFIG_KEY)
    assert str(frame["reshard_after_forward"].dtype) == "bool"
    assert set(frame["grad_sync"]) == {"last", "every"}
    assert len(frame.drop_duplicates(list(CONFIG_KEY))) == 14
    # the exports of that recommendation, as the installed libraries read them
    info = run_info(outcome.run.path)
    export_run(frame, info, "hf")
    hf = json.loads((outcome.run.path / "export-hf.json").read_text())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecated key
        args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), **hf)
    assert args.fsdp is True and args.fsdp_plugin_args["reshard_after_forward"] is False
    assert args.accelerator_config.gradient_accumulation_kwargs == {"sync_each_batch": True}
    export_run(frame, info, "deepspeed")
    ds = json.loads((outcome.run.path / "export-deepspeed.json").read_text())
    assert ds["zero_optimization"] == {"stage": 2}  # parameters kept: ZeRO-2
    assert ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 2 == 32
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser

    path = export_run(frame, info, "accelerate")
    parsed = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    parsed, _, _ = _validate_launch_command(parsed)
    assert (parsed.use_fsdp, parsed.num_processes, parsed.fsdp_reshard_after_forward) == (
        True, 2, False
    )  # fmt: skip
    assert "GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)" in path.read_text()


def test_a_replayed_table_answers_for_the_measurement_a_row_is(tmp_path):
    # a table that names one micro-batch a device grad_sync every answers for the same
    # measurement named last, as a search proposes it (BatchConfig.canonical)
    table = tmp_path / "every.csv"
    table.write_text("batch_size,num_devices,micro_batch_size,grad_sync,samples_per_s\n"
                     "32,2,16,every,300\n32,2,8,every,250\n")  # fmt: skip
    replay = ReplayTable(table)
    assert replay.lookup(BatchConfig(32, 2, 16))["samples_per_s"] == 300.0
    assert replay.lookup(BatchConfig(32, 2, 8, grad_sync="every"))["samples_per_s"] == 250.0
    with pytest.raises(MbtuneError, match="has no row for .* micro_batch_size 8; it holds 2"):
        replay.lookup(BatchConfig(32, 2, 8))  # two micro-batches: last is another measurement


def test_an_out_of_memory_bounds_the_same_settings_at_as_many_or_fewer_devices():
    # each measurement once: on 4 devices m = 8 is one micro-batch a device, every = last
    points = sorted({BatchConfig(32, n, m, grad_sync=s).canonical() for n in (1, 2, 4)
                     for m in (2, 4, 8) for s in ("last", "every")})  # fmt: skip
    assert len(points) == 17
    ok = Observation(BatchConfig(32, 2, 2), "ok", 100.0, (10.0, 10.1))
    # sharded, m >= 4 on 1 or 2 devices with grad_sync last: on 4 devices each holds a
    # smaller shard, and grad_sync every holds memory on a scale of its own
    oom = Observation(BatchConfig(32, 2, 4), "oom")
    a = assess(points, [ok, oom], sharded=True)
    assert a.feasible == len(points) - 4
    b = assess(points, [ok, Observation(BatchConfig(32, 2, 8, grad_sync="every"), "oom")],
               sharded=True)  # fmt: skip
    assert b.feasible == len(points) - 2  # m = 8 with every, on 1 and 2 devices
    # unsharded, each device holds the whole model: m >= 4 on every device count
    assert assess(points, [ok, oom]).feasible == len(points) - 6


def test_one_micro_batch_a_device_is_on_grad_sync_everys_memory_scale():
    # sharded, grad_sync last accumulates unsharded gradients over a device's micro-batches;
    # with one (g = 1) there are none to hold, as with every: an out of memory at m = 8 with
    # last (g = 2) says nothing of m = 16 (g = 1), one at m = 16 bounds every's larger m
    points = sorted({BatchConfig(32, 2, m, grad_sync=s).canonical() for m in (4, 8, 16)
                     for s in ("last", "every")})  # fmt: skip
    assert [(c.micro_batch_size, c.grad_sync) for c in points] == [
        (4, "every"), (4, "last"), (8, "every"), (8, "last"), (16, "last")
    ]
    assert BatchConfig(32, 2, 16).memory_variant(True) == BatchConfig(
        32, 2, 8, grad_sync="every"
    ).variant
    assert BatchConfig(32, 2, 16).memory_variant(False) == BatchConfig(32, 2, 8).variant
    ok = Observation(BatchConfig(32, 2, 4), "ok", 100.0, (10.0, 10.1))
    last = assess(points, [ok, Observation(BatchConfig(32, 2, 8), "oom")], sharded=True)
    assert last.feasible == len(points) - 1  # m = 8 with last only
    one = assess(points, [ok, Observation(BatchConfig(32, 2, 16), "oom")], sharded=True)
    assert one.feasible == len(points) - 1  # m = 16 itself: no larger m of every's
    every = assess(points, [ok, Observation(BatchConfig(32, 2, 8, grad_sync="every"), "oom")],
                   sharded=True)  # fmt: skip
    assert every.feasible == len(points) - 2  # m = 8 with every, and m = 16


def test_a_predicted_record_reads_back_as_an_oom_of_no_trial():
    record = TrialRecord(
        trial=1, status="oom", batch_size=8, num_devices=2, micro_batch_size=4,
        reshard_after_forward=False, grad_sync="every", reason="predicted: peak memory ...",
    )  # fmt: skip
    back = TrialRecord.from_row(record.to_row())
    assert back == record and back.predicted and back.config.settings == (False, False, "every")
    assert not TrialRecord(trial=2, status="oom", batch_size=8, num_devices=2,
                           micro_batch_size=4, reason="CUDA out of memory").predicted  # fmt: skip
    old = {k: v for k, v in record.to_row().items() if k not in ("reshard_after_forward",
                                                                  "grad_sync")}  # fmt: skip
    assert TrialRecord.from_row(old).config.settings == (False, True, "last")  # defaults


BAD = [
    ({"search": {"space": {"grad_sync": ["last", "sometimes"]}}},
     "search.space.grad_sync: expected last or every, or a list of them such as [last, every], "
     "got ['last', 'sometimes']; 'sometimes' is not one of them"),
    ({"search": {"space": {"pipeline_schedule": ["1f1b", "interleaved1f1b"]}}},
     "search.space.pipeline_schedule: expected gpipe or 1f1b or interleaved_1f1b or zbv or "
     "dualpipev, or a list of them such as [gpipe, 1f1b, interleaved_1f1b, zbv, dualpipev], "
     "got ['1f1b', 'interleaved1f1b']; 'interleaved1f1b' is not one of them (did you mean "
     "'interleaved_1f1b'?)"),
    ({"trial": {"sharding": "fsdp", "parallel": "ddp", "grad_sync": "sometimes"}},
     "trial.grad_sync: 'sometimes' is not one of: last, every"),
    ({"search": {"space": {"reshard_after_forward": [True, False]}}},
     "search.space.reshard_after_forward: reshard_after_forward (true or false) applies to "
     "sharded trials only, and trial.sharding is none; set trial.sharding: fsdp (with "
     "trial.parallel: ddp), or leave reshard_after_forward out"),
    ({"trial": {"grad_sync": "every"}},
     "trial.grad_sync: grad_sync (last or every) applies to sharded trials only, and "
     "trial.sharding is none; set trial.sharding: fsdp (with trial.parallel: ddp), or leave "
     "grad_sync out"),
    ({"search": {"predict_memory": "maybe"}},
     "search.predict_memory: expected true or false, got 'maybe'"),
]  # fmt: skip


@pytest.mark.parametrize(("section", "message"), BAD)
def test_bad_sharding_knobs_exit_2_with_one_line_naming_the_field(
    tmp_path, capsys, section, message
):
    import yaml

    raw = {"name": "bad", "model": "gpt", "train_input": {"batch_size": 8}, **section}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(raw))
    code = main(["validate", str(path)])
    out, err = capsys.readouterr()
    assert (code, out, err) == (2, "", f"mbtune: error: {message}\n")


@pytest.mark.ray
@pytest.mark.slow
def test_configurations_predicted_over_the_budget_are_recorded_without_a_trial(
    ray_session, tmp_path
):
    """A tiny gpt whose activations dominate (256 tokens a sample): on 370 MiB less 5%,
    m = 32 and 64 are predicted over (about 373 and 465 MiB, the process's own 278 MiB
    included), m = 8 and 16 under (303 and 326 MiB); one trial is bought, at m = 8."""
    exp = parse_experiment({
        "name": "predicted",
        "model": {"name": "gpt", "n_layer": 2, "d_model": 64, "n_head": 2, "seq_len": 256,
                  "vocab_size": 256},
        "train_input": {"batch_size": 64, "micro_batch_size": "auto"},
        "search": {"space": {"micro_batch_size": [8, 16, 32, 64]}, "sampler": "grid",
                   "num_samples": 1},
        "trial": {"device": "cpu", "device_memory": "370MiB", "compile": False,
                  "warmup_steps": 0, "measure_steps": 1},
        "output_dir": str(tmp_path / "runs"),
    })  # fmt: skip
    lines: list[str] = []
    outcome = run_search(exp, echo=lines.append)
    predicted = [r for r in outcome.records if r.predicted]
    assert [(r.trial, r.micro_batch_size, r.status) for r in predicted] == [
        (1, 32, "oom"), (2, 64, "oom")
    ]  # fmt: skip
    assert predicted[0].reason.startswith("predicted: peak memory ")
    assert "above the budget trial.device_memory 370 MiB" in predicted[0].reason
    assert predicted[1].reason.startswith("predicted: more memory than micro_batch_size 32")
    measured = [r for r in outcome.records if not r.predicted]
    assert [(r.trial, r.micro_batch_size) for r in measured] == [(3, 8)]  # num_samples: 1
    assert outcome.summary["predicted_oom"] == 2
    assert any("2 configurations predicted out of memory, skipped without a trial" in line
               for line in lines)  # fmt: skip
    assert any(line.startswith("mbtune: 2 of 4 configurations predicted over 352 MiB")
               for line in lines)  # fmt: skip


# -- the knobs on two gloo ranks: what each changes, and the step they leave as it was ------


def _knobs_rank(rank: int, world: int, reshard: bool, sync: str) -> None:
    """FSDP on 2 ranks with ``reshard`` and ``sync``: the gathered parameters kept after the
    forward pass or not, the first micro-batch's gradients reduced or not, and the step's
    gradients those of one process's full batch either way."""
    import torch
    from torch.distributed.tensor import DTensor

    from mbtune.config.trial import TrialConfig
    from mbtune.models.build import build_model
    from mbtune.trial.sharding import FullyShardedGroup
    from mbtune.trial.step import accumulate_gradients

    cpu = torch.device("cpu")
    gpt = {"n_layer": 2, "d_model": 32, "n_head": 2, "seq_len": 8, "vocab_size": 64,
           "dropout": 0.0}  # fmt: skip
    whole = build_model("gpt", gpt, seed=3)
    with torch.device("meta"):
        spec = build_model("gpt", gpt, seed=3)
    trial = TrialConfig(parallel="ddp", sharding="fsdp", compile=False, precision="fp32")
    group = FullyShardedGroup(cpu, trial, seed=3, reshard_after_forward=reshard,
                              grad_sync=sync)  # type: ignore[arg-type]  # fmt: skip
    model = group.data_parallel(group.place(spec.module, cpu))
    torch.manual_seed(1)
    batch = whole.make_batch(8, cpu)
    whole.loss_fn(whole.module, batch).backward()
    share = tuple(t[4 * rank : 4 * rank + 4] for t in batch)
    first, last = [tuple(t[a : a + 2] for t in share) for a in (0, 2)]
    block = model.blocks[0]
    loss = spec.loss_fn(model, first) * (2 / 4)
    # reshard_after_forward false: the block's parameters stay gathered (whole tensors)
    assert all(isinstance(p, DTensor) == reshard for p in block.parameters())
    with group.no_sync(model):
        loss.backward()
    # grad_sync every: the first micro-batch's gradients were reduce-scattered already
    assert all((p.grad is not None) == (sync == "every") for p in model.parameters())
    accumulate_gradients(spec.loss_fn, model, [last], total=4)
    for p, q in zip(model.parameters(), whole.module.parameters(), strict=True):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize(("reshard", "sync"), [(False, "every")])  # the defaults: test_sharding
def test_the_knobs_change_what_a_rank_holds_and_not_the_gradients(tmp_path, reshard, sync):
    spawn_ranks(_knobs_rank, (reshard, sync), nprocs=2, rendezvous=tmp_path / "pg")


@pytest.mark.parametrize("sampler", ["grid", "model"])
def test_predicted_configurations_are_never_proposed_nor_counted_and_survive_a_resume(
    tmp_path, sampler
):
    from ray.tune.search import Searcher

    from mbtune.lattice import enumerate_configs
    from mbtune.runs.rundir import RunDir
    from mbtune.search import METRIC, make_searcher

    points = enumerate_configs(mode="auto", batch_sizes=[32], num_devices=[1, 2])
    over = [c for c in points if c.micro_batch_size >= 8]  # predicted out of memory
    run = RunDir.create(tmp_path, "r")
    records = [
        TrialRecord(trial=i, status="oom", reason="predicted: peak memory ...", **c.sizes())
        for i, c in enumerate(over, start=1)
    ]
    for record in records:
        run.append_trial(record)
    searcher = make_searcher(sampler, points, seed=0, ledger=run.trials_file, budget=3)
    searcher.add_predicted(records)
    path = str(tmp_path / "state.pkl")
    searcher.save(path)
    restored = make_searcher(sampler, points, seed=0, ledger=run.trials_file, budget=3)
    restored.restore(path)  # the ledger's predicted rows again: learnt once
    assert len(restored.observations) == len(over) and not restored.finished_ids
    measured = []
    for i in range(10):
        params = restored.suggest(f"t{i}")
        if params == Searcher.FINISHED:
            break
        config = BatchConfig.from_mapping(params)
        measured.append(config)
        restored.on_trial_complete(f"t{i}", {METRIC: 100.0 * config.micro_batch_size})
    assert len(measured) == 3  # the budget: predicted ones are no trial of it
    assert not set(measured) & set(over)
