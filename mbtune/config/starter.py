"""``mbtune init``: a commented starter experiment with the keys a user most likely changes.

The text is written out line by line rather than dumped from a mapping, so that every key
keeps its comment; :func:`write_starter` parses what it renders before writing it, so a
starter is valid by construction.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from mbtune.config import schema
from mbtune.config.model_options import HF_TASKS, MODEL_OPTIONS, hf_config_key, hf_model_type
from mbtune.config.schema import SAMPLERS
from mbtune.errors import MbtuneError

__all__ = ["DEVICES", "starter_text", "write_starter"]

DEVICES = tuple(d for d in schema.DEVICES if d != "auto")
"""The devices a starter is written for: trial.device's, but ``auto``. A starter writes
what its device needs (a GPU per trial, the card's memory or a CPU's budget, a longer
timeout), so it must know the device when it is written; ``auto`` is decided only when a
trial runs, on whatever machine that is."""

_TINY_HF = {"gpt2": {"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 512}}
"""Small sizes for the hf: models the starter knows, so that a first search takes minutes."""

_MODE_NOTES = {
    "auto": "auto: the fastest divisor of the per-device batch that fits",
    "explore": "explore: every size of the space, divisible or not",
    "none": "none: no accumulation (m = the per-device batch)",
}


def starter_text(
    path: str, name: str, *, model: str = "gpt", device: str = "cpu", mode: str = "auto"
) -> str:
    """The starter experiment named ``name``, as YAML with comments; ``path``: where it will
    be, for the commands its first lines show."""
    cuda = device == "cuda"
    lines = [
        "# An mbtune experiment, written by `mbtune init`. Change what you need, then:",
        f"#   mbtune validate {path}    # is it valid? what will it do?",
        f"#   mbtune space {path}       # every configuration it would try",
        f"#   mbtune run {path}         # search; writes runs/{name}-TIMESTAMP/",
        f"name: {name}",
        *_model_lines(model),
        _line("train_input:", "what you would run without mbtune: the reference"),
        _line("  batch_size: 32", "global batch: samples per optimizer step, all devices"),
        _line(f"  micro_batch_size: {mode}", _MODE_NOTES[mode]),
        _line("  num_devices: 1", "data-parallel devices (or num_csx)"),
        "search:",
        _line("  space:", "what may vary; what it leaves out stays at train_input's"),
        _line("    num_devices: [1, 2]", "a list or {min, max}; see trial.parallel"),
        *([] if mode == "none" else ["    micro_batch_size: {min: 1, max: 32}"]),
        _line("    # batch_size: {min: 32, max: 256}", "free B: every B = n x m x g in range"),
        _line("  sampler: model", ", ".join(["model", *(s for s in SAMPLERS if s != "model")])),
        _line("  num_samples: 12", "at most this many trials"),
        _line("  time_budget_s: 1800", "... and at most this many seconds"),
        _line("  confidence_target: 90", "stop once 90% sure of the recommendation (100: never)"),
        "trial:",
        _line(f"  device: {device}", _either(schema.DEVICES)),
        _line("  parallel: simulate", "one device measured, the all-reduce modelled; or ddp"),
        _line("  precision: auto", "auto: bf16 where the card has it; or fp32, tf32, bf16, fp16"
              if cuda else "auto: fp32 on a CPU; or bf16"),
        _line("  compile: true", "torch.compile; compile time is reported apart"),
        "  warmup_steps: 2",
        _line("  measure_steps: 5", "timed optimizer steps per trial"),
        _line("  # device_memory: 40GiB", "budget per device (default: the card's memory)")
        if cuda
        else _line("  device_memory: 4GiB", "budget per device; above it a trial is oom"),
        _line(f"  timeout_s: {1200 if cuda else 600}", "a trial still running then: timeout"),
        "ray:",
        _line("  address: null", "null: an embedded Ray; auto or HOST:PORT: a cluster"),
        "  cpus_per_trial: 1",
        f"  gpus_per_trial: {1 if cuda else 0}",
        _line("  max_concurrent_trials: 1", "trials measured at once (they disturb each other)"),
        "output_dir: runs",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


def _either(choices: tuple[str, ...]) -> str:
    """``a, b or c``."""
    return f"{', '.join(choices[:-1])} or {choices[-1]}"


def _line(text: str, comment: str) -> str:
    """``text``, then ``comment`` at column 30 (or after one space, past it)."""
    return f"{text:<29} # {comment}"


def _model_lines(model: str) -> list[str]:
    if model in MODEL_OPTIONS:
        return [
            _line("model:", f"{', '.join(MODEL_OPTIONS)}, hf:<model_type> or module:function"),
            f"  name: {model}",
            *(f"  {key}: {value}" for key, value in MODEL_OPTIONS[model].items()),
        ]
    model_type = hf_model_type(model)
    if model_type is not None:
        tiny = _TINY_HF.get(model_type)
        # the layer count under the config's own name: gpt2's n_layer, t5's num_layers
        layers = hf_config_key(model_type, "num_hidden_layers")
        if tiny:
            sizes = [f"  {key}: {value}" for key, value in tiny.items()]
        elif layers:
            sizes = [_line(f"  # {layers}: 2", "any key of its config: make it small")]
        else:  # a composite config: its sizes are in its sub-configs
            sizes = ["  # any key of its config: make it small"]
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
    path: str | Path, *, model: str = "gpt", device: str = "cpu", mode: str = "auto"
) -> Path:
    """Write the starter experiment to ``path``, which must not exist; return the path."""
    from mbtune.config.load import parse_experiment

    path = Path(path)
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", path.stem)[:100].strip(".") or "experiment"
    text = starter_text(str(path), name, model=model, device=device, mode=mode)
    parse_experiment(yaml.safe_load(text), source=path)  # valid, or its one-line reason
    try:
        with path.open("x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise MbtuneError(
            f"init: {path} exists; mbtune init never overwrites a file: name another PATH"
        ) from None
    except OSError as e:
        raise MbtuneError(f"init: cannot write {path}: {e.strerror or e}") from None
    return path
