"""A configuration as the snippet another training framework reads.

Pure: integers in, text out. Each framework has its own rule for how the numbers must
relate (DeepSpeed: train_batch_size = micro-batch x accumulation x world size), and most
cannot express the uneven splits mbtune measures (devices or micro-batches that differ by
one sample). Such a configuration is exported as the nearest one the framework can
express, and every change is said in ``Export.notes``:

1. the micro-batch size becomes the one that really ran (m = 5 on 8 samples runs two
   micro-batches of 4: the same measurement as m = 4);
2. the run's own recommended global batch for (n, m) is used where it has one;
3. otherwise the batch size moves to the nearest one the framework accepts for the same
   n and m (ties go up), as explore mode recommends a global batch (docs/design.md).

A sharded configuration (``trial.sharding: fsdp``: each device held its shard of the
model, FSDP2) is exported as each framework shards: transformers' ``fsdp`` and
``fsdp_config`` (FSDP2), Accelerate's FSDP plugin config, Lightning's ``FSDPStrategy``,
DeepSpeed's ZeRO stage 3 (2 where the parameters stay gathered after the forward pass),
Composer's FSDP, Megatron-LM's and NeMo's torch FSDP2 and torchtitan's data-parallel shard
degree; Cerebras has no counterpart, and says so. The configuration's ``reshard_after_forward``
picks each one's ZeRO-3-like or ZeRO-2-like setting, and its ``grad_sync: every`` becomes
Accelerate's ``sync_each_batch`` (transformers: through ``accelerator_config``), or a note.

A split model (t, p and the pipeline's schedule: mbtune.lattice's layout) is exported by
mbtune.analysis.export_parallel: Megatron-LM's, NeMo's and torchtitan's own layout, and the
others' where they have the notion (Accelerate's and Lightning's tensor parallelism,
DeepSpeed's AutoTP and pipeline, Composer's tp), or a note naming what would. The batch
arithmetic is over the d data-parallel replicas: each replica's P = B / d samples as g
micro-batches of m.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import get_args

from mbtune.analysis import export_parallel as split
from mbtune.config.trial import PRECISIONS as _TRIAL_PRECISIONS
from mbtune.config.trial import Sharding
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig, nearest_valid_batch_sizes
from mbtune.report import micro_batches, per_device_split

__all__ = [
    "FRAMEWORKS",
    "PRECISIONS",
    "RULES",
    "SHARDINGS",
    "Export",
    "check_framework",
    "expressible",
    "export_config",
]

FRAMEWORKS = (
    "accelerate", "cerebras", "composer", "deepspeed", "hf", "lightning", "megatron", "nemo",
    "torchtitan",
)  # fmt: skip

RULES = {
    "accelerate": "DataLoader batch_size x gradient_accumulation_steps x num_processes = the "
    "global batch",
    "cerebras": "batch_size divisible by num_csx, and batch_size / num_csx divisible by "
    "micro_batch_size",
    "composer": "global_train_batch_size divisible by the number of devices, and "
    "device_train_microbatch_size at most the per-device batch",
    "deepspeed": "train_batch_size = train_micro_batch_size_per_gpu x "
    "gradient_accumulation_steps x world size",
    "hf": "per_device_train_batch_size x gradient_accumulation_steps x devices = the global batch",
    "lightning": "DataLoader batch_size x accumulate_grad_batches x devices = the global batch",
    "megatron": "--global-batch-size divisible by --micro-batch-size x the data-parallel size",
    "nemo": "data.global_batch_size divisible by data.micro_batch_size x the data-parallel size",
    "torchtitan": "global_batch_size divisible by local_batch_size x the data-parallel degree "
    "(with a pipeline, local_batch_size by pipeline_parallel_microbatch_size)",
}
"""How each framework requires the numbers to relate, in its own names."""

PRECISIONS = tuple(p for p in _TRIAL_PRECISIONS if p != "auto")
"""The precisions a snippet can say: a trial's, resolved (``auto`` is decided per device)."""

