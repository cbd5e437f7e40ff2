"""A search's start: the memory screen runs in a process of its own while Ray starts, and
what it found is recorded as before (mbtune.search._run)."""

from __future__ import annotations

from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool

import pytest

from mbtune.config.load import parse_experiment
from mbtune.errors import MbtuneError
from mbtune.runs.rundir import RunDir
from mbtune.search import _run, search_points
from mbtune.trial.screen import screen


def screened(tmp_path, *, budget: str | None = "370MiB", **search):
    """A tiny gpt whose activations dominate (256 tokens a sample): on 370 MiB, the largest
    micro-batches are predicted over the budget (tests/test_sharded_search.py's)."""
    trial = {"device": "cpu", "compile": False}
    return parse_experiment({
        "name": "screened",
        "model": {"name": "gpt", "n_layer": 2, "d_model": 64, "n_head": 2, "seq_len": 256,
                  "vocab_size": 256},
        "train_input": {"batch_size": 64, "micro_batch_size": "auto"},
        "search": {"space": {"micro_batch_size": [8, 16, 32, 64]}, "sampler": "grid", **search},
        "trial": {**trial, "device_memory": budget} if budget else trial,
        "output_dir": str(tmp_path / "runs"),
    })  # fmt: skip


def test_the_memory_screen_is_started_before_ray(tmp_path, monkeypatch):
    exp = screened(tmp_path)
    order: list[str] = []
    started: list[Future] = []

    def beside(exp, points, say, verbose=False):
        order.append("screen")
        future: Future = Future()
        started.append(future)
        return future

    def start_ray(*args, **kwargs):
        order.append("ray")
        raise MbtuneError("--address: cannot start or reach an embedded local Ray: no")

    monkeypatch.setattr(_run, "screen_beside", beside)
    monkeypatch.setattr(_run, "start_ray", start_ray)
    with pytest.raises(MbtuneError, match="cannot start"):
        _run.run_search(exp, echo=lambda line: None)
    assert order == ["screen", "ray"]
    assert started[0].cancelled()  # Ray did not start: the screen's answer is not waited for
    assert not (tmp_path / "runs").exists()  # nor a run directory made


def test_nothing_is_screened_beside_ray_without_a_budget_known_here(tmp_path):
    lines: list[str] = []
    points = search_points(screened(tmp_path))
    for exp in (
        screened(tmp_path, budget=None),  # a CPU without one (or a card of the cluster's)
        screened(tmp_path, predict_memory=False),
    ):
        assert _run.screen_beside(exp, points, lines.append) is None
    assert lines == []


@pytest.mark.slow
def test_the_screen_beside_ray_answers_as_the_screen_itself(tmp_path, monkeypatch):
    import ray

    exp = screened(tmp_path)
    points = search_points(exp)
    lines: list[str] = []
    future = _run.screen_beside(exp, points, lines.append)
    assert lines == ["mbtune: predicting the memory of 4 configurations (search.predict_memory)"]
    found, here = future.result(), screen(exp, points)
    assert (found.budget, found.over, found.predictions) == (here.budget, here.over,
                                                             here.predictions)  # fmt: skip
    assert [(c.micro_batch_size, reason.split(":")[0]) for c, reason in found.over] == [
        (32, "predicted"), (64, "predicted")
    ]  # fmt: skip
    monkeypatch.setattr(ray, "remote", None)  # no Ray task: the answer is the process's
    run = RunDir.create(tmp_path / "runs", "screened")
    records = _run.predict_out_of_memory(exp, points, run, lines.append, screening=future)
    assert [(r.trial, r.micro_batch_size, r.status) for r in records] == [
        (1, 32, "oom"), (2, 64, "oom")
    ]  # fmt: skip
    assert run.records() == records
    assert lines[-1].startswith("mbtune: 2 of 4 configurations predicted over 352 MiB")


def test_a_screen_whose_process_died_is_said_and_everything_measured(tmp_path):
    exp = screened(tmp_path)
    died: Future = Future()
    died.set_exception(BrokenProcessPool("A process in the process pool was terminated"))
    lines: list[str] = []
    run = RunDir.create(tmp_path / "runs", "screened")
    records = _run.predict_out_of_memory(exp, search_points(exp), run, lines.append,
                                         screening=died)  # fmt: skip
    assert records == [] and run.records() == []
    assert lines == [
        "mbtune: memory prediction failed, every configuration is measured: BrokenProcessPool: "
        "A process in the process pool was terminated"
    ]
