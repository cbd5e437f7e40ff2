"""Plots: every one written as a valid, non-empty PNG, and each draws what it promises."""

import subprocess
import sys

import pytest
from rundirs import EXPERIMENT, FINISHED_ROWS, PNG_MAGIC, finished_run, make_run, trial_row

from mbtune.analysis import plots
from mbtune.runs.load import load_run, run_info


def legend_labels(fig):
    legend = fig.axes[0].get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend else []


def test_every_plot_is_written_as_a_png(tmp_path):
    path = finished_run(tmp_path)
    written, skipped = plots.write_plots(load_run(path), run_info(path))
    assert [p.name for p in written] == list(plots.PLOT_FILES.values()) and skipped == []
    for p in written:
        data = p.read_bytes()
        assert p.parent == path and len(data) > 1000 and data.startswith(PNG_MAGIC)


def test_a_run_without_recommendations_gets_no_confidence_plot_and_says_why(tmp_path):
    path = make_run(tmp_path, FINISHED_ROWS)
    written, skipped = plots.write_plots(load_run(path), run_info(path))
    assert [p.name for p in written] == [
        "plot-throughput.png", "plot-memory.png", "plot-step-time.png"
    ]  # fmt: skip
    assert skipped == [
        "plot-confidence.png not written: the run has no recommendations.jsonl (older run?)"
    ]
    assert not (path / "plot-confidence.png").exists()


def test_throughput_has_a_line_per_device_count_and_marks_failures(tmp_path):
    fig = plots.throughput_figure(load_run(make_run(tmp_path, FINISHED_ROWS)), title="t")
    labels = legend_labels(fig)
    assert labels == ["num_devices 1", "num_devices 2", "out of memory", "error",
                      "best: 630 samples/s"]  # fmt: skip
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert list(lines["num_devices 2"].get_xdata()) == [4, 8]
    assert list(lines["num_devices 2"].get_ydata()) == [590.0, 630.0]


def test_the_star_is_the_runs_best_configuration_not_its_luckiest_trial(tmp_path):
    # (2, 8) measured twice, 630 and 660: the star sits on its line (the median, 645),
    # or at the model's estimate where the run ranked it, never at the luckier 660
    rows = [*FINISHED_ROWS, trial_row(32, 2, 8, 660.0)]
    fig = plots.throughput_figure(load_run(make_run(tmp_path, rows)), title="t")
    assert legend_labels(fig)[-1] == "best: 645 samples/s"
    ranking = [{"batch_size": 32, "num_devices": 2, "micro_batch_size": 8,
                "estimated_samples_per_s": 641.0, "samples_per_s": 644.8, "measurements": 2}]
    summary = {"status": "finished", "recommended": None, "ranking": ranking}
    path = make_run(tmp_path, rows, name="ranked-20261128-130000", summary=summary)
    fig = plots.throughput_figure(load_run(path), title="t")
    star = next(x for x in fig.axes[0].get_lines() if x.get_label().startswith("best"))
    assert star.get_label() == "best: 641 samples/s (estimated)"
    assert list(star.get_xdata()) == [8] and list(star.get_ydata()) == [641.0]


def test_memory_draws_the_budget_or_says_there_is_none(tmp_path):
    df = load_run(make_run(tmp_path, FINISHED_ROWS))
    fig = plots.memory_figure(df, device_memory_bytes=512 * 2**20, title="t")
    assert legend_labels(fig) == [
        "num_devices 1",
        "num_devices 2",
        "out of memory",
        "budget (device_memory) 512 MiB",
    ]  # the error trial has no peak memory: it is not drawn
    budget = [line for line in fig.axes[0].get_lines() if line.get_label().startswith("budget")]
    assert list(budget[0].get_ydata()) == [512, 512]  # MiB
    fig = plots.memory_figure(df, device_memory_bytes=None, title="t")
    assert not any(label.startswith("budget") for label in legend_labels(fig))
    assert fig.axes[0].get_title().endswith("(no device_memory budget set)")


def test_step_time_stacks_compute_communication_and_bubble(tmp_path):
    fig = plots.step_time_figure(load_run(make_run(tmp_path, FINISHED_ROWS)), title="t")
    ax = fig.axes[0]
    assert legend_labels(fig) == ["compute", "all-reduce", "pipeline bubble"]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["n1 m4", "n1 m8", "n2 m4", "n2 m8"]
    compute, comm = ax.containers[0], ax.containers[1]
    assert comm[3].get_y() == compute[3].get_height()  # all-reduce sits on compute
    assert comm[3].get_height() == pytest.approx(0.1) and comm[0].get_height() == 0.0


def test_step_time_keeps_the_best_bars_when_there_are_many(tmp_path, monkeypatch):
    monkeypatch.setattr(plots, "STEP_TIME_BARS", 2)
    fig = plots.step_time_figure(load_run(make_run(tmp_path, FINISHED_ROWS)), title="t")
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["n2 m4", "n2 m8"]
    assert fig.axes[0].get_title().endswith("(best 2 of 4)")


def test_confidence_over_trials_with_its_target(tmp_path):
    path = finished_run(tmp_path)
    info = run_info(path)
    fig = plots.confidence_figure(info.recommendations, target=90, title="t")
    ax = fig.axes[0]
    assert legend_labels(fig) == ["confidence", "target 90"]
    assert list(ax.get_lines()[0].get_ydata()) == [10, 40, 92]
    assert [t.get_text() for t in ax.texts] == ["n1 m4", "n2 m8"]  # each change labelled
    fig = plots.confidence_figure(info.recommendations, target=None, title="t")
    assert legend_labels(fig) == ["confidence"]


def test_compare_has_a_line_per_run_and_device_count(tmp_path):
    a = load_run(make_run(tmp_path, FINISHED_ROWS, name="a"))
    b = load_run(make_run(tmp_path, [trial_row(32, 2, 8, 700.0)], name="b"))
    fig = plots.compare_figure([a, b], ["a", "b"], title="a vs b")
    assert {"a, n 1", "a, n 2", "b, n 2"} <= set(legend_labels(fig))
    written = plots.save(fig, tmp_path / "c.png")
    assert written.read_bytes().startswith(PNG_MAGIC)


def test_plotting_leaves_the_callers_matplotlib_backend_alone(tmp_path):
    path = make_run(tmp_path, FINISHED_ROWS)
    code = (
        "import matplotlib; matplotlib.use('svg'); "
        "from mbtune.analysis import plots; from mbtune.runs.load import load_run, run_info; "
        f"plots.write_plots(load_run({str(path)!r}), run_info({str(path)!r})); "
        "import sys; sys.exit(0 if matplotlib.get_backend() == 'svg' else 1)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_a_run_without_peak_memory_or_ok_trials_still_plots(tmp_path):
    rows = [trial_row(32, 1, 8, status="oom", peak_memory_bytes=None)]
    path = make_run(tmp_path, rows, experiment={**EXPERIMENT, "trial": {}})  # no budget
    written, _ = plots.write_plots(load_run(path), run_info(path))
    assert all(p.read_bytes().startswith(PNG_MAGIC) for p in written)
