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
from mbtune.analysis.export_parallel import TORCHTITAN_SCHEDULES
from mbtune.errors import MbtuneError
from mbtune.lattice import PIPELINE_SCHEDULES, BatchConfig

# ---------------------------------------------------------------------------
# each framework's snippet, read back the way the framework reads it, and its rule


def accelerate(text: str, n: int) -> dict:
    data = yaml.safe_load(text)
    # the script's two lines, in the comment: "# accelerator = Accelerator(...)"
    lines = [line[2:] for line in text.splitlines() if re.match(r"# \w+ = \w+\(", line)]
    script = python_calls("\n".join(lines))
    g, m = script["Accelerator"]["gradient_accumulation_steps"], script["DataLoader"]["batch_size"]
    # Accelerate: the loader batch (per process) x gradient_accumulation_steps x num_processes,
    # the data-parallel ones: num_processes / the tensor-parallel size
    tp = (data.get("parallelism_config") or {}).get("parallelism_config_tp_size", 1)
    assert data["num_processes"] == n * tp and data["num_machines"] == 1
    return {"batch_size": m * g * n, "micro_batch_size": m}


def torchtitan(text: str, n: int) -> dict:
    values, _ = cli_args(text)
    b, local = (
        int(values["--training.global_batch_size"]),
        int(values["--training.local_batch_size"]),
    )
    shard = int(values["--parallelism.data_parallel_shard_degree"])
    replicate = int(values["--parallelism.data_parallel_replicate_degree"])
    pipeline = int(values.get("--parallelism.pipeline_parallel_degree") or 1)
    m = int(values["--parallelism.pipeline_parallel_microbatch_size"]) if pipeline > 1 else local
    # torchtitan: the global batch divisible by the local batch x the data-parallel degree;
    # with a pipeline, the local batch split into micro-batches of pipeline_parallel_microbatch_size
    assert shard * replicate == n
    assert b % (local * n) == 0 and local % m == 0
    return {"batch_size": b, "micro_batch_size": m}


def cli_args(text: str) -> tuple[dict[str, str | None], list[str]]:
    """A command line's ``--flag value`` and ``--flag`` (None) pairs, and its positional
    words (torchtitan's ``activation-checkpoint:full``), its comment lines left out."""
    args = [a for line in text.splitlines() if not line.startswith("#") for a in shlex.split(line)]
    values: dict[str, str | None] = {}
    positional, flag = [], None
    for arg in args:
        if arg.startswith("--"):
            values[arg] = None
            flag = arg
        elif flag is not None and not re.fullmatch(r"[a-z-]+:[a-z-]+", arg):  # a subcommand
            values[flag], flag = arg, None
        else:
            positional.append(arg)
    return values, positional


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
    # Lightning: the loader batch (per process) x accumulate_grad_batches x devices, whose
    # data-parallel ones only where ModelParallelStrategy splits the model
    split = calls.get("ModelParallelStrategy")
    if split:
        assert devices == split["data_parallel_size"] * split["tensor_parallel_size"]
        devices = split["data_parallel_size"]
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
    values, positional = cli_args(text)
    assert positional == []
    return values


def nemo(text: str, n: int) -> dict:
    fields = nemo_fields(text)
    m, b = fields["data.micro_batch_size"], fields["data.global_batch_size"]
    devices = fields["trainer.devices"] * fields["trainer.num_nodes"]
    t = fields["trainer.strategy.tensor_model_parallel_size"]
    p = fields["trainer.strategy.pipeline_model_parallel_size"]
    # NeMo (Megatron's): the global batch divisible by micro-batch x data-parallel size
    assert devices // (t * p) == n and devices % (t * p) == 0
    assert b % (m * n) == 0
    return {"batch_size": b, "micro_batch_size": m}


