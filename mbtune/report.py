"""Every sentence mbtune shows a person about a configuration and a recommendation.

Pure text: neither torch nor ray nor pandas. The search's stream (a trial line, the
recommendation line, the end-of-run summary), ``mbtune validate``'s summary,
``mbtune space``'s micro-batches column, ``mbtune trial``'s result, the export's header
and ``mbtune analyze``'s recommendation are all said here, each piece one way:

- a configuration's sizes: :func:`sizes` ('num_devices 2, batch_size 64, micro_batch_size 8');
- how it computes: :func:`step_suffix` (', bf16, with activation checkpointing');
- how it splits into micro-batches: :func:`micro_batches` ('4x8', '3+2+2') and the
  sentences built on it, :func:`devices_split` and :func:`per_device_split`.

The stream's recommendation line keeps the Cerebras order (micro_batch_size first, then
the rest in parentheses), which the end-of-run summary follows.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mbtune.lattice import BatchConfig

if TYPE_CHECKING:
    from mbtune.config.experiment import Experiment
    from mbtune.runs.record import TrialRecord
    from mbtune.trial.trial import TrialResult

__all__ = [
    "base_line",
    "devices_split",
    "experiment_lines",
    "export_header",
    "micro_batches",
    "per_device_split",
    "recommended_line",
    "result_lines",
    "sizes",
    "step_suffix",
    "stream_line",
    "summary_lines",
    "tie_line",
    "trial_line",
]


def sizes(config: BatchConfig) -> str:
    """The three sizes that name a configuration, in the order of trials.csv's columns."""
    return (
        f"num_devices {config.num_devices}, batch_size {config.batch_size}, micro_batch_size "
        f"{config.micro_batch_size}"
    )


def _plural(count: int, word: str, suffix: str = "s") -> str:
    return f"{count} {word}{suffix if count != 1 else ''}"


def micro_batches(config: BatchConfig) -> str:
    """The micro-batches one device runs: '4x8', '3+2+2', or '1000x3+24x2' for many.

    Computed from (P, g) rather than from the list of sizes, which a configuration such as
    batch_size 2**31 at micro_batch_size 1 would make billions of items long.
    """
    g = config.grad_accum_steps
    q, r = divmod(config.per_device_batch, g)
    if r == 0:
        return f"{g}x{q}"
    if g <= 8:
        return "+".join(map(str, [q + 1] * r + [q] * (g - r)))
    return f"{r}x{q + 1}+{g - r}x{q}"


def _even_or_listed(config: BatchConfig, even: str) -> str:
    """``even`` (a phrase of g and the size q) where the micro-batches are all one size,
    else :func:`micro_batches`."""
    g = config.grad_accum_steps
    q, r = divmod(config.per_device_batch, g)
    return even.format(g=g, q=q) if r == 0 else micro_batches(config)


def devices_split(config: BatchConfig) -> str:
    """How one configuration runs, e.g. '2 devices x 4 micro-batches of 8'."""
    g = config.grad_accum_steps
    return (
        f"{_plural(config.num_devices, 'device')} x {_plural(g, 'micro-batch', 'es')} of "
        + _even_or_listed(config, "{q}")
    )


def per_device_split(config: BatchConfig) -> str:
    """What one device computes, e.g. 'per device 16 samples as 2 x 8', or where the
    devices differ by a sample, 'per device 17 or 16 samples, the busiest as 5+4+4+4'."""
    runs = _even_or_listed(config, "{g} x {q}")
    b, n = config.batch_size, config.num_devices
    if b % n:
        return f"per device {b // n + 1} or {b // n} samples, the busiest as {runs}"
    return f"per device {b // n} samples as {runs}"


