"""How the experiment's dataclasses state and check their rules, and the one-line error.

A field's type says what it takes (``bool``, ``int``, ``float``, ``str``, ``Path``, a
``Literal`` of choices, ``| None`` where it may be unset) and its metadata the range of a
number (:func:`number`) or that it is a memory size (:func:`memory`); :func:`check_fields`
checks every field of a section against both, with the messages the YAML loader gives.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import reprlib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from mbtune.config.model_options import did_you_mean
from mbtune.errors import MbtuneError

__all__ = [
    "INT_LIMIT",
    "MAX_BYTES",
    "SIZE",
    "Bounds",
    "ConfigError",
    "FieldKind",
    "check_fields",
    "check_number",
    "field_kinds",
    "kind_of",
    "memory",
    "number",
    "parse_memory",
    "show",
]

INT_LIMIT = 2**31 - 1
"""No real batch or device count comes near this; refusing larger keeps the arithmetic fast."""
MAX_BYTES = 2**60
"""1 EiB: a larger memory size or bandwidth is a typo."""


class ConfigError(MbtuneError):
    """Bad input in an experiment; ``str()`` is the one line shown to the user."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}" if where else message)
        self.where = where
        """The field's dotted YAML path (empty for the experiment file as a whole)."""
        self.rule = message
        """The message without the field: the rule, the value given, what is valid."""

    def under(self, prefix: str) -> ConfigError:
        """The same error at ``prefix`` (a value built apart, then placed at a field)."""
        return ConfigError(f"{prefix}.{self.where}" if self.where else prefix, self.rule)


@dataclass(frozen=True, kw_only=True)
class Bounds:
    """The range of a number field (the metadata :func:`number` gives it)."""

    minimum: float = 1
    """The smallest valid value (inclusive)."""
    maximum: float = INT_LIMIT
    """The largest valid value (inclusive)."""
    below: float | None = None
    """An exclusive upper bound instead of ``maximum``."""
    positive: bool = False
    """Any number above 0 (``minimum`` and ``maximum`` unused)."""
    also: str = ""
    """Other forms the field takes, named in the message (``'auto', 'explore' or 'none'``)."""

    def valid(self, integer: bool) -> str:
        """What the field takes, as the message says it."""
        kind = "a whole number" if integer else "a number"
        if self.positive:
            return f"a positive {kind[2:]}"
        upper = f"up to (not including) {self.below}" if self.below is not None else None
        text = f"{kind} from {self.minimum} {upper or f'to {self.maximum}'}"
        return text + (f", or {self.also}" if self.also else "")


SIZE = Bounds()
"""A size listed (a space's device counts and micro-batch sizes, a plan's device counts): a
whole number from 1."""


def number(default: Any = dataclasses.MISSING, **bounds: Any) -> Any:
    """A number field with its :class:`Bounds` (default: a whole number from 1)."""
    return dataclasses.field(default=default, metadata={"bounds": Bounds(**bounds)})


def memory() -> Any:
    """A size in bytes (YAML also takes ``8GiB``, ``512MB``), unset by default."""
    return dataclasses.field(default=None, metadata={"memory": True})


def check_number(value: Any, where: str, bounds: Bounds, *, integer: bool) -> None:
    """Refuse a value that is not a number of the kind, finite, within ``bounds``."""
    valid = bounds.valid(integer)
    ok_type = isinstance(value, int) if integer else isinstance(value, int | float)
    if (
        isinstance(value, bool)
        or not ok_type
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise ConfigError(where, f"expected {valid}, got {show(value)}")
    if bounds.positive:
        if not value > 0:
            raise ConfigError(where, f"must be positive, got {show(value)}")
        return
    above = value < bounds.below if bounds.below is not None else value <= bounds.maximum
    if not (bounds.minimum <= value and above):
        raise ConfigError(where, f"{show(value)} is out of range; expected {valid}")


_MEMORY_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}  # fmt: skip
_MEMORY_RULE = "expected bytes or a size such as 8GiB, 512MB, 1.5GB"


