"""A trial's memory: its peak, the budget it must fit in, and out of memory as a result.

A configuration fits when its peak leaves ``trial.memory_headroom`` of the budget free
(``trial.device_memory``, else a CUDA card's memory). An out-of-memory error, wherever it
is raised (wrapped by a compile error too), makes a trial ``oom``, any other failure
``error``: :func:`verdict` is that rule, for a simulated trial, every ddp rank and replay
alike. torch is imported inside the functions that need it: this module is imported by the
driver too.
"""

from __future__ import annotations

import contextlib
import gc
import re
from pathlib import Path
from typing import Any

from mbtune.config.model_options import one_line
from mbtune.config.trial import TrialConfig

__all__ = [
    "Verdict",
    "alloc_retries",
    "fixed_mmap_threshold",
    "find_oom",
    "memory_budget",
    "over_budget",
    "peak_memory",
    "peak_reserved",
    "reason_line",
    "release",
    "reset_peak",
    "retry_note",
    "short_reason",
    "verdict",
]

Verdict = tuple[str, str]
"""(status, reason) of a trial that did not measure: ``oom`` or ``error``, and why."""

REASON_CHARS = 300
"""The longest reason a row of trials.csv keeps."""


def reason_line(exc: BaseException) -> str:
    """An exception in one line (model_options.one_line), cut for a row of trials.csv."""
    return short_reason(one_line(exc))


def short_reason(text: str) -> str:
    """``text`` in one line (whitespace folded), cut for a row of trials.csv."""
    text = " ".join(text.split())
    return text if len(text) <= REASON_CHARS else text[: REASON_CHARS - 3] + "..."


def find_oom(exc: BaseException) -> BaseException | None:
    """The out-of-memory error in ``exc``'s chain (e.g. wrapped by a compile error), if any."""
    import torch

    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.OutOfMemoryError | MemoryError) or re.search(
            r"CUDA out of memory|OutOfMemoryError", str(e)
        ):
            return e
        e = e.__cause__ or e.__context__
    return None


def verdict(failure: BaseException | None, over: str | None = None) -> Verdict | None:
    """What a failure (or a peak over the budget, see :func:`over_budget`) makes of a
    trial: ``oom`` with the out-of-memory error's line, else ``error``; None: neither."""
    if failure is not None:
        oom = find_oom(failure)
        return ("oom", reason_line(oom)) if oom is not None else ("error", reason_line(failure))
    return ("oom", over) if over else None


def over_budget(tr: TrialConfig, budget: int | None, peak: int | None) -> str | None:
    """Why the peak memory means out of memory, or None: a configuration fits when its peak
    leaves ``trial.memory_headroom`` of the budget free (``trial.device_memory``, else a
    CUDA card's memory)."""
    if budget is None or peak is None:
        return None
    headroom = tr.headroom(budget)
    usable = budget * (1 - headroom)
    if peak <= usable:
        return None
    source = "trial.device_memory" if tr.device_memory is not None else "the card's memory"
    if peak <= budget:
        return (
            f"peak memory {peak / 2**20:.0f} MiB fits in the budget {source} "
            f"{budget / 2**20:.0f} MiB but leaves less than trial.memory_headroom "
            f"{headroom:g} of it free (at most {usable / 2**20:.0f} MiB)"
        )
    return (
        f"peak memory {peak / 2**20:.0f} MiB is above the budget {source} {budget / 2**20:.0f} MiB"
    )


def memory_budget(torch: Any, device: Any, device_memory: int | None) -> int | None:
    """The memory a trial must fit in: ``trial.device_memory``, else on CUDA the card's
    memory, else None (no budget): a simulated trial and a ddp rank alike."""
    if device_memory is not None:
        return device_memory
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return None


def reset_peak(torch: Any, device: Any) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    with contextlib.suppress(OSError):  # Linux: "5" resets the peak resident set size
        Path("/proc/self/clear_refs").write_text("5")


def peak_memory(torch: Any, device: Any) -> int | None:
    """CUDA: the allocator's peak; CPU: this process's peak resident set size."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        status = Path("/proc/self/status").read_text()
        return int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) * 1024  # type: ignore[index]
    except (OSError, TypeError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


CPU_MMAP_THRESHOLD = 1 << 20
"""Bytes from which glibc gives a CPU allocation pages of its own (mmap), returned when freed."""


def fixed_mmap_threshold() -> None:
    """On the CPU, make the process's high-water mark the memory the trial held, not what
    glibc's heap kept: by default glibc raises its mmap threshold to every large block freed
    (up to 32 MiB), after which tensors of that size come from the heap and their freed
    memory stays resident. A ddp rank fixes it at 1 MiB (a sharded rank frees and gathers
    a block's parameters every pass: its peak doubled without). Nothing where there is no
    glibc."""
    import ctypes
    import ctypes.util

    with contextlib.suppress(OSError, AttributeError, TypeError):
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        libc.mallopt(-3, CPU_MMAP_THRESHOLD)  # M_MMAP_THRESHOLD


def peak_reserved(torch: Any, device: Any) -> int | None:
    """CUDA: the caching allocator's peak reservation."""
    return int(torch.cuda.max_memory_reserved(device)) if device.type == "cuda" else None


def alloc_retries(torch: Any, device: Any) -> int | None:
    """CUDA: how often the allocator has freed its cache to retry an allocation so far."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def retry_note(retries: int | None) -> str | None:
    if not retries:
        return None
    return (
        f"the CUDA allocator freed its cache and retried {retries} time(s) during the timed "
        "steps: this configuration is at the edge of memory and may slow down or fail later "
        "in training"
    )


def release(torch: Any, device: Any) -> None:
    """Give CUDA memory back after a trial (an OOM leaves tensors behind in frames).

    Not on the CPU: there the trial's process ends with the trial, and a full collection
    costs ~0.1 s, a fifth of a short eager trial (docs/benchmarks.md).
    """
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
