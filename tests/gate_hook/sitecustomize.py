"""The trial gate's hook (tests/trial_gate.py): on PYTHONPATH, Python imports it at the
start of every process. Under a gate (MBTUNE_TEST_GATE names its directory) each trial
process takes one of the gate's passes or, none left, announces itself (``held-PID``) and
holds while the gate's ``hold`` file exists: a cold trial (``python -m mbtune.trial``) at
its start, a trial forked by a warm parent (``python -m mbtune.trial --warm ...``, or
``--warm-ahead``: one the driver started ahead) as it is forked. Every other process, and
every process without a gate, goes on at once; the hook starts no thread (a warm parent
checks that it has only one before it forks)."""

import os
import sys
import time

_GATE = os.environ.get("MBTUNE_TEST_GATE")


def _gate() -> None:
    for name in sorted(n for n in os.listdir(_GATE) if n.startswith("pass-")):
        try:
            os.unlink(os.path.join(_GATE, name))  # taken by whoever unlinks it
            return
        except FileNotFoundError:
            continue
    hold = os.path.join(_GATE, "hold")
    if os.path.exists(hold):
        open(os.path.join(_GATE, f"held-{os.getpid()}"), "w").close()
        deadline = time.monotonic() + 300  # a test that never releases: not forever
        while os.path.exists(hold) and time.monotonic() < deadline:
            time.sleep(0.05)


if _GATE and sys.orig_argv[1:3] == ["-m", "mbtune.trial"]:
    if sys.orig_argv[3:4] in (["--warm"], ["--warm-ahead"]):  # a warm parent, not a trial
        os.register_at_fork(after_in_child=_gate)  # each trial: a child forked here
    else:
        _gate()
