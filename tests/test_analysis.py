"""The analysis: a run directory as a typed frame, ranked, pivoted, compared and printed."""

import io
import json
import math
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from rundirs import FINISHED_ROWS, finished_run, make_run, recommendation_record, trial_row

import mbtune
from mbtune.analysis import frames as analysis
from mbtune.config.load import parse_experiment
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.runs.load import COLUMNS, load_recommendations, load_run, load_runs, run_info
from mbtune.runs.rundir import TRIAL_COLUMNS

ROOT = Path(__file__).resolve().parent.parent

REPLAY_TABLE = """batch_size,num_devices,micro_batch_size,samples_per_s,peak_memory_bytes,status
4,1,1,100,100000000,ok
4,1,2,180,200000000,ok
4,1,4,300,900000000,ok
4,2,1,190,100000000,ok
4,2,2,,,oom
"""


@pytest.fixture(scope="module")
def replay_run(ray_session, tmp_path_factory):
    """A real (replay) search of five configurations, once for this module: 4,1,4 goes
    over the 512 MiB budget and 4,2,2 is an oom in the table."""
    from mbtune.search import run_search

    tmp = tmp_path_factory.mktemp("replay")
    (tmp / "t.csv").write_text(REPLAY_TABLE)
    exp = parse_experiment(
        {
            "name": "analysis",
            "model": "mlp",
            "train_input": {"batch_size": 4, "micro_batch_size": "auto"},
            "search": {"space": {"num_devices": [1, 2]}, "sampler": "grid"},
            "trial": {"backend": "replay", "table": str(tmp / "t.csv"),
                      "device_memory": "512MiB", "measure_steps": 3},
            "output_dir": str(tmp / "runs"),
        }
    )  # fmt: skip
    return run_search(exp, echo=lambda line: None).run.path


# ---------------------------------------------------------------------------
# load_run


@pytest.mark.ray
@pytest.mark.slow
def test_load_run_reads_a_finished_search(replay_run):
    df = load_run(replay_run)
    assert list(df.columns[: len(COLUMNS)]) == list(COLUMNS)
    assert len(df) == 5 and df["trial"].tolist() == [1, 2, 3, 4, 5]
    for name in ("trial", "batch_size", "num_devices", "micro_batch_size", "per_device_batch",
                 "grad_accum_steps", "pipeline_parallel"):  # fmt: skip
        assert df[name].dtype == np.int64, name
    for name in ("samples_per_s", "step_time_ms_median", "peak_memory_bytes", "wall_s"):
        assert df[name].dtype == np.float64, name
    assert pd.api.types.is_datetime64_any_dtype(df["finished_at"])
    by_config = df.set_index(["num_devices", "micro_batch_size"])
    assert sorted(by_config.index) == [(1, 1), (1, 2), (1, 4), (2, 1), (2, 2)]
    assert by_config.loc[(1, 2), "samples_per_s"] == pytest.approx(180.0)
    assert by_config.loc[(1, 2), "grad_accum_steps"] == 2
    assert by_config.loc[(1, 2), "step_times_ms"] == pytest.approx([4 / 180 * 1e3] * 3, rel=1e-3)
    assert by_config.loc[(1, 4), "status"] == "oom" and "512" in by_config.loc[(1, 4), "reason"]
    assert by_config.loc[(2, 2), "status"] == "oom"
    assert math.isnan(by_config.loc[(2, 2), "samples_per_s"])  # empty -> NaN, not ''
    assert df.attrs["dropped_rows"] == 0


@pytest.mark.ray
@pytest.mark.slow
def test_analyze_a_finished_search_end_to_end(replay_run, capsys):
    from mbtune.cli import main

    code = main(["analyze", str(replay_run)])
    out = capsys.readouterr().out
    assert code == 0
    # a search's run is ranked by its model's estimates, and the table says so
    title = "trials, best first by the run's ranking (estimated_samples_per_s), then samples_per_s:"
    first = out.split(title)[1].splitlines()[2].split()
    assert first[:5] == ["1", "4", "4", "2", "1"]  # rank, trial, B, n, m: 2 devices x 1
    for name in ("plot-throughput.png", "plot-memory.png", "plot-step-time.png"):
        assert (replay_run / name).read_bytes().startswith(b"\x89PNG")