SHARDINGS: tuple[str, ...] = get_args(Sharding)
"""How a trial held the model: ``none`` (each device the whole) or ``fsdp`` (its shard)."""

_TF32_CALL = 'torch.set_float32_matmul_precision("high")'

_SUFFIX = {
    "accelerate": "yaml", "cerebras": "yaml", "composer": "yaml", "deepspeed": "json",
    "hf": "json", "lightning": "py", "megatron": "args", "nemo": "py", "torchtitan": "args",
}  # fmt: skip

_NO_CHECKPOINTING_SETTING = ("accelerate", "composer", "deepspeed", "lightning")
"""Frameworks with no setting that checkpoints any model's blocks (unsharded)."""


@dataclass(frozen=True)
class Export:
    """One framework's snippet for one configuration."""

    framework: str
    config: BatchConfig
    """The configuration the snippet expresses (may differ from the measured one)."""
    text: str
    """The snippet, as the framework reads it."""
    notes: tuple[str, ...] = ()
    """What changed from the measured configuration and why, and how to launch it."""

    @property
    def filename(self) -> str:
        return _filename(self.framework)


def check_framework(framework: str) -> None:
    """Refuse a framework mbtune cannot export to, in one line naming the valid ones."""
    if framework not in FRAMEWORKS:
        raise MbtuneError(
            f"--export: unknown framework {framework!r}; valid: {', '.join(FRAMEWORKS)}"
        )


