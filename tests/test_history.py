"""The study read as the search reads it (mbtune.search._history): read again after each
trial, it learns only the trials finished since, and says what reading every trial again
says."""

from __future__ import annotations

import optuna
import pytest
from test_optuna_study import POINTS, record

from mbtune.lattice import BatchConfig
from mbtune.search import _history
from mbtune.search._history import History, read_history
from mbtune.search._space import OptunaSpace
from mbtune.search._study import CACHED, SearchStudy


@pytest.fixture
def learnt(monkeypatch) -> list[int]:
    """The numbers of the trials read_history learns, in order (a cache of its own)."""
    numbers: list[int] = []
    learn = _history._learn

    def counted(h, space, t):
        numbers.append(t.number)
        learn(h, space, t)

    monkeypatch.setattr(_history, "_learn", counted)
    monkeypatch.setattr(_history, "_LEARNT", _history._Learnt())
    return numbers


def from_scratch(study: SearchStudy) -> History:
    """What every trial of ``study`` teaches, learnt again from the first."""
    h = History()
    trials = study.trials()
    for t in sorted((t for t in trials if t.state.is_finished()), key=_history.finished_order):
        _history._learn(h, study.space, t)
    h.running = read_history(trials, study.space).running
    return h


def searched_study(tmp_path) -> SearchStudy:
    return SearchStudy.at(f"sqlite:///{tmp_path / 'optuna.db'}", OptunaSpace(POINTS))


def test_each_reading_learns_only_the_trials_finished_since_and_reads_as_all_of_them(
    tmp_path, learnt
):
    study = searched_study(tmp_path)
    study.add(record(BatchConfig(32, 2, 8), None, status="oom", reason="predicted: over"))
    steps = [
        (BatchConfig(32, 1, 4), 300.0),
        (BatchConfig(32, 2, 4), 410.0),
        (BatchConfig(32, 1, 4), 290.0),  # a repeat: pooled with the first
        (BatchConfig(32, 1, 8), None),  # out of memory
    ]
    for i, (config, speed) in enumerate(steps, start=2):
        number, _ = study.ask(config)
        study.set_attrs(number, {"trial_id": f"t{i}"})
        running = read_history(study.trials(), study.space)
        assert running.running == {number: config}  # asked, not finished: running
        status = "ok" if speed else "oom"
        study.tell(record(config, speed, status=status, trial=i, trial_id=f"t{i}"))
        before = len(learnt)
        h = read_history(study.trials(), study.space)
        assert learnt[before:] == [number]  # the trial just told, alone
        assert h == from_scratch(study)
    # a proposal answered from the cache, and a trial still running
    number, _ = study.ask(BatchConfig(32, 2, 4))
    study.finish(number, CACHED, 410.0, batch_size=32, num_devices=2, micro_batch_size=4)
    running, _ = study.ask(BatchConfig(32, 2, 2))
    before = len(learnt)
    h = read_history(study.trials(), study.space)
    assert learnt[before:] == [number]
    assert h == from_scratch(study)
    assert h.running == {running: BatchConfig(32, 2, 2)}
    assert h.looks[BatchConfig(32, 1, 4)] == 2 and h.trials == 4
    # what a caller does with its answer is not remembered
    h.observations.clear()
    h.measured.clear()
    assert read_history(study.trials(), study.space) == from_scratch(study)


def test_another_studys_trials_or_another_order_are_learnt_whole(tmp_path, learnt):
    study = searched_study(tmp_path)
    for i, m in enumerate((1, 2, 4), start=1):
        study.add(record(BatchConfig(32, 1, m), 100.0 * m, trial=i, trial_id=f"t{i}"))
    read_history(study.trials(), study.space)
    assert learnt == [0, 1, 2]
    # the same trials read from another storage: other objects, learnt again
    again = optuna.load_study(study_name="mbtune", storage=f"sqlite:///{tmp_path / 'optuna.db'}")
    del learnt[:]
    read_history(again.get_trials(deepcopy=False), study.space)
    assert learnt == [0, 1, 2]
    # a reading whose trials do not begin with those learnt (deep copies): learnt whole
    del learnt[:]
    h = read_history(study.study.get_trials(deepcopy=True), study.space)
    assert learnt == [0, 1, 2]
    assert h == from_scratch(study)
