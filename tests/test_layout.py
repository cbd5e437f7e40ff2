"""The package's shape, kept true: every module on docs/design.md's map, no import circle,
no module over 500 lines, no private name borrowed from another module, and no private
attribute of Ray or Optuna. Read from the source with `ast`; nothing is imported."""

from __future__ import annotations

import ast
import graphlib
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mbtune"
DESIGN = ROOT / "docs" / "design.md"
FOREIGN = ("ray", "optuna")
"""The libraries whose private attributes mbtune must not use: their private parts change
without notice between releases."""


def modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def package_of(module: str) -> str:
    """The package a module's relative imports start from."""
    return module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]


@dataclass(frozen=True, kw_only=True)
class Import:
    """One name an mbtune module takes from another."""

    module: str
    """The mbtune module imported from (or imported itself)."""
    name: str | None
    """The name taken from it; None where the module itself is imported."""
    line: int
    """Where, in the importing module."""


def mbtune_imports(module: str, tree: ast.Module) -> list[Import]:
    """What `module` imports from mbtune, relative imports resolved; a module imported by
    `from package import module` counts as the module."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [Import(module=a.name, name=None, line=node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package_of(module).split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for a in node.names:
                if f"{base}.{a.name}" in MODULES:
                    found.append(Import(module=f"{base}.{a.name}", name=None, line=node.lineno))
                else:
                    found.append(Import(module=base, name=a.name, line=node.lineno))
    return [i for i in found if i.module.split(".")[0] == PACKAGE.name]


def parsed() -> dict[str, ast.Module]:
    return {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


TREES = parsed()


# --- the map ----------------------------------------------------------------------------


def mapped_modules(text: str) -> set[str]:
    """The modules named in the first column of the "Module map" table: `name`,
    `package.module` or `package/module.py`, relative to mbtune/."""
    section = text.split("## Module map", 1)[1].split("\n## ", 1)[0]
    names = set()
    for row in re.findall(r"^\|([^|\n]*)\|", section, flags=re.MULTILINE):
        for cell in re.findall(r"`([^`]+)`", row):
            names.add(cell.removeprefix("mbtune/").removesuffix(".py").replace("/", "."))
    return names


def test_every_module_is_on_the_design_map():
    """A module nobody can find on the map is a module nobody knows the purpose of; the
    package itself and its `python -m` entry point are CONTRIBUTING.md's."""
    mapped = mapped_modules(DESIGN.read_text())
    missing = [
        name.removeprefix("mbtune.")
        for name in MODULES
        if name not in ("mbtune", "mbtune.__main__") and name.removeprefix("mbtune.") not in mapped
    ]
    assert not missing, f"modules missing from docs/design.md's module map: {missing}"


def test_every_module_is_named_in_contributing():
    """CONTRIBUTING.md's "How the package is laid out" names each module (a package's
    private modules by their own names), for the newcomer who starts there."""
    text = (ROOT / "CONTRIBUTING.md").read_text()
    section = text.split("## How the package is laid out", 1)[1]
    prose = re.sub(r"```.*?```", "", section.split("\n## ", 1)[0], flags=re.DOTALL)
    named = set(re.findall(r"`([^`]+)`", prose))
    missing = [m for m in MODULES if m != "mbtune" and m.rpartition(".")[2] not in named]
    assert not missing, (
        f"modules CONTRIBUTING.md's How the package is laid out does not name: {missing}"
    )


def test_every_module_on_the_design_map_exists():
    stale = sorted(m for m in mapped_modules(DESIGN.read_text()) if f"mbtune.{m}" not in MODULES)
    assert not stale, f"docs/design.md's module map names modules that are gone: {stale}"


def test_the_map_reader_reads_every_form_of_a_name():
    text = "## Module map\n\n| module | owns |\n| --- | --- |\n| `a` | x `b` |\n| `c.d`, `mbtune/e/f.py` | y |\n\n## Next\n| `g` | z |\n"  # noqa: E501
    assert mapped_modules(text) == {"a", "c.d", "e.f"}


