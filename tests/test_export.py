"""Exports: every snippet, read back as its framework reads it, obeys that framework's rule."""

import ast
import builtins
import dataclasses
import functools
import itertools
import json
import re
import shlex
import types
import warnings

import pytest
import torch
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from mbtune.analysis.export import FRAMEWORKS, PRECISIONS, SHARDINGS, export_config, expressible
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig

# ---------------------------------------------------------------------------
# each framework's snippet, read back the way the framework reads it, and its rule


def accelerate(text: str, n: int) -> dict:
    data = yaml.safe_load(text)
    # the script's two lines, in the comment: "# accelerator = Accelerator(...)"
    lines = [line[2:] for line in text.splitlines() if re.match(r"# \w+ = \w+\(", line)]
    script = python_calls("\n".join(lines))
    g, m = script["Accelerator"]["gradient_accumulation_steps"], script["DataLoader"]["batch_size"]
    # Accelerate: the loader batch (per process) x gradient_accumulation_steps x num_processes
    assert data["num_processes"] == n and data["num_machines"] == 1
    return {"batch_size": m * g * n, "micro_batch_size": m}


def torchtitan(text: str, n: int) -> dict:
    data = toml(text)
    b, m = data["training"]["global_batch_size"], data["training"]["local_batch_size"]
    dp = data["parallelism"]
    # torchtitan: the global batch divisible by the local batch x the data-parallel degree
    assert dp["data_parallel_shard_degree"] * dp["data_parallel_replicate_degree"] == n
    assert b % (m * n) == 0
    return {"batch_size": b, "micro_batch_size": m}


def toml(text: str) -> dict:
    """TOML read as torchtitan reads it (Python 3.11's tomllib; skipped on 3.10)."""
    return pytest.importorskip("tomllib").loads(text)


def python_calls(text: str) -> dict[str, dict]:
    """Each call of a name in ``text`` and its keyword arguments that are constants."""
    return {
        node.func.id: {k.arg: k.value.value for k in node.keywords
                       if isinstance(k.value, ast.Constant)}
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }  # fmt: skip


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
    assert set(data) <= HF_KEYS
    # Hugging Face: the effective batch is per_device x accumulation x number of devices
    return {"batch_size": m * g * n, "micro_batch_size": m}


def lightning(text: str, n: int) -> dict:
    calls = python_calls(text)
    devices = calls["Trainer"]["devices"]
    g, m = calls["Trainer"]["accumulate_grad_batches"], calls["DataLoader"]["batch_size"]
    # Lightning: the loader batch (per process) x accumulate_grad_batches x devices
    assert devices == n
    return {"batch_size": m * g * devices, "micro_batch_size": m}


def megatron(text: str, n: int) -> dict:
    values = megatron_args(text)
    m, b = int(values["--micro-batch-size"]), int(values["--global-batch-size"])
    # Megatron: global batch divisible by micro-batch x data-parallel size (raises otherwise)
    assert b % (m * n) == 0
    return {"batch_size": b, "micro_batch_size": m}


def megatron_args(text: str) -> dict[str, str | None]:
    """Megatron's command-line arguments: ``--flag value``, or ``--flag`` alone (None)."""
    args = [a for line in text.splitlines() if not line.startswith("#") for a in shlex.split(line)]
    values: dict[str, str | None] = {}
    for arg in args:
        if arg.startswith("--"):
            values[arg] = None
        else:
            values[list(values)[-1]] = arg
    return values


HF_KEYS = {
    "per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "tf32",
    "activation_checkpointing", "activation_checkpointing_kwargs", "fsdp", "fsdp_config",
}  # fmt: skip

READ_BACK = {
    f.__name__: f
    for f in (accelerate, cerebras, composer, deepspeed, hf, lightning, megatron, torchtitan)
}


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
    elif framework == "accelerate":
        assert export.text.startswith("# from a test\n")
    else:
        assert "# from a test" in export.text


