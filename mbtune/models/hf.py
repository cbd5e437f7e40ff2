"""Hugging Face transformers models as mbtune models: ``model.name: hf:<model_type>``.

The model is built with random weights from ``AutoConfig.for_model(model_type, **options)``
(no download: it works offline; throughput does not depend on the weights), or from the
config.json of a local model directory (``model.pretrained: PATH``). Every key under
``model:`` goes to the config, except mbtune's own:

    task        causal-lm (decoders), masked-lm (encoders), seq2seq-lm (encoder-decoders),
                seq-classification, image-classification; the default follows the model
    seq_len     tokens per synthetic sample (default min(128, the model's positions))
    pretrained  a local model directory whose config.json to start from (not its weights)

and ``image_size`` (the side of the synthetic images, default 224) for an image model
whose config has no image size of its own (a convolutional one).

The synthetic batch is what a collator gives the model, a dict with labels, and the loss
is ``module(**batch).loss``: a mean over tokens that every sample has as many of (no
padding), so it is also the mean over the samples and gradient accumulation is exact.

``transformers`` is an optional extra: ``pip install 'mbtune[hf]'``.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import functools
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from mbtune.config.model_options import (
    HF_TASKS,
    ModelError,
    did_you_mean,
    one_line,
    split_hf_options,
)
from mbtune.models.parallel import ParallelParts
from mbtune.models.spec import Batch, ModelSpec, batch_mixing_reason

__all__ = ["build_hf_model", "hf_parts"]

_MAPPINGS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "masked-lm": "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "seq-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "seq2seq-lm": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "image-classification": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
}
"""task -> transformers' table of the model types that have a head for it."""

_DEFAULT_TASKS = ("seq2seq-lm", "masked-lm", "causal-lm", "image-classification")
"""The default task: the first of these the model type has a head for (an encoder such as
BERT also has a causal-LM head, but is pre-trained as a masked LM)."""

_SEQ_LEN = 128
_IMAGE_SIZE = 224
_NOT_ARCHITECTURE = ("model_type", "architectures", "transformers_version", "_name_or_path",
                     "torch_dtype", "dtype")  # fmt: skip
"""Keys of a config.json that are not the model's shape: the weights' dtype among them
(the model is built in fp32; the trial chooses the precision it measures)."""
_SPECIAL_TOKENS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
_TASK_LOSSES = {
    "causal-lm": "ForCausalLM",
    "masked-lm": "ForMaskedLM",
    "seq-classification": "ForSequenceClassification",
    "seq2seq-lm": "ForConditionalGeneration",
    "image-classification": "ForImageClassification",
}
"""task -> transformers' loss for it (a key of its LOSS_MAPPING), for a model whose class
name names none (gpt2's GPT2LMHeadModel): transformers reads the loss from the class name
and, where it finds none, warns at the first loss of every model it builds."""


def build_hf_model(
    model_type: str,
    options: dict[str, Any],
    *,
    seed: int,
    activation_checkpointing: bool,
    meta: bool = False,
) -> ModelSpec:
    """The transformers model ``hf:<model_type>`` with random weights, its synthetic
    batch and loss (ModelError for an unknown type, task or option). With ``meta``, the
    model is built on torch's meta device: every check, its shapes, no memory and no
    weights (a 7B model in milliseconds), for the driver to check an experiment."""
    name = f"hf:{model_type}"
    own, config_options = split_hf_options(options)
    transformers = _import_transformers(name)
    defaults = _default_config(transformers, model_type)
    task = _task(model_type, own.get("task"))
    image_size = None
    if task == "image-classification" and not hasattr(defaults, "image_size"):
        image_size = config_options.pop("image_size", _IMAGE_SIZE)  # a CNN takes any side
    config = _config(transformers, defaults, own.get("pretrained"), config_options)
    shapes = _synthetic_shapes(config, task, own.get("seq_len"), image_size)

    torch.manual_seed(seed)
    auto_class = getattr(transformers, HF_TASKS[task])
    try:
        with torch.device("meta") if meta else contextlib.nullcontext():
            module = auto_class.from_config(config)  # fp32: the trial decides the precision
    except Exception as exc:  # e.g. a hidden size the heads do not divide
        raise ModelError(
            f"model: transformers cannot build {name} for {task} from these options "
            f"({one_line(exc)})"
        ) from exc
    module.train()
    _name_the_loss(module, task)
    if activation_checkpointing:
        if not module.supports_gradient_checkpointing:
            raise ModelError(
                f"trial.activation_checkpointing: {name} ({type(module).__name__}) does not "
                "support gradient checkpointing in transformers; turn it off for this model"
            )
        _checkpoint_layers(module)
    return ModelSpec(
        module=module,
        make_batch=functools.partial(_batch, task=task, **shapes),
        loss_fn=_loss,
        tokens_per_sample=shapes.get("seq_len"),
        mixes_batch=batch_mixing_reason(module),
    )


