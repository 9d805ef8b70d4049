"""Security tier: a recorded message played back to another member, to its
sender, or to a later run of the group at the same address.

Without ``encrypt=True`` a signed message and the connection token travel in
clear, so someone on the network can record both. The replay guard refuses a
message its recipient has seen; the signed destination rank and the group's
run (a random number the coordinator draws, learned by each member in the
answer to its Join) refuse the rest. What must hold, over ``tcp://`` with a
group key that stays the same across runs (as the per-user key of an
``env://`` group does):

====================================  ==========================================
replayed to                           outcome
====================================  ==========================================
the recipient, again                  dropped as "replayed"
another member                        dropped as "wrong destination"
the member that sent it               dropped as "wrong destination"
every member of a new run of the      "wrong run" at the rank it was for,
group at the same addresses           "wrong destination" elsewhere
a Join, to the coordinator of a new   answered with a challenge to the address
run at the same address               it names (which only the live joiner
                                      answers); it takes no rank, before or
                                      after the real rank joined
====================================  ==========================================

The function it carries never runs a second time, and every member's
graceful shutdown still completes at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq
from conftest import free_ports, intruder, local_group, poll_or_fail

from nbrpc.agent import Agent, AgentOptions
from nbrpc.agent.messages import CONTROL, REQUEST, Join
from nbrpc.serialize import loads
from nbrpc.transport import new_key
from nbrpc.transport.frames import unpack

pytestmark = pytest.mark.security

RAN: list[str] = []


def record_call(tag: str) -> str:
    RAN.append(tag)
    return tag


@contextmanager
def group(key: bytes, ports: list[int], shutdown_s: list[float]) -> Iterator[list[Agent]]:
    """Three agents over tcp:// only, at fixed ports, with group key ``key``;
    how long their graceful shutdown took goes to ``shutdown_s``, and it must
    raise nothing."""
    errors: list = []
    with local_group(["a", "b", "c"], threads=2, key=key, local_ipc=False,
                     per_rank={r: {"port": p} for r, p in enumerate(ports)},
                     shutdown_errors=errors) as agents:
        yield agents
        t0 = time.monotonic()
    shutdown_s.append(time.monotonic() - t0)
    assert not errors, errors


def _replay(agent: Agent, frames: list) -> None:
    with intruder(agent.address, agent._key) as sock:  # (a recorded connection token)
        sock.setsockopt(zmq.LINGER, 2000)  # (close waits, at most 2 s, for it to leave)
        sock.send_multipart(frames)


def test_a_recorded_request_runs_once_in_one_run_on_one_member() -> None:
    RAN.clear()
    key, ports = new_key(), free_ports(3)
    first_shutdown: list[float] = []
    with group(key, ports, first_shutdown) as (a, b, c):
        recorded: list = []
        deliver = b.io._zmq._deliver

        def tap(frames: list) -> None:  # what crossed the wire to b, as received
            recorded.append([bytes(f) for f in frames])
            deliver(frames)

        b.io._zmq._deliver = tap
        assert a.rpc_sync("b", record_call, ("once",)) == "once"
        b.io._zmq._deliver = deliver
        request = next(f for f in recorded if f[0][33] == REQUEST)  # (kind: after sig, version)
        assert RAN == ["once"]

        for target in (b, c, a):
            _replay(target, request)
        poll_or_fail(lambda: b.io.dropped["replayed"] == 1
                     and c.io.dropped["wrong destination"] == 1
                     and a.io.dropped["wrong destination"] == 1, 5,
                     lambda: [dict(x.io.dropped) for x in (a, b, c)])
        assert a.rpc_sync("c", record_call, ("still working",)) == "still working"
    assert RAN == ["once", "still working"]

    later_shutdown: list[float] = []
    with group(key, ports, later_shutdown) as agents:  # a new run, at the same addresses
        assert {x.address for x in agents} == {f"tcp://127.0.0.1:{p}" for p in ports}
        assert len({x.io.run for x in agents}) == 1  # one run, agreed at the join
        for target in agents:
            _replay(target, request)
        a2, b2, c2 = agents
        poll_or_fail(lambda: b2.io.dropped["wrong run"] == 1
                     and a2.io.dropped["wrong destination"] == 1
                     and c2.io.dropped["wrong destination"] == 1, 5,
                     lambda: [dict(x.io.dropped) for x in agents])
    assert RAN == ["once", "still working"], "a recorded request ran again"
    print(f"\ngraceful shutdown of the three ranks after the replays: "
          f"{first_shutdown[0]:.2f} s, then {later_shutdown[0]:.2f} s")


def _start(agents: list[Agent], coordinator: str) -> list[threading.Thread]:
    threads = [threading.Thread(target=x.start, args=(None if x.rank == 0 else coordinator, 10),
                                daemon=True) for x in agents]
    for t in threads:
        t.start()
    return threads


def _stop_all(agents: list[Agent]) -> None:
    for x in agents:  # (together: a static group's graceful shutdown waits for all)
        threading.Thread(target=x.shutdown, kwargs={"timeout": 10}, daemon=True).start()
    poll_or_fail(lambda: all(x.state == "stopped" for x in agents), 20, "the agents to stop")


def _tcp_agent(name: str, rank: int, key: bytes, port: int) -> Agent:
    return Agent(name, rank, key, world_size=3,
                 options=AgentOptions(num_worker_threads=2, port=port, local_ipc=False))


def test_a_recorded_join_takes_no_rank_in_a_later_run() -> None:
    """A Join recorded in one run, played to the coordinator of a later run at
    the same address before the real rank joins, neither takes that rank nor
    fails the group: the coordinator takes a Join only once it is signed for
    its run, which a joiner learns from the challenge the coordinator sends
    to the address the Join names."""
    key, ports = new_key(), free_ports(3)
    names = ["a", "b", "c"]
    first = [_tcp_agent(n, r, key, p) for r, (n, p) in enumerate(zip(names, ports))]
    joins: list = []
    deliver = first[0].io._zmq._deliver

    def tap(frames: list) -> None:  # what rank 2 sent the coordinator while joining
        env = unpack(key, [bytes(f) for f in frames])
        if env.sender == 2 and env.kind == CONTROL and type(loads(env.payload, env.buffers)) is Join:
            joins.append([bytes(f) for f in frames])
        deliver(frames)

    first[0].io._zmq._deliver = tap
    for t in _start(first, first[0].address):
        t.join(15)
    try:
        assert all(x.state == "ready" for x in first), [x.state for x in first]
        assert joins, "rank 2's Join was not seen"
    finally:
        _stop_all(first)

    later = [_tcp_agent(n, r, key, p) for r, (n, p) in enumerate(zip(names, ports))]
    a2, b2, c2 = later
    starting = _start([a2, b2], a2.address)
    try:
        for frames in joins:  # played back before the real rank 2 joins
            _replay(a2, frames)
        time.sleep(0.5)  # a negative check: the recording must not take rank 2
        assert 2 not in a2.control.coordinator.members, "a recorded Join took rank 2"
        for t in [*starting, *_start([c2], a2.address)]:
            t.join(15)
        assert all(x.state == "ready" for x in later), [x.state for x in later]
        assert a2.members.get(2).incarnation == c2.io.incarnation
        assert a2.rpc_sync("c", record_call, ("c2",)) == "c2"
        for frames in joins:  # and played back once rank 2 is a member: ignored
            _replay(a2, frames)
        time.sleep(0.5)  # a negative check: rank 2 keeps its member and its address
        assert a2.control.coordinator.members[2].incarnation == c2.io.incarnation
        assert a2.rpc_sync("c", record_call, ("c2 again",)) == "c2 again"
    finally:
        _stop_all(later)