def test_an_interrupted_run_is_read_as_far_as_it_got(tmp_path):
    path = make_run(tmp_path, FINISHED_ROWS[:3])  # no summary.json: the search was stopped
    df = load_run(path)
    assert df["trial"].tolist() == [1, 2, 3] and df["status"].tolist() == ["ok", "ok", "oom"]
    assert df["samples_per_s"].tolist()[:2] == [300.0, 630.0]
    info = run_info(path)
    assert info.summary is None and info.recommendations is None
    assert analysis.recommendation(df, info).config.sizes() == {
        "batch_size": 32, "num_devices": 2, "micro_batch_size": 8
    }  # fmt: skip


def _kill_mid_row(path: Path, keep: int) -> None:
    """Cut trials.csv inside its last row, as a driver killed while writing it leaves it."""
    csv_file = path / "trials.csv"
    text = csv_file.read_text()
    last = text.rstrip("\n").rfind("\n") + 1
    csv_file.write_text(text[: last + keep])


@pytest.mark.parametrize("keep", [1, 12, 60])
def test_a_killed_run_drops_its_half_written_last_row(tmp_path, keep):
    path = make_run(tmp_path, FINISHED_ROWS[:4])
    _kill_mid_row(path, keep)
    df = load_run(path)
    assert df["trial"].tolist() == [1, 2, 3]
    assert df.attrs["dropped_rows"] == 1


def test_a_row_cut_between_its_carriage_return_and_newline_is_complete(tmp_path):
    path = make_run(tmp_path, FINISHED_ROWS[:2])
    csv_file = path / "trials.csv"
    csv_file.write_bytes(csv_file.read_bytes().removesuffix(b"\n"))  # rows end in \r\n
    df = load_run(path)
    assert df["trial"].tolist() == [1, 2] and df.attrs["dropped_rows"] == 0


def test_a_killed_run_that_was_resumed_drops_only_the_half_row(tmp_path):
    path = make_run(tmp_path, FINISHED_ROWS[:3])
    _kill_mid_row(path, 20)
    from mbtune.runs.rundir import RunDir

    RunDir(path).append_trial({"trial": 4, **FINISHED_ROWS[3]})  # cuts the half row off first
    RunDir(path).append_trial({"trial": 5, **FINISHED_ROWS[4]})
    df = load_run(path)
    # the append cut the torn line off before writing, so nothing is left to drop
    assert df["trial"].tolist() == [1, 2, 4, 5] and df.attrs["dropped_rows"] == 0


def test_a_run_killed_before_its_first_trial(tmp_path):
    path = make_run(tmp_path, [])
    with pytest.raises(MbtuneError, match=r"has no trials.csv yet: no trial of this run"):
        load_run(path)
    (path / "trials.csv").write_text("trial,trial_id,sta")  # killed inside the header
    assert load_run(path).empty
    (path / "trials.csv").write_text(",".join(TRIAL_COLUMNS) + "\n")
    df = load_run(path)
    assert df.empty and list(df.columns) == list(COLUMNS)


def test_a_directory_that_is_not_a_run(tmp_path):
    with pytest.raises(MbtuneError, match=r"is not an mbtune run directory"):
        load_run(tmp_path)


def test_older_or_sparser_rows_are_completed_from_the_sizes(tmp_path):
    path = make_run(tmp_path, [])
    (path / "trials.csv").write_text(
        "trial,status,batch_size,num_devices,micro_batch_size,samples_per_s,extra\n"
        "1,ok,30,2,4,100.5,kept\n"
        "2,error,30,2,x,,\n"  # no usable micro_batch_size: dropped
    )
    df = load_run(path)
    assert len(df) == 1 and df.attrs["dropped_rows"] == 1
    row = df.iloc[0]
    p_g_p = (row["per_device_batch"], row["grad_accum_steps"], row["pipeline_parallel"])
    assert p_g_p == (15, 4, 1)
    assert not row["strict"] and row["extra"] == "kept"
    assert row["step_times_ms"] == [] and math.isnan(row["tokens_per_s"])


