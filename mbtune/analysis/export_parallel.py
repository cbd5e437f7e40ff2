"""A split model (t, p and the pipeline's schedule) as the frameworks that split models
read it: Megatron-LM's arguments, NeMo 2's recipe fields and torchtitan's command line;
and, for the others, the layout in their own keys where they have the notion, or a note
that says they have not and names what would.

Pure, like mbtune.analysis.export, whose ``export_config`` calls these with the numbers of
the configuration it exports: B (``b``), d data-parallel replicas, m, g micro-batches per
replica, t, p and the schedule (the vocabulary of mbtune.lattice). Megatron-LM and NeMo run
1F1B, or with v = 2 stages per rank its interleaved form; gpipe becomes 1F1B (the same
bubble, fewer micro-batches' activations held) and the zero-bubble V schedules (zbv,
dualpipev) the interleaved 1F1B of the same two stages per rank, each said in a note.
torchtitan runs every schedule mbtune measures, by torch.distributed.pipelining's names.
"""

from __future__ import annotations

from mbtune.lattice import stages_per_rank

__all__ = [
    "SPLITTERS",
    "TORCHTITAN_SCHEDULES",
    "kept_layout",
    "layout_notes",
    "layout_words",
    "megatron",
    "megatron_schedule",
    "nemo",
    "torchtitan",
]

TORCHTITAN_SCHEDULES = {
    "gpipe": "GPipe", "1f1b": "1F1B", "interleaved_1f1b": "Interleaved1F1B",
    "zbv": "ZBVZeroBubble", "dualpipev": "DualPipeV",
}  # fmt: skip
"""mbtune's schedules by torchtitan's ``pipeline_parallel_schedule`` names (torch's
``get_schedule_class``)."""

SPLITTERS = ("megatron", "nemo", "torchtitan")
"""The exports that split a model as mbtune measured it, by their own arguments."""
_SPLITTERS = f"{', '.join(SPLITTERS[:-1])} or {SPLITTERS[-1]}"  # in a note's words


def kept_layout(framework: str, t: int, p: int) -> tuple[int, int]:
    """The tensor- and pipeline-parallel sizes ``framework``'s export trains, which it is
    launched with (:func:`layout_notes` says what it leaves): every split in the
    :data:`SPLITTERS` and DeepSpeed (its PipelineModule), none on Cerebras (a CS-X holds
    each layer whole), the tensor-parallel one alone elsewhere (no pipeline)."""
    if framework == "cerebras":
        return 1, 1
    return t, p if framework in (*SPLITTERS, "deepspeed") else 1


def layout_words(d: int, t: int, p: int, schedule: str) -> str:
    """``d`` replicas of a model split ``t`` x ``p``, in words: "2 data-parallel x 2
    tensor-parallel x 2 pipeline stages (1f1b)"; the plain "2 data-parallel" unsplit."""
    words = [f"{d} data-parallel"]
    words += [f"{t} tensor-parallel"] * (t > 1)
    words += [f"{p} pipeline stages ({schedule})"] * (p > 1)
    return " x ".join(words)


def megatron_schedule(p: int, g: int, schedule: str) -> tuple[int, str | None]:
    """The virtual stages per rank Megatron-LM runs for ``schedule`` (1: 1F1B) and why it
    differs from what was measured (None: it does not). Megatron's interleaved schedule
    needs the micro-batches in groups of p (g a multiple of p)."""
    if p == 1:
        return 1, None
    if schedule == "gpipe":
        return 1, (
            "pipeline_schedule gpipe: Megatron-LM has no GPipe schedule; exported its 1F1B "
            "(the same bubble, (p - 1) / g, with at most p micro-batches' activations held "
            "where GPipe holds g), which was not measured as such"
        )
    if schedule in ("zbv", "dualpipev"):
        fits = g % p == 0
        instead = (
            "its interleaved 1F1B with the same 2 stages per rank (bubble (p - 1) / (2 g), "
            "about three times a zero-bubble schedule's)"
            if fits
            else f"its 1F1B ({g} micro-batches are not a multiple of pipeline_parallel {p}, "
            "as its interleaved schedule needs)"
        )
        return (2 if fits else 1), (
            f"pipeline_schedule {schedule}: Megatron-LM has no zero-bubble V schedule; "
            f"exported {instead}, which was not measured as such; torchtitan runs {schedule} "
            f"as measured (pipeline_parallel_schedule {TORCHTITAN_SCHEDULES[schedule]})"
        )
    return stages_per_rank(schedule), None


