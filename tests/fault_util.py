"""Shared by the fault tiers: a script-mode group of real processes, and a GIL meter.

The test process joins the group itself (``join``); the other members are
subprocesses (``spawn``) that block in ``rpc.shutdown()`` until the test's own
shutdown (``finish``). Functions here run remotely too: the subprocesses have
this directory on their path, so they are pickled by reference.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from nbrpc import rpc
from nbrpc.agent import current_agent

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
MEMBER = """
import sys
from nbrpc import rpc
name, rank, world, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=120,
                                       num_worker_threads=4)
rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)
rpc.shutdown(timeout=300)
"""


def spawn(name: str, rank: int, world: int, port: int) -> subprocess.Popen:
    """A member in a subprocess, joining ``tcp://127.0.0.1:port``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    return subprocess.Popen([sys.executable, "-c", MEMBER, name, str(rank), str(world),
                             str(port)], env=env)


def join(name: str, rank: int, world: int, port: int) -> None:
    """This process joins the same group, with the members' options."""
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}",
                                           rpc_timeout=120, num_worker_threads=4)
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)


def finish(procs: list[subprocess.Popen], killed: tuple = ()) -> None:
    """Shut this member down (which releases the others), then reap the
    subprocesses (bounded); each that was not ``killed`` must exit 0."""
    try:
        rpc.shutdown(timeout=60)
    finally:
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)
    for p in procs:
        if p not in killed:
            assert p.returncode == 0, p.args


# -- run remotely ------------------------------------------------------------------------
def pid() -> int:
    return os.getpid()


def health() -> tuple[list[int], int, int]:
    """(member ranks, times this agent took someone back, deaths it saw)."""
    agent = current_agent()
    deaths = sum(e["event"] == "member-dead" for e in agent.events.records(None))
    return agent.member_ranks(), agent.readmitted, deaths


class GilTicker:
    """A thread that wakes every 5 ms; ``gap`` is the longest it could not run
    (how long something held the GIL). Start/stop, or use it as a context."""

    def __init__(self) -> None:
        self.gap = 0.0
        self._stop = threading.Event()
        self._running = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-ticker", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        last = time.perf_counter()
        self._running.set()
        while not self._stop.wait(0.005):
            now = time.perf_counter()
            self.gap, last = max(self.gap, now - last), now

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(5)
        return self.gap

    def __enter__(self) -> GilTicker:
        assert self._running.wait(5), "the GIL ticker thread did not start"
        return self  # running: its first wake-up is measured from its start

    def __exit__(self, *exc: object) -> None:
        self.stop()


def assert_healthy(names: list[str], world: int) -> None:
    """Every member named sees the whole group, and none ever saw a death or
    took anyone back (nobody was wrongly declared dead)."""
    for name in names:
        ranks, readmitted, deaths = rpc.rpc_sync(name, health, timeout=30)
        assert ranks == list(range(world)) and readmitted == 0 and deaths == 0, (
            name, ranks, readmitted, deaths)
