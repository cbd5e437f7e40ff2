"""Load: a search of many trials, two at a time, finishes and records each exactly once.

Exactly once, with the result as measured, is about trials that finish two at a time:
each pair a chance for two finishing trials to be numbered, written to trials.csv and told
to the study at once. 16 trials are 8 pairs, finishing in either order, three of them out
of memory (one on two devices), over both device counts and every micro-batch size. More
trials repeat the same pairs and say nothing more of it, each a trial process (0.2 s here
at best). The driver's memory over a long search (500 trials) is measured by
bench/driver_memory.py (figures in docs/benchmarks.md), not asserted here.
"""

from __future__ import annotations

import csv

import pytest

from mbtune.config.load import parse_experiment
from mbtune.search import run_search, search_points

TRIALS = 16


def load_experiment(tmp_path, **search):
    raw = {
        "name": "load",
        # replay never builds the model; a user-model name (never imported) keeps torch out
        # of every trial process, where a built-in name's option check would import it
        "model": "replay_only:unused",
        "train_input": {"batch_size": 64, "micro_batch_size": "auto"},
        "search": {
            # B free from 8 to 128: every B = n x m x g in range: 345 configurations
            "space": {
                "batch_size": {"min": 8, "max": 128},
                "num_devices": [1, 2],
                "micro_batch_size": [1, 2, 4, 8],
            },
            **search,
        },
        "trial": {"backend": "replay", "table": str(tmp_path / "table.csv"), "measure_steps": 3},
        "ray": {"max_concurrent_trials": 2},
        "output_dir": str(tmp_path / "runs"),
    }
    (tmp_path / "table.csv").write_text("")  # parse_experiment only resolves the path
    exp = parse_experiment(raw)
    table = {}
    with (tmp_path / "table.csv").open("w", newline="") as f:
        columns = ["batch_size", "num_devices", "micro_batch_size", "samples_per_s", "status"]
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        # in the grid's order: every fifth out of memory, the 5th, 10th and 15th of 16
        for i, c in enumerate(sorted(p.canonical() for p in search_points(exp))):
            status = "oom" if i % 5 == 4 else "ok"
            speed = float(c.batch_size * c.num_devices + 7 * c.micro_batch_size)
            table[c.batch_size, c.num_devices, c.micro_batch_size] = (status, speed)
            writer.writerow({**c.sizes(), "samples_per_s": speed, "status": status})
    return exp, table


@pytest.mark.ray
@pytest.mark.slow
def test_trials_two_at_a_time_are_each_recorded_once(ray_session, tmp_path):
    exp, table = load_experiment(tmp_path, sampler="grid", num_samples=TRIALS)
    assert len(table) > TRIALS  # the budget ends the search, not the lattice
    assert exp.ray.max_concurrent_trials == 2
    lines = []
    outcome = run_search(exp, echo=lines.append)
    with outcome.run.trials_file.open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == TRIALS
    assert sorted(int(r["trial"]) for r in rows) == list(range(1, TRIALS + 1))
    assert len({r["trial_id"] for r in rows}) == TRIALS
    configs = [
        (int(r["batch_size"]), int(r["num_devices"]), int(r["micro_batch_size"])) for r in rows
    ]
    assert len(set(configs)) == TRIALS
    # what the docstring says the 16 cover: both device counts, every micro-batch size, an
    # out of memory on each device count
    assert {(n, m) for _, n, m in configs} >= {(n, m) for n in (1, 2) for m in (1, 2, 4)}
    assert {m for _, _, m in configs} == {1, 2, 4, 8}
    assert sum(r["status"] == "oom" for r in rows) == 3
    assert {r["num_devices"] for r in rows if r["status"] == "oom"} == {"1", "2"}
    for config, r in zip(configs, rows, strict=True):  # every result kept as measured
        status, speed = table[config]
        assert r["status"] == status, r
        if status == "ok":
            assert float(r["samples_per_s"]) == pytest.approx(speed), r
    assert sum(line.startswith("mbtune ") and " trial " in line for line in lines) == TRIALS