def megatron(
    comment: str, b: int, d: int, m: int, g: int, t: int, p: int, schedule: str, *,
    layers: int | None, flags: str, checkpointing: bool, fsdp: bool, reshard: bool,
) -> tuple[str, list[str]]:  # fmt: skip
    """Megatron-LM's arguments (``pretrain_gpt.py``'s): the layout, the batch, ``flags``
    (the precision), full recomputation of each layer where checkpointed, torch FSDP2
    where sharded (the distributed optimizer with a pipeline: Megatron's FSDP2 refuses
    one); with its notes."""
    notes: list[str] = []
    v, said = megatron_schedule(p, g, schedule)
    notes += [said] * (said is not None)
    layout = f" --tensor-model-parallel-size {t}" * (t > 1)
    layout += f" --pipeline-model-parallel-size {p}" * (p > 1)
    if v > 1 and layers and layers % (p * v) == 0:
        layout += f" --num-layers-per-virtual-pipeline-stage {layers // (p * v)}"
    elif v > 1:
        layout += f" --num-virtual-stages-per-pipeline-rank {v}"
        unknown = f"{layers}, not a multiple of {p * v}" if layers else "unknown here"
        notes.append(
            f"the model's layers are {unknown}: --num-virtual-stages-per-pipeline-rank {v} "
            "(Megatron-LM core 0.11 on); an older Megatron-LM takes "
            f"--num-layers-per-virtual-pipeline-stage (its layers / {p * v})"
        )
    # mbtune recomputes whole transformer blocks: Megatron's full granularity, each layer
    recompute = " --recompute-granularity full --recompute-method uniform"
    recompute += " --recompute-num-layers 1"
    if fsdp and p > 1:
        shard = " --use-distributed-optimizer"
        notes.append(
            "sharding fsdp: Megatron-LM's torch FSDP2 (--use-torch-fsdp2) refuses pipeline "
            "parallelism; exported its distributed optimizer (--use-distributed-optimizer: "
            "the optimizer's states sharded over the data-parallel group, the parameters and "
            "gradients whole), which was not measured as such"
        )
    elif fsdp:
        shard = " --use-torch-fsdp2 --no-gradient-accumulation-fusion --ckpt-format torch_dist"
        shard += " --untie-embeddings-and-output-weights"
        shard += " --torch-fsdp2-no-reshard-after-forward" * (not reshard)
        notes.append(
            "Megatron-LM's torch FSDP2 needs --untie-embeddings-and-output-weights (an output "
            "layer of its own, not the embedding's: more parameters than a tied model)"
        )
    else:
        shard = ""
    split = [f"tensor-parallel size {t}"] * (t > 1) + [f"pipeline-parallel size {p}"] * (p > 1)
    text = (
        f"{comment}# {', '.join([*split, f'data-parallel size {d}'])}: {g} micro-batches per "
        f"step on each replica\n{layout.lstrip()}{' ' * bool(layout)}--micro-batch-size {m} "
        f"--global-batch-size {b}{flags}{recompute * checkpointing}{shard}\n"
    )
    if t > 1 and "--use-torch-fsdp2" not in shard:
        notes.append(
            "Megatron-LM's tensor parallelism needs CUDA_DEVICE_MAX_CONNECTIONS=1 in the "
            "environment before Blackwell GPUs"
        )
    return text, notes


