"""Model names and options checked without importing torch (the driver of a search
validates an experiment but never builds its model): the rule of ``model.name``, the
built-ins' options, the keys mbtune reserves for itself under an ``hf:`` model and under a
user model, and what an ``hf:`` model's config calls its sizes."""

from __future__ import annotations

import ast
import difflib
import importlib.util
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mbtune.errors import MbtuneError

__all__ = [
    "HF_NAMES",
    "HF_PREFIX",
    "HF_TASKS",
    "MODEL_OPTIONS",
    "USER_MODEL_FORM",
    "USER_MODEL_NAMES",
    "ModelError",
    "check_model_name",
    "check_options",
    "did_you_mean",
    "hf_config_default",
    "hf_config_key",
    "hf_model_type",
    "one_line",
    "split_hf_options",
    "split_user_options",
    "user_model_parts",
    "with_defaults",
]


class ModelError(MbtuneError):
    """A model name, option or user model that cannot be used; the message is one line."""


MODEL_OPTIONS: Mapping[str, Mapping[str, object]] = MappingProxyType(
    {
        "gpt": MappingProxyType(
            dict(n_layer=2, n_head=4, d_model=128, seq_len=64, vocab_size=512, dropout=0.0)
        ),
        "mlp": MappingProxyType(dict(in_features=256, hidden=512, n_layer=3, num_classes=10)),
        "cnn_bn": MappingProxyType(dict(image_size=32, channels=3, width=16, num_classes=10)),
    }
)
"""For each built-in model, its option names and default values."""

USER_MODEL_FORM = "package.module:function"
"""How a user model is named: a module importable from the current directory (Python
names joined by dots), a colon, and the function in it that builds the model."""

USER_MODEL_NAMES = f"valid: {', '.join(MODEL_OPTIONS)}, or {USER_MODEL_FORM}"
"""How an error lists the valid model names: the built-ins and the user model's form."""

HF_PREFIX = "hf:"
"""``model.name: hf:<model_type>`` builds a Hugging Face transformers model."""

HF_TASKS: Mapping[str, str] = MappingProxyType(
    {
        "causal-lm": "AutoModelForCausalLM",
        "masked-lm": "AutoModelForMaskedLM",
        "seq-classification": "AutoModelForSequenceClassification",
        "seq2seq-lm": "AutoModelForSeq2SeqLM",
        "image-classification": "AutoModelForImageClassification",
    }
)
"""``model.task`` of an ``hf:`` model -> the transformers auto class that builds it."""

HF_NAMES = "hf:<model_type> for a Hugging Face transformers model (e.g. hf:gpt2)"
"""How an error lists the ``hf:`` names among the valid ones."""

HF_RESERVED = ("task", "seq_len", "pretrained")
"""Keys under an ``hf:`` model that mbtune reads; every other key goes to the config."""

_HF_MODEL_TYPE = re.compile(r"[A-Za-z0-9][\w.-]*")
_CLASS_NAME = re.compile(r"[A-Za-z_]\w*")
_USER_NAME = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
"""USER_MODEL_FORM: ``pkg.mod:f``, never ``pkg..mod:f``, ``.mod:f`` or ``a:b:c``."""


def check_model_name(name: object) -> None:
    """The rule of ``model.name``: a built-in (:data:`MODEL_OPTIONS`), ``hf:<model_type>``
    or a user model's ``package.module:function`` (a name with a colon is one of the last
    two); ModelError names what is wrong and what is valid."""
    if not isinstance(name, str):
        raise ModelError(f"model.name: must be a string, got {name!r}; {USER_MODEL_NAMES}")
    if name in MODEL_OPTIONS or hf_model_type(name) is not None:
        return
    if ":" in name:
        user_model_parts(name)
        return
    raise ModelError(
        f"model.name: unknown model {name!r}; {USER_MODEL_NAMES}"
        f"{did_you_mean(name, MODEL_OPTIONS)}; or {HF_NAMES}"
    )


def user_model_parts(name: str) -> tuple[str, str]:
    """The module and the function of a user model's name, ``package.module:function``
    (ModelError where the name is not of that form)."""
    if _USER_NAME.fullmatch(name) is None:
        raise ModelError(
            f"model.name: {name!r} is not of the form {USER_MODEL_FORM} (Python names "
            f"joined by dots, a colon, a function's name); {USER_MODEL_NAMES}"
        )
    module, function = name.split(":")
    return module, function