def test_load_runs_adds_a_run_column(tmp_path):
    a = make_run(tmp_path / "x", FINISHED_ROWS[:2], name="same")
    b = make_run(tmp_path / "y", FINISHED_ROWS[:3], name="same")
    c = make_run(tmp_path, FINISHED_ROWS[:1], name="other")
    df = load_runs([a, b, c])
    assert df.columns[0] == "run" and len(df) == 6
    assert df["run"].tolist() == [str(a)] * 2 + [str(b)] * 3 + ["other"]
    with pytest.raises(MbtuneError, match="at least one run directory"):
        load_runs([])


def test_the_package_exports_the_loaders_without_importing_pandas_early(light_imports):
    # conftest.LIGHT_IMPORTS: import mbtune, then its loaders, then the analysis modules
    assert "pandas" not in light_imports.loaded("package")
    assert light_imports.loaded("loaders").get("pandas") == "loaders"  # they bring it
    loaded = light_imports.loaded("analysis")
    assert not {"torch", "ray"} & loaded.keys(), loaded
    assert mbtune.load_run is load_run and mbtune.load_runs is load_runs


def test_every_column_is_documented():
    docs = (ROOT / "docs" / "analysis.md").read_text()
    documented = set(re.findall(r"^\| `(\w+)` \|", docs, flags=re.M))
    assert set(COLUMNS) <= documented


# ---------------------------------------------------------------------------
# ranking, pivots, recommendation


def test_ranked_puts_the_best_first_and_the_failed_last(tmp_path):
    df = load_run(make_run(tmp_path, FINISHED_ROWS))
    table = analysis.ranked(df)
    assert table["trial"].tolist() == [2, 5, 4, 1, 3, 6]
    assert table["rank"].tolist()[:4] == [1, 2, 3, 4] and table["rank"].isna().tolist()[4:] == [
        True, True
    ]  # fmt: skip


def test_best_is_the_model_s_ranking_where_the_run_wrote_one(tmp_path):
    """The lucky repeat of another configuration (660 samples/s once) does not outrank the
    recommendation: the run's ranking (the search model's) orders trials and configurations,
    the stream's last record while the run goes on, summary.json's once it ended."""
    rows = [trial_row(32, 2, 8, 630.0), trial_row(32, 2, 4, 660.0), trial_row(32, 2, 8, 640.0),
            trial_row(32, 2, 4, 560.0), trial_row(32, 1, 8, status="oom")]  # fmt: skip
    ranking = [
        {"batch_size": 32, "num_devices": 2, "micro_batch_size": 8,
         "estimated_samples_per_s": 634.0, "samples_per_s": 634.9, "measurements": 2},
        {"batch_size": 32, "num_devices": 2, "micro_batch_size": 4,
         "estimated_samples_per_s": 601.0, "samples_per_s": 607.9, "measurements": 2},
    ]  # fmt: skip
    stream = [{**recommendation_record(4, 2, 8, 32, 634.9, 80), "ranking": ranking}]
    path = make_run(tmp_path, rows, recommendations=stream)
    df = load_run(path)
    assert df["model_rank"].tolist()[:4] == [1.0, 2.0, 1.0, 2.0] and math.isnan(df["model_rank"][4])
    assert df["estimated_samples_per_s"].tolist()[:2] == [634.0, 601.0]
    table = analysis.ranked(df)
    assert table["trial"].tolist() == [3, 1, 2, 4, 5]  # the recommendation's trials first
    assert analysis.recommendation(df, run_info(path)).config == BatchConfig(32, 2, 8)
    best = analysis.best_per_config(df)
    assert best["micro_batch_size"].tolist() == [8, 4, 8]  # model's order; the fastest each
    assert best["samples_per_s"].tolist()[:2] == [640.0, 660.0]
    # once the run ended, summary.json's ranking is the one read
    (path / "summary.json").write_text(json.dumps({"status": "finished",
                                                   "ranking": ranking[::-1]}))  # fmt: skip
    assert analysis.ranked(load_run(path))["trial"].tolist()[:2] == [2, 4]


