"""The experiment config: every key parsed, every bad input a one-line ConfigError."""

import contextlib
import dataclasses
import pickle
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mbtune.config.experiment import Experiment
from mbtune.config.load import (
    apply_overrides,
    load_experiment,
    parse_experiment,
)
from mbtune.config.rules import ConfigError, parse_memory
from mbtune.config.schema import LinkTier, ModelConfig, PlanConfig, RayConfig
from mbtune.config.search import DEFAULT_SPACE, IntRange, SearchConfig, SpaceConfig, StartPoint
from mbtune.config.train_input import TrainInput
from mbtune.config.trial import TrialConfig
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.runs.load import load_run_experiment
from mbtune.runs.rundir import RunDir

ROOT = Path(__file__).resolve().parent.parent


def make(**sections):
    raw = {"name": "t", "model": {"name": "mlp"}, "train_input": {"batch_size": 32}}
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(raw.get(key), dict):
            raw[key] = {**raw[key], **value}
        else:
            raw[key] = value
    return parse_experiment(raw)


def test_every_key_is_read():
    exp = make(
        model={"name": "gpt", "n_layer": 3, "seq_len": 32},
        train_input={
            "batch_size": 64,
            "micro_batch_size": 8,
            "num_devices": 2,
            "allow_uneven": False,
            "pipeline_stages": 2,  # the old name: n counted the data-parallel devices
        },
        search={
            "space": {"num_devices": [4, 2, 4], "batch_size": {"min": 32, "max": 128}},
            "sampler": "GP",
            "objective": "samples_per_s_per_device",
            "num_samples": 7,
            "time_budget_s": 60,
            "confidence_target": 95,
            "seed": 3,
        },
        trial={
            "backend": "torch",
            "noise": 0.03,
            "device": "cpu",
            "parallel": "simulate",
            "compile": False,
            "warmup_steps": 0,
            "measure_steps": 9,
            "device_memory": "8GiB",
            "timeout_s": 30,
        },
        ray={
            "address": "auto",
            "dashboard": True,
            "cpus_per_trial": 0.5,
            "gpus_per_trial": 1,
            "max_concurrent_trials": 2,
        },
        output_dir="out",
    )
    assert exp.model.name == "gpt" and exp.model.options == {"n_layer": 3, "seq_len": 32}
    t = exp.train_input
    assert (t.batch_size, t.micro_batch_size, t.num_devices, t.pipeline_parallel) == (64, 8, 4, 2)
    assert t.config == BatchConfig(64, 4, 8, pipeline_parallel=2)
    s = exp.search
    assert s.space.num_devices == (2, 4) and s.space.batch_size == IntRange(32, 128)
    assert (s.sampler, s.objective, s.num_samples, s.time_budget_s) == (
        "gp", "samples_per_s_per_device", 7, 60
    )  # fmt: skip
    assert (s.confidence_target, s.seed) == (95, 3)
    tr = exp.trial
    assert (tr.noise, tr.device, tr.compile, tr.warmup_steps, tr.measure_steps) == (
        0.03, "cpu", False, 0, 9
    )  # fmt: skip
    assert tr.device_memory == 8 * 2**30 and tr.timeout_s == 30
    r = exp.ray
    assert (r.address, r.dashboard, r.cpus_per_trial, r.gpus_per_trial) == ("auto", True, 0.5, 1)
    assert r.max_concurrent_trials == 2
    assert exp.output_dir == Path("out")
    # B = d x m x g in 32..128 with m = 8 on one or two replicas of 2 stages
    assert [(c.batch_size, c.num_devices) for c in exp.configs()] == [
        (32, 2), (40, 2), (48, 2), (56, 2), (64, 2), (72, 2), (80, 2), (88, 2), (96, 2),
        (104, 2), (112, 2), (120, 2), (128, 2), (32, 4), (48, 4), (64, 4), (80, 4), (96, 4),
        (112, 4), (128, 4),
    ]  # fmt: skip


def test_defaults():
    exp = make()
    assert exp.train_input.micro_batch_size == "auto" and exp.train_input.num_devices == 1
    assert exp.search.sampler == "model" and exp.search.confidence_target == 90
    assert exp.search.space.source == "default"
    assert exp.trial.backend == "torch" and exp.trial.compile is True
    assert exp.trial.device_memory is None and exp.ray.address is None
    assert [c.micro_batch_size for c in exp.configs()] == [1, 2, 4, 8, 16, 32]


@pytest.mark.parametrize(
    ("trial", "ray", "gpus"),
    [
        ({"device": "cuda"}, {}, 1),
        ({"device": "cuda", "parallel": "ddp"}, {}, 1),
        ({"device": "cpu"}, {}, 0),
        ({"device": "auto"}, {}, 0),
        ({"device": "cpu"}, {"gpus_per_trial": 1}, 1),
        ({"device": "cuda"}, {"gpus_per_trial": 2}, 2),
    ],
)
def test_gpus_per_trial_follows_the_device_unless_it_is_set(trial, ray, gpus):
    exp = make(trial=trial, ray=ray)
    assert exp.ray.gpus_per_trial == ray.get("gpus_per_trial")
    assert exp.gpus_per_trial == gpus


def test_drift_and_max_repeats_are_read_with_their_defaults(tmp_path):
    table = tmp_path / "t.csv"
    table.write_text("batch_size,num_devices,micro_batch_size,samples_per_s\n32,1,32,10\n")
    assert (make().trial.drift, make().search.max_repeats) == (0.0, 5)
    exp = make(
        trial={"backend": "replay", "table": str(table), "drift": 0.035},
        search={"max_repeats": 1},
    )
    assert (exp.trial.drift, exp.search.max_repeats) == (0.035, 1)
    again = parse_experiment(exp.to_dict())
    assert (again.trial, again.search.max_repeats) == (exp.trial, 1)