def check_options(name: str, options: Mapping[str, object]) -> dict[str, object]:
    """A built-in model's defaults overlaid with `options`, each checked (ModelError)."""
    defaults = MODEL_OPTIONS[name]
    for key, value in options.items():
        if key not in defaults:
            raise ModelError(
                f"model.{key}: unknown option for model {name!r}; valid: "
                f"{', '.join(defaults)}{did_you_mean(str(key), defaults)}"
            )
        default = defaults[key]
        if isinstance(default, float):
            # a probability; an int 0 is fine, a bool never is
            ok = (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and 0.0 <= value < 1.0
            )
            if not ok:
                raise ModelError(
                    f"model.{key}: must be a float in [0, 1), got {value!r}; "
                    f"the default is {default!r}"
                )
        elif not _is_size(value):
            raise ModelError(
                f"model.{key}: must be a positive integer, got {value!r}; "
                f"the default is {default!r}"
            )
    checked = with_defaults(name, options)
    if name == "gpt" and checked["d_model"] % checked["n_head"]:
        d_model, n_head = checked["d_model"], checked["n_head"]
        below = d_model - d_model % n_head
        valid = ", ".join(str(v) for v in (below, below + n_head) if v > 0)
        raise ModelError(
            f"model.d_model: must be divisible by model.n_head (d_model={d_model}, "
            f"n_head={n_head}); valid d_model near {d_model}: {valid}"
        )
    return checked


def with_defaults(name: str, options: Mapping[str, object]) -> dict[str, object]:
    """A built-in model's defaults overlaid with `options` as :func:`check_options` passes
    them (without checking them): a probability as a float (YAML's `dropout: 0` is an int)."""
    defaults = MODEL_OPTIONS[name]
    given = {k: float(v) if isinstance(defaults.get(k), float) else v for k, v in options.items()}
    return {**defaults, **given}