def test_ranked_follows_the_objective_not_the_raw_throughput(tmp_path):
    rows = [
        trial_row(32, 1, 8, 400.0, objective="samples_per_s_per_device"),  # 400 per device
        trial_row(32, 2, 8, 630.0, objective="samples_per_s_per_device"),  # 315 per device
    ]
    table = analysis.ranked(load_run(make_run(tmp_path, rows)))
    assert table["num_devices"].tolist() == [1, 2]


def test_pivot_of_samples_per_s_with_statuses(tmp_path):
    df = load_run(make_run(tmp_path, FINISHED_ROWS))
    pivot = analysis.throughput_pivot(df)
    assert list(pivot.index) == [4, 8, 16, 32] and list(pivot.columns) == [1, 2]
    assert pivot.loc[8, 2] == 630.0 and math.isnan(pivot.loc[16, 2])
    text = analysis.status_pivot(df)
    assert (text.loc[16, 2], text.loc[32, 1], text.loc[16, 1]) == ("oom", "error", "")
    assert text.loc[8, 2] == "630.0"


def test_the_recommendation_comes_from_summary_json_else_the_best_trial(tmp_path):
    summary = {"status": "finished", "confidence": 80, "recommended_batch_size": 64,
               "recommended": {"batch_size": 32, "num_devices": 1, "micro_batch_size": 8,
                               "samples_per_s": 320.0}}  # fmt: skip
    path = make_run(tmp_path, FINISHED_ROWS, summary=summary)
    rec = analysis.recommendation(load_run(path), run_info(path))
    assert (rec.config.num_devices, rec.config.micro_batch_size, rec.source) == (
        1, 8, "summary.json"
    )  # fmt: skip
    assert (rec.confidence, rec.recommended_batch_size, rec.grad_accum_steps) == (80, 64, 4)
    (path / "summary.json").write_text('{"recommended": {"batch_size": "many"}}')
    with pytest.raises(MbtuneError, match="'recommended' needs batch_size"):
        analysis.recommendation(load_run(path), run_info(path))
    (path / "summary.json").write_text("{not json")
    with pytest.raises(MbtuneError, match="summary.json is not valid JSON"):
        run_info(path)


def test_no_recommendation_without_an_ok_trial(tmp_path):
    path = make_run(
        tmp_path, [trial_row(32, 1, 32, status="oom"), trial_row(32, 2, 16, None, "error")]
    )
    with pytest.raises(
        MbtuneError,
        match=r"successfully \(2 trials: error 1, oom 1; first reason: oom for the test\); nothing",
    ):
        analysis.recommendation(load_run(path), run_info(path))


def test_recommendations_jsonl_skips_a_half_written_line(tmp_path):
    path = finished_run(tmp_path)
    with (path / "recommendations.jsonl").open("a") as f:
        f.write('{"time": "2026-11-21T19:41:12", "trials": 6, "confid')
    recs = load_recommendations(path)
    assert recs["trials"].tolist() == [1, 2, 5] and recs["confidence"].tolist() == [10, 40, 92]
    assert load_recommendations(tmp_path) is None


# ---------------------------------------------------------------------------
# compare and text


def test_compare_matches_configurations_and_gives_the_ratio(tmp_path):
    a = load_run(make_run(tmp_path, FINISHED_ROWS, name="a"))
    b_rows = [trial_row(32, 2, 8, 693.0), trial_row(32, 2, 16, 700.0), trial_row(32, 1, 2, 50.0),
              trial_row(32, 2, 4, 600.0, "oom")]  # fmt: skip
    b = load_run(make_run(tmp_path, b_rows, name="b"))
    both = analysis.compare_runs(a, b).set_index(["num_devices", "micro_batch_size"])
    assert both.loc[(2, 8), "ratio"] == pytest.approx(1.1)
    assert (both.loc[(2, 16), "status_a"], both.loc[(2, 16), "status_b"]) == ("oom", "ok")
    assert math.isnan(both.loc[(2, 16), "ratio"])
    assert both.loc[(2, 4), "samples_per_s_b"] == 600.0 and math.isnan(both.loc[(2, 4), "ratio"])
    assert math.isnan(both.loc[(1, 2), "samples_per_s_a"]) and pd.isna(both.loc[(1, 2), "status_a"])
    assert len(both) == 7  # the union of both runs' configurations


