"""The search's boundary of what fits: the configurations of a search predicted over its
memory budget before the first trial (:func:`screen`, run in a Ray task: mbtune.search), so
that they are recorded as ``oom`` without being measured; and one configuration's verdict
(:func:`predicted_oom`). Read from mbtune.trial.predict's prediction, judged by
mbtune.trial.memory's rule for a measured peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mbtune.config.experiment import Experiment
from mbtune.config.model_options import one_line
from mbtune.lattice import BatchConfig
from mbtune.trial.memory import Verdict, memory_budget, over_budget, short_reason
from mbtune.trial.predict import has_cuda, predict_memory

__all__ = ["Screening", "predicted_oom", "screen"]


def predicted_oom(exp: Experiment, config: BatchConfig) -> Verdict | None:
    """``("oom", "predicted: ...")`` where ``config``'s predicted peak leaves less than
    ``trial.memory_headroom`` of ``trial.device_memory`` free (mbtune.trial.memory's rule
    for a measured peak), so that a search can record it without measuring; None where it
    fits, or where no budget is given (a card's memory is known only on the card)."""
    budget = exp.trial.device_memory
    if budget is None:
        return None
    over = over_budget(exp.trial, budget, predict_memory(exp, config).peak_memory_bytes)
    return None if over is None else ("oom", f"predicted: {over}")


@dataclass(frozen=True)
class Screening:
    """What predicting a search's configurations found, before its first trial
    (:func:`screen`): the configurations predicted over the budget, each with its reason."""

    budget: int | None
    """The memory budget of one device, in bytes (``trial.device_memory``, else a CUDA
    card's); None: none is known, and nothing was predicted."""
    over: tuple[tuple[BatchConfig, str], ...] = ()
    """(configuration, reason) of each one predicted over the budget, less the headroom;
    the reason starts with ``predicted:`` (mbtune.runs.record.PREDICTED)."""
    predictions: int = 0
    """Configurations whose memory was predicted (the others followed from them)."""
    seconds: float = 0.0
    failed: str | None = None
    """Why nothing could be predicted (one line), where the prediction failed."""


def screen(exp: Experiment, configs: list[BatchConfig]) -> Screening:
    """Predict which of ``configs`` (a search's points) cannot fit the memory budget, as a
    trial would judge its measured peak (mbtune.trial.memory.over_budget), without
    predicting each: memory grows with the micro-batch a device runs, and with the batch
    at the same micro-batch, so for each (n, layout, settings of a step: BatchConfig.
    memory_variant; each layout holds its own share of the model), from the smallest batch
    up, a search over m from the largest down finds the smallest m predicted over the
    budget: it and every larger m are over, as is every m at least as large at a larger
    batch. Runs
    where torch may be imported (a search's Ray task); never raises for a model that
    cannot be predicted: ``failed`` says why."""
    import time

    import torch

    started = time.perf_counter()
    torch.set_num_threads(exp.cpu_threads)
    budget = _known_budget(exp)
    if budget is None:
        return Screening(None)
    usable = budget * (1 - exp.trial.headroom(budget))
    peaks: dict[BatchConfig, int] = {}

    def over(c: BatchConfig) -> bool:
        if c not in peaks:
            peaks[c] = predict_memory(exp, c).peak_memory_bytes
        return peaks[c] > usable

    groups: dict[tuple[Any, ...], dict[int, list[BatchConfig]]] = {}
    sharded = exp.trial.sharding == "fsdp"
    for c in sorted({c.canonical() for c in configs}):
        variant = c.memory_variant(sharded)
        groups.setdefault((c.num_devices, *variant), {}).setdefault(c.batch_size, []).append(c)
    found: list[tuple[BatchConfig, str]] = []
    try:
        for by_batch in groups.values():
            bound: BatchConfig | None = None  # the smallest m over, at a smaller batch
            for batch in sorted(by_batch):
                ms = sorted(by_batch[batch], key=lambda c: c.micro_batch_size)
                top = len(ms)
                if bound is not None:  # at least as large an m as one over: over too
                    top = next((i for i, c in enumerate(ms)
                                if c.micro_batch_size >= bound.micro_batch_size), top)  # fmt: skip
                # from the largest m down, in growing steps (a large m has few micro-batches
                # to simulate), to one that fits; then halving: ms[:lo] fit, ms[hi:top] over
                lo, hi, step = 0, top, 1
                while lo < hi:
                    i = max(lo, hi - step)
                    if not over(ms[i]):
                        lo = i + 1
                        break
                    hi, step = i, step * 2
                while lo < hi:
                    mid = (lo + hi) // 2
                    if over(ms[mid]):
                        hi = mid
                    else:
                        lo = mid + 1
                for first, over_ms in ((ms[lo] if lo < top else None, ms[lo:top]),
                                       (bound, ms[top:])):  # fmt: skip
                    found += [(c, _reason(exp.trial, budget, first, peaks.get(first), c))
                              for c in over_ms if first is not None]  # fmt: skip
                bound = ms[lo] if lo < top else bound
    except Exception as e:  # noqa: BLE001 - a model mbtune cannot predict is measured instead
        return Screening(budget, failed=short_reason(one_line(e)), predictions=len(peaks),
                         seconds=time.perf_counter() - started)  # fmt: skip
    return Screening(budget, tuple(found), len(peaks), time.perf_counter() - started)


def _reason(tr: Any, budget: int, first: BatchConfig, peak: int | None, config: BatchConfig) -> str:
    """``predicted: ...``: the rule a measured peak would break (over_budget's words), for
    the configuration predicted, or for a larger one, named by the one it follows from."""
    if config == first and peak is not None:
        return f"predicted: {over_budget(tr, budget, peak)}"
    shown = f" ({peak / 2**20:.0f} MiB)" if peak is not None else ""
    return (
        f"predicted: more memory than micro_batch_size {first.micro_batch_size} at "
        f"batch_size {first.batch_size}{shown}, which leaves less than "
        f"trial.memory_headroom {tr.headroom(budget):g} of the budget "
        f"{budget / 2**20:.0f} MiB free"
    )


def _known_budget(exp: Experiment) -> int | None:
    """The budget a trial of ``exp`` must fit in, where it is known here: trial.device_memory,
    else the memory of the CUDA card this process sees (a CUDA trial's own budget); None
    on a CPU without trial.device_memory (nothing there says oom but the kernel)."""
    tr = exp.trial
    if tr.device_memory is not None:
        return tr.device_memory
    if tr.device in ("cuda", "auto") and has_cuda():
        import torch

        return memory_budget(torch, torch.device("cuda"), None)
    return None
