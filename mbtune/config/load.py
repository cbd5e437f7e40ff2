"""The experiment from YAML: safe loading, ``--set`` overrides, and the conversion of each
value to its field's type.

The rules live in the dataclasses (mbtune.config.schema, mbtune.config.search,
mbtune.config.trial, mbtune.config.experiment): this module only reads YAML, checks each
mapping's keys, turns YAML's spellings into the fields' types (``8GiB`` into bytes, a list
into a tuple, ``{min, max}`` into an IntRange, a path relative to the experiment file) and
lets the dataclasses refuse what breaks a rule.
Every error is a :class:`ConfigError` whose one-line message names the field's dotted
YAML path, the rule, the value given and what would be valid.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mbtune.config.experiment import Experiment
from mbtune.config.model_options import did_you_mean
from mbtune.config.rules import ConfigError, field_kinds, kind_of, parse_memory, show
from mbtune.config.schema import LinkTier, ModelConfig, PlanConfig, RayConfig
from mbtune.config.search import IntRange, SearchConfig, SpaceConfig, StartPoint
from mbtune.config.train_input import TrainInput
from mbtune.config.trial import TrialConfig
from mbtune.lattice import ModelShape

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

__all__ = [
    "MAX_YAML_DEPTH",
    "MAX_YAML_VALUES",
    "SEARCH_SPACES_DIR",
    "apply_overrides",
    "load_experiment",
    "parse_experiment",
    "ShapeOf",
]

ShapeOf = Callable[[ModelConfig], ModelShape]
"""How a model's shape is found (mbtune.models.shape.shape_of: the config room builds no
model)."""

SEARCH_SPACES_DIR = resources.files("mbtune.search_spaces")
"""The named search spaces: search_spaces/*.yaml at the repository's top level, installed as
the package data of mbtune.search_spaces (pyproject.toml), in a wheel and an editable install."""
MAX_YAML_VALUES = 100_000
"""Most values (aliases expanded) an experiment may hold: a few dozen is typical. Bounds
the work of every later step against "billion laughs" alias bombs and cycles."""
MAX_YAML_DEPTH = 50
"""Deepest nesting an experiment may have: four levels is typical."""


# ---------------------------------------------------------------------------
# reading files


def load_experiment(
    path: str | Path, overrides: Sequence[str] = (), *, shape_of: ShapeOf | None = None
) -> Experiment:
    """Read an experiment YAML (safe loader only), apply ``--set`` overrides, validate.
    ``shape_of``: how to find the model's shape (mbtune.models.shape.shape_of), called where
    a layout splits the model, so that Megatron's rules hold the experiment from the start."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise ConfigError("", f"experiment file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError("", f"{path} is a directory; expected an experiment YAML file") from None
    except UnicodeDecodeError:
        raise ConfigError("", f"{path}: not a text file (expected UTF-8 YAML)") from None
    except OSError as e:
        raise ConfigError("", f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:  # a path no file system accepts, e.g. with a NUL character
        raise ConfigError("", f"cannot read {show(str(path))}: {e}") from None
    raw = _safe_load(text, str(path))
    raw = apply_overrides(raw, overrides)
    return parse_experiment(raw, source=path, shape_of=shape_of)


def _safe_load(text: str, where: str) -> Any:
    """YAML with the safe loader only (no tags that build Python objects), size-checked."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError("", f"{where}: invalid YAML{at}: {problem}") from None
    except RecursionError:
        raise ConfigError("", f"{where}: YAML nested too deeply") from None
    except Exception as e:  # a scalar its tag cannot build: !!int x, 2001-02-30, 10**5000
        problem = " ".join(str(e).split())[:200] or type(e).__name__
        raise ConfigError("", f"{where}: invalid YAML: {problem}") from None
    _check_size(data, where)
    return data


def _check_size(data: Any, where: str) -> None:
    """Refuse a document that expands to too many values or nests too deeply.

    Walks the document as later steps will, aliases expanded, but stops at the limits:
    a "billion laughs" or a cycle (``&a [*a]``) costs at most MAX_YAML_VALUES steps.
    """
    stack = [(data, 0)]
    seen = 0
    while stack:
        node, depth = stack.pop()
        seen += 1
        if seen > MAX_YAML_VALUES:
            raise ConfigError(
                "",
                f"{where}: more than {MAX_YAML_VALUES:,} values once YAML aliases are "
                "expanded; an experiment holds a few dozen (repeated aliases or a cycle?)",
            )
        if depth > MAX_YAML_DEPTH:
            raise ConfigError(
                "",
                f"{where}: YAML nested more than {MAX_YAML_DEPTH} levels deep; an "
                "experiment needs a few",
            )
        if isinstance(node, Mapping):
            stack.extend((v, depth + 1) for v in node.values())
            stack.extend((k, depth + 1) for k in node if not isinstance(k, str))
        elif isinstance(node, list | tuple | set | frozenset):
            stack.extend((v, depth + 1) for v in node)


def apply_overrides(raw: Any, overrides: Sequence[str]) -> Any:
    """Apply ``key.path=value`` overrides; values are parsed as YAML scalars or lists."""
    if not overrides:
        return raw
    raw = dict(raw) if isinstance(raw, Mapping) else raw
    if not isinstance(raw, dict):
        return raw  # parse_experiment reports the real problem
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(
                "--set", f"expected KEY.PATH=VALUE, e.g. train_input.batch_size=128, got {item!r}"
            )
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            child = dict(child) if isinstance(child, Mapping) else {}
            node[part] = child
            node = child
        node[parts[-1]] = _safe_load(value, f"--set {key}")
    return raw


# ---------------------------------------------------------------------------
# YAML to dataclasses


def parse_experiment(
    raw: Any, *, source: Path | None = None, shape_of: ShapeOf | None = None
) -> Experiment:
    """Build a validated Experiment from the mapping a YAML file holds (``shape_of``: as
    :func:`load_experiment`'s)."""
    base = source.parent if source is not None else Path.cwd()
    _check_size(raw, str(source) if source is not None else "the experiment")
    top = _Section(raw, "", _keys(Experiment, but=("source", "model_shape")), what="the experiment")
    model = _parse_model(top.get("model", required=True))
    train_input = _parse_train_input(top.get("train_input", required=True))
    search = _parse_search(top.get("search"), base)
    space = search.space
    split = train_input.tensor_parallel * train_input.pipeline_parallel > 1 or any(
        v is not None and (v != (1,)) for v in (space.tensor_parallel, space.pipeline_parallel)
    )
    return _build(
        Experiment,
        top,
        name=top.get("name", default=source.stem if source else None, required=source is None),
        model=model,
        train_input=train_input,
        search=search,
        model_shape=shape_of(model) if split and shape_of is not None else None,
        trial=_build(
            TrialConfig, _Section(top.get("trial"), "trial", _keys(TrialConfig)), base=base
        ),
        ray=_build(RayConfig, _Section(top.get("ray"), "ray", _keys(RayConfig))),
        plan=_parse_plan(top.get("plan"), base) if top.get("plan") is not None else None,
        source=source,
    )


def _parse_model(raw: Any) -> ModelConfig:
    if isinstance(raw, str):
        raw = {"name": raw}
    sec = _Section(raw, "model", None)
    name = sec.get("name", required=True)
    return ModelConfig(name=name, options={k: v for k, v in sec.data.items() if k != "name"})


def _parse_train_input(raw: Any) -> TrainInput:
    sec = _Section(raw, "train_input", ("num_csx", "pipeline_stages", *_keys(TrainInput)))
    alias = "num_csx" in sec.data
    if alias:
        if "num_devices" in sec.data:
            raise ConfigError(
                "train_input.num_csx", "give num_devices or its Cerebras alias num_csx, not both"
            )
        sec.data["num_devices"] = sec.data.pop("num_csx")
    if "pipeline_stages" in sec.data:
        _old_pipeline_stages(sec)
    try:
        return _build(TrainInput, sec)
    except ConfigError as e:  # name the key the file has
        if not alias or e.where != "train_input.num_devices":
            raise
        raise ConfigError("train_input.num_csx", e.rule) from None


def _old_pipeline_stages(sec: _Section) -> None:
    """``pipeline_stages``, the old name of pipeline_parallel, read as it: its num_devices
    counted the data-parallel devices alone, so the devices become n x p."""
    if "pipeline_parallel" in sec.data:
        raise ConfigError(
            "train_input.pipeline_stages",
            "give pipeline_parallel or its old name pipeline_stages, not both",
        )
    stages = sec.data.pop("pipeline_stages")
    sec.data["pipeline_parallel"] = stages
    devices = sec.data.get("num_devices", 1)
    if _is(stages, int) and _is(devices, int) and stages > 1:
        sec.data["num_devices"] = devices * stages
        print(
            f"mbtune: train_input.pipeline_stages {stages} is read as pipeline_parallel "
            f"{stages} over num_devices {devices * stages} (num_devices now counts every "
            "device: data-parallel replicas x stages)",
            file=sys.stderr,
        )


def _parse_search(raw: Any, base: Path) -> SearchConfig:
    sec = _Section(raw, "search", _keys(SearchConfig))
    converted = {}
    if sec.get("space") is not None:
        converted["space"] = _parse_space(sec.get("space"), base)
    if sec.get("start_points") is not None:
        converted["start_points"] = _parse_points(sec.get("start_points"), "search.start_points")
    return _build(SearchConfig, sec, **converted)


def _parse_plan(raw: Any, base: Path) -> PlanConfig:
    sec = _Section(raw, "plan", _keys(PlanConfig))
    converted: dict[str, Any] = {}
    for key in ("intra_node", "inter_node"):
        with _under(f"plan.{key}"):
            converted[key] = _build(LinkTier, _Section(sec.get(key), "", _keys(LinkTier)))
    for key in ("samples", "tokens", "steps"):  # PyYAML reads 1e9 (no dot, no sign) as text
        value = sec.get(key)
        if isinstance(value, str):
            try:
                number = float(value.replace("_", ""))
            except ValueError:
                continue  # the class refuses it, naming the value
            converted[key] = int(number) if key == "steps" and number.is_integer() else number
    devices = sec.get("num_devices")
    if devices is not None:
        converted["num_devices"] = (devices,) if _is(devices, int) else _tuple(devices, int)
    paths = sec.get("nccl_tests")
    if paths is not None:
        items = [paths] if isinstance(paths, str) else paths
        if isinstance(items, list) and all(isinstance(p, str) and p for p in items):
            converted["nccl_tests"] = tuple(
                _resolve(base / p, "plan.nccl_tests") if "\0" not in p else Path(p) for p in items
            )
        else:
            converted["nccl_tests"] = paths  # the class refuses it, naming the value
    return _build(PlanConfig, sec, **converted)


def _parse_points(raw: Any, where: str) -> tuple[Any, ...]:
    if not isinstance(raw, list):
        raise ConfigError(where, f"expected a list of configurations, got {kind_of(raw)}")
    points = []
    for i, item in enumerate(raw):
        with _under(f"{where}[{i}]"):
            points.append(_build(StartPoint, _Section(item, "", _keys(StartPoint))).config)
    return tuple(points)


def _parse_space(raw: Any, base: Path) -> SpaceConfig:
    where = "search.space"
    source = "inline"
    if isinstance(raw, str):
        path = _space_path(raw, base)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(where, f"cannot read space file {path}: {e}") from None
        source = raw
        raw = _safe_load(text, str(path))
    sec = _Section(raw, where, _keys(SpaceConfig, but=("source",)))
    converted: dict[str, Any] = {"source": source}
    for key in ("num_devices", "micro_batch_size", "batch_size", "tensor_parallel",
                "pipeline_parallel"):  # fmt: skip
        value = sec.get(key)
        if isinstance(value, Mapping):
            with _under(f"{where}.{key}"):
                converted[key] = _range(value)
        elif key != "batch_size":
            converted[key] = (value,) if _is(value, int) else _tuple(value, int)
    for key, kind in (
        ("activation_checkpointing", bool),
        ("reshard_after_forward", bool),
        ("grad_sync", str),
        ("pipeline_schedule", str),
    ):
        value = sec.get(key)
        if kind is str:  # a choice, in any case (as a section's choices are read)
            value = [_lower(v) for v in value] if isinstance(value, list) else _lower(value)
        converted[key] = (value,) if _is(value, kind) else _tuple(value, kind)
    return _build(SpaceConfig, sec, **converted)


def _range(raw: Mapping[str, Any]) -> IntRange:
    sec = _Section(raw, "", _keys(IntRange))
    return IntRange(sec.get("min", required=True), sec.get("max", required=True))


def _space_path(value: str, base: Path) -> Path | Traversable:
    """A space is a name from search_spaces/ (package data) or a path (relative to the
    experiment file)."""
    if value.endswith((".yaml", ".yml")) or "/" in value:
        for candidate in (base / value, Path(value)):
            if candidate.is_file():
                return candidate
        raise ConfigError("search.space", f"space file not found: {value}")
    names = sorted(p.name[: -len(".yaml")] for p in SEARCH_SPACES_DIR.iterdir()
                   if p.name.endswith(".yaml"))  # fmt: skip
    if value not in names:
        raise ConfigError(
            "search.space",
            f"unknown space {value!r}; valid: {', '.join(names)}, a path to a YAML file, or "
            f"an inline mapping{did_you_mean(value, names)}",
        )
    return SEARCH_SPACES_DIR / f"{value}.yaml"


# ---------------------------------------------------------------------------
# converting one mapping


OTHER_TOOLS_NAMES = {
    "search.max_trials": "num_samples",  # Keras Tuner, NNI
    "search.n_trials": "num_samples",  # Optuna's study.optimize
    "search.num_trials": "num_samples",
    "search.trials": "num_samples",
    "search.timeout": "time_budget_s",  # Optuna's study.optimize
    "search.time_budget": "time_budget_s",
}
"""Keys other tuners name what mbtune calls otherwise: an unknown key that is one of them
is answered with mbtune's name, where spelling alone would suggest another key
(``max_trials`` is nearest ``max_repeats``)."""


class _Section:
    """One mapping of the YAML: checks its type and its keys."""

    def __init__(
        self, raw: Any, where: str, known: Sequence[str] | None = None, *, what: str | None = None
    ) -> None:
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ConfigError(
                where, f"{what or 'this section'} must be a mapping of keys, got {kind_of(raw)}"
            )
        self.where = where
        self.data = dict(raw)
        for key in self.data:
            if not isinstance(key, str):
                raise ConfigError(self.at(str(key)), f"keys must be text, got {kind_of(key)}")
            if known is not None and key not in known:
                ours = OTHER_TOOLS_NAMES.get(self.at(key))
                hint = f" (did you mean {ours!r}?)" if ours else did_you_mean(key, known)
                raise ConfigError(
                    self.at(key), f"unknown key; valid keys: {', '.join(known)}{hint}"
                )

    def at(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, *, default: Any = None, required: bool = False) -> Any:
        """The value at ``key``; an explicit null is the default, unless it is required."""
        if key not in self.data:
            if required:
                raise ConfigError(self.at(key), "required key is missing")
            return default
        value = self.data[key]
        return default if value is None and not required else value


def _build(cls: type, sec: _Section, *, base: Path | None = None, **converted: Any) -> Any:
    """``cls`` from a mapping: each value in its field's type (a choice in lower case, a
    memory size in bytes, a path as a Path: relative to ``base`` where given, resolved),
    or as the YAML has it for the class to refuse; ``converted``: fields already built.
    A key left out, or null, takes the field's default."""
    kwargs = dict(converted)
    for f, kind in field_kinds(cls):
        if f.name in kwargs or not f.init:
            continue
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        value = sec.get(f.name, required=required)
        if value is None and not required:
            continue
        if f.metadata.get("memory"):
            value = parse_memory(value, sec.at(f.name))
        elif kind.choices and isinstance(value, str) and value.lower() in kind.choices:
            value = value.lower()
        elif kind.base is Path and isinstance(value, str) and value:
            value = Path(value)  # the class refuses a NUL character, which resolve() cannot take
            if base is not None and "\0" not in str(value):
                value = _resolve(base / value, sec.at(f.name))
        kwargs[f.name] = value
    return cls(**kwargs)


@contextmanager
def _under(where: str) -> Iterator[None]:
    """Place the errors of a value that knows no section (an IntRange, a start point)
    under the field that holds it."""
    try:
        yield
    except ConfigError as e:
        raise e.under(where) from None


def _resolve(path: Path, where: str) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise ConfigError(where, f"cannot resolve {show(str(path))}: {e}") from None


def _keys(cls: type, *, but: tuple[str, ...] = ()) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name not in but)


def _is(value: Any, kind: type) -> bool:
    """``value`` is a ``kind`` (an int is never a bool here, as in YAML)."""
    return isinstance(value, kind) and (kind is bool or not isinstance(value, bool))


def _lower(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _tuple(value: Any, kind: type) -> Any:
    """A YAML list of ``kind`` as a sorted tuple without repeats; another list as a tuple,
    and anything else as it is, for the class to refuse."""
    if not isinstance(value, list):
        return value
    if all(_is(v, kind) for v in value):
        return tuple(sorted(set(value)))
    return tuple(value)