def test_best_per_config_keeps_the_fastest_ok_trial(tmp_path):
    rows = [trial_row(32, 1, 8, status="oom"), trial_row(32, 1, 8, 300.0),
            trial_row(32, 1, 8, 310.0)]  # fmt: skip
    best = analysis.best_per_config(load_run(make_run(tmp_path, rows)))
    assert len(best) == 1 and best["samples_per_s"].iloc[0] == 310.0


def test_render_table_formats(tmp_path):
    table = analysis.ranked(load_run(make_run(tmp_path, FINISHED_ROWS)))
    records = json.loads(analysis.render_table(table, "json"))
    assert records[0]["rank"] == 1 and records[0]["samples_per_s"] == 630.0
    assert records[-1]["rank"] is None and records[-1]["samples_per_s"] is None
    back = pd.read_csv(io.StringIO(analysis.render_table(table, "csv")))
    assert back["trial"].tolist() == [2, 5, 4, 1, 3, 6] and back["step_times_ms"].iloc[0]
    markdown = analysis.render_table(table[["rank", "status"]], "markdown").splitlines()
    assert markdown[:3] == ["| rank | status |", "|---:|---|", "| 1 | ok |"]
    assert markdown[-1] == "|  | error |" and len(markdown) == 2 + len(table)
    text = analysis.render_table(table[["rank", "samples_per_s"]], "table",
                                 floats={"samples_per_s": ",.1f"}).splitlines()  # fmt: skip
    assert text[0] == "rank  samples_per_s" and text[1] == "   1          630.0"
    with pytest.raises(MbtuneError, match="unknown format 'xml'"):
        analysis.render_table(table, "xml")


def test_the_docs_column_table_is_the_record_schema():
    from pathlib import Path

    from mbtune.runs import record

    docs = (Path(__file__).parent.parent / "docs" / "analysis.md").read_text()
    assert record.markdown_table() in docs


def test_every_trial_result_field_is_a_column_of_trials_csv():
    import dataclasses

    from mbtune.trial.trial import TrialResult

    fields = {f.name for f in dataclasses.fields(TrialResult)}
    assert fields <= set(TRIAL_COLUMNS)


def test_run_info_reads_the_typed_experiment_the_run_saved(tmp_path):
    path = make_run(tmp_path, FINISHED_ROWS)
    info = run_info(path)
    assert info.experiment.train_input.batch_size == 32
    assert (info.name, info.objective, info.device_memory_bytes, info.confidence_target) == (
        "handmade", "samples_per_s", 512 * 2**20, 90
    )  # fmt: skip
    (path / "experiment.yaml").write_text("name: x\nmodel: mlp\ntrain_input: {batch_size: 0}\n")
    with pytest.raises(
        MbtuneError,
        match=r"^RUN_DIR: cannot read .*experiment\.yaml: train_input\.batch_size: 0 is out of "
        r"range; expected a whole number from 1 to \d+$",
    ):
        run_info(path)


def test_repeats_are_shown_with_their_spread_in_the_report_and_the_plot(tmp_path):
    rows = [
        trial_row(32, 1, 4, 400.0),
        trial_row(32, 1, 8, 500.0),
        trial_row(32, 1, 8, 450.0, repeat=1),
        trial_row(32, 1, 8, 480.0, repeat=2),
        trial_row(32, 1, 16, 300.0),
    ]
    path = make_run(tmp_path, rows)
    trials = load_run(path)
    assert trials["repeat"].tolist() == [0, 0, 1, 2, 0]
    spread = analysis.repeat_spread(trials)
    assert spread[["micro_batch_size", "measurements"]].values.tolist() == [[8, 3]]
    row = spread.iloc[0]
    assert (row["samples_per_s_median"], row["samples_per_s_min"], row["samples_per_s_max"]) == (
        480.0, 450.0, 500.0
    )  # fmt: skip
    assert row["spread"] == pytest.approx(
        np.std([500, 450, 480], ddof=1) / np.mean([500, 450, 480])
    )
    report = analysis.run_report(trials, run_info(path))
    assert "configurations measured more than once" in report and "5.3%" in report
    pytest.importorskip("matplotlib")
    from matplotlib.collections import LineCollection

    from mbtune.analysis.plots import throughput_figure

    ax = throughput_figure(trials, title="r").axes[0]
    bars = [c for c in ax.collections if isinstance(c, LineCollection)]
    assert [seg.tolist() for c in bars for seg in c.get_segments()] == [[[8, 450], [8, 500]]]
    assert ax.lines[0].get_ydata().tolist() == [400.0, 480.0, 300.0]  # through the medians
    # a run from before repeats: every trial a first measurement, no such section
    older = make_run(tmp_path, rows[:2], name="older-20261121-194111")
    lines = (older / "trials.csv").read_text().splitlines()
    drop = lines[0].split(",").index("repeat")
    (older / "trials.csv").write_text(
        "\n".join(",".join(c for i, c in enumerate(line.split(",")) if i != drop)
                  for line in lines) + "\n"
    )  # fmt: skip
    assert load_run(older)["repeat"].tolist() == [0, 0]


