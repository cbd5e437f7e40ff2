"""Every sentence mbtune shows a person about a configuration and a recommendation.

Pure text: neither torch nor ray nor pandas. The search's stream (a trial line, the
recommendation line, the end-of-run summary), ``mbtune validate``'s split of your
configuration, ``mbtune space``'s micro-batches column, ``mbtune trial``'s result, the
exports' headers and ``mbtune analyze``'s recommendation all say it here, one way each.

    mbtune 19:41:11  trial   3  num_devices 2, batch_size 64, micro_batch_size 8, bf16:
    1,234.5 samples/s, MFU 41%  ok
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mbtune.lattice import as_flag

__all__ = [
    "step_suffix",
    "summary_lines",
    "trial_line",
]

Row = Mapping[str, Any]


def step_suffix(precision: str | None, activation_checkpointing: bool) -> str:
    """How a step computes, to follow a configuration's sizes: ', bf16, with activation
    checkpointing' (empty where neither is known or on)."""
    words = [precision] if precision else []
    if activation_checkpointing:
        words.append("with activation checkpointing")
    return "".join(f", {w}" for w in words)


def _known(value: Any) -> bool:
    """A figure trials.csv holds: a CSV cell that was not measured is empty."""
    return value not in (None, "")


def trial_line(row: Row) -> str:
    """The stream's line for one finished trial (a trials.csv row), stamped with the time."""
    speed, mfu = row.get("samples_per_s"), row.get("mfu")
    figure = f"{float(speed):,.1f} samples/s" if _known(speed) else "-"
    figure += f", MFU {float(mfu):.0%}" if _known(mfu) else ""
    status = row["status"] + (f" ({row['reason']})" if row.get("reason") else "")
    step = step_suffix(row.get("precision"), as_flag(row.get("activation_checkpointing", False)))
    return (
        f"mbtune {time.strftime('%H:%M:%S')}  trial {row['trial']:>3}  num_devices "
        f"{row['num_devices']}, batch_size {row['batch_size']}, micro_batch_size "
        f"{row['micro_batch_size']}{step}: {figure}  {status}"
    )


def summary_lines(rows: Sequence[Row], summary: Mapping[str, Any], run_path: Path) -> list[str]:
    """The end of a search for a person: how many trials, the recommendation with its
    speed-ups, the nearest valid batch size, compile break-even, and the top five
    (``summary``: the reporter's summary.json)."""
    failed = sum(r["status"] != "ok" for r in rows)
    lines = [f"mbtune: {len(rows)} trials finished ({failed} not ok); results in {run_path}"]
    best = summary["recommended"]
    if best is None:
        return [*lines, "mbtune: no configuration ran successfully"]
    user = (
        f", {summary['speedup_over_user']:.2f}x your configuration"
        if summary.get("speedup_over_user")
        else ""
    )
    step = step_suffix(best.get("precision"), best.get("activation_checkpointing", False))
    mfu = f" (MFU {best['mfu']:.0%})" if best.get("mfu") is not None else ""
    lines.append(
        f"recommended: micro_batch_size {best['micro_batch_size']}, num_devices "
        f"{best['num_devices']}, batch_size {best['batch_size']}{step} (grad_accum_steps "
        f"{best['grad_accum_steps']}): {best['samples_per_s']:,.1f} samples/s{mfu}, "
        f"{summary['speedup_over_base']:.2f}x base{user}, confidence score "
        f"{summary['confidence']} (out of 100)"
    )
    if summary["recommended_batch_size"] != best["batch_size"]:
        lines.append(
            f"  the valid batch_size nearest yours for this micro_batch_size and num_devices: "
            f"{summary['recommended_batch_size']}"
        )
    lines += map(_break_even_line, summary["compile_break_even"])
    lines.append("best configurations:")
    lines += _top_table(summary["top"])
    return lines


def _break_even_line(b: Mapping[str, Any]) -> str:
    other = b["against"]
    pays = (
        f"pays off after {b['break_even_steps']:,} training steps"
        if b["break_even_steps"]
        else "never pays off"
    )
    return (
        f"  it compiles {b['extra_compile_s']:.1f} s slower than micro_batch_size "
        f"{other['micro_batch_size']} on {other['num_devices']} device(s), and {pays}"
    )


def _top_table(top: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = [f"  {'rank':>4}  {'num_devices':>11}  {'batch_size':>10}  {'micro_batch_size':>16}  "
             f"{'grad_accum':>10}  {'samples/s':>10}  {'compile_s':>9}"]  # fmt: skip
    for i, r in enumerate(top, start=1):
        compile_s = f"{r['compile_s']:.1f}" if r["compile_s"] is not None else "-"
        lines.append(
            f"  {i:>4}  {r['num_devices']:>11}  {r['batch_size']:>10}  "
            f"{r['micro_batch_size']:>16}  {r['grad_accum_steps']:>10}  "
            f"{r['samples_per_s']:>10,.1f}  {compile_s:>9}"
        )
    return lines