def nemo_fields(text: str) -> dict[str, object]:
    """Each ``recipe.a.b = value`` of a NeMo snippet: its path below ``recipe`` and its value
    (a constant, or the source of an expression); every path one NeMo 2's recipe has."""
    fields = {}
    for node in ast.parse(text).body:
        if isinstance(node, ast.Assign):
            (target,) = node.targets
            path = ast.unparse(target)
            assert path.startswith("recipe."), path
            value = node.value
            fields[path.removeprefix("recipe.")] = (
                value.value if isinstance(value, ast.Constant) else ast.unparse(value)
            )
    assert set(fields) <= NEMO_RECIPE_FIELDS, set(fields) - NEMO_RECIPE_FIELDS
    return fields


# NeMo 2.7's recipe (a NeMo-Run Partial of llm.pretrain): nl.Trainer's devices, num_nodes and
# plugins; MegatronStrategy's __init__ parameters; the data module's (MockDataModule,
# PreTrainingDataModule); the model's megatron.core TransformerConfig recompute fields
NEMO_RECIPE_FIELDS = {
    "trainer.devices", "trainer.num_nodes", "trainer.plugins",
    *(f"trainer.strategy.{name}" for name in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size",
        "virtual_pipeline_model_parallel_size", "sequence_parallel", "fsdp")),
    "data.micro_batch_size", "data.global_batch_size",
    *(f"model.config.recompute_{name}" for name in ("granularity", "method", "num_layers")),
}  # fmt: skip


HF_KEYS = {
    "per_device_train_batch_size", "gradient_accumulation_steps", "bf16", "fp16", "tf32",
    "activation_checkpointing", "activation_checkpointing_kwargs", "fsdp", "fsdp_config",
}  # fmt: skip

