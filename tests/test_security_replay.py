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
====================================  ==========================================

The function it carries never runs a second time, and every member's
graceful shutdown still completes at once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq
from conftest import free_ports, intruder, local_group, poll_or_fail

from nbrpc.agent import Agent
from nbrpc.agent.messages import REQUEST
from nbrpc.transport import new_key

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
