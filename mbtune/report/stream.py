"""What a search says as it goes and at its end: a trial's line, the recommendation
line (the Cerebras order: micro_batch_size first, then the rest in parentheses, which the
end-of-run summary follows), what base is, another look, a tie, the summary, an export's
header and ``mbtune analyze``'s recommendation."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mbtune.lattice import SETTINGS, BatchConfig
from mbtune.report.words import (
    layout,
    layout_cell,
    plural,
    shown_columns,
    sizes,
    step_suffix,
    value_text,
)

if TYPE_CHECKING:
    from mbtune.runs.record import TrialRecord

__all__ = [
    "another_look_line",
    "base_line",
    "export_header",
    "recommended_line",
    "stream_line",
    "summary_lines",
    "tie_line",
    "trial_line",
]


def trial_line(r: TrialRecord) -> str:
    """The stream's line for one finished trial, stamped with the time."""
    figure = f"{r.samples_per_s:,.1f} samples/s" if r.samples_per_s is not None else "-"
    figure += f", MFU {r.mfu:.0%}" if r.mfu is not None else ""
    status = f"{r.status}" + (f" ({r.reason})" if r.reason else "")
    step = step_suffix(r.precision, *r.config.settings, sharding=r.sharding)
    return (
        f"mbtune {time.strftime('%H:%M:%S')}  trial {r.trial:>3}  {sizes(r.config)}{step}: "
        f"{figure}  {status}"
    )


def summary_lines(
    records: Sequence[TrialRecord], summary: Mapping[str, Any], run_path: Path
) -> list[str]:
    """The end of a search for a person: how many trials (and how many configurations were
    predicted out of memory and skipped), the recommendation with its speed-ups, the
    nearest valid batch size, compile break-even, and the top five (``summary``: the
    reporter's summary.json)."""
    predicted = sum(r.predicted for r in records)
    failed = sum(r.status != "ok" and not r.predicted for r in records)
    skipped = (
        f"; {plural(predicted, 'configuration')} predicted out of memory, skipped without "
        "a trial (search.predict_memory)"
        if predicted
        else ""
    )
    lines = [
        f"mbtune: {len(records) - predicted} trials finished ({failed} not ok){skipped}; "
        f"results in {run_path}"
    ]
    best = summary["recommended"]
    if best is None:
        return [*lines, "mbtune: no configuration ran successfully"]
    user = (
        f", {summary['speedup_over_user']:.2f}x your configuration"
        if summary.get("speedup_over_user")
        else ""
    )
    sharding = "fsdp" if any(r.sharding == "fsdp" for r in records) else None
    step = step_suffix(
        best.get("precision"), *BatchConfig.from_mapping(best).settings, sharding=sharding
    )
    mfu = f" (MFU {best['mfu']:.0%})" if best.get("mfu") is not None else ""
    split = layout(BatchConfig.from_mapping(best), " ")
    lines.append(
        f"recommended: micro_batch_size {best['micro_batch_size']}, num_devices "
        f"{best['num_devices']}{split}, batch_size {best['batch_size']}{step} (grad_accum_steps "
        f"{best['grad_accum_steps']}): {best['samples_per_s']:,.1f} samples/s{mfu}, "
        f"{summary['speedup_over_base']:.2f}x base{user}, confidence score "
        f"{summary['confidence']} (out of 100)"
    )
    lines.append(_measurements_line(summary))
    if summary.get("tie"):
        lines.append("  " + tie_line(summary["tie"], (summary.get("drift") or {}).get("relative")))
    if summary["recommended_batch_size"] != best["batch_size"]:
        lines.append(
            f"  the valid batch_size nearest yours for this micro_batch_size and num_devices: "
            f"{summary['recommended_batch_size']}"
        )
    # printed in tenths of a second: a difference that rounds to 0.0 s is none to weigh
    lines += [_break_even_line(b) for b in summary["compile_break_even"]
              if b["extra_compile_s"] >= 0.05]  # fmt: skip
    lines.append("best configurations:")
    lines += _top_table(summary["top"])
    if any(r.get("compile_from_cache") for r in summary["top"]):
        lines.append(f"  {CACHED_MARK} its graphs came from torch's compile cache (compiled by an "
                     "earlier trial or run): less than a cold compile")  # fmt: skip
    return lines