# --- the shape --------------------------------------------------------------------------

MAX_LINES = 500
"""The longest a module may be: one longer holds more than one concern; split it by them,
the split saying what each part is for (docs/design.md's map)."""


def too_long(modules: dict[str, Path], limit: int = MAX_LINES) -> list[str]:
    """``name: N lines`` for each of ``modules`` (a path by its name) longer than ``limit``."""
    counts = {name: len(path.read_text().splitlines()) for name, path in modules.items()}
    return [f"{name}: {n} lines" for name, n in counts.items() if n > limit]


def test_no_module_is_over_500_lines():
    long = too_long(MODULES)
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_line_count_refuses_a_501_line_module(tmp_path):
    module = tmp_path / "long.py"
    module.write_text("x = 1\n" * 501)
    assert too_long({"long": module}) == ["long: 501 lines"]
    module.write_text("x = 1\n" * 500)
    assert too_long({"long": module}) == []


def test_no_import_circle():
    graph = {
        name: {i.module for i in mbtune_imports(name, tree) if i.module in MODULES} - {name}
        for name, tree in TREES.items()
    }
    try:
        tuple(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        pytest.fail(f"import circle: {' -> '.join(e.args[1])}")


LAYERS: dict[str, set[str]] = {
    "errors": set(),
    "lattice": {"errors"},
    "comm": {"lattice"},
    "config": {"errors", "lattice"},
    "metrics": {"lattice", "runs"},
    "progress": {"lattice", "runs", "metrics"},
    "cluster": {"mbtune", "errors"},
    "runs": {"errors", "lattice", "config"},
    "models": {"errors", "lattice", "config"},
    "trial": {"errors", "lattice", "comm", "config", "models", "progress", "cluster"},
    "report": {"errors", "lattice", "config", "runs", "trial"},
    "recommend": {"errors", "lattice", "comm", "config", "runs", "report"},
    "analysis": {"mbtune", "errors", "lattice", "config", "runs", "report", "plan"},
    "plan": {"errors", "lattice", "comm", "config", "runs", "report", "recommend", "models"},
    "search": {
        "mbtune", "errors", "lattice", "config", "runs", "trial", "report", "recommend",
        "progress", "cluster", "metrics",
    },
    "cli": {
        "errors", "lattice", "config", "runs", "models", "trial", "report", "analysis",
        "search", "progress", "cluster", "plan",
    },
    "mbtune": {"errors", "lattice", "config", "runs", "analysis", "plan"},
    "__main__": {"cli"},
}  # fmt: skip
"""What each room of the package may import: a package (or a top-level module) and the
rooms below it. The pure rooms (lattice, config, runs, recommend, analysis) are the ones
that import neither torch nor ray (tests/test_lattice.py checks it at run time)."""


def room_of(module: str) -> str:
    """`mbtune.config.schema` is in `config`; the package itself is `mbtune`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "mbtune"


def test_every_room_is_in_the_layering():
    rooms = {room_of(m) for m in MODULES}
    assert rooms == set(LAYERS), f"rooms without a layer: {rooms - set(LAYERS)}"


def test_each_room_imports_only_the_rooms_below_it():
    crossings = [
        f"{MODULES[name].relative_to(ROOT)}:{i.line}: {room_of(name)} imports {i.module}"
        for name, tree in TREES.items()
        for i in mbtune_imports(name, tree)
        if room_of(i.module) != room_of(name) and room_of(i.module) not in LAYERS[room_of(name)]
    ]
    assert not crossings, "\n".join(crossings)


def test_the_top_level_holds_few_modules():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 10, top


def defined_names(tree: ast.Module) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def test_only_a_package_re_exports():
    """A name is imported from the module that defines it; only a package's `__init__`
    re-exports (its public API). A module's `__all__` names only what it defines."""
    found = []
    for name, tree in TREES.items():
        path = MODULES[name]
        for i in mbtune_imports(name, tree):
            if i.name is None or MODULES.get(i.module, path).name == "__init__.py":
                continue
            if i.module in TREES and i.name not in defined_names(TREES[i.module]):
                found.append(f"{path.relative_to(ROOT)}:{i.line}: {i.name} from {i.module}")
        if path.name == "__init__.py":
            continue
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
            ):
                exported = {ast.literal_eval(e) for e in node.value.elts}
                found += [
                    f"{path.relative_to(ROOT)}: __all__ names {n}, defined elsewhere"
                    for n in sorted(exported - defined_names(tree))
                ]
    assert not found, "\n".join(found)