def _is_size(value: object) -> bool:
    # a positive int: bool is an int to Python, but `n_layer: true` is a mistake
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def one_line(exc: BaseException) -> str:
    """An exception as one line: its type and its message, whitespace folded."""
    message = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or nothing; case does not
    count (``TPEE`` is near ``tpe``, ``block`` near ``Block``)."""
    by_folded = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(str(word).lower(), list(by_folded), n=1)
    return f" (did you mean {by_folded[close[0]]!r}?)" if close else ""


def hf_model_type(name: str) -> str | None:
    """The model type of ``hf:<model_type>`` (None for a name without the prefix)."""
    if not name.startswith(HF_PREFIX):
        return None
    model_type = name[len(HF_PREFIX) :]
    if not _HF_MODEL_TYPE.fullmatch(model_type):
        raise ModelError(
            f"model.name: {name!r} names no Hugging Face model type; expected hf:<model_type>, "
            "e.g. hf:gpt2, hf:llama, hf:bert, hf:t5"
        )
    return model_type


def hf_config_key(model_type: str, common: str) -> str | None:
    """What the transformers config of ``model_type`` calls transformers' common attribute
    ``common`` (``num_hidden_layers``, ``hidden_size``, ...): its own name where its
    ``attribute_map`` maps the common one to it (gpt2's ``n_layer``, t5's ``num_layers``),
    else ``common`` itself (llama's ``num_hidden_layers``); None where the config has
    neither (a composite model, such as clip, keeps its sizes in its sub-configs).

    Read from the config's source, not imported: importing a transformers config imports
    torch, which validating or writing an experiment never needs. ``common`` where the
    source is not at hand (transformers is not installed, or keeps the type elsewhere).
    """
    config = _hf_config_class(model_type)
    if config is None:
        return common
    names: dict[str, ast.expr | None] = {}  # the config's fields and class attributes
    for node in config.body:
        if isinstance(node, ast.Assign):
            names.update((t.id, node.value) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node.value  # a field (transformers 5)
        elif isinstance(node, ast.FunctionDef) and node.name == "__init__":  # transformers 4
            names.update((a.arg, None) for a in [*node.args.args, *node.args.kwonlyargs])
    try:
        attribute_map = ast.literal_eval(names.get("attribute_map") or "{}")
    except (ValueError, TypeError, SyntaxError):
        attribute_map = {}
    own = attribute_map.get(common, common) if isinstance(attribute_map, dict) else common
    # a config built on another one's (not transformers' base) may have the field from it
    inherits = any(
        ast.unparse(base).endswith("Config")
        and ast.unparse(base) not in ("PreTrainedConfig", "PretrainedConfig")
        for base in config.bases
    )
    return own if own in names or inherits else None


def hf_config_default(model_type: str, key: str) -> int | None:
    """The default of the field ``key`` (the config's own name, as :func:`hf_config_key`
    gives it) of transformers' config of ``model_type``, where it is a whole number written
    in its source (a transformers 5 field, or a transformers 4 ``__init__`` argument);
    None where it is not (a default computed at runtime, a composite config, no
    transformers). Read from the source, as :func:`hf_config_key`: no import."""
    config = _hf_config_class(model_type)
    if config is None:
        return None
    default: ast.expr | None = None
    for node in config.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if node.target.id == key:
                default = node.value
        elif isinstance(node, ast.FunctionDef) and node.name == "__init__":
            args = node.args
            positional = args.args[len(args.args) - len(args.defaults) :]
            pairs = [
                *zip(positional, args.defaults, strict=True),
                *zip(args.kwonlyargs, args.kw_defaults, strict=True),
            ]
            default = next((d for a, d in pairs if a.arg == key), default)
    try:
        value = ast.literal_eval(default) if default is not None else None
    except (ValueError, TypeError, SyntaxError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _hf_config_class(model_type: str) -> ast.ClassDef | None:
    """The class of transformers' config of ``model_type``, parsed from its module, where
    transformers names that module after the type; None where there is none to parse."""
    try:
        spec = importlib.util.find_spec("transformers")  # where it is; imports nothing
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    module = model_type.replace("-", "_")  # as transformers names a model type's module
    models = Path(next(iter(spec.submodule_search_locations)), "models")
    for folder in (models / module, models / "deprecated" / module):
        try:
            source = (folder / f"configuration_{module}.py").read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and any(
                isinstance(item, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "model_type" for t in item.targets)
                and isinstance(item.value, ast.Constant)
                and item.value.value == model_type
                for item in node.body
            ):
                return node
    return None


def split_hf_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """An ``hf:`` model's options as (mbtune's own: task, seq_len, pretrained; the
    transformers config's: every other key), mbtune's own checked (ModelError)."""
    own = {k: v for k, v in options.items() if k in HF_RESERVED}
    config = {k: v for k, v in options.items() if k not in HF_RESERVED}
    if "checkpoint_blocks" in config:
        raise ModelError(
            "model.checkpoint_blocks: only for user models; an hf: model checkpoints its own "
            "layers (transformers' gradient_checkpointing_enable) when "
            "trial.activation_checkpointing is on"
        )
    task = own.get("task")
    if task is not None and task not in HF_TASKS:
        raise ModelError(
            f"model.task: unknown task {task!r}; valid: {', '.join(HF_TASKS)}"
            f"{did_you_mean(str(task), HF_TASKS)}"
        )
    seq_len = own.get("seq_len")
    if seq_len is not None and not _is_size(seq_len):
        raise ModelError(f"model.seq_len: must be a positive integer, got {seq_len!r}")
    pretrained = own.get("pretrained")
    if pretrained is not None and (not isinstance(pretrained, str) or not pretrained.strip()):
        raise ModelError(
            f"model.pretrained: must be the path of a local model directory (holding its "
            f"config.json), got {pretrained!r}"
        )
    return own, config


def split_user_options(options: Mapping[str, Any]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """A user model's options as (the class names of ``model.checkpoint_blocks``, checked;
    the keyword arguments for the user's function: every other key)."""
    passed = {k: v for k, v in options.items() if k != "checkpoint_blocks"}
    if "checkpoint_blocks" not in options:
        return (), passed
    value = options["checkpoint_blocks"]
    names = [value] if isinstance(value, str) else value
    if (
        not isinstance(names, (list, tuple))
        or not names
        or not all(isinstance(c, str) and _CLASS_NAME.fullmatch(c) for c in names)
    ):
        raise ModelError(
            f"model.checkpoint_blocks: must be the class name of the model's repeated block "
            f"(e.g. Block), or a list of class names, got {value!r}"
        )
    return tuple(names), passed
