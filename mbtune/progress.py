"""Live progress of the trials a search runs: which trial, its configuration, its phase
(building, compiling, warm-up k of K, timing k of K) and how long it has run.

A phase travels from where it happens to where it is shown in three hops:

    trial process (python -m mbtune.trial)  -- one JSON line per phase, on a pipe -->  trial actor
    trial actor (any node of the cluster)   -- Ray: the board actor's tell() ------->  board
    driver: a thread polls the board and draws

The board (a Ray actor on the driver's node, alive as long as the search) also holds the
node each trial runs on, told by its trial actor before it measures (:func:`forwarder`): a
trial whose node is lost never reports, yet its row names the node (:func:`node_of`). And
the run's state as Ray metrics (mbtune.metrics): the driver tells it which trials run, and
each finished trial with the recommendation after it, as it records them (:func:`recorded`).

On a terminal the driver draws one line and rewrites it in place; anywhere else (a log, CI,
``ray job submit``) it prints a plain line for each trial still running every
:data:`PLAIN_EVERY_S` seconds, so that quick trials add nothing to the output. The finished
trial's own line replaces the progress line.

Nothing here imports Ray at module level: the trial process uses :func:`phase_writer` only.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TextIO

from mbtune.lattice import BatchConfig
from mbtune.metrics import RunGauges, RunState
from mbtune.runs.record import TrialRecord

__all__ = [
    "PHASE_FD_FLAG", "PLAIN_EVERY_S", "Board", "Display", "PhaseHook", "echo", "ended",
    "forwarder", "node_of", "one_trial", "phase_pipe", "phase_writer", "recorded", "shown",
    "started",
]  # fmt: skip

PhaseHook = Callable[[str, int, int], None]
"""``on_phase(phase, done, total)``: told as a trial moves through its phases: ``building``,
``compiling`` (the first step, which compiles), ``warm-up`` and ``timing`` (``done`` of
``total`` steps), ``replaying``, ``starting workers`` (ddp). ``done``/``total`` are 0
where a phase has no steps to count."""

PHASE_FD_FLAG = "--phase-fd"
"""``python -m mbtune.trial --phase-fd N``: write each phase to file descriptor N."""

PLAIN_EVERY_S = 30.0
"""Where the output is not a terminal: a trial still running says so this often."""

TICK_S = 0.5
"""How often a terminal's progress line is redrawn (its elapsed time moves)."""

FORWARD_EVERY_S = 0.2
"""A trial actor passes a new step count of the same phase on at most this often."""

BOARD = "mbtune-progress-{job}"
"""The board actor's name: one per Ray job (the driver's; its trial actors are in it too),
so that two searches on one cluster, even in one namespace, never share a board."""


# ---------------------------------------------------------------------------
# the trial process: phases onto a pipe


def phase_writer(fd: int) -> PhaseHook:
    """A hook that writes each phase to ``fd`` as one JSON line; a reader that went away
    does not fail the trial."""
    out = os.fdopen(fd, "w", buffering=1, encoding="utf-8")

    def write(phase: str, done: int, total: int) -> None:
        if out.closed:
            return
        try:
            out.write(json.dumps([phase, done, total]) + "\n")
        except (OSError, ValueError):
            with contextlib.suppress(OSError):
                out.close()

    return write


# ---------------------------------------------------------------------------
# the trial actor: the pipe read, the phases passed on to the board


@contextlib.contextmanager
def phase_pipe(on_phase: PhaseHook | None) -> Iterator[tuple[list[str], tuple[int, ...]]]:
    """A pipe for a trial process to write its phases to; yields the arguments and the file
    descriptors to start it with. A thread passes each phase it writes to ``on_phase``. With
    no ``on_phase``: no pipe (no arguments, no descriptors)."""
    if on_phase is None:
        yield [], ()
        return
    read_fd, write_fd = os.pipe()

    def read() -> None:
        with os.fdopen(read_fd, encoding="utf-8", errors="replace") as lines:
            for line in lines:
                try:
                    phase, done, total = json.loads(line)
                    on_phase(str(phase), int(done), int(total))
                except (ValueError, TypeError):
                    continue  # not a phase: a display is never worth a failed trial

    reader = threading.Thread(target=read, name="mbtune-phases", daemon=True)
    reader.start()
    try:
        yield [PHASE_FD_FLAG, str(write_fd)], (write_fd,)
    finally:
        os.close(write_fd)  # the child's copy closed when it ended: the reader sees the end
        reader.join(timeout=2.0)  # a grandchild could hold the pipe open: do not wait on it