def borrowed_private_names(module: str, tree: ast.Module) -> list[str]:
    """Private names `module` imports from another mbtune module, and private modules it
    imports from outside their package; a package's own private modules share theirs."""
    own_package = package_of(module)
    found = []
    for i in mbtune_imports(module, tree):
        where = f"{MODULES[module].relative_to(ROOT)}:{i.line}"
        parts = i.module.split(".")
        private_module = any(is_private(p) for p in parts)
        inside = private_module and i.module.rpartition(".")[0] == own_package
        if private_module and not inside:
            found.append(f"{where}: imports the private module {i.module}")
        elif i.name is not None and is_private(i.name) and not inside:
            found.append(f"{where}: from {i.module} import {i.name}")
    return found


def test_no_private_name_is_imported_from_another_module():
    borrowed = [line for name, tree in TREES.items() for line in borrowed_private_names(name, tree)]
    assert not borrowed, "\n".join(borrowed)


# --- Ray's and Optuna's private attributes --------------------------------------------------


def expression_key(node: ast.AST) -> str | None:
    """`x` or `self.x`: what a taint can be attached to."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        return f"{node.value.id}.{node.attr}"
    return None


def root_keys(node: ast.AST) -> list[str]:
    """The keys of `node` and of every expression it is taken from: `a.b(c)[d].e` gives
    `a.b.e`'s own key (none), `a.b` and `a`."""
    keys = []
    while True:
        if (key := expression_key(node)) is not None:
            keys.append(key)
        if isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Await):
            node = node.value
        else:
            return keys


