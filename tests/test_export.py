"""Exports: every snippet, read back as its framework reads it, obeys that framework's rule."""

import ast
import json
import shlex

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from mbtune.errors import MbtuneError
from mbtune.export import FRAMEWORKS, export_config, expressible
from mbtune.lattice import BatchConfig, num_microbatches

# ---------------------------------------------------------------------------
# each framework's snippet, read back the way the framework reads it, and its rule


def cerebras(text: str, n: int) -> dict:
    data = yaml.safe_load(text)
    b, m = data["train_input"]["batch_size"], data["train_input"]["micro_batch_size"]
    num_csx = data["runconfig"]["num_csx"]
    # Cerebras: batch_size / num_csx must be a whole number and a multiple of micro_batch_size
    assert num_csx == n and b % num_csx == 0 and (b // num_csx) % m == 0
    return {"batch_size": b, "micro_batch_size": m}


def composer(text: str, n: int) -> dict:
    data = yaml.safe_load(text)
    b, m = data["global_train_batch_size"], data["device_train_microbatch_size"]
    # Composer: the global batch is divisible by the world size; a microbatch fits a device
    assert b % n == 0 and 1 <= m <= b // n
    return {"batch_size": b, "micro_batch_size": m}


def deepspeed(text: str, n: int) -> dict:
    data = json.loads(text)
    b, m = data["train_batch_size"], data["train_micro_batch_size_per_gpu"]
    g = data["gradient_accumulation_steps"]
    # DeepSpeed: train_batch_size = micro-batch per GPU x accumulation x world size
    assert b == m * g * n
    return {"batch_size": b, "micro_batch_size": m}


def hf(text: str, n: int) -> dict:
    data = json.loads(text)
    m, g = data["per_device_train_batch_size"], data["gradient_accumulation_steps"]
    assert set(data) == {"per_device_train_batch_size", "gradient_accumulation_steps"}
    # Hugging Face: the effective batch is per_device x accumulation x number of devices
    return {"batch_size": m * g * n, "micro_batch_size": m}


def lightning(text: str, n: int) -> dict:
    calls = {
        node.func.id: {k.arg: k.value.value for k in node.keywords}
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    devices = calls["Trainer"]["devices"]
    g, m = calls["Trainer"]["accumulate_grad_batches"], calls["DataLoader"]["batch_size"]
    # Lightning: the loader batch (per process) x accumulate_grad_batches x devices
    assert devices == n
    return {"batch_size": m * g * devices, "micro_batch_size": m}


def megatron(text: str, n: int) -> dict:
    args = [a for line in text.splitlines() if not line.startswith("#") for a in shlex.split(line)]
    values = dict(zip(args[::2], args[1::2], strict=True))
    m, b = int(values["--micro-batch-size"]), int(values["--global-batch-size"])
    # Megatron: global batch divisible by micro-batch x data-parallel size (raises otherwise)
    assert b % (m * n) == 0 and num_microbatches(b, n, m) * m * n == b
    return {"batch_size": b, "micro_batch_size": m}


READ_BACK = {f.__name__: f for f in (cerebras, composer, deepspeed, hf, lightning, megatron)}


def test_every_framework_has_a_rule_check():
    assert set(READ_BACK) == set(FRAMEWORKS)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_an_even_configuration_is_exported_as_measured(framework):
    config = BatchConfig(64, 2, 4)  # per device 32 as 8 micro-batches of 4
    export = export_config(framework, config, header="from a test")
    assert READ_BACK[framework](export.text, 2) == {"batch_size": 64, "micro_batch_size": 4}
    assert export.config == config
    assert export.filename.startswith(f"export-{framework}.")
    assert not [n for n in export.notes if "exported" in n]  # nothing changed
    if framework in ("deepspeed", "hf"):
        assert "from a test" not in export.text  # JSON has no comments
    else:
        assert "# from a test" in export.text


@pytest.mark.parametrize("framework", [f for f in FRAMEWORKS if f != "composer"])
def test_an_uneven_micro_batch_split_becomes_the_nearest_expressible_batch(framework):
    config = BatchConfig(30, 2, 4)  # per device 15 as 4+4+4+3
    export = export_config(framework, config)
    assert READ_BACK[framework](export.text, 2) == {"batch_size": 32, "micro_batch_size": 4}
    assert any(
        "batch_size 30 on 2 devices with micro_batch_size 4 splits unevenly (per device 15 as "
        "4+4+4+3): exported the nearest batch_size it can express, 32" in note
        for note in export.notes
    )


def test_composer_expresses_an_uneven_micro_batch_split_and_says_how_it_differs():
    export = export_config("composer", BatchConfig(20, 2, 4))  # per device 10 as 4+3+3
    assert composer(export.text, 2) == {"batch_size": 20, "micro_batch_size": 4}
    assert any("as 4+4+2 where mbtune measured 4+3+3" in note for note in export.notes)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_uneven_devices_are_never_expressible(framework):
    export = export_config(framework, BatchConfig(33, 2, 4))  # devices get 17 and 16
    b = READ_BACK[framework](export.text, 2)["batch_size"]
    assert b in (32, 34) and b % 2 == 0
    assert any("per device 17 or 16" in note for note in export.notes)


def test_a_micro_batch_size_is_exported_as_the_one_that_ran():
    exported, notes = expressible("deepspeed", BatchConfig(16, 2, 5))  # 8 as 2 x 4
    assert exported == BatchConfig(16, 2, 4)
    assert notes == [
        "micro_batch_size 5 runs the per-device batch 8 as 2 micro-batches of at most 4: "
        "exported as micro_batch_size 4 (the same measurement)"
    ]


def test_the_runs_recommended_global_batch_is_used_where_it_is_expressible():
    exported, notes = expressible("hf", BatchConfig(30, 2, 4), recommended_batch_size=40)
    assert exported == BatchConfig(40, 2, 4)
    assert "batch_size 40 is the run's recommended global batch" in notes[0]
    exported, _ = expressible("hf", BatchConfig(30, 2, 4), recommended_batch_size=42)
    assert exported == BatchConfig(32, 2, 4)  # 42 is not a multiple of 2 x 4: nearest


def test_megatron_pipeline_stages():
    export = export_config("megatron", BatchConfig(64, 2, 4), pipeline_stages=4)
    assert "--pipeline-model-parallel-size 4" in export.text
    assert megatron(export.text, 2) == {"batch_size": 64, "micro_batch_size": 4}
    assert "launch on 2 data-parallel devices x 4 pipeline stages (8 in all)" in export.notes


def test_an_unknown_framework():
    with pytest.raises(MbtuneError, match=r"unknown framework 'keras'; valid: cerebras, composer"):
        export_config("keras", BatchConfig(8, 1, 2))


@st.composite
def configs(draw):
    n = draw(st.integers(1, 8))
    b = draw(st.integers(n, 300))
    m = draw(st.integers(1, -(-b // n)))
    return BatchConfig(b, n, m)


@settings(max_examples=300, deadline=None)
@given(config=configs(), framework=st.sampled_from(FRAMEWORKS))
def test_every_export_obeys_its_frameworks_rule(config, framework):
    export = export_config(framework, config)
    read = READ_BACK[framework](export.text, config.num_devices)
    m = config.canonical_micro_batch_size
    assert read["micro_batch_size"] == m  # the micro-batch that ran, and the same devices
    assert read["batch_size"] == export.config.batch_size
    if BatchConfig(config.batch_size, config.num_devices, m).is_strict:
        assert export.config.batch_size == config.batch_size  # nothing to change
    # no batch size the framework accepts for (n, m) is nearer than the exported one
    step = config.num_devices * (1 if framework == "composer" else m)
    distance = abs(export.config.batch_size - config.batch_size)
    for other in range(max(step, config.batch_size - distance + 1), config.batch_size + distance):
        if other % step == 0 and other // config.num_devices >= m:
            pytest.fail(f"{other} is nearer to {config.batch_size} than {export.config}")