# -----------------------------------------------------------------------------
# the config and the task


def _import_transformers(name: str) -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise ModelError(
            f"model.name: {name} needs Hugging Face transformers, which is not installed: "
            "pip install 'mbtune[hf]'"
        ) from exc
    return transformers


def _default_config(transformers: Any, model_type: str) -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        close = difflib.get_close_matches(model_type, list(CONFIG_MAPPING_NAMES), n=3)
        hint = f" (did you mean {', '.join(f'hf:{c}' for c in close)}?)" if close else ""
        raise ModelError(
            f"model.name: transformers {transformers.__version__} has no model type "
            f"{model_type!r}{hint}; e.g. hf:gpt2, hf:llama, hf:bert, hf:t5"
        )
    return transformers.AutoConfig.for_model(model_type)


def _config(
    transformers: Any, defaults: Any, pretrained: str | None, options: dict[str, Any]
) -> Any:
    """The model's config: its ``defaults`` (or a local config.json) overlaid with
    ``options``, each of which the config must have."""
    model_type = defaults.model_type
    for key in options:
        if not hasattr(defaults, key):
            known = [*defaults.to_dict(), *type(defaults).attribute_map]
            raise ModelError(
                f"model.{key}: {type(defaults).__name__} has no option {key!r}"
                f"{did_you_mean(key, known)}; mbtune's own keys: task, seq_len, pretrained"
            )
    kwargs = {**_pretrained(model_type, pretrained), **options} if pretrained else dict(options)
    if hasattr(defaults, "use_cache"):
        kwargs.setdefault("use_cache", False)  # training never reads a KV cache
    # a small vocabulary drops the special tokens of the large one it replaces (gpt2's
    # 50256), as a tokenizer of that size would have them inside
    vocab = kwargs.get("vocab_size")
    for key in _SPECIAL_TOKENS:
        token = kwargs.get(key, getattr(defaults, key, None))
        outside = isinstance(vocab, int) and isinstance(token, int) and token >= vocab
        if outside and key not in options:
            kwargs[key] = None
    try:
        return transformers.AutoConfig.for_model(model_type, **kwargs)
    except Exception as exc:
        raise ModelError(
            f"model: transformers refused the options of hf:{model_type} ({one_line(exc)})"
        ) from exc


def _pretrained(model_type: str, path: str) -> dict[str, Any]:
    """The config.json of a local model directory, as config keys."""
    file = Path(path).expanduser() / "config.json"
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(
            f"model.pretrained: cannot read {str(file)!r} ({one_line(exc)}); expected a "
            "local model directory holding its config.json"
        ) from exc
    found = data.get("model_type") if isinstance(data, dict) else None
    if found != model_type:
        raise ModelError(
            f"model.pretrained: {str(file)!r} is the config of model type {found!r}, not "
            f"{model_type!r}; set model.name: hf:{found}"
        )
    return {k: v for k, v in data.items() if k not in _NOT_ARCHITECTURE}


def _task(model_type: str, task: str | None) -> str:
    """The task asked for, or the model's own; ModelError if it has no head for it."""
    from transformers.models.auto import modeling_auto

    heads = [t for t in HF_TASKS if model_type in getattr(modeling_auto, _MAPPINGS[t])]
    if task is None:
        task = next((t for t in _DEFAULT_TASKS if t in heads), heads[0] if heads else None)
    if task not in heads:
        raise ModelError(
            f"model.task: transformers has no {task or 'supported'} head for hf:{model_type}; "
            f"valid tasks for it: {', '.join(heads) or 'none that mbtune makes batches for'}"
        )
    return task


def _synthetic_shapes(
    config: Any, task: str, seq_len: int | None, image_size: int | None
) -> dict[str, Any]:
    """What ``_batch`` needs to make a batch of ``task`` for this config (and the two
    token ids a training batch needs that a default config may lack)."""
    if task == "image-classification":
        side = getattr(config, "image_size", None) or image_size
        channels = _needed(config, "num_channels", task)
        return {"channels": channels, "side": side, "num_labels": config.num_labels}
    positions = getattr(config, "max_position_embeddings", None)
    if seq_len is None:
        seq_len = min(_SEQ_LEN, positions or _SEQ_LEN)
    if positions and seq_len > positions:
        raise ModelError(
            f"model.seq_len: {seq_len} is more than the model's {positions} positions; use "
            f"seq_len <= {positions}, or set model.max_position_embeddings"
        )
    vocab_size = _needed(config, "vocab_size", task)
    pad = getattr(config, "pad_token_id", None)  # transformers 5: only configs that have one
    if task == "seq-classification" and pad is None:
        # transformers finds each sample's last token by its padding; a decoder has none
        pad = config.pad_token_id = vocab_size - 1
    if config.is_encoder_decoder and getattr(config, "decoder_start_token_id", None) is None:
        # the decoder's input is shifted right and starts with it (t5's hub configs: pad)
        config.decoder_start_token_id = pad if pad is not None else 0
    eos = getattr(config, "eos_token_id", None) if task == "seq-classification" else None
    return {
        "seq_len": seq_len,
        "vocab_size": vocab_size,
        "pad": pad,
        "eos": eos if isinstance(eos, int) and eos != pad else None,
        "num_labels": config.num_labels,
    }


