"""The Ray a search runs on: an embedded one, or a cluster it joins; and the cluster's head
going away.

A cluster is joined by ``--address auto`` or ``HOST:PORT`` (the head's GCS port), or by
``RAY_ADDRESS``, as ``ray.init`` does. Before ``ray.init`` is asked, the address is checked
in seconds: something must listen there, and the cluster must not refuse this process's
token (Ray 2.59+ turns token authentication on for the clusters ``ray start`` makes, and
``ray.init`` would retry a refused driver for 20 s). Ray Client (``ray://``) is refused: it
would run the whole search on the head node. The driver ships its own mbtune package to
the cluster, so the nodes run the driver's code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import ray

from mbtune.errors import MbtuneError

__all__ = [
    "EXIT_CLUSTER_LOST", "TOKEN_CHECK_S", "check_reachable", "cluster_size", "init_ray",
    "token_note", "token_source", "watch_head",
]  # fmt: skip

EXIT_CLUSTER_LOST = 75
"""The exit code of a search whose cluster's head node went away (sysexits' EX_TEMPFAIL:
try again later, with --resume)."""

TOKEN_CHECK_S = 10.0
"""How long the token check waits for an answer (a port that accepts and never answers)."""

RAY_CLIENT_REFUSED = (
    "{flag}: {address}: Ray Client (ray://) would run the search itself on the head "
    "node, so the run directory would not be written here (Ray advises Ray Jobs for Tune); "
    "run mbtune on a node of the cluster with --address auto or HOST:PORT (the head's GCS "
    "port, 6379 by default), or submit it: ray job submit --address http://HEAD:8265 "
    "--working-dir . -- mbtune run EXPERIMENT.yaml"
)


def init_ray(
    address: str | None, dashboard: bool, verbose: bool
) -> tuple[str | None, str | None] | None:
    """Join the cluster at ``address`` (or RAY_ADDRESS, as ray.init does), else start an
    embedded Ray. Returns the cluster's GCS address once joined (None for an embedded Ray)
    and the dashboard's host:port (None without one); None if Ray was running already."""
    joining = address or os.environ.get("RAY_ADDRESS") or None
    flag = "--address" if address else "RAY_ADDRESS"  # where the user said it
    if joining and "://" in joining:
        raise MbtuneError(RAY_CLIENT_REFUSED.format(flag=flag, address=joining))
    if joining and joining != "auto":
        check_reachable(joining, quiet=not verbose, flag=flag)
    # Ray replaces builtins.print the first time it shows a message from the cluster (a
    # worker that died), also in a Ray started before; Tune then cannot save its state
    os.environ.setdefault("RAY_TQDM_PATCH_PRINT", "0")
    # Tune's default loggers include TensorBoard's, which imports torch into the driver
    # (2 s) for event files nobody reads; the search adds back the JSON and CSV ones
    os.environ.setdefault("TUNE_DISABLE_AUTO_CALLBACK_LOGGERS", "1")
    if ray.is_initialized():
        return None
    quiet = {"log_to_driver": verbose, "logging_level": logging.INFO if verbose else logging.ERROR}
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    if not verbose:  # a failed trial is recorded with its reason: no traceback from Tune too
        os.environ.setdefault("TUNE_PRINT_ALL_TRIAL_ERRORS", "0")
    try:
        if joining:
            context = ray.init(address=joining, runtime_env=_shipped_code(), **quiet)
        else:
            context = ray.init(include_dashboard=dashboard, dashboard_host="127.0.0.1", **quiet)
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = joining or "an embedded local Ray"
        raise MbtuneError(f"{flag}: cannot start or reach {where}: {_first_line(e)}") from None
    url = context.address_info.get("webui_url") or None
    return (ray.get_runtime_context().gcs_address if joining else None), url