def test_the_modelled_link_defaults_to_the_trial_device_and_each_part_can_be_set():
    from mbtune.config.trial import LINKS

    default = make().trial
    assert default.link("cpu") == (LINKS["cpu"][0], LINKS["cpu"][1] * 1e-6)
    assert default.link("cuda") == (LINKS["cuda"][0], LINKS["cuda"][1] * 1e-6)
    assert LINKS["cpu"] != LINKS["cuda"]
    bandwidth_only = make(trial={"link_bandwidth": "1GB"}).trial
    assert bandwidth_only.link("cuda") == (10**9, LINKS["cuda"][1] * 1e-6)
    both = make(trial={"link_bandwidth": "1GB", "link_latency_us": 50}).trial
    assert both.link("cpu") == (10**9, pytest.approx(50e-6))
    assert (
        parse_experiment(make(trial={"link_latency_us": 50}).to_dict()).trial
        == make(trial={"link_latency_us": 50}).trial
    )  # the run directory's experiment.yaml keeps "not set" as not set


def test_num_csx_is_an_alias_of_num_devices():
    exp = make(train_input={"batch_size": 64, "num_csx": 4})
    assert exp.train_input.num_devices == 4


@pytest.mark.parametrize(
    ("value", "expected"),
    [("8GiB", 8 * 2**30), ("512MB", 512 * 10**6), ("1.5 GB", 1_500_000_000), (4096, 4096),
     ("100", 100), ("2kib", 2048)],
)  # fmt: skip
def test_parse_memory(value, expected):
    assert parse_memory(value) == expected


@pytest.mark.parametrize("value", ["8 parsecs", "-1GB", 0, True, [1], "GiB", 1.5])
def test_parse_memory_rejects(value):
    with pytest.raises(ConfigError, match=r"^trial\.device_memory: .*(memory size|positive)"):
        parse_memory(value)


def test_modes_are_read_case_insensitively():
    assert make(train_input={"micro_batch_size": "Explore"}).train_input.mode == "explore"
    assert make(train_input={"micro_batch_size": "none"}).train_input.config == BatchConfig(
        32, 1, 32
    )


def test_named_space_and_path_space(tmp_path):
    assert make(search={"space": "powers_of_two"}).search.space.micro_batch_size[:3] == (1, 2, 4)
    space = tmp_path / "s.yaml"
    space.write_text("num_devices: [1, 2]\n")
    exp_file = tmp_path / "e.yaml"
    exp_file.write_text("model: mlp\ntrain_input: {batch_size: 8}\nsearch: {space: s.yaml}\n")
    exp = load_experiment(exp_file)
    assert exp.name == "e" and exp.search.space.num_devices == (1, 2)


def test_replay_table_is_relative_to_the_experiment(tmp_path):
    f = tmp_path / "e.yaml"
    f.write_text("model: mlp\ntrain_input: {batch_size: 8}\ntrial: {backend: replay, table: t.csv}")
    assert load_experiment(f).trial.table == tmp_path / "t.csv"


def test_overrides():
    raw = {"model": {"name": "mlp"}, "train_input": {"batch_size": 32}}
    out = apply_overrides(raw, ["train_input.batch_size=128", "search.space.num_devices=[1, 2]"])
    assert out["train_input"]["batch_size"] == 128
    assert out["search"]["space"]["num_devices"] == [1, 2]
    assert raw["train_input"]["batch_size"] == 32  # the input is left alone
    with pytest.raises(ConfigError, match=r"^--set: expected KEY\.PATH=VALUE"):
        apply_overrides(raw, ["train_input.batch_size"])


def test_the_plan_section_is_read_with_its_tier_defaults_and_round_trips():
    assert make().plan is None
    raw = apply_overrides(
        {"name": "t", "model": "mlp", "train_input": {"batch_size": 32}},
        ["plan.samples=1e9", "plan.num_devices=[64, 8]", "plan.inter_node.bandwidth=25GB",
         "plan.price_per_device_hour=2.5"],
    )  # fmt: skip
    exp = parse_experiment(raw)
    plan = exp.plan
    assert plan.samples == 1e9 and plan.num_devices == (8, 64) and plan.max_slowdown == 0.1
    assert plan.price_per_device_hour == 2.5 and plan.devices_per_node == 8
    intra, inter = plan.links()
    assert intra == (370e9, 5e-6, 0.3)  # INTRA_NODE
    assert inter == (25e9, 10e-6, 0.3)  # the rest: INTER_NODE
    assert parse_experiment(exp.to_dict()).plan == plan
    assert make(plan={"steps": "2e5"}).plan.steps == 200_000


def test_resolved_experiment_round_trips():
    exp = parse_experiment(
        {"name": "x", "model": {"name": "gpt", "n_layer": 1}, "train_input": {"batch_size": 8},
         "search": {"space": {"micro_batch_size": [1, 2]}}}
    )  # fmt: skip
    again = parse_experiment(exp.to_dict())
    assert again.configs() == exp.configs()
    assert again.model == exp.model and again.train_input == exp.train_input


def test_shipped_experiments_are_valid():
    for path in sorted((ROOT / "experiments").glob("*.yaml")):
        exp = load_experiment(path)
        assert exp.configs(), path


# -- bad input: one ConfigError per rule, naming the field -----------------------

