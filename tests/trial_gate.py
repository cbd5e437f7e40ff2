"""A gate for the trials of a search started as a command (`mbtune run` in a subprocess):
the first ``passes`` trial processes run, the next ones hold until the test releases the
gate. A test that polls what the search writes (trials.csv) and then signals it knows
that the search cannot have moved on, let alone finished, in between: no race between a
poll and the search, as the cluster tests' hold file.

The hook is tests/gate_hook/sitecustomize.py, which Python imports in every process that
has it on PYTHONPATH: a search on an embedded Ray gets it from the command's environment
(:meth:`TrialGate.env`: the embedded Ray's workers, and their trial processes, inherit the
driver's); the session's Ray (tests/conftest.py) starts with it and with its own gate
directory, which a test closes with ``TrialGate(shared_ray.gate, passes)``."""

from __future__ import annotations

import os
from pathlib import Path

HOOK = Path(__file__).with_name("gate_hook")


class TrialGate:
    def __init__(self, directory: Path, passes: int) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        for old in self.dir.iterdir():  # the session Ray's gate, closed again: afresh
            old.unlink()
        for i in range(passes):
            (self.dir / f"pass-{i:04d}").touch()
        (self.dir / "hold").touch()

    def env(self) -> dict[str, str]:
        """The environment of a search behind this gate."""
        path = os.pathsep.join(p for p in (str(HOOK), os.environ.get("PYTHONPATH")) if p)
        return {**os.environ, "PYTHONPATH": path, "MBTUNE_TEST_GATE": str(self.dir)}

    def held(self) -> set[int]:
        """The trial processes that found no pass left and hold (their pids)."""
        return {int(p.name.split("-")[1]) for p in self.dir.glob("held-*")}

    def release(self) -> None:
        """Every trial from now on runs, and the held ones go on."""
        (self.dir / "hold").unlink(missing_ok=True)
