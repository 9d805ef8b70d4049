"""Busy is not dead: failure detection, readmission, and the errors a bad call gets.

In-process tier: agents in this process, a member made "busy" by blocking its
I/O thread (``io.call_soon(time.sleep, s)``: the process and its connections
stay up, as when user code holds the GIL) and "dead" by stopping its
transport (its connections close, as when the process is killed).
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time

import pytest
import torch
import zmq
from conftest import intruder, local_group, poll_for
from targets import add, sleep_then

from nbrpc.agent import Agent, AgentOptions
from nbrpc.agent.messages import LinkCut
from nbrpc.errors import RendezvousError, SerializationError, WorkerGoneError
from nbrpc.rpc.options import read_options
from nbrpc.transport import ShmRef, new_key, pack


def unpicklable():
    return threading.Lock()


def _tables_full(agents: list[Agent]) -> bool:
    ranks = {a.rank for a in agents}
    return all(set(a.member_ranks()) == ranks and a.state == "ready" for a in agents)


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="off Linux, a lost host's links stay up: silence counts (30 s)")
def test_by_default_silence_alone_never_makes_a_member_dead_on_linux(monkeypatch) -> None:
    # the kernel vouches for a linked member however long its Python is silent
    monkeypatch.delenv("NBRPC_FAILURE_TIMEOUT", raising=False)
    assert AgentOptions().failure_timeout == math.inf
    assert read_options(None)["failure_timeout"] == math.inf


def test_a_restarted_member_joins_once_its_old_process_is_found_gone() -> None:
    """A dynamic group's member restarts under its name and rank before the
    coordinator noticed the old process died: the coordinator leaves the rank
    to the member it has (a Join does not displace a live member), and the new
    process asks again until the old one is declared dead (its link closed)."""
    with local_group(["a", "b"], dynamic=True, heartbeat_interval=0.2) as (a, b):
        b.shutdown(graceful=False)  # killed: its connections close
        b2 = Agent("b", 1, a._key, world_size=None,
                   options=AgentOptions(num_worker_threads=2, heartbeat_interval=0.2))
        try:
            t0 = time.monotonic()
            b2.start(a.address, timeout=10)
            took = time.monotonic() - t0
            assert a.members.get(1).incarnation == b2.io.incarnation
            assert a.rpc_async("b", add, (2, 3)).wait() == 5
            assert took < 6, f"the restarted member took {took:.1f} s to join"
        finally:
            b2.shutdown(graceful=False)


def test_a_stopped_process_is_noticed_by_its_connection_not_a_silence_rule() -> None:
    with local_group(["a", "b", "c"]) as (a, b, c):  # default failure_timeout
        assert a.options.failure_timeout == AgentOptions().failure_timeout
        fut = a.rpc_async("b", sleep_then, (5, "never"))
        t0 = time.monotonic()
        b.shutdown(graceful=False)  # its sockets close, as a killed process's would
        with pytest.raises(WorkerGoneError, match=r"'b' died \(its connection closed\)"):
            fut.wait()
        assert time.monotonic() - t0 < 2.5
        assert poll_for(lambda: "b" not in c.members.by_name, timeout=3)
        assert a.rpc_async("c", add, (1, 2)).wait() == 3


def test_a_member_whose_link_to_another_stays_down_fails_its_calls_to_it(monkeypatch) -> None:
    """Two members cut off from each other, not from the coordinator: nobody
    declares either dead, so the caller ends its calls itself once its link
    has been down for 2 * link_timeout, and the peer stays a member. While
    it waits, it heartbeats the peer (data in flight, so the kernel notices a
    cut); a peer that only died is reported by the coordinator first."""
    with local_group(["a", "b", "c"], heartbeat_interval=0.2) as (a, b, c):
        sent: list = []  # (rank, message type) of b's control messages
        send = b.control.send

        def recording(rank, msg):
            sent.append((rank, type(msg).__name__))
            send(rank, msg)

        monkeypatch.setattr(b.control, "send", recording)
        fut = b.rpc_async("c", sleep_then, (4, "never"))  # (c serves it; b stops waiting)
        assert poll_for(lambda: (2, "Heartbeat") in sent, timeout=2)  # probes while it waits
        real = b.io.link_down_since
        cut = time.monotonic()
        monkeypatch.setattr(b.io, "link_down_since", lambda r: cut if r == 2 else real(r))
        with pytest.raises(WorkerGoneError, match=r"'c' is out of reach from 'b': the connection "
                           r"to it has been down for \d\.\d s, though the group still counts it "
                           r"a member \(a network cut"):
            fut.wait()
        assert 2 * b.options.link_timeout <= time.monotonic() - cut < 2 * b.options.link_timeout + 1
        with pytest.raises(WorkerGoneError, match="out of reach"):  # new calls too, next tick
            b.rpc_async("c", sleep_then, (4, "never")).wait()
        assert _tables_full([a, b, c]) and not any(  # nobody declared dead, nobody evicted
            e["event"] == "member-dead" for x in (a, b, c) for e in x.snapshot()["events"])
        events = [e for e in b.snapshot()["events"] if e["event"] == "peer-unreachable"]
        assert [e["peer"] for e in events] == ["c"]  # one per cut, however many calls failed
        assert a.rpc_async("c", add, (1, 2)).wait() == 3  # the coordinator reaches it
        assert poll_for(lambda: 1 in c.control._answers_cut, timeout=2)  # (below)
        monkeypatch.setattr(b.io, "link_down_since", real)  # the link is back
        # b told the coordinator of its cut too, and c heard that b's answers
        # could not come back: b's next tick says the link is mended
        assert poll_for(lambda: 1 not in c.control._answers_cut, timeout=2)
        assert b.rpc_async("c", add, (2, 3)).wait() == 5 and c.rpc_async("b", add, (3, 4)).wait() == 7
        sent.clear()
        time.sleep(0.5)  # deliberate: two ticks and more, in which nothing may be sent to c
        assert (2, "Heartbeat") not in sent  # nothing in flight to c: no probes


def test_a_members_cut_link_fails_its_calls_when_due_not_a_tick_later(monkeypatch) -> None:
    """Ticks 1 s apart, a link cut just after one: the next tick sees it down
    for 1 s of the 1.5 allowed and checks again at 1.5 s, not at 2 s."""
    with local_group(["a", "b", "c"], heartbeat_interval=1.0, link_timeout=0.75) as (a, b, c):
        real, send, cut = b.io.link_down_since, b.control.send, []

        def cut_at_the_first_probe(rank, msg):  # on b's I/O thread, in its tick
            if rank == 2 and not cut:
                cut.append(time.monotonic())
            send(rank, msg)

        monkeypatch.setattr(b.control, "send", cut_at_the_first_probe)
        monkeypatch.setattr(b.io, "link_down_since",
                            lambda r: cut[0] if r == 2 and cut else real(r))
        fut = b.rpc_async("c", sleep_then, (6, "never"))
        with pytest.raises(WorkerGoneError, match="'c' is out of reach from 'b'"):
            fut.wait()
        took = time.monotonic() - cut[0]
        assert 1.5 <= took < 1.85, f"failed {took:.2f} s after the cut (due at 1.5, tick at 2)"


def test_a_member_whose_answers_cannot_come_back_has_its_callers_told(monkeypatch) -> None:
    """A cut one way: b's requests reach c, and b's own link to c stays up, but
    c's connection to b (on which its answers travel) is down. c tells the
    coordinator once that has lasted 2 * link_timeout; the coordinator relays it
    to b, whose calls to c fail ("its answers cannot come back"), and new ones
    at its next tick, until c says the link is back (at once, when its transport
    sees it up). A relayed report that comes after the mend it names is stale."""
    with local_group(["a", "b", "c"], heartbeat_interval=0.2) as (a, b, c):
        fut = b.rpc_async("c", sleep_then, (6, "never"))
        real, cut = c.io.link_down_since, time.monotonic()
        monkeypatch.setattr(c.io, "link_down_since", lambda r: cut if r == 1 else real(r))
        with pytest.raises(WorkerGoneError, match=r"'c' is out of reach from 'b': its answers "
                           r"cannot come back \(it reported its connection to 'b' down for "
                           r"\d\.\d s, while requests to it get through"):
            fut.wait()
        lt = c.options.link_timeout
        assert 2 * lt <= time.monotonic() - cut < 2 * lt + 1
        assert b.io.link_down_since(2) is None  # b's own link was up throughout
        with pytest.raises(WorkerGoneError, match="its answers cannot come back"):
            b.rpc_async("c", sleep_then, (4, "never")).wait()  # new calls too, next tick
        assert _tables_full([a, b, c]) and not any(  # nobody declared dead, nobody evicted
            e["event"] == "member-dead" for x in (a, b, c) for e in x.snapshot()["events"])
        events = [e for e in b.snapshot()["events"] if e["event"] == "peer-unreachable"]
        assert [e["peer"] for e in events] == ["c"]  # one per cut, however many calls failed
        assert a.rpc_async("c", add, (1, 2)).wait() == 3  # the coordinator reaches c

        # the link is back: c's transport says so, and c tells b on that link
        # (its tick, which would tell b too, is kept out of it here)
        monkeypatch.setattr(c.io, "link_down_since", real)
        monkeypatch.setattr(c.control, "_report_cuts", lambda now, stalled: None)
        c.io.call_soon(c.io._link_up, 1)
        assert poll_for(lambda: 2 not in b.control._answers_cut, timeout=2)
        assert b.rpc_async("c", add, (2, 3)).wait() == 5
        # the coordinator's relay of that cut, were it to come after the mend: stale
        stale = LinkCut(reporter=2, peer=1, since=cut, down_s=2.0)
        b.io.call_soon(b.control._on_link_cut, 0, stale)
        # a report relayed for someone else (sender is not the reporter): not relayed
        a.io.call_soon(a.control._on_link_cut, 1, LinkCut(reporter=2, peer=1, since=0.0,
                                                          down_s=2.0))
        time.sleep(0.5)  # deliberate: two ticks of b's, in which nothing may fail its calls
        assert not b.control._answers_cut
        assert b.rpc_async("c", add, (3, 4)).wait() == 7


def test_a_one_way_cut_with_the_coordinator_is_told_through_another_member(monkeypatch) -> None:
    """The coordinator's own links. First a's (the coordinator's) link to b is
    down while b's to a is up: b's calls to a fail, told through c. Then b's
    link to a is down while a's to b is up: a's calls to b fail, told through
    c. Nobody is declared dead (each side still hears the other)."""
    with local_group(["a", "b", "c"], heartbeat_interval=0.2) as (a, b, c):
        lt = a.options.link_timeout
        for caller, callee, rank in ((b, a, 1), (a, b, 0)):
            fut = caller.rpc_async(callee.name, sleep_then, (6, "never"))
            real, cut = callee.io.link_down_since, time.monotonic()
            monkeypatch.setattr(callee.io, "link_down_since",
                                lambda r, real=real, cut=cut, rank=rank:
                                cut if r == rank else real(r))
            with pytest.raises(WorkerGoneError, match=rf"'{callee.name}' is out of reach from "
                               rf"'{caller.name}': its answers cannot come back"):
                fut.wait()
            assert 2 * lt <= time.monotonic() - cut < 2 * lt + 1
            with pytest.raises(WorkerGoneError, match="its answers cannot come back"):
                caller.rpc_async(callee.name, sleep_then, (4, "never")).wait()  # (next tick)
            assert _tables_full([a, b, c]) and not any(
                e["event"] == "member-dead" for x in (a, b, c) for e in x.snapshot()["events"])
            monkeypatch.setattr(callee.io, "link_down_since", real)  # back: its tick says so
            assert poll_for(lambda cuts=caller.control._answers_cut, r=callee.rank: r not in cuts,
                            timeout=2)
            assert caller.rpc_async(callee.name, add, (1, 2)).wait() == 3


def test_in_a_group_of_two_a_cut_has_nobody_to_relay_it(monkeypatch) -> None:
    """With no third member, nobody can carry the report: none is sent."""
    with local_group(["a", "b"], heartbeat_interval=0.2) as (a, b):
        sent, send = [], a.control.send
        monkeypatch.setattr(a.control, "send", lambda r, m: (sent.append(type(m)), send(r, m)))
        cut = time.monotonic() - 10
        real = a.io.link_down_since
        monkeypatch.setattr(a.io, "link_down_since", lambda r: cut if r == 1 else real(r))
        time.sleep(0.5)  # deliberate: two ticks of a's, in which it could have sent one
        assert LinkCut not in sent and a.control._cuts_told == {}
        assert a.rpc_async("b", add, (1, 2)).wait() == 3


def test_a_member_calling_one_that_died_hears_the_coordinators_verdict() -> None:
    with local_group(["a", "b", "c"], heartbeat_interval=0.2) as (a, b, c):
        fut = b.rpc_async("c", sleep_then, (2, "never"))  # waiting on c, as far as b knows
        c.shutdown(graceful=False)
        with pytest.raises(WorkerGoneError, match=r"'c' died \(its connection closed\)"):
            fut.wait()


def test_a_busy_member_is_not_evicted_and_its_calls_complete() -> None:
    with local_group(["a", "b", "c"], heartbeat_interval=0.2) as (a, b, c):
        fut = a.rpc_async("b", add, (20, 22))
        b.io.call_soon(time.sleep, 3.0)  # silent for 3 s, connections up
        c.io.call_soon(time.sleep, 3.0)
        time.sleep(0.05)
        late = a.rpc_async("b", add, (1, 1))
        from_member = c.rpc_async("b", add, (2, 2))  # (c's I/O thread is held too)
        assert fut.wait() == 42 and late.wait() == 2 and from_member.wait() == 4
        time.sleep(0.5)
        assert _tables_full([a, b, c])
        assert not any(e["event"] == "member-dead" for x in (a, b, c)
                       for e in x.snapshot()["events"])


def test_a_busy_coordinator_loses_nobody() -> None:
    with local_group(["a", "b", "c"], heartbeat_interval=0.2) as (a, b, c):
        a.io.call_soon(time.sleep, 3.0)  # the coordinator hears nothing for 3 s
        time.sleep(3.5)
        assert _tables_full([a, b, c]) and a.readmitted == b.readmitted == 0
        assert b.rpc_async("a", add, (1, 1)).wait() == 2


def test_a_member_wrongly_declared_dead_is_taken_back() -> None:
    with local_group(["a", "b", "c"], heartbeat_interval=0.2, failure_timeout=1.0) as (a, b, c):
        b.io.call_soon(time.sleep, 2.5)  # longer than failure_timeout
        assert poll_for(lambda: "b" not in a.members.by_name, timeout=3)  # suspected: evicted
        assert poll_for(lambda: _tables_full([a, b, c]), timeout=5)  # and back
        assert a.readmitted + b.readmitted >= 1
        assert a.rpc_async("b", add, (2, 3)).wait() == 5
        assert c.rpc_async("b", add, (2, 4)).wait() == 6
        assert b.rpc_async("c", add, (2, 5)).wait() == 7


def test_members_rejoin_a_coordinator_they_gave_up_on() -> None:
    with local_group(["a", "b", "c"], heartbeat_interval=0.2, failure_timeout=1.0) as (a, b, c):
        a.io.call_soon(time.sleep, 2.5)
        assert poll_for(lambda: 0 not in b.members and 0 not in c.members, timeout=3)
        assert poll_for(lambda: _tables_full([a, b, c]), timeout=5)
        assert b.readmitted >= 1 and c.readmitted >= 1
        assert b.rpc_async("a", add, (1, 1)).wait() == 2


def test_failure_timeout_is_validated() -> None:
    with pytest.raises(ValueError, match="failure_timeout"):
        Agent("x", 0, new_key(), world_size=1,
              options=AgentOptions(heartbeat_interval=0.5, failure_timeout=0.6))
    with pytest.raises(ValueError, match="failure_timeout"):
        Agent("x", 0, new_key(), world_size=1, options=AgentOptions(failure_timeout=math.nan))


def test_rank0_reports_a_refused_joiner_at_once() -> None:
    key = new_key()
    lead = Agent("lead", 0, key, world_size=2, options=AgentOptions(num_worker_threads=2))
    wrong = Agent("w", 1, key, world_size=3, options=AgentOptions(num_worker_threads=2))
    errors: list[BaseException] = []

    def start_lead() -> None:
        try:
            lead.start(None, timeout=20)
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=start_lead)
    t0 = time.monotonic()
    t.start()
    with pytest.raises(RendezvousError, match="world_size=3"):
        wrong.start(lead.address, timeout=20)
    t.join(20)
    assert time.monotonic() - t0 < 5, "rank 0 waited out its join timeout"
    assert errors and isinstance(errors[0], RendezvousError)
    assert "refused" in str(errors[0]) and "world_size=3" in str(errors[0])


def test_eviction_during_shutdown_ends_the_shutdown() -> None:
    with local_group(["a", "b", "c"], heartbeat_interval=0.2, failure_timeout=1.0) as (a, b, c):
        done = threading.Event()

        def leave() -> None:
            c.shutdown(timeout=30)  # waits for a and b, who are not shutting down
            done.set()

        t = threading.Thread(target=leave)
        t.start()
        time.sleep(0.3)
        t0 = time.monotonic()
        c.io.call_soon(time.sleep, 1.6)  # c is declared dead meanwhile
        assert done.wait(8), "shutdown waited its whole timeout"
        assert time.monotonic() - t0 < 8
        t.join(5)
        assert c.state == "stopped"


def test_bad_call_arguments_say_what_is_expected(trio) -> None:
    a, _, _ = trio
    for timeout, err, text in [(math.nan, ValueError, "got nan"),
                               (-3, ValueError, "got -3"),
                               ("1", TypeError, "got str '1'")]:
        with pytest.raises(err, match=r"timeout must be .*" + text):
            a.rpc_async("b", add, (1, 2), timeout=timeout)
    with pytest.raises(TypeError, match=r"args must be a tuple .* e\.g\. args=\(5,\); got int 5"):
        a.rpc_async("b", add, 5)
    with pytest.raises(TypeError, match="kwargs must be a dict"):
        a.rpc_async("b", add, (1,), 3)
    assert a.rpc_async("b", add, [1, 2], timeout=-1).wait() == 3  # a list works, as in torch
    assert a.rpc_async("b", add, (1, 2), timeout=math.inf).wait() == 3


def test_an_unpicklable_result_names_the_worker_and_the_type(trio) -> None:
    a, _, _ = trio
    with pytest.raises(SerializationError) as info:
        a.rpc_async("b", unpicklable).wait()
    text = str(info.value)
    assert "unpicklable() on 'b'" in text and "_thread.lock" in text
    assert "Ok(" not in text and "value=" not in text


def test_drops_are_counted_by_reason_and_logged_once_per_interval(trio, caplog) -> None:
    a, b, _ = trio
    caplog.set_level(logging.WARNING, logger="nbrpc.transport.drops")
    with intruder(b.address, b._key) as s:  # past the handshake, but signing with another key
        for i in range(50):
            s.send_multipart(pack(new_key(), 1, 0, i, b"x"))
        to_b = {"dest": b.rank, "run": b.io.run}  # (for b, in this run: checked further on)
        recorded = pack(b._key, 3, 0, 0, b"\x80\x05N.", incarnation=99, seq=5, **to_b)
        s.send_multipart(recorded)
        s.send_multipart(recorded)  # played back
        stale = pack(b._key, 3, 0, 0, b"\x80\x05N.", incarnation=99, seq=6,
                     sent_at=time.time() - 3600, **to_b)
        s.send_multipart(stale)
        assert poll_for(lambda: sum(b.io.dropped.values()) == 52)
    with intruder(b.address, b._key) as s:  # signed, but nothing b can act on
        s.send_multipart(pack(b._key, 99, 0, 0, b"", incarnation=98, seq=1, **to_b))
        # (a CONTROL message: a request would be answered, and a's count of
        # requests sent would never match b's of requests served)
        s.send_multipart(pack(b._key, 3, 0, 0, b"", [ShmRef("nbrpc-1-00-0", 4 << 20)],
                              incarnation=98, seq=2, **to_b))
        assert poll_for(lambda: sum(b.io.dropped.values()) == 54)
    assert b.snapshot()["counters"]["dropped"] == {"bad signature": 50, "replayed": 1,
                                                   "stale": 1, "unknown kind": 1,
                                                   "unreadable segment": 1}
    lines = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(lines) == 5, [r.getMessage() for r in lines]  # the first of each reason
    assert a.rpc_async("b", add, (1, 1)).wait() == 2


def test_encrypted_group_works_and_a_peer_without_the_key_never_gets_through() -> None:
    with local_group(["a", "b"], encrypt=True) as (a, b):
        big = torch.arange(1 << 20, dtype=torch.float32)  # through the socket or shm
        assert torch.equal(a.rpc_async("b", torch.clone, (big,)).wait(), big)
        assert a.rpc_async("b", add, (1, 2)).wait() == 3
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.DEALER)  # no CURVE keys: the handshake fails
        s.setsockopt(zmq.LINGER, 0)
        s.connect(b.address)
        try:
            for i in range(20):
                s.send_multipart(pack(new_key(), 1, 0, i, b"x"))
            time.sleep(0.5)
        finally:
            s.close()
        assert sum(b.io.dropped.values()) == 0  # it never reached the I/O thread
        assert b.rpc_async("a", add, (2, 2)).wait() == 4
