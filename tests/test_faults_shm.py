"""Fault tier for shared memory: huge tensors, a tiny /dev/shm, a killed holder.

* 2 GB float32 tensors go to a worker process and come back three times;
  both processes keep their GIL free enough that nobody is declared dead.
* With /dev/shm a 64 MB tmpfs (Docker's default; made in a private mount
  namespace) a 256 MB tensor goes both ways by socket instead: no SIGBUS,
  every exit code 0, no segment left in that tmpfs.
* A SIGKILLed worker's segments are swept by the survivor as soon as it
  notices the death (the killed child is still an unreaped zombie then).
* A 256 MB segment is reused by the very next write after its receiver drops
  the tensor (counted, not timed), and a worker's idle segments go back to
  the system without its transport stopping.

The test process is the driver (rank 0, the coordinator); workers are
subprocesses that block in ``rpc.shutdown()`` until the driver's own.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import free_ports, poll_or_fail
from fault_util import ROOT, TESTS, GilTicker, assert_healthy, finish, join, pid, spawn

from nbrpc import rpc
from nbrpc.agent import current_agent
from nbrpc.transport import shm

pytestmark = [pytest.mark.faults, pytest.mark.multiprocess,
              pytest.mark.skipif(not shm.available(), reason="no /dev/shm")]

SWEEP_BOUND_S = 2.0


# -- run remotely (module level: the workers import this file) ----------------------
_ticker: GilTicker | None = None


def start_ticker() -> None:
    global _ticker
    _ticker = GilTicker()


def stop_ticker() -> float:
    assert _ticker is not None
    return _ticker.stop()


def echo(t: torch.Tensor) -> torch.Tensor:
    """Return the received tensor itself (it goes back through a new segment)."""
    return t


def make(nbytes: int, value: float) -> torch.Tensor:
    return torch.full((nbytes // 4,), value)


def shm_stats() -> tuple[int, int]:
    """(segments created, segments reused) by this process's writer."""
    w = current_agent().io._shm
    return (w.created, w.reused) if w is not None else (0, 0)


_kept: list = []


def keep(t: torch.Tensor) -> None:
    """Hold on to a received tensor (and so to its segment) until ``drop``."""
    _kept.append(t)


def drop() -> None:
    _kept.clear()


def retain_for(idle_s: float, every_s: float) -> None:
    """Have this process's writer give back segments idle for ``idle_s``."""
    shm.KEEP_IDLE_S, shm.TRIM_EVERY_S = idle_s, every_s


# -- helpers --------------------------------------------------------------------------
def _segments_of(pid_: int) -> list[str]:
    """The segment files of process ``pid_``, in its directories in /dev/shm."""
    found = []
    for entry in os.listdir(shm.SHM_DIR):
        path = os.path.join(shm.SHM_DIR, entry)
        if entry.startswith(f"nbrpc-{pid_}-"):
            try:
                found += [f"{entry}/{f}" for f in os.listdir(path)]
            except NotADirectoryError:
                found.append(entry)
            except FileNotFoundError:
                pass
    return found


# -- a. 2 GB round trips ----------------------------------------------------------------
def test_2gb_round_trips_lose_nobody() -> None:
    (port,) = free_ports(1)
    procs = [spawn("worker1", 1, 2, port)]
    try:
        join("driver", 0, 2, port)
        rpc.rpc_sync("worker1", start_ticker)
        ticker = GilTicker()
        x = torch.arange(1 << 29, dtype=torch.float32)  # 2 GiB
        took = []
        for i in range(2):  # the second round reuses the first's segments
            samples, total = x[:: 1 << 20].clone(), x.sum()
            t0 = time.monotonic()
            y = rpc.rpc_sync("worker1", echo, args=(x,), timeout=120)
            took.append(time.monotonic() - t0)
            assert y.shape == x.shape and y.data_ptr() != x.data_ptr()
            assert torch.equal(y[:: 1 << 20], samples), f"round {i}"
            assert y.sum() == total and torch.equal(y, x), f"round {i}"
            del y  # its segment goes back to the worker for the next round
            x.add_(1)
        driver_gap, worker_gap = ticker.stop(), rpc.rpc_sync("worker1", stop_ticker)
        created, reused = rpc.rpc_sync("worker1", shm_stats)
        print(f"\n2 GiB round trips: {', '.join(f'{s:.2f}' for s in took)} s; longest GIL "
              f"wait: driver {driver_gap:.3f} s, worker {worker_gap:.3f} s; worker's "
              f"segments: {created} created, {reused} reused")
        assert_healthy(["driver", "worker1"], 2)
        assert driver_gap < 0.5 and worker_gap < 0.5
        assert reused >= 1  # later rounds copy into the pages of the first
    finally:
        finish(procs)


