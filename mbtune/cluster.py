"""The Ray a search runs on: an embedded one, or a cluster it joins; and the cluster's head
going away.

A cluster is joined by ``--address auto`` or ``HOST:PORT`` (the head's GCS port), or by
``RAY_ADDRESS``, as ``ray.init`` does. Before ``ray.init`` is asked, the address is checked
in seconds: something must listen there, and the cluster must not refuse this process's
token (Ray 2.59+ turns token authentication on for the clusters ``ray start`` makes, and
``ray.init`` would retry a refused driver for 20 s). Ray Client (``ray://``) is refused: it
would run the whole search on the head node. The driver ships its own mbtune package to
the cluster, so the nodes run the driver's code.

Ray reads ``RAY_AUTH_MODE`` once, when it is imported: :func:`prepare_ray` checks a named
cluster and sets it, so it runs before anything imports Ray (the ``mbtune`` command calls it
first; :func:`init_ray` calls it too). This module imports Ray only inside its functions.
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

from mbtune.errors import MbtuneError

__all__ = [
    "EXIT_CLUSTER_LOST", "TOKEN_CHECK_S", "check_reachable", "cluster_size", "init_ray",
    "prepare_ray", "short_of", "token_note", "token_source", "watch_head", "watch_resources",
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
    joining, flag = _joining(address)
    prepare_ray(address)
    import ray  # after prepare_ray: it may set RAY_AUTH_MODE, which Ray reads on import

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
            with _dashboard_dependencies_found():
                context = ray.init(include_dashboard=dashboard, dashboard_host="127.0.0.1",
                                   **quiet)  # fmt: skip
    except (ConnectionError, RuntimeError, ValueError) as e:
        where = joining or "an embedded local Ray"
        raise MbtuneError(f"{flag}: cannot start or reach {where}: {_first_line(e)}") from None
    url = context.address_info.get("webui_url") or None
    return (ray.get_runtime_context().gcs_address if joining else None), url


DASHBOARD_DEPENDENCIES = (
    "aiohttp", "aiohttp_cors", "grpc", "opencensus", "opentelemetry", "prometheus_client",
    "pydantic",
)  # fmt: skip
"""The packages whose presence tells Ray that its dashboard can run: the imports of
``ray.dashboard.optional_deps``, which ray[default] (an mbtune dependency) installs."""

OPTIONAL_DEPS = "ray.dashboard.optional_deps"
"""The module Ray imports to learn whether :data:`DASHBOARD_DEPENDENCIES` are installed."""


@contextlib.contextmanager
def _dashboard_dependencies_found() -> Iterator[None]:
    """While an embedded Ray starts. Ray asks whether its dashboard's dependencies are
    installed (to start its dashboard and each node's agent in full, or minimal) by
    importing ``ray.dashboard.optional_deps``, whose own imports are all of them: aiohttp,
    opencensus, opentelemetry, pydantic and more (0.3 to 1.1 s after Ray's own import at
    load 8, 4.7 s of a 10.9 s start at load 11), which this process never uses: the
    dashboard and the agents are processes of their own that import them there. Where
    each of them is installed (found by importlib.util.find_spec, which imports nothing),
    a stand-in for that module is in the import system's cache, one that imports the real
    module only when a name is read from it: Ray's question is answered at once, and as it
    would have been. Where one is missing, Ray asks as it always does, and says so."""
    import importlib
    import importlib.util
    import types

    if OPTIONAL_DEPS in sys.modules or any(
        importlib.util.find_spec(name) is None for name in DASHBOARD_DEPENDENCIES
    ):
        yield
        return
    stand_in = types.ModuleType(OPTIONAL_DEPS, "installed; imported when a name is read")

    def real(name: str) -> Any:
        if sys.modules.get(OPTIONAL_DEPS) is stand_in:
            del sys.modules[OPTIONAL_DEPS]
        return getattr(importlib.import_module(OPTIONAL_DEPS), name)

    stand_in.__getattr__ = real  # type: ignore[attr-defined]  # a module's own (PEP 562)
    sys.modules[OPTIONAL_DEPS] = stand_in
    try:
        yield
    finally:
        if sys.modules.get(OPTIONAL_DEPS) is stand_in:
            del sys.modules[OPTIONAL_DEPS]


def prepare_ray(address: str | None) -> None:
    """Ready this process to join the cluster at ``address`` (or RAY_ADDRESS; nothing to do
    for an embedded Ray), before Ray is imported: Ray Client is refused, and a cluster
    named by host:port is checked (:func:`check_reachable`), which sets RAY_AUTH_MODE=token
    where the cluster wants the token at hand. Asked again, it checks again and says
    nothing new."""
    joining, flag = _joining(address)
    if joining and "://" in joining:
        raise MbtuneError(RAY_CLIENT_REFUSED.format(flag=flag, address=joining))
    if joining and joining != "auto":
        check_reachable(joining, flag=flag)


def _joining(address: str | None) -> tuple[str | None, str]:
    """The cluster to join (``address``, else RAY_ADDRESS; None: an embedded Ray) and the
    flag the user named it with, for errors. ``auto`` is RAY_ADDRESS where that names a
    cluster, as ray.init reads it: checked (and given its token) as a named address."""
    named = os.environ.get("RAY_ADDRESS") or None
    if address == "auto" and named not in (None, "auto"):
        return named, "RAY_ADDRESS"
    return address or named, "--address" if address else "RAY_ADDRESS"


def _shipped_code() -> dict[str, Any]:
    """The runtime environment of a search on a cluster: this mbtune package, put first on
    every worker's PYTHONPATH (so also on its trial processes'), so that the cluster's
    nodes run the very code of the driver, whatever mbtune they have installed."""
    import mbtune

    return {"py_modules": [str(Path(mbtune.__file__).parent)]}


def cluster_size() -> str:
    """The joined cluster in a few words: its live nodes, CPUs and GPUs."""
    import ray

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


def check_reachable(address: str, *, flag: str = "--address") -> None:
    """Fail in seconds, not minutes, when nothing listens at ``address`` (host:port), or
    when the cluster there wants a token this process does not send; where it wants the
    token at hand, send it (:func:`_check_token`). ``flag`` names where the address came
    from, in the error."""
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
    _check_token(address, flag)


def _host_port(address: str) -> tuple[str, str]:
    """``host:port`` split, an IPv6 host's brackets removed (``[::1]:6379``)."""
    host, _, port = address.rpartition(":")
    return host.removeprefix("[").removesuffix("]"), port