@pytest.mark.parametrize("framework", [f for f in FRAMEWORKS if f != "composer"])
def test_an_uneven_micro_batch_split_becomes_the_nearest_expressible_batch(framework):
    config = BatchConfig(30, 2, 4)  # per device 15 as 4+4+4+3
    export = export_config(framework, config)
    assert READ_BACK[framework](export.text, 2) == {"batch_size": 32, "micro_batch_size": 4}
    assert any(
        "batch_size 30 on 2 devices with micro_batch_size 4 splits unevenly (per device 15 samples "
        "as 4+4+4+3): exported the nearest batch_size it can express, 32" in note
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
    export = export_config("megatron", BatchConfig(64, 8, 4, pipeline_parallel=4))
    assert "--pipeline-model-parallel-size 4" in export.text
    assert megatron(export.text, 2) == {"batch_size": 64, "micro_batch_size": 4}
    assert "launch on 2 data-parallel devices x 4 pipeline stages (8 in all)" in export.notes


def test_an_unknown_framework():
    with pytest.raises(
        MbtuneError, match=r"unknown framework 'keras'; valid: accelerate, cerebras, "
    ):
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


# ---------------------------------------------------------------------------
# the precision and the activation checkpointing measured, in each framework's own keys


def precision_setting(framework: str, text: str) -> object:
    """The framework's own setting of the arithmetic, read back from the snippet."""
    if framework == "accelerate":
        return yaml.safe_load(text)["mixed_precision"]
    if framework == "torchtitan":
        training = toml(text)["training"]
        return training["mixed_precision_param"], training["mixed_precision_reduce"]
    if framework == "cerebras":
        model = yaml.safe_load(text)["model"]
        return model["mixed_precision"], model.get("fp16_type")
    if framework == "composer":
        return yaml.safe_load(text)["precision"]
    if framework == "deepspeed":  # a block that is absent is disabled
        data = json.loads(text)
        return tuple(data.get(k, {"enabled": False})["enabled"] for k in ("bf16", "fp16"))
    if framework == "hf":
        data = json.loads(text)
        return data["bf16"], data["fp16"], data.get("tf32")
    if framework == "lightning":
        (call,) = [c for c in ast.walk(ast.parse(text)) if isinstance(c, ast.Call)
                   and getattr(c.func, "id", None) == "Trainer"]  # fmt: skip
        precision = {k.arg: k.value.value for k in call.keywords}["precision"]
        return precision, 'set_float32_matmul_precision("high")' in text
    return tuple(f for f in ("--bf16", "--fp16") if f in megatron_args(text))


PRECISION_SETTINGS = {
    "accelerate": {"fp32": "no", "tf32": "no", "bf16": "bf16", "fp16": "fp16"},
    "torchtitan": {"fp32": ("float32", "float32"), "tf32": ("float32", "float32"),
                   "bf16": ("bfloat16", "float32"), "fp16": ("float32", "float32")},
    "cerebras": {"fp32": (False, None), "tf32": (False, None), "bf16": (True, "bfloat16"),
                 "fp16": (True, "float16")},
    "composer": {"fp32": "fp32", "tf32": "fp32", "bf16": "amp_bf16", "fp16": "amp_fp16"},
    "deepspeed": {"fp32": (False, False), "tf32": (False, False), "bf16": (True, False),
                  "fp16": (False, True)},
    "hf": {"fp32": (False, False, None), "tf32": (False, False, True),
           "bf16": (True, False, None), "fp16": (False, True, None)},
    "lightning": {"fp32": ("32-true", False), "tf32": ("32-true", True),
                  "bf16": ("bf16-mixed", False), "fp16": ("16-mixed", False)},
    "megatron": {"fp32": (), "tf32": (), "bf16": ("--bf16",), "fp16": ("--fp16",)},
}  # fmt: skip
TF32_NOTE = 'call torch.set_float32_matmul_precision("high") before training'


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_precision_is_in_the_frameworks_own_keys(framework, precision):
    export = export_config(framework, BatchConfig(64, 2, 4), precision=precision)
    assert precision_setting(framework, export.text) == PRECISION_SETTINGS[framework][precision]
    assert READ_BACK[framework](export.text, 2) == {"batch_size": 64, "micro_batch_size": 4}
    tf32_note = [n for n in export.notes if "tf32" in n]
    no_tf32 = ("accelerate", "composer", "deepspeed", "megatron", "torchtitan")
    if precision == "tf32" and framework in no_tf32:
        assert tf32_note == [f"precision tf32: {framework} has no setting for it; {TF32_NOTE} "
                             "(TF32 matmuls, fp32 everything else)"]  # fmt: skip
    elif precision == "tf32" and framework == "cerebras":
        assert tf32_note == [
            "precision tf32: a GPU setting with no Cerebras counterpart (a CS-X system manages "
            "its own memory and arithmetic); not exported"
        ]
    else:  # said in the snippet itself (hf's tf32 key, Lightning's call), or not asked
        assert tf32_note == []
    fp16_note = [n for n in export.notes if n.startswith("precision fp16")]
    if precision == "fp16" and framework == "torchtitan":
        assert fp16_note == [
            "precision fp16: torchtitan trains in bfloat16 or float32 only; exported float32 "
            "(mixed_precision_param), which was not measured as such"
        ]
    else:
        assert fp16_note == []


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("how", ["argument", "config"])
def test_activation_checkpointing_is_exported_or_said_how(framework, how):
    if how == "argument":
        export = export_config(framework, BatchConfig(64, 2, 4), activation_checkpointing=True)
    else:  # a configuration measured with checkpointing carries it
        export = export_config(framework, BatchConfig(64, 2, 4, activation_checkpointing=True))
    plain = export_config(framework, BatchConfig(64, 2, 4))
    notes = [n for n in export.notes if n.startswith("activation checkpointing")]
    if framework == "hf":  # transformers 5's names (gradient_checkpointing is deprecated)
        assert json.loads(export.text)["activation_checkpointing"] is True
        kwargs = json.loads(export.text)["activation_checkpointing_kwargs"]
        assert kwargs == {"use_reentrant": False}
        assert "activation_checkpointing" not in json.loads(plain.text)
    elif framework == "torchtitan":
        assert toml(export.text)["activation_checkpoint"]["mode"] == "full"
        assert toml(plain.text)["activation_checkpoint"]["mode"] == "none"
    elif framework == "megatron":
        args = megatron_args(export.text)
        assert (args["--recompute-granularity"], args["--recompute-method"]) == ("full", "uniform")
        assert args["--recompute-num-layers"] == "1"
        assert "--recompute-granularity" not in megatron_args(plain.text)
    elif framework == "cerebras":
        assert notes == [
            "activation checkpointing: a GPU setting with no Cerebras counterpart (a CS-X system "
            "manages its own memory and arithmetic); not exported"
        ]
    else:
        assert notes == [
            f"activation checkpointing: {framework} has no setting that turns it on for any "
            "model; checkpoint the model's blocks as mbtune did (torch.utils.checkpoint."
            "checkpoint(block, x, use_reentrant=False); a transformers model: "
            "model.activation_checkpointing_enable(), in transformers 4 "
            "gradient_checkpointing_enable())"
        ]
    if framework == "hf":
        assert "transformers 4 names activation_checkpointing(_kwargs) gradient_checkpointing" in (
            " ".join(export.notes)
        )
    if framework in ("hf", "megatron", "torchtitan"):
        assert notes == []
    assert not [n for n in plain.notes if n.startswith("activation checkpointing")]


@pytest.mark.parametrize("precision", ["auto", "float16", "BF16"])
def test_an_unknown_or_unresolved_precision(precision):
    with pytest.raises(
        MbtuneError,
        match=rf"^--export: unknown precision '{precision}'; valid: fp32, tf32, bf16, "
        r"fp16$",
    ):
        export_config("hf", BatchConfig(8, 1, 2), precision=precision)


# ---------------------------------------------------------------------------
# round trips: the snippet, given to the framework itself


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("config", [BatchConfig(64, 2, 4), BatchConfig(30, 2, 4, True)],
                         ids=["even", "uneven-checkpointed"])  # fmt: skip
def test_hf_keys_build_training_arguments(tmp_path, precision, config):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # TrainingArguments needs it
    export = export_config("hf", config, precision=precision)
    kwargs = json.loads(export.text)
    m, g = kwargs["per_device_train_batch_size"], kwargs["gradient_accumulation_steps"]
    assert m * g * 2 == export.config.batch_size
    if config.batch_size != export.config.batch_size:  # uneven: said plainly
        said = (
            "splits unevenly (per device 15 samples as 4+4+4+3): exported the nearest batch_size "
        )
        assert any(said in note for note in export.notes)

    cuda = torch.cuda.is_available()
    cpu = {"use_cpu": True} if precision == "bf16" and not cuda else {}  # bf16 on the CPU
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)  # no deprecated key
            args = transformers.TrainingArguments(output_dir=str(tmp_path), **kwargs, **cpu)
    except ValueError as e:
        # transformers checks the hardware: tf32 needs an Ampere GPU, and fp16 CUDA (before
        # 5.x); here the keys are fields of TrainingArguments and the refusal is about the
        # hardware, not the keys
        ampere = cuda and torch.cuda.get_device_capability()[0] >= 8
        assert (precision == "tf32" and not ampere) or (precision == "fp16" and not cuda)
        assert re.search(r"tf32 requires Ampere|can only be used on CUDA", str(e))
        fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
        assert set(kwargs) <= fields
        return
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (m, g)
    assert (args.bf16, args.fp16) == (precision == "bf16", precision == "fp16")
    assert args.activation_checkpointing is config.activation_checkpointing


