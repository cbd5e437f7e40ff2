"""``mbtune init``: a commented starter experiment with the keys a user most likely changes.

The text is written out line by line rather than dumped from a mapping, so that every key
keeps its comment; :func:`write_starter` parses what it renders before writing it, so a
starter is valid by construction. A Hugging Face model's starter names its config's own
keys (``num_hidden_layers``, ``hidden_size``, ... as its config class calls them): small on
the CPU, the model type's own defaults on CUDA. Sized by a caller that may predict memory
(``mbtune init`` passes mbtune.trial.sizing.size_starter): where the model's states
exceed one device, the starter shards it (``sharding: fsdp`` over the devices it needs),
and where sharding alone cannot hold it, splits its layers too (``tensor_parallel``, with
t and p in its space).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from mbtune.config import trial
from mbtune.config.model_options import (
    HF_TASKS,
    MODEL_OPTIONS,
    hf_config_default,
    hf_config_key,
    hf_model_type,
)
from mbtune.config.search import SAMPLERS
from mbtune.errors import MbtuneError

if TYPE_CHECKING:
    from mbtune.config.experiment import Experiment

__all__ = ["DEVICES", "HF_SIZE_KEYS", "Sizing", "starter_text", "write_starter"]

DEVICES = tuple(d for d in trial.DEVICES if d != "auto")
"""The devices a starter is written for: trial.device's, but ``auto``. A starter writes
what its device needs (the card's memory or a CPU's budget, a longer timeout; a GPU per
trial follows from the device), so it must know the device when it is written; ``auto``
is decided only when a trial runs, on whatever machine that is."""

HF_SIZE_KEYS = {
    "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4,
    "num_key_value_heads": 4, "intermediate_size": 256, "vocab_size": 512,
}  # fmt: skip
"""The sizes of a transformers config (its common names; each written under the config's
own, see model_options.hf_config_key) and the small values of a CPU starter, so that a
first search takes minutes; a CUDA starter writes the model type's defaults."""


@dataclass(frozen=True)
class Sizing:
    """How a starter's model is held: the devices of its train_input, whether they shard
    it (``sharding: fsdp``, ``parallel: ddp``), the device memory it was sized for (None:
    the starter's own), and what the sizing found, for a person."""

    num_devices: int = 1
    sharded: bool = False
    device_memory: int | None = None
    peak_memory_bytes: int | None = None
    """One device's predicted peak at the starter's smallest configuration."""
    lines: tuple[str, ...] = ()
    tensor_parallel: int = 1
    """The devices each layer is split over where sharding alone does not hold the model
    (1: none)."""
    searched_tensor_parallel: tuple[int, ...] = ()
    """The t its space lists (none: t is not searched)."""
    searched_pipeline_parallel: tuple[int, ...] = ()
    """The p its space lists (none: p is not searched)."""


_MODE_NOTES = {
    "auto": "auto: the fastest divisor of the per-device batch that fits",
    "explore": "explore: every size of the space, divisible or not",
    "none": "none: no accumulation (m = the per-device batch)",
}


