"""The built-in models' options, checked without importing torch (the driver of a search
validates an experiment but never builds its model)."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from types import MappingProxyType

from mbtune.errors import MbtuneError

__all__ = ["MODEL_OPTIONS", "ModelError", "check_options", "did_you_mean"]


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


def check_options(name: str, options: Mapping[str, object]) -> dict[str, object]:
    """A built-in model's defaults overlaid with `options`, each checked (ModelError)."""
    defaults = MODEL_OPTIONS[name]
    checked = dict(defaults)
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
            checked[key] = float(value)
        else:
            # a size: bool is an int to Python, but `n_layer: true` is a mistake
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelError(
                    f"model.{key}: must be a positive integer, got {value!r}; "
                    f"the default is {default!r}"
                )
            checked[key] = value
    if name == "gpt" and checked["d_model"] % checked["n_head"]:
        d_model, n_head = checked["d_model"], checked["n_head"]
        below = d_model - d_model % n_head
        valid = ", ".join(str(v) for v in (below, below + n_head) if v > 0)
        raise ModelError(
            f"model.d_model: must be divisible by model.n_head (d_model={d_model}, "
            f"n_head={n_head}); valid d_model near {d_model}: {valid}"
        )
    return checked


def did_you_mean(word: str, choices) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or nothing."""
    close = difflib.get_close_matches(word, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
