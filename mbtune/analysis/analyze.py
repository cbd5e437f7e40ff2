"""``mbtune analyze``: a run's report and plots (and its plan, where the experiment has a
plan section or ``--set plan.KEY=VALUE`` gives one), two runs side by side, or a run's
recommendation as another framework's snippet.

The command line passes its arguments to :func:`analyze`, which checks them and does the
work with the modules that own each part: mbtune.runs reads, mbtune.analysis.frames ranks
and reports, mbtune.analysis.plots draws, mbtune.analysis.export writes the snippet,
mbtune.plan plans (counting the model's bytes imports torch: only then) and
mbtune.report says the recommendation. What is not for the terminal reader (the files
written, the export's notes) goes to stderr with csv and json, so that those pipe cleanly.
"""

from __future__ import annotations

import functools
import operator
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import pandas as pd

from mbtune.analysis import frames as analysis
from mbtune.analysis.export import check_framework, export_config
from mbtune.config.rules import ConfigError
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig, stages_per_rank
from mbtune.report import export_header
from mbtune.runs.load import RunInfo, load_run, run_info
from mbtune.runs.record import SIZES
from mbtune.runs.rundir import RunDir

if TYPE_CHECKING:  # mbtune.plan imports scipy: only a run with a plan pays for it
    from mbtune.plan.planner import Plan

__all__ = [
    "analyze",
    "compare_two",
    "export_run",
    "report_one",
    "run_plan",
    "write_plan",
]


def analyze(
    run_dirs: Sequence[str | Path],
    *,
    fmt: str = "table",
    export: str | None = None,
    plots: bool = True,
    plan_overrides: Sequence[str] = (),
) -> None:
    """One run directory: its report and plots (and its plan, with ``plan_overrides``:
    ``plan.KEY=VALUE`` items), or with ``export`` its recommendation as that framework's
    snippet; two: compared (b against a)."""
    if len(run_dirs) > 2:
        raise MbtuneError(
            f"analyze: give one run directory, or two to compare; got {len(run_dirs)}"
        )
    for item in plan_overrides:
        if not item.startswith("plan."):
            raise ConfigError(
                "--set", f"mbtune analyze sets the plan's keys only (plan.KEY=VALUE), got {item!r}"
            )
    if plan_overrides and (len(run_dirs) != 1 or export is not None):
        raise ConfigError("--set", "plans one run: give one run directory and no --export")
    if export is not None:
        check_framework(export)  # before any run is read
        if len(run_dirs) != 1:
            raise MbtuneError("--export: give one run directory (its recommendation is exported)")
    runs = [(load_run(path), run_info(path)) for path in run_dirs]
    notes = sys.stdout if fmt in ("table", "markdown") else sys.stderr
    if len(runs) == 2:
        compare_two(runs[0], runs[1], fmt=fmt, plots=plots, notes=notes)
    elif export is not None:
        export_run(*runs[0], export)
    else:
        report_one(*runs[0], fmt=fmt, plots=plots, notes=notes, plan_overrides=plan_overrides)


def report_one(
    trials: pd.DataFrame,
    info: RunInfo,
    *,
    fmt: str,
    plots: bool,
    notes: TextIO,
    plan_overrides: Sequence[str] = (),
) -> None:
    """Print one run's report (and plan) and write its plots (and plan.csv) into it
    (``notes``: where to say so)."""
    if trials.empty:
        raise MbtuneError(analysis.no_ok_trial_message(trials, info.path))
    print(analysis.run_report(trials, info, fmt), end="")
    if not analysis.has_ok_trial(trials):  # the failed trials are shown, then the error
        raise MbtuneError(analysis.no_ok_trial_message(trials, info.path))
    plan = None
    if plan_overrides or info.experiment.plan is not None:
        plan = run_plan(info, plan_overrides, notes=notes)
    if plan is not None and fmt in ("table", "markdown"):
        from mbtune.plan.planner import plan_lines

        text = "\n".join(plan_lines(plan))
        print("\n" + (f"```\n{text}\n```" if fmt == "markdown" else text))
    if plots:
        from mbtune.analysis.plots import write_plots

        written, skipped = write_plots(trials, info)
        print("plots: " + ", ".join(str(p) for p in written), file=notes)
        for line in skipped:
            print(line, file=notes)
    if plan is not None:
        write_plan(plan, info, plot=plots, notes=notes)