# ---------------------------------------------------------------------------
# a configuration is named by every searched dimension (CONFIG_KEY)


def test_config_key_is_every_searched_column():
    from mbtune.lattice import LAYOUT, SETTINGS
    from mbtune.runs.record import CONFIG_KEY, SIZES

    assert [*SIZES, *SETTINGS, *LAYOUT] == list(CONFIG_KEY)
    assert SETTINGS == ("activation_checkpointing", "reshard_after_forward", "grad_sync")


def test_best_per_config_keeps_checkpointing_on_and_off_apart(tmp_path):
    rows = [
        trial_row(32, 1, 8, 300.0),
        trial_row(32, 1, 8, 250.0, activation_checkpointing=True),
        trial_row(32, 1, 8, 310.0),
        trial_row(32, 1, 16, status="oom"),
        trial_row(32, 1, 16, 280.0, activation_checkpointing=True),
    ]
    best = analysis.best_per_config(load_run(make_run(tmp_path, rows)))
    kept = best[["micro_batch_size", "activation_checkpointing", "samples_per_s", "status"]]
    assert kept.fillna({"samples_per_s": 0.0}).values.tolist() == [
        [8, False, 310.0, "ok"], [16, False, 0.0, "oom"], [8, True, 250.0, "ok"],
        [16, True, 280.0, "ok"],
    ]  # fmt: skip


def test_compare_runs_pairs_checkpointing_on_with_on_and_off_with_off(tmp_path):
    a = load_run(make_run(tmp_path, [
        trial_row(32, 1, 8, 300.0), trial_row(32, 1, 8, 250.0, activation_checkpointing=True),
        trial_row(32, 1, 16, 400.0, activation_checkpointing=True),
    ], name="a"))  # fmt: skip
    b = load_run(make_run(tmp_path, [
        trial_row(32, 1, 8, 330.0), trial_row(32, 1, 8, 200.0, activation_checkpointing=True),
        trial_row(32, 1, 16, 500.0),
    ], name="b"))  # fmt: skip
    both = analysis.compare_runs(a, b)
    assert list(both.columns[:4]) == [
        "batch_size", "num_devices", "micro_batch_size", "activation_checkpointing"
    ]  # fmt: skip
    by_config = both.set_index(["micro_batch_size", "activation_checkpointing"])
    assert len(both) == 4
    assert by_config.loc[(8, False), "ratio"] == pytest.approx(1.1)
    assert by_config.loc[(8, True), "ratio"] == pytest.approx(0.8)
    # measured with checkpointing in a and without in b: not the same configuration
    on_in_a, off_in_b = by_config.loc[(16, True)], by_config.loc[(16, False)]
    assert on_in_a["samples_per_s_a"] == 400.0 and pd.isna(on_in_a["status_b"])
    assert off_in_b["samples_per_s_b"] == 500.0 and pd.isna(off_in_b["status_a"])
    assert by_config["ratio"].isna().tolist() == [False, False, True, True]
    text = analysis.compare_report(a, b, run_info(tmp_path / "a"), run_info(tmp_path / "b"))
    matched = "matched on (batch_size, num_devices, micro_batch_size, activation_checkpointing)"
    assert matched in text


