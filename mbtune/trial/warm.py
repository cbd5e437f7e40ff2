"""The warm parent: a process per trial actor that has imported torch and the trial's code
once, and forks a child for each trial (Linux).

A trial keeps a process of its own (an out-of-memory, a crash, a hang or a leak ends with
it), but no longer pays a fresh Python, torch's import and torch.compile's (seconds each)
before it builds its model. mbtune.trial.launch keeps one warm parent per trial actor,
``python -m mbtune.trial --warm FD MODULE...``: it imports the modules named (torch, the
trial's code, and what this experiment's trials use: dynamo and inductor to compile,
transformers for an ``hf:`` model; torch.compile's per-process probes, see
mbtune.trial.compiling.warm_compiler), says it is ready on the socket FD, and then, for each
request that comes on it, forks a child that runs the trial as ``python -m mbtune.trial``
would (its stdout, stderr and phase pipe the actor's, its working directory and
environment the request's) and exits; the parent tells the actor the child's exit status.

What fork cannot carry, and how the parent stays clear of it:

- threads: only the forking thread goes on in the child, so a lock another thread held
  stays locked there forever. The parent runs no torch op (torch's OpenMP and inter-op
  pools start at the first op, never at import), starts OpenBLAS (numpy's) with one
  thread, and checks before every fork that it has one thread; if not, it says why and
  the actor's trials run cold (``python -m mbtune.trial``, a fresh process each).
- CUDA: a CUDA context does not survive a fork. The parent never initialises CUDA (it
  imports torch only; the child is the first to touch the card), and checks that too.
- a user model is imported in the child only: its code never runs in the parent.

The parent serves one trial at a time (an actor runs one); it ends when the actor's end of
the socket closes (the actor ended), killing a child still running, and a child ends when
its parent does (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import json
import os
import pickle
import select
import signal
import socket
import struct
import subprocess
import sys
import traceback
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AHEAD_FLAG",
    "WARM_FLAG",
    "Ended",
    "WarmParent",
    "answer",
    "fork_problem",
    "parent_environment",
    "serve",
    "serve_ahead",
    "spawn",
]

WARM_FLAG = "--warm"
"""``python -m mbtune.trial --warm FD MODULE...``: serve trials on socket FD."""

AHEAD_FLAG = "--warm-ahead"
"""``python -m mbtune.trial --warm-ahead FD PID MODULE...``: serve the first actor that
connects to the listening socket FD, while process PID (its parent) lives."""

_LENGTH = struct.Struct("!Q")
_MAX_FDS = 8
_PR_SET_PDEATHSIG = 1


# ---------------------------------------------------------------------------
# one trial: what the child (or a cold process) runs


def answer(request: Any, phase_fd: int | None) -> None:
    """Measure ``request`` (a TrialRequest) and print the result as one JSON line; with
    ``phase_fd``, each phase is written to that file descriptor (mbtune.progress)."""
    from mbtune.progress import phase_writer
    from mbtune.trial.trial import trial_metrics

    on_phase = phase_writer(phase_fd) if phase_fd is not None else None
    metrics = trial_metrics(
        request.experiment, request.config, repeat=request.repeat, on_phase=on_phase
    )
    print(json.dumps(metrics), flush=True)


# ---------------------------------------------------------------------------
# the warm parent


def serve(fd: int, preload: list[str]) -> int:
    """The warm parent's loop: preload, say ready (or why not), then fork a child per
    request until the actor's end of socket ``fd`` closes."""
    sock = socket.socket(fileno=fd)
    env = dict(os.environ)  # as it started: importing inductor sets its cache's variable
    return _serve(sock, _preload(preload) or fork_problem(), preload, env)


def serve_ahead(fd: int, driver: int, preload: list[str]) -> int:
    """A warm parent started ahead of its actor by the search's driver (pid ``driver``,
    beside Ray's start: see mbtune.trial.launch.WarmAhead), listening on the socket ``fd``
    it was given: it preloads and serves the first actor that connects (see
    :meth:`WarmParent.adopt`), as :func:`serve` does. It ends with the driver, or once that
    actor's end of the socket closes."""
    _end_with_parent(driver)
    env = dict(os.environ)
    listener = socket.socket(fileno=fd)
    problem = _preload(preload) or fork_problem()
    sock, _ = listener.accept()
    listener.close()  # one actor: another one that asks finds no one, and starts its own
    return _serve(sock, problem, preload, env)


def _serve(
    sock: socket.socket, problem: str | None, preload: list[str], env: dict[str, str]
) -> int:
    _send(sock, {"problem": problem, "preload": preload, "env": env})
    if problem:
        return 0
    while True:
        try:
            message, fds = _receive(sock)
        except EOFError:
            return 0
        problem = fork_problem()
        if problem:  # nothing forked: the actor runs this trial and the next ones cold
            for f in fds:
                os.close(f)
            _send(sock, {"problem": problem})
            return 0
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            sock.close()
            os._exit(_child(message, fds))
        for f in fds:
            os.close(f)
        _send(sock, {"pid": pid})
        returncode = _wait(sock, pid)
        if returncode is None:
            return 0  # the actor is gone, and its trial with it
        _send(sock, {"returncode": returncode})


