"""The reporter: the stream of recommendations, the summary, and the Tune callback."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from mbtune.lattice import BatchConfig, enumerate_configs
from mbtune.recommend.observation import observation
from mbtune.recommend.reporter import Reporter
from mbtune.runs.record import TrialRecord
from mbtune.runs.rundir import RunDir

POINTS = enumerate_configs(mode="auto", batch_sizes=[32], num_devices=[1, 2])
LINE = re.compile(
    r"^mbtune \d\d:\d\d:\d\d  recommended micro_batch_size: \d+ \(num_devices: \d+, "
    r"batch_size: \d+\), estimated performance: \d+\.\d\dx base, confidence score: \d+ "
    r"\(out of 100\)$"
)


def result(n: int, m: int, speed: float | None, status: str = "ok", **extra) -> dict:
    """What a trial reports (numbers, lists), as the search hands it to the trial log."""
    step_ms = 32 / speed * 1e3 if speed else None
    return {
        "batch_size": 32, "num_devices": n, "micro_batch_size": m,
        "grad_accum_steps": -(-32 // n // m), "status": status,
        "samples_per_s": speed, "objective": speed or 0.0,
        "step_times_ms": [step_ms * f for f in (0.99, 1.0, 1.01)] if speed else [], **extra,
    }  # fmt: skip


def row(n: int, m: int, speed: float | None, status: str = "ok", **extra) -> TrialRecord:
    """A finished trial's record, as the trial log keeps it."""
    return TrialRecord.from_result({"trial": 1, **result(n, m, speed, status, **extra)})


def test_a_record_becomes_an_observation():
    o = observation(row(2, 8, 500.0, micro_batch_sizes_tried=[16, 8]))
    assert o.config == BatchConfig(32, 2, 8) and o.status == "ok" and o.value == 500.0
    assert len(o.step_times_ms) == 3 and o.oom_micro_batch_sizes == (16,)
    assert observation(row(2, 16, None, "oom", micro_batch_sizes_tried=[16])).status == "oom"
    assert observation(row(1, 9, 100.0)).config == BatchConfig(32, 1, 8)  # canonical m
    # an ok trial without a positive objective cannot be trusted: an error
    assert observation(row(1, 8, 100.0, objective=0.0)).status == "error"


def test_a_row_read_back_gives_the_same_observation_as_the_result():
    """trials.csv keeps step times to 4 digits: the rest is the same observation."""
    record = row(2, 8, 500.0, micro_batch_sizes_tried=[16, 8])
    back = observation(TrialRecord.from_row(record.to_row()))
    assert back == observation(dataclasses.replace(record, step_times_ms=back.step_times_ms))
    assert back.step_times_ms == pytest.approx(record.step_times_ms, rel=1e-3)


BASE = ("mbtune: base is this first recommendation's throughput: each estimated performance "
        "that follows is relative to it")  # fmt: skip


def test_the_stream_starts_at_base_and_reports_the_speedup():
    reporter = Reporter(POINTS)
    rows = [row(1, 4, 400.0)]
    first = reporter.update(rows, [])
    assert first.config == BatchConfig(32, 1, 4) and first.estimated_performance == 1.0
    line, base = first.line().split("\n")  # the first says what base is, once
    assert LINE.match(line) and base == BASE
    history = [first.record()]
    rows.append(row(2, 8, 500.0))
    second = reporter.update(rows, history)
    assert second.config == BatchConfig(32, 2, 8) and LINE.match(second.line())
    assert second.estimated_performance == 1.25 and second.trials == 2
    record = second.record()
    assert {k: record[k] for k in ("micro_batch_size", "num_devices", "batch_size")} == {
        "micro_batch_size": 8, "num_devices": 2, "batch_size": 32}  # fmt: skip
    assert 0 <= record["confidence"] <= 99 and record["time"]
    json.dumps(record)


