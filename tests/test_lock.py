"""One writer per run directory (mbtune.runs.lock): a second writer is refused with one
line naming the holder; a holder that died, however, holds nothing."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading

import pytest

from mbtune.errors import MbtuneError
from mbtune.runs.lock import LOCK_FILE, RunLock

HOLD = """
import sys, time
from mbtune.runs.lock import RunLock
lock = RunLock.take(sys.argv[1], command="mbtune run --resume")  # held while referenced
print("held", flush=True)
time.sleep(120)
"""


def holder(run_dir) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_is_refused_with_the_holder_named(tmp_path):
    proc = holder(tmp_path)
    try:
        with pytest.raises(MbtuneError) as e:
            RunLock.take(tmp_path, command="mbtune run")
        line = str(e.value)
        assert "\n" not in line
        assert line.startswith(f"{tmp_path} is in use by mbtune run --resume (process {proc.pid} "
                               f"on {socket.gethostname()}, since ")  # fmt: skip
        assert "mbtune run --resume" in line.split("; ", 1)[1]  # and what to do
    finally:
        proc.kill()
        proc.wait()


def test_a_holder_killed_with_sigkill_leaves_no_lock(tmp_path):
    proc = holder(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    lock = RunLock.take(tmp_path, command="mbtune run --resume")  # the kernel let it go
    assert str(os.getpid()) in (tmp_path / LOCK_FILE).read_text()
    lock.release()


def test_a_released_lock_can_be_taken_again_and_the_holder_is_refused_in_process(tmp_path):
    first = RunLock.take(tmp_path, command="mbtune run")
    with pytest.raises(MbtuneError, match=r"in use by mbtune run \(process \d+ on "):
        RunLock.take(tmp_path, command="mbtune run --resume")
    first.release()
    RunLock.take(tmp_path, command="mbtune run --resume").release()


def test_a_holder_that_has_not_written_yet_is_named_as_starting(tmp_path):
    import fcntl

    refused: list[str] = []

    def second() -> None:
        try:
            RunLock.take(tmp_path, command="mbtune run").release()
        except MbtuneError as e:
            refused.append(str(e))

    with (tmp_path / LOCK_FILE).open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        taker = threading.Thread(target=second, daemon=True)
        taker.start()
        taker.join(120)  # a taker that waited for the lock would wait until it is let go
    taker.join(120)  # let go: one that waited takes it now, and is not refused
    # refused while the lock was held, so at once: it never waits
    assert len(refused) == 1 and "in use by another mbtune process" in refused[0]
