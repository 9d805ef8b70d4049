"""The member side of a graceful shutdown, as state (no network, no agent)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from nbrpc.agent.options import AgentOptions
from nbrpc.agent.shutdown import Shutdown


class _Caller:
    """A caller with nothing outstanding; ``on_read`` runs at each look."""

    def __init__(self, on_read=lambda: None) -> None:
        self.lock = threading.Lock()
        self.sent_to: dict[int, int] = {}
        self.on_read = on_read

    @property
    def pending(self) -> dict:
        self.on_read()
        return {}


def _shutdown(caller: _Caller, sent: list) -> Shutdown:
    agent = SimpleNamespace(name="worker1", rank=1, world_size=2, options=AgentOptions(),
                            members={0: "driver"}, busy_checks=[],
                            control=SimpleNamespace(send=lambda rank, msg: sent.append(msg)))
    return Shutdown(agent, caller, SimpleNamespace(served_to={}))


def test_a_round_waits_for_the_coordinators_verdict() -> None:
    sent: list = []
    leaving = _shutdown(_Caller(), sent)
    threading.Timer(0.05, lambda: leaving.on_verdict(0, True)).start()
    leaving._drain_group(time.monotonic() + 10, 10)
    assert [r.round for r in sent] == [0] and not leaving.verdicts


def test_a_group_gone_between_two_looks_does_not_leave_a_round_waiting() -> None:
    # cut short after the round's check of ``cut`` but before its verdict was
    # registered: cut_short() found no verdict to settle, so the round must look again
    sent: list = []
    leaving = _shutdown(_Caller(lambda: leaving.cut or leaving.cut_short("the coordinator died")),
                        sent)
    t0 = time.monotonic()
    leaving._drain_group(time.monotonic() + 5, 5)  # (it raised RpcTimeoutError after 5 s)
    assert time.monotonic() - t0 < 2.5 and leaving.cut == "the coordinator died"
    assert not leaving.verdicts
