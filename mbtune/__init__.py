"""mbtune: find the fastest batch size, micro-batch size and device count for a model.

The package imports neither torch nor ray; the modules that need them import them when
they are used. ``load_run`` and ``load_runs`` (mbtune.runs.load) import pandas on first use,
``load_plan`` (mbtune.plan.load) pandas and scipy, and torch to count the model's bytes.
"""

from typing import Any

from mbtune.config.experiment import Experiment
from mbtune.config.load import load_experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig

__all__ = [
    "BatchConfig",
    "Experiment",
    "MbtuneError",
    "load_experiment",
    "load_plan",
    "load_run",
    "load_runs",
]
__version__ = "0.1.0"

_LAZY = {
    "load_run": "mbtune.runs.load",
    "load_runs": "mbtune.runs.load",
    "load_plan": "mbtune.plan.load",
}


def __getattr__(name: str) -> Any:
    # pandas costs a second to import: only a caller of the analysis pays for it
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mbtune' has no attribute {name!r}")


def __dir__() -> list[str]:
    # the lazy names too: dir(mbtune) and a shell's completion list every public name
    return sorted({*globals(), *__all__})
