"""``mbtune analyze``: a run's report and plots, two runs side by side, or a run's
recommendation as another framework's snippet.

The command line passes its arguments to :func:`analyze`, which checks them and does the
work with the modules that own each part: mbtune.runs reads, mbtune.analysis.frames ranks
and reports, mbtune.analysis.plots draws, mbtune.analysis.export writes the snippet and
mbtune.report says the recommendation. What is not for the terminal reader (the plots
written, the export's notes) goes to stderr with csv and json, so that those pipe cleanly.
"""

from __future__ import annotations

import functools
import operator
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import pandas as pd

from mbtune.analysis import frames as analysis
from mbtune.analysis.export import check_framework, export_config
from mbtune.errors import MbtuneError
from mbtune.lattice import BatchConfig
from mbtune.report import export_header
from mbtune.runs.load import RunInfo, load_run, run_info
from mbtune.runs.record import SIZES

__all__ = ["analyze", "compare_two", "export_run", "report_one"]


def analyze(
    run_dirs: Sequence[str | Path],
    *,
    fmt: str = "table",
    export: str | None = None,
    plots: bool = True,
) -> None:
    """One run directory: its report and plots, or with ``export`` its recommendation as
    that framework's snippet; two: compared (b against a)."""
    if len(run_dirs) > 2:
        raise MbtuneError(
            f"analyze: give one run directory, or two to compare; got {len(run_dirs)}"
        )
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
        report_one(*runs[0], fmt=fmt, plots=plots, notes=notes)


def report_one(
    trials: pd.DataFrame, info: RunInfo, *, fmt: str, plots: bool, notes: TextIO
) -> None:
    """Print one run's report and write its plots into it (``notes``: where to say so)."""
    if trials.empty:
        raise MbtuneError(analysis.no_ok_trial_message(trials, info.path))
    print(analysis.run_report(trials, info, fmt), end="")
    if not analysis.has_ok_trial(trials):  # the failed trials are shown, then the error
        raise MbtuneError(analysis.no_ok_trial_message(trials, info.path))
    if plots:
        from mbtune.analysis.plots import write_plots

        written, skipped = write_plots(trials, info)
        print("plots: " + ", ".join(str(p) for p in written), file=notes)
        for line in skipped:
            print(line, file=notes)


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
        pipeline_stages=rec.pipeline_stages,
        recommended_batch_size=rec.recommended_batch_size,
        header=export_header(
            c, samples_per_s=rec.samples_per_s, run_path=info.path, source=rec.source
        ),
        precision=rec.precision,
        activation_checkpointing=c.activation_checkpointing,
        sharding=_sharding(trials, rec.config, info),
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


def _sharding(trials: pd.DataFrame, config: BatchConfig, info: RunInfo) -> str:
    """How the recommended configuration held the model: its trials' ``sharding``
    (trials.csv), else the run's ``trial.sharding`` (runs from before the column)."""
    if "sharding" in trials:
        sizes = (trials[k] == getattr(config, k) for k in SIZES)
        measured = trials.loc[functools.reduce(operator.and_, sizes), "sharding"].dropna()
        if len(measured):
            return str(measured.iloc[0])
    return info.experiment.trial.sharding
