"""Fault tier: real processes starved of the GIL, stopped and killed.

Busy is not dead: a GIL hold (a C call that never lets go, as
``ctypes.PyDLL`` makes one) of 10 s on the driver or of 35 s on a worker
(longer than the 30 s that silence was once allowed: by default, on Linux, a
member whose kernel acknowledges its connection is never dropped for
silence), or a 10 s SIGSTOP of a worker or of the coordinator, loses no
member and no call, also when they overlap (the driver's hold and the other
worker's stop both happen while the worker holds its GIL). Dead is noticed
fast: a SIGKILLed worker's calls fail within 2.5 s.

The test process is one member of each group (the driver, or a plain member
when the coordinator is the process being stopped); the others are
subprocesses that block in ``rpc.shutdown()`` until the test's own shutdown.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time

import pytest
from conftest import free_ports, poll_or_fail
from fault_util import assert_healthy, finish, health, join, pid, spawn
from targets import add, sleep_then

from nbrpc import rpc
from nbrpc.errors import WorkerGoneError

pytestmark = [pytest.mark.faults, pytest.mark.multiprocess]

HOLD_S = 10
LONG_HOLD_S = 35  # a worker busy for longer than any silence rule's old default
DEATH_BOUND_S = 2.5
def hold_gil(seconds: int) -> int:
    """Sleep in C with the GIL held: no other thread of this process runs."""
    ctypes.PyDLL(None).sleep(int(seconds))
    return os.getpid()


def test_gil_holds_and_sigstop_lose_nobody_and_sigkill_is_noticed_fast() -> None:
    (port,) = free_ports(1)
    procs = [spawn(f"worker{r}", r, 3, port) for r in (1, 2)]
    killed: tuple = ()
    try:
        join("driver", 0, 3, port)
        names = ["driver", "worker1", "worker2"]
        pids = {n: rpc.rpc_sync(n, pid) for n in names[1:]}

        # 1. worker1 holds its GIL for 35 s; the other two faults happen meanwhile
        t0 = time.monotonic()
        held = rpc.rpc_async("worker1", hold_gil, args=(LONG_HOLD_S,), timeout=90)
        time.sleep(0.5)
        queued = rpc.rpc_async("worker1", add, args=(20, 22), timeout=90)
        for i in range(5):  # calls to it wait, calls elsewhere flow
            assert rpc.rpc_sync("worker2", add, args=(i, 1), timeout=10) == i + 1
            time.sleep(1)

        # 2. the driver (the coordinator) holds its GIL for 10 s
        t1 = time.monotonic()
        hold_gil(HOLD_S)
        assert time.monotonic() - t1 >= HOLD_S - 0.5
        time.sleep(1.5)  # a round of heartbeats
        assert_healthy(["driver", "worker2"], 3)  # worker1 still holds its GIL

        # 3. worker2 is stopped for 10 s: only the driver runs Python
        os.kill(pids["worker2"], signal.SIGSTOP)
        try:
            during = rpc.rpc_async("worker2", add, args=(1, 2), timeout=60)
            time.sleep(HOLD_S)
        finally:
            os.kill(pids["worker2"], signal.SIGCONT)
        assert during.wait() == 3
        assert time.monotonic() - t0 < LONG_HOLD_S, "the faults did not overlap: lengthen the hold"
        assert not held.done()
        assert held.wait() == pids["worker1"] and queued.wait() == 42
        time.sleep(1.5)
        assert_healthy(names, 3)

        # 4. a worker is killed during calls: they fail within the bound
        calls = [rpc.rpc_async("worker2", sleep_then, args=(30, i), timeout=60) for i in range(4)]
        time.sleep(0.3)
        os.kill(pids["worker2"], signal.SIGKILL)
        killed = (procs[1],)
        t0 = time.monotonic()
        for fut in calls:
            with pytest.raises(WorkerGoneError, match="worker2"):
                fut.wait()
        noticed = time.monotonic() - t0
        print(f"\nSIGKILL noticed in {noticed:.2f} s")
        assert noticed < DEATH_BOUND_S
        assert rpc.rpc_sync("worker1", add, args=(1, 1), timeout=10) == 2
        poll_or_fail(lambda: rpc.rpc_sync("worker1", health)[0] == [0, 1], 5,
                     "worker1 to hear that worker2 died")
    finally:
        finish(procs, killed)


def test_a_stopped_coordinator_loses_nobody() -> None:
    (port,) = free_ports(1)
    procs = [spawn("master", 0, 3, port), spawn("worker2", 2, 3, port)]
    try:
        join("worker1", 1, 3, port)
        names = ["master", "worker1", "worker2"]
        master = rpc.rpc_sync("master", pid)
        os.kill(master, signal.SIGSTOP)
        try:
            during = rpc.rpc_async("master", add, args=(2, 3), timeout=60)
            for i in range(5):  # peers still talk to each other directly
                assert rpc.rpc_sync("worker2", add, args=(i, 1), timeout=10) == i + 1
                time.sleep(HOLD_S / 5)
        finally:
            os.kill(master, signal.SIGCONT)
        assert during.wait() == 5
        time.sleep(1.5)
        assert_healthy(names, 3)
    finally:
        finish(procs)
