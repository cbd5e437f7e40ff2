"""The run's Optuna study as optuna-dashboard shows it: the user's sizes and results as
user attributes of every trial, no trial left running, the recommendation as the note."""

from __future__ import annotations

import signal
import subprocess
import sys

import optuna
import pytest
from test_interrupts import MBTUNE, start_and_signal
from test_search import replay_experiment

from mbtune.lattice import BatchConfig
from mbtune.runs.record import TrialRecord
from mbtune.runs.rundir import RunDir
from mbtune.search import OptunaSearcher, OptunaSpace, run_search
from mbtune.search._study import (
    STUDY_NAME,
    fail_interrupted,
    publish_recommendation,
    record_attrs,
)

POINTS = [BatchConfig(32, n, m) for n in (1, 2) for m in (1, 2, 4, 8)]


def sqlite(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'optuna.db'}"


def searcher(tmp_path) -> OptunaSearcher:
    storage = optuna.storages.RDBStorage(sqlite(tmp_path))
    return OptunaSearcher(OptunaSpace(POINTS), "tpe", seed=0, storage=storage)


def study(tmp_path) -> optuna.Study:
    return optuna.load_study(study_name=STUDY_NAME, storage=sqlite(tmp_path))


def record(config: BatchConfig, samples_per_s: float | None, status: str = "ok") -> TrialRecord:
    return TrialRecord(
        trial=1, status=status, **config.sizes(), grad_accum_steps=config.grad_accum_steps,
        samples_per_s=samples_per_s, peak_memory_bytes=2**20,
    )  # fmt: skip


def test_an_asked_trial_carries_its_proposal_then_what_it_measured(tmp_path):
    s = searcher(tmp_path)
    proposed = BatchConfig.from_mapping(s.suggest("t1"))
    asked = study(tmp_path).trials[0]
    assert asked.state == optuna.trial.TrialState.RUNNING
    assert asked.user_attrs == {
        "batch_size": proposed.batch_size, "num_devices": proposed.num_devices,
        "micro_batch_size": proposed.micro_batch_size, "activation_checkpointing": False,
        "reshard_after_forward": True, "grad_sync": "last",
        "grad_accum_steps": proposed.grad_accum_steps,
    }  # fmt: skip
    # measured at half the proposed micro-batch (halved on out of memory)
    ran = BatchConfig(proposed.batch_size, proposed.num_devices, 1)
    s.on_trial_complete("t1", {"objective": 123.0, **record_attrs(record(ran, 123.0))})
    told = study(tmp_path).trials[0]
    assert told.state == optuna.trial.TrialState.COMPLETE and told.value == 123.0
    assert told.user_attrs == {
        "batch_size": 32, "num_devices": ran.num_devices, "micro_batch_size": 1,
        "activation_checkpointing": False, "reshard_after_forward": True, "grad_sync": "last",
        "grad_accum_steps": ran.grad_accum_steps,
        "status": "ok", "samples_per_s": 123.0, "peak_memory_bytes": 2**20, "trial": 1,
    }  # fmt: skip


def test_a_told_result_is_a_trial_with_the_users_sizes(tmp_path):
    s = searcher(tmp_path)
    s.tell(BatchConfig(32, 2, 4), 0.0, measured=True, attrs=record_attrs(
        record(BatchConfig(32, 2, 4), None, status="oom")))  # fmt: skip
    s.tell(BatchConfig(32, 1, 8), 300.0, measured=False)
    oom, warm = study(tmp_path).trials
    assert (oom.user_attrs["status"], oom.user_attrs["micro_batch_size"]) == ("oom", 4)
    assert "samples_per_s" not in oom.user_attrs  # not measured: left out, not null
    assert warm.user_attrs == {
        "batch_size": 32, "num_devices": 1, "micro_batch_size": 8,
        "activation_checkpointing": False, "reshard_after_forward": True, "grad_sync": "last",
        "grad_accum_steps": 4, "status": "ok",
    }  # fmt: skip


def test_a_result_the_study_was_told_before_a_kill_is_not_told_again(tmp_path):
    # a killed driver told the study, then Ray's older state had the searcher read the
    # row back from trials.csv on resume: the study keeps one trial of it
    s = searcher(tmp_path)
    attrs = {**record_attrs(record(BatchConfig(32, 1, 4), 300.0)), "trial_id": "a_00002"}
    s.tell(BatchConfig(32, 1, 4), 300.0, measured=True, attrs=attrs)
    s.tell(BatchConfig(32, 1, 4), 300.0, measured=True, attrs=attrs)
    assert [t.user_attrs["trial_id"] for t in study(tmp_path).trials] == ["a_00002"]


