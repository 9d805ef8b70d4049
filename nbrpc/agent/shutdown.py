"""Leaving the group: the member side of the graceful shutdown.

:class:`Shutdown` is one part of an :class:`~nbrpc.agent.agent.Agent`
(``agent.leaving``; :meth:`Agent.shutdown <nbrpc.agent.agent.Agent.shutdown>`
runs :meth:`Shutdown.shutdown`). A graceful shutdown drains twice (before and
after the upper layers' shutdown hooks): each round this member waits until
it has no call of its own outstanding, then reports its counters
(:class:`~.messages.DrainReport`) to the coordinator, whose
:class:`~.group.Coordinator` decides when the whole group is quiet (the
termination check is there, as pure state). A dynamic group's members leave
one at a time, as PyTorch's do, without drain rounds: each waits for its own
calls, then tells the coordinator (``Leave``), which tells the others
(``MemberLeft``). The coordinator's own leave is told to all the others, who
stay a group without it (no new member can join then). A group that falls apart while
waiting cuts the shutdown short (:meth:`Shutdown.cut_short`); every wait is
bounded by the shutdown's deadline.
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ..errors import RpcTimeoutError
from . import gcfreeze
from .messages import DrainReport, Leave, MemberLeft

log = logging.getLogger(__name__)


class Shutdown:
    """The member side of leaving the group (see the module docstring).

    Owns the drain rounds (``rounds``) and their verdicts from the
    coordinator (``verdicts``: round -> future of "is the group done?"), and
    ``cut``: why a graceful shutdown stopped waiting (the group fell apart),
    else None. ``agent`` is the :class:`~nbrpc.agent.agent.Agent` it is part
    of (its state, hooks and :meth:`~nbrpc.agent.agent.Agent._stop_local`;
    reports go through its control part); ``caller`` and ``callee`` hold the
    counts a drain report carries.
    """

    def __init__(self, agent: Any, caller: Any, callee: Any) -> None:
        self.agent, self.caller, self.callee = agent, caller, callee
        self.name, self.rank, self.world_size = agent.name, agent.rank, agent.world_size
        self.options, self.members = agent.options, agent.members
        self.verdicts: dict[int, Future] = {}  # shutdown round -> "done?"
        self.rounds = itertools.count()
        self.cut: str | None = None  # why a graceful shutdown stopped waiting

    def shutdown(self, graceful: bool = True, timeout: float = 0,
                 leak_check: bool = False) -> None:
        """Leave the group (see :meth:`Agent.shutdown <nbrpc.agent.agent.Agent.shutdown>`)."""
        agent = self.agent
        if agent.state in ("stopping", "stopped"):
            return
        limit = timeout if timeout > 0 else (self.options.rpc_timeout or 60.0)
        deadline = time.monotonic() + limit
        error: Exception | None = None
        if graceful and agent.state == "ready":
            agent.state = "stopping"
            if leak_check:  # unreachable RRefs in reference cycles are not leaks
                gcfreeze.thaw()  # (a frozen garbage cycle would hold them)
                gc.collect()  # (40 ms with torch loaded: only when asked)
            try:
                if self.rank != 0 and 0 not in self.members:  # the coordinator died
                    self._wait_local_idle(deadline, limit)
                    self._run_shutdown_hooks(leak_check)
                elif self.world_size is None:
                    self._wait_local_idle(deadline, limit, busy=True)
                    self._run_shutdown_hooks(leak_check)
                    self._wait_local_idle(deadline, limit, busy=True)
                    if self.rank != 0:
                        agent.control.send(0, Leave(self.rank))
                    else:  # the members stay a group: they hear a leave, not a death
                        agent.control.send_all([(r, MemberLeft(0, False, "left the group"))
                                                for r in self.members.ranks() if r != 0])
                else:  # every member runs both drains, so the rounds line up
                    self._drain_group(deadline, limit)
                    self._run_shutdown_hooks(leak_check)
                    self._drain_group(deadline, limit)
            except RpcTimeoutError as e:
                error = e
        if self.cut:
            log.warning("nbrpc agent %r: graceful shutdown cut short: %s", self.name, self.cut)
        agent._stop_local()
        if error is not None:
            raise error

    def cut_short(self, why: str) -> None:
        """Stop a graceful shutdown's waits: the group it waits for is gone."""
        self.cut = why
        for verdict in list(self.verdicts.values()):
            if not verdict.done():
                verdict.set_result(True)

    def on_verdict(self, rnd: int, done: bool) -> None:
        """The coordinator's verdict on drain round ``rnd`` (I/O thread)."""
        verdict = self.verdicts.get(rnd)
        if verdict is not None and not verdict.done():
            verdict.set_result(done)

    def _run_shutdown_hooks(self, leak_check: bool) -> None:
        for hook in self.agent.shutdown_hooks:
            hook(leak_check)

    def busy(self) -> int:
        """Unfinished protocol work of the upper layers (their ``busy_checks``)."""
        return sum(check() for check in self.agent.busy_checks)

    def _wait_local_idle(self, deadline: float, limit: float, busy: bool = False) -> None:
        pending = self.caller.pending
        while (pending or (busy and self.busy())) and not self.cut:
            if time.monotonic() > deadline:
                raise RpcTimeoutError(
                    f"shutdown waiting for {len(pending)} outstanding call(s) and "
                    f"{self.busy()} unfinished RRef message(s)", limit)
            time.sleep(0.002)

    def _drain_group(self, deadline: float, limit: float) -> None:
        while not self.cut:  # bounded by the deadline
            self._wait_local_idle(deadline, limit)
            rnd = next(self.rounds)
            verdict = self.verdicts[rnd] = Future()
            if self.cut:  # cut short before cut_short() could see this round's verdict
                del self.verdicts[rnd]
                return
            active = len(self.caller.pending) + self.busy()
            with self.caller.lock:
                report = DrainReport(rnd, active, dict(self.caller.sent_to),
                                     dict(self.callee.served_to))
            self.agent.control.send(0, report)
            try:
                done = verdict.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise RpcTimeoutError("graceful shutdown (waiting for the other workers)",
                                      limit) from None
            finally:
                del self.verdicts[rnd]
            if done or self.cut:
                return
            if active:  # protocol work waits on other workers: do not spin
                time.sleep(0.005)