def step_suffix(
    precision: str | None,
    activation_checkpointing: bool,
    reshard_after_forward: bool = True,
    grad_sync: str = "last",
    *,
    sharding: str | None = None,
) -> str:
    """How a step computes, to follow a configuration's sizes (its settings, in the order
    of ``BatchConfig.settings``): ', bf16, with activation checkpointing', and, sharded,
    ', reshard_after_forward false, grad_sync every'. A setting at its default is not named
    (so that a configuration without them reads as it always has), unless ``sharding`` is
    ``fsdp``: then both of FSDP's are, ', fsdp, reshard_after_forward true, grad_sync last'."""
    words = [precision] if precision else []
    if activation_checkpointing:
        words.append("with activation checkpointing")
    fsdp = sharding == "fsdp"
    words += ["fsdp"] * fsdp
    if fsdp or not reshard_after_forward:
        words.append(f"reshard_after_forward {str(reshard_after_forward).lower()}")
    if fsdp or grad_sync != "last":
        words.append(f"grad_sync {grad_sync}")
    return "".join(f", {w}" for w in words)


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
        f"; {_plural(predicted, 'configuration')} predicted out of memory, skipped without "
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
    lines.append(
        f"recommended: micro_batch_size {best['micro_batch_size']}, num_devices "
        f"{best['num_devices']}, batch_size {best['batch_size']}{step} (grad_accum_steps "
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
    if drift["repeats"]:
        learnt = (
            f"{drift['relative']:.1%}, estimated from {_plural(drift['repeats'], 'repeat')} "
            f"(prior {drift['prior']:.1%})"
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


def _top_table(top: Sequence[Mapping[str, Any]]) -> list[str]:
    """The best configurations, ranked as the recommendation ranks them: by the search
    model's estimate (``estimated``), which pools every look and what the neighbours say,
    beside the measured samples/s (every look's geometric mean)."""
    lines = [f"  {'rank':>4}  {'num_devices':>11}  {'batch_size':>10}  "
             f"{'micro_batch_size':>16}  {'grad_accum':>10}  {'samples/s':>10}  "
             f"{'estimated':>10}  {'compile_s':>9}"]  # fmt: skip
    for i, r in enumerate(top, start=1):
        compile_s = f"{r['compile_s']:.1f}" if r["compile_s"] is not None else "-"
        estimate = r.get("estimated_samples_per_s")
        estimated = f"{estimate:,.1f}" if estimate is not None else "-"
        lines.append(
            f"  {i:>4}  {r['num_devices']:>11}  {r['batch_size']:>10}  "
            f"{r['micro_batch_size']:>16}  {r['grad_accum_steps']:>10}  "
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
) -> str:
    """The stream's recommendation after a trial; ``made_at``: when, ISO (its clock is
    shown)."""
    c = config
    step = step_suffix(precision, *c.settings)
    shown_mfu = f", MFU {mfu:.0%}" if mfu is not None else ""
    return (
        f"mbtune {made_at[-8:]}  recommended micro_batch_size: {c.micro_batch_size} "
        f"(num_devices: {c.num_devices}, batch_size: {c.batch_size}{step}), estimated "
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
        f"recommended ({origin}): {sizes(c)} ({_plural(g, 'micro-batch', 'es')} per "
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


def result_lines(r: TrialResult, *, threads: int | None = None) -> list[str]:
    """A trial result, for a person; ``threads``: the CPU threads it computed with."""
    config = BatchConfig(r.batch_size, r.num_devices, r.micro_batch_size)
    cpu = f" ({_plural(threads, 'CPU thread')})" if threads else ""
    lines = [
        # the order of the command's flags (--batch-size, --num-devices, --micro-batch-size)
        f"batch_size {r.batch_size}, num_devices {r.num_devices}, micro_batch_size "
        f"{r.micro_batch_size}: {per_device_split(config)} "
        f"({_plural(r.grad_accum_steps, 'micro-batch', 'es')}) on {r.device}{cpu}",
        f"  status       {r.status}" + (f" ({r.reason})" if r.reason else ""),
    ]
    step = [r.precision] if r.precision else []
    if r.activation_checkpointing:
        step.append("activation checkpointing")
    if r.sharding == "fsdp" or r.config.settings[1:] != (True, "last"):
        step.append(step_suffix(None, False, *r.config.settings[1:], sharding=r.sharding)[2:])
    if step:
        lines.append(f"  step         {', '.join(step)}")
    if r.note:
        lines.append(f"  note         {r.note}")
    if len(r.micro_batch_sizes_tried) > 1:
        tried = ", ".join(map(str, r.micro_batch_sizes_tried))
        lines.append(f"  tried        micro_batch_size {tried} (halved on out of memory)")
    if r.samples_per_s is not None:
        lines += _speed_lines(r)
    if r.tflops_per_s is not None:
        mfu = f", MFU {r.mfu:.1%}" if r.mfu is not None else ", MFU unknown (no peak known)"
        lines.append(
            f"  flops        {r.flops_per_sample / 1e9:,.3g} GFLOP per sample, "
            f"{r.tflops_per_s:,.3g} TFLOP/s per device{mfu}"
        )
    if r.eval_samples_per_s is not None:
        lines.append(f"  eval         {r.eval_samples_per_s:,.1f} samples/s forward-only")
    if r.compile_s is not None:
        lines.append(f"  compile      {r.compile_s:.1f} s (not counted in throughput)")
    if r.compile_fallback:
        lines.append(f"  warning      {r.compile_fallback}")
    if r.peak_memory_bytes is not None:
        reserved = (
            f" ({r.peak_reserved_bytes / 2**20:,.0f} MiB reserved)"
            if r.peak_reserved_bytes is not None
            else ""
        )
        lines.append(f"  peak memory  {r.peak_memory_bytes / 2**20:,.0f} MiB{reserved}")
    if r.loss is not None:
        lines.append(f"  loss         {r.loss:.5g} (the last timed step's mean)")
    lines.append(f"  wall time    {r.wall_s:.1f} s")
    return lines


def _speed_lines(r: TrialResult) -> list[str]:
    """Throughput and the step time, and what the step time is made of."""
    ddp = r.parallel == "ddp"
    tokens = f", {r.tokens_per_s:,.0f} tokens/s" if r.tokens_per_s else ""
    lines = [
        f"  throughput   {r.samples_per_s:,.1f} samples/s "
        f"({r.samples_per_s_per_device:,.1f} per device){tokens}",
        f"  step time    {r.step_time_ms_median:.2f} ms median, IQR "
        f"{r.step_time_ms_iqr:.2f} ms over {len(r.step_times_ms)} timed steps"
        + (f" of {r.num_devices} DDP workers (the slowest each step)" if ddp else ""),
    ]
    if ddp:  # three measurements: they need not add up (DDP overlaps, and adds its own)
        compute = f"{r.compute_time_ms:.2f} ms" if r.compute_time_ms is not None else "-"
        lines.append(
            f"    apart      compute {compute} (the same steps without the all-reduce), "
            f"all-reduce {r.comm_time_ms:.2f} ms (of the gradient's bytes, alone)"
        )
    else:  # modelled: FSDP's all-gathers and reduce-scatters where sharded
        comm = "all-gather + reduce-scatter" if r.sharding == "fsdp" else "all-reduce"
        lines.append(
            f"    of which   compute {r.compute_time_ms:.2f} ms, {comm} "
            f"{r.comm_time_ms:.2f} ms, pipeline bubble {r.bubble_time_ms:.2f} ms"
        )
    return lines


_MODES = {
    "none": "micro_batch_size none (no accumulation: m = per-device batch)",
    "auto": "micro_batch_size auto (the fastest divisor of the per-device batch that fits)",
    "explore": "micro_batch_size explore (every size in the space, divisible or not)",
}


def experiment_lines(exp: Experiment) -> list[tuple[str, str]]:
    """What an experiment will do, in a few labelled lines (``mbtune validate``)."""
    t, s, tr = exp.train_input, exp.search, exp.trial
    configs = exp.configs()
    distinct = len({c.canonical() for c in configs})
    options = ", ".join(f"{k}={v}" for k, v in exp.model.options.items())
    mode = _MODES.get(t.mode, f"micro_batch_size {t.micro_batch_size} (explicit)")
    user = exp.user_config
    yours = (
        f"; yours runs {devices_split(user)}" if user is not None and user in set(configs) else ""
    )
    memory = f"{tr.device_memory / 2**30:.2f} GiB" if tr.device_memory else "no budget"
    measure = (
        f"replay of {tr.table}" + (f" with {tr.noise:.0%} noise" if tr.noise else "")
        if tr.backend == "replay"
        else f"torch on {tr.device}, compile {'on' if tr.compile else 'off'}, "
        f"parallel {tr.parallel}"
    )
    budget = f"up to {s.num_samples} trials" + (
        f" or {s.time_budget_s:g} s" if s.time_budget_s else ""
    )
    stop = (
        f"stop at confidence {s.confidence_target}"
        if s.confidence_target < 100  # the score is 0..99: 100 is never reached
        else "never stops on confidence (runs to num_samples or the time budget)"
    )
    return [
        ("name", exp.name),
        ("model", exp.model.name + (f" ({options})" if options else "")),
        (
            "train_input",
            f"batch_size {t.batch_size}, num_devices {t.num_devices}"
            + (f", tensor_parallel {t.tensor_parallel}" if t.tensor_parallel > 1 else "")
            + (f", pipeline_parallel {t.pipeline_parallel}" if t.pipeline_parallel > 1 else "")
            + (", allow_uneven" if t.allow_uneven else ""),
        ),
        ("mode", mode + yours),
        (
            "space",
            f"{len(configs)} configurations ({distinct} distinct measurements) from "
            f"'{s.space.source}'",
        ),
        *(("not searched", line) for line in exp.unused_values(configs)),
        (
            "search",
            f"sampler {s.sampler}, objective {s.objective}, {budget}, {stop}, seed {s.seed}",
        ),
        (
            "trial",
            f"{measure}; {tr.warmup_steps} warm-up + {tr.measure_steps} timed steps, "
            f"{_plural(exp.cpu_threads, 'CPU thread')}, memory {memory}, timeout "
            f"{tr.timeout_s:g} s",
        ),
        ("ray", exp.ray.address or "embedded local Ray"),
        ("output_dir", str(exp.output_dir)),
    ]


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
        f"{s['dimension']} {_value(s['value'])} over {_value(s['over'])} ({s['speedup']:.2f}x)"
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
    rest = {(c.num_devices, c.batch_size, *c.settings) for c in members}
    if len(rest) == 1:
        c = members[0]
        ms = ", ".join(str(m.micro_batch_size) for m in members)
        step = step_suffix(None, *c.settings)
        devices = _plural(c.num_devices, "device")
        return f"micro_batch_size {ms} at {devices} (batch_size {c.batch_size}{step})"
    return "; ".join(sizes(c) + step_suffix(None, *c.settings) for c in members)


def _value(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)