def test_the_pivot_and_the_report_keep_checkpointing_apart(tmp_path):
    rows = [
        trial_row(32, 1, 8, 300.0), trial_row(32, 1, 8, 250.0, activation_checkpointing=True),
        trial_row(32, 2, 8, 500.0), trial_row(32, 2, 16, status="oom"),
        trial_row(32, 2, 16, 450.0, activation_checkpointing=True),
    ]  # fmt: skip
    path = make_run(tmp_path, rows)
    df = load_run(path)
    pivot = analysis.throughput_pivot(df)
    assert pivot.columns.names == ["num_devices", "activation_checkpointing"]
    assert pivot.loc[8, (1, False)] == 300.0 and pivot.loc[8, (1, True)] == 250.0
    assert analysis.status_pivot(df).loc[16].tolist() == ["", "", "oom", "450.0"]
    report = analysis.run_report(df, run_info(path))
    assert "num_devices 2, activation_checkpointing False  num_devices 2, activation" in report
    ranked_header = report.split("trials, best first by samples_per_s:\n")[1].splitlines()[0]
    assert ranked_header.split()[3:7] == [
        "num_devices", "micro_batch_size", "activation_checkpointing", "grad_accum_steps"
    ]  # fmt: skip
    # a run that measured one setting only reads as it always has
    plain = load_run(make_run(tmp_path, FINISHED_ROWS, name="plain-20261121-194111"))
    assert list(analysis.throughput_pivot(plain).columns) == [1, 2]
    assert "activation_checkpointing" not in analysis.run_report(plain, run_info(path))


def test_a_plot_draws_checkpointing_on_and_off_as_two_lines(tmp_path):
    pytest.importorskip("matplotlib")
    from mbtune.analysis.plots import compare_figure, throughput_figure

    rows = [trial_row(32, 1, 8, 300.0), trial_row(32, 1, 8, 250.0, activation_checkpointing=True),
            trial_row(32, 1, 16, 320.0)]  # fmt: skip
    df = load_run(make_run(tmp_path, rows))
    ax = throughput_figure(df, title="t").axes[0]
    lines = {line.get_label(): line.get_ydata().tolist() for line in ax.lines}
    assert lines["num_devices 1, activation_checkpointing False"] == [300.0, 320.0]
    assert lines["num_devices 1, activation_checkpointing True"] == [250.0]
    ax = compare_figure([df, df], ["a", "b"], title="t").axes[0]
    assert "a, n 1, activation_checkpointing True" in [line.get_label() for line in ax.lines]


# ---------------------------------------------------------------------------
# the trial record and trials.csv's one reader


def test_the_record_is_every_column_of_trials_csv():
    import dataclasses

    from mbtune.runs.record import CSV_COLUMNS, TrialRecord

    fields = [f.name for f in dataclasses.fields(TrialRecord)]
    assert fields == [*CSV_COLUMNS, "extras"]


def test_the_pivot_of_a_split_model_names_each_layout_as_the_table_of_the_best(tmp_path):
    rows = [trial_row(32, 4, 4, 600.0),
            trial_row(32, 4, 4, 700.0, pipeline_parallel=2, pipeline_schedule="interleaved_1f1b"),
            trial_row(32, 4, 4, 650.0, tensor_parallel=2)]  # fmt: skip
    path = make_run(tmp_path, rows)
    report = analysis.run_report(load_run(path), run_info(path))
    header = report.split("(a configuration's fastest measurement):\n")[1].splitlines()[0]
    assert header.split("  ") == [  # no schedule where nothing is pipelined
        "micro_batch_size", "num_devices 4, t x p 1x1", "num_devices 4, t x p 1x2 "
        "interleaved_1f1b", "num_devices 4, t x p 2x1"]  # fmt: skip