def _without(flag: str) -> str:
    return "unset RAY_ADDRESS" if flag == "RAY_ADDRESS" else f"leave out {flag}"


def _check_token(address: str, flag: str) -> None:
    """A cluster with token authentication refuses a driver without its token. Ask once,
    with the token Ray would send, for at most TOKEN_CHECK_S; anything but a refused token
    is left for ray.init to report. Refused without a token where one is at hand
    (RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, ~/.ray/auth_token): ask again
    with it and, taken, use it as ``--address auto`` does (RAY_AUTH_MODE=token, which Ray
    reads when it is imported), and say so in one line."""
    mode = os.environ.get("RAY_AUTH_MODE", "")
    at_hand = _token_at_hand(os.environ, Path.home())
    sent = at_hand[1] if at_hand and mode.lower() == "token" else None  # as Ray would
    if not _refuses(address, sent):
        return  # taken, no answer, or not a token problem: ray.init says what it is
    if mode.lower() == "token":
        raise MbtuneError(_refused(flag, address, "this token"))
    if mode:  # the user's explicit choice: not overridden
        raise MbtuneError(
            f"{flag}: the Ray cluster at {address} requires token authentication, and "
            f"RAY_AUTH_MODE is {mode!r} here: unset it, or set it to token"
        )
    if at_hand is None:
        raise MbtuneError(
            f"{flag}: the Ray cluster at {address} requires token authentication: set "
            "RAY_AUTH_TOKEN to its token, or write it to ~/.ray/auth_token (on the head node, "
            "`ray get-auth-token` prints it)"
        )
    source, token = at_hand
    if _refuses(address, token):
        raise MbtuneError(_refused(flag, address, f"the token in {source}"))
    if "ray" in sys.modules:  # Ray read RAY_AUTH_MODE already: too late to set it
        raise MbtuneError(
            f"{flag}: the Ray cluster at {address} requires token authentication, and Ray "
            "was imported before mbtune could turn it on: set RAY_AUTH_MODE=token (Ray "
            "reads it when it is imported)"
        )
    os.environ["RAY_AUTH_MODE"] = "token"  # Ray's token loader then finds the same token
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
    at_hand = _token_at_hand(environ, home)
    return at_hand[0] if at_hand else None


def _token_at_hand(environ: Mapping[str, str], home: Path) -> tuple[str, str] | None:
    """The token Ray's loader would find, and where (as :func:`token_source` names it)."""
    if token := environ.get("RAY_AUTH_TOKEN", "").strip():
        return "RAY_AUTH_TOKEN", token
    named = environ.get("RAY_AUTH_TOKEN_PATH")
    path = Path(named) if named else home / ".ray" / "auth_token"
    try:
        held = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None
    return (str(path), held) if held else None