def _shipped_code() -> dict[str, Any]:
    """The runtime environment of a search on a cluster: this mbtune package, put first on
    every worker's PYTHONPATH (so also on its trial processes'), so that the cluster's
    nodes run the very code of the driver, whatever mbtune they have installed."""
    import mbtune

    return {"py_modules": [str(Path(mbtune.__file__).parent)]}


def cluster_size() -> str:
    """The joined cluster in a few words: its live nodes, CPUs and GPUs."""
    nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    have = ray.cluster_resources()
    return f"{nodes} node(s), {have.get('CPU', 0):g} CPUs, {have.get('GPU', 0):g} GPUs"


def token_note() -> str:
    """How to open a dashboard that asks for Ray's token (Ray 2.59+ turns token
    authentication on for the local Ray it starts; ray.init sets RAY_AUTH_MODE then)."""
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return ""
    return " (it asks for Ray's token: `ray get-auth-token` prints it)"


# ---------------------------------------------------------------------------
# is the address worth asking ray.init about?


def check_reachable(address: str, *, quiet: bool = True, flag: str = "--address") -> None:
    """Fail in seconds, not minutes, when nothing listens at ``address`` (host:port), or
    when the cluster there wants a token this process does not send. ``flag`` names where
    the address came from, in the error."""
    host, port = _host_port(address)
    if not host or not re.fullmatch(r"[0-9]{1,5}", port) or not 0 < int(port) < 65536:
        raise MbtuneError(
            f"{flag}: {address!r} is not 'auto' or host:port (a port from 1 to 65535)"
        )
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
    except (OSError, ValueError) as e:  # ValueError: a host name IDNA cannot encode
        raise MbtuneError(
            f"{flag}: nothing answers at {address} ({getattr(e, 'strerror', None) or e}); "
            f"start a cluster with `ray start --head`, or {_without(flag)} for an embedded Ray"
        ) from None
    _check_token(address, quiet, flag)


def _host_port(address: str) -> tuple[str, str]:
    """``host:port`` split, an IPv6 host's brackets removed (``[::1]:6379``)."""
    host, _, port = address.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), port


def _without(flag: str) -> str:
    return "unset RAY_ADDRESS" if flag == "RAY_ADDRESS" else f"leave out {flag}"


def _check_token(address: str, quiet: bool, flag: str) -> None:
    """A cluster with token authentication refuses a driver without its token. Ask once,
    for at most TOKEN_CHECK_S; anything but a refused token is left for ray.init to report.
    Refused without a token where one is at hand (RAY_AUTH_TOKEN, the file
    RAY_AUTH_TOKEN_PATH names, ~/.ray/auth_token): use it, as ``--address auto`` does, say
    so in one line, and ask again."""
    try:
        from ray.exceptions import AuthenticationError
    except ImportError:  # a Ray without token authentication
        return
    if not isinstance(_ask_gcs(address, quiet), AuthenticationError):
        return  # no answer, or not a token problem: ray.init says what it is
    mode = os.environ.get("RAY_AUTH_MODE", "")
    if mode.lower() == "token":
        raise MbtuneError(_refused(flag, address, "this token"))
    if mode:  # the user's explicit choice: not overridden
        raise MbtuneError(
            f"{flag}: the Ray cluster at {address} requires token authentication, and "
            f"RAY_AUTH_MODE is {mode!r} here: unset it, or set it to token"
        )
    source = token_source(os.environ, Path.home())
    if source is None:
        raise MbtuneError(
            f"{flag}: the Ray cluster at {address} requires token authentication: set "
            "RAY_AUTH_TOKEN to its token, or write it to ~/.ray/auth_token (on the head node, "
            "`ray get-auth-token` prints it)"
        )
    _send_token()
    if isinstance(_ask_gcs(address, quiet), AuthenticationError):
        raise MbtuneError(_refused(flag, address, f"the token in {source}"))
    print(
        f"mbtune: the Ray cluster at {address} requires token authentication: using the "
        f"token in {source}",
        file=sys.stderr,
        flush=True,
    )