READ_BACK = {
    f.__name__: f
    for f in (accelerate, cerebras, composer, deepspeed, hf, lightning, megatron, nemo, torchtitan)
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
    assert "launch on 8 devices: 2 data-parallel x 4 pipeline stages (1f1b)" in export.notes


def test_an_unknown_framework():
    with pytest.raises(
        MbtuneError, match=r"unknown framework 'keras'; valid: accelerate, cerebras, "
    ):
        export_config("keras", BatchConfig(8, 1, 2))


@st.composite
def configs(draw):
    d = draw(st.integers(1, 8))  # replicas, each split t x p where the layout says so
    t, p = draw(st.sampled_from([(1, 1), (1, 1), (2, 1), (1, 2), (2, 2), (1, 4)]))
    schedule = draw(st.sampled_from(PIPELINE_SCHEDULES))
    b = draw(st.integers(d, 300))
    m = draw(st.integers(1, -(-b // d)))
    return BatchConfig(b, d * t * p, m, tensor_parallel=t, pipeline_parallel=p,
                       pipeline_schedule=schedule)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(config=configs(), framework=st.sampled_from(FRAMEWORKS))
def test_every_export_obeys_its_frameworks_rule(config, framework):
    export = export_config(framework, config)
    d = config.data_parallel
    read = READ_BACK[framework](export.text, d)
    m = config.canonical_micro_batch_size
    assert read["micro_batch_size"] == m  # the micro-batch that ran, and the same devices
    assert read["batch_size"] == export.config.batch_size
    if dataclasses.replace(config, micro_batch_size=m).is_strict:
        assert export.config.batch_size == config.batch_size  # nothing to change
    # no batch size the framework accepts for (d, m) is nearer than the exported one
    step = d * (1 if framework == "composer" else m)
    distance = abs(export.config.batch_size - config.batch_size)
    for other in range(max(step, config.batch_size - distance + 1), config.batch_size + distance):
        if other % step == 0 and other // d >= m:
            pytest.fail(f"{other} is nearer to {config.batch_size} than {export.config}")


# ---------------------------------------------------------------------------
# the precision and the activation checkpointing measured, in each framework's own keys


def precision_setting(framework: str, text: str) -> object:
    """The framework's own setting of the arithmetic, read back from the snippet."""
    if framework == "accelerate":
        return yaml.safe_load(text)["mixed_precision"]
    if framework == "torchtitan":
        values, _ = cli_args(text)
        return (values["--training.mixed_precision_param"],
                values["--training.mixed_precision_reduce"])  # fmt: skip
    if framework == "nemo":  # its plugin: a factory's name, or the precision it is given
        plugin = ast.parse(nemo_fields(text)["trainer.plugins"]).body[0].value
        if isinstance(plugin.func, ast.Name):
            return plugin.func.id
        return {k.arg: ast.unparse(k.value) for k in plugin.keywords}["precision"]
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
    "nemo": {"fp32": "'32'", "tf32": "'32'", "bf16": "bf16_mixed", "fp16": "fp16_mixed"},
}  # fmt: skip
TF32_NOTE = 'call torch.set_float32_matmul_precision("high") before training'


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_precision_is_in_the_frameworks_own_keys(framework, precision):
    export = export_config(framework, BatchConfig(64, 2, 4), precision=precision)
    assert precision_setting(framework, export.text) == PRECISION_SETTINGS[framework][precision]
    assert READ_BACK[framework](export.text, 2) == {"batch_size": 64, "micro_batch_size": 4}
    tf32_note = [n for n in export.notes if "tf32" in n]
    no_tf32 = ("accelerate", "composer", "deepspeed", "megatron", "nemo", "torchtitan")
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
        assert cli_args(export.text)[1] == ["activation-checkpoint:full"]
        assert cli_args(plain.text)[1] == ["activation-checkpoint:none"]
    elif framework == "nemo":  # megatron.core's TransformerConfig, as Megatron's arguments
        fields = nemo_fields(export.text)
        assert fields["model.config.recompute_granularity"] == "full"
        assert fields["model.config.recompute_method"] == "uniform"
        assert fields["model.config.recompute_num_layers"] == 1
        assert "model.config.recompute_granularity" not in nemo_fields(plain.text)
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
    if framework in ("hf", "megatron", "nemo", "torchtitan"):
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
        values, _ = cli_args(text)
        return (int(values["--parallelism.data_parallel_shard_degree"]),
                int(values["--parallelism.data_parallel_replicate_degree"]),
                values.get("--parallelism.fsdp_reshard_after_forward"))  # fmt: skip
    if framework == "nemo":
        return nemo_fields(text).get("trainer.strategy.fsdp")
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
    "nemo": {("none", True): None, ("fsdp", True): "pytorch", ("fsdp", False): "pytorch"},
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
        assert cli_args(export.text)[1] == ["activation-checkpoint:full"]


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


def trainer_arguments(lightning, text: str, monkeypatch) -> dict:
    """What a Lightning snippet, pasted and run, hands its Trainer (whose FSDP and model
    parallelism need CUDA: the Trainer is not built)."""
    seen = {}

    def trainer(**kwargs):
        seen.update(kwargs)
        return types.SimpleNamespace(fit=lambda *args: None)

    monkeypatch.setattr(lightning.pytorch, "Trainer", trainer)  # what the snippet imports
    names = {"train_dataset": torch.utils.data.TensorDataset(torch.zeros(64, 1)), "model": None}
    exec(text, names)  # the snippet as a user pastes it
    return seen


@pytest.mark.parametrize("reshard", [True, False])
def test_lightning_fsdp_strategy_is_built(reshard, monkeypatch):
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.strategies import FSDPStrategy

    export = export_config(
        "lightning", BatchConfig(64, 2, 4), precision="bf16", sharding="fsdp",
        reshard_after_forward=reshard,
    )  # fmt: skip
    seen = trainer_arguments(lightning, export.text, monkeypatch)
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


# ---------------------------------------------------------------------------
# a split model (tensor_parallel t, pipeline_parallel p, pipeline_schedule)


def split_config(t: int, p: int, schedule: str = "1f1b", b: int = 64) -> BatchConfig:
    """2 replicas of a model split t x p: B samples as micro-batches of 4 on each replica."""
    return BatchConfig(b, 2 * t * p, 4, tensor_parallel=t, pipeline_parallel=p,
                       pipeline_schedule=schedule)  # fmt: skip


# schedule -> (Megatron's virtual stages per rank, what its note says); g = 8 micro-batches
MEGATRON_SCHEDULES = {
    "gpipe": (1, "Megatron-LM has no GPipe schedule; exported its 1F1B"),
    "1f1b": (1, None),
    "interleaved_1f1b": (2, None),
    "zbv": (2, "Megatron-LM has no zero-bubble V schedule; exported its interleaved 1F1B"),
    "dualpipev": (2, "no zero-bubble V schedule; exported its interleaved 1F1B"),
}


@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
@pytest.mark.parametrize("layers", [8, None, 6])
def test_megatron_exports_the_layout_and_schedule(schedule, layers):
    export = export_config("megatron", split_config(2, 2, schedule), header="h", layers=layers)
    args = megatron_args(export.text)
    assert megatron(export.text, 2) == {"batch_size": 64, "micro_batch_size": 4}
    assert (args["--tensor-model-parallel-size"], args["--pipeline-model-parallel-size"]) == (
        "2", "2")  # fmt: skip
    v, said = MEGATRON_SCHEDULES[schedule]
    per_stage = args.get("--num-layers-per-virtual-pipeline-stage")
    per_rank = args.get("--num-virtual-stages-per-pipeline-rank")
    if v == 1:
        assert per_stage is per_rank is None
    elif layers == 8:  # 8 layers over 2 ranks x 2 virtual stages
        assert (per_stage, per_rank) == ("2", None)
    else:  # unknown, or 6: no whole number of layers per virtual stage
        assert (per_stage, per_rank) == (None, "2")
        why = "unknown here" if layers is None else "6, not a multiple of 4"
        assert any(f"the model's layers are {why}: --num-virtual-stages-per-pipeline-rank 2"
                   in n for n in export.notes)  # fmt: skip
    notes = [n for n in export.notes if n.startswith("pipeline_schedule")]
    assert len(notes) == (said is not None) and (said is None or said in notes[0])
    assert export.text.splitlines()[1] == (
        "# tensor-parallel size 2, pipeline-parallel size 2, data-parallel size 2: 8 "
        "micro-batches per step on each replica"
    )
    assert f"launch on 8 devices: 2 data-parallel x 2 tensor-parallel x 2 pipeline stages " \
        f"({schedule})" in export.notes  # fmt: skip


def test_megatron_runs_a_zero_bubble_schedule_as_1f1b_where_it_cannot_interleave():
    export = export_config("megatron", split_config(1, 2, "zbv", b=40))  # g = 5: not 2's multiple
    assert "--num-virtual-stages-per-pipeline-rank" not in export.text
    assert any("exported its 1F1B (5 micro-batches are not a multiple of pipeline_parallel 2"
               in n for n in export.notes)  # fmt: skip


def test_megatron_shards_a_pipeline_with_its_distributed_optimizer():
    piped = megatron_args(export_config("megatron", split_config(1, 2), sharding="fsdp").text)
    assert "--use-distributed-optimizer" in piped and "--use-torch-fsdp2" not in piped
    flat = megatron_args(export_config("megatron", split_config(2, 1), sharding="fsdp").text)
    assert "--use-torch-fsdp2" in flat and "--untie-embeddings-and-output-weights" in flat


@pytest.mark.parametrize(("t", "p", "schedule", "sharding"), [
    (2, 1, "1f1b", "none"), (2, 1, "1f1b", "fsdp"), (1, 2, "1f1b", "none"),
    (2, 2, "interleaved_1f1b", "none"), (1, 4, "zbv", "fsdp"), (2, 2, "gpipe", "fsdp"),
])  # fmt: skip
def test_megatron_arguments_pass_megatrons_own_validation(monkeypatch, t, p, schedule, sharding):
    """Megatron-LM's parse_args and validate_args (megatron.training.arguments, from the
    Megatron-LM repository beside an installed megatron-core) take the export as written,
    and megatron.core's micro-batch calculator gives the g micro-batches measured."""
    arguments = pytest.importorskip("megatron.training.arguments")
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator

    config = split_config(t, p, schedule)
    export = export_config("megatron", config, precision="bf16", sharding=sharding, layers=16)
    model = "--num-layers 16 --hidden-size 64 --num-attention-heads 4 --seq-length 128 "
    model += "--max-position-embeddings 128"
    argv = ["pretrain_gpt.py", *model.split()]
    argv += [a for line in export.text.splitlines() if not line.startswith("#")
             for a in shlex.split(line)]  # fmt: skip
    monkeypatch.setattr("sys.argv", argv)
    monkeypatch.setenv("WORLD_SIZE", str(config.num_devices))
    # Megatron's tensor parallelism needs 1 (the note says so), its torch FSDP2 more
    fsdp2 = "--use-torch-fsdp2" in export.text
    assert any("CUDA_DEVICE_MAX_CONNECTIONS=1" in n for n in export.notes) == (t > 1 and not fsdp2)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8" if fsdp2 else "1")
    monkeypatch.setattr(arguments, "get_device_arch_version", lambda: 9)  # a Hopper: no GPU here
    args = arguments.parse_args()
    arguments.validate_args(args)
    v = MEGATRON_SCHEDULES[schedule][0]
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) == (t, p)
    assert args.virtual_pipeline_model_parallel_size == (v if v > 1 else None)
    assert args.data_parallel_size == config.data_parallel == 2
    calculator = ConstantNumMicroBatchesCalculator(
        args.global_batch_size, args.micro_batch_size, args.data_parallel_size, False, 0
    )
    assert calculator.get() == config.grad_accum_steps == 8


@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
def test_torchtitan_exports_the_layout_and_schedule(schedule):
    export = export_config("torchtitan", split_config(2, 2, schedule), sharding="fsdp")
    values, positional = cli_args(export.text)
    assert torchtitan(export.text, 2) == {"batch_size": 64, "micro_batch_size": 4}
    names = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
             "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV"}  # fmt: skip
    assert values["--parallelism.pipeline_parallel_schedule"] == names[schedule]
    assert values["--parallelism.tensor_parallel_degree"] == "2"
    assert values["--parallelism.pipeline_parallel_degree"] == "2"
    # one local batch of a replica's 32 samples, the pipeline's 8 micro-batches of 4
    assert values["--training.local_batch_size"] == "32"
    assert values["--parallelism.pipeline_parallel_microbatch_size"] == "4"
    assert "--parallelism.no-enable-sequence-parallel" in values
    assert positional == ["activation-checkpoint:none"]
    assert not [n for n in export.notes if n.startswith("pipeline_schedule")]  # as measured


@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
def test_torchtitan_schedule_names_are_the_schedules_mbtune_runs(schedule):
    """torchtitan builds its schedule with torch's get_schedule_class(name): each name
    exported gives the class a real mbtune trial runs for the schedule."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    from mbtune.trial.parallelize import SCHEDULES

    assert get_schedule_class(TORCHTITAN_SCHEDULES[schedule]).__name__ == SCHEDULES[schedule]


def test_torchtitan_without_a_pipeline_accumulates_micro_batches():
    values, _ = cli_args(export_config("torchtitan", split_config(2, 1)).text)
    assert values["--training.local_batch_size"] == "4"  # 64 / (4 x 2): 8 accumulation steps
    assert "--parallelism.pipeline_parallel_degree" not in values


@pytest.mark.parametrize(("t", "p", "schedule", "sharding"), [
    (1, 1, "1f1b", "none"), (2, 1, "1f1b", "fsdp"), (1, 2, "gpipe", "none"),
    (2, 2, "interleaved_1f1b", "fsdp"), (1, 2, "dualpipev", "none"),
])  # fmt: skip
def test_torchtitan_reads_the_command_line(monkeypatch, t, p, schedule, sharding):
    """torchtitan's ConfigManager (0.3: its tyro command line over a config of its registry)
    reads the export, and its ParallelDims take the degrees over the trial's devices."""
    manager = pytest.importorskip("torchtitan.config.manager")
    from torchtitan.distributed.parallel_dims import ParallelDims

    config = split_config(t, p, schedule)
    export = export_config("torchtitan", config, precision="bf16", sharding=sharding,
                           activation_checkpointing=True)  # fmt: skip
    args = [a for line in export.text.splitlines() if not line.startswith("#")
            for a in shlex.split(line)]  # fmt: skip
    job = manager.ConfigManager().parse_args(
        ["--module", "llama3", "--config", "llama3_debugmodel", *args]
    )
    parallelism, training = job.parallelism, job.training
    assert (parallelism.tensor_parallel_degree, parallelism.pipeline_parallel_degree) == (t, p)
    assert type(job.activation_checkpoint).__qualname__ == "FullAC.Config"
    assert training.mixed_precision_param == "bfloat16"
    dims = ParallelDims.from_config(parallelism, world_size=config.num_devices)
    assert (dims.dp_shard * dims.dp_replicate, dims.tp, dims.pp) == (2, t, p)
    # the trainer's arithmetic: accumulation steps, and the pipeline's micro-batches
    steps = training.global_batch_size // (training.local_batch_size * 2)
    if p > 1:
        assert parallelism.pipeline_parallel_schedule == TORCHTITAN_SCHEDULES[schedule]
        micro = training.local_batch_size // parallelism.pipeline_parallel_microbatch_size
        assert (steps, micro) == (1, config.grad_accum_steps)
    else:
        assert steps == config.grad_accum_steps


@pytest.mark.parametrize("schedule", PIPELINE_SCHEDULES)
def test_nemo_exports_the_layout_in_its_recipe_fields(schedule):
    export = export_config("nemo", split_config(2, 2, schedule), precision="bf16",
                           header="from a test")  # fmt: skip
    fields = nemo_fields(export.text)
    assert nemo(export.text, 2) == {"batch_size": 64, "micro_batch_size": 4}
    strategy = {k.removeprefix("trainer.strategy."): v for k, v in fields.items()
                if k.startswith("trainer.strategy.")}  # fmt: skip
    v = MEGATRON_SCHEDULES[schedule][0]
    assert strategy == {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
        "virtual_pipeline_model_parallel_size": v if v > 1 else None, "sequence_parallel": False,
    }  # fmt: skip
    assert fields["trainer.devices"] == 8 and fields["trainer.num_nodes"] == 1
    assert fields["trainer.plugins"] == "bf16_mixed()"
    assert undefined_names(export.text) == {"recipe"}  # the user's recipe, all else imported


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_nemo_fields_set_a_nemo_recipe(precision):
    """NeMo 2's own recipe objects (NeMo-Run Configs of nl.Trainer, nl.MegatronStrategy, a
    data module and a GPT model) take the snippet as pasted; each name set is a parameter
    of the class it configures (MegatronStrategy takes **kwargs: checked by signature)."""
    llm = pytest.importorskip("nemo.collections.llm")
    import inspect

    import nemo_run as run
    from nemo import lightning as nl

    recipe = run.Partial(
        llm.pretrain,
        model=run.Config(llm.GPTModel, config=run.Config(llm.GPTConfig)),
        trainer=run.Config(nl.Trainer, strategy=run.Config(nl.MegatronStrategy)),
        data=run.Config(llm.MockDataModule, seq_length=128),
    )
    export = export_config("nemo", split_config(2, 2, "interleaved_1f1b"), precision=precision,
                           activation_checkpointing=True)  # fmt: skip
    exec(export.text, {"recipe": recipe})  # the snippet as pasted, with your recipe
    strategy = recipe.trainer.strategy
    assert set(nemo_fields(export.text)) >= {"trainer.strategy.sequence_parallel"}
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "virtual_pipeline_model_parallel_size", "sequence_parallel"):  # fmt: skip
        assert name in inspect.signature(nl.MegatronStrategy).parameters
    assert (strategy.tensor_model_parallel_size, strategy.pipeline_model_parallel_size,
            strategy.virtual_pipeline_model_parallel_size) == (2, 2, 2)  # fmt: skip
    assert (recipe.data.micro_batch_size, recipe.data.global_batch_size) == (4, 64)
    assert (recipe.trainer.devices, recipe.trainer.num_nodes) == (8, 1)
    assert recipe.model.config.recompute_granularity == "full"
    plugin = recipe.trainer.plugins
    assert plugin.precision == {"fp32": "32", "bf16": "bf16-mixed"}[precision]