def nemo(
    comment: str, b: int, n: int, m: int, g: int, t: int, p: int, schedule: str, *,
    precision: str, checkpointing: bool, fsdp: bool, reshard: bool,
) -> tuple[str, list[str]]:  # fmt: skip
    """NeMo 2's recipe fields (``nemo.collections.llm``'s recipes: a NeMo-Run
    ``run.Partial`` whose ``trainer.strategy`` is a MegatronStrategy and ``data`` a data
    module), set on the user's ``recipe`` in Python; with its notes."""
    notes: list[str] = []
    v, said = megatron_schedule(p, g, schedule)
    notes += [said] * (said is not None)
    imports = "import torch\nimport nemo_run as run\nfrom nemo import lightning as nl\n"
    plugin = (
        'run.Config(nl.MegatronMixedPrecision, precision="32", params_dtype=torch.float32, '
        "pipeline_dtype=torch.float32)"
    )
    if precision in ("bf16", "fp16"):
        name = f"{precision}_mixed"
        imports = f"from nemo.collections.llm.recipes.precision.mixed_precision import {name}\n"
        plugin = f"{name}()"
    strategy = "recipe.trainer.strategy"
    lines = [
        f"recipe.trainer.devices = {n}  # per node: with N nodes, num_nodes N and {n} / N",
        "recipe.trainer.num_nodes = 1",
        f"{strategy}.tensor_model_parallel_size = {t}",
        f"{strategy}.pipeline_model_parallel_size = {p}",
        f"{strategy}.virtual_pipeline_model_parallel_size = {v if v > 1 else None}",
        f"{strategy}.sequence_parallel = False",
        f"recipe.trainer.plugins = {plugin}",
        f"recipe.data.micro_batch_size = {m}",
        f"recipe.data.global_batch_size = {b}",
    ]
    if fsdp and p == 1:
        lines.append(f'{strategy}.fsdp = "pytorch"  # torch FSDP2')
        notes += [
            "reshard_after_forward false (parameters kept gathered after the forward pass): "
            "NeMo's torch FSDP2 has no setting for it; not exported"
        ] * (not reshard)
    elif fsdp:
        notes.append(
            "sharding fsdp: NeMo's torch FSDP2 (trainer.strategy.fsdp) is Megatron-LM's, which "
            "refuses pipeline parallelism; keep the recipe's distributed optimizer "
            "(optim.config.use_distributed_optimizer: the optimizer's states sharded), which "
            "was not measured as such"
        )
    if checkpointing:  # megatron.core's TransformerConfig: every layer recomputed whole
        lines += [
            'recipe.model.config.recompute_granularity = "full"',
            'recipe.model.config.recompute_method = "uniform"',
            "recipe.model.config.recompute_num_layers = 1",
        ]
    text = (
        f"{comment}# recipe: your NeMo 2 recipe, e.g. from nemo.collections import llm; "
        "recipe = llm.llama3_8b.pretrain_recipe()\n"
        f"{imports}\n" + "".join(f"{line}\n" for line in lines)
    )
    notes.append(
        "NeMo 2's recipe fields (nemo_toolkit 2.x, nemo.collections.llm); NeMo 3 trains "
        "language models with Megatron Bridge, whose ConfigContainer has the same values as "
        "cfg.model.tensor_model_parallel_size, pipeline_model_parallel_size, "
        "virtual_pipeline_model_parallel_size and cfg.train.micro_batch_size, global_batch_size"
    )
    return text, notes


def torchtitan(
    comment: str, b: int, d: int, m: int, g: int, t: int, p: int, schedule: str, *,
    precision: str, fsdp: bool, reshard: bool, checkpointing: bool, filename: str,
) -> tuple[str, list[str]]:  # fmt: skip
    """torchtitan's command line (0.3's ConfigManager: ``--section.key value`` over a
    config of its registry): the data-parallel shard degree d where sharded (FSDP2), else
    its replicate degree d; the tensor-parallel degree and the pipeline's degree, schedule
    and micro-batch. Without a pipeline a step's g micro-batches are its gradient
    accumulation (local batch m); with one they are the pipeline's micro-batches of one
    local batch (m x g), as its schedule needs them."""
    param = "bfloat16" if precision == "bf16" else "float32"
    shard, replicate = (d, 1) if fsdp else (1, d)
    local = m * g if p > 1 else m
    lines = [
        f"--training.local_batch_size {local} --training.global_batch_size {b}",
        f"--training.mixed_precision_param {param} --training.mixed_precision_reduce float32",
        f"--parallelism.data_parallel_shard_degree {shard} "
        f"--parallelism.data_parallel_replicate_degree {replicate}"
        + f" --parallelism.fsdp_reshard_after_forward {'always' if reshard else 'never'}"
        * fsdp,
    ]
    notes = [
        f"torchrun --nproc-per-node {d * t * p} -m torchtitan.train --module YOUR_MODEL --config "
        f"YOUR_CONFIG $(grep -v '^#' {filename}): torchtitan 0.3's command line; before 0.3 its "
        "TOML job config held the same keys ([training] local_batch_size = ...)"
    ]
    if t > 1:
        lines.append(
            f"--parallelism.tensor_parallel_degree {t} --parallelism.no-enable-sequence-parallel"
        )
        notes.append(
            "sequence parallelism off, as measured; torchtitan's default turns it on (less "
            "activation memory for the same traffic)"
        )
    if p > 1:
        lines += [
            "--training.disable_cuda_graphs "  # torchtitan's CUDA graphs take no pipeline
            f"--parallelism.pipeline_parallel_degree {p} --parallelism.pipeline_parallel_schedule "
            f"{TORCHTITAN_SCHEDULES[schedule]} --parallelism.pipeline_parallel_microbatch_size {m}",
            "--parallelism.pipeline_parallel_first_stage_less_layers 0 "
            "--parallelism.pipeline_parallel_last_stage_less_layers 0",
        ]
    lines.append(f"activation-checkpoint:{'full' if checkpointing else 'none'}")
    if precision == "fp16":
        notes.append(
            "precision fp16: torchtitan trains in bfloat16 or float32 only; exported float32 "
            "(mixed_precision_param), which was not measured as such"
        )
    return comment + "".join(f"{line}\n" for line in lines), notes