def export_config(
    framework: str,
    config: BatchConfig,
    *,
    recommended_batch_size: int | None = None,
    header: str | None = None,
    precision: str = "fp32",
    activation_checkpointing: bool = False,
    sharding: str = "none",
    reshard_after_forward: bool | None = None,
    layers: int | None = None,
) -> Export:
    """``config`` as ``framework``'s snippet, with the ``precision`` (fp32, tf32, bf16,
    fp16), the activation checkpointing (``activation_checkpointing`` or ``config``'s own)
    and the ``sharding`` (``none``, ``fsdp``) that were measured in the framework's own
    keys, or a note where it has none. ``reshard_after_forward``: whether a sharded model's
    parameters were freed after the forward pass (FSDP2's default; ZeRO-3 rather than 2);
    None: ``config``'s own. Sharded, ``config``'s ``grad_sync: every`` (gradients
    synchronised in every micro-batch) is exported where the framework has a key for it
    (transformers, Accelerate), else said in a note.
    ``header`` becomes a comment where the format has comments (YAML, Python, arguments;
    not JSON). ``layers``: the model's layers (blocks), which Megatron-LM's interleaved
    schedule is given per virtual stage (None: unknown; another argument says the same)."""
    check_framework(framework)
    if precision not in PRECISIONS:
        raise MbtuneError(
            f"--export: unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}"
        )
    if sharding not in SHARDINGS:
        raise MbtuneError(f"--export: unknown sharding {sharding!r}; valid: {', '.join(SHARDINGS)}")
    fsdp = sharding == "fsdp"
    checkpointing = activation_checkpointing or config.activation_checkpointing
    if reshard_after_forward is None:
        reshard_after_forward = config.reshard_after_forward
    exported, notes = expressible(framework, config, recommended_batch_size)
    b, n, m = exported.batch_size, exported.data_parallel, exported.micro_batch_size
    g, (t, p, schedule) = exported.grad_accum_steps, exported.layout
    if fsdp and n == 1 and t * p > 1:  # FSDP2 over a data-parallel group of one device
        fsdp = False
        notes.append(
            "sharding fsdp over 1 replica of a split model shards nothing (its data-parallel "
            "group is one device): exported unsharded"
        )
    sync_every = fsdp and config.grad_sync == "every"
    bf16, fp16, tf32 = (precision == p for p in ("bf16", "fp16", "tf32"))
    comment = f"# {header}\n" if header else ""
    ranks, staged = split.kept_layout(framework, t, p)  # launched as it trains
    launch = f"launch on {n} data-parallel device{'s' if n > 1 else ''}"
    if ranks * staged > 1:
        launch = (
            f"launch on {n * ranks * staged} devices: "
            f"{split.layout_words(n, ranks, staged, schedule)}"
        )
    if framework not in split.SPLITTERS:
        notes += split.layout_notes(framework, n, t, p, schedule, fsdp=fsdp)
    if framework == "accelerate":
        text, more = _accelerate(
            comment, n, m, g, precision, fsdp=fsdp, reshard=reshard_after_forward,
            checkpointing=checkpointing, sync_every=sync_every, tensor_parallel=t,
        )  # fmt: skip
        notes += more
    elif framework == "torchtitan":
        text, more = split.torchtitan(
            comment, b, n, m, g, t, p, schedule, precision=precision, fsdp=fsdp,
            reshard=reshard_after_forward, checkpointing=checkpointing,
            filename=_filename(framework),
        )  # fmt: skip
        notes += more
    elif framework == "nemo":
        text, more = split.nemo(
            comment, b, exported.num_devices, m, g, t, p, schedule, precision=precision,
            checkpointing=checkpointing, fsdp=fsdp, reshard=reshard_after_forward,
        )  # fmt: skip
        notes += more
    elif framework == "cerebras":
        fp16_type = "  fp16_type: bfloat16\n" if bf16 else "  fp16_type: float16\n" * fp16
        text = (
            f"{comment}train_input:\n  batch_size: {b}\n  micro_batch_size: {m}\n"
            f"model:\n  mixed_precision: {_yaml(bf16 or fp16)}\n{fp16_type}"
            f"runconfig:\n  num_csx: {n}\n"
        )
    elif framework == "composer":
        amp = "amp_bf16" if bf16 else "amp_fp16" if fp16 else "fp32"
        strategy = "FULL_SHARD" if reshard_after_forward else "SHARD_GRAD_OP"
        shard = f"  fsdp:\n    sharding_strategy: {strategy}\n" * fsdp
        shard += f"  tp:\n    tensor_parallel_degree: {t}\n" * (t > 1)
        world = f"world size {n * t}, data-parallel {n}" if t > 1 else f"world size {n}"
        text = (
            f"{comment}# {world}: each replica loads {b // n} samples per step\n"
            f"global_train_batch_size: {b}\ndevice_train_microbatch_size: {m}\n"
            f"precision: {amp}\n" + f"parallelism_config:\n{shard}" * bool(shard)
        )
    elif framework == "deepspeed":
        # DeepSpeed trains in fp32 unless its bf16 or fp16 block is enabled
        amp = {"bf16": {"enabled": True}} if bf16 else {"fp16": {"enabled": True}} if fp16 else {}
        # ZeRO-3 shards the parameters, gradients and optimizer states as FSDP2 does; ZeRO-2
        # keeps the parameters whole, as FSDP2 does between forward and backward without
        # resharding after the forward pass
        stage = 3 if reshard_after_forward else 2
        autotp = t if p == 1 else 1  # AutoTP trains a whole model, not a PipelineModule
        if (autotp > 1 or p > 1) and fsdp:  # ZeRO-3 not with AutoTP, nor 2 with a pipeline
            stage = min(stage, 1 if p > 1 else 2)
            notes.append(
                f"sharding fsdp: DeepSpeed's {'pipeline' if p > 1 else 'AutoTP'} takes ZeRO up "
                f"to stage {stage}; exported stage {stage}, which was not measured as such"
            )
        zero = {"zero_optimization": {"stage": stage}} if fsdp else {}
        tp = {"tensor_parallel": {"autotp_size": autotp}} if autotp > 1 else {}
        text = _json(
            train_batch_size=b,
            train_micro_batch_size_per_gpu=m,
            gradient_accumulation_steps=g,
            **amp,
            **zero,
            **tp,
        )
        world = n * autotp * p
        notes.append(
            f"{launch} (deepspeed --num_gpus {world} train.py); in the "
            'script deepspeed.initialize(model=model, optimizer=optimizer, config="'
            f'{_filename(framework)}") reads it'
        )
    elif framework == "hf":
        extra: dict[str, object] = {"tf32": True} if tf32 else {}
        if fsdp:  # FSDP2; checkpointing FSDP's own (transformers' advice: no extra all-gather)
            extra["fsdp"] = True
            extra["fsdp_config"] = {
                "version": 2,
                "reshard_after_forward": reshard_after_forward,
                **({"activation_checkpointing": True} if checkpointing else {}),
            }
        elif checkpointing:  # as measured: torch.utils.checkpoint, non-reentrant
            extra["activation_checkpointing"] = True
            extra["activation_checkpointing_kwargs"] = {"use_reentrant": False}
        if sync_every:  # Accelerate's GradientAccumulationPlugin, through the Trainer
            sync = {"sync_each_batch": True}
            extra["accelerator_config"] = {"gradient_accumulation_kwargs": sync}
        if fsdp:
            notes.append(
                "keys as transformers 5 reads them: fsdp true and fsdp_config's FSDP2 keys "
                "(version 2, reshard_after_forward)"
            )
        elif checkpointing:
            notes.append(
                "keys as transformers 5 reads them; transformers 4 names activation_"
                "checkpointing(_kwargs) gradient_checkpointing(_kwargs)"
            )
        text = _json(
            per_device_train_batch_size=m,
            gradient_accumulation_steps=g,
            bf16=bf16,
            fp16=fp16,
            **extra,
        )
        notes.append(
            f"{launch}; the keys are transformers.TrainingArguments': "
            f'TrainingArguments(output_dir="out", **json.load(open("{_filename(framework)}")))'
        )
    elif framework == "lightning":
        mode = "bf16-mixed" if bf16 else "16-mixed" if fp16 else "32-true"
        tf32_line = f"{_TF32_CALL}  # TF32 matmuls, as measured\n" if tf32 else ""
        strategy = "FULL_SHARD" if reshard_after_forward else "SHARD_GRAD_OP"
        # tensor parallelism: ModelParallelStrategy (FSDP2 over its data-parallel dimension)
        kind = "ModelParallelStrategy" if t > 1 else "FSDPStrategy" if fsdp else ""
        imports = (  # a script as pasted: its imports, then yours (the data, the model)
            "import torch\n" * tf32
            + "from lightning.pytorch import Trainer\n"
            + f"from lightning.pytorch.strategies import {kind}\n" * bool(kind)
            + "from torch.utils.data import DataLoader\n\n"
        )
        shard = {
            "ModelParallelStrategy": f"ModelParallelStrategy(data_parallel_size={n}, "
            f"tensor_parallel_size={t})",
            "FSDPStrategy": f'FSDPStrategy(sharding_strategy="{strategy}")',
        }.get(kind)
        text = (
            f"{comment}{imports}{tf32_line}"
            + f"strategy = {shard}\n" * bool(kind)
            + f"trainer = Trainer(devices={n * t}, accumulate_grad_batches={g}, "
            f'precision="{mode}"{", strategy=strategy" * bool(kind)})\n'
            "# train_dataset and model: yours (a torch Dataset, a LightningModule)\n"
            f"train_loader = DataLoader(train_dataset, batch_size={m})\n"
            "trainer.fit(model, train_loader)\n"
        )
        if fsdp and t == 1:
            notes.append(
                "FSDPStrategy(auto_wrap_policy={YourBlock}) makes each of your model's blocks "
                "a unit of its own, as mbtune sharded it (without it the model is one unit)"
                + "; activation_checkpointing_policy={YourBlock} checkpoints them"
                * checkpointing
            )
    else:
        text, more = split.megatron(
            comment, b, n, m, g, t, p, schedule, layers=layers,
            flags=" --bf16" * bf16 + " --fp16" * fp16, checkpointing=checkpointing, fsdp=fsdp,
            reshard=reshard_after_forward,
        )  # fmt: skip
        notes += more
    if framework not in ("deepspeed", "hf"):
        notes.append(launch)
    if framework == "cerebras" and (tf32 or checkpointing or fsdp):
        gpu_only = ["precision tf32"] * tf32 + ["activation checkpointing"] * checkpointing
        gpu_only += ["sharding fsdp"] * fsdp
        notes.append(
            f"{' and '.join(gpu_only)}: a GPU setting with no Cerebras counterpart (a CS-X "
            "system manages its own memory and arithmetic); not exported"
        )
    elif tf32 and framework not in ("hf", "lightning"):
        notes.append(
            f"precision tf32: {framework} has no setting for it; call {_TF32_CALL} before "
            "training (TF32 matmuls, fp32 everything else)"
        )
    if sync_every and framework not in ("accelerate", "hf"):
        notes.append(
            f"grad_sync every (gradients reduce-scattered in every micro-batch's backward "
            f"pass, not only the last's): {framework} has no setting for it; not exported"
        )
    sharded_setting = fsdp and framework in ("accelerate", "lightning")  # FSDP's own switch
    if checkpointing and framework in _NO_CHECKPOINTING_SETTING and not sharded_setting:
        notes.append(
            f"activation checkpointing: {framework} has no setting that turns it on for any "
            "model; checkpoint the model's blocks as mbtune did (torch.utils.checkpoint."
            "checkpoint(block, x, use_reentrant=False); a transformers model: "
            "model.activation_checkpointing_enable(), in transformers 4 "
            "gradient_checkpointing_enable())"
        )
    return Export(framework, exported, text, tuple(notes))


