"""RRef fork/delete protocol with real processes (script mode).

Three worlds, each one ``torch.multiprocessing.spawn(_child, nprocs=3, join=False)``
whose processes call ``rpc.init_rpc(name, rank=rank, world_size=3)`` (env://, with
MASTER_ADDR/MASTER_PORT from a free port the parent chose) and ``rpc.shutdown()``,
as in PyTorch's tutorials (see ``test_script_mode.py``, whose patterns this file
copies). The parent joins the processes one by one (``spawn``'s own join would
terminate the survivors as soon as one process is killed), draining a
``multiprocessing`` queue that carries every result row back.

=============  ==========================================================================
world/phase    what it checks
=============  ==========================================================================
life/cycles    150 create/fork/delete cycles (50 per rank, run concurrently), roles and
               directions rotated; then every owner table, user table and child table is
               empty and each process's ``__del__`` count equals the values it owned
life/inflight  each rank makes 50 RRefs on the next rank and drops them right before a
               graceful ``rpc.shutdown()``: every owner freed exactly 50 values
life/large     20 tensors of 4 MB owned by rank 1, made by rank 0: freed, RSS drops
owner_dies     rank 0 SIGKILLs rank 2, the owner of RRefs it and rank 1 use: to_here()
               and proxy calls (sent before the death is known, or after; one waits for
               a value that never exists) fail with WorkerGoneError in seconds, and the
               RRefs are freed once dropped; 0 <-> 1 keeps working, shuts down gracefully
user_dies      rank 0 SIGKILLs rank 1, which holds forks of three values owned by rank 0
               (owner→user, user→user, its own remote()): rank 0 frees them in seconds;
               0 and 2 shut down gracefully
=============  ==========================================================================

Values are ``Tracked`` objects (module level, so every process imports the class):
``__init__`` counts values made in this process, ``__del__`` counts originals freed
(copies made by ``to_here()`` are not counted). Results are rows put on the queue
(``<init>``, ``<body>``, ``<shutdown>``, ``<after>`` per phase and rank); the tests
read them. A watchdog (``faulthandler.dump_traceback_later(exit=True)``) bounds every
phase of every child, every barrier and poll has a deadline, and the parent kills
(by pid) any process still alive after ``WORLD_TIMEOUT_S``.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import poll_or_fail
from targets import whoami
from worlds import World, await_death, child, outcome, run_world, world_cache

import nbrpc.debug
from nbrpc import rpc
from nbrpc.agent import current_agent
from nbrpc.errors import WorkerGoneError
from nbrpc.rpc import RRef

pytestmark = pytest.mark.multiprocess

WORLD = 3
NAMES = ["master", "worker1", "worker2"]
RPC_TIMEOUT_S = 20.0  # every call, join and graceful shutdown is bounded by this
PHASE_WATCHDOG_S = 40.0  # a child stuck this long in one phase dumps its threads and exits
WAIT_S = 20.0  # barriers and events between ranks
WORLD_TIMEOUT_S = 90.0  # the parent kills what is still alive after this
CYCLES_PER_RANK = 50  # 150 cycles in all
DEATH_DETECTED_S = 6.0  # from SIGKILL to WorkerGoneError (failure_timeout is 2 s)


# -- values, counted per process --------------------------------------------------------
_COUNTS = {"created": 0, "deleted": 0}
_COUNT_LOCK = threading.Lock()


class Tracked:
    """A value whose freeing is visible: ``__del__`` counts originals only."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.original = True
        with _COUNT_LOCK:
            _COUNTS["created"] += 1

    def get(self) -> str:
        return self.tag

    def __getstate__(self) -> dict:  # a copy (to_here) is not an original
        return {**self.__dict__, "original": False}

    def __del__(self) -> None:
        if self.__dict__.get("original"):
            with _COUNT_LOCK:
                _COUNTS["deleted"] += 1


def _counts() -> dict:
    with _COUNT_LOCK:
        return dict(_COUNTS)


def _reset_counts() -> None:
    with _COUNT_LOCK:
        _COUNTS.update(created=0, deleted=0)


# -- functions run remotely ---------------------------------------------------------
_KEPT: list = []  # RRefs a worker was asked to hold