def parse_memory(value: Any, where: str = "trial.device_memory") -> int:
    """``8GiB``, ``512MB``, ``1.5GB`` or a number of bytes -> bytes (a rate may end in /s)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size: float = value
    else:
        match = isinstance(value, str) and re.fullmatch(
            r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)(?:/s)?\s*", value
        )
        if not match or match[2].lower() not in _MEMORY_UNITS:
            raise ConfigError(where, f"{show(value)} is not a memory size; {_MEMORY_RULE}")
        size = float(match[1]) * _MEMORY_UNITS[match[2].lower()]  # inf for 400 digits
    if not size >= 1:
        raise ConfigError(where, f"must be positive, got {show(value)}; {_MEMORY_RULE}")
    if size > MAX_BYTES:
        raise ConfigError(where, f"{show(value)} is too large; {_MEMORY_RULE}, at most 1EiB")
    return int(size)


# ---------------------------------------------------------------------------
# checking a section's fields


@dataclass(frozen=True)
class FieldKind:
    """What a field's type annotation admits."""

    base: type | None
    """bool, int, float, str or Path; None: only the choices, or a type its class checks."""
    choices: tuple[Any, ...]
    """The values of a ``Literal`` in the annotation."""
    optional: bool
    """``| None``: the field may be unset."""


@functools.cache
def field_kinds(cls: type) -> tuple[tuple[dataclasses.Field, FieldKind], ...]:
    """Each field of a dataclass with what its annotation admits."""
    hints = typing.get_type_hints(cls)
    return tuple((f, _kind(hints[f.name])) for f in dataclasses.fields(cls))


def _kind(hint: Any) -> FieldKind:
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)
    args = typing.get_args(hint) if union else (hint,)
    literals = [a for a in args if typing.get_origin(a) is Literal]
    others = [a for a in args if a is not type(None) and a not in literals]
    simple = len(others) == 1 and others[0] in (bool, int, float, str, Path)
    return FieldKind(
        base=others[0] if simple else None,
        choices=tuple(c for a in literals for c in typing.get_args(a)),
        optional=type(None) in args,
    )


def check_fields(section: object, where: str) -> None:
    """Check every field of a section dataclass whose type says what it takes.

    Fields of other types (tuples, mappings, nested sections) are left to the class.
    """
    for f, kind in field_kinds(type(section)):
        value = getattr(section, f.name)
        at = f"{where}.{f.name}" if where else f.name
        if (value is None and kind.optional) or value in kind.choices:
            continue
        if f.metadata.get("memory"):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ConfigError(at, f"{show(value)} is not a memory size; {_MEMORY_RULE}")
            parse_memory(value, at)
        elif kind.base is None and kind.choices:
            hint = did_you_mean(value, kind.choices) if isinstance(value, str) else ""
            raise ConfigError(at, f"{show(value)} is not one of: {', '.join(kind.choices)}{hint}")
        elif kind.base is bool and not isinstance(value, bool):
            raise ConfigError(at, f"expected true or false, got {show(value)}")
        elif kind.base in (int, float):
            check_number(value, at, f.metadata["bounds"], integer=kind.base is int)
        elif kind.base is str and not (isinstance(value, str) and value):
            raise ConfigError(at, f"expected non-empty text, got {show(value)}")
        elif kind.base is Path:
            if not isinstance(value, Path) or not str(value):
                raise ConfigError(at, f"expected non-empty text, got {show(value)}")
            if "\0" in str(value):
                raise ConfigError(
                    at, f"{show(str(value))} is not a valid path: it holds a NUL character"
                )


# ---------------------------------------------------------------------------
# values in messages


def kind_of(value: Any) -> str:
    """A value's type as a message names it: a list, text, a mapping, int."""
    return {list: "a list", str: "text", dict: "a mapping"}.get(type(value), type(value).__name__)


def show(value: Any) -> str:
    """A value as the message shows it: on one line, and never pages long.

    reprlib bounds the work too: a list of a billion aliased items is shown in microseconds.
    """
    try:
        text = _REPR.repr(value)
    except ValueError:  # an int too long to print
        text = f"<a {type(value).__name__} too long to show>"
    text = text.replace("\n", " ")
    return text if len(text) <= 60 else text[:57] + "..."


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxstring, _REPR.maxother, _REPR.maxlong = 3, 60, 60, 60