def _accelerate(
    comment: str,
    n: int,
    m: int,
    g: int,
    precision: str,
    *,
    fsdp: bool,
    reshard: bool,
    checkpointing: bool,
    sync_every: bool = False,
    tensor_parallel: int = 1,
) -> tuple[str, list[str]]:
    """An ``accelerate launch --config_file`` YAML (FSDP2's plugin where sharded, and with
    its parallelism_config where ``tensor_parallel`` > 1: Accelerate's tensor parallelism
    is FSDP2's), and the script's two numbers, which the config file has no key for, as its
    comment (with ``sync_every``, the accumulation plugin that synchronises every
    micro-batch)."""
    t = tensor_parallel
    kind = "FSDP" if fsdp or t > 1 else "MULTI_GPU" if n > 1 else "NO"
    mixed = {"bf16": "bf16", "fp16": "fp16"}.get(precision, "'no'")  # quoted: YAML's no is false
    accumulation = (
        f"gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps={g}, "
        "sync_each_batch=True)"
        if sync_every
        else f"gradient_accumulation_steps={g}"
    )
    plugin = "# from accelerate.utils import GradientAccumulationPlugin\n" * sync_every
    text = (
        f"{comment}# in the training script:\n"
        f"# from accelerate import Accelerator\n{plugin}"
        "# from torch.utils.data import DataLoader\n"
        f"# accelerator = Accelerator({accumulation})\n"
        f"# train_loader = DataLoader(train_dataset, batch_size={m})\n"
        f"compute_environment: LOCAL_MACHINE\ndistributed_type: {kind}\n"
        f"mixed_precision: {mixed}\nnum_machines: 1\nnum_processes: {n * t}\nmachine_rank: 0\n"
        f"use_cpu: false\ndebug: false\n"
    )
    notes = [
        f"accelerate launch --config_file {_filename('accelerate')} train.py; in the script "
        f"Accelerator({accumulation}) and DataLoader(batch_size={m}), the model, optimizer and "
        "loader passed through accelerator.prepare, and each step inside "
        "`with accelerator.accumulate(model):`"
    ]
    if fsdp or t > 1:
        text += (
            f"fsdp_config:\n  fsdp_version: 2\n  fsdp_reshard_after_forward: {_yaml(reshard)}\n"
            f"  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
            f"  fsdp_activation_checkpointing: {_yaml(checkpointing)}\n"
            f"  fsdp_state_dict_type: SHARDED_STATE_DICT\n"
        )
        notes.append(
            "fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP wraps a transformers model's "
            "_no_split_modules, one unit per block as mbtune sharded it; for another model add "
            "fsdp_transformer_layer_cls_to_wrap: YourBlock"
        )
    if t > 1:  # d replicas of t-way shards, sharded over d by FSDP2
        shard = n  # Accelerate refuses TP with plain replicas (dp_replicate_size alone)
        if not fsdp and n > 1:
            notes.append(
                f"tensor_parallel {t} over {n} unsharded replicas: Accelerate's tensor "
                f"parallelism takes no plain replicas; exported dp_shard_size {n} (FSDP2 "
                "shards what mbtune held whole), which was not measured as such"
            )
        text += (
            f"parallelism_config:\n  parallelism_config_dp_replicate_size: 1\n"
            f"  parallelism_config_dp_shard_size: {shard}\n"
            f"  parallelism_config_tp_size: {t}\n  parallelism_config_cp_size: 1\n"
        )
    return text, notes