def layout_notes(framework: str, d: int, t: int, p: int, schedule: str, *, fsdp: bool) -> list[str]:
    """What ``framework`` (one that does not split a model by its own arguments) says of
    the layout it exports or cannot: the pipeline where it has none (all but DeepSpeed),
    tensor parallelism where it needs more than its keys."""
    notes = []
    if framework == "cerebras" and t * p > 1:
        return [
            f"{layout_words(d, t, p, schedule)}: a CS-X holds each layer whole (weights "
            "streamed), so tensor and pipeline parallelism have no Cerebras counterpart; "
            f"num_csx is the data-parallel {d}; not exported"
        ]
    if p > 1 and framework == "deepspeed":
        notes.append(
            f"pipeline_parallel {p}: build the model as deepspeed.pipe.PipelineModule(layers="
            f"..., num_stages={p}) and step it with engine.train_batch(); DeepSpeed runs its "
            f"own 1F1B-like schedule (TrainSchedule: {schedule} was measured) with "
            "gradient_accumulation_steps micro-batches per step, and ZeRO at stage 1 at most"
        )
    elif p > 1:
        replicas = "the replica's" if d == 1 else f"the {d} replicas'"
        notes.append(
            f"pipeline_parallel {p} ({schedule}): {framework} trains no pipeline; exported "
            f"{replicas} batches without the pipeline's split ({d * t} "
            f"device{'s' * (d * t > 1)} instead of {d * t * p}), which was not measured as "
            f"such; the {_SPLITTERS} export splits it as measured"
        )
    if t > 1 and framework == "hf":
        notes.append(
            f"tensor_parallel {t}: TrainingArguments(..., parallelism_config=ParallelismConfig("
            f"dp_{'shard' if fsdp else 'replicate'}_size={d}, tp_size={t})) (from accelerate "
            "import ParallelismConfig) with FSDP2 (fsdp true, fsdp_config version 2), the "
            'model loaded with tp_plan="auto" (a transformers model with a tensor-parallel plan)'
        )
    elif t > 1 and framework == "accelerate":
        notes.append(
            f"tensor_parallel {t}: Accelerate's parallelism_config (FSDP2 with tp_size {t}) "
            'shards a transformers model loaded with tp_plan="auto"'
        )
    elif t > 1 and framework == "lightning":
        notes.append(
            f"tensor_parallel {t}: ModelParallelStrategy splits nothing itself: your "
            "LightningModule's configure_model applies the plan over "
            'self.device_mesh["tensor_parallel"] (torch\'s parallelize_module) and, sharded, '
            'fully_shard over self.device_mesh["data_parallel"]'
        )
    elif t > 1 and framework == "composer":
        notes.append(
            f"tensor_parallel {t}: composer's tp needs its layer_plan, your model's module "
            "names to torch ParallelStyles (Python, not YAML), and FSDP beside it"
        )
    elif t > 1 and framework == "deepspeed" and p > 1:
        notes.append(
            f"tensor_parallel {t}: DeepSpeed documents AutoTP training for a whole model, "
            f"not a PipelineModule; not exported (the {_SPLITTERS} export splits it)"
        )
    return notes