def forwarder(node_id: str) -> PhaseHook | None:
    """In a search's trial actor, before it measures: tell the driver's board that
    ``node_id`` runs this trial (waited on, so that a node lost later cannot lose the
    message), and return a hook that passes phases on to the board (a new phase at once, a
    new step count of the same phase at most every FORWARD_EVERY_S); None where there is
    no board (a trial outside a search)."""
    import ray
    from ray import tune

    try:
        board = ray.get_actor(_board_name())
        trial_id = tune.get_context().get_trial_id()
    except Exception:  # noqa: BLE001 - no board, or not in a Tune trial: nothing to show
        return None
    if trial_id is None:
        return None
    with contextlib.suppress(Exception):  # a row without its node never fails a trial
        ray.get(board.ran_on.remote(trial_id, node_id), timeout=10)
    last = ["", 0.0]

    def forward(phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if phase == last[0] and now - last[1] < FORWARD_EVERY_S:
            return
        last[:] = [phase, now]
        board.tell.remote(trial_id, phase, done, total)  # not waited on

    return forward


def node_of(trial_id: str) -> str | None:
    """In the driver: the node ``trial_id`` said it ran on (None: it did not say, or there
    is no board to ask)."""
    board = _display.board if _display is not None else None
    if board is None:
        return None
    import ray

    try:
        return ray.get(board.node_of.remote(trial_id), timeout=10)
    except Exception:  # noqa: BLE001 - the reason is what matters
        return None


def _board_name() -> str:
    import ray

    return BOARD.format(job=ray.get_runtime_context().get_job_id())


class Board:
    """What the trial actors tell the driver while they run: the latest phase of each
    running trial and the node each runs on. A Ray actor in the driver's job, on its node
    (it outlives any other), read by the driver. With ``run``, the run's Ray metrics too:
    set from it at once, then after each trial the driver records (:meth:`recorded`) and
    each change in how many run (:meth:`running`)."""

    def __init__(self, run: RunState | None = None) -> None:
        self.phases: dict[str, tuple[str, int, int]] = {}
        self.nodes: dict[str, str] = {}
        self.run, self.gauges = run, None
        if run is not None:
            try:
                self.gauges = RunGauges()
            except Exception:  # noqa: BLE001 - no metrics: the board still shows the phases
                self.run = None
        self._publish()

    def recorded(self, record: TrialRecord, recommendation: dict[str, Any] | None) -> None:
        if self.run is not None:
            self.run.add(record, recommendation)
            self._publish()

    def running(self, count: int) -> None:
        if self.run is not None and self.run.running != count:
            self.run.running = count
            self._publish()

    def _publish(self) -> None:
        if self.gauges is not None and self.run is not None:
            try:
                self.gauges.publish(self.run)
            except Exception:  # noqa: BLE001 - a metric is never worth the phases shown
                self.gauges = None

    def tell(self, trial_id: str, phase: str, done: int, total: int) -> None:
        self.phases[trial_id] = (phase, done, total)

    def forget(self, trial_id: str) -> None:
        self.phases.pop(trial_id, None)

    def ran_on(self, trial_id: str, node_id: str) -> None:
        self.nodes[trial_id] = node_id

    def node_of(self, trial_id: str) -> str | None:
        return self.nodes.pop(trial_id, None)

    def snapshot(self) -> dict[str, tuple[str, int, int]]:
        return dict(self.phases)


# ---------------------------------------------------------------------------
# the driver: what is shown


@dataclass
class _Running:
    config: BatchConfig
    started: float
    said: float
    """When a plain line last said this trial (monotonic seconds)."""
    phase: str = "starting"
    done: int = 0
    total: int = 0

    def doing(self, now: float) -> str:
        steps = f" {self.done} of {self.total}" if self.total else ""
        return f"{self.phase}{steps}, {_duration(now - self.started)}"


def _duration(seconds: float) -> str:
    s = int(seconds)
    return f"{s} s" if s < 100 else f"{s // 60} min {s % 60:02d} s"


class Display:
    """The running trials, drawn on ``out``: one line rewritten in place on a terminal
    (``tty``), else a plain line per trial every PLAIN_EVERY_S. ``finished``: the trials the
    run had finished before, so that a running trial shows the number it will get."""

    def __init__(self, out: TextIO, *, tty: bool, finished: int = 0, board: Any = None) -> None:
        self.out, self.tty, self.finished, self.board = out, tty, finished, board
        self.running: dict[str, _Running] = {}
        self.lock = threading.RLock()
        self.drawn = False

    # what happens

    def started(self, trial_id: str, config: BatchConfig) -> None:
        now = time.monotonic()
        with self.lock:
            self.running[trial_id] = _Running(config, now, now)
            self.draw()
            count = len(self.running)
        if self.board is not None:
            self.board.running.remote(count)

    def phase(self, trial_id: str, phase: str, done: int, total: int) -> None:
        with self.lock:
            trial = self.running.get(trial_id)
            if trial is not None:
                trial.phase, trial.done, trial.total = phase, done, total

    def ended(self, trial_id: str) -> None:
        with self.lock:
            if self.running.pop(trial_id, None) is not None:
                self.finished += 1
            self.draw()
            count = len(self.running)
        if self.board is not None:
            self.board.forget.remote(trial_id)
            self.board.running.remote(count)

    def recorded(self, record: TrialRecord, recommendation: dict[str, Any] | None) -> None:
        """A finished trial, as trials.csv holds it, and the recommendation after it, as
        recommendations.jsonl holds it (None: none yet): told to the board's metrics."""
        if self.board is not None:
            self.board.recorded.remote(record, recommendation)  # not waited on

    def echo(self, line: str) -> None:
        """Print ``line`` above the progress line."""
        with self.lock:
            self._clear()
            self.out.write(line + "\n")
            self.draw()

    # drawing

    def lines(self, now: float, short: bool = False) -> list[tuple[str, _Running]]:
        """Each running trial's line, numbered as trials.csv will number it (in the order
        they started, after the finished ones); ``short``: without the clock, the sizes as
        n, B and m."""
        stamp = f"mbtune {time.strftime('%H:%M:%S')}  "
        ordered = sorted(self.running.values(), key=lambda r: r.started)
        lines = []
        for i, r in enumerate(ordered, start=1):
            c = r.config
            t, p, schedule = c.layout  # as mbtune.report.sizes names them: what splits
            if short:
                split = f" (t {t}, p {p})" if t * p > 1 else ""
            else:
                split = f", tensor_parallel {t}" * (t > 1) + (
                    f", pipeline_parallel {p} ({schedule})" if p > 1 else ""
                )
            sizes = (
                f"n {c.num_devices}{split}, B {c.batch_size}, m {c.micro_batch_size}"
                if short
                else f"num_devices {c.num_devices}{split}, batch_size {c.batch_size}, "
                f"micro_batch_size {c.micro_batch_size}"
            )
            if short:  # several on one line: no clock (each says how long it has run)
                lines.append((f"trial {self.finished + i} {sizes}: {r.doing(now)}", r))
            else:
                lines.append((f"{stamp}trial {self.finished + i:>3}  {sizes}: {r.doing(now)}", r))
        return lines

    def draw(self) -> None:
        """On a terminal: rewrite the progress line. Elsewhere: a plain line for each trial
        not said for PLAIN_EVERY_S."""
        now = time.monotonic()
        with self.lock:
            lines = self.lines(now)
            if self.tty:
                self._clear()
                if lines:
                    # the terminal's width, less one: a line that wraps cannot be rewritten
                    width = shutil.get_terminal_size((100, 24)).columns - 1
                    text = lines[0][0] if len(lines) == 1 else ""
                    if not text or len(text) > width:
                        text = " | ".join(line for line, _ in self.lines(now, short=True))
                    self.out.write("\r" + text[:width])
                    self.drawn = True
            else:
                for line, trial in lines:
                    if now - trial.said >= PLAIN_EVERY_S:
                        self.out.write(line + "\n")
                        trial.said = now
            self.out.flush()

    def _clear(self) -> None:
        if self.drawn:
            self.out.write("\r\x1b[K")
            self.drawn = False

    def due(self) -> bool:
        """Whether a tick would show anything new (a plain line falls due)."""
        now = time.monotonic()
        with self.lock:
            if self.tty:
                return bool(self.running)
            return any(now - r.said >= PLAIN_EVERY_S for r in self.running.values())

    def poll(self) -> None:
        """Read the board: the latest phase of each running trial."""
        import ray

        try:
            phases = ray.get(self.board.snapshot.remote(), timeout=5)
        except Exception:  # noqa: BLE001 - a board that does not answer shows nothing new
            return
        for trial_id, (phase, done, total) in phases.items():
            self.phase(trial_id, phase, done, total)


_display: Display | None = None
"""The display of the search this driver runs (one at a time), or None."""


@contextlib.contextmanager
def shown(
    finished: int = 0,
    out: TextIO | None = None,
    *,
    board: bool = True,
    metrics: RunState | None = None,
) -> Iterator[Display]:
    """Show the progress of the trials a search runs while the block runs; ``finished``:
    how many trials the run had finished before (a resumed run). ``board``: start the board
    actor the trial actors tell (Ray must be running); without it, phases are told to the
    display directly. ``metrics``: the run as it stands, which the board exports as Ray
    metrics (mbtune.metrics) and keeps up to date."""
    global _display

    out = out or sys.stdout
    display = Display(out, tty=out.isatty(), finished=finished)
    if board:
        import ray

        name = _board_name()
        with contextlib.suppress(ValueError):  # a board left by a search that died in this job
            ray.kill(ray.get_actor(name))
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # on the driver's node: it outlives any other, and its metrics are served by the
        # endpoint mbtune run prints
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        try:
            display.board = (
                ray.remote(Board)
                .options(name=name, num_cpus=0, max_restarts=0, scheduling_strategy=here)
                .remote(metrics)
            )
        except Exception:  # noqa: BLE001 - no board: trials show "starting", never fail
            display.board = None
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(TICK_S):
            if display.due():
                if display.board is not None:
                    display.poll()
                display.draw()

    ticking = threading.Thread(target=tick, name="mbtune-progress", daemon=True)
    _display = display
    ticking.start()
    try:
        yield display
    finally:
        stop.set()
        ticking.join(timeout=10)
        _display = None
        with display.lock:
            display._clear()
            out.flush()
        if display.board is not None:
            import ray

            with contextlib.suppress(Exception):
                ray.kill(display.board)


@contextlib.contextmanager
def one_trial(config: BatchConfig) -> Iterator[PhaseHook]:
    """The progress line of one trial measured here (``mbtune trial``), on a terminal; yields
    the hook to tell its phases to."""
    with shown(board=False) as display:
        display.started("trial", config)
        yield functools.partial(display.phase, "trial")
        display.ended("trial")


def echo(line: str) -> None:
    """Print one line now, above the progress line where one is shown."""
    if _display is not None:
        _display.echo(line)
    else:
        print(line, flush=True)


def started(trial_id: str, config: BatchConfig) -> None:
    if _display is not None:
        _display.started(trial_id, config)


def ended(trial_id: str) -> None:
    if _display is not None:
        _display.ended(trial_id)


def recorded(record: TrialRecord, recommendation: dict[str, Any] | None = None) -> None:
    """The search recorded a finished trial (``record``, its row of trials.csv) and the
    recommendation after it (``recommendation``, its record of recommendations.jsonl)."""
    if _display is not None:
        _display.recorded(record, recommendation)