def expressible(
    framework: str, config: BatchConfig, recommended_batch_size: int | None = None
) -> tuple[BatchConfig, list[str]]:
    """The configuration ``framework`` can express nearest to ``config``, and why it
    differs (empty notes: it is ``config`` itself)."""
    notes = []
    n, m = config.data_parallel, config.canonical_micro_batch_size
    if m != config.micro_batch_size:
        notes.append(
            f"micro_batch_size {config.micro_batch_size} runs the per-device batch "
            f"{config.per_device_batch} as {config.grad_accum_steps} micro-batches of at most "
            f"{m}: exported as micro_batch_size {m} (the same measurement)"
        )
    b = config.batch_size
    rb = recommended_batch_size
    if rb and rb != b and _fits(framework, rb, n, m):
        notes.append(
            f"batch_size {rb} is the run's recommended global batch for num_devices {n} and "
            f"micro_batch_size {m} (measured at batch_size {b})"
        )
        b = rb
    if not _fits(framework, b, n, m):
        nearest = _nearest(framework, b, n, m)
        notes.append(
            f"{framework} needs {RULES[framework]}, but batch_size {b} on {n} device"
            f"{'s' if n > 1 else ''} with micro_batch_size {m} splits unevenly "
            f"({per_device_split(BatchConfig(b, n, m))}): exported the nearest batch_size it "
            f"can express, {nearest} ({per_device_split(BatchConfig(nearest, n, m))}), which "
            "was not measured as such"
        )
        b = nearest
    exported = dataclasses.replace(config, batch_size=b, micro_batch_size=m)
    whole, rest = divmod(b // n, m)  # composer cuts micro-batches of m and a shorter last one
    # the same micro-batches as mbtune's even split exactly where the last is one short
    if framework == "composer" and rest and rest != m - 1:
        chunks = "+".join([str(m)] * whole + [str(rest)]) if whole < 8 else f"{whole}x{m}+{rest}"
        notes.append(
            f"composer splits the per-device batch {b // n} as {chunks} where mbtune measured "
            f"{micro_batches(exported)} (as many micro-batches, the same largest one)"
        )
    return exported, notes


def _fits(framework: str, batch_size: int, num_devices: int, micro_batch_size: int) -> bool:
    if batch_size < num_devices or batch_size % num_devices:
        return False  # no framework spreads a global batch unevenly over devices
    per_device = batch_size // num_devices
    if framework == "composer":  # composer cuts the last micro-batch short
        return micro_batch_size <= per_device
    return per_device % micro_batch_size == 0


def _nearest(framework: str, batch_size: int, num_devices: int, micro_batch_size: int) -> int:
    """The nearest batch size ``framework`` accepts for (n, m); a tie goes up. Above always
    fits: it is a multiple of n (x m) with a per-device share of at least ceil(B / n) >= m."""
    step = 1 if framework == "composer" else micro_batch_size
    below, above = nearest_valid_batch_sizes(batch_size, num_devices, step)
    fits = [c for c in (above, below) if c and _fits(framework, c, num_devices, micro_batch_size)]
    return min(fits, key=lambda c: abs(c - batch_size))


def _json(**values: object) -> str:
    return json.dumps(values, indent=2) + "\n"


def _yaml(flag: bool) -> str:
    return "true" if flag else "false"


def _filename(framework: str) -> str:
    return f"export-{framework}.{_SUFFIX[framework]}"
