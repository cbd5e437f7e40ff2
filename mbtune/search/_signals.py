"""SIGINT and SIGTERM end a search the way Tune's own Ctrl-C does."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["STOPPING", "graceful_stop"]

STOPPING = (
    "mbtune: stopping: the trials in flight end first (Ray Tune gives each 10 s); "
    "a second Ctrl-C stops at once\n"
)
"""What the first SIGINT or SIGTERM is answered with, at once."""


@contextlib.contextmanager
def graceful_stop() -> Iterator[list[int]]:
    """SIGINT or SIGTERM stop the search as Tune's own Ctrl-C does: running trials end,
    Ray's state is saved for --resume, and fit() returns. A second signal stops at once.
    Yields a list that holds the signal once one came."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received  # signals reach only the main thread: nothing to catch here
        return

    def stop(signum: int, frame: Any) -> None:
        if received:
            raise KeyboardInterrupt
        received.append(signum)
        os.kill(os.getpid(), signal.SIGUSR1)  # Tune's graceful stop, as for its Ctrl-C
        # said at once (the summary comes once the trials in flight have ended), past
        # sys.stdout's buffer: a print here could re-enter one the main thread was in
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.write(sys.stdout.fileno(), STOPPING.encode())

    # a signal the process was started ignoring (a background job's SIGINT) stays ignored
    old = {
        s: signal.signal(s, stop)
        for s in (signal.SIGINT, signal.SIGTERM)
        if signal.getsignal(s) is not signal.SIG_IGN
    }
    was = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # SIGINT is ours; SIGUSR1 stays Tune's
    try:
        yield received
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if was is None:
            os.environ.pop("TUNE_DISABLE_SIGINT_HANDLER", None)
        else:
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = was
