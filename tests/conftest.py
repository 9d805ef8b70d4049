"""Shared fixtures: an in-process group of agents that starts in milliseconds."""

from __future__ import annotations

import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from nbrpc.agent import Agent, AgentOptions, set_default_agent
from nbrpc.transport import new_key

pytest_plugins = ["rerun_report"]  # the first failure of a test that passed on its rerun


@contextmanager
def local_group(names: list[str], threads: int = 4, rpc_timeout: float = 10.0,
                dynamic: bool = False, per_rank: dict[int, dict] | None = None,
                key: bytes | None = None, shutdown_errors: list | None = None,
                **options) -> Iterator[list[Agent]]:
    """Agents ``names`` (rank = position) in this process, joined as one group;
    ``options`` are more :class:`AgentOptions` fields, ``per_rank`` more for some ranks.
    ``key``: the group key (a fresh one by default); ``shutdown_errors``: where
    what each agent's graceful shutdown raised goes (else it is only logged)."""
    key = key or new_key()
    opts = lambda r: AgentOptions(num_worker_threads=threads, rpc_timeout=rpc_timeout,  # noqa: E731
                                  **{**options, **(per_rank or {}).get(r, {})})
    ws = None if dynamic else len(names)
    agents = [Agent(n, r, key, world_size=ws, options=opts(r)) for r, n in enumerate(names)]
    coordinator = agents[0].address
    starters = [threading.Thread(target=a.start, args=(None if a.rank == 0 else coordinator, 10))
                for a in agents]
    for t in starters:
        t.start()
    for t in starters:
        t.join(15)
    assert all(a.state == "ready" for a in agents), [a.state for a in agents]
    if dynamic:  # a joiner is ready once it has joined; earlier members learn of it later
        everyone = set(names)
        assert poll_for(lambda: all(everyone <= set(a.members.by_name) for a in agents),
                        timeout=10), [sorted(a.members.by_name) for a in agents]
    try:
        yield agents
    finally:
        def stop(agent: Agent) -> None:
            try:
                agent.shutdown(timeout=10)
            except Exception as e:
                if shutdown_errors is None:
                    raise
                shutdown_errors.append(e)

        stoppers = [threading.Thread(target=stop, args=(a,)) for a in agents]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join(20)


def local_user(name: str) -> tuple[int, int]:
    """(uid, gid) of a second local user ``name``, made here as a system user with no
    home and no shell the first time (left in place); skips without root, setpriv
    or useradd. Run code as it with ``setpriv --reuid=UID --regid=GID --clear-groups``."""
    import pwd
    import shutil
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("needs root, to create a second local user and run code as it")
    if not (shutil.which("setpriv") and shutil.which("useradd")):
        pytest.skip("needs setpriv and useradd (util-linux, passwd)")
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell",
                        "/usr/sbin/nologin", name], capture_output=True)
        pw = pwd.getpwnam(name)  # (a concurrent run may have made it: fine)
    return pw.pw_uid, pw.pw_gid


def python_as(uid: int, gid: int, needs: str = "pass", env: dict[str, str] | None = None
              ) -> tuple[str | None, list[str]]:
    """The first Python that user (``uid``, ``gid``) may run ``needs`` with:
    this environment's, else Debian's (another user may not start an
    interpreter installed under /root, such as pyenv's with a shared
    libpython). None if neither, and why each failed."""
    import subprocess
    import sys

    why = []
    for python in (sys.executable, "/usr/bin/python3"):
        probe = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                                python, "-c", needs],
                               env=env, cwd="/", capture_output=True, text=True, timeout=30)
        if probe.returncode == 0:
            return python, why
        why.append(f"{python}: {probe.stderr.strip()[-200:]}")
    return None, why


def small_rref_graph(type_name: str, nbytes: int) -> dict:
    """``debug.rref_graph()``'s plain data for a small group: one value (of
    ``type_name``, ``nbytes``) owned by worker1 and held by the driver, and a
    driver's fork of a value whose owner, worker2, is no longer listed."""
    return {"workers": ["driver", "worker1"], "pending": [], "edges": [], "users": [
        {"rref_id": "1:1", "fork_id": "0:2", "owner": "worker1", "parent": None,
         "state": "confirmed", "site": "x.py:3", "worker": "driver"},
        {"rref_id": "2:1", "fork_id": "0:3", "owner": "worker2", "parent": None,
         "state": "confirmed", "site": "x.py:4", "worker": "driver"}],
        "values": {"1:1": {"owner": "worker1", "state": "ready", "type": type_name,
                           "nbytes": nbytes, "site": "x.py:3", "age": 1.0, "owner_refs": 0,
                           "users": {"0:2": "driver"}}}}


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_ports(n: int) -> list[int]:
    """``n`` distinct loopback ports free at the time of the call, below the
    kernel's ephemeral range: between this call and the bind that uses one, no
    outgoing connection can be given it as its own port. (A port the kernel
    handed out, ``bind(0)``, once failed a world's rank 0 with "Address already
    in use": its peers, dialling it before it listened, may get that very port
    for a connection of theirs, and a TCP connection to itself then holds it.)"""
    rng = random.Random()
    low = _ephemeral_low()
    socks: list[socket.socket] = []
    try:
        for _ in range(50 * n if low > 20000 else 0):  # (bounded: else bind(0) below)
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", rng.randrange(20000, low)))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:  # none free there: any port the kernel gives
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def poll_or_fail(pred: Callable[[], Any], timeout: float, what: Any,
                 interval: float = 0.02, error: type[Exception] = AssertionError) -> Any:
    """Wait for ``pred()`` to be true and return it; on timeout fail, saying what
    was awaited (``what``, or ``what()`` for an explanation computed then)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            why = what() if callable(what) else what
            raise error(f"timed out after {timeout} s waiting for {why}")
        time.sleep(interval)


class _TimedOut(Exception):
    pass


def poll_for(condition: Callable[[], bool], timeout: float = 5.0, interval: float = 0.005) -> bool:
    """Wait until ``condition()`` is true; False if ``timeout`` passes first
    (:func:`poll_or_fail`'s wait, for a test that asserts on the answer)."""
    try:
        poll_or_fail(condition, timeout, None, interval, _TimedOut)
    except _TimedOut:
        return False
    return True


@contextmanager
def intruder(address: str, key: bytes | None = None) -> Iterator[Any]:
    """A raw DEALER connected to an agent, as an attacker would open one. With
    ``key``, it presents the group's connection token (as a peer that sniffed
    it off a network could): it gets in, but can still sign nothing."""
    import zmq

    from nbrpc.transport.io import connect_token

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    if key is not None:
        sock.setsockopt(zmq.PLAIN_USERNAME, b"nbrpc")
        sock.setsockopt(zmq.PLAIN_PASSWORD, connect_token(key))
    sock.connect(address)
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()


@pytest.fixture
def trio() -> Iterator[list[Agent]]:
    with local_group(["a", "b", "c"]) as agents:
        yield agents


@pytest.fixture
def trio_default() -> Iterator[list[Agent]]:
    """``trio`` with ``a`` as the process's default agent (what init_rpc makes it)."""
    with local_group(["a", "b", "c"]) as agents:
        set_default_agent(agents[0])
        try:
            yield agents
        finally:
            set_default_agent(None)


@pytest.fixture(autouse=True)
def no_thread_leak() -> Iterator[None]:
    """Every test must leave no nbrpc thread behind."""
    yield
    assert poll_for(lambda: not [t for t in threading.enumerate() if t.name.startswith("nbrpc")],
                    timeout=5), [t.name for t in threading.enumerate()]
