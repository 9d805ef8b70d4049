"""RRef forks, lifetimes, failures and leaks with real agents in one process.

Values are ``Tracked`` objects whose ``__del__`` records that the owner really
freed them; every test ends by checking that nothing is left anywhere.
"""

from __future__ import annotations

import gc
import logging
import pickle
import threading
import time
import weakref

import pytest
import torch
from conftest import local_group, poll_for
from test_inprocess import Unpicklable

from nbrpc.agent import current_agent, set_default_agent
from nbrpc.errors import NbrpcError, RpcTimeoutError, WorkerGoneError
from nbrpc.rref import RRef, RRefLeakWarning, remote

FREED: list[str] = []
_lock = threading.Lock()


class Tracked:
    def __init__(self, tag: str, payload: int = 0) -> None:
        self.tag = tag
        self.payload = torch.zeros(payload // 4) if payload else None

        self.original = True  # copies made by to_here() are not counted

    def get(self) -> str:
        return self.tag

    def __getstate__(self) -> dict:
        return {**self.__dict__, "original": False}

    def __del__(self) -> None:
        if self.original:
            with _lock:
                FREED.append(self.tag)


# -- functions that run remotely ------------------------------------------------------
def tag_of(rref: RRef) -> str:
    """Works on any worker: the owner reads its value, a user fetches it."""
    return rref.local_value().tag if rref.is_owner() else rref.to_here().tag


def role_and_tag(rref: RRef) -> tuple[bool, str]:
    return rref.is_owner(), tag_of(rref)


def make_owned(tag: str) -> RRef:
    """Runs on the owner: returns an RRef to a fresh local value (owner → user)."""
    return RRef(Tracked(tag))


def forward(rref: RRef, to: str) -> str:
    """A user passes an RRef it received on to another worker (nested calls)."""
    return current_agent().rpc_async(to, tag_of, (rref,)).wait()


def tags_in(container: dict) -> list[str]:
    return sorted(tag_of(r) for r in container["refs"])


def hold(rref: RRef) -> dict:
    """A value that contains an RRef (owned elsewhere)."""
    return {"inner": rref}


def keep_for(rref: RRef, seconds: float) -> str:
    time.sleep(seconds)  # deliberate: holds the fork of ``rref`` for ``seconds``
    return tag_of(rref)


def keep_and_return(rref: RRef, seconds: float) -> tuple[str, RRef]:
    return keep_for(rref, seconds), rref


def fail(msg: str) -> None:
    raise ValueError(msg)


def all_clear(*agents) -> bool:
    return all(not a.ext["rref"].state.owned and not a.ext["rref"].state.users
               and not a.ext["rref"].state.children for a in agents)


def freed(tag: str) -> bool:
    gc.collect()
    with _lock:
        return tag in FREED


@pytest.fixture
def group():
    with local_group(["a", "b", "c"], control_retry=0.2) as agents:
        yield agents
        gc.collect()
        assert poll_for(lambda: all_clear(*agents), timeout=5), [
            a.ext["rref"].snapshot() for a in agents]


# -- the four scenarios, end to end -----------------------------------------------------
def test_user_to_owner(group) -> None:
    a, b, _ = group
    r = remote(a, "b", Tracked, ("u2o",), {}, -1)
    assert a.rpc_async("b", role_and_tag, (r,)).wait() == (True, "u2o")
    assert poll_for(lambda: not a.ext["rref"].state.children)  # the owner accepted
    assert not freed("u2o")
    del r
    assert poll_for(lambda: freed("u2o"))


def child_accepts_sent(agent) -> int:  # noqa: ANN001
    return sum(e["event"] == "send" and e["op"] == "rref_child_accept"
               for e in agent.events.records())


def test_an_rref_sent_home_is_let_go_by_the_answer_not_by_a_message(group) -> None:
    """user → owner inside a request (a parameter server's ``rpc_sync(rref.owner(),
    f, (rref,))``): the answer proves the owner holds its copy, so the parent
    lets go when it comes; no ChildAccept message (PyTorch sends one)."""
    a, b, _ = group
    r = remote(a, "b", Tracked, ("home",), {}, -1)
    assert r.to_here().tag == "home"
    for call in (a.rpc_sync, lambda *args: a.rpc_async(*args).wait()):
        for _ in range(3):
            assert call("b", role_and_tag, (r,)) == (True, "home")
            assert not a.ext["rref"].state.children  # at once, with the answer
    assert child_accepts_sent(b) == 0
    assert sum(e["event"] == "rref-child-accepted" and "by the answer" in e["detail"]
               for e in a.events.records()) == 6
    assert not freed("home")
    del r
    assert poll_for(lambda: freed("home"))


def test_an_rref_sent_home_in_a_call_that_timed_out_is_let_go_by_its_late_answer(
        group) -> None:
    a, b, _ = group
    r = remote(a, "b", Tracked, ("late-home",), {}, -1)
    with pytest.raises(RpcTimeoutError):
        a.rpc_async("b", keep_for, (r, 0.5), timeout=0.1).wait()
    assert a.ext["rref"].state.children  # the owner may not have read it yet
    assert poll_for(lambda: not a.ext["rref"].state.children, timeout=5)
    assert child_accepts_sent(b) == 0 and not freed("late-home")
    del r
    assert poll_for(lambda: freed("late-home"))


def test_owner_to_user(group) -> None:
    a, b, _ = group
    r = a.rpc_async("b", make_owned, ("o2u",)).wait()  # the owner made it, returned it
    assert not r.is_owner() and r.owner_name() == "b" and r.confirmed_by_owner()
    assert r.to_here().tag == "o2u" and not freed("o2u")
    del r
    assert poll_for(lambda: freed("o2u"))


def test_user_to_user(group) -> None:
    a, b, c = group
    r = remote(a, "b", Tracked, ("u2u",), {}, -1)
    fut = a.rpc_async("c", keep_for, (r, 0.3))
    del r  # the parent lets go while c still uses its fork (0.3 s later)
    assert fut.wait() == "u2u"
    assert poll_for(lambda: freed("u2u"))


def test_a_user_to_user_fork_in_a_request_is_let_go_by_the_answer(group) -> None:
    """c runs the function once the owner confirmed its copy (as PyTorch), so its
    answer stands for the ChildAccept PyTorch sends: a lets go when it comes."""
    a, b, c = group
    r = remote(a, "b", Tracked, ("u2u-answer",), {}, -1)
    for _ in range(3):
        assert a.rpc_sync("c", tag_of, (r,)) == "u2u-answer"
        assert not a.ext["rref"].state.children  # at once, with the answer
    assert child_accepts_sent(c) == 0
    del r
    assert poll_for(lambda: freed("u2u-answer"))


def test_a_fork_still_pending_when_the_answer_goes_is_accepted_later() -> None:
    """The owner has not confirmed c's copy when c answers (its wait for that is
    bounded by the RPC timeout): the answer says the fork is pending, so a keeps
    holding its copy until the ChildAccept c sends once the owner confirms."""
    with local_group(["a", "b", "c"], rpc_timeout=0.3, control_retry=3.0) as (a, b, c):
        r = remote(a, "b", Tracked, ("slow-fork",), {}, -1)
        assert r.to_here().tag == "slow-fork"
        c.faults.add("rref_fork", "delay", delay=1.2)
        assert a.rpc_async("c", tag_of, (r,), timeout=5).wait() == "slow-fork"
        assert a.ext["rref"].state.children  # the answer said: still pending
        del r
        assert not freed("slow-fork")
        assert poll_for(lambda: not a.ext["rref"].state.children, timeout=5)
        assert child_accepts_sent(c) == 1
        assert poll_for(lambda: freed("slow-fork"), timeout=5)


def confirmed_here(rref: RRef) -> bool:
    return rref.confirmed_by_owner()


def test_a_user_rref_argument_is_confirmed_before_the_function_runs(group) -> None:
    """As PyTorch (test_user_rrefs_confirmed): the callee runs the function
    once the owner has registered the forks in its arguments, even when that
    registration is slow (here: delayed 0.3 s), for rpc and for remote."""
    a, b, c = group
    r = remote(a, "b", Tracked, ("confirmed",), {}, -1)
    assert poll_for(r.confirmed_by_owner)
    c.faults.add("rref_fork", "delay", delay=0.3, times=2)
    t0 = time.monotonic()
    assert a.rpc_async("c", confirmed_here, (r,)).wait() is True
    assert time.monotonic() - t0 >= 0.25
    assert remote(a, "c", confirmed_here, (r,), {}, -1).to_here() is True
    assert not c.faults.rules  # both registrations were delayed
    del r
    assert poll_for(lambda: freed("confirmed"))


def test_nested_calls_containers_and_rrefs_inside_values(group) -> None:
    a, b, c = group
    r1 = remote(a, "b", Tracked, ("n1",), {}, -1)
    r2 = remote(a, "c", Tracked, ("n2",), {}, -1)
    assert a.rpc_async("c", forward, (r1, "b")).wait() == "n1"  # a → c → b (owner)
    assert a.rpc_async("b", forward, (r2, "a")).wait() == "n2"  # a → b → a (a user)
    assert a.rpc_async("c", tags_in, ({"refs": [r1, r2, r1]},)).wait() == ["n1", "n1", "n2"]
    outer = remote(a, "c", hold, (r1,), {}, -1)  # c's value holds a fork of r1
    del r1
    inner = outer.to_here()["inner"]  # c forks it to a again
    assert inner.to_here().tag == "n1" and not freed("n1")
    del outer
    assert not freed("n1")
    del inner
    assert poll_for(lambda: freed("n1"))
    del r2
    assert poll_for(lambda: freed("n2"))


def test_rref_local_value_to_self_and_back(group) -> None:
    a, _, _ = group
    set_default_agent(a)  # RRef(value) outside an agent's threads uses the default
    try:
        mine = RRef(Tracked("mine"))
    finally:
        set_default_agent(None)
    assert mine.is_owner() and mine.local_value().tag == "mine"
    assert a.rpc_async("a", tag_of, (mine,)).wait() == "mine"  # owner → itself
    assert a.rpc_async("c", role_and_tag, (mine,)).wait() == (False, "mine")  # owner → user
    del mine
    assert poll_for(lambda: freed("mine"))


def test_creation_error_reraised_by_to_here_proxies_and_forks(group, caplog) -> None:
    a, _, _ = group
    with caplog.at_level(logging.WARNING, logger="nbrpc.agent.agent"):
        r = remote(a, "b", fail, ("creation failed",), {}, -1)
        with pytest.raises(ValueError, match="creation failed"):
            r.to_here()
        with pytest.raises(ValueError, match="creation failed"):
            r.rpc_sync().anything()
        with pytest.raises(ValueError, match="creation failed"):
            a.rpc_async("c", tag_of, (r,)).wait()
    # the owner logs the failure once, not again each time the stored error is raised
    logged = [r.getMessage() for r in caplog.records if "raised" in r.getMessage()]
    assert logged == ["nbrpc agent 'b': remote from 'a' raised ValueError: creation failed"]


def test_a_call_that_raises_lets_go_of_its_rref_argument_without_a_garbage_collection(
        group) -> None:
    """The callee formats the error it sends back; reading its frames' variables
    for ``__tracebackhide__`` (``f_locals``) left a cycle through the exception
    that kept the call's frames, and the user RRef they held, until the next
    collection (under load the fixture's one ``gc.collect()`` came too early)."""
    a, _, c = group
    r = remote(a, "b", fail, ("creation failed",), {}, -1)
    gc.disable()
    try:
        with pytest.raises(ValueError, match="creation failed"):
            a.rpc_async("c", tag_of, (r,)).wait()
        assert poll_for(lambda: not c.ext["rref"].state.users, timeout=5), \
            c.ext["rref"].snapshot()
    finally:
        gc.enable()


def test_pickling_outside_rpc_is_refused_with_the_fix(group) -> None:
    a, _, _ = group
    r = remote(a, "b", Tracked, ("pk",), {}, -1)
    with pytest.raises(NbrpcError, match=r"only be pickled inside an RPC.*to_here\(\)"):
        pickle.dumps(r)
    del r
    assert poll_for(lambda: freed("pk"))


def test_repr_snapshot_and_events(group) -> None:
    a, b, c = group
    r = remote(a, "b", Tracked, ("snap", 4096), {}, -1)
    assert poll_for(r.confirmed_by_owner)
    assert repr(r).startswith(f"RRef(id={r._id}, owner='b', user fork") and "confirmed" in repr(r)
    fut = a.rpc_async("c", keep_for, (r, 0.5))
    rid = r._id
    assert poll_for(lambda: len(b.ext["rref"].state.owned[rid].forks) == 2)
    owned = b.snapshot()["rrefs"]["owned"][0]
    assert owned["state"] == "ready" and owned["type"].endswith("Tracked")
    assert owned["nbytes"] >= 4096 and "test_rref_inprocess.py" in owned["site"]
    assert sorted(owned["forks"].values()) == ["a", "c"]
    users = c.snapshot()["rrefs"]["users"]
    assert users[0]["owner"] == "b" and users[0]["parent"] == "a"
    assert fut.wait() == "snap"
    events = {e["event"] for e in a.snapshot(events=None)["events"]}
    assert {"rref-forked", "rref-confirmed"} <= events
    assert {"rref-created"} <= {e["event"] for e in b.snapshot(events=None)["events"]}
    del r, fut
    assert poll_for(lambda: freed("snap"))
    assert "rref-deleted" in {e["event"] for e in b.snapshot(events=None)["events"]}
    assert "rref-delete-sent" in {e["event"] for e in a.snapshot(events=None)["events"]}


def test_large_values_are_freed() -> None:
    with local_group(["a", "b"]) as (a, b):
        refs = [remote(a, "b", torch.zeros, (1 << 20,), {}, -1) for _ in range(20)]  # 4 MB each
        assert all(r.to_here().shape == (1 << 20,) for r in refs[:2])
        owned = b.ext["rref"].state.owned
        assert poll_for(lambda: len(owned) == 20 and all(e.value.done() for e in owned.values()))
        values = [weakref.ref(e.value.value()) for e in b.ext["rref"].state.owned.values()]
        del refs
        gc.collect()
        assert poll_for(lambda: all(v() is None for v in values))
        assert b.ext["rref"].state.deleted == 20


def served(agent, op: str) -> int:
    return sum(r["event"] == "serve" and r["op"] == op for r in agent.events.records())


def test_a_burst_of_deletions_reaches_the_owner_in_a_few_messages() -> None:
    """Deletions within ``DELETE_WINDOW`` of the last Deletes sent wait and go
    together: 40 RRefs dropped in a loop cost their owner a few Delete
    messages (one per window the loop spans), not 40, and every value is freed."""
    with local_group(["a", "b"]) as (a, b):
        refs = [remote(a, "b", Tracked, (f"burst{i}",), {}, -1) for i in range(40)]
        assert poll_for(lambda: all(r.confirmed_by_owner() for r in refs))
        before = served(b, "rref_delete")
        while refs:
            refs.pop()  # (collected here: nothing else refers to it)
        assert poll_for(lambda: all(freed(f"burst{i}") for i in range(40)), timeout=5)
        assert b.ext["rref"].state.deleted == 40
        assert poll_for(lambda: served(b, "rref_delete") > before)
        assert served(b, "rref_delete") - before <= 10  # (40 without the merge)
        sent = [e for e in a.snapshot(events=None)["events"] if e["event"] == "rref-delete-sent"]
        assert len(sent) == 40  # the event log still has one line per RRef


def test_a_deletion_inside_the_window_waits_for_its_end() -> None:
    with local_group(["a", "b"]) as (a, b):
        r = remote(a, "b", Tracked, ("windowed",), {}, -1)
        assert poll_for(r.confirmed_by_owner)
        ctx = a.ext["rref"]
        ctx._quiet_until = time.monotonic() + 0.5  # as if Deletes had just gone
        del r
        time.sleep(0.2)
        assert not freed("windowed") and len(b.ext["rref"].state.owned) == 1
        assert poll_for(lambda: freed("windowed"), timeout=5)


def test_a_dropped_batch_of_deletes_is_retried_whole() -> None:
    with local_group(["a", "b"], control_retry=0.2) as (a, b):
        refs = [remote(a, "b", Tracked, (f"retried{i}",), {}, -1) for i in range(10)]
        assert poll_for(lambda: all(r.confirmed_by_owner() for r in refs))
        a.faults.add("rref_delete", "drop", times=2)
        refs.clear()
        assert poll_for(lambda: all(freed(f"retried{i}") for i in range(10)), timeout=8)
        assert a.faults.fired and a.ext["rref"].retries >= 1
        assert poll_for(lambda: not a.ext["rref"].state.users)


# -- failures ---------------------------------------------------------------------
FAULTS = [("rref_fork", False), ("rref_fork", True), ("rref_child_accept", False),
          ("rref_child_accept", True), ("rref_delete", False), ("rref_delete", True)]


@pytest.mark.parametrize("action", ["drop", "delay"])
@pytest.mark.parametrize("op,reply", FAULTS)
def test_fault_once_no_premature_delete_no_leak(group, op, reply, action) -> None:
    """Drop or delay (by 0.3 s) one fork request, accept or delete, or its
    reply: the value stays alive while anyone holds it, and is freed after
    the retries."""
    a, b, c = group
    tag = f"{op}-{reply}-{action}"
    for agent in group:
        agent.faults.add(op, action, delay=0.3, reply=reply)
    r = remote(a, "b", Tracked, (tag,), {}, -1)
    fut = a.rpc_async("c", keep_and_return, (r, 0.4))  # (a's fork in the request is
    del r                                               # let go by the answer; the
    got, back = fut.wait()  # one in the answer, by a ChildAccept)
    assert got == tag  # c's fork still works 0.4 s after a let go
    assert back.to_here().tag == tag
    del fut, back
    assert poll_for(lambda: freed(tag), timeout=8)
    assert any(agent.faults.fired for agent in group)


def test_user_call_is_never_retried(group) -> None:
    a, _, _ = group
    a.faults.add("call", "drop")
    with pytest.raises(Exception, match="timeout"):
        a.rpc_async("b", tag_of, (), timeout=0.3).wait()


def test_owner_death_fails_rref_operations_promptly() -> None:
    with local_group(["a", "b", "c"], heartbeat_interval=0.1, failure_timeout=0.5) as (a, b, c):
        r = remote(a, "b", Tracked, ("dies",), {}, -1)
        assert r.to_here().tag == "dies"
        b.shutdown(graceful=False)  # stops answering, as a killed process would
        t0 = time.monotonic()
        assert poll_for(lambda: "b" not in a.members.by_name, timeout=3)
        assert time.monotonic() - t0 < 2
        with pytest.raises(WorkerGoneError, match=r"'b' died.*owned RRef"):
            r.to_here()
        with pytest.raises(WorkerGoneError, match="'b' died"):
            r.rpc_sync().get()
        assert r.owner_name() == "b" and "owner-gone" in repr(r)
        del r
        assert poll_for(lambda: not a.ext["rref"].state.users)


def test_a_batch_of_deletes_never_answered_settles_every_fork() -> None:
    """Every attempt of a merged Delete dropped: when the sender gives up, each
    of its forks is settled (no user entry left waiting) and logged."""
    with local_group(["a", "b"], control_retry=0.01) as (a, b):
        refs = [remote(a, "b", Tracked, (f"unanswered{i}",), {}, -1) for i in range(6)]
        assert poll_for(lambda: all(r.confirmed_by_owner() for r in refs))
        ids = {str(r._id) for r in refs}
        ctx = a.ext["rref"]
        ctx._quiet_until = time.monotonic() + 0.2  # the six go later, as one Delete
        a.faults.add("rref_delete", "drop", times=100)
        refs.clear()
        assert poll_for(lambda: not ctx.state.users, timeout=10)
        assert ctx.gave_up == 1  # one message
        errored = {e["op"] for e in a.snapshot(events=None)["events"]
                   if e["event"] == "rref-errored"}
        assert errored == ids  # a line for each fork


def test_dead_user_forks_are_released_by_the_owner() -> None:
    with local_group(["a", "b", "c"], heartbeat_interval=0.1, failure_timeout=0.5) as (a, b, c):
        r = remote(a, "b", Tracked, ("orphan",), {}, -1)
        held = remote(c, "b", Tracked, ("held-by-c",), {}, -1)
        assert a.rpc_async("c", tag_of, (r,)).wait() == "orphan"
        del r
        assert held.to_here().tag == "held-by-c"
        c.shutdown(graceful=False)  # dies holding a fork of "held-by-c"
        assert poll_for(lambda: freed("orphan") and freed("held-by-c"), timeout=4)
        del held


def test_graceful_shutdown_waits_for_in_flight_deletes() -> None:
    with local_group(["a", "b"]) as (a, b):
        refs = [remote(a, "b", Tracked, (f"late{i}",), {}, -1) for i in range(30)]
        a.faults.add("rref_delete", "delay", delay=0.2, times=5)
        del refs  # the deletes are queued, some delayed, as shutdown starts
    assert b.ext["rref"].state.owned == {} and b.ext["rref"].state.deleted == 30


def test_shutdown_deletes_user_rrefs_still_held_and_reports_them() -> None:
    with local_group(["a", "b"]) as (a, b):
        kept = remote(a, "b", Tracked, ("kept",), {}, -1)
        assert kept.to_here().tag == "kept"
        with pytest.warns(RRefLeakWarning, match=r"still alive on 'a'") as record:
            stopper = threading.Thread(target=b.shutdown)
            stopper.start()
            a.shutdown(leak_check=True)
            stopper.join(10)
    rrefs = record[0].message.rrefs
    assert rrefs[0]["role"] == "user" and "test_rref_inprocess.py" in rrefs[0]["site"]
    assert b.ext["rref"].state.owned == {}  # deleted at shutdown, as PyTorch does
    del kept


def test_fork_of_a_failed_creation_fails_promptly(group) -> None:
    a, _, _ = group
    r = remote(a, "b", Tracked, (Unpicklable(),), {}, -1)
    with pytest.raises(RuntimeError, match="cannot rebuild"):
        r.to_here()
    t0 = time.monotonic()
    with pytest.raises(NbrpcError, match="never created on 'b'.*cannot rebuild"):
        a.rpc_async("c", tag_of, (r,)).wait()
    assert time.monotonic() - t0 < 3  # not the 10 s RPC timeout


def test_a_fork_request_given_up_releases_the_parent() -> None:
    """No answer to a ForkRequest after every retry: the child says so to its
    parent, which lets go; nothing leaks and shutdown does not wait for it."""
    with local_group(["a", "b", "c"], control_retry=0.01) as (a, b, c):
        c.faults.add("rref_fork", "drop", times=8)  # all MAX_ATTEMPTS are lost
        r = remote(a, "b", Tracked, ("lost-fork",), {}, -1)
        assert a.rpc_async("c", tag_of, (r,)).wait() == "lost-fork"
        del r
        assert poll_for(lambda: c.ext["rref"].gave_up > 0, timeout=5)
        assert poll_for(lambda: freed("lost-fork"), timeout=3)
        assert not a.ext["rref"].state.children and a.ext["rref"].busy() == 0


@pytest.mark.parametrize("to", ["c", "b"])  # a user; the owner (no ChildAccept either way)
def test_forks_in_a_request_the_callee_cannot_unpickle_are_undone(group, to) -> None:
    """The callee fails before it reaches the RRef: no ForkRequest ever comes, so
    the parent must let go when told the request was not read."""
    a, _, _ = group
    r = remote(a, "b", Tracked, ("unread",), {}, -1)
    with pytest.raises(RuntimeError, match="cannot rebuild"):
        a.rpc_async(to, tag_of, (Unpicklable(), r)).wait()
    assert poll_for(lambda: not a.ext["rref"].state.children)
    del r
    assert poll_for(lambda: freed("unread"))


# -- to_here() of a value that is ready: answered on the owner's I/O thread -------------
def slow_value(seconds: float, tag: str) -> Tracked:
    time.sleep(seconds)  # deliberate: the value is made this late
    return Tracked(tag)


def test_fetch_overtaking_its_creation_waits_for_the_value(group) -> None:
    a, b, _ = group
    a.faults.add("remote", "delay", delay=0.3)  # the Fetch reaches b first
    r = remote(a, "b", Tracked, ("late",), {}, -1)
    assert r.to_here().tag == "late"
    assert a.faults.fired == [("remote", "request", "delay")]
    del r
    assert poll_for(lambda: freed("late"))


def test_fetch_waiting_for_a_slow_value_does_not_hold_the_owner(group) -> None:
    """The owner's I/O thread only registers the wait: other calls to the owner
    are served meanwhile, and the answer goes out when the value is set."""
    a, b, _ = group
    r = remote(a, "b", slow_value, (1.0, "slow"), {}, -1)
    got: list[str] = []
    fetch = threading.Thread(target=lambda rr: got.append(rr.to_here().tag), args=(r,))
    fetch.start()
    assert poll_for(lambda: any((e["event"], e["op"]) == ("send", "rref_fetch")
                                for e in a.snapshot()["events"]))
    # sent after the Fetch on the same connection, so b's I/O thread reads it after
    assert a.rpc_async("b", tags_in, ({"refs": []},)).wait() == []  # served meanwhile
    assert not got  # (the value takes 1 s)
    fetch.join(10)
    assert got == ["slow"]
    del r
    assert poll_for(lambda: freed("slow"))


def test_lost_fetch_answer_times_out_and_the_next_fetch_works(group) -> None:
    a, b, _ = group
    r = remote(a, "b", Tracked, ("lost",), {}, -1)
    b.faults.add("rref_fetch", "drop", reply=True)
    with pytest.raises(TimeoutError):
        r.to_here(timeout=0.5)
    assert r.to_here().tag == "lost"  # the owner and the RRef are unharmed
    del r
    assert poll_for(lambda: freed("lost"))


def test_delayed_fetch_answers_arrive_for_their_own_calls(group) -> None:
    a, b, _ = group
    r1 = remote(a, "b", Tracked, ("first",), {}, -1)
    r2 = remote(a, "b", Tracked, ("second",), {}, -1)
    assert (r1.to_here().tag, r2.to_here().tag) == ("first", "second")  # both confirmed
    b.faults.add("rref_fetch", "delay", reply=True, delay=0.3)  # the next answer comes late
    got: list[str] = []
    started = time.perf_counter()
    first = threading.Thread(target=lambda r: got.append(r.to_here().tag), args=(r1,))
    first.start()
    assert poll_for(lambda: b.faults.fired)  # r1's answer is the one held back
    assert a.unanswered_since(started) == 1
    assert r2.to_here().tag == "second"  # overtakes it, and is its own answer
    first.join(5)
    assert got == ["first"]
    del r1, r2
    assert poll_for(lambda: freed("first") and freed("second"))