# -- b. /dev/shm of 64 MB ------------------------------------------------------------
SMALL_SHM_DRIVER = """
import json, os, sys
sys.path[:0] = [sys.argv[2], sys.argv[3]]
import torch
from nbrpc import rpc
from fault_util import health, join, spawn
from test_faults_shm import echo, make, shm_stats
port = int(sys.argv[1])
worker = spawn("worker1", 1, 2, port)
join("driver", 0, 2, port)
out = {}
x = torch.arange(64 << 20, dtype=torch.float32)  # 256 MiB: larger than all of /dev/shm
y = rpc.rpc_sync("worker1", echo, args=(x,), timeout=60)
out["there_and_back"] = bool(torch.equal(x, y))
z = rpc.rpc_sync("worker1", make, args=(256 << 20, 2.5), timeout=60)
out["back"] = bool(z.shape == x.shape and z.eq(2.5).all())
small = torch.ones(2 << 20)  # 8 MiB still fits: shared memory serves it
out["small"] = bool(torch.equal(rpc.rpc_sync("worker1", echo, args=(small,)), small))
out["stats"] = [rpc.rpc_sync(n, shm_stats) for n in ("driver", "worker1")]
out["health"] = [rpc.rpc_sync(n, health) for n in ("driver", "worker1")]
del y, z
rpc.shutdown(timeout=60)
out["worker_rc"] = worker.wait(60)
out["left"] = sorted(os.listdir("/dev/shm"))
print("RESULT", json.dumps(out), flush=True)
"""


def test_a_64mb_dev_shm_sends_256mb_by_socket_and_nobody_dies() -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs on /dev/shm in a mount namespace needs root")
    (port,) = free_ports(1)
    script = ('mount -t tmpfs -o size=64m tmpfs /dev/shm || { echo NOMOUNT; exit 77; }; '
              'exec "$0" -c "$1" "$2" "$3" "$4"')
    try:
        out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                              sys.executable, SMALL_SHM_DRIVER, str(port), str(TESTS),
                              str(ROOT)], capture_output=True, text=True, timeout=80, cwd=ROOT)
    except FileNotFoundError:
        pytest.skip("no unshare(1)")
    if out.returncode == 77 or "unshare failed" in out.stderr:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace: {out.stderr.strip()}")
    # a segment only ftruncated (sparse) would die here of SIGBUS (exit -7), copying
    # past the 64 MB of the tmpfs; posix_fallocate makes it ENOSPC, sent by socket
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr[-3000:]}"
    line = next(s for s in out.stdout.splitlines() if s.startswith("RESULT "))
    res = json.loads(line.removeprefix("RESULT "))
    assert res["there_and_back"] and res["back"] and res["small"], res
    assert res["health"] == [[[0, 1], 0, 0]] * 2, res
    assert res["stats"][0][0] >= 1, res  # the 8 MiB buffer did use shared memory
    assert res["worker_rc"] == 0 and res["left"] == [], res
    assert "--shm-size" in out.stderr  # the warning says what to do


