"""Plumbing around ipyparallel for :class:`~nbrpc.cluster.Cluster`: the loop
thread its coroutines run on, which host an ssh launcher gives each worker,
this host's routable address, and killing what we started.
"""

from __future__ import annotations

import concurrent.futures
import signal
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from typing import Any

from ..errors import NbrpcError


class ClusterError(NbrpcError):
    """A cluster operation failed (an engine did not start, a name is unknown, ...)."""


class LoopThread:
    """A private tornado/asyncio loop thread for ipyparallel's coroutines (stopped with us)."""

    def __init__(self) -> None:
        from tornado.ioloop import IOLoop

        self.loop: Any = None
        started = threading.Event()

        def main() -> None:
            self.loop = IOLoop(make_current=False)
            self.loop.add_callback(started.set)
            self.loop.start()
            self.loop.close(all_fds=False)

        self.thread = threading.Thread(target=main, name="nbrpc-cluster-loop", daemon=True)
        self.thread.start()
        if not started.wait(10):
            raise ClusterError("the cluster's event loop thread did not start")

    def run(self, fn: Callable[..., Coroutine], *args: Any, timeout: float = 60.0,
            **kwargs: Any) -> Any:
        """Run ``await fn(*args, **kwargs)`` on the loop; wait (bounded, interruptibly)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        async def call() -> None:
            try:
                fut.set_result(await fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)

        self.loop.add_callback(call)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return fut.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{getattr(fn, '__name__', fn)} did not finish "
                                       f"within {timeout:g} s") from None

    def stop(self, timeout: float = 5.0) -> None:
        if self.loop is not None and self.thread.is_alive():
            self.loop.add_callback(self.loop.stop)
            self.thread.join(timeout)


def kill_family(procs: list[Any]) -> None:
    """SIGKILL the processes we started that are still alive, and their children
    (the controller's heart monitor), collected first: once a parent dies they
    are re-parented. ``psutil.Process`` checks the creation time too, so a
    recycled pid is never hit."""
    import psutil

    family: list[Any] = []
    for p in procs:
        try:
            if p.is_running():
                family += p.children(recursive=True)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
        family.append(p)
    for p in family:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                p.send_signal(signal.SIGKILL)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass


def host_for_rank(engines: dict[str, Any], rank: int) -> dict[str, Any]:
    """An ssh ``engines`` option ({host: count} or {host: {"n": count, ...}}) narrowed
    to worker ``rank``'s host, the rank-th slot round robin: each worker is an
    engine set of one, and ipyparallel would otherwise always take the first host.

    >>> [host_for_rank({"a": 2, "b": {"n": 1, "ssh_args": []}}, r) for r in (1, 2, 3, 4)]
    [{'a': 1}, {'a': 1}, {'b': {'n': 1, 'ssh_args': []}}, {'a': 1}]
    """
    slots: list[str] = []
    for host, spec in engines.items():
        slots += [host] * int(spec.get("n", 1) if isinstance(spec, dict) else spec)
    if not slots:
        raise ClusterError(f"launcher option engines={engines!r} names no engine slots")
    host = slots[(rank - 1) % len(slots)]
    spec = engines[host]
    return {host: {**spec, "n": 1} if isinstance(spec, dict) else 1}


def routable_ip() -> str:
    """This host's address that other hosts can reach (for non-local launchers)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 9))  # no packet is sent
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())