BAD = [
    ({"train_input": {"batch_size": 0}}, r"^train_input\.batch_size: 0 is out of range; "
     r"expected a whole number from 1 to"),
    ({"train_input": {"batch_size": -4}}, r"^train_input\.batch_size: -4 is out of range"),
    ({"train_input": {"batch_size": "64"}}, r"^train_input\.batch_size: expected a whole "
     r"number .*, got '64'"),
    ({"train_input": {"batch_size": 2, "num_devices": 4}}, r"^train_input\.batch_size: "
     r"batch_size 2 is smaller than num_devices 4"),
    ({"train_input": {"batch_size": 64, "micro_batch_size": 5, "num_devices": 2}},
     r"^train_input\.micro_batch_size: micro_batch_size 5 does not divide the per-device "
     r"batch 32 .*60 \(below\) or 70 \(above\); valid micro_batch_size for batch_size 64: "
     r"1, 2, 4, 8, 16, 32 \(or set allow_uneven: true\)$"),
    # the nearest batch sizes are valid for the micro-batch size too (were 99 and 102)
    ({"train_input": {"batch_size": 100, "num_csx": 3, "micro_batch_size": 4}},
     r"^train_input\.batch_size: batch_size 100 is not divisible by num_devices 3; nearest "
     r"valid batch_size for micro_batch_size 4: 96 \(below\) or 108 \(above\); valid "
     r"num_devices for batch_size 100 and micro_batch_size 4: 1, 5, 25 \(or set "
     r"allow_uneven: true\)$"),
    ({"train_input": {"batch_size": 65, "num_devices": 2}}, r"^train_input\.batch_size: "
     r"batch_size 65 is not divisible by num_devices 2; nearest valid batch_size: 64 \(below\)"
     r" or 66 \(above\); valid num_devices for batch_size 65: 1, 5, 13, 65$"),  # auto tries
    # divisors of P only: allow_uneven is no way out
    ({"train_input": {"batch_size": 64, "num_csx": 2, "num_devices": 2}},
     r"^train_input\.num_csx: give num_devices or its Cerebras alias num_csx, not both"),
    ({"train_input": {"batch_size": 64, "micro_batch_size": "automatic"}},
     r"^train_input\.micro_batch_size: expected a whole number .*or 'auto', 'explore' or "
     r"'none', got 'automatic'"),
    ({"train_input": {"batch_size": 8, "micro_batch_size": 16}},
     r"^train_input\.micro_batch_size: micro_batch_size 16 exceeds the per-device batch 8"),
    ({"train_input": {"batch_sise": 8}}, r"^train_input\.batch_sise: unknown key; valid keys: "
     r".*\(did you mean 'batch_size'\?\)"),
    ({"trainput": {}}, r"^trainput: unknown key; .*\(did you mean 'train_input'\?\)"),
    # another tuner's name for the number of trials: mbtune's, not the nearest spelling
    ({"search": {"max_trials": 8}}, r"^search\.max_trials: unknown key; .*\(did you mean "
     r"'num_samples'\?\)$"),
    ({"search": {"sampler": "tpee"}}, r"^search\.sampler: 'tpee' is not one of: tpe, gp, "
     r"random, model, grid, halving, doubling \(did you mean 'tpe'\?\)"),
    ({"search": {"objective": "speed"}}, r"^search\.objective: 'speed' is not one of"),
    ({"search": {"confidence_target": 101}}, r"^search\.confidence_target: 101 is out of "
     r"range; expected a whole number from 1 to 100"),
    ({"search": {"space": "nope"}}, r"^search\.space: unknown space 'nope'; valid: "
     r"data_parallel, default, powers_of_two"),
    ({"search": {"space": {"micro_batch_size": []}}}, r"^search\.space\.micro_batch_size: the "
     r"list is empty"),
    ({"search": {"space": {"micro_batch_size": {"min": 8, "max": 2}}}},
     r"^search\.space\.micro_batch_size: min 8 is greater than max 2"),
    ({"search": {"space": {"micro_batch_size": [64, 128]}}}, r"^search\.space: no valid "
     r"configuration: micro_batch_size 'auto', batch_size 32, num_devices 1, space "
     r"micro_batch_size \[64, 128\]"),
    ({"search": {"space": {"batch_size": {"min": 1, "max": 9}}}}, r"^search\.space: a "
     r"batch_size range needs micro_batch_size listed in the space in mode 'auto'"),
    ({"search": {"space": {"num_devices": [64]}}}, r"^search\.space: no valid configuration"),
    ({"trial": {"backend": "jax"}}, r"^trial\.backend: 'jax' is not one of: torch, replay"),
    ({"trial": {"backend": "replay"}}, r"^trial\.table: the replay backend needs trial\.table"),
    ({"trial": {"device": "tpu"}}, r"^trial\.device: 'tpu' is not one of: auto, cpu, cuda"),
    ({"trial": {"compile": "yes"}}, r"^trial\.compile: expected true or false, got 'yes'"),
    ({"trial": {"measure_steps": 0}}, r"^trial\.measure_steps: 0 is out of range"),
    ({"trial": {"noise": float("nan")}}, r"^trial\.noise: expected a number from 0.0 to 1.0"),
    ({"trial": {"drift": 1.0}}, r"^trial\.drift: 1\.0 is out of range; expected a number from "
     r"0\.0 up to \(not including\) 1\.0$"),
    ({"trial": {"drift": 0.03}}, r"^trial\.drift: drift 0\.03 applies to replayed trials only, "
     r"and trial\.table is not set"),
    ({"search": {"max_repeats": 0}}, r"^search\.max_repeats: 0 is out of range; expected a whole "
     r"number from 1"),
    ({"trial": {"device_memory": "lots"}}, r"^trial\.device_memory: 'lots' is not a memory "
     r"size"),
    ({"ray": {"max_concurrent_trials": 0}}, r"^ray\.max_concurrent_trials: 0 is out of range"),
    ({"model": {"name": "gtp"}}, r"^model\.name: unknown model 'gtp'; valid: gpt, mlp, cnn_bn,"
     r" or package\.module:function \(did you mean 'gpt'\?\)"),
    # a user model's name is held to the builder's rule here, before any trial runs
    ({"model": {"name": "pkg..mod:f"}}, r"^model\.name: 'pkg\.\.mod:f' is not of the form "
     r"package\.module:function \(Python names joined by dots, a colon, a function's name\); "
     r"valid: gpt, mlp, cnn_bn, or package\.module:function$"),
    ({"model": {"name": "mlp", "hiden": 3}}, r"^model\.hiden: unknown option for model 'mlp'"
     r"; valid: .*\(did you mean 'hidden'\?\)"),
    ({"model": {"name": "mlp", "hidden": 0}}, r"^model\.hidden: must be a positive integer"),
    ({"model": {"name": "gpt", "d_model": 130}}, r"^model\.d_model: must be divisible by "
     r"model\.n_head"),
    ({"model": 3}, r"^model: this section must be a mapping of keys, got int"),
    ({"name": "a b"}, r"^name: 'a b' is not a valid name"),
    ({"train_input": {"batch_size": 64, "micro_batch_size": "explore", "num_devices": 2,
                      "pipeline_parallel": 2}},
     r"^train_input\.pipeline_parallel: pipeline_parallel 2 cannot explore uneven "
     r"micro-batches; set micro_batch_size: auto or none, or set tensor_parallel: 1 and "
     r"pipeline_parallel: 1$"),
    ({"train_input": {"batch_size": 65, "num_devices": 4, "micro_batch_size": 4,
                      "allow_uneven": True, "pipeline_parallel": 2}},
     r"^train_input\.allow_uneven: uneven splits cannot be split over a model's devices: .*; "
     r"set allow_uneven: false with nearest valid batch_size for micro_batch_size 4: 64 "
     r"\(below\) or 72 \(above\), or set tensor_parallel: 1 and pipeline_parallel: 1$"),
    ({"train_input": {"batch_size": 64, "num_devices": 3, "tensor_parallel": 2}},
     r"^train_input\.num_devices: num_devices 3 is not a multiple of tensor_parallel 2 x "
     r"pipeline_parallel 1 = 2; valid num_devices for batch_size 64: 2, 4, 8, 16, 32, 64, 128$"),
    ({"train_input": {"batch_size": 64, "num_devices": 4, "pipeline_parallel": 2,
                      "micro_batch_size": 64}},
     r"^train_input\.micro_batch_size: micro_batch_size 64 exceeds the per-device batch 32 "
     r"\(batch_size 64 / the 2 data-parallel replicas \(num_devices 4 / \(tensor_parallel x "
     r"pipeline_parallel 2\)\)\)"),
    ({"train_input": {"batch_size": 64, "num_devices": 2, "pipeline_parallel": 2,
                      "micro_batch_size": 64}, "trial": {"pipeline_schedule": "dualpipev"}},
     r"^trial\.pipeline_schedule: dualpipev with pipeline_parallel 2 needs at least 4 "
     r"micro-batches per step, and this configuration has 1$"),
    ({"trial": {"pipeline_schedule": "looped"}}, r"^trial\.pipeline_schedule: "),
    ({"train_input": {"batch_size": 8, "pipeline_stages": 2, "pipeline_parallel": 2}},
     r"^train_input\.pipeline_stages: give pipeline_parallel or its old name"),
    ({"train_input": {"batch_size": 2**40}}, r"^train_input\.batch_size: .* out of range"),
]  # fmt: skip


