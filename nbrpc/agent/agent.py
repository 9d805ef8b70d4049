"""The agent: one per RPC participant, owning all of that participant's state.

Several agents can live in one process (the in-process test tier does that);
nothing here is a module global except the thread-local "current agent".

Threads of one agent::

    caller thread ──pickle, sign──▶ peer's DEALER (under its lock) ──▶ peer
    peer ──▶ ROUTER ──▶ I/O thread ─┬─ RESPONSE: unpickle, complete the future
                                    ├─ CONTROL:  membership, heartbeats, shutdown
                                    ├─ INLINE:   protocol handler ─▶ reply
                                    └─ REQUEST:  worker pool ─▶ handler ─▶ reply
                                                 (the worker sends the reply itself)

Failure detection (see :mod:`.group`): a member whose connection closed (its
process exited, its host vanished) is declared dead after ``link_timeout``;
one that is only silent (busy, stopped) with its link up is not, unless
``failure_timeout`` is set (then after that long). Its calls fail with
:class:`WorkerGoneError`, upper layers' ``gone_hooks`` run (the RRef layer
releases the forks it held), and the shared-memory segments it left are
swept. Every ``heartbeat_interval`` members and the coordinator exchange
heartbeats; a member declared dead that is heard from again is taken back.

The class is put together from one mixin per seam, each in its own module:
:mod:`.caller` (send a request, match its answer), :mod:`.callee` (serve a
request, answer it), :mod:`.liveness` (control messages, heartbeats, failure
detection) and :mod:`.drain` (leaving the group). What travels with a message
is in :mod:`.wire`, the member table in :mod:`.members`, the coordinator's
pure state in :mod:`.group`; this module keeps the agent's state, its start
and the member table's side effects.

A REQUEST payload names its handler by ``op``. ``call`` is built in; upper
layers install more through :func:`register_extension` (the RRef layer adds
``remote``, ``rref_fetch``, ...).
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from ..errors import DeviceMapError, RendezvousError, WorkerGoneError
from ..serialize import CodeCache, parallel_copy
from ..transport import Envelope, IOLoop, shm
from . import devices, gcfreeze
from .callee import Callee
from .caller import Caller
from .current import _Default, _local, current_agent, set_default_agent  # noqa: F401
from .drain import Shutdown
from .events import EventLog
from .faults import FaultPlan
from .group import Coordinator, WorkerInfo, check_worker_name
from .liveness import Control
from .members import MemberTable
from .messages import Join, Member
from .options import AgentOptions, _check_options
from .pool import WorkerPool
from .wire import (  # noqa: F401 (the names upper layers import from here)
    INTERNAL,
    Deferred,
    MessageContext,
    Pending,
    Propagator,
    call_args,
    check_timeout,
    internal,
)

log = logging.getLogger(__name__)

_EXTENSIONS: list[Callable[[Agent], None]] = []


def register_extension(install: Callable[[Agent], None]) -> None:
    """Run ``install(agent)`` for every agent created from now on.

    Upper layers use it to add request handlers (``agent.handlers[op] = fn``),
    per-agent state (``agent.ext[name] = obj``) and snapshot sections.
    """
    _EXTENSIONS.append(install)


class Agent(Caller, Callee, Control, Shutdown):
    """One RPC participant. Create, :meth:`start`, call, :meth:`shutdown`.

    >>> from nbrpc.transport import new_key
    >>> a = Agent("solo", 0, new_key(), world_size=1)
    >>> a.start(None, timeout=5)
    >>> a.rpc_async("solo", pow, (2, 10)).wait()
    1024
    >>> a.shutdown()
    """

    def __init__(
        self,
        name: str,
        rank: int,
        key: bytes,
        *,
        world_size: int | None,
        options: AgentOptions | None = None,
    ) -> None:
        check_worker_name(name)  # as WorkerInfo does, before anything starts
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        self.name, self.rank, self.world_size = name, rank, world_size
        self.options = opts = options or AgentOptions()
        _check_options(opts)
        self._key = key
        self.info = WorkerInfo(name, rank)
        self.io = IOLoop(key, rank, self._on_message, name=f"nbrpc-io[{name}]",
                         copy=parallel_copy, max_message_size=opts.max_message_size,
                         max_age=opts.max_message_age, encrypt=opts.encrypt,
                         ipc=opts.local_ipc)
        self.address = self.io.bind(opts.host, opts.port)
        self.io.on_unread = self._unreadable
        if self.io.channels is not None:  # (threads that serve a caller's own channel)
            self.io.channels.on_thread_start = self._adopt_thread
            self.io.channels.limit = opts.num_worker_threads
        self._member = Member(name, rank, self.address, self.io.local_address, opts.devices,
                              opts.max_message_size, self.io.incarnation)
        if rank == 0:  # the coordinator draws the run every message of the group is signed for
            self.io.run = secrets.randbits(63) or 1
        self.device_plan = devices.DevicePlan()  # set once the members are known
        self.pool = WorkerPool(opts.num_worker_threads, f"nbrpc-worker[{name}]",
                               self._adopt_thread, self.io.call_later)
        self.events = EventLog(opts.event_log_size)
        self.codes = CodeCache()  # notebook code by value, once
        self.handlers: dict[str, Callable[[Any, int], Any]] = {"call": self._handle_call}
        self.ext: dict[str, Any] = {}
        self.snapshot_sections: dict[str, Callable[[], Any]] = {}
        # hooks of upper layers: a member died or left (run on the I/O thread);
        # unfinished protocol work (graceful shutdown waits for 0); shutdown
        # between its two drains (given leak_check)
        self.gone_hooks: list[Callable[[int], None]] = []
        self.busy_checks: list[Callable[[], int]] = []
        self.shutdown_hooks: list[Callable[[bool], None]] = []
        self.faults = FaultPlan()
        self.propagator: Propagator | None = None  # set by the autograd layer
        self.state = "new"
        self._pending: dict[int, Pending] = {}
        # requests that timed out with hooks on their answer: msg id -> (peer, wire)
        self._late_hooks: OrderedDict[int, tuple[int, MessageContext]] = OrderedDict()
        self._ids = itertools.count(1)
        self.members = MemberTable()
        self._coordinator = Coordinator(world_size) if rank == 0 else None
        self._joined = threading.Event()
        # Requests that arrived before this agent had the member table (a peer
        # that heard first called at once): served once it arrives (I/O thread).
        self._early: list[Envelope] = []
        self._join_error: str | None = None
        self._verdicts: dict[int, Future] = {}  # shutdown round -> "done?"
        self._rounds = itertools.count()
        self._lock = threading.Lock()
        self._sent: Counter[int] = Counter()  # requests sent, per peer (under _lock)
        self._served: Counter[int] = Counter()  # requests answered, per caller (under _lock)
        self._coordinator_seen = 0.0  # when rank 0 was last heard from
        self._coordinator_address: str | None = None
        self._last_tick = 0.0
        self._shutdown_cut: str | None = None  # why a graceful shutdown stopped waiting
        self.readmitted = 0  # members (or the coordinator) taken back after a wrong suspicion
        self._gc_held = False
        self.timeouts = self.late_replies = self.remote_errors = 0
        self.channels_busy = 0  # channel threads running a request (under _lock)
        for install in _EXTENSIONS:
            install(self)

    # -- lifecycle -----------------------------------------------------------
    def start(self, coordinator_address: str | None, timeout: float) -> None:
        """Start the threads and join the group; returns once members are known."""
        timeout = timeout if timeout > 0 else 60.0
        self.begin(coordinator_address)
        if not self.wait_joined(timeout):
            self.fail_join(timeout)

    def begin(self, coordinator_address: str | None) -> None:
        """Start the threads and send Join to the coordinator (returns at once)."""
        self.state = "joining"
        if self.options.gc_freeze and not self._gc_held:
            gcfreeze.hold()
            self._gc_held = True
        self.io.start()
        self.io.call_soon(self._adopt_thread)
        join = Join(self._member, self.world_size)
        if self.options.heartbeat_interval > 0:
            self._last_tick = time.monotonic()
            self.io.call_later(self.options.heartbeat_interval, self._tick)
        if self._coordinator is not None:
            self.io.call_soon(self._on_join, join)
        else:
            if coordinator_address is None:
                raise RendezvousError("a non-coordinator agent needs the coordinator's address")
            self._coordinator_address = coordinator_address
            self.io.set_address(0, coordinator_address)
            self._send_control(0, join)

    def wait_joined(self, timeout: float) -> bool:
        """Wait (bounded) for the member table; True once joined. A refusal
        from the coordinator stops the agent and raises RendezvousError."""
        if not self._joined.wait(timeout):
            return False
        if self._join_error:
            self._stop_local()
            raise RendezvousError(self._join_error)
        self._check_devices()
        if self.state == "ready":
            log.info("nbrpc agent %r (rank %d) ready at %s", self.name, self.rank, self.address)
        return True

    def _check_devices(self) -> None:
        """Check every member's device maps against every member's devices, as
        PyTorch's ``init_rpc`` does (a static group's ranks all see the same table,
        so all fail alike), and keep this agent's share; a misfit stops the agent
        and raises :class:`~nbrpc.errors.DeviceMapError`."""
        configs = {m.name: m.devices or devices.DeviceConfig() for m in self.members.members()}
        try:
            devices.check(configs, static=self.world_size is not None)
        except DeviceMapError:
            self._stop_local()
            raise
        self.device_plan = devices.plan(self.name, configs)

    def fail_join(self, timeout: float) -> None:
        """Stop, and raise the error for a join that did not complete in time."""
        self._stop_local()
        if self._join_error:  # the group failed, and some rank never came to hear it
            raise RendezvousError(f"{self._join_error} (and not every rank joined within "
                                  f"{timeout:g} s to be told so)")
        missing = ""
        if self._coordinator is not None and self.world_size is not None:
            have = sorted(self._coordinator.members)
            missing = (f" Joined so far: ranks {have} of world_size={self.world_size};"
                       " check that every rank calls init_rpc with the same init_method.")
        if self.rank != 0:
            missing += (" If rank 0 runs as another user or with another key "
                        "(NBRPC_SECRET_KEY, NBRPC_KEY_FILE), it drops this worker's messages "
                        "unread: give every rank the same NBRPC_SECRET_KEY.")
        if self.io.dropped_bad:
            missing += (f" {self.io.dropped_bad} message(s) signed with another key were "
                        "dropped here meanwhile: a rank with a different key tried to join.")
        raise RendezvousError(
            f"{self.name!r} could not join the group within {timeout:g} s.{missing}")


    def _adopt_thread(self) -> None:
        _local.agent = self

    # -- members (the table is .members; the side effects are here) -------------
    def resolve(self, to: Any) -> Member:
        """The member a destination (name, rank or WorkerInfo) names."""
        return self.members.resolve(to)

    def worker_infos(self) -> list[WorkerInfo]:
        return self.members.infos()

    def peer_name(self, rank: int) -> str:
        """The name of ``rank`` (a member's, a former member's, else ``rank<N>``)."""
        return self.members.peer_name(rank)

    def member_ranks(self) -> list[int]:
        """The current members' ranks, sorted."""
        return self.members.ranks()

    def rank_of(self, name: str) -> int | None:
        """The rank of the member (or former member) called ``name``, or None."""
        return self.members.rank_of(name)

    def _set_members(self, members: tuple[Member, ...]) -> None:
        for m in members:
            self._add_member(m)

    def _add_member(self, m: Member) -> None:
        self.members.add(m)
        if m.rank != self.rank:
            self.io.set_address(m.rank, m.address, m.local)

    def expel(self, rank: int, dead: bool = True, why: str | None = None) -> None:
        """Coordinator only: drop ``rank`` from the group now, as the failure
        detector would (``dead``) or as a leave, e.g. because its process is
        known to have exited. Everyone is told; calls to it fail at once."""
        if self._coordinator is None:
            raise RuntimeError(f"only the coordinator (rank 0) can expel a member, not {self.name!r}")

        def run() -> None:
            if rank in self.members and rank != self.rank:
                self._coordinator.banish(rank)  # that process is not taken back
                self._dispatch(self._coordinator.on_leave(rank, dead=dead, why=why))
                self._remove_member(rank, dead=dead, why=why)

        self.io.call_soon(run)

    def _remove_member(self, rank: int, dead: bool = False, why: str | None = None) -> None:
        why = why or ("died" if dead else "left the group")
        m = self.members.remove(rank, why)
        if m is None:
            return
        (log.warning if dead else log.info)("nbrpc agent %r: worker %r (rank %d) %s",
                                            self.name, m.name, rank, why)
        self.events.add("member-dead" if dead else "member-left", "", m.name, 0, 0)
        self.io.forget(rank)
        self.codes.forget(rank)
        for mid, p in list(self._pending.items()):
            if p.peer == rank and self._pending.pop(mid, None) is not None:
                if p.timer is not None:
                    self.io.cancel(p.timer)
                self._settle(p, error=WorkerGoneError(m.name, why))
        for hook in self.gone_hooks:
            try:
                hook(rank)
            except Exception:
                log.exception("a member-gone hook failed for rank %d", rank)
        if rank == 0 and self.state == "stopping":
            self._cut_shutdown(f"the coordinator {m.name!r} {why}")
        if dead:  # a killed process leaves its shared-memory segments behind
            try:
                shm.sweep_orphans()
            except Exception:
                log.exception("sweeping shared-memory segments of rank %d failed", rank)

    def is_member(self, rank: int) -> bool:
        """Whether ``rank`` is in this agent's current member table."""
        return rank in self.members

    def gone_why(self, rank: int) -> str | None:
        """Why ``rank`` is no longer a member ("died (no heartbeat ...)"), or None."""
        return self.members.gone_why(rank)

    @property
    def sent(self) -> int:
        """Requests sent since start."""
        return sum(self._sent.values())

    @property
    def served(self) -> int:
        """Requests answered since start."""
        return sum(self._served.values())

    # -- calls: caller side --------------------------------------------------


    # -- calls: callee side --------------------------------------------------


    # -- control -------------------------------------------------------------


    # -- failure detection (on the I/O thread) ---------------------------------


    # -- observability -------------------------------------------------------

    def snapshot(self, events: int | None = 200) -> dict[str, Any]:
        """This agent's state as plain data (the debug layer gathers these)."""
        now = time.perf_counter()
        snap = {
            "name": self.name,
            "rank": self.rank,
            "address": self.address,
            "state": self.state,
            "world_size": self.world_size,
            "members": [{"name": m.name, "rank": m.rank, "address": m.address}
                        for m in self.members.members()],
            "devices": {"cuda_count": getattr(self.options.devices, "count", 0),
                        "served": list(self.device_plan.devices),
                        "reverse_maps": {n: dict(m) for n, m in self.device_plan.reverse_maps}},
            "counters": {
                "requests_sent": self.sent,
                "requests_served": self.served,
                "protocol_busy": self._busy(),
                "messages_sent": self.io.sent_msgs,
                "messages_received": self.io.recv_msgs,
                "bytes_sent": self.io.sent_bytes,
                "bytes_received": self.io.recv_bytes,
                "dropped_bad_signature": self.io.dropped_bad,
                "dropped": dict(self.io.dropped),
                "readmitted": self.readmitted,
                "in_flight": len(self._pending),
                "timeouts": self.timeouts,
                "late_replies": self.late_replies,
                "remote_errors": self.remote_errors,
                "code_cache": self.codes.stats(),
                "threads": self.pool.size,
                "busy_threads": self.pool.busy,
                "queued": self.pool.queued,
                "channels": self.io.channels.served if self.io.channels is not None else 0,
                "channels_busy": self.channels_busy,
            },
            "in_flight": [
                {"msg_id": mid, "op": p.op, "peer": self.peer_name(p.peer),
                 "age": now - p.started}
                for mid, p in list(self._pending.items())
            ],
            "events": self.events.records(events),
        }
        for name, section in self.snapshot_sections.items():
            snap[name] = section()
        return snap

    def __repr__(self) -> str:
        return f"<nbrpc Agent {self.name!r} rank={self.rank} {self.state} at {self.address}>"