def test_the_speedup_is_of_the_estimates_the_recommendation_ranks_by():
    # a second look at base's configuration reads 5% lower: the recommendation is still base
    # itself, so 1.00x (its pooled reading over base's first one would say 0.97x)
    reporter = Reporter(POINTS)
    rows = [row(2, 4, 400.0)]
    history = [reporter.update(rows, []).record()]
    rows.append(row(2, 4, 380.0))
    again = reporter.update(rows, history)
    assert again.config == BatchConfig(32, 2, 4) and again.estimated_performance == 1.0
    # the stream's ratio is the one of the table's estimated column (samples/s = objective)
    rows += [row(2, 8, 420.0), row(1, 4, 250.0), row(2, 8, 410.0)]
    last = reporter.update(rows, history)
    est = {(r["num_devices"], r["micro_batch_size"]): r["estimated_samples_per_s"]
           for r in last.record()["ranking"]}  # fmt: skip
    rec = last.config.num_devices, last.config.micro_batch_size
    assert rec == (2, 8) and last.estimated_performance == round(est[rec] / est[2, 4], 2)


def test_a_sharded_searchs_stream_names_its_settings_as_its_trial_lines_do():
    from mbtune.analysis.watch import _recommendation_line
    from mbtune.recommend.confidence import SearchModel

    model = SearchModel(tuple(p.canonical() for p in POINTS), sharded=True)
    rec = Reporter(model).update([row(2, 8, 500.0)], [])
    assert "batch_size: 32, fsdp, reshard_after_forward true, grad_sync last), " in rec.line()
    assert rec.record()["sharding"] == "fsdp"  # and mbtune watch reads it back
    assert _recommendation_line(rec.record()) == rec.line().split("\n")[0]
    assert "sharding" not in Reporter(POINTS).update([row(2, 8, 500.0)], []).record()


@pytest.mark.parametrize(
    ("user", "says"),
    [
        # base is not the user's configuration, which a user reads "1.00x base" as
        (BatchConfig(32, 1, 32), ", not to your configuration (the summary compares with "
                                 "yours where measured)"),
        (BatchConfig(32, 1, 4), None),
    ],
)  # fmt: skip
def test_the_first_recommendation_says_whether_base_is_your_configuration(user, says):
    first = Reporter(POINTS, user_config=user).update([row(1, 4, 400.0)], [])
    base = first.line().split("\n")[1]
    if says is None:  # the first recommendation is yours
        assert base == BASE.replace("throughput:", "throughput, your own configuration's:")
    else:
        assert base == BASE + says


def test_no_recommendation_until_a_trial_succeeds():
    assert Reporter(POINTS).update([row(2, 16, None, "oom")], []) is None


def test_the_summary_compares_with_base_and_the_users_configuration():
    reporter = Reporter(POINTS, user_config=BatchConfig(32, 1, 32), user_batch_size=40)
    rows = [
        row(1, 32, 200.0, compile_s=5.0),
        row(1, 8, 400.0, compile_s=10.0),
        row(2, 8, 500.0, compile_s=20.0),
    ]
    history = [reporter.update(rows[1:2]).record()]  # base: (1, 8), the first recommended
    s = reporter.summary(rows, "finished", history)
    assert s["status"] == "finished" and s["trials"] == 3
    assert s["recommended"]["num_devices"] == 2 and s["recommended"]["micro_batch_size"] == 8
    assert s["speedup_over_base"] == 1.25 and s["speedup_over_user"] == 2.5
    # a first record that names no configuration: base is its objective
    assert reporter.summary(rows, "finished", [{"objective": 250.0}])["speedup_over_base"] == 2.0
    top = [(t["num_devices"], t["micro_batch_size"]) for t in s["top"]]
    assert top == [(2, 8), (1, 8), (1, 32)]
    # valid batch sizes for n = 2, m = 8 are multiples of 16: 32 and 48 around the user's 40
    assert s["recommended_batch_size"] == 48
    # 500 vs 400 samples/s saves 0.5 ms a sample; 10 s more compile = 20 000 samples = 625 steps
    even = {(b["against"]["num_devices"], b["against"]["micro_batch_size"]): b
            for b in s["compile_break_even"]}  # fmt: skip
    assert even[1, 8]["extra_compile_s"] == 10.0 and even[1, 8]["break_even_steps"] == 625
    # 15 s more than m = 32 at 200 samples/s: 3 ms a sample saved, 5 000 samples = 157 steps
    assert even[1, 32]["break_even_steps"] == 157


