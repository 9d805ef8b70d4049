"""Leaving the group: the member side of the graceful shutdown.

Mixed into :class:`~nbrpc.agent.agent.Agent`. A graceful shutdown drains
twice (before and after the upper layers' shutdown hooks): each round this
member waits until it has no call of its own outstanding, then reports its
counters (:class:`~.messages.DrainReport`) to the coordinator, whose
:class:`~.group.Coordinator` decides when the whole group is quiet (the
termination check is there, as pure state). A group that falls apart while
waiting cuts the shutdown short (:meth:`Shutdown._cut_shutdown`); every wait
is bounded by the shutdown's deadline.
"""

from __future__ import annotations

import gc
import logging
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout

from ..errors import RpcTimeoutError, ShutdownError
from . import gcfreeze
from .current import _Default
from .messages import DrainReport, Leave

log = logging.getLogger(__name__)


class Shutdown:
    """The member side of leaving the group (see the module docstring)."""

    def shutdown(self, graceful: bool = True, timeout: float = 0,
                 leak_check: bool = False) -> None:
        """Leave the group. Graceful: first wait until the whole (static) group
        has no call, in any direction, still outstanding; then run the
        ``shutdown_hooks`` (the RRef layer reports leaks if ``leak_check`` and
        deletes its user RRefs) and wait again for what they sent."""
        if self.state in ("stopping", "stopped"):
            return
        limit = timeout if timeout > 0 else (self.options.rpc_timeout or 60.0)
        deadline = time.monotonic() + limit
        error: Exception | None = None
        if graceful and self.state == "ready":
            self.state = "stopping"
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
                        self._send_control(0, Leave(self.rank))
                else:  # every member runs both drains, so the rounds line up
                    self._drain_group(deadline, limit)
                    self._run_shutdown_hooks(leak_check)
                    self._drain_group(deadline, limit)
            except RpcTimeoutError as e:
                error = e
        if self._shutdown_cut:
            log.warning("nbrpc agent %r: graceful shutdown cut short: %s", self.name,
                        self._shutdown_cut)
        self._stop_local()
        if error is not None:
            raise error

    def _cut_shutdown(self, why: str) -> None:
        """Stop a graceful shutdown's waits: the group it waits for is gone."""
        self._shutdown_cut = why
        for verdict in list(self._verdicts.values()):
            if not verdict.done():
                verdict.set_result(True)

    def _run_shutdown_hooks(self, leak_check: bool) -> None:
        for hook in self.shutdown_hooks:
            hook(leak_check)

    def _busy(self) -> int:
        return sum(check() for check in self.busy_checks)

    def _stop_local(self) -> None:
        self.state = "stopped"
        self.io.stop()
        if self._gc_held:
            self._gc_held = False
            gcfreeze.release()
        stuck = self.pool.stop(timeout=2.0)
        if stuck:
            log.warning("nbrpc agent %r: worker threads still running user code at "
                        "shutdown: %s", self.name, ", ".join(stuck))
        for mid in list(self._pending):
            p = self._pending.pop(mid, None)
            if p is not None and not p.future.done():
                p.settle(error=ShutdownError(
                    f"{self.name!r} shut down before {self.peer_name(p.peer)!r} answered"))
        if _Default.agent is self:
            _Default.agent = None

    def _wait_local_idle(self, deadline: float, limit: float, busy: bool = False) -> None:
        while (self._pending or (busy and self._busy())) and not self._shutdown_cut:
            if time.monotonic() > deadline:
                raise RpcTimeoutError(
                    f"shutdown waiting for {len(self._pending)} outstanding call(s) and "
                    f"{self._busy()} unfinished RRef message(s)", limit)
            time.sleep(0.002)

    def _drain_group(self, deadline: float, limit: float) -> None:
        while not self._shutdown_cut:  # bounded by the deadline
            self._wait_local_idle(deadline, limit)
            rnd = next(self._rounds)
            verdict = self._verdicts[rnd] = Future()
            active = len(self._pending) + self._busy()
            with self._lock:
                report = DrainReport(rnd, active, dict(self._sent), dict(self._served))
            self._send_control(0, report)
            try:
                done = verdict.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeout:
                raise RpcTimeoutError("graceful shutdown (waiting for the other workers)",
                                      limit) from None
            finally:
                del self._verdicts[rnd]
            if done or self._shutdown_cut:
                return
            if active:  # protocol work waits on other workers: do not spin
                time.sleep(0.005)