def foreign_private_uses(source: str, where: str = "<source>") -> list[str]:
    """Uses in `source` of a private part of Ray or Optuna: an import of a private module
    or name; a private attribute (`x._y`, or getattr/hasattr/setattr with "_y") of a name
    bound to their imports or of a value made from one (assigned, or a parameter annotated
    with one of their classes); and, in a class that subclasses one of theirs, a private
    attribute of `self` or `super()` that mbtune's classes do not set themselves."""
    tree = ast.parse(source)
    found: list[str] = []
    foreign: set[str] = set()

    def note(node: ast.AST, what: str) -> None:
        found.append(f"{where}:{node.lineno}: {what}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] in FOREIGN:
                    foreign.add(a.asname or a.name.split(".")[0])
                    if any(is_private(p) for p in a.name.split(".")):
                        note(node, f"imports {a.name}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in FOREIGN:
            for a in node.names:
                foreign.add(a.asname or a.name)
                if any(is_private(p) for p in [*node.module.split("."), a.name]):
                    note(node, f"imports {a.name} from {node.module}")

    def is_foreign(node: ast.AST) -> bool:
        return any(key in foreign for key in root_keys(node))

    # values made from theirs: assigned, or parameters annotated with one of their classes
    for _ in range(5):  # to a fixed point: a chain of assignments is short
        before = len(foreign)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if is_foreign(node.value):
                    foreign.update(k for t in targets if (k := expression_key(t)) is not None)
            elif isinstance(node, ast.arg) and node.annotation and is_foreign(node.annotation):
                foreign.add(node.arg)
        if len(foreign) == before:
            break

    def private_attributes(scope: ast.AST) -> list[tuple[ast.AST, ast.AST, str]]:
        """(node, the object, the private name) for every private attribute in `scope`."""
        uses = []
        for node in ast.walk(scope):
            if isinstance(node, ast.Attribute) and is_private(node.attr):
                uses.append((node, node.value, node.attr))
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and isinstance(node.args[1].value, str)
                and is_private(node.args[1].value)
            ):
                uses.append((node, node.args[0], node.args[1].value))
        return uses

    for node, obj, name in private_attributes(tree):
        if is_foreign(obj):
            note(node, f"{ast.unparse(obj)}.{name}")

    # subclasses of theirs: what `self` has that the class chain in mbtune did not set
    classes = {c.name: c for c in ast.walk(tree) if isinstance(c, ast.ClassDef)}

    def chain(cls: ast.ClassDef) -> list[ast.ClassDef] | None:
        """The class and its mbtune bases, if one of theirs is among its ancestors."""
        for base in cls.bases:
            if is_foreign(base):
                return [cls]
            if isinstance(base, ast.Name) and base.id in classes:
                above = chain(classes[base.id])
                if above is not None:
                    return [cls, *above]
        return None

    for cls in classes.values():
        lineage = chain(cls)
        if lineage is None:
            continue
        own = set()
        for c in lineage:
            for node in ast.walk(c):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    own.add(node.name)
                elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(
                    node.ctx, ast.Store
                ):
                    own.add(node.id if isinstance(node, ast.Name) else node.attr)
        for node, obj, name in private_attributes(cls):
            on_self = isinstance(obj, ast.Name) and obj.id in ("self", "cls")
            on_super = (
                isinstance(obj, ast.Call)
                and isinstance(obj.func, ast.Name)
                and obj.func.id == "super"
            )
            if (on_self or on_super) and name not in own and not is_foreign(obj):
                note(node, f"{ast.unparse(obj)}.{name} (inherited from Ray or Optuna)")
    return found


def test_no_private_attribute_of_ray_or_optuna_is_used():
    uses = [
        line
        for path in MODULES.values()
        for line in foreign_private_uses(path.read_text(), str(path.relative_to(ROOT)))
    ]
    assert not uses, "\n".join(uses)


@pytest.mark.parametrize(
    ("source", "uses"),
    [
        ("import ray\nray._private.state.actors()", ["ray._private"]),
        ("from ray._raylet import GcsClient", ["imports GcsClient from ray._raylet"]),
        ("import ray._private.services", ["imports ray._private.services"]),
        ("import optuna as ot\nstudy = ot.create_study()\nstudy._storage", ["study._storage"]),
        ("from ray import tune\ntune.Tuner()._local_tuner", ["tune.Tuner()._local_tuner"]),
        (
            """
            from ray.tune.search import Searcher
            from ray.tune.search.optuna import OptunaSearch
            class Dedup(Searcher):
                def __init__(self, inner: OptunaSearch):
                    super().__init__()
                    self.inner = inner
                    self._seen = {}
                def on_trial_complete(self, trial_id):
                    getattr(self.inner, "_ot_trials", {})
                    self.inner._space, self.inner._ot_study
                    self._seen.clear(), self._helper()
                    self._metric, super()._mode
                def _helper(self):
                    pass
            class Later(Dedup):
                def more(self):
                    self._seen, self._points_to_evaluate
            """,
            [
                "self.inner._ot_trials",
                "self.inner._space",
                "self.inner._ot_study",
                "self._metric (inherited",
                "super()._mode (inherited",
                "self._points_to_evaluate (inherited",
            ],
        ),
        (  # mbtune's own private attributes, and other libraries': not Ray's or Optuna's
            """
            import os
            import ray
            class Display:
                def _clear(self): pass
            def end(display: Display, searcher):
                display._clear(), searcher._state, os._exit(1)
                ray.get(searcher.ref)
            """,
            [],
        ),
    ],
)
def test_the_private_attribute_reader_finds_what_it_should_and_only_that(source, uses):
    found = foreign_private_uses(textwrap.dedent(source))
    assert len(found) == len(uses), found
    assert all(any(use in line for line in found) for use in uses), found