def test_a_configuration_measured_again_keeps_the_compile_time_of_its_first_look():
    # the second look at (2, 8) loaded its graphs from the compile cache: 0.5 s, not 20
    rows = [row(1, 8, 400.0, compile_s=10.0), row(2, 8, 500.0, compile_s=20.0),
            row(2, 8, 500.0, compile_s=0.5)]  # fmt: skip
    s = Reporter(POINTS).summary(rows, "finished")
    assert s["recommended"]["compile_s"] == 20.0 and s["recommended"]["measurements"] == 2
    [even] = s["compile_break_even"]
    assert even["against"]["micro_batch_size"] == 8 and even["extra_compile_s"] == 10.0


def test_a_compile_time_from_the_cache_is_weighed_against_its_like_only():
    # (1, 8) loaded every graph (2, 8) compiled (the same micro-batch shape): its 0.6 s
    # makes no break-even against (2, 8)'s cold 20 s; (1, 32) compiled its own
    rows = [row(2, 8, 500.0, compile_s=20.0), row(1, 8, 400.0, compile_s=0.6,
            compile_from_cache=True), row(1, 32, 200.0, compile_s=5.0)]  # fmt: skip
    s = Reporter(POINTS).summary(rows, "finished")
    assert [b["against"]["micro_batch_size"] for b in s["compile_break_even"]] == [32]
    # a run whose every graph came from the cache weighs its loads against each other
    warm = [dataclasses.replace(r, compile_from_cache=True) for r in rows]
    even = Reporter(POINTS).summary(warm, "finished")["compile_break_even"]
    assert [b["against"]["micro_batch_size"] for b in even] == [8, 32]
    top = [(t["num_devices"], t["micro_batch_size"], t["compile_from_cache"]) for t in s["top"]]
    assert top == [(2, 8, False), (1, 8, True), (1, 32, False)]
    # a configuration with a look that compiled keeps that look's time
    again = Reporter(POINTS).summary([*rows, row(1, 8, 400.0, compile_s=9.0)], "finished")
    assert again["top"][1]["compile_s"] == 9.0 and not again["top"][1]["compile_from_cache"]


def test_the_recommended_batch_size_is_the_valid_one_nearest_the_users():
    r = Reporter(POINTS, user_batch_size=100)
    assert r.recommended_batch_size(BatchConfig(32, 2, 8)) == 96  # 96 and 112 around 100
    c = BatchConfig(32, 2, 8)
    assert Reporter(POINTS, user_batch_size=104).recommended_batch_size(c) == 112
    assert Reporter(POINTS, user_batch_size=3).recommended_batch_size(c) == 16


def test_a_summary_with_nothing_that_ran():
    s = Reporter(POINTS).summary([row(2, 16, None, "oom")], "finished")
    assert s["recommended"] is None and s["top"] == []