def _end_with_parent(parent: int | None = None) -> None:
    """This process is killed when its parent ends (Linux's ``PR_SET_PDEATHSIG``); with
    ``parent``, it ends now where that parent has already gone."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os._exit(0)


def _preload(modules: list[str]) -> str | None:
    """Import each of ``modules``; an entry ``MODULE:FUNCTION`` also calls that function
    (no arguments): work every trial would do once, done here for all of them."""
    for entry in modules:
        name, _, function = entry.partition(":")
        try:
            module = importlib.import_module(name)
            if function:
                getattr(module, function)()
        except Exception as e:  # a missing optional library: its trials say so, cold
            return f"preloading {entry} failed: {type(e).__name__}: {e}"
    return None


def fork_problem() -> str | None:
    """Why this process may not fork a trial (threads running, CUDA initialised); None
    where it may."""
    try:
        threads = os.listdir("/proc/self/task")
    except OSError:
        return "no /proc/self/task to count this process's threads in"
    if len(threads) > 1:
        names = sorted(_thread_name(t) for t in threads if int(t) != os.getpid())
        return f"the warm parent runs {len(threads)} threads ({', '.join(names)}), not one"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "the warm parent initialised CUDA"
    return None


def _thread_name(tid: str) -> str:
    try:
        with open(f"/proc/self/task/{tid}/comm") as f:
            return f.read().strip()
    except OSError:
        return tid


def _wait(sock: socket.socket, pid: int) -> int | None:
    """The child's exit status (negative: the signal that ended it), killing it where the
    actor asks; None where the actor went away (the child is killed, and reaped)."""
    child = os.pidfd_open(pid)
    try:
        while True:
            ready, _, _ = select.select([child, sock], [], [])
            if child in ready:
                return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            try:
                _receive(sock)  # the actor's one message while a child runs: kill it
            except EOFError:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(child)


def _child(message: dict[str, Any], fds: list[int]) -> int:
    """The forked child: the request's stdout, stderr, directory and environment, then the
    trial; the exit code a ``python -m mbtune.trial`` process would have."""
    code = 0
    try:
        _end_with_parent()
        out, err, *phase = fds
        for f, target in ((out, 1), (err, 2)):
            os.dup2(f, target)
            os.close(f)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.environ.clear()
        os.environ.update(message["env"])
        os.chdir(message["cwd"])
        sys.path[0] = message["cwd"]  # as ``python -m`` started there
        answer(pickle.loads(message["request"]), phase[0] if phase else None)
    except SystemExit as e:
        code = _exit_code(e)
    except BaseException:
        traceback.print_exc()
        code = 1
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()  # a user model's exit handlers, as at a process's end
    with contextlib.suppress(BaseException):
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def _exit_code(e: SystemExit) -> int:
    """The exit code Python gives ``SystemExit(e.code)`` (a text is printed, code 1)."""
    if e.code is None or isinstance(e.code, int):
        return e.code or 0
    print(e.code, file=sys.stderr)
    return 1


# ---------------------------------------------------------------------------
# the actor's side


@dataclass(frozen=True)
class Ended:
    """How a trial's process ended."""

    returncode: int | None
    """Its exit status (negative: the signal that ended it); None where it is not known."""
    killed: bool = False
    """Killed by the actor, still running at its deadline."""
    reason: str | None = None
    """Why the exit status is not known."""


