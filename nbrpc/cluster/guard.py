"""Run a Python module that must not outlive the process that started it.

``python -c <loader> PARENT_PID MODULE ARGS...`` (see :func:`command`) runs
``python -m MODULE ARGS...`` in this interpreter, with a daemon thread that
ends the process as soon as ``PARENT_PID`` is no longer its parent (it died,
and this process was re-parented). The parent is checked before anything is
imported, and this file is loaded by path: importing the ``nbrpc`` package
would import torch, seconds on the controller's critical path. Processes
the module forks (ipyparallel's controller forks its heart monitor) get the
same watch on *their* parent, so a whole tree goes when its root goes. The
cluster starts ipyparallel's controller this way, so that a kernel killed
with SIGKILL leaves nothing behind.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys
import threading
import time

log = logging.getLogger("nbrpc.cluster.guard")

CLEANUP_ENV = "NBRPC_GUARD_CLEANUP"
# The largest frame (bytes) a ZeroMQ socket of the guarded process accepts.
MAX_MESSAGE_ENV = "NBRPC_ZMQ_MAX_MESSAGE"
# Set: the guarded ipyparallel controller binds ipc:// where its peers connect.
IPC_ENV = "NBRPC_IPP_IPC"
# Set: serve the controller's ipc:// channels to other hosts through an
# authenticated relay (relay.ControllerRelay) listening on this host.
RELAY_ENV = "NBRPC_RELAY_BIND"
RELAY_SOCKETS_ENV = "NBRPC_RELAY_SOCKETS"  # the channels' socket paths, less ":<port>"
RELAY_KEY_ENV = "NBRPC_RELAY_KEY_FILE"  # the controller's engine connection file
RELAY_FILE_ENV = "NBRPC_RELAY_FILE"  # where the relay writes the HOST:PORT it listens on

_LOADER = ("import runpy, sys; runpy.run_path(sys.argv[1], run_name='__nbrpc_guard__')"
           "['main'](sys.argv[2:])")


def command(module: str, parent: int | None = None) -> list[str]:
    """The argv that runs ``python -m module`` guarded by ``parent`` (default: us).

    >>> command("ipyparallel.controller", parent=42)[4:]
    ['42', 'ipyparallel.controller']
    """
    return [sys.executable, "-c", _LOADER, os.path.abspath(__file__),
            str(os.getpid() if parent is None else parent), module]


def watch_parent(parent: int, period: float = 0.25) -> threading.Thread:
    """Exit this process (code 3) within ``period`` seconds of ``parent`` dying,
    killing this process's own children first."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period)
        log.warning("parent process %d is gone; exiting", parent)
        _kill_children()
        _clean_up()
        os._exit(3)

    t = threading.Thread(target=watch, name="nbrpc-parent-watch", daemon=True)
    t.start()
    return t


def _kill_children() -> None:
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            try:
                child.kill()
            except psutil.Error:
                pass
    except Exception:  # noqa: BLE001 - exiting anyway
        pass


def _clean_up() -> None:
    """Remove the directory ``$NBRPC_GUARD_CLEANUP`` names: the private profile of
    a cluster whose driver died (only nbrpc's own ``nbrpc-cluster-*`` folders)."""
    path = os.environ.get(CLEANUP_ENV, "")
    if path and os.path.basename(path.rstrip("/")).startswith("nbrpc-cluster-"):
        import shutil

        shutil.rmtree(path, ignore_errors=True)


def cap_zmq_messages(limit: int) -> None:
    """Make every ZeroMQ socket this process creates from now on (and the
    processes it forks) refuse a frame larger than ``limit`` bytes
    (``ZMQ_MAXMSGSIZE``): libzmq reads a frame's declared size first and
    drops the connection before allocating it. ipyparallel's controller sets
    no limit and speaks no authenticated handshake, so without one a peer
    that can reach its ports makes it hold whatever a frame declares."""
    import zmq

    init = zmq.Context.__init__

    def capped_init(self: zmq.Context, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)
        self.sockopts[zmq.MAXMSGSIZE] = limit  # a default for each socket it makes

    zmq.Context.__init__ = capped_init  # type: ignore[method-assign]


def bind_ipc_where_peers_connect() -> None:
    """ipyparallel's controller binds an ``ipc://`` channel at
    ``<ip>-<port>``, while its engines and clients connect to
    ``<ip>:<port>`` (ipyparallel 9: ``IPController.construct_url`` against
    ``EngineApp`` and ``Client``), so over ipc nobody reaches it. Make the
    controller bind where they connect (a ``:`` is an ordinary character
    in a socket's path)."""
    from ipyparallel.controller.app import IPController

    construct_url = IPController.construct_url

    def colon_url(self: IPController, kind: str, channel: str, index: object = None) -> str:
        url = construct_url(self, kind, channel, index)
        if url.startswith("ipc://"):
            path, _, port = url.rpartition("-")
            url = f"{path}:{port}"
        return url

    IPController.construct_url = colon_url  # type: ignore[method-assign]


def start_relay(host: str, sockets: str, key_file: str, address_file: str) -> object:
    """Start the controller's relay (:class:`.relay.ControllerRelay`) on
    ``host``, and write the ``HOST:PORT`` it listens on to ``address_file``
    (mode 0600, whole or not at all). ``relay.py`` is loaded by path, as this
    file is: importing the package would import torch."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location(
        "nbrpc_guard_relay", os.path.join(os.path.dirname(os.path.abspath(__file__)), "relay.py"))
    relay = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = relay  # (dataclasses look their module up)
    spec.loader.exec_module(relay)

    def key_of() -> bytes | None:
        try:
            with open(key_file) as f:
                return relay.relay_secret(json.load(f))
        except (OSError, ValueError):
            return None

    server = relay.ControllerRelay(host, sockets, key_of,
                                   report=address_file + relay.REPORT_SUFFIX).start()
    host, port = server.address
    tmp = f"{address_file}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    os.replace(tmp, address_file)
    return server


def _watch_in_forked_child() -> None:
    os.environ.pop(CLEANUP_ENV, None)  # the root of the tree cleans up, once
    watch_parent(os.getppid())


def main(argv: list[str]) -> None:
    """``argv``: PARENT_PID MODULE [ARGS...]."""
    if len(argv) < 2 or not argv[0].isdigit():
        raise SystemExit("usage: guard PARENT_PID MODULE [ARGS...]")
    parent = int(argv[0])
    if os.getppid() != parent:  # it died while we were starting
        os._exit(3)
    watch_parent(parent)
    os.register_at_fork(after_in_child=_watch_in_forked_child)
    limit = os.environ.get(MAX_MESSAGE_ENV, "")
    if limit.isdigit():
        cap_zmq_messages(int(limit))
    if os.environ.get(IPC_ENV):
        bind_ipc_where_peers_connect()
    if os.environ.get(RELAY_ENV):
        start_relay(os.environ[RELAY_ENV], os.environ[RELAY_SOCKETS_ENV],
                    os.environ[RELAY_KEY_ENV], os.environ[RELAY_FILE_ENV])
    sys.argv = [argv[1], *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
