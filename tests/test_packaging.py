"""mbtune as an installed tool: its data in the wheel and the sdist, ``python -m mbtune``.

CI (.ci/run) also installs the wheel into a fresh environment and runs a search with it.
"""

import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib import resources
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
SPACES = ["data_parallel.yaml", "default.yaml", "powers_of_two.yaml"]


def test_the_named_spaces_are_package_data_from_the_top_level_folder():
    found = resources.files("mbtune.search_spaces")
    assert sorted(p.name for p in found.iterdir() if p.name.endswith(".yaml")) == SPACES
    assert Path(str(found)) == ROOT / "search_spaces"  # the editable install finds them there


def test_every_package_of_mbtune_is_in_the_wheel_list():
    """pyproject.toml lists the packages (one of them, the search spaces, lives outside
    mbtune/): a new room of the package must be added there too."""
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"])  # fmt: skip
    found = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "mbtune").rglob("__init__.py")
    }
    assert listed == found | {"mbtune.search_spaces"}


def test_python_m_mbtune_runs_the_command():
    done = subprocess.run([sys.executable, "-m", "mbtune", "--help"], capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stdout.startswith("usage: mbtune [-h] COMMAND")
    assert "init" in done.stdout and done.stderr == ""


def test_the_wheel_and_the_sdist_carry_the_search_spaces(tmp_path):
    # built from a copy, so that the build leaves nothing in the checkout
    source = tmp_path / "src"
    shutil.copytree(ROOT / "mbtune", source / "mbtune",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    shutil.copytree(ROOT / "search_spaces", source / "search_spaces",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    build = "from setuptools import build_meta as b; b.build_wheel('out'); b.build_sdist('out')"
    subprocess.run([sys.executable, "-c", build], cwd=source, check=True, capture_output=True,
                   timeout=120)  # fmt: skip
    (wheel,) = (source / "out").glob("*.whl")
    (sdist,) = (source / "out").glob("*.tar.gz")
    with zipfile.ZipFile(wheel) as w, tarfile.open(sdist) as s:
        in_wheel = set(w.namelist())
        in_sdist = {name.split("/", 1)[1] for name in s.getnames() if "/" in name}
    for name in SPACES:
        assert f"mbtune/search_spaces/{name}" in in_wheel
        assert f"search_spaces/{name}" in in_sdist  # the source tree's layout
    assert "mbtune/__main__.py" in in_wheel and "mbtune/config/starter.py" in in_wheel
    dashboard = "mbtune/grafana_dashboard.json"  # the Grafana dashboard mbtune.metrics installs
    assert dashboard in in_wheel and dashboard in in_sdist