def _call_back(to: str) -> str:
    """Runs on one worker, calls ``to``: checks the callee -> caller direction."""
    return rpc.rpc_sync(to, whoami, timeout=10)


def _fetch_tag(rref: RRef) -> str:
    """A user copy: to_here()."""
    assert not rref.is_owner()
    return rref.to_here(timeout=RPC_TIMEOUT_S).tag


def _proxy_tag(rref: RRef) -> str:
    """A user copy: a proxy call on the owner's value."""
    assert not rref.is_owner()
    return rref.rpc_sync(timeout=RPC_TIMEOUT_S).get()


def _home_tag(rref: RRef) -> tuple[bool, str]:
    """The RRef came home (user → owner): an owner RRef, the original value."""
    value = rref.local_value()
    return rref.is_owner(), value.tag if value.original else "a copy!"


def _make_owned(tag: str) -> RRef:
    """Runs on the owner: RRef(obj), returned to the caller (owner → user)."""
    return RRef(Tracked(tag))


def _keep(rref: RRef) -> str:
    _KEPT.append(rref)
    return rref.to_here(timeout=RPC_TIMEOUT_S).tag


def _remote_and_keep(owner: str, tag: str) -> str:
    """A user RRef made here by remote(), kept."""
    rref = rpc.remote(owner, Tracked, args=(tag,))
    return _keep(rref)


def _remote_and_fork(owner: str, to: str, tag: str) -> str:
    """remote() here, fork to ``to`` (which keeps it), then drop ours (user → user)."""
    rref = rpc.remote(owner, Tracked, args=(tag,))
    return rpc.rpc_sync(to, _keep, args=(rref,), timeout=RPC_TIMEOUT_S)


def _pid() -> int:
    return os.getpid()


def _rrefs_here() -> dict:
    return nbrpc.debug.snapshot(events=0)["rrefs"]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _malloc_trim() -> bool:
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0))
    except OSError:
        return False




def _nothing_alive(expected_owned: int | None = None) -> Callable[[], bool]:
    """This worker holds no RRef of any kind, and (if given) freed exactly
    ``expected_owned`` values it made."""
    ctx = current_agent().ext["rref"]

    def check() -> bool:
        st = ctx.state
        if st.owned or st.users or st.children or len(ctx.live):
            return False
        c = _counts()
        return expected_owned is None or c["created"] == c["deleted"] == expected_owned

    return check


def _explain() -> dict:
    ctx = current_agent().ext["rref"]
    snap = _rrefs_here()
    return {"counts": _counts(), "live_rrefs": [repr(r) for r in list(ctx.live)][:10],
            "owned": snap["owned"][:5], "users": snap["users"][:5],
            "children": snap["children"][:5], "counters": snap["counters"]}


# -- world "life": cycles, in-flight deletes, large values --------------------------------
CYCLE_KINDS = ("user_to_user", "user_to_owner", "owner_to_user")