def starter_text(
    path: str,
    name: str,
    *,
    model: str = "gpt",
    device: str = "cpu",
    mode: str = "auto",
    sizing: Sizing = Sizing(),
) -> str:
    """The starter experiment named ``name``, as YAML with comments; ``path``: where it will
    be, for the commands its first lines show; ``sizing``: how its model is held."""
    cuda = device == "cuda"
    n, sharded = sizing.num_devices, sizing.sharded
    t = sizing.tensor_parallel
    split = t > 1
    memory = sizing.device_memory
    lines = [
        "# An mbtune experiment, written by `mbtune init`. Change what you need, then:",
        f"#   mbtune validate {path}    # is it valid? what will it do?",
        f"#   mbtune space {path}       # every configuration it would try",
        f"#   mbtune run {path}         # search; writes runs/{name}-TIMESTAMP/",
        f"name: {name}",
        *_model_lines(model, device),
        _line("train_input:", "what you would run without mbtune: the reference"),
        _line("  batch_size: 32", "global batch: samples per optimizer step, all devices"),
        _line(f"  micro_batch_size: {mode}", _MODE_NOTES[mode]),
        _line(f"  num_devices: {n}", "every device (or num_csx): replicas x t x p"),
        *(
            [_line(f"  tensor_parallel: {t}", "devices each layer is split over (Megatron's tp)"),
             _line("  pipeline_parallel: 1", "pipeline stages (Megatron's pp)")]
            if split else []
        ),
        "search:",
        _line("  space:", "what may vary; what it leaves out stays at train_input's"),
        _line(f"    num_devices: [{n}, {2 * n}]", "a list or {min, max}; see trial.parallel"),
        *([] if mode == "none" else ["    micro_batch_size: {min: 1, max: 32}"]),
        *(
            [_line(f"    tensor_parallel: {_flow(sizing.searched_tensor_parallel)}",
                   "split layers: within a node"),
             _line(f"    pipeline_parallel: {_flow(sizing.searched_pipeline_parallel)}",
                   "pipeline stages"),
             _line("    pipeline_schedule: [1f1b, interleaved_1f1b]", "how a pipeline runs")]
            if split else []
        ),
        *(
            [_line("    # reshard_after_forward: [true, false]", "sharded: ZeRO-3 or -2-like"),
             _line("    # grad_sync: [last, every]", "sharded: reduce once a step, or each")]
            if sharded else []
        ),
        _line("    # batch_size: {min: 32, max: 256}", "free B: every B = n x m x g in range"),
        _line("  sampler: model", ", ".join(["model", *(s for s in SAMPLERS if s != "model")])),
        _line("  num_samples: 12", "at most this many trials"),
        _line("  time_budget_s: 1800", "... and at most this many seconds"),
        _line("  confidence_target: 90", "stop once 90% sure of the recommendation (100: never)"),
        "trial:",
        _line(f"  device: {device}", _either(trial.DEVICES)),
        _line("  parallel: ddp", "every device a process of its own (Ray Train)")
        if sharded
        else _line("  parallel: simulate", "one device measured, the all-reduce modelled; or ddp"),
        *(
            [_line("  sharding: fsdp", "each device holds its shard of the model (FSDP2)")]
            if sharded else []
        ),
        _line("  precision: auto", "auto: bf16 where the card has it; or fp32, tf32, bf16, fp16"
              if cuda else "auto: fp32 on a CPU; or bf16"),
        _line("  compile: true", "torch.compile; compile time is reported apart"),
        "  warmup_steps: 2",
        _line("  measure_steps: 5", "timed optimizer steps per trial"),
        _line(f"  device_memory: {_size(memory)}", "sized for it: set your card's")
        if memory is not None
        else _line("  # device_memory: 40GiB", "budget per device (default: the card's memory)")
        if cuda
        else _line("  device_memory: 4GiB", "budget per device; above it a trial is oom"),
        _line(f"  timeout_s: {1200 if cuda else 600}", "a trial still running then: timeout"),
        "ray:",
        _line("  address: null", "null: an embedded Ray; auto or HOST:PORT: a cluster"),
        "  cpus_per_trial: 1",
        _line("  max_concurrent_trials: 1", "trials measured at once (they disturb each other)"),
        "output_dir: runs",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def _flow(values: tuple[int, ...]) -> str:
    """``[1, 2]``: a YAML list on one line."""
    return f"[{', '.join(map(str, values))}]"


def _either(choices: tuple[str, ...]) -> str:
    """``a, b or c``."""
    return f"{', '.join(choices[:-1])} or {choices[-1]}"


def _line(text: str, comment: str) -> str:
    """``text``, then ``comment`` at column 30 (or after one space, past it)."""
    return f"{text:<29} # {comment}"


def _size(nbytes: int) -> str:
    """A memory size as the YAML reads it: whole GiB where it is, else MiB."""
    return f"{nbytes // 2**30}GiB" if nbytes % 2**30 == 0 else f"{nbytes // 2**20}MiB"


def _hf_sizes(model_type: str, cuda: bool) -> list[str]:
    """The config's sizes under its own names (gpt2's n_layer, t5's num_layers): small on
    the CPU (each with the type's default beside it), the type's defaults on CUDA."""
    lines = []
    for common, small in HF_SIZE_KEYS.items():
        own = hf_config_key(model_type, common)
        default = hf_config_default(model_type, own) if own else None
        if own is None or (cuda and default is None):
            continue
        if cuda:
            lines.append(_line(f"  {own}: {default}", f"{model_type}'s default"))
        else:
            shown = f"{default}" if default is not None else "from its other sizes"
            lines.append(_line(f"  {own}: {small}", f"small, for a CPU; {model_type}'s: {shown}"))
    return lines


def _model_lines(model: str, device: str = "cpu") -> list[str]:
    if model in MODEL_OPTIONS:
        return [
            _line("model:", f"{', '.join(MODEL_OPTIONS)}, hf:<model_type> or module:function"),
            f"  name: {model}",
            *(f"  {key}: {value}" for key, value in MODEL_OPTIONS[model].items()),
        ]
    model_type = hf_model_type(model)
    if model_type is not None:
        # a composite config (clip) keeps its sizes in its sub-configs
        sizes = _hf_sizes(model_type, device == "cuda") or [
            "  # any key of its config: make it small"
        ]
        return [
            _line("model:", "a Hugging Face transformers model, from its config"),
            _line(f"  name: {model}", "needs transformers: pip install 'mbtune[hf]'"),
            _line("  task: causal-lm", "or " + ", ".join(t for t in HF_TASKS if t != "causal-lm")),
            _line("  seq_len: 64", "tokens per sample"),
            *sizes,
        ]
    return [
        _line("model:", "your model, imported from the current directory:"),
        _line(f"  name: {model}", "function() -> (module, make_batch, loss)"),
        _line("  # hidden: 256", "every other key is passed to the function"),
    ]


def write_starter(
    path: str | Path,
    *,
    model: str = "gpt",
    device: str = "cpu",
    mode: str = "auto",
    size: Callable[[Experiment], Sizing] | None = None,
) -> tuple[Path, Sizing]:
    """Write the starter experiment to ``path``, which must not exist; return the path and
    how it was sized. ``size``: how its model must be held, from the starter as it is
    without (mbtune.trial.sizing.size_starter); None: one device, unsharded."""
    from mbtune.config.load import parse_experiment

    path = Path(path)
    if path.exists():  # before any sizing, which may take a while
        raise _exists(path)
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", path.stem)[:100].strip(".") or "experiment"
    text = starter_text(str(path), name, model=model, device=device, mode=mode)
    exp = parse_experiment(yaml.safe_load(text), source=path)  # valid, or its one-line reason
    sizing = size(exp) if size is not None else Sizing()
    if sizing != Sizing():
        text = starter_text(str(path), name, model=model, device=device, mode=mode, sizing=sizing)
        parse_experiment(yaml.safe_load(text), source=path)
    try:
        with path.open("x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise _exists(path) from None
    except OSError as e:
        raise MbtuneError(f"init: cannot write {path}: {e.strerror or e}") from None
    return path, sizing


def _exists(path: Path) -> MbtuneError:
    return MbtuneError(
        f"init: {path} exists; mbtune init never overwrites a file: name another PATH"
    )
