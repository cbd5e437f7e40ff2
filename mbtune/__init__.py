"""mbtune: find the fastest batch size, micro-batch size and device count for a model.

The package imports neither torch nor ray; the modules that need them import them when
they are used.
"""

from mbtune.config import Experiment, load_experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig

__all__ = ["BatchConfig", "Experiment", "MbtuneError", "load_experiment"]
__version__ = "0.1.0"