GCS_PING = "/ray.rpc.NodeInfoGcsService/GetClusterId"
"""The gRPC method the token check calls: a Ray client's first call to a cluster's GCS (it
asks for the cluster's id), answered to any client the GCS lets in."""


def _refuses(address: str, token: str | None) -> bool:
    """Whether the GCS at ``address`` refuses a client that sends ``token`` (None: none),
    asked once over gRPC, as Ray's own client asks, for at most TOKEN_CHECK_S. No answer
    in time, or any answer but "unauthenticated", is no refusal.

    Not Ray's own client: importing Ray fixes its token mode for good (see prepare_ray).
    gRPC (grpcio, which ray[default] requires) is imported here, not Ray. A cluster that
    speaks TLS (RAY_USE_TLS) does not answer this plain channel: ray.init is left to judge."""
    import grpc

    metadata = (("authorization", f"Bearer {token}"),) if token else None
    # direct, as Ray connects: not through an HTTP proxy named in the environment
    with grpc.insecure_channel(address, options=[("grpc.enable_http_proxy", 0)]) as channel:
        ping = channel.unary_unary(GCS_PING)  # no serializers: bytes in and out
        try:
            ping(b"", timeout=TOKEN_CHECK_S, metadata=metadata)  # b"": the empty request
        except grpc.RpcError as e:  # raised as a grpc.Call, which has the status code
            return e.code() == grpc.StatusCode.UNAUTHENTICATED
    return False


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

    def silent() -> bool | None:
        return None if _answers(cluster) else True

    with _watch("mbtune-head-watch", silent, _head_patience_s(),
                lambda _, silent_s: on_lost(silent_s) or True):  # fmt: skip
        yield


RESOURCE_NAMES = {"cpu": "CPU", "gpu": "GPU", "memory": "memory"}
"""mbtune's names of a trial's resources, and Ray's."""


def short_of(need: dict[str, float], nodes: list[dict[str, float]]) -> str | None:
    """What the alive ``nodes`` (each node's resources, Ray's names) lack to hold one trial
    that needs ``need`` (mbtune's names) on one of them, in words; None where one can."""

    def lacks(have: dict[str, float]) -> list[str]:
        return [name for name, amount in need.items()
                if amount > 0 and have.get(RESOURCE_NAMES[name], 0) < amount]  # fmt: skip

    if any(not lacks(have) for have in nodes):
        return None
    most = {
        key: max((have.get(key, 0) for have in nodes), default=0) for key in RESOURCE_NAMES.values()
    }
    return (
        ", ".join(
            f"{need[name]:g} {name.upper() if name != 'memory' else 'bytes of memory'} "
            f"(no node has more than {most[RESOURCE_NAMES[name]]:g})"
            for name in lacks(most)
        )
        or "one node with all of it"
    )


@contextlib.contextmanager
def watch_resources(
    cluster: str | None,
    need: dict[str, float],
    wait_s: float,
    on_short: Callable[[str], bool],
    *,
    every_s: float = 1.0,
) -> Iterator[None]:
    """While the block runs on a cluster: should the cluster's nodes together stop having
    what one trial ``need``s (the nodes that had it went away) for ``wait_s`` seconds,
    call ``on_short`` with what is missing, from a thread of its own, until it says it
    acted (True). An embedded Ray never loses a node: nothing is watched."""
    if cluster is None:
        yield
        return
    import ray

    def missing() -> str | None:
        alive = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        return short_of(need, alive)

    with _watch("mbtune-resource-watch", missing, wait_s, lambda m, _: on_short(m), every_s):
        yield


@contextlib.contextmanager
def _watch(
    name: str,
    probe: Callable[[], Any],
    patience_s: float,
    act: Callable[[Any, float], bool],
    every_s: float = 1.0,
) -> Iterator[None]:
    """While the block runs, a thread of its own asks ``probe`` every ``every_s`` seconds;
    once it has said something other than None for ``patience_s`` seconds on end, ``act``
    is called with what it said last and for how long, until ``act`` says it acted. A
    probe that raises has said nothing new (the head watch speaks for a silent cluster)."""
    done = threading.Event()

    def watch() -> None:
        since = None
        while not done.wait(every_s):
            try:
                found = probe()
            except Exception:  # noqa: BLE001 - see the docstring
                continue
            if found is None:
                since = None
                continue
            since = since or time.monotonic()
            waited = time.monotonic() - since
            if waited >= patience_s and act(found, waited):
                return

    thread = threading.Thread(target=watch, name=name, daemon=True)
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