def _needed(config: Any, key: str, task: str) -> Any:
    """The config's ``key``, which the synthetic batch of ``task`` is made from."""
    value = getattr(config, key, None)
    if value is None:
        raise ModelError(
            f"model.name: hf:{config.model_type} has no {key} in its {type(config).__name__}, "
            f"which mbtune makes its {task} batch from (a composite model, e.g. vision-language "
            "or speech, takes inputs mbtune does not make); measure it as your own "
            "package.module:function, whose make_batch gives its inputs"
        )
    return value


def _name_the_loss(module: nn.Module, task: str) -> None:
    """The task's loss, where transformers found none in the class's name (it would warn
    "`loss_type=None` was set in the config but it is unrecognized" and fall back to the
    causal LM's: for causal-lm, the same loss, without the warning)."""
    if getattr(module, "loss_type", "") is not None:  # found, or a transformers without it
        return
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING
    except ImportError:
        return
    if _TASK_LOSSES[task] in LOSS_MAPPING:
        module.loss_type = _TASK_LOSSES[task]


def _checkpoint_layers(module: nn.Module) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(module, "activation_checkpointing_enable"):  # transformers >= 5.x
        module.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        module.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# -----------------------------------------------------------------------------
# the synthetic batch and the loss


def _batch(n: int, device: torch.device, *, task: str, **shapes: Any) -> Batch:
    """What a collator gives ``task``: a dict with labels, every sample of full length."""
    if task == "image-classification":
        side = shapes["side"]
        hw = tuple(side) if isinstance(side, (list, tuple)) else (side, side)
        pixels = torch.randn((n, shapes["channels"], *hw), device=device)
        return {"pixel_values": pixels, "labels": _labels(n, shapes["num_labels"], device)}
    tokens = functools.partial(
        _tokens, n, shapes["seq_len"], shapes["vocab_size"], shapes["pad"], device
    )
    input_ids = tokens()
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    if task == "causal-lm":
        batch["labels"] = input_ids  # the model shifts them: predict the next token
    elif task == "seq-classification":
        if shapes["eos"] is not None:  # an encoder-decoder classifies at each sample's end
            input_ids[:, -1] = shapes["eos"]
        batch["labels"] = _labels(n, shapes["num_labels"], device)
    else:  # masked-lm predicts every position; seq2seq-lm a target as long as the input
        batch["labels"] = tokens()
    return batch


def _tokens(n: int, seq_len: int, vocab_size: int, pad: int | None, device) -> torch.Tensor:
    """Random token ids, never the padding id: no sample is shorter than seq_len."""
    if pad is None or not 0 <= pad < vocab_size:
        return torch.randint(vocab_size, (n, seq_len), device=device)
    ids = torch.randint(vocab_size - 1, (n, seq_len), device=device)
    return ids + (ids >= pad).long()  # skip over the padding id


def _labels(n: int, num_labels: int, device: torch.device) -> torch.Tensor:
    if num_labels == 1:  # transformers regresses a single label
        return torch.randn(n, device=device)
    return torch.randint(num_labels, (n,), device=device)


def _loss(module: nn.Module, batch: Batch) -> torch.Tensor:
    return module(**batch).loss


# -----------------------------------------------------------------------------
# model parallelism: a Llama-family decoder's stages and tensor-parallel plan

_DECODER_PARTS = ("embed_tokens", "layers", "norm", "rotary_emb")
"""What a Llama-family base model (``model.model``) holds, which its stages are made of."""