class WarmParent:
    """One warm parent (``python -m mbtune.trial --warm``) and the actor's end of its
    socket, started here with ``preload`` imported. ``problem``: why it cannot fork trials
    (None: it can, as long as it lives)."""

    def __init__(
        self, preload: tuple[str, ...], env: dict[str, str], sock: socket.socket,
        process: subprocess.Popen | None, problem: str | None,
    ) -> None:  # fmt: skip
        self.preload = preload
        self.env = env
        """The environment it started with: libraries read theirs once, as they load."""
        self.sock = sock
        self.process = process
        """Its process where this one started it (None: adopted, not this process's child)."""
        self.problem = problem

    @classmethod
    def start(cls, preload: tuple[str, ...], *, cwd: str) -> WarmParent:
        """A warm parent started here, in ``cwd``, once it has said whether it can fork."""
        env = dict(os.environ)
        ours, theirs = socket.socketpair()
        try:
            process = spawn(WARM_FLAG, theirs, list(preload), cwd=cwd, env=env)
        finally:
            theirs.close()
        try:
            problem = _receive(ours)[0]["problem"]
        except EOFError:
            problem = f"the warm parent exited with {process.wait()} as it started"
        return cls(preload, env, ours, process, problem)

    @classmethod
    def adopt(cls, name: str, preload: tuple[str, ...]) -> WarmParent | None:
        """The warm parent started ahead under ``name`` (:func:`serve_ahead`), once it is
        ready, where it preloaded ``preload`` in this process's environment but for Ray's
        and Tune's bookkeeping (``RAY_*``, ``TUNE_*``: no library the parent imports reads
        them); None where it is not on this host, has been taken, could not fork,
        or differs (it ends as its socket closes)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect("\0" + name)
            hello = _receive(sock)[0]
        except (OSError, EOFError):
            sock.close()
            return None
        env = dict(os.environ)
        if (
            hello["problem"]
            or tuple(hello["preload"]) != preload
            or _imported_with(hello["env"]) != _imported_with(parent_environment(env))
        ):
            sock.close()
            return None
        return cls(preload, env, sock, process=None, problem=None)

    def alive(self) -> bool:
        if self.problem is not None:
            return False
        if self.process is not None:
            return self.process.poll() is None
        return not select.select([self.sock], [], [], 0)[0]  # readable while idle: ended

    def run(self, request: bytes, *, cwd: str, fds: list[int], kill_after: float) -> Ended | None:
        """Fork a child for the pickled TrialRequest ``request``, with ``fds`` (its stdout,
        stderr and phase pipe), killed at ``kill_after`` seconds; how it ended, or None
        where nothing was forked (the parent cannot fork, ``problem`` says why, or it has
        ended)."""
        message = {"request": request, "cwd": cwd, "env": dict(os.environ)}
        try:
            _send(self.sock, message, fds)
            reply = _receive(self.sock)[0]
        except (EOFError, OSError):
            return None
        if reply.get("problem"):
            self.problem = reply["problem"]
            return None
        try:
            killed = not select.select([self.sock], [], [], kill_after)[0]
            if killed:
                _send(self.sock, {"kill": True})
            return Ended(_receive(self.sock)[0]["returncode"], killed=killed)
        except (EOFError, OSError) as e:
            return Ended(None, reason=f"the trial's warm parent ended ({self._ended(e)})")

    def _ended(self, e: BaseException) -> str:
        if self.process is None:
            return f"{type(e).__name__}: {e}"
        try:
            code = self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return f"{type(e).__name__}: {e}"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def close(self) -> None:
        """End the warm parent: it exits once its socket closes."""
        self.sock.close()
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)


def spawn(
    flag: str, sock: socket.socket, args: list[str], *, cwd: str, env: dict[str, str]
) -> subprocess.Popen:
    """``python -m mbtune.trial FLAG FD ARGS...`` in ``cwd``: a warm parent given ``sock``
    (as FD), in the environment a warm parent starts with for a process whose own is
    ``env`` (:func:`parent_environment`)."""
    return subprocess.Popen(
        [sys.executable, "-m", "mbtune.trial", flag, str(sock.fileno()), *args],
        pass_fds=[sock.fileno()], stdin=subprocess.DEVNULL, cwd=cwd,
        env=parent_environment(env),
    )  # fmt: skip


def parent_environment(env: dict[str, str]) -> dict[str, str]:
    """The environment a warm parent starts with, for a process whose own is ``env``."""
    return {"OPENBLAS_NUM_THREADS": "1", **env}  # numpy's pool would start at import


def _imported_with(env: dict[str, str]) -> dict[str, str]:
    """``env`` less what a Ray worker's environment adds for Ray's own bookkeeping."""
    return {k: v for k, v in env.items() if not k.startswith(_RAYS_OWN) and k not in _BOOKKEEPING}


_RAYS_OWN = ("RAY_", "TUNE_")
_BOOKKEEPING = {"PL_DISABLE_FORK", "PYTHONBREAKPOINT", "SPT_NOENV", "PS1", "PWD", "OLDPWD", "_"}
"""With ``_RAYS_OWN``: what a Tune trial actor's environment has that its driver's had
not, or the reverse (Ray 2.60: Ray's and Tune's bookkeeping, Lightning's fork switch, a
shell's prompt and directories): no library a warm parent imports reads them.
(OMP_NUM_THREADS, which Ray also sets, is read: the driver starts a parent ahead with the
value Ray will give its trial actor.)"""


# ---------------------------------------------------------------------------
# messages: a length, a pickle, and file descriptors beside the length


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] = ()) -> None:
    data = pickle.dumps(message)
    socket.send_fds(sock, [_LENGTH.pack(len(data))], list(fds))
    sock.sendall(data)


def _receive(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    head, fds, _, _ = socket.recv_fds(sock, _LENGTH.size, _MAX_FDS)
    head += _exactly(sock, _LENGTH.size - len(head)) if head else b""
    if not head:
        raise EOFError("the other end closed")
    (length,) = _LENGTH.unpack(head)
    return pickle.loads(_exactly(sock, length)), fds


def _exactly(sock: socket.socket, n: int) -> bytes:
    chunks = []
    while n:
        chunk = sock.recv(min(n, 1 << 20))
        if not chunk:
            raise EOFError("the other end closed")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)
