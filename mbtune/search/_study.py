"""The run's Optuna study (optuna.db) as optuna-dashboard shows it: every trial with the
configuration as the user names it and what it measured as user attributes, no trial left
running by an interrupted driver, and the current recommendation as the study's note.

Optuna's own parameters are the sampler's encoding (``num_devices_index``,
``micro_batch_size_log2``: see mbtune.search._proposers.OptunaSpace); the user attributes
are what a person looks for (``batch_size``, ``num_devices``, ``micro_batch_size``,
``samples_per_s``, ``status``, ...). Public Optuna API only: a trial's attributes are set
through the storage's own methods, before the trial is told (a finished trial is frozen).

A run without a study (``search.sampler`` grid, halving, doubling or model) is left alone.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import optuna

from mbtune.lattice import BatchConfig
from mbtune.runs.record import CONFIG_KEY, TrialRecord

__all__ = [
    "RECOMMENDATION_ATTR",
    "STUDY_NAME",
    "config_attrs",
    "fail_interrupted",
    "publish_recommendation",
    "record_attrs",
    "set_trial_attrs",
]

STUDY_NAME = "mbtune"
"""The name of the study in every run's optuna.db."""

RECOMMENDATION_ATTR = "recommendation"
"""The study's user attribute holding the current recommendation line (beside
``confidence`` and ``trials``), for those without optuna-dashboard's note."""

INTERRUPTED = "interrupted"
"""The ``status`` of a trial whose driver stopped before it finished."""

_RESULTS = (
    "grad_accum_steps", "status", "samples_per_s", "peak_memory_bytes", "reason", "trial",
    "trial_id",
)  # fmt: skip
"""A finished trial's columns shown beside its configuration (``trial``: its row number in
trials.csv; ``trial_id``: Ray Tune's id of it)."""


def config_attrs(config: BatchConfig) -> dict[str, Any]:
    """A configuration as the user names it: every column of ``CONFIG_KEY``, and g."""
    return {
        **{k: getattr(config, k) for k in CONFIG_KEY},
        "grad_accum_steps": config.grad_accum_steps,
    }


def record_attrs(record: TrialRecord) -> dict[str, Any]:
    """A finished trial's user attributes: its configuration as measured and what it
    measured (a figure it did not measure is left out)."""
    attrs = {k: getattr(record, k) for k in (*CONFIG_KEY, *_RESULTS)}
    return {k: v for k, v in attrs.items() if v is not None}


def set_trial_attrs(storage: Any, number: int, attrs: Mapping[str, Any]) -> None:
    """Set ``attrs`` as user attributes of the unfinished trial ``number`` of the study in
    ``storage`` (an Optuna storage: the one the study was created with)."""
    study_id = storage.get_study_id_from_name(STUDY_NAME)
    trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, number)
    for key, value in attrs.items():
        storage.set_trial_user_attr(trial_id, key, value)


def fail_interrupted(url: str) -> int:
    """Mark every trial left running in the study at ``url`` failed, its ``status``
    ``interrupted`` (a driver that stopped or was killed mid-trial); how many were."""
    storage = _storage(url)
    try:
        study_id = storage.get_study_id_from_name(STUDY_NAME)
    except KeyError:
        return 0  # a sampler without a study
    running = storage.get_all_trials(study_id, states=(optuna.trial.TrialState.RUNNING,))
    for frozen in running:
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, frozen.number)
        storage.set_trial_user_attr(trial_id, "status", INTERRUPTED)
        storage.set_trial_state_values(trial_id, optuna.trial.TrialState.FAIL)
    return len(running)


def publish_recommendation(
    url: str, line: str, *, confidence: int, target: int, trials: int
) -> None:
    """Put the current recommendation in the study at ``url``: its note (optuna-dashboard's
    ``save_note``, where optuna-dashboard is installed) and its user attributes
    ``recommendation``, ``confidence`` and ``trials`` (always)."""
    storage = _storage(url)
    try:
        study_id = storage.get_study_id_from_name(STUDY_NAME)
    except KeyError:
        return  # a sampler without a study
    storage.set_study_user_attr(study_id, RECOMMENDATION_ATTR, line)
    storage.set_study_user_attr(study_id, "confidence", confidence)
    storage.set_study_user_attr(study_id, "trials", trials)
    try:
        from optuna_dashboard import save_note
    except ImportError:
        return
    note = (
        f"## mbtune's recommendation\n\n{line}\n\nconfidence score **{confidence}** of its "
        f"target {target}, after {trials} trial{'s' if trials != 1 else ''} "
        f"(updated after every trial)\n"
    )
    save_note(optuna.load_study(study_name=STUDY_NAME, storage=storage), note)


@functools.lru_cache(maxsize=8)
def _storage(url: str) -> optuna.storages.RDBStorage:
    """One storage per run's optuna.db for the driver's life: opening it checks the schema."""
    return optuna.storages.RDBStorage(url)
