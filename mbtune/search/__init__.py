"""The search: a Ray Tune ``Tuner`` whose trials run the trial engine, proposed in the
run's Optuna study by an Optuna sampler (the search model's, :class:`ModelSampler`, by
default), and reported on as they finish.

Each trial runs in a process of its own (mbtune.trial.launch), started by the Ray trial actor,
so an out-of-memory, a crash, a hang or a poisoned CUDA context in one trial cannot touch
another: the actor records what happened and the search goes on. With ``trial.parallel:
ddp`` the trial actor instead fits a Ray Train run whose workers, one process per
device, are that trial's own (see mbtune.trial.ddp).

The package's parts, private behind this surface: ``_run`` (the Tuner, resume, warm
start), ``_searcher`` (what Tune asks for the next trial: the study asked, the cache,
another look), ``_samplers`` (the Optuna samplers: the search model's, the baselines',
Optuna's own), ``_space`` (the lattice as Optuna's parameters), ``_history`` (the study
read as the search reads it), ``_stopping`` (another look, the stop), ``_ledger`` (a
finished trial's row, line and recommendation; when to stop), ``_signals`` (Ctrl-C and
SIGTERM), ``_study`` (the run's Optuna study, which every run keeps and every sampler
reads).

May import: every room below it (mbtune, errors, lattice, config, runs, trial, report,
recommend, progress, cluster); never torch (a test checks the driver).
"""

from mbtune.search._ledger import ConfidenceStop, TrialLog, print_line
from mbtune.search._run import (
    SearchOutcome,
    resume_search,
    run_search,
    start_ray,
    trial_resources,
)
from mbtune.search._samplers import (
    DoublingSampler,
    HalvingSampler,
    LatticeGridSampler,
    LatticeSampler,
    ModelSampler,
    RecommendAndStop,
    search_model,
    search_points,
)
from mbtune.search._searcher import MbtuneSearcher, make_searcher
from mbtune.search._signals import graceful_stop
from mbtune.search._space import OptunaSpace
from mbtune.search._stopping import (
    RIVAL_ACROSS,
    RIVAL_MATERIAL,
    another_look,
    one_look_reason,
    settled,
    strongest_rival,
)
from mbtune.trial.launch import METRIC, pack_result, unpack_result

__all__ = [
    "METRIC",
    "RIVAL_ACROSS",
    "RIVAL_MATERIAL",
    "ConfidenceStop",
    "DoublingSampler",
    "HalvingSampler",
    "LatticeGridSampler",
    "LatticeSampler",
    "MbtuneSearcher",
    "ModelSampler",
    "OptunaSpace",
    "RecommendAndStop",
    "SearchOutcome",
    "TrialLog",
    "another_look",
    "graceful_stop",
    "make_searcher",
    "one_look_reason",
    "pack_result",
    "print_line",
    "resume_search",
    "run_search",
    "search_model",
    "search_points",
    "settled",
    "start_ray",
    "strongest_rival",
    "trial_resources",
    "unpack_result",
]