def test_nemo_shards_with_torch_fsdp2_but_not_a_pipeline():
    flat = export_config("nemo", split_config(2, 1), sharding="fsdp", reshard_after_forward=False)
    assert nemo_fields(flat.text)["trainer.strategy.fsdp"] == "pytorch"
    assert any(n.startswith("reshard_after_forward false") for n in flat.notes)
    piped = export_config("nemo", split_config(1, 2), sharding="fsdp")
    assert "trainer.strategy.fsdp" not in nemo_fields(piped.text)
    assert any("refuses pipeline parallelism" in n for n in piped.notes)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_sharding_one_replica_of_a_split_model_is_exported_unsharded(framework):
    config = BatchConfig(32, 4, 8, tensor_parallel=2, pipeline_parallel=2)  # d = 1
    export = export_config(framework, config, sharding="fsdp")
    assert export.text == export_config(framework, config).text
    assert "sharding fsdp over 1 replica of a split model shards nothing (its data-parallel " \
        "group is one device): exported unsharded" in export.notes  # fmt: skip


def test_the_others_express_tensor_parallelism_where_they_have_it():
    config = split_config(2, 1)
    data = yaml.safe_load(export_config("accelerate", config).text)
    assert data["num_processes"] == 4 and data["distributed_type"] == "FSDP"
    assert data["parallelism_config"]["parallelism_config_tp_size"] == 2
    assert data["parallelism_config"]["parallelism_config_dp_shard_size"] == 2  # see below
    calls = python_calls(export_config("lightning", config).text)
    assert calls["ModelParallelStrategy"] == {"data_parallel_size": 2, "tensor_parallel_size": 2}
    assert calls["Trainer"]["devices"] == 4
    deepspeed_config = json.loads(export_config("deepspeed", config).text)
    assert deepspeed_config["tensor_parallel"] == {"autotp_size": 2}
    composer_config = yaml.safe_load(export_config("composer", config).text)
    assert composer_config["parallelism_config"]["tp"] == {"tensor_parallel_degree": 2}
    hf_notes = export_config("hf", config, sharding="fsdp").notes
    assert any("ParallelismConfig(dp_shard_size=2, tp_size=2)" in n for n in hf_notes)
    cerebras_notes = export_config("cerebras", config).notes
    assert any("no Cerebras counterpart; num_csx is the data-parallel 2" in n
               for n in cerebras_notes)  # fmt: skip