def _measurements_line(summary: Mapping[str, Any]) -> str:
    """How often the recommendation was measured, and the drift between trials the score
    allowed for: estimated from the run's repeats, or its prior."""
    looks = summary["recommended"].get("measurements") or 1
    times = "once" if looks == 1 else "twice" if looks == 2 else f"{looks} times"
    why = f" ({summary['measured_once_because']})" if summary.get("measured_once_because") else ""
    drift = summary.get("drift")
    if not drift:
        return f"  measured {times}{why}"
    if drift["repeats"]:  # the spread of repeats beyond their steps' own (docs/confidence.md)
        learnt = (
            f"{drift['relative']:.1%} beyond the steps' own noise, estimated from "
            f"{plural(drift['repeats'], 'repeat')} (prior {drift['prior']:.1%})"
        )
    else:
        learnt = f"{drift['prior']:.1%} assumed (search.noise_floor): nothing was measured twice"
    return f"  measured {times}{why}; drift between trials {learnt}"


def _break_even_line(b: Mapping[str, Any]) -> str:
    other = b["against"]
    steps = b["break_even_steps"]
    pays = (
        f"pays off after {steps:,} training step{'' if steps == 1 else 's'}"
        if steps
        else "never pays off"
    )
    return (
        f"  it compiles {b['extra_compile_s']:.1f} s slower than micro_batch_size "
        f"{other['micro_batch_size']} on {other['num_devices']} device(s), and {pays}"
    )


CACHED_MARK = "*"
"""Beside a compile time whose graphs came from torch's compile cache."""


def _top_table(top: Sequence[Mapping[str, Any]]) -> list[str]:
    """The best configurations, ranked as the recommendation ranks them: by the search
    model's estimate (``estimated``), which pools every look and what the neighbours say,
    beside the measured samples/s (every look's geometric mean)."""
    configs = [BatchConfig.from_mapping(r) for r in top]
    split = any(c.layout[:2] != (1, 1) for c in configs)  # then a column: t x p (schedule)
    layouts = [layout_cell(*c.layout) for c in configs]
    wide = max([len("t x p"), *map(len, layouts)])
    shown = shown_columns(configs, SETTINGS)  # and the settings of a step off their default
    lines = [
        f"  {'rank':>4}  {'num_devices':>11}  " + f"{'t x p':>{wide}}  " * split
        + f"{'batch_size':>10}  {'micro_batch_size':>16}  "
        + "".join(f"{label}  " for label, _ in shown)
        + f"{'grad_accum':>10}  {'samples/s':>10}  {'estimated':>10}  {'compile_s':>9}"
    ]  # fmt: skip
    for i, (r, tp) in enumerate(zip(top, layouts, strict=True), start=1):
        compile_s = f"{r['compile_s']:.1f}" if r["compile_s"] is not None else "-"
        compile_s += CACHED_MARK if r.get("compile_from_cache") else ""
        estimate = r.get("estimated_samples_per_s")
        estimated = f"{estimate:,.1f}" if estimate is not None else "-"
        lines.append(
            f"  {i:>4}  {r['num_devices']:>11}  "
            + f"{tp:>{wide}}  " * split
            + f"{r['batch_size']:>10}  "
            f"{r['micro_batch_size']:>16}  "
            + "".join(f"{words[i - 1]}  " for _, words in shown)
            + f"{r['grad_accum_steps']:>10}  "
            f"{r['samples_per_s']:>10,.1f}  {estimated:>10}  {compile_s:>9}"
        )
    return lines


# ---------------------------------------------------------------------------
# a recommendation: the stream's after each trial (mbtune.recommend.reporter's
# StreamRecommendation), a finished run's read back (mbtune.analysis.frames' RunRecommendation)