def hf_parts(module: nn.Module) -> ParallelParts:
    """How a Llama-family causal-lm decoder (Llama, Mistral, Qwen2, Qwen3...) splits into
    stages (its ``_no_split_modules`` blocks, ``model.layers``) and shards by its projection
    names: q/k/v_proj and gate/up_proj by columns, o_proj and down_proj by rows."""
    base = getattr(module, "model", None)
    layers = getattr(base, "layers", None)
    blocks = set(getattr(module, "_no_split_modules", None) or ())
    llama_like = (
        all(hasattr(base, part) for part in _DECODER_PARTS)
        and hasattr(module, "lm_head")
        and len(layers) > 0
        and type(layers[0]).__name__ in blocks
    )
    if not llama_like:
        raise ModelError(
            f"train_input.tensor_parallel / pipeline_parallel: hf:{module.config.model_type} "
            f"({type(module).__name__}) is not a Llama-family causal-lm decoder (model."
            f"{', model.'.join(_DECODER_PARTS)} and lm_head), which mbtune splits into stages "
            "and shards by heads; measure it at tensor_parallel 1 and pipeline_parallel 1"
        )
    config = module.config
    tied = module.lm_head.weight is base.embed_tokens.weight
    loss_function = module.loss_function
    return ParallelParts(
        num_blocks=len(layers),
        make_stage=functools.partial(_DecoderStage, module),
        io=lambda batch: ((batch["input_ids"],), batch["labels"]),
        loss=lambda logits, labels: loss_function(
            logits=logits, labels=labels, vocab_size=config.vocab_size
        ),
        tp_plan={
            **{f"layers.*.self_attn.{p}_proj": "colwise" for p in "qkv"},
            "layers.*.self_attn.o_proj": "rowwise",
            "layers.*.mlp.gate_proj": "colwise",
            "layers.*.mlp.up_proj": "colwise",
            "layers.*.mlp.down_proj": "rowwise",
        },
        tp_divides={
            "attention heads (model.num_attention_heads)": config.num_attention_heads,
            "key/value heads (model.num_key_value_heads)": config.num_key_value_heads,
            "MLP width (model.intermediate_size)": config.intermediate_size,
        },
        tied=(("embed_tokens.weight", "lm_head.weight"),) if tied else (),
        blocks_attr="layers",
        init=_build_init,
    )


def _build_init(module: nn.Module) -> None:
    """The draws of the model's build in one process, in their order: the modules made
    children first, each torch layer drawing in its constructor (``reset_parameters``:
    transformers makes them on the CPU), and each transformers model, once its own modules
    are made, drawing them again in its ``post_init`` (``initialize_weights``, which skips
    what an inner model's did: the decoder's before the head is made). A head tied to the
    embedding is its own weight until the build ties it, at its very end: it draws its own
    values meanwhile (on the meta device: into nothing the rank keeps), then is tied again."""
    from transformers import PreTrainedModel

    for m in module.modules():  # none initialised yet, as in a fresh build
        m.__dict__.pop("_is_hf_initialized", None)
    head, embedding = module.get_output_embeddings(), module.get_input_embeddings()
    tied = head is not None and head.weight is embedding.weight
    if tied:
        head.weight = nn.Parameter(torch.empty_like(embedding.weight))

    def build(m: nn.Module) -> None:
        for child in m.children():
            build(child)
        if type(m).__module__.startswith("torch.nn.") and hasattr(m, "reset_parameters"):
            m.reset_parameters()
        if isinstance(m, PreTrainedModel):
            m.initialize_weights()

    build(module)
    if tied:
        head.weight = embedding.weight


class _DecoderStage(nn.Module):
    """One pipeline stage of a Llama-family decoder: copies of its layers ``[start, stop)``
    and its rotary embedding, of the token embedding on the first stage and of the final
    norm and head on the last. Its layers run as the decoder's own forward runs them."""

    def __init__(self, model: nn.Module, start: int, stop: int, *, first: bool, last: bool):
        super().__init__()
        memo: dict[int, object] = {}
        self.copied_from: dict[str, str] = {}
        """Each part's path here -> the path of the model's module it copies."""

        def own(path: str, source: str) -> nn.Module:
            self.copied_from[path] = source
            return copy.deepcopy(model.get_submodule(source), memo)

        self.config = model.config
        self.shard_blocks = (type(model.model.layers[0]).__name__,)  # an FSDP unit each
        self.embed_tokens = own("embed_tokens", "model.embed_tokens") if first else None
        self.rotary_emb = own("rotary_emb", "model.rotary_emb")  # each stage places positions
        self.layers = nn.ModuleList(
            own(f"layers.{i - start}", f"model.layers.{i}") for i in range(start, stop)
        )
        self.norm = own("norm", "model.norm") if last else None
        self.lm_head = own("lm_head", "lm_head") if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        if self.embed_tokens is not None:  # x: token ids (B, T)
            x = self.embed_tokens(x)
        positions = torch.arange(x.size(1), device=x.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=x, attention_mask=None, cache=None,
            position_ids=positions,
        )  # fmt: skip
        rope = self.rotary_emb(x, position_ids=positions)
        for layer in self.layers:  # x: (B, T, hidden_size)
            x = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rope)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))  # (B, T, vocab_size) logits
        return x