# -- c. SIGKILL of a process holding segments -----------------------------------------
def test_a_killed_workers_segments_are_swept_when_its_death_is_noticed() -> None:
    (port,) = free_ports(1)
    procs = [spawn("worker1", 1, 2, port)]
    killed: tuple = ()
    try:
        join("driver", 0, 2, port)
        wpid = rpc.rpc_sync("worker1", pid)
        held = rpc.rpc_sync("worker1", make, args=(16 << 20, 1.0))  # its segment, mapped here
        freed = rpc.rpc_sync("worker1", make, args=(8 << 20, 2.0))
        del freed  # that one is renamed to .free, waiting for worker1 to reuse it
        assert len(poll_or_fail(lambda: _segments_of(wpid), 5, "worker1's segments")) >= 2
        os.kill(wpid, signal.SIGKILL)
        killed = (procs[0],)
        t0 = time.monotonic()
        # not reaped: until finish(), worker1 is a zombie that still answers kill(pid, 0)
        poll_or_fail(lambda: not current_agent().is_member(1), 30, "the death of worker1")
        noticed = time.monotonic() - t0
        poll_or_fail(lambda: not _segments_of(wpid), SWEEP_BOUND_S,
                     lambda: f"the sweep of {_segments_of(wpid)} (death noticed after "
                             f"{noticed:.1f} s; is shm.sweep_orphans() called on it?)")
        swept = time.monotonic() - t0 - noticed
        print(f"\nSIGKILL noticed in {noticed:.2f} s, segments gone {swept:.2f} s later")
        assert held.eq(1.0).all()  # a swept segment's map stays valid
    finally:
        finish(procs, killed)


# -- d. reuse right after a drop, and idle segments given back --------------------------
def test_a_256mb_segment_is_reused_as_soon_as_its_receiver_drops_it() -> None:
    (port,) = free_ports(1)
    procs = [spawn("worker1", 1, 2, port)]
    try:
        join("driver", 0, 2, port)
        x = torch.arange(64 << 20, dtype=torch.float32)  # 256 MiB
        took = []
        for _ in range(3):
            t0 = time.monotonic()
            rpc.rpc_sync("worker1", keep, args=(x,), timeout=60)
            took.append(time.monotonic() - t0)
            rpc.rpc_sync("worker1", drop)  # handed back before this answer leaves worker1
        created, reused = shm_stats()
        print(f"\n256 MiB to a worker that keeps it, then drops it: "
              f"{', '.join(f'{s:.3f}' for s in took)} s; driver's segments: {created} "
              f"created, {reused} reused")
        assert (created, reused) == (1, 2)  # one segment: its pages written, never re-made
        for _ in range(3):  # echoed: the worker answers before it lets go of the request
            y = rpc.rpc_sync("worker1", echo, args=(x,), timeout=60)
            assert torch.equal(y[:: 1 << 20], x[:: 1 << 20])
            del y
        created, reused = shm_stats()
        w_created, w_reused = rpc.rpc_sync("worker1", shm_stats)
        print(f"after 3 echoes: driver {created} created, {reused} reused; "
              f"worker {w_created} created, {w_reused} reused")
        assert (w_created, w_reused) == (1, 2)
        assert created == 1 and reused == 5
    finally:
        finish(procs)


def test_an_idle_workers_segments_go_back_before_it_stops() -> None:
    (port,) = free_ports(1)
    procs = [spawn("worker1", 1, 2, port)]
    try:
        join("driver", 0, 2, port)
        wpid = rpc.rpc_sync("worker1", pid)
        rpc.rpc_sync("worker1", retain_for, args=(0.3, 0.1))
        z = rpc.rpc_sync("worker1", make, args=(8 << 20, 1.0))
        assert len(_segments_of(wpid)) == 1
        del z  # free now: kept for reuse while worker1 keeps writing, not for ever
        t0 = time.monotonic()
        poll_or_fail(lambda: not _segments_of(wpid), 10,
                     lambda: f"worker1's idle segments {_segments_of(wpid)} to go")
        print(f"\nan idle 8 MiB segment went back {time.monotonic() - t0:.2f} s after its drop")
        assert rpc.rpc_sync("worker1", make, args=(8 << 20, 2.0)).eq(2.0).all()  # still works
    finally:
        finish(procs)