def stream_line(
    *,
    made_at: str,
    config: BatchConfig,
    estimated_performance: float,
    confidence: int,
    precision: str | None,
    mfu: float | None,
    sharding: str | None = None,
) -> str:
    """The stream's recommendation after a trial; ``made_at``: when, ISO (its clock is
    shown); ``sharding``: ``fsdp`` where the trials shard, whose settings are then named."""
    c = config
    step = step_suffix(precision, *c.settings, sharding=sharding)
    shown_mfu = f", MFU {mfu:.0%}" if mfu is not None else ""
    return (
        f"mbtune {made_at[-8:]}  recommended micro_batch_size: {c.micro_batch_size} "
        f"(num_devices: {c.num_devices}{layout(c, ': ')}, batch_size: {c.batch_size}{step}), "
        "estimated "
        f"performance: {estimated_performance:.2f}x base{shown_mfu}, confidence score: "
        f"{confidence} (out of 100)"
    )


def base_line(yours: bool | None) -> str:
    """The stream's line under a run's first recommendation: base is its throughput.
    ``yours``: whether it is the user's own configuration (None: the experiment fixes none)."""
    own = ", your own configuration's" if yours else ""
    theirs = ", not to your configuration (the summary compares with yours where measured)"
    return (
        f"mbtune: base is this first recommendation's throughput{own}: each estimated "
        f"performance that follows is relative to it{theirs * (yours is False)}"
    )


def recommended_line(
    config: BatchConfig,
    *,
    source: str,
    samples_per_s: float | None,
    confidence: int | None,
    recommended_batch_size: int | None,
    precision: str | None,
) -> str:
    """``mbtune analyze``'s recommendation of a run; ``source``: where it came from
    (summary.json, or the best ok trial)."""
    c, g = config, config.grad_accum_steps
    speed = f": {samples_per_s:,.1f} samples/s" if samples_per_s is not None else ""
    origin = source + (f", confidence {confidence}" if confidence is not None else "")
    batch = f"; recommended global batch {recommended_batch_size}" if recommended_batch_size else ""
    step = step_suffix(precision, *c.settings)
    return (
        f"recommended ({origin}): {sizes(c)} ({plural(g, 'micro-batch', 'es')} per "
        f"device{step}){speed}{batch}"
    )


def export_header(
    config: BatchConfig, *, samples_per_s: float | None, run_path: Path, source: str
) -> str:
    """The first comment of an exported snippet: what was measured, where."""
    speed = f"{samples_per_s:,.1f} samples/s " if samples_per_s is not None else ""
    return f"mbtune: {sizes(config)}: {speed}in {run_path} ({source})"


# ---------------------------------------------------------------------------
# mbtune trial and mbtune validate


def another_look_line(why: str, config: BatchConfig, look: int) -> str:
    """The stream's line when the search measures a configuration again."""
    step = step_suffix(None, *config.settings)
    return f"mbtune: {why}: {sizes(config)}{step} (measurement {look})"


def tie_line(tie: Mapping[str, Any], drift: float | None = None) -> str:
    """A tie (``tie``: its record, mbtune.recommend.tie.Tie) as the stream and the
    summary say it: what the search cannot tell apart at this machine's spread, which of
    them it recommends and by what rule, and what it was sure of."""
    members = [BatchConfig.from_mapping(m) for m in tie["members"]]
    first = members[0]
    spread = f" (repeats differ by {drift:.1%})" if drift else ""
    sure = "; ".join(
        f"{s['dimension']} {value_text(s['value'])} over {value_text(s['over'])} "
        f"({s['speedup']:.2f}x)"
        for s in tie.get("sure", ())
    )
    return (
        f"a tie within {tie['width']:.1%} on this machine{spread}: {_members(members)}; "
        f"recommended: micro_batch_size {first.micro_batch_size}"
        f"{step_suffix(None, *first.settings)} ({tie['rule']})"
        + (f"; sure of: {sure}" if sure else "")
    )


def _members(members: Sequence[BatchConfig]) -> str:
    """'micro_batch_size 1, 2, 8, 16 at 2 devices (batch_size 32)' where only the
    micro-batch differs, else each one's sizes."""
    rest = {(c.num_devices, c.batch_size, *c.variant) for c in members}
    if len(rest) == 1:
        c = members[0]
        ms = ", ".join(str(m.micro_batch_size) for m in members)
        step = step_suffix(None, *c.settings)
        devices = plural(c.num_devices, "device")
        return (f"micro_batch_size {ms} at {devices}{layout(c, ' ')} (batch_size "
                f"{c.batch_size}{step})")  # fmt: skip
    return "; ".join(sizes(c) + step_suffix(None, *c.settings) for c in members)