@pytest.mark.parametrize("framework", ["accelerate", "composer", "hf", "lightning"])
def test_a_framework_without_a_pipeline_says_so_and_names_what_would(framework):
    export = export_config(framework, split_config(1, 2, "interleaved_1f1b"))
    assert READ_BACK[framework](export.text, 2) == {"batch_size": 64, "micro_batch_size": 4}
    assert (
        f"pipeline_parallel 2 (interleaved_1f1b): {framework} trains no pipeline; exported the 2 "
        "replicas' batches without the pipeline's split (2 devices instead of 4), which was not "
        "measured as such; the megatron, nemo or torchtitan export splits it as measured"
    ) in export.notes
    # and it launches what it exports: the replicas, not the stages it dropped
    launch = [n for n in export.notes if "launch on " in n]
    assert launch and all("launch on 2 data-parallel devices" in n for n in launch)
    one = export_config(framework, BatchConfig(32, 2, 4, pipeline_parallel=2))  # 1 replica
    assert "exported the replica's batches without the pipeline's split (1 device instead of " \
        "2)" in " ".join(one.notes)  # fmt: skip


def test_deepspeed_pipeline_is_its_pipeline_module():
    export = export_config("deepspeed", split_config(2, 2), sharding="fsdp")
    data = json.loads(export.text)
    assert data["zero_optimization"] == {"stage": 1} and "tensor_parallel" not in data
    assert any("deepspeed.pipe.PipelineModule(layers=..., num_stages=2)" in n
               for n in export.notes)  # fmt: skip
    assert any("--num_gpus 4 " in n for n in export.notes)  # 2 replicas x 2 stages


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_accelerate_tensor_parallel_config_launches(tmp_path, monkeypatch, sharding):
    pytest.importorskip("accelerate")
    from accelerate import ParallelismConfig
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    export = export_config("accelerate", split_config(2, 1), sharding=sharding)
    path = tmp_path / export.filename
    path.write_text(export.text)
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)  # the config file read as `accelerate launch`
    assert (args.num_processes, args.use_fsdp, args.use_parallelism_config) == (4, True, True)
    for key, value in prepare_multi_gpu_env(args).items():  # what each process is given
        monkeypatch.setenv(key, value)
    parallelism = ParallelismConfig()  # raises where tp_size > 1 has plain replicas
    assert (parallelism.tp_size, parallelism.dp_shard_size, parallelism.dp_replicate_size) == (
        2, 2, 1)  # fmt: skip
    said = [n for n in export.notes if "takes no plain replicas" in n]
    assert len(said) == (sharding == "none")


