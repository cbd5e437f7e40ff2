"""What ``mbtune trial`` says of its result and ``mbtune validate`` of an experiment."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mbtune.report.words import devices_split, layout, per_device_split, plural, step_suffix

if TYPE_CHECKING:
    from mbtune.config.experiment import Experiment
    from mbtune.trial.trial import TrialResult

__all__ = ["experiment_lines", "result_lines"]


def result_lines(r: TrialResult, *, threads: int | None = None) -> list[str]:
    """A trial result, for a person; ``threads``: the CPU threads it computed with."""
    config = r.config
    cpu = f" ({plural(threads, 'CPU thread')})" if threads else ""
    lines = [
        # the order of the command's flags (--batch-size, --num-devices, --micro-batch-size)
        f"batch_size {r.batch_size}, num_devices {r.num_devices}, micro_batch_size "
        f"{r.micro_batch_size}{layout(config, ' ')}: {per_device_split(config)} "
        f"({plural(r.grad_accum_steps, 'micro-batch', 'es')}) on {r.device}{cpu}",
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
    split = r.tensor_parallel * r.pipeline_parallel > 1
    tokens = f", {r.tokens_per_s:,.0f} tokens/s" if r.tokens_per_s else ""
    lines = [
        f"  throughput   {r.samples_per_s:,.1f} samples/s "
        f"({r.samples_per_s_per_device:,.1f} per device){tokens}",
        f"  step time    {r.step_time_ms_median:.2f} ms median, IQR "
        f"{r.step_time_ms_iqr:.2f} ms over {len(r.step_times_ms)} timed steps"
        + (f" of {r.num_devices} workers (the slowest each step)" if ddp else ""),
    ]
    if ddp and split:  # the sends, receives and all-reduces are inside the step
        return lines
    if ddp:  # three measurements: they need not add up (DDP overlaps, and adds its own)
        compute = f"{r.compute_time_ms:.2f} ms" if r.compute_time_ms is not None else "-"
        lines.append(
            f"    apart      compute {compute} (the same steps without the all-reduce), "
            f"all-reduce {r.comm_time_ms:.2f} ms (of the gradient's bytes, alone)"
        )
    else:  # modelled: FSDP's all-gathers and reduce-scatters where sharded
        comm = "all-gather + reduce-scatter" if r.sharding == "fsdp" else "all-reduce"
        comm += " + tensor-parallel all-reduces + pipeline sends" * split
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
        f"parallel {tr.parallel}" + f", sharding {tr.sharding}" * (tr.sharding != "none")
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
            f"{plural(len(configs), 'configuration')} "
            f"({plural(distinct, 'distinct measurement')}) from '{s.space.source}'",
        ),
        *(("not searched", line) for line in exp.unused_values(configs)),
        (
            "search",
            f"sampler {s.sampler}, objective {s.objective}, {budget}, {stop}, seed {s.seed}",
        ),
        (
            "trial",
            f"{measure}; {tr.warmup_steps} warm-up + {tr.measure_steps} timed steps, "
            f"{plural(exp.cpu_threads, 'CPU thread')}, memory {memory}, timeout "
            f"{tr.timeout_s:g} s",
        ),
        ("ray", exp.ray.address or "embedded local Ray"),
        ("output_dir", str(exp.output_dir)),
    ]
