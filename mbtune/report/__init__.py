"""Every sentence mbtune shows a person about a configuration and a recommendation.

Pure text: neither torch nor ray nor pandas. The search's stream (a trial line, the
recommendation line, the end-of-run summary), ``mbtune validate``'s summary,
``mbtune space``'s micro-batches column, ``mbtune trial``'s result, the export's header
and ``mbtune analyze``'s recommendation are all said here, each piece one way:

A package of three: ``words`` (how a configuration is named), ``stream`` (what a search
says), ``command`` (what ``mbtune trial`` and ``mbtune validate`` say); its names are
re-exported here.

- a configuration's sizes and layout: :func:`sizes` ('num_devices 2, batch_size 64,
  micro_batch_size 8');
- how it computes: :func:`step_suffix` (', bf16, with activation checkpointing');
- how it splits into micro-batches: :func:`micro_batches` ('4x8', '3+2+2') and the
  sentences built on it, :func:`devices_split` and :func:`per_device_split`.

The stream's recommendation line keeps the Cerebras order (micro_batch_size first, then
the rest in parentheses), which the end-of-run summary follows.
"""

from mbtune.report.command import experiment_lines, result_lines
from mbtune.report.stream import (
    another_look_line,
    base_line,
    export_header,
    recommended_line,
    stream_line,
    summary_lines,
    tie_line,
    trial_line,
)
from mbtune.report.words import (
    devices_split,
    layout,
    micro_batches,
    per_device_split,
    plural,
    sizes,
    step_suffix,
    value_text,
)

__all__ = [
    "another_look_line",
    "base_line",
    "devices_split",
    "experiment_lines",
    "export_header",
    "layout",
    "micro_batches",
    "per_device_split",
    "plural",
    "recommended_line",
    "result_lines",
    "sizes",
    "step_suffix",
    "stream_line",
    "summary_lines",
    "tie_line",
    "trial_line",
    "value_text",
]