@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_lightning_arguments_build_a_trainer(precision, monkeypatch):
    lightning = pytest.importorskip("lightning")
    export = export_config(
        "lightning", BatchConfig(30, 2, 4), precision=precision, header="from a test"
    )
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False,
                 enable_checkpointing=False)  # fmt: skip
    # the snippet's own import gives it this Trainer; its fit is recorded, not run
    monkeypatch.setattr(lightning.pytorch, "Trainer", functools.partial(lightning.Trainer, **quiet))
    fitted = []
    monkeypatch.setattr(lightning.Trainer, "fit", lambda self, *args: fitted.append(args))
    model = lightning.LightningModule()
    names = {"train_dataset": torch.utils.data.TensorDataset(torch.zeros(64, 1)), "model": model}
    before = torch.get_float32_matmul_precision()
    try:
        exec(export.text, names)  # the snippet as a user pastes it: the user's names alone
        assert torch.get_float32_matmul_precision() == ("high" if precision == "tf32" else before)
    finally:
        torch.set_float32_matmul_precision(before)
    trainer, loader = names["trainer"], names["train_loader"]
    m, g = loader.batch_size, trainer.accumulate_grad_batches
    assert trainer.num_devices == 2 and m * g * 2 == export.config.batch_size == 32
    assert (
        trainer.precision == {"fp32": "32-true", "tf32": "32-true", "bf16": "bf16-mixed"}[precision]
    )
    assert fitted == [(model, loader)]