def _refused(flag: str, address: str, token: str) -> str:
    return (
        f"{flag}: the Ray cluster at {address} refused {token}; Ray reads it from "
        "RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or ~/.ray/auth_token (on the head node, "
        "`ray get-auth-token` prints the cluster's)"
    )


def token_source(environ: Mapping[str, str], home: Path) -> str | None:
    """Where Ray's token loader would find a token, in its order: ``RAY_AUTH_TOKEN``, else
    the file ``RAY_AUTH_TOKEN_PATH`` names, else ``~/.ray/auth_token``; None where none is."""
    if environ.get("RAY_AUTH_TOKEN", "").strip():
        return "RAY_AUTH_TOKEN"
    named = environ.get("RAY_AUTH_TOKEN_PATH")
    path = Path(named) if named else home / ".ray" / "auth_token"
    try:
        held = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    return str(path) if held else None


def _send_token() -> None:
    """Send the token this process finds with every request to Ray, from now on (what
    ``RAY_AUTH_MODE=token`` in the environment does; Ray reads its config once)."""
    from ray._raylet import AuthenticationTokenLoader, Config

    os.environ["RAY_AUTH_MODE"] = "token"
    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _ask_gcs(address: str, quiet: bool) -> BaseException | None:
    """Connect to the GCS at ``address`` once, for at most TOKEN_CHECK_S; what it raised
    (None: it answered, or did not answer in time)."""
    from ray._raylet import GcsClient

    answer: list[BaseException | None] = []

    def ask() -> None:
        try:
            GcsClient(address=address)
            answer.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
            answer.append(e)

    with _stderr_silenced(quiet):  # Ray's C++ client logs the refusal itself
        asking = threading.Thread(target=ask, name="mbtune-token-check", daemon=True)
        asking.start()
        asking.join(TOKEN_CHECK_S)
    return answer[0] if answer else None


@contextlib.contextmanager
def _stderr_silenced(silence: bool) -> Iterator[None]:
    """Send file descriptor 2 (where Ray's C++ code logs) to /dev/null for a moment."""
    if not silence:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


# ---------------------------------------------------------------------------
# the head going away


@contextlib.contextmanager
def watch_head(cluster: str | None, on_lost: Callable[[float], None]) -> Iterator[None]:
    """While the block runs on a cluster: should its head node (its GCS at ``cluster``)
    stop answering for longer than a restarting head would take, call ``on_lost`` with the
    seconds of silence, from a thread of its own. Ray itself ends a driver whose GCS has
    been silent for ``RAY_gcs_rpc_server_reconnect_timeout_s`` (60 s), with a log line of
    its C++ client: ``on_lost`` comes 10 s before, so that the end can be a clean one."""
    if cluster is None:
        yield
        return
    give_up_after_s = _head_patience_s()
    done = threading.Event()

    def watch() -> None:
        silent_since = None
        while not done.wait(1.0):
            if _answers(cluster):
                silent_since = None
                continue
            silent_since = silent_since or time.monotonic()
            if time.monotonic() - silent_since >= give_up_after_s:
                on_lost(time.monotonic() - silent_since)
                return

    thread = threading.Thread(target=watch, name="mbtune-head-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def _head_patience_s() -> float:
    """How long a silent head is waited for: a restarting GCS (fault-tolerant, with Redis)
    comes back; 10 s less than Ray itself waits, so that the end is ours, not Ray's."""
    name = "RAY_gcs_rpc_server_reconnect_timeout_s"  # Ray's own spelling  # noqa: SIM112
    try:
        reconnect_s = float(os.environ.get(name, 60))
    except ValueError:
        reconnect_s = 60.0
    return max(reconnect_s - 10, reconnect_s / 2)


def _answers(address: str) -> bool:
    host, port = _host_port(address)
    try:
        socket.create_connection((host, int(port)), timeout=2).close()
    except OSError:
        return False
    return True