def test_lightning_model_parallel_strategy_is_built(monkeypatch):
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.strategies import ModelParallelStrategy

    export = export_config("lightning", split_config(2, 1), precision="bf16", sharding="fsdp")
    seen = trainer_arguments(lightning, export.text, monkeypatch)
    strategy = seen["strategy"]
    assert isinstance(strategy, ModelParallelStrategy)
    assert (strategy._data_parallel_size, strategy._tensor_parallel_size) == (2, 2)
    assert (seen["devices"], seen["accumulate_grad_batches"]) == (4, 8)


def test_analyze_exports_a_split_runs_layout(tmp_path, capsys):
    from rundirs import EXPERIMENT, make_run, trial_row

    from mbtune.cli import main
    from mbtune.runs.record import SIZES

    def split_row(b, m, speed, schedule):
        config = BatchConfig(b, 8, m, tensor_parallel=2, pipeline_parallel=2,
                             pipeline_schedule=schedule)  # fmt: skip
        layout = {k: v for k, v in config.as_dict().items() if k not in SIZES}
        return trial_row(b, 8, m, speed, sharding="fsdp", **layout)

    experiment = {**EXPERIMENT, "model": {"name": "gpt", "n_layer": 8}}
    path = make_run(tmp_path, [split_row(64, 4, 900.0, "interleaved_1f1b"),
                               split_row(64, 8, 700.0, "1f1b")], experiment=experiment)  # fmt: skip
    assert main(["analyze", str(path), "--export", "megatron"]) == 0
    out, err = capsys.readouterr()
    args = megatron_args(out)
    assert (args["--tensor-model-parallel-size"], args["--pipeline-model-parallel-size"]) == (
        "2", "2")  # fmt: skip
    assert args["--num-layers-per-virtual-pipeline-stage"] == "2"  # gpt's 8 layers over 2 x 2
    assert megatron(out, 2) == {"batch_size": 64, "micro_batch_size": 4}
    assert "launch on 8 devices: 2 data-parallel x 2 tensor-parallel x 2 pipeline stages " \
        "(interleaved_1f1b)" in err  # fmt: skip
    assert main(["analyze", str(path), "--export", "torchtitan"]) == 0
    values, _ = cli_args(capsys.readouterr().out)
    assert values["--parallelism.pipeline_parallel_schedule"] == "Interleaved1F1B"
    assert values["--parallelism.data_parallel_shard_degree"] == "2"  # sharded, as measured