def test_the_tune_callback_records_streams_and_stops(tmp_path):
    pytest.importorskip("ray")
    from mbtune.search import ConfidenceStop, TrialLog

    run = RunDir.create(tmp_path, "cb")
    lines: list[str] = []
    log = TrialLog(run, lines.append, Reporter(POINTS), target=90, max_repeats=1)
    stop = ConfidenceStop(log)
    speeds = {(1, m): 100.0 * m for m in (1, 2, 4, 8, 16, 32)} | {(2, 16): None}
    speeds |= {(2, m): 190.0 * m for m in (1, 2, 4, 8)}
    for i, ((n, m), speed) in enumerate(speeds.items()):
        trial = SimpleNamespace(trial_id=f"t{i}", config={"batch_size": 32, "num_devices": n,
                                                          "micro_batch_size": m})  # fmt: skip
        log.on_trial_result(0, [], trial, result(n, m, speed, "ok" if speed else "oom"))
        log.on_trial_complete(0, [], trial)
        if stop.stop_all():
            break
    rows, records = run.trials(), run.recommendations()
    assert len(rows) == i + 1 and [r["trial"] for r in rows] == [str(k + 1) for k in range(i + 1)]
    # one recommendation after every finished trial from the first that ran
    first_ok = next(k for k, r in enumerate(rows) if r["status"] == "ok")
    assert len(records) == len(rows) - first_ok
    said = [part for line in lines for part in line.split("\n")]
    assert sum(bool(LINE.match(line)) for line in said) == len(records)
    assert said.count(BASE) == 1  # under the first recommendation only
    assert records[-1]["confidence"] >= 90 and stop.stop_all()
    assert (records[-1]["num_devices"], records[-1]["micro_batch_size"]) == (2, 8)
    # a trial stopped before it reported (the search was already confident) is not a result
    log.on_trial_complete(0, [], SimpleNamespace(trial_id="late", config={}))
    assert len(run.trials()) == len(rows)


def test_a_tie_is_in_the_stream_the_summary_and_its_table_starts_with_the_recommendation():
    from mbtune.recommend.confidence import SearchModel
    from mbtune.report import summary_lines

    # a busy machine: every micro-batch size on 2 devices within a few percent, repeats
    # 5-10% apart; 1 device half as fast
    looks = {1: (735, 660), 2: (700, 790), 4: (680, 780), 8: (775, 690), 16: (700, 790)}
    rows = [row(1, 8, 350), row(1, 32, 340)]
    rows += [row(2, m, v) for m, values in looks.items() for v in values]
    rows = [dataclasses.replace(r, trial=i) for i, r in enumerate(rows, start=1)]
    model = SearchModel(tuple(sorted({p.canonical() for p in POINTS})), noise_floor=0.035)
    reporter = Reporter(model)
    rec = reporter.update(rows)
    assert rec is not None and rec.tie is not None
    assert rec.record()["tie"] == rec.tie and rec.confidence < 90
    first, base, tie = rec.line().split("\n")  # the run's first: base said, then the tie
    assert LINE.match(first) and base == BASE and tie.startswith("mbtune: a tie within ")
    summary = reporter.summary(rows, "tie", [rec.record()])
    assert summary["tie"] == rec.tie
    top = summary["top"][0]
    assert (top["num_devices"], top["micro_batch_size"]) == (2, rec.config.micro_batch_size)
    assert summary["recommended"] == top
    lines = summary_lines(rows, summary, Path("runs/x"))
    assert any(line.startswith("  a tie within ") for line in lines)


def test_the_stream_and_the_summary_carry_one_ranking_the_recommendation_first():
    """The one order of "best" (reporter.ranking): every configuration measured ok, the
    recommendation first, then by the model's estimate, in samples/s; the stream's records
    and summary.json carry it, so watch and analyze read it rather than rank again."""
    reporter = Reporter(POINTS)
    records = [row(1, 8, 300.0), row(2, 8, 610.0), row(2, 4, 560.0), row(2, 8, 590.0),
               row(2, 16, None, "oom")]  # fmt: skip
    rec = reporter.update(records)
    ranking = rec.record()["ranking"]
    assert BatchConfig.from_mapping(ranking[0]) == rec.config == BatchConfig(32, 2, 8)
    assert [(e["num_devices"], e["micro_batch_size"]) for e in ranking] == [(2, 8), (2, 4),
                                                                             (1, 8)]  # fmt: skip
    assert ranking[0]["measurements"] == 2 and ranking[1]["measurements"] == 1
    estimates = [e["estimated_samples_per_s"] for e in ranking]
    assert estimates[1] > estimates[2] and all(e > 0 for e in estimates)
    summary = reporter.summary(records, "finished", [rec.record()])
    assert summary["ranking"] == ranking
    assert BatchConfig.from_mapping(summary["ranking"][0]) == BatchConfig.from_mapping(
        summary["recommended"]
    )
    json.dumps(summary)  # as summary.json holds it