def test_a_record_writes_the_row_the_trial_reported_byte_for_byte(tmp_path):
    """trials.csv's format is as before: a record writes the cells the result's own
    values wrote (a whole number stays whole, a list is space-separated)."""
    from mbtune.runs.record import TrialRecord
    from mbtune.runs.rundir import RunDir

    reported = {
        "trial": 1, "trial_id": "t1", "repeat": 0, **trial_row(32, 2, 8, 630.0),
        "peak_memory_bytes": 3 * 2**30, "micro_batches": [8, 8], "mixes_batch": False,
    }  # fmt: skip
    by_record, by_hand = RunDir.create(tmp_path, "r"), RunDir.create(tmp_path, "h")
    by_record.append_trial(TrialRecord.from_result(reported))
    by_hand.append_trial({k: v for k, v in reported.items() if k in TRIAL_COLUMNS})
    text = by_record.trials_file.read_bytes()
    assert text == by_hand.trials_file.read_bytes()
    assert b",3221225472," in text and b",8 8," in text and b",630.0," in text
    back = by_record.records()[0]
    assert back.to_row() == TrialRecord.from_result(reported).to_row()
    assert (back.peak_memory_bytes, back.micro_batches, back.activation_checkpointing) == (
        3 * 2**30, (8, 8), False
    )  # fmt: skip


def test_a_record_needs_a_trial_number_and_sizes_that_form_a_configuration():
    from mbtune.lattice import LatticeError
    from mbtune.runs.record import TrialRecord

    row = {"trial": "1", "status": "ok", "batch_size": "32", "num_devices": "2"}
    with pytest.raises(ValueError, match="no whole number in micro_batch_size"):
        TrialRecord.from_row(row)
    with pytest.raises(ValueError, match="no whole number in trial"):
        TrialRecord.from_row({**row, "trial": "", "micro_batch_size": "4"})
    with pytest.raises(LatticeError, match="batch_size 1 is smaller than num_devices 2"):
        TrialRecord.from_row({**row, "batch_size": "1", "micro_batch_size": "1"})
    record = TrialRecord.from_row({**row, "micro_batch_size": "4.0", "samples_per_s": "x",
                                   "step_times_ms": "1 y", "repeat": ""})  # fmt: skip
    assert (record.micro_batch_size, record.samples_per_s, record.step_times_ms) == (4, None, ())
    assert record.repeat == 0 and record.config.grad_accum_steps == 4


DAMAGED = [
    # (what a killed driver, or a hand, left after two whole rows; the trials read)
    ("", [1, 2]),
    ("3,t3,ok,32,1,8", [1, 2]),  # torn inside the row
    ("\r", [1, 2]),  # torn between the last row's \r and \n: that row is whole
    ("3,t3,ok\r\n", [1, 2]),  # whole, but too few fields
    ("3,t3,ok,32,1,x" + "," * (len(TRIAL_COLUMNS) - 6) + "\r\n", [1, 2]),  # no micro_batch_size
]


@pytest.mark.parametrize(("tail", "trials"), DAMAGED)
def test_one_rule_for_a_half_written_row_everywhere(tmp_path, tail, trials):
    """The search resuming (RunDir.records, RunDir.trials) and the analysis (load_run)
    read the same trials from the same damaged file, and the writer cuts exactly what
    they drop before it appends."""
    from mbtune.runs.rundir import RunDir, read_trials

    path = make_run(tmp_path, FINISHED_ROWS[:2])
    run = RunDir(path)
    text = run.trials_file.read_bytes()
    run.trials_file.write_bytes(text.removesuffix(b"\n") if tail == "\r" else text + tail.encode())
    dropped = read_trials(run.trials_file).dropped
    assert [r.trial for r in run.records()] == trials
    assert [r["trial"] for r in run.trials()] == [str(t) for t in trials]
    df = load_run(path)
    assert df["trial"].tolist() == trials and df.attrs["dropped_rows"] == dropped
    assert dropped == (0 if tail in ("", "\r") else 1)
    run.append_trial({"trial": 9, **FINISHED_ROWS[2]})
    assert [r.trial for r in run.records()] == [*trials, 9]
    assert load_run(path)["trial"].tolist() == [*trials, 9]


def test_the_record_imports_neither_torch_nor_pandas_nor_ray(light_imports):
    loaded = light_imports.loaded("record")  # conftest.LIGHT_IMPORTS: the modules imported
    assert not {"torch", "pandas", "ray"} & loaded.keys(), loaded