@pytest.mark.parametrize(("sections", "message"), BAD)
def test_bad_input_is_one_line_naming_the_field(sections, message):
    with pytest.raises(MbtuneError, match=message) as info:
        make(**sections)
    assert "\n" not in str(info.value)


def test_missing_sections_are_named():
    with pytest.raises(ConfigError, match=r"^train_input: required key is missing"):
        parse_experiment({"name": "x", "model": "mlp"})
    with pytest.raises(ConfigError, match=r"^the experiment must be a mapping|^: "):
        parse_experiment([1, 2])
    with pytest.raises(ConfigError, match=r"^name: required key is missing"):
        parse_experiment({"model": "mlp", "train_input": {"batch_size": 1}})


def test_file_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"experiment file not found: .*nope\.yaml"):
        load_experiment(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1,\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: invalid YAML at line \d+, column \d+"):
        load_experiment(bad)
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00\x01")
    with pytest.raises(ConfigError, match=r"not a text file"):
        load_experiment(binary)
    with pytest.raises(ConfigError, match=r"is a directory"):
        load_experiment(tmp_path)


# -- the dataclasses refuse what the YAML refuses, with the same message ---------


def exp(**sections):
    """An Experiment built in code (mlp, B = 32), with ``sections`` replaced."""
    base = {"name": "t", "model": ModelConfig(name="mlp"), "train_input": TrainInput(batch_size=32)}
    return Experiment(**{**base, **sections})


DDP = TrialConfig(parallel="ddp")

# (a class, the keywords that break one of its rules): one line per rule
RULES = [
    (TrainInput, dict(batch_size=0)),
    (TrainInput, dict(batch_size="64")),
    (TrainInput, dict(batch_size=8, num_devices=0)),
    (TrainInput, dict(batch_size=2, num_devices=4)),
    (TrainInput, dict(batch_size=30, num_devices=4)),
    (TrainInput, dict(batch_size=16, micro_batch_size=3)),
    (TrainInput, dict(batch_size=8, micro_batch_size=16)),
    (TrainInput, dict(batch_size=8, micro_batch_size="most")),
    (TrainInput, dict(batch_size=8, allow_uneven="yes")),
    (TrainInput, dict(batch_size=8, pipeline_parallel=0)),
    (
        TrainInput,
        dict(batch_size=64, num_devices=2, micro_batch_size="explore", pipeline_parallel=2),
    ),
    (
        TrainInput,
        dict(
            batch_size=65, num_devices=4, micro_batch_size=4, allow_uneven=True, pipeline_parallel=2
        ),
    ),
    (TrainInput, dict(batch_size=8, num_devices=3, tensor_parallel=2)),
    (TrainInput, dict(batch_size=8, tensor_parallel=0)),
    (SpaceConfig, dict(tensor_parallel=(0,))),
    (SpaceConfig, dict(pipeline_parallel=())),
    (SpaceConfig, dict(pipeline_schedule=("looped",))),
    (TrialConfig, dict(pipeline_schedule="looped")),
    (ModelConfig, dict(name="")),
    (ModelConfig, dict(name="gtp")),
    (ModelConfig, dict(name="pkg..mod:f")),
    (ModelConfig, dict(name="mlp", options={"hiden": 3})),
    (ModelConfig, dict(name="gpt", options={"d_model": 130})),
    (ModelConfig, dict(name="hf:gpt2", options={"task": "chat"})),
    (ModelConfig, dict(name="m:f", options={"checkpoint_blocks": 3})),
    (IntRange, dict(min=8, max=2)),
    (IntRange, dict(min=0, max=2)),
    (IntRange, dict(min=1, max=10**6)),
    (SpaceConfig, dict(num_devices=())),
    (SpaceConfig, dict(num_devices=(0, 1))),
    (SpaceConfig, dict(micro_batch_size="all")),
    (SpaceConfig, dict(batch_size="all")),
    (SpaceConfig, dict(activation_checkpointing=())),
    (SpaceConfig, dict(reshard_after_forward=("yes",))),
    (SpaceConfig, dict(grad_sync=("last", "sometimes"))),
    (SpaceConfig, dict(grad_sync=())),
    (SearchConfig, dict(sampler="bogus")),
    (SearchConfig, dict(objective="speed")),
    (SearchConfig, dict(num_samples=0)),
    (SearchConfig, dict(time_budget_s=-1)),
    (SearchConfig, dict(confidence_target=101)),
    (SearchConfig, dict(noise_floor=2)),
    (SearchConfig, dict(seed=-1)),
    (SearchConfig, dict(max_repeats=0)),
    (SearchConfig, dict(predict_memory="yes")),
    (StartPoint, dict(batch_size=1, num_devices=2, micro_batch_size=1)),
    (StartPoint, dict(batch_size=32, micro_batch_size=0)),
    (TrialConfig, dict(backend="nonsense")),
    (TrialConfig, dict(table=Path("a\0b"))),
    (TrialConfig, dict(noise=1.5)),
    (TrialConfig, dict(drift=1.0)),
    (TrialConfig, dict(drift=0.03)),
    (TrialConfig, dict(device="tpu")),
    (TrialConfig, dict(parallel="fsdp")),
    (TrialConfig, dict(sharding="zero3")),
    (TrialConfig, dict(sharding="fsdp", parallel="ddp", precision="fp16", device="cuda")),
    (TrialConfig, dict(sharding="fsdp", parallel="simulate", precision="fp16", device="cuda")),
    (TrialConfig, dict(reshard_after_forward=False)),
    (TrialConfig, dict(grad_sync="every")),
    (TrialConfig, dict(grad_sync="sometimes", sharding="fsdp", parallel="ddp")),
    (TrialConfig, dict(reshard_after_forward="no", sharding="fsdp", parallel="ddp")),
    (TrialConfig, dict(compile="yes")),
    (TrialConfig, dict(compile_mode="fast")),
    (TrialConfig, dict(dynamic=1)),
    (TrialConfig, dict(warmup_steps=-1)),
    (TrialConfig, dict(measure_steps=0)),
    (TrialConfig, dict(eval="no")),
    (TrialConfig, dict(device_memory=0)),
    (TrialConfig, dict(device_memory=2**61)),
    (TrialConfig, dict(on_oom="retry")),
    (TrialConfig, dict(link_bandwidth=True)),
    (TrialConfig, dict(link_latency_us=-1)),
    (TrialConfig, dict(precision="fp8")),
    (TrialConfig, dict(precision="fp16", device="cpu")),
    (TrialConfig, dict(activation_checkpointing="on")),
    (TrialConfig, dict(peak_tflops=0)),
    (TrialConfig, dict(memory_headroom=0.995)),
    (TrialConfig, dict(timeout_s=0.5)),
    (RayConfig, dict(address="")),
    (RayConfig, dict(dashboard="on")),
    (RayConfig, dict(cpus_per_trial=-1)),
    (RayConfig, dict(resource_wait_s=-1)),
    (RayConfig, dict(gpus_per_trial=-1)),
    (RayConfig, dict(max_concurrent_trials=0)),
    (PlanConfig, dict()),
    (PlanConfig, dict(samples=1.0, steps=2)),
    (PlanConfig, dict(samples=-1.0)),
    (PlanConfig, dict(tokens=0)),
    (PlanConfig, dict(steps=1.5)),
    (PlanConfig, dict(samples=1.0, num_devices=())),
    (PlanConfig, dict(samples=1.0, num_devices=(0, 8))),
    (PlanConfig, dict(samples=1.0, batch_size=0)),
    (PlanConfig, dict(samples=1.0, devices_per_node=0)),
    (PlanConfig, dict(samples=1.0, price_per_device_hour=-1)),
    (PlanConfig, dict(samples=1.0, max_slowdown=-0.1)),
    (PlanConfig, dict(samples=1.0, nccl_tests=3)),
    (LinkTier, dict(bandwidth=0)),
    (LinkTier, dict(latency_us=-1)),
    (LinkTier, dict(uncertainty=5)),
    (Experiment, dict(name="a b")),
    (Experiment, dict(output_dir=Path("a\0b"))),
    (Experiment, dict(trial=TrialConfig(backend="replay"))),
    (Experiment, dict(trial=TrialConfig(parallel="ddp", backend="replay", table=Path("t")))),
    (
        Experiment,
        dict(trial=TrialConfig(parallel="ddp", device="cuda"), ray=RayConfig(gpus_per_trial=0)),
    ),  # fmt: skip
    (Experiment, dict(trial=DDP, ray=RayConfig(cpus_per_trial=0))),
    (Experiment, dict(trial=DDP, ray=RayConfig(gpus_per_trial=0.5))),
    (Experiment, dict(search=SearchConfig(space=SpaceConfig(num_devices=(64,))))),
    (Experiment, dict(search=SearchConfig(start_points=(BatchConfig(32, 1, 5),)))),
    (Experiment, dict(search=SearchConfig(space=SpaceConfig(reshard_after_forward=(True, False))))),
    (Experiment, dict(search=SearchConfig(space=SpaceConfig(grad_sync=("last", "every"))))),
]
SECTIONS = {
    TrainInput: ["train_input"], SearchConfig: ["search"], TrialConfig: ["trial"],
    RayConfig: ["ray"], SpaceConfig: ["search", "space"], ModelConfig: ["model"],
    StartPoint: ["search", "start_points", 0], IntRange: ["search", "space", "micro_batch_size"],
    PlanConfig: ["plan"], LinkTier: ["plan", "intra_node"],
}  # fmt: skip
"""Where the YAML holds each class."""


def as_yaml(value):
    """A value built in code as YAML spells it (a dataclass: the fields it sets)."""
    if isinstance(value, ModelConfig):
        return {"name": value.name, **value.options}
    if dataclasses.is_dataclass(value):
        return {f.name: as_yaml(getattr(value, f.name)) for f in dataclasses.fields(value)
                if not is_default(f, getattr(value, f.name))}  # fmt: skip
    if isinstance(value, dict):
        return {k: as_yaml(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return [as_yaml(v) for v in value]
    return str(value) if isinstance(value, Path) else value


def is_default(f: dataclasses.Field, value) -> bool:
    if f.default is not dataclasses.MISSING:
        return value == f.default
    return f.default_factory is not dataclasses.MISSING and value == f.default_factory()


def from_yaml(cls, keywords):
    """The experiment whose YAML holds ``cls(**keywords)`` in its place."""
    if cls is Experiment:
        return make(**as_yaml(keywords))
    if cls is ModelConfig:
        return make(model={"name": keywords["name"], **keywords.get("options", {})})
    value = as_yaml(keywords)
    for key in reversed(SECTIONS[cls]):
        value = [value] if key == 0 else {key: value}
    return make(**value)


def error_of(build) -> MbtuneError:
    with pytest.raises(MbtuneError) as info:
        build()
    return info.value


@pytest.mark.parametrize(("cls", "keywords"), RULES)
def test_the_dataclasses_refuse_what_the_yaml_refuses_with_the_same_message(cls, keywords):
    in_yaml = error_of(lambda: from_yaml(cls, keywords))
    in_code = error_of(lambda: (exp if cls is Experiment else cls)(**keywords))
    if isinstance(in_code, ConfigError) and in_code.where != in_yaml.where:
        # a value that knows no section (an IntRange, a start point): placed under its field
        assert in_yaml.where.endswith(in_code.where) and in_yaml.rule == in_code.rule
    else:
        assert str(in_yaml) == str(in_code)
    assert "\n" not in str(in_code)


@pytest.mark.parametrize("cls", [*(c for c in SECTIONS if c is not ModelConfig), Experiment])
def test_every_section_refuses_a_key_it_does_not_know(cls):
    # a model's other keys are its options, checked by the model (RULES above)
    required = {"min": 1, "max": 8} if cls is IntRange else {}
    error = error_of(lambda: from_yaml(cls, {**required, "bogus_key": 1}))
    where = ".".join(str(k) for k in SECTIONS.get(cls, [])).replace(".0", "[0]")
    assert isinstance(error, ConfigError)
    assert error.where == (f"{where}.bogus_key" if where else "bogus_key")
    assert error.rule.startswith("unknown key; valid keys: ")


def test_every_field_has_a_rule_above():
    """A field added without a line in RULES fails here."""
    named = {str(error_of(lambda r=r: from_yaml(*r))).split(":")[0] for r in RULES}
    missing = []
    for cls, prefix in [(TrainInput, "train_input"), (SearchConfig, "search"),
                        (SpaceConfig, "search.space"), (TrialConfig, "trial"), (RayConfig, "ray"),
                        (ModelConfig, "model"), (PlanConfig, "plan"),
                        (LinkTier, "plan.intra_node"), (Experiment, "")]:  # fmt: skip
        for f in dataclasses.fields(cls):
            if f.name in ("source", "space", "options", "model", "train_input", "search", "trial",
                          "ray", "intra_node", "inter_node", "model_shape"):  # fmt: skip
                continue
            where = f"{prefix}.{f.name}" if prefix else f.name
            missing += [where] * (not any(n == where or n.startswith((f"{where}[", f"{where}."))
                                          for n in named))  # fmt: skip
    assert not missing


def test_the_default_space_is_search_spaces_default_yaml():
    named = make(search={"space": "default"}).search.space
    assert named == DEFAULT_SPACE == SearchConfig().space == make().search.space


@pytest.fixture
def with_files(tmp_path):
    """An experiment file with a replay table, a space file and a user model."""
    (tmp_path / "table.csv").write_text(
        "batch_size,num_devices,micro_batch_size,samples_per_s\n32,1,8,100\n32,1,16,120\n"
    )
    (tmp_path / "space.yaml").write_text("micro_batch_size: [8, 16]\n")
    path = tmp_path / "e.yaml"
    path.write_text(
        "model: {name: my_models.wide:build, width: 4}\ntrain_input: {batch_size: 32}\n"
        "search: {space: space.yaml, max_repeats: 2}\n"
        "trial: {backend: replay, table: table.csv, drift: 0.02}\n"
    )
    return path


def test_an_experiment_pickles(with_files):
    exp = load_experiment(with_files)
    assert pickle.loads(pickle.dumps(exp)) == exp


def test_a_run_directory_s_experiment_reads_typed_without_its_files(with_files, tmp_path):
    exp = load_experiment(with_files)
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.write_experiment(exp.to_dict())
    (tmp_path / "table.csv").unlink()  # gone: reading the run opens no file it names
    saved = load_run_experiment(run.path)
    assert (saved.model, saved.train_input, saved.trial, saved.ray) == (
        exp.model, exp.train_input, exp.trial, exp.ray
    )  # fmt: skip
    assert saved.configs() == exp.configs() and saved.search.max_repeats == 2
    with pytest.raises(MbtuneError, match=r"^RUN_DIR: .* is not an mbtune run directory"):
        load_run_experiment(tmp_path)


# -- mbtune trial's flags: train_input's rules, naming the flag ------------------


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ((None, None, None), BatchConfig(32, 1, 32)),
        ((64, 2, 8), BatchConfig(64, 2, 8)),
        ((None, None, 4), BatchConfig(32, 1, 4)),
        ((0, None, None), r"^--batch-size: 0 is out of range; expected a whole number from 1"),
        ((None, 0, None), r"^--num-devices: 0 is out of range"),
        # the flag that broke the batch's rule is named, and the device counts it splits over
        ((None, 64, None), r"^--num-devices: batch_size 32 is smaller than "
                           r"num_devices 64: .*; valid num_devices for batch_size 32: 1, 2, 4"),
        ((None, 3, None), r"^--num-devices: batch_size 32 is not divisible by num_devices 3; "
                          r"nearest valid batch_size: 30 \(below\) or 33 \(above\); valid "
                          r"num_devices for batch_size 32: 1, 2, 4, 8, 16, 32 \(or set "
                          r"allow_uneven: true\)$"),
        ((None, 5, 2), r"^--num-devices: batch_size 32 is not divisible by num_devices 5; .*; "
                       r"valid num_devices for batch_size 32 and micro_batch_size 2: 1, 2, 4, 8, "
                       r"16 "),
        ((None, None, 3), r"^--micro-batch-size: micro_batch_size 3 does not divide the "
                          r"per-device batch 32 .*valid micro_batch_size for batch_size 32: 1, "
                          r"2, 4, 8, 16, 32 \(or set allow_uneven: true\)$"),
        ((None, None, 64), r"^--micro-batch-size: micro_batch_size 64 exceeds the per-device "
                           r"batch 32"),
    ],
)  # fmt: skip
def test_trial_flags_are_held_to_train_input_s_rules(flags, expected):
    from mbtune.cli import trial_config

    exp = make()
    if isinstance(expected, BatchConfig):
        assert trial_config(exp, *flags) == expected
    else:
        with pytest.raises(ConfigError, match=expected):
            trial_config(exp, *flags)


def test_trial_flags_may_split_unevenly_where_the_experiment_explores():
    from mbtune.cli import trial_config

    exp = make(train_input={"batch_size": 30, "micro_batch_size": "explore"})
    assert trial_config(exp, None, 4, 3) == BatchConfig(30, 4, 3)
    assert trial_config(exp, None, 4, None) == BatchConfig(30, 4, 8)


@pytest.mark.parametrize(
    ("schedule", "micro"), [("gpipe", 16), ("1f1b", 8), ("dualpipev", 4), ("interleaved_1f1b", 8)]
)
def test_without_a_micro_batch_size_a_pipeline_trial_runs_the_largest_its_schedule_takes(
    schedule, micro
):
    """B 32 over n 4 of p 2: 2 replicas of 16; gpipe runs 1 micro-batch, 1f1b needs 2,
    dualpipev 4, interleaved_1f1b a multiple of 2."""
    from mbtune.cli import trial_config

    exp = make(train_input={"batch_size": 32, "num_devices": 4, "pipeline_parallel": 2},
               trial={"pipeline_schedule": schedule})  # fmt: skip
    assert trial_config(exp, None, None, None) == BatchConfig(
        32, 4, micro, pipeline_parallel=2, pipeline_schedule=schedule
    )
    with pytest.raises(ConfigError, match=r"^--micro-batch-size: ") if micro < 16 else (
        contextlib.nullcontext()
    ):  # fmt: skip
        trial_config(exp, None, None, 16)  # m = P: one micro-batch


# -- the values of a space that leave nothing: named, with why -------------------


@pytest.mark.parametrize(
    ("train_input", "space", "lines"),
    [
        # the issue's case: 3 devices cannot split the quickstart's batch of 32
        ({"batch_size": 32}, {"num_devices": [1, 3]},
         ["num_devices 3: batch_size 32 does not split evenly over 3 devices; valid num_devices "
          "for batch_size 32: 1, 2, 4, 8, 16, 32"]),
        # a range: the values grouped by why, runs named by their ends
        ({"batch_size": 32}, {"num_devices": {"min": 1, "max": 40}},
         ["num_devices 3, 5..7, 9..15, 17..31: batch_size 32 does not split evenly over any of "
          "them; valid num_devices for batch_size 32: 1, 2, 4, 8, 16, 32",
          "num_devices 33..40: more devices than batch_size 32 has samples; valid num_devices "
          "for batch_size 32: 1, 2, 4, 8, 16, 32"]),
        # an explicit micro-batch size: the devices that run it; uneven would run 3 devices
        ({"batch_size": 32, "micro_batch_size": 8}, {"num_devices": [1, 3, 8]},
         ["num_devices 3: batch_size 32 does not split evenly over 3 devices; valid num_devices "
          "for batch_size 32 and micro_batch_size 8: 1, 2, 4 (or set allow_uneven: true)",
          "num_devices 8: micro_batch_size 8 exceeds the per-device batch 4; valid num_devices "
          "for batch_size 32 and micro_batch_size 8: 1, 2, 4"]),
        ({"batch_size": 32}, {"num_devices": [1, 2], "micro_batch_size": [3, 8, 64]},
         ["micro_batch_size 3: not a divisor of any per-device batch (16, 32)",
          "micro_batch_size 64: larger than every per-device batch (16, 32)"]),
        ({"batch_size": 32, "micro_batch_size": "explore"}, {"micro_batch_size": [5, 33]},
         ["micro_batch_size 33: larger than every per-device batch (32)"]),
        ({"batch_size": 32, "micro_batch_size": "none"}, {"num_devices": [1, 2],
                                                          "micro_batch_size": [16, 8]},
         ["micro_batch_size 8: not a per-device batch (16, 32): micro_batch_size none runs "
          "each device's batch as one micro-batch"]),
        ({"batch_size": 32, "micro_batch_size": 4}, {"micro_batch_size": [4, 8]},
         ["micro_batch_size 8: train_input.micro_batch_size 4 is explicit: the space cannot "
          "vary it"]),
        ({"batch_size": 32}, {"batch_size": {"min": 8, "max": 32}, "num_devices": [1, 64],
                              "micro_batch_size": [4, 64]},
         ["num_devices 64: no batch_size in 8..32 is num_devices x micro_batch_size x "
          "micro-batches",
          "micro_batch_size 64: no batch_size in 8..32 is num_devices x micro_batch_size x "
          "micro-batches"]),
        # a range of micro-batch sizes bounds what the mode picks: not each value named
        ({"batch_size": 32}, {"micro_batch_size": {"min": 1, "max": 64}}, []),
        # ... but an explicit micro-batch size leaves it unused as a whole
        ({"batch_size": 32, "micro_batch_size": 8}, {"micro_batch_size": {"min": 1, "max": 32}},
         ["micro_batch_size 1..32: train_input.micro_batch_size 8 is explicit: the space "
          "cannot vary it"]),
    ],
)  # fmt: skip
def test_a_value_of_the_space_that_leaves_nothing_is_named_with_why(train_input, space, lines):
    exp = make(train_input=train_input, search={"space": space})
    assert exp.unused_values() == lines


def test_an_empty_space_says_why_each_value_leaves_nothing():
    with pytest.raises(ConfigError, match=r"^search\.space: no valid configuration: .*; "
                       r"num_devices 3, 5: batch_size 32 does not split evenly over any of them; "
                       r"valid num_devices for batch_size 32: 1, 2, 4, 8, 16, 32$"):  # fmt: skip
        make(search={"space": {"num_devices": [3, 5]}})


def values_named(lines: list[str], key: str) -> set[int]:
    """The values ``unused_values`` names for ``key``: '3, 5..7' as {3, 5, 6, 7}."""
    named: set[int] = set()
    for line in lines:
        if line.startswith(f"{key} "):
            for part in line[len(key) + 1 :].split(": ")[0].split(", "):
                lo, _, hi = part.partition("..")
                named.update(range(int(lo), int(hi or lo) + 1))
    return named


@settings(max_examples=150, deadline=None)
@given(
    batch=st.one_of(st.integers(1, 64), st.tuples(st.integers(1, 40), st.integers(0, 40))),
    mode=st.one_of(st.integers(1, 8), st.sampled_from(["auto", "explore", "none"])),
    ns=st.one_of(st.none(), st.lists(st.integers(1, 12), min_size=1, max_size=5)),
    ms=st.one_of(st.none(), st.lists(st.integers(1, 40), min_size=1, max_size=5)),
    allow_uneven=st.booleans(),
)
def test_every_value_that_leaves_nothing_is_named_and_no_other(batch, mode, ns, ms, allow_uneven):
    space: dict = {"num_devices": ns} if ns else {}
    space |= {"micro_batch_size": ms} if ms else {}
    if isinstance(batch, tuple):
        space["batch_size"] = {"min": batch[0], "max": batch[0] + batch[1]}
    train_input = {"batch_size": batch if isinstance(batch, int) else 64,
                   "micro_batch_size": mode, "allow_uneven": allow_uneven}  # fmt: skip
    try:
        exp = make(train_input=train_input, search={"space": space})
    except ConfigError as e:
        if "no valid configuration" not in e.rule:
            return  # refused for another reason (the user's own sizes, a range without m)
        lines, configs = e.rule.split("; ")[1:], []  # the reasons follow the summary
        lines = [line for line in lines if line.startswith(("num_devices", "micro_batch_size"))]
    else:
        configs = exp.configs()
        lines = exp.unused_values(configs)
    for key, listed in (("num_devices", ns), ("micro_batch_size", ms)):
        present = {getattr(c, key) for c in configs}
        assert values_named(lines, key) == set(listed or ()) - present, lines