def write_plan(plan: Plan, info: RunInfo, *, plot: bool, notes: TextIO) -> list[Path]:
    """Write ``plan`` into its run's directory, as ``mbtune analyze`` and ``mbtune plan``
    both do: plan.csv and, with ``plot``, plot-plan.png; one line on ``notes`` names
    them. The files written."""
    path = RunDir(info.path).plan_file
    try:
        plan.as_frame().to_csv(path, index=False)
    except OSError as e:
        raise MbtuneError(f"cannot write {path}: {e.strerror or e}") from None
    written = [path]
    if plot:
        from mbtune.analysis.plots import PLAN_PLOT, plan_figure, save

        written.append(save(plan_figure(plan, title=info.name), info.path / PLAN_PLOT))
    print("plan: " + ", ".join(str(p) for p in written), file=notes)
    return written


def run_plan(info: RunInfo, overrides: Sequence[str], *, notes: TextIO) -> Plan | None:
    """The plan of ``info``'s run: its experiment's plan section with ``overrides``. Where
    the section alone cannot be planned, one line on ``notes`` says why and the report
    stands (None); what ``--set`` asked for is an error."""
    from mbtune.plan.load import plan_run

    try:
        return plan_run(info.path, overrides)
    except MbtuneError as e:
        if overrides:
            raise
        print(f"mbtune: no plan: {e}", file=notes)
        return None


def compare_two(
    a: tuple[pd.DataFrame, RunInfo],
    b: tuple[pd.DataFrame, RunInfo],
    *,
    fmt: str,
    plots: bool,
    notes: TextIO,
) -> None:
    """Print runs ``a`` and ``b`` side by side, and plot them into ``a``'s directory."""
    for trials, info in (a, b):
        if trials.empty:  # a run with only failed trials still compares: they are results
            raise MbtuneError(analysis.no_ok_trial_message(trials, info.path))
    (trials_a, info_a), (trials_b, info_b) = a, b
    print(analysis.compare_report(trials_a, trials_b, info_a, info_b, fmt), end="")
    if plots:
        from mbtune.analysis.plots import compare_figure, save

        title = f"a: {info_a.path.name} vs b: {info_b.path.name}"
        figure = compare_figure([trials_a, trials_b], ["a", "b"], title=title)
        path = save(figure, info_a.path / f"compare-{info_b.path.name}.png")
        print(f"plot: {path}", file=notes)


def export_run(trials: pd.DataFrame, info: RunInfo, framework: str) -> Path:
    """Print the run's recommendation as ``framework``'s snippet and write it into the run
    directory; the file written."""
    rec = analysis.recommendation(trials, info)
    c = rec.config
    snippet = export_config(
        framework,
        c,
        recommended_batch_size=rec.recommended_batch_size,
        header=export_header(
            c, samples_per_s=rec.samples_per_s, run_path=info.path, source=rec.source
        ),
        precision=rec.precision,
        activation_checkpointing=c.activation_checkpointing,
        sharding=_sharding(trials, rec.config, info),
        layers=_layers(info) if framework == "megatron" and _interleaved(c) else None,
    )
    path = info.path / snippet.filename
    print(snippet.text, end="")
    try:
        path.write_text(snippet.text, encoding="utf-8")
    except OSError as e:
        raise MbtuneError(f"--export: cannot write {path}: {e.strerror or e}") from None
    for note in snippet.notes:
        print(f"mbtune: {note}", file=sys.stderr)
    print(f"mbtune: wrote {path}", file=sys.stderr)
    return path


def _interleaved(config: BatchConfig) -> bool:
    """Whether a pipeline rank holds several stages (Megatron-LM's virtual stages)."""
    return config.pipeline_parallel > 1 and stages_per_rank(config.pipeline_schedule) > 1


def _layers(info: RunInfo) -> int | None:
    """The run's model's layers (Megatron-LM's interleaved schedule is given them per
    virtual stage): the experiment's shape, else the model's built on torch's meta device
    (mbtune.plan.model_bytes); None where it cannot be built here (the export says so)."""
    if info.experiment.model_shape is not None:
        return info.experiment.model_shape.layers
    from mbtune.plan.model_bytes import split_shape  # imports torch

    try:
        return split_shape(info.experiment.model).layers
    except (MbtuneError, ImportError, OSError):  # a model of yours not importable here
        return None


def _sharding(trials: pd.DataFrame, config: BatchConfig, info: RunInfo) -> str:
    """How the recommended configuration held the model: its trials' ``sharding``
    (trials.csv), else the run's ``trial.sharding`` (runs from before the column)."""
    if "sharding" in trials:
        sizes = (trials[k] == getattr(config, k) for k in SIZES)
        measured = trials.loc[functools.reduce(operator.and_, sizes), "sharding"].dropna()
        if len(measured):
            return str(measured.iloc[0])
    return info.experiment.trial.sharding
