"""User models: ``model.name: package.module:function``, imported from the current
directory and called with the other keys under ``model:``.

The function returns ``(module, make_batch, loss)``; everything about that contract is
checked here, once, with a one-line ModelError naming what is wrong: the name's form, the
import, the options the function's signature takes, the three returned items, and one
small batch made on the CPU. ``model.checkpoint_blocks`` (reserved, not passed to the
function) names the class of the blocks that activation checkpointing wraps.
``experiments/user_model.py`` is a worked example.

Model parallelism (``train_input.tensor_parallel``, ``pipeline_parallel``) reads hooks on
the module the function returns (:func:`user_parallel_parts`; docs/model_parallel.md):

    tensor_parallel_plan   {"blocks.*.attn.q": "colwise", "blocks.*.attn.out": "rowwise", ...}:
                           module paths (inside a stage, or the model where it has no
                           stages) -> colwise | rowwise; its attention takes the number of
                           heads from the local width (view(B, T, -1, head_dim))
    pipeline_blocks        int: how many blocks the stages share out
    pipeline_stage(start, stop, *, first, last) -> nn.Module: a new module of copies of
                           blocks [start, stop), the inputs' layers where first, the head
                           where last
    pipeline_io(batch)     -> (stage 0's inputs as a tuple of tensors, the loss's target)
    pipeline_loss(output, target) -> a micro-batch's mean loss from the last stage's output
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import reprlib
import sys
import types
import typing
from collections import Counter
from collections.abc import Callable, Mapping

import torch
import torch.nn as nn

from mbtune.config.model_options import (
    ModelError,
    did_you_mean,
    one_line,
    split_user_options,
    user_model_parts,
)
from mbtune.models.batch import batch_tensors
from mbtune.models.checkpointing import checkpoint_blocks
from mbtune.models.parallel import TP_STYLES, ParallelParts
from mbtune.models.spec import Batch, LossFn, ModelSpec, batch_mixing_reason

__all__ = ["PIPELINE_HOOKS", "TP_PLAN_HOOK", "build_user_model", "user_parallel_parts"]

TP_PLAN_HOOK = "tensor_parallel_plan"
"""The attribute of a user model that gives its tensor-parallel plan (see the docstring)."""
PIPELINE_HOOKS = ("pipeline_blocks", "pipeline_stage", "pipeline_io", "pipeline_loss")
"""The attributes of a user model that split it into pipeline stages (see the docstring)."""

_BATCH_FORMS = "a tensor, a tuple or list of tensors, or a mapping of names to tensors"
_USER_CONTRACT = (
    "expected package.module:function where function(**options) returns "
    "(module, make_batch, loss): module a torch.nn.Module, make_batch(n, device) -> "
    f"{_BATCH_FORMS}, each with leading dimension n, loss(module, batch) -> "
    "scalar mean loss over the samples"
)


def build_user_model(
    name: str, options: Mapping[str, object], *, seed: int, activation_checkpointing: bool
) -> ModelSpec:
    """The user's model `name` (``package.module:function``) called with `options`, its
    contract checked (ModelError), seeded with `seed`, its `model.checkpoint_blocks`
    checkpointed if `activation_checkpointing`."""
    module_name, function_name = user_model_parts(name)

    # `mbtune run` from the project directory must find the project's own modules
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    importlib.invalidate_caches()
    try:
        py_module = importlib.import_module(module_name)
    except Exception as exc:
        raise ModelError(
            f"model.name: cannot import {module_name!r} ({one_line(exc)}); "
            "expected package.module:function importable from the current directory"
        ) from exc

    if not hasattr(py_module, function_name):
        public = [a for a in dir(py_module) if not a.startswith("_")]
        raise ModelError(
            f"model.name: module {module_name!r} has no attribute {function_name!r}"
            f"{did_you_mean(function_name, public)}; {_USER_CONTRACT}"
        )
    function = getattr(py_module, function_name)
    if not callable(function):
        raise ModelError(
            f"model.name: {name!r} is a {type(function).__name__}, not a function; {_USER_CONTRACT}"
        )
    block_names, options = split_user_options(options)
    _check_user_options(name, function, options)

    torch.manual_seed(seed)
    try:
        returned = function(**options)
    except Exception as exc:
        raise ModelError(
            f"model.name: {name!r} (called with {_given(options)}) raised {one_line(exc)}"
        ) from exc

    module, make_batch, loss_fn = _check_user_return(name, returned)
    _checkpoint_user_blocks(name, module, block_names, asked=activation_checkpointing)

    # one small batch, now, so a broken make_batch fails here and not in every trial;
    # on a forked RNG, so that validating does not shift the caller's random stream
    with torch.random.fork_rng(devices=[]):
        try:
            _check_batch(make_batch(2, torch.device("cpu")), 2, name)
        except ModelError:
            raise
        except Exception as exc:
            raise ModelError(
                f"model.name: make_batch(2, cpu) from {name!r} raised {one_line(exc)}"
            ) from exc

    return ModelSpec(
        module=module,
        make_batch=functools.partial(_user_batch, make_batch, name),
        loss_fn=loss_fn,
        tokens_per_sample=None,
        mixes_batch=batch_mixing_reason(module),
    )


def _check_user_options(name: str, function: Callable, options: dict[str, object]) -> None:
    """Options that the function's signature cannot take, or whose value is not of the type
    it gives them (an annotation, else its default's type), named as `model.<key>`."""
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):  # no signature to check (a C function): let the call tell
        return
    named = {
        p.name: p
        for p in params.values()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        for key in options:
            if key not in named:
                raise ModelError(
                    f"model.{key}: unknown option for model {name!r}; valid: "
                    f"{', '.join(named) or '(none)'}{did_you_mean(str(key), named)}"
                )
    hints = _type_hints(function)
    for key, value in options.items():
        param = named.get(key)
        expected = _expected_type(param, hints) if param is not None else None
        if expected is None or _accepts(expected, value):
            continue
        default = "" if param.default is inspect.Parameter.empty else f"={param.default!r}"
        takes = (
            f"{key}: {_spell(expected)}{default.replace('=', ' = ')}"
            if param.annotation is not inspect.Parameter.empty
            else f"{key}{default} (its default's type)"
        )
        raise ModelError(
            f"model.{key}: expected {_spell(expected)}, got {_SHORT.repr(value)} "
            f"({_a(type(value).__name__)}); {name!r} takes {takes}"
        )


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 40
"""An option's value in an error: a long string or list shortened."""


def _a(noun: str) -> str:
    return f"{'an' if noun[:1] in 'aeiou' else 'a'} {noun}"


def _given(options: Mapping[str, object]) -> str:
    """The options a user's function was called with, as a call spells them."""
    return ", ".join(f"{k}={_SHORT.repr(v)}" for k, v in options.items()) or "no options"


def _type_hints(function: Callable) -> dict[str, object]:
    """The function's annotations, resolved (``from __future__ import annotations`` makes
    them strings); where they cannot all be, those that are not strings."""
    try:
        return typing.get_type_hints(function)
    except Exception:
        annotations = getattr(function, "__annotations__", None)
        if not isinstance(annotations, dict):
            return {}
        return {k: v for k, v in annotations.items() if not isinstance(v, str)}


def _expected_type(param: inspect.Parameter, hints: Mapping[str, object]) -> object | None:
    """The type a parameter takes: its annotation (None where it cannot be resolved), else
    its default's type (None without a default, or with a default of None)."""
    if param.annotation is not inspect.Parameter.empty:
        return hints.get(param.name)
    if param.default is inspect.Parameter.empty or param.default is None:
        return None
    return type(param.default)


_YAML_TYPES = (bool, int, float, str, list, dict, type(None))
"""What an option read from YAML can be. A type none of them is (a Path, a torch.dtype)
is the function's to convert to: not checked."""


def _accepts(expected: object, value: object) -> bool:
    """Whether ``value``, read from YAML, is of the ``expected`` type: an int is a float,
    a list a tuple, a bool no int; True wherever that cannot be told."""
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if origin is typing.Union or origin is types.UnionType:
        return any(_accepts(arm, value) for arm in args)
    if origin is typing.Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if origin is typing.Annotated:
        return _accepts(args[0], value)
    if origin is not None:  # list[int], dict[str, float], Sequence[int]
        if not _accepts(origin, value):
            return False
        if isinstance(value, (list, tuple)) and args:
            if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
                return len(args) == len(value) and all(map(_accepts, args, value))
            return all(_accepts(args[0], item) for item in value)
        if isinstance(value, dict) and len(args) == 2:
            return all(_accepts(args[0], k) and _accepts(args[1], v) for k, v in value.items())
        return True
    if expected is None or expected is type(None):
        return value is None
    if expected in (int, float):
        kinds = (int, float) if expected is float else (int,)
        return isinstance(value, kinds) and not isinstance(value, bool)
    if expected is tuple:
        return isinstance(value, (list, tuple))
    if not isinstance(expected, type) or expected is typing.Any:
        return True
    try:
        if not any(issubclass(kind, expected) for kind in _YAML_TYPES):
            return True
        return isinstance(value, expected)
    except TypeError:  # a Protocol that is not runtime_checkable, a generic alias
        return True


def _spell(expected: object) -> str:
    """A type as an error names it: int, int or None, list[int], 'a' or 'b'."""
    origin, args = typing.get_origin(expected), typing.get_args(expected)
    if origin is typing.Union or origin is types.UnionType:
        return " or ".join(_spell(arm) for arm in args)
    if origin is typing.Literal:
        return " or ".join(repr(a) for a in args)
    if expected is None or expected is type(None):
        return "None"
    if isinstance(expected, type) and origin is None:
        return expected.__name__
    return str(expected).replace("typing.", "")


def _check_user_return(name: str, returned: object) -> tuple[nn.Module, Callable, LossFn]:
    def fail(what: str) -> ModelError:
        return ModelError(f"model.name: {name!r} returned {what}; {_USER_CONTRACT}")

    if not isinstance(returned, tuple) or len(returned) != 3:
        size = f" of {len(returned)} items" if isinstance(returned, (tuple, list)) else ""
        raise fail(f"a {type(returned).__name__}{size}, not a 3-tuple")
    module, make_batch, loss_fn = returned
    if not isinstance(module, nn.Module):
        raise fail(f"a {type(module).__name__} as first item, not a torch.nn.Module")
    if not callable(make_batch):
        raise fail(f"a {type(make_batch).__name__} as make_batch, not a function")
    if not callable(loss_fn):
        raise fail(f"a {type(loss_fn).__name__} as loss, not a function")
    return module, make_batch, loss_fn


def _check_batch(value: object, n: int, name: str) -> Batch:
    """The user's batch, unchanged, once it is checked: a tensor, a tuple or list of
    tensors, or a mapping of names to tensors, each with leading dimension n."""
    where = f"model.name: make_batch({n}, device) from {name!r} returned"
    expected = f"expected {_BATCH_FORMS}, each with leading dimension {n}"
    if isinstance(value, Mapping):
        for key, t in value.items():
            if not isinstance(key, str) or not isinstance(t, torch.Tensor):
                raise ModelError(
                    f"{where} a {type(value).__name__} whose {key!r} is a "
                    f"{type(t).__name__}, not a tensor named by a string; {expected}"
                )
    elif isinstance(value, (tuple, list)):
        for i, t in enumerate(value):
            if not isinstance(t, torch.Tensor):
                raise ModelError(
                    f"{where} a {type(value).__name__} whose item {i} is a "
                    f"{type(t).__name__}, not a tensor; {expected}"
                )
    elif not isinstance(value, torch.Tensor):
        raise ModelError(f"{where} a {type(value).__name__}; {expected}")
    tensors = batch_tensors(value)
    if not tensors:
        raise ModelError(f"{where} an empty {type(value).__name__}; {expected}")
    if any(t.dim() == 0 or t.shape[0] != n for t in tensors):
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise ModelError(
            f"{where} tensors of shapes {shapes}; every tensor must have leading "
            f"dimension {n} (one row per sample)"
        )
    return value


def _user_batch(make_batch: Callable, name: str, n: int, device: torch.device) -> Batch:
    return _check_batch(make_batch(n, device), n, name)


def _checkpoint_user_blocks(
    name: str, module: nn.Module, block_names: tuple[str, ...], *, asked: bool
) -> None:
    """Checkpoint the blocks `model.checkpoint_blocks` names, if asked; a name that matches
    no submodule fails either way (a search may turn checkpointing on later)."""
    prefix = "trial.activation_checkpointing" if asked else "model.checkpoint_blocks"
    repeated = Counter(type(sub).__name__ for sub in module.modules() if any(sub.children()))
    blocks = ", ".join(f"{c} (x{k})" for c, k in repeated.most_common(4) if k > 1) or "none"
    if not block_names:
        if asked:
            raise ModelError(
                f"{prefix}: user model {name!r} does not say what to checkpoint; set "
                "model.checkpoint_blocks to the class name of its repeated block "
                f"(its repeated submodules: {blocks}), or turn checkpointing off"
            )
        return
    classes = {type(sub).__name__ for sub in module.modules()}
    for block in block_names:
        if block not in classes:
            raise ModelError(
                f"{prefix}: model.checkpoint_blocks {block!r} matches no submodule of "
                f"{name!r}{did_you_mean(block, classes)}; its repeated submodules: {blocks}"
            )
    if asked:
        checkpoint_blocks(module, block_names)


def user_parallel_parts(module: nn.Module, *, pipeline: bool, tensor: bool) -> ParallelParts:
    """A user model's :class:`ParallelParts` from its hooks (the module's docstring), each
    the trial needs checked: the pipeline's where ``pipeline``, the plan where ``tensor``.
    Without the pipeline's hooks the whole model is the one stage, with its own loss."""
    name = type(module).__name__
    missing = [hook for hook in PIPELINE_HOOKS if not hasattr(module, hook)]
    if pipeline and missing:
        raise ModelError(
            f"train_input.pipeline_parallel: the user model {name} has no {', '.join(missing)}; "
            f"a model split into pipeline stages needs {', '.join(PIPELINE_HOOKS)} "
            "(docs/model_parallel.md), or pipeline_parallel 1"
        )
    plan = getattr(module, TP_PLAN_HOOK, None) or {}
    if tensor and not plan:
        raise ModelError(
            f"train_input.tensor_parallel: the user model {name} has no {TP_PLAN_HOOK} (module "
            "paths -> colwise or rowwise, docs/model_parallel.md); set it, or tensor_parallel 1"
        )
    bad = {path: style for path, style in dict(plan).items() if style not in TP_STYLES}
    if bad:
        path, style = next(iter(bad.items()))
        raise ModelError(
            f"model.{TP_PLAN_HOOK}: {path!r} has style {style!r}; valid: {', '.join(TP_STYLES)}"
        )
    if missing:  # tensor parallel alone: the model is its stage
        return ParallelParts(num_blocks=1, make_stage=None, io=None, loss=None, tp_plan=plan)
    return ParallelParts(
        num_blocks=int(module.pipeline_blocks),
        make_stage=module.pipeline_stage,
        io=module.pipeline_io,
        loss=module.pipeline_loss,
        tp_plan=plan,
    )