def _cycle_plan(creator: int, j: int) -> tuple[int, int, str, bool]:
    """Cycle ``j`` of rank ``creator``: (owner, third, kind, drop_early).
    Owners alternate between the two other ranks, kinds rotate, and every
    other block of six the creator drops its RRef while the fork is in flight."""
    owner = (creator + 1 + j % 2) % WORLD
    third = 3 - creator - owner
    kind = CYCLE_KINDS[(j // 2) % 3]
    drop_early = (j // 6) % 2 == 1
    return owner, third, kind, drop_early


def _expected_owned(rank: int) -> int:
    return sum(_cycle_plan(c, j)[0] == rank for c in range(WORLD) for j in range(CYCLES_PER_RANK))


def _one_cycle(me: int, j: int) -> None:
    owner, third, kind, drop_early = _cycle_plan(me, j)
    o, t = NAMES[owner], NAMES[third]
    tag = f"{NAMES[me]}-{j}-{kind}"
    if kind == "owner_to_user":  # the owner makes RRef(obj) and returns it
        rref = rpc.rpc_sync(o, _make_owned, args=(tag,), timeout=RPC_TIMEOUT_S)
        assert not rref.is_owner() and rref.owner_name() == o, rref
    else:
        rref = rpc.remote(o, Tracked, args=(tag,))
    if kind == "user_to_owner":  # home first, then on to the third worker
        assert rpc.rpc_sync(o, _home_tag, args=(rref,), timeout=RPC_TIMEOUT_S) == (True, tag)
    use = _proxy_tag if (j // 12) % 2 else _fetch_tag
    fut = rpc.rpc_async(t, use, args=(rref,), timeout=RPC_TIMEOUT_S)
    if drop_early:  # the parent lets go while its child fork is in flight
        del rref
        assert fut.wait() == tag
    else:
        assert fut.wait() == tag
        del rref


def _body_cycles(rank: int, sync: dict) -> dict:
    t0 = time.monotonic()
    try:
        for j in range(CYCLES_PER_RANK):
            _one_cycle(rank, j)
    finally:  # the others check their tables once every rank has stopped creating
        cycles_s = time.monotonic() - t0
        sync["barrier"].wait(WAIT_S)
    expected = _expected_owned(rank)
    t1 = time.monotonic()
    poll_or_fail(_nothing_alive(expected), 10.0, lambda: f"nothing alive: {_explain()}")
    snap = _rrefs_here()
    assert snap["owned"] == [] and snap["users"] == [] and snap["children"] == [], snap
    assert snap["counters"]["owned_deleted"] == expected, snap["counters"]
    assert snap["counters"]["outstanding"] == 0, snap["counters"]
    return {"cycles_s": round(cycles_s, 2), "drain_s": round(time.monotonic() - t1, 3),
            "owned_and_freed": expected, "counts": _counts(), "counters": snap["counters"]}


INFLIGHT = 50


def _body_inflight(rank: int, sync: dict) -> dict:
    _CTX["agent"] = current_agent()  # read again after shutdown
    other = NAMES[(rank + 1) % WORLD]
    refs = [rpc.remote(other, Tracked, args=(f"inflight-{rank}-{i}",)) for i in range(INFLIGHT)]
    del refs  # shutdown follows at once (the wrapper calls it)
    return {}


def _after_inflight(rank: int) -> dict:
    """After rpc.shutdown(): what the owner freed, read without waiting."""
    counts = _counts()
    st = _CTX.pop("agent").ext["rref"].state
    info = {"counts": counts, "state_deleted": st.deleted, "owned_left": len(st.owned),
            "users_left": len(st.users), "children_left": len(st.children)}
    assert counts["created"] == INFLIGHT, info
    assert counts["deleted"] == INFLIGHT, info
    assert st.deleted == INFLIGHT and not st.owned and not st.users and not st.children, info
    return info


N_LARGE, LARGE_NUMEL = 20, 1 << 20  # 20 tensors of 4 MiB
RSS_DROP = 60 << 20


def _await_owned_ready(n: int) -> dict:
    """On the owner: ``n`` values stored and ready; the RSS at that point."""
    st = current_agent().ext["rref"].state
    poll_or_fail(lambda: len(st.owned) == n and all(e.value.done() for e in list(st.owned.values())),
          10.0, lambda: f"{n} owned values: {_rrefs_here()['owned'][:3]}")
    owned = _rrefs_here()["owned"]
    return {"rss": _rss(), "owned_nbytes": sum(o["nbytes"] for o in owned)}


def _await_freed(peak: int) -> dict:
    """On the owner: its table empties, and its RSS drops by RSS_DROP from ``peak``
    (first without help, then with malloc_trim, which can only return memory that
    is free: values still alive keep theirs)."""
    t0 = time.monotonic()
    st = current_agent().ext["rref"].state
    poll_or_fail(lambda: not st.owned, 10.0, lambda: f"an empty owner table: {_explain()}")
    empty_s = time.monotonic() - t0
    rss_at_empty = _rss()
    trimmed = False

    def dropped() -> bool:
        nonlocal trimmed
        if peak - _rss() >= RSS_DROP:
            return True
        if time.monotonic() - t0 > 2.0:
            trimmed = _malloc_trim() or trimmed
        return peak - _rss() >= RSS_DROP

    info = {"empty_s": round(empty_s, 3), "peak": peak, "rss_at_empty": rss_at_empty}
    poll_or_fail(dropped, 8.0, lambda: f"RSS to drop by {RSS_DROP >> 20} MiB: "
                              f"{dict(info, rss_now=_rss())}")
    return dict(info, rss_final=_rss(), malloc_trim_used=trimmed,
                deleted=st.deleted, drop_mib=round((peak - _rss()) / 2**20, 1))


def _body_large(rank: int, sync: dict) -> dict:
    if rank != 0:
        return {}
    base = rpc.rpc_sync("worker1", _rss, timeout=RPC_TIMEOUT_S)
    refs = [rpc.remote("worker1", torch.zeros, args=(LARGE_NUMEL,)) for _ in range(N_LARGE)]
    for r in refs[:2]:
        t = r.to_here(timeout=RPC_TIMEOUT_S)
        assert t.shape == (LARGE_NUMEL,) and not t.any()
        del t
    peak = rpc.rpc_sync("worker1", _await_owned_ready, args=(N_LARGE,), timeout=RPC_TIMEOUT_S)
    assert peak["owned_nbytes"] == N_LARGE * LARGE_NUMEL * 4, peak
    assert peak["rss"] - base >= N_LARGE * LARGE_NUMEL * 4 * 0.9, (base, peak)  # really held
    del refs, r
    freed = rpc.rpc_sync("worker1", _await_freed, args=(peak["rss"],), timeout=RPC_TIMEOUT_S)
    assert freed["deleted"] == N_LARGE, freed
    return {"rss_base_mib": round(base / 2**20, 1), "rss_peak_mib": round(peak["rss"] / 2**20, 1),
            **freed}


# -- world "owner_dies": rank 0 kills rank 2, the owner ---------------------------------
@rpc.functions.async_execution
def _never_ready() -> torch.futures.Future:
    """A value that never exists: a to_here() of it waits until the owner dies."""
    return torch.futures.Future()


def _fetch_in_thread(rref: RRef) -> dict:
    """to_here() on a thread of its own; the returned dict gets the outcome (as
    text: the error's traceback must not outlive the thread)."""
    out: dict = {}

    def run() -> None:
        try:
            out["value"] = repr(rref.to_here(timeout=RPC_TIMEOUT_S))
        except BaseException as e:
            out["error"] = f"{type(e).__name__}: {e}"
        out["at"] = time.monotonic()

    out["thread"] = threading.Thread(target=run, name="test-fetch", daemon=True)
    out["thread"].start()
    return out


def _body_owner_dies(rank: int, sync: dict) -> dict:
    if rank == 2:
        await_death(_CTX["results"], sync["victim_ready"], WAIT_S)
    if rank == 1:
        return _owner_dies_rank1(sync)
    doomed = rpc.remote("worker2", Tracked, args=("doomed",))
    assert doomed.to_here(timeout=RPC_TIMEOUT_S).tag == "doomed"
    assert rpc.rpc_sync("worker1", _keep, args=(doomed,), timeout=RPC_TIMEOUT_S) == "doomed"
    never = rpc.remote("worker2", _never_ready)
    poll_or_fail(never.confirmed_by_owner, 5.0, "the owner to confirm the RRef to a pending value")
    waiting = _fetch_in_thread(never)  # in flight across the death, whatever the timing
    poll_or_fail(lambda: any(c["op"] == "rref_fetch" for c in nbrpc.debug.snapshot(events=0)[
        "in_flight"]), 5.0, "the fetch of the pending value to be in flight")
    pid2 = rpc.rpc_sync("worker2", _pid, timeout=RPC_TIMEOUT_S)
    sync["victim_ready"].wait(WAIT_S)  # its queue is flushed: nothing is lost with it
    t_kill = time.monotonic()
    os.kill(pid2, signal.SIGKILL)
    in_flight = doomed.rpc_async(timeout=RPC_TIMEOUT_S).get()  # sent to the dead owner
    with pytest.raises(WorkerGoneError, match="died") as ei:
        doomed.to_here(timeout=RPC_TIMEOUT_S)
    to_here_s = time.monotonic() - t_kill
    message = str(ei.value)
    del ei  # its traceback holds the RRef
    assert "worker2" in message, message
    with pytest.raises(WorkerGoneError, match="died"):
        doomed.rpc_sync(timeout=RPC_TIMEOUT_S).get()
    proxy_s = time.monotonic() - t_kill
    with pytest.raises(WorkerGoneError, match="died"):
        in_flight.wait()
    del in_flight
    waiting["thread"].join(DEATH_DETECTED_S)
    assert waiting.get("error", "").startswith("WorkerGoneError") and "died" in waiting[
        "error"], waiting
    waiting_s = waiting["at"] - t_kill
    assert max(to_here_s, proxy_s, waiting_s) < DEATH_DETECTED_S, (to_here_s, proxy_s, waiting_s)
    sync["killed"].set()
    # rank 0 <-> rank 1 keeps working, RRefs included
    assert rpc.rpc_sync("worker1", whoami, timeout=10) == "worker1"
    assert rpc.rpc_sync("worker1", _call_back, args=("master",), timeout=10) == "master"
    alive = rpc.remote("worker1", Tracked, args=("alive",))
    assert alive.to_here(timeout=10).tag == "alive" and alive.rpc_sync(timeout=10).get() == "alive"
    o2u = rpc.rpc_sync("worker1", _make_owned, args=("o2u",), timeout=10)
    assert rpc.rpc_sync("worker1", _home_tag, args=(o2u,), timeout=10) == (True, "o2u")
    del o2u
    del alive
    assert [m["name"] for m in nbrpc.debug.snapshot(events=0)["members"]] == NAMES[:2]
    assert "owner-gone" in repr(doomed) or "released" in repr(doomed), repr(doomed)
    del doomed, never, waiting
    st = current_agent().ext["rref"].state
    poll_or_fail(lambda: not st.owned and not st.users and not st.children, 5.0,
          lambda: f"empty RRef tables on master: {_explain()}")
    # the RRef objects themselves: reported, and checked by a test of their own
    try:
        poll_or_fail(_nothing_alive(), 2.0, "the RRef objects to be freed")
        live: list = []
    except AssertionError:
        live = [repr(r) for r in list(current_agent().ext["rref"].live)]
    sync["done"].wait(WAIT_S)  # rank 1's own checks
    return {"to_here_s": round(to_here_s, 2), "proxy_s": round(proxy_s, 2),
            "waiting_to_here_s": round(waiting_s, 2), "message": message, "live_rrefs": live}


def _owner_dies_rank1(sync: dict) -> dict:
    try:
        assert sync["killed"].wait(WAIT_S), "rank 0 did not kill rank 2"
        poll_or_fail(lambda: "worker2" not in [m["name"] for m in nbrpc.debug.snapshot(events=0)[
            "members"]], 5.0, "worker2 to leave rank 1's member table")
        assert len(_KEPT) == 1
        with pytest.raises(WorkerGoneError, match="'worker2' died"):
            _KEPT[0].to_here(timeout=10)
        with pytest.raises(WorkerGoneError, match="'worker2' died"):
            _KEPT[0].rpc_sync(timeout=10).get()
        _KEPT.clear()
        assert rpc.rpc_sync("master", whoami, timeout=10) == "master"
        assert rpc.rpc_sync("master", _call_back, args=("worker1",), timeout=10) == "worker1"
        r = rpc.remote("master", Tracked, args=("from1",))
        assert r.rpc_sync(timeout=10).get() == "from1"
        del r
        # "alive" and "o2u" were owned here; rank 0 dropped them
        poll_or_fail(_nothing_alive(2), 5.0, lambda: f"nothing alive on worker1: {_explain()}")
        return {"counts": _counts()}
    finally:
        sync["done"].set()


# -- world "user_dies": rank 0 kills rank 1, which holds forks of rank 0's values -----------
def _body_user_dies(rank: int, sync: dict) -> dict:
    if rank == 1:
        await_death(_CTX["results"], sync["victim_ready"], WAIT_S)
    if rank == 2:
        assert sync["done"].wait(WAIT_S), "rank 0 did not finish"
        assert rpc.rpc_sync("master", whoami, timeout=10) == "master"
        return {"users_left": len(_rrefs_here()["users"])}
    st = current_agent().ext["rref"].state
    own = RRef(Tracked("owner_to_user"))
    assert rpc.rpc_sync("worker1", _keep, args=(own,), timeout=RPC_TIMEOUT_S) == "owner_to_user"
    del own
    assert rpc.rpc_sync("worker2", _remote_and_fork, args=("master", "worker1", "user_to_user"),
                        timeout=RPC_TIMEOUT_S) == "user_to_user"
    assert rpc.rpc_sync("worker1", _remote_and_keep, args=("master", "users_own"),
                        timeout=RPC_TIMEOUT_S) == "users_own"

    def held_by_worker1_only() -> bool:
        owned = _rrefs_here()["owned"]
        return len(owned) == 3 and all(
            o["owner_refs"] == 0 and set(o["forks"].values()) == {"worker1"} for o in owned)

    poll_or_fail(held_by_worker1_only, 5.0, lambda: f"forks held by worker1 only: {_explain()}")
    assert _counts() == {"created": 3, "deleted": 0}, _counts()
    pid1 = rpc.rpc_sync("worker1", _pid, timeout=RPC_TIMEOUT_S)
    sync["victim_ready"].wait(WAIT_S)
    t_kill = time.monotonic()
    os.kill(pid1, signal.SIGKILL)
    poll_or_fail(lambda: not st.owned, DEATH_DETECTED_S, lambda: f"an empty owner table: {_explain()}")
    empty_s = time.monotonic() - t_kill
    poll_or_fail(_nothing_alive(3), 2.0, lambda: f"nothing alive on master: {_explain()}")
    assert rpc.rpc_sync("worker2", whoami, timeout=10) == "worker2"
    assert [m["name"] for m in nbrpc.debug.snapshot(events=0)["members"]] == ["master", "worker2"]
    sync["done"].set()
    return {"empty_s": round(empty_s, 2), "counts": _counts()}


# -- the spawned process -------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    name: str
    body: Callable[[int, dict], dict]
    after: Callable[[int], dict] | None = None  # rank -> info, after rpc.shutdown()
    barrier_before_shutdown: bool = False


WORLDS: dict[str, list[Phase]] = {
    "life": [Phase("cycles", _body_cycles),
             Phase("inflight", _body_inflight, after=_after_inflight),
             Phase("large", _body_large, barrier_before_shutdown=True)],
    "owner_dies": [Phase("owner_dies", _body_owner_dies)],
    "user_dies": [Phase("user_dies", _body_user_dies)],
}
_CTX: dict[str, Any] = {}  # set in the child


def _child(rank: int, world: str, port: int, results: Any, sync: dict) -> None:
    with child(rank, world, port, results) as report:
        _CTX["results"] = results
        for phase in WORLDS[world]:
            faulthandler.dump_traceback_later(PHASE_WATCHDOG_S, exit=True)
            _reset_counts()
            _KEPT.clear()
            t0 = time.monotonic()
            opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=RPC_TIMEOUT_S)
            rpc.init_rpc(NAMES[rank], rank=rank, world_size=WORLD, rpc_backend_options=opts)
            report.write(phase.name, "<init>", secs=time.monotonic() - t0, pid=os.getpid())
            info, body, body_s = outcome(lambda p=phase: p.body(rank, sync))
            if phase.barrier_before_shutdown:
                try:
                    sync["barrier"].wait(WAIT_S)
                except BaseException:
                    body = (body or "") + traceback.format_exc()
            _, shutdown, secs = outcome(lambda: rpc.shutdown(timeout=RPC_TIMEOUT_S))
            report.write(phase.name, "<shutdown>", ok=shutdown is None, secs=secs,
                         error=shutdown)
            report.write(phase.name, "<body>", ok=body is None, secs=body_s, info=info,
                         error=body)
            if phase.after is not None:
                report.attempt(phase.name, "<after>", lambda p=phase: p.after(rank))


# -- the parent side -----------------------------------------------------------------------
def _sync(ctx: Any) -> dict:
    return {"barrier": ctx.Barrier(WORLD), "killed": ctx.Event(), "done": ctx.Event(),
            "victim_ready": ctx.Event()}


@pytest.fixture(scope="module")
def worlds() -> Callable[[str], World]:
    """Each world is spawned once, by the first test that asks for it."""
    return world_cache(lambda name: run_world(name, _child, WORLD, WORLD_TIMEOUT_S, _sync))


# -- the tests -----------------------------------------------------------------------------
@pytest.mark.parametrize("rank", range(WORLD))
def test_create_fork_delete_cycles_leave_nothing_alive(worlds, rank: int) -> None:
    w = worlds("life")
    info = w.ok("cycles", "<body>", rank)["info"]
    assert info["counts"] == {"created": 50, "deleted": 50}, info
    w.ok("cycles", "<shutdown>", rank)


def test_cycle_plan_covers_every_direction_and_kind() -> None:
    combos = {(c, _cycle_plan(c, j)[0], _cycle_plan(c, j)[2], _cycle_plan(c, j)[3])
              for c in range(WORLD) for j in range(CYCLES_PER_RANK)}
    assert len(combos) == WORLD * 2 * len(CYCLE_KINDS) * 2  # creator, owner, kind, drop_early
    assert [_expected_owned(r) for r in range(WORLD)] == [50, 50, 50]


@pytest.mark.parametrize("rank", range(WORLD))
def test_graceful_shutdown_waits_for_in_flight_deletes(worlds, rank: int) -> None:
    w = worlds("life")
    w.ok("inflight", "<body>", rank)
    w.ok("inflight", "<shutdown>", rank)
    info = w.ok("inflight", "<after>", rank)["info"]
    assert info["counts"] == {"created": INFLIGHT, "deleted": INFLIGHT}, info


def test_large_values_are_freed_and_memory_returns(worlds) -> None:
    w = worlds("life")
    info = w.ok("large", "<body>", 0)["info"]
    assert info["drop_mib"] >= RSS_DROP / 2**20, info
    for rank in range(WORLD):
        w.ok("large", "<shutdown>", rank)
    print(info)


def test_life_world_exits_cleanly(worlds) -> None:
    w = worlds("life")
    assert w.exitcodes == [0] * WORLD, (w.exitcodes, [r for r in w.rows if not r["ok"]])
    shm = Path("/dev/shm")
    pids = {r["pid"] for r in w.rows if r.get("pid")}
    if shm.is_dir():
        left = [p.name for p in shm.iterdir() if any(p.name.startswith(f"nbrpc-{pid}-")
                                                     for pid in pids)]
        assert not left, left


def test_owner_killed_fails_rref_calls_promptly(worlds) -> None:
    w = worlds("owner_dies")
    info = w.ok("owner_dies", "<body>", 0)["info"]
    assert info["to_here_s"] < DEATH_DETECTED_S and "died" in info["message"], info
    w.ok("owner_dies", "<body>", 1)
    assert w.exitcodes[2] == -signal.SIGKILL, w.exitcodes
    print(info)


def test_rrefs_whose_calls_were_in_flight_at_owner_death_are_freed(worlds) -> None:
    """``never.to_here()`` waits (on a thread) for a value that never comes when its
    owner is killed, and ``doomed``'s fetch and proxy call are in flight: once the
    caller drops them, nothing may keep them alive (the error a waiter raised used to
    be the one its future held in C++, and its traceback pinned the waiting frames)."""
    info = worlds("owner_dies").ok("owner_dies", "<body>", 0)["info"]
    assert info["live_rrefs"] == [], info["live_rrefs"]


def test_dead_user_forks_are_released_by_the_owner(worlds) -> None:
    w = worlds("user_dies")
    info = w.ok("user_dies", "<body>", 0)["info"]
    assert info["empty_s"] < DEATH_DETECTED_S and info["counts"]["deleted"] == 3, info
    w.ok("user_dies", "<body>", 2)
    assert w.exitcodes[1] == -signal.SIGKILL, w.exitcodes
    print(info)


@pytest.mark.parametrize("world,survivors", [("owner_dies", (0, 1)), ("user_dies", (0, 2))])
def test_graceful_shutdown_after_a_member_died(worlds, world: str, survivors) -> None:
    w = worlds(world)
    secs = [w.ok(world, "<shutdown>", r)["secs"] for r in survivors]
    assert [w.exitcodes[r] for r in survivors] == [0, 0], w.exitcodes
    assert max(secs) < 5.0, secs
    print({"world": world, "shutdown_s": [round(s, 2) for s in secs]})
