"""One writer per run directory: an OS file lock that the kernel releases when the
process dies, however it dies.

A search (``mbtune run``, ``mbtune run --resume``) holds ``RUN_DIR/.lock`` with ``flock``
for as long as it runs; a second process that wants to write the same directory is
refused with one line naming the holder (its process, host and start time, which the
holder writes into the file). Nothing is ever left to clean up: a run killed with
SIGKILL holds no lock, so its resume is never refused. Readers (``mbtune analyze``, the
pandas API) take no lock and read while a run writes.

The file descriptor is not inherited by the processes a run starts (Python opens files
non-inheritable), so a Ray worker that outlives a killed driver does not keep its lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO

from mbtune.errors import MbtuneError

__all__ = ["LOCK_FILE", "RunLock"]

LOCK_FILE = ".lock"
"""The lock's file inside the run directory; it stays after the run (it holds no lock)."""


class RunLock:
    """The exclusive lock of one run directory, held until :meth:`release` or the
    process's end."""

    def __init__(self, path: Path, handle: IO[str]) -> None:
        self.path = path
        self._handle = handle

    @classmethod
    def take(cls, run_dir: str | Path, *, command: str) -> RunLock:
        """Lock ``run_dir`` for this process, or raise a one-line MbtuneError that names
        who holds it. ``command``: what this process is (said to a second opener)."""
        path = Path(run_dir) / LOCK_FILE
        handle = path.open("a+", encoding="utf-8")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = _holder(handle.read())
            handle.close()
            raise MbtuneError(
                f"{run_dir} is in use by {holder}; one process writes a run directory at a "
                "time: wait for it to end, or stop it and resume with mbtune run --resume"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({
            "pid": os.getpid(), "host": socket.gethostname(), "command": command,
            "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        }) + "\n")  # fmt: skip
        handle.flush()
        return cls(path, handle)

    def release(self) -> None:
        if not self._handle.closed:
            fcntl.flock(self._handle.fileno(), fcntl.LOCK_UN)
            self._handle.close()


def _holder(text: str) -> str:
    """Who holds the lock, from what it wrote: 'mbtune run (process 123 on host, since
    ...)'; the holder may not have written yet."""
    try:
        h = json.loads(text)
        return f"{h['command']} (process {h['pid']} on {h['host']}, since {h['since']})"
    except (ValueError, KeyError, TypeError):
        return "another mbtune process (it is starting)"