def test_an_interrupted_trial_is_failed_and_its_later_result_learnt(tmp_path):
    s = searcher(tmp_path)
    params = s.suggest("t1")
    s.suggest("t2")
    s.on_trial_complete("t2", {"objective": 5.0, "status": "ok"})
    assert fail_interrupted(sqlite(tmp_path)) == 1  # the driver stopped with t1 in flight
    first = study(tmp_path).trials[0]
    assert first.state == optuna.trial.TrialState.FAIL
    assert first.user_attrs["status"] == "interrupted"
    assert fail_interrupted(sqlite(tmp_path)) == 0
    # the resumed run measures it: learnt as a trial of its own, the failed one kept
    config = BatchConfig.from_mapping(params)
    s.on_trial_complete("t1", {"objective": 77.0, **record_attrs(record(config, 77.0))})
    trials = study(tmp_path).trials
    assert [t.state.name for t in trials] == ["FAIL", "COMPLETE", "COMPLETE"]
    assert trials[2].value == 77.0 and trials[2].user_attrs["samples_per_s"] == 77.0
    # a trial told already (before a killed driver's last save) is not told twice
    s.asked["t3"] = trials[1].number
    s.on_trial_complete("t3", {"objective": 5.0, "status": "ok"})
    assert len(study(tmp_path).trials) == 3


def test_a_run_without_a_study_is_left_alone(tmp_path):
    optuna.storages.RDBStorage(sqlite(tmp_path))  # grid, halving, doubling, model: no study
    assert fail_interrupted(sqlite(tmp_path)) == 0
    publish_recommendation(sqlite(tmp_path), "line", confidence=1, target=90, trials=1)
    assert optuna.get_all_study_names(sqlite(tmp_path)) == []


def test_without_optuna_dashboard_the_recommendation_is_a_study_attribute(tmp_path, monkeypatch):
    searcher(tmp_path)
    monkeypatch.setitem(sys.modules, "optuna_dashboard", None)  # not installed
    publish_recommendation(sqlite(tmp_path), "mbtune 12:00:00  recommended micro_batch_size: 4",
                           confidence=42, target=90, trials=3)  # fmt: skip
    attrs = study(tmp_path).user_attrs
    assert attrs == {"recommendation": "mbtune 12:00:00  recommended micro_batch_size: 4",
                     "confidence": 42, "trials": 3}  # fmt: skip


@pytest.mark.ray
def test_after_a_tpe_search_the_study_shows_the_users_trials_and_recommendation(
    ray_session, tmp_path
):
    lines: list[str] = []
    outcome = run_search(replay_experiment(tmp_path, sampler="tpe", num_samples=6),
                         echo=lines.append)  # fmt: skip
    saved = optuna.load_study(study_name=STUDY_NAME, storage=outcome.run.optuna_url)
    trials = saved.get_trials(deepcopy=False)
    assert trials and not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    for t in trials:
        assert {"batch_size", "num_devices", "micro_batch_size", "status"} <= set(t.user_attrs)
    measured = [t for t in trials if t.user_attrs["status"] in ("ok", "oom", "error")]
    by_row = {t.user_attrs["trial"]: t for t in measured}
    for r in outcome.records:  # each row of trials.csv is a trial of the study, the same
        t = by_row[r.trial]
        assert (t.user_attrs["micro_batch_size"], t.user_attrs["status"]) == (
            r.micro_batch_size, r.status)  # fmt: skip
        assert t.user_attrs.get("samples_per_s") == r.samples_per_s
    final = [line for line in lines if "recommended micro_batch_size:" in line][-1]
    assert saved.user_attrs["recommendation"] == final
    assert saved.user_attrs["confidence"] == outcome.summary["confidence"]
    try:
        from optuna_dashboard import get_note
    except ImportError:
        return
    assert final in get_note(saved)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_or_killed_tpe_run_leaves_no_trial_running_once_resumed(tmp_path, sig):
    _, _, _, run = start_and_signal(tmp_path, sig, sampler="tpe", num_samples=8)
    url = f"sqlite:///{run / 'optuna.db'}"
    if sig == signal.SIGTERM:  # the run ended itself: nothing left running already
        states = {t.state for t in optuna.load_study(study_name=STUDY_NAME, storage=url).trials}
        assert optuna.trial.TrialState.RUNNING not in states
    done = subprocess.run([MBTUNE, "run", "--resume", str(run)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    trials = optuna.load_study(study_name=STUDY_NAME, storage=url).trials
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    assert all("status" in t.user_attrs for t in trials)
    # a trial the kill caught between Optuna's ask and its configuration has no sizes
    sized = [t for t in trials if t.user_attrs["status"] != "interrupted"]
    assert all("batch_size" in t.user_attrs for t in sized)
    interrupted = [t for t in trials if t.user_attrs["status"] == "interrupted"]
    assert all(t.state == optuna.trial.TrialState.FAIL for t in interrupted)
    rows = RunDir(run).records()  # every row of trials.csv is a told trial, once
    # a trial the kill caught between its attributes and its tell is interrupted, and its
    # row is learnt again as a trial of its own: count the others
    told_trials = [t for t in sized if "trial" in t.user_attrs]
    told = [t.user_attrs["trial"] for t in told_trials]
    assert sorted(told) == [r.trial for r in rows]
    assert {t.user_attrs["trial_id"] for t in told_trials} == {r.trial_id for r in rows}