def undefined_names(code: str) -> set[str]:
    """The names ``code`` reads that it neither imports nor assigns, nor Python has."""
    nodes = list(ast.walk(ast.parse(code)))
    names = [node for node in nodes if isinstance(node, ast.Name)]
    imports = [node for node in nodes if isinstance(node, ast.Import | ast.ImportFrom)]
    bound = {a.asname or a.name.split(".")[0] for node in imports for a in node.names}
    bound |= {node.id for node in names if isinstance(node.ctx, ast.Store)}
    read = {node.id for node in names if isinstance(node.ctx, ast.Load)}
    return read - bound - set(dir(builtins))


def python_of(framework: str, text: str) -> str:
    """The Python a user pastes from a snippet: Lightning's whole; Accelerate's the lines of
    its comment under 'in the training script:'."""
    if framework == "lightning":
        return text
    lines = text.splitlines()
    start = lines.index("# in the training script:") + 1
    return "\n".join(line[2:] for line in itertools.takewhile(
        lambda line: line.startswith("# "), lines[start:]))  # fmt: skip


@pytest.mark.parametrize("framework", ["accelerate", "lightning"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("grad_sync", ["last", "every"])
def test_a_python_snippet_imports_all_it_needs(framework, precision, sharding, grad_sync):
    """Pasted, the Python of an export runs with the user's own objects alone (its dataset,
    its model): every other name it reads it imports, and its imports import."""
    pytest.importorskip(framework)
    config = BatchConfig(30, 2, 4, grad_sync=grad_sync)
    export = export_config(framework, config, precision=precision, sharding=sharding,
                           header="from a test")  # fmt: skip
    code = python_of(framework, export.text)
    assert undefined_names(code) == {"train_dataset", "model"} & undefined_names(code)
    assert "train_dataset" in undefined_names(code)
    statements = ast.parse(code).body
    imports = [node for node in statements if isinstance(node, ast.Import | ast.ImportFrom)]
    assert imports
    exec(compile(ast.Module(body=imports, type_ignores=[]), export.filename, "exec"), {})


def test_the_hf_and_deepspeed_notes_say_how_the_file_is_read(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)
    export = export_config("hf", BatchConfig(64, 2, 4))
    (tmp_path / export.filename).write_text(export.text)
    (call,) = [n.split(": ", 1)[1] for n in export.notes if "TrainingArguments(" in n]
    args = eval(call, {"TrainingArguments": transformers.TrainingArguments, "json": json})
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (4, 8)
    notes = export_config("deepspeed", BatchConfig(64, 2, 4)).notes
    assert any(
        "deepspeed --num_gpus 2 train.py" in n and 'config="export-deepspeed.json"' in n
        for n in notes
    )


# ---------------------------------------------------------------------------
# a sharded configuration (trial.sharding: fsdp), as each framework shards


def sharding_setting(framework: str, text: str) -> object:
    """The framework's own sharding setting, read back from the snippet (None: none)."""
    if framework == "accelerate":
        data = yaml.safe_load(text)
        fsdp = data.get("fsdp_config") or {}
        return (
            data["distributed_type"],
            fsdp.get("fsdp_version"),
            fsdp.get("fsdp_reshard_after_forward"),
        )
    if framework == "composer":
        return (yaml.safe_load(text).get("parallelism_config") or {}).get("fsdp")
    if framework == "deepspeed":
        return json.loads(text).get("zero_optimization")
    if framework == "hf":
        data = json.loads(text)
        return data.get("fsdp"), data.get("fsdp_config")
    if framework == "lightning":
        return python_calls(text).get("FSDPStrategy")
    if framework == "megatron":
        return tuple(a for a in megatron_args(text) if "fsdp" in a or a == "--ckpt-format")
    if framework == "torchtitan":
        dp = toml(text)["parallelism"]
        return (dp["data_parallel_shard_degree"], dp["data_parallel_replicate_degree"],
                dp.get("fsdp_reshard_after_forward"))  # fmt: skip
    return "runconfig" in yaml.safe_load(text) and None  # cerebras: nothing to say it


FSDP2 = ("--use-torch-fsdp2", "--ckpt-format")
SHARDING_SETTINGS = {  # (sharding, reshard_after_forward): the setting read back
    "accelerate": {("none", True): ("MULTI_GPU", None, None), ("fsdp", True): ("FSDP", 2, True),
                   ("fsdp", False): ("FSDP", 2, False)},
    "cerebras": {("none", True): None, ("fsdp", True): None, ("fsdp", False): None},
    "composer": {("none", True): None, ("fsdp", True): {"sharding_strategy": "FULL_SHARD"},
                 ("fsdp", False): {"sharding_strategy": "SHARD_GRAD_OP"}},
    "deepspeed": {("none", True): None, ("fsdp", True): {"stage": 3},
                  ("fsdp", False): {"stage": 2}},
    "hf": {("none", True): (None, None),
           ("fsdp", True): (True, {"version": 2, "reshard_after_forward": True}),
           ("fsdp", False): (True, {"version": 2, "reshard_after_forward": False})},
    "lightning": {("none", True): None, ("fsdp", True): {"sharding_strategy": "FULL_SHARD"},
                  ("fsdp", False): {"sharding_strategy": "SHARD_GRAD_OP"}},
    "megatron": {("none", True): (), ("fsdp", True): FSDP2,
                 ("fsdp", False): (*FSDP2, "--torch-fsdp2-no-reshard-after-forward")},
    "torchtitan": {("none", True): (1, 2, None), ("fsdp", True): (2, 1, "always"),
                   ("fsdp", False): (2, 1, "never")},
}  # fmt: skip


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize(("sharding", "reshard"), [("none", True), ("fsdp", True), ("fsdp", False)])
def test_a_sharded_configuration_is_exported_as_the_framework_shards(framework, sharding, reshard):
    export = export_config(
        framework, BatchConfig(64, 2, 4), sharding=sharding, reshard_after_forward=reshard
    )
    assert READ_BACK[framework](export.text, 2) == {"batch_size": 64, "micro_batch_size": 4}
    assert (
        sharding_setting(framework, export.text)
        == SHARDING_SETTINGS[framework][(sharding, reshard)]
    )
    cerebras_note = [n for n in export.notes if "sharding fsdp" in n]
    if framework == "cerebras" and sharding == "fsdp":
        assert cerebras_note == [
            "sharding fsdp: a GPU setting with no Cerebras counterpart (a CS-X system manages "
            "its own memory and arithmetic); not exported"
        ]
    else:
        assert cerebras_note == []


@pytest.mark.parametrize("framework", ["accelerate", "hf", "lightning", "torchtitan"])
def test_sharded_checkpointing_is_fsdps_own_where_the_framework_has_it(framework):
    export = export_config(
        framework, BatchConfig(64, 2, 4, activation_checkpointing=True), sharding="fsdp"
    )
    said = [n for n in export.notes if n.startswith("activation checkpointing")]
    assert said == []  # a setting of its own: no note telling how
    if framework == "accelerate":
        assert yaml.safe_load(export.text)["fsdp_config"]["fsdp_activation_checkpointing"]
    elif framework == "hf":  # FSDP's, not the training argument (no extra all-gather)
        data = json.loads(export.text)
        assert data["fsdp_config"]["activation_checkpointing"] is True
        assert "activation_checkpointing" not in data
    elif framework == "lightning":
        assert "activation_checkpointing_policy={YourBlock} checkpoints them" in " ".join(
            export.notes
        )
    else:
        assert toml(export.text)["activation_checkpoint"]["mode"] == "full"


def test_an_unknown_sharding():
    with pytest.raises(MbtuneError, match=r"^--export: unknown sharding 'zero3'; valid: none, "
                       r"fsdp$"):  # fmt: skip
        export_config("hf", BatchConfig(8, 1, 2), sharding="zero3")


# -- round trips of a sharded export, into the installed libraries


@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("reshard", [True, False])
def test_hf_fsdp_keys_build_training_arguments_with_fsdp2(tmp_path, monkeypatch, reshard,
                                                          checkpointing):  # fmt: skip
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")  # TrainingArguments sets it
    config = BatchConfig(64, 2, 4, activation_checkpointing=checkpointing)
    export = export_config("hf", config, sharding="fsdp", reshard_after_forward=reshard)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # no deprecated key
        args = transformers.TrainingArguments(output_dir=str(tmp_path), **json.loads(export.text))
    assert args.fsdp is True
    plugin = args.fsdp_plugin_args  # what Accelerate's FSDP plugin is built from
    assert (plugin["fsdp_version"], plugin["reshard_after_forward"]) == (2, reshard)
    assert plugin.get("activation_checkpointing", False) is checkpointing
    assert args.activation_checkpointing is False  # FSDP's own checkpointing, not this one


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_accelerate_config_launches_with_its_fsdp2_plugin(tmp_path, monkeypatch, sharding):
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    export = export_config(
        "accelerate", BatchConfig(64, 2, 4, True), precision="bf16", sharding=sharding,
        reshard_after_forward=False,
    )  # fmt: skip
    path = tmp_path / export.filename
    path.write_text(export.text)
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)  # the config file read as `accelerate launch`
    assert (args.num_processes, args.mixed_precision) == (2, "bf16")
    assert (args.use_fsdp, args.multi_gpu) == (sharding == "fsdp", sharding == "none")
    if sharding == "none":
        return
    for key, value in prepare_multi_gpu_env(args).items():  # what each process is given
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert (plugin.reshard_after_forward, plugin.activation_checkpointing) == (False, True)


@pytest.mark.parametrize("reshard", [True, False])
def test_lightning_fsdp_strategy_is_built(reshard, monkeypatch):
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.strategies import FSDPStrategy

    export = export_config(
        "lightning", BatchConfig(64, 2, 4), precision="bf16", sharding="fsdp",
        reshard_after_forward=reshard,
    )  # fmt: skip
    seen = {}

    def trainer(**kwargs):  # Lightning's FSDP needs CUDA: checked for what it is handed
        seen.update(kwargs)
        return types.SimpleNamespace(fit=lambda *args: None)

    monkeypatch.setattr(lightning.pytorch, "Trainer", trainer)  # what the snippet imports
    names = {"train_dataset": torch.utils.data.TensorDataset(torch.zeros(64, 1)), "model": None}
    exec(export.text, names)  # the snippet as a user pastes it
    strategy = seen["strategy"]
    assert isinstance(strategy, FSDPStrategy)
    assert strategy.sharding_strategy.name == ("FULL_SHARD" if reshard else "SHARD_GRAD_OP")
    assert (seen["devices"], seen["accumulate_grad_batches"]) == (2, 8)


def test_an_analyzed_sharded_run_exports_its_sharding(tmp_path, capsys):
    from rundirs import make_run, trial_row

    from mbtune.analysis.analyze import export_run
    from mbtune.runs.load import load_run, run_info

    path = make_run(tmp_path, [trial_row(32, 2, 8, 500.0, sharding="fsdp"),
                               trial_row(32, 2, 4, 400.0, sharding="fsdp")])  # fmt: skip
    export_run(load_run(path), run_info(path), "deepspeed")
    assert json.loads(capsys.readouterr().out)["zero_optimization"] == {"stage": 3}
    unsharded = make_run(tmp_path, [trial_row(32, 2, 8, 500.0)], name="plain")
    export_run(load_run(unsharded), run_info(unsharded), "deepspeed")
    assert "zero_optimization" not in json.loads(capsys.readouterr().out)
