"""The agent: one per RPC participant, owning all of that participant's state.

Several agents can live in one process (the in-process test tier does that);
nothing here is a module global except the thread-local "current agent" and
the process default (:func:`current_agent`).

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

The agent is put together from one part per seam, each an object with its
own state, in a module of its name: :class:`~.caller.Caller` (send a
request, match its answer: ``agent.caller``), :class:`~.callee.Callee`
(serve a request, answer it: ``agent.callee``), :class:`~.control.Control`
(control messages, heartbeats, failure detection: ``agent.control``) and
:class:`~.shutdown.Shutdown` (leaving the group: ``agent.leaving``). The
agent owns the dispatch of incoming messages (``agent.routes``: message kind
-> the part's handler), its start and stop, and the member table's side
effects; its public calls that a part implements are thin delegations. What
travels with a message is in :mod:`.wire`, the member table in
:mod:`.members`, the coordinator's pure state in :mod:`.group`.

A REQUEST payload names its handler by ``op``. ``call`` is built in; upper
layers install more through :func:`register_extension` (the RRef layer adds
``remote``, ``rref_fetch``, ...).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import DeviceMapError, NotInitializedError, RendezvousError
from ..serialize import CodeCache, parallel_copy
from ..transport import Envelope, IOLoop, shm
from ..transport.local import same_identity
from . import devices, gcfreeze
from .callee import Callee
from .caller import Caller
from .control import Control
from .events import EventLog
from .faults import FaultPlan
from .futures import RpcFuture
from .group import WorkerInfo, check_worker_name
from .members import MemberTable
from .messages import CONTROL, INLINE, REQUEST, RESPONSE, Join, Member
from .options import AgentOptions, _check_options
from .pool import WorkerPool
from .shutdown import Shutdown
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
_IN_THIS_PROCESS: set[int] = set()  # the incarnations of the agents made in this process

_local = threading.local()  # .agent: the agent of an agent's own threads


class _Default:
    agent: Agent | None = None  # the process default, set by nbrpc.rpc.init_rpc


def current_agent(what: str = "this call") -> Agent:
    """The agent of this thread: an agent's own threads use their agent, any
    other thread the process default set by ``init_rpc``."""
    agent = getattr(_local, "agent", None) or _Default.agent
    if agent is None:
        raise NotInitializedError(what)
    return agent


def set_default_agent(agent: Agent | None) -> None:
    _Default.agent = agent


def register_extension(install: Callable[[Agent], None]) -> None:
    """Run ``install(agent)`` for every agent created from now on.

    Upper layers use it to add request handlers (``agent.handlers[op] = fn``),
    per-agent state (``agent.ext[name] = obj``) and snapshot sections.
    """
    _EXTENSIONS.append(install)


class Agent:
    """One RPC participant. Create, :meth:`start`, call, :meth:`shutdown`.

    The agent holds what its parts share (the I/O loop ``io``, the worker
    ``pool``, the member table ``members``, ``events``, ``codes``,
    ``handlers``, ``ext``, the upper layers' hooks, ``state``, ``options``)
    and its parts: ``caller`` (:class:`~.caller.Caller`), ``callee``
    (:class:`~.callee.Callee`), ``control`` (:class:`~.control.Control`) and
    ``leaving`` (:class:`~.shutdown.Shutdown`), each the owner of its own
    state. ``routes`` is its dispatch of incoming messages by kind.

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
        self.io = IOLoop(key, rank, self.dispatch, name=f"nbrpc-io[{name}]",
                         copy=parallel_copy, max_message_size=opts.max_message_size,
                         max_age=opts.max_message_age, encrypt=opts.encrypt,
                         ipc=opts.local_ipc)
        self.address = self.io.bind(opts.host, opts.port)
        if self.io.channels is not None:  # (threads that serve a caller's own channel)
            self.io.channels.on_thread_start = self._adopt_thread
            self.io.channels.limit = opts.num_worker_threads
        self.me = Member(name, rank, self.address, self.io.local_address, opts.devices,
                         opts.max_message_size, self.io.incarnation)  # this agent's record
        if rank == 0:  # the coordinator draws the run every message of the group is signed for
            self.io.run = secrets.randbits(63) or 1
        self.device_plan = devices.DevicePlan()  # set once the members are known
        # where tensors go: (peer, is an answer) -> device map, or None (filled as
        # used, emptied as members change)
        self._routes: dict[tuple[int, bool], dict[str, str] | None] = {}
        _IN_THIS_PROCESS.add(self.io.incarnation)
        self.pool = WorkerPool(opts.num_worker_threads, f"nbrpc-worker[{name}]",
                               self._adopt_thread, self.io.call_later)
        self.events = EventLog(opts.event_log_size)
        self.codes = CodeCache()  # notebook code by value, once
        self.handlers: dict[str, Callable[[Any, int], Any]] = {}
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
        self.members = MemberTable()
        self.cpu_mapped = self._maps_cpu()  # does a map tensors from here may follow name "cpu"
        self._gc_held = False
        # the parts, each with its own state (the counts of requests sent and
        # served share one lock: a drain report reads both under it)
        counts = threading.Lock()
        self.caller = Caller(self, counts)
        self.callee = Callee(self, self.caller, counts)
        self.leaving = Shutdown(self, self.caller, self.callee)
        self.control = Control(self, self.callee, self.leaving)
        self.handlers["call"] = self.callee.handle_call
        self.io.on_unread = self.callee.unreadable
        # the dispatch of incoming messages (on the I/O thread, or on the
        # thread that reads its own channel): message kind -> handler
        self.routes: dict[int, Callable[[Envelope], None]] = {
            RESPONSE: self.caller.complete,
            REQUEST: self.callee.on_request,
            INLINE: self.callee.on_inline,
            CONTROL: self.control.on_message,
        }
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
        join = Join(self.me, self.world_size)
        if self.options.heartbeat_interval > 0:
            self.control.last_tick = time.monotonic()
            self.io.call_later(self.options.heartbeat_interval, self.control.tick)
        if self.control.coordinator is not None:
            self.io.call_soon(self.control.on_join, join)
        else:
            if coordinator_address is None:
                raise RendezvousError("a non-coordinator agent needs the coordinator's address")
            self.control.coordinator_address = coordinator_address
            self.io.set_address(0, coordinator_address)
            self.control.send(0, join)
            retry = self.options.control_retry
            self.io.call_later(retry, self.control.retry_join, 2 * retry)

    def wait_joined(self, timeout: float) -> bool:
        """Wait (bounded) for the member table; True once joined. A refusal
        from the coordinator stops the agent and raises RendezvousError."""
        if not self.control.joined.wait(timeout):
            return False
        if self.control.join_error:
            self._stop_local()
            raise RendezvousError(self.control.join_error)
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
        if self.control.join_error:  # the group failed, and some rank never came to hear it
            raise RendezvousError(f"{self.control.join_error} (and not every rank joined within "
                                  f"{timeout:g} s to be told so)")
        missing = ""
        if self.control.coordinator is not None and self.world_size is not None:
            have = sorted(self.control.coordinator.members)
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

    def set_members(self, members: tuple[Member, ...]) -> None:
        for m in members:
            self.add_member(m)

    def add_member(self, m: Member) -> None:
        self.members.add(m)
        self._routes.clear()
        self.cpu_mapped = self._maps_cpu()
        if m.rank != self.rank:
            self.io.set_address(m.rank, m.address, m.local)

    # -- where tensors go --------------------------------------------------------
    def _maps_cpu(self) -> bool:
        """Whether a map that tensors sent from here may follow names "cpu": this
        agent's own maps (or its home is the CPU), or a current member's map to
        it (its answers' CPU tensors may then come from a GPU here)."""
        mine = self.me.devices
        if mine is not None and (mine.home == "cpu" or any(
                "cpu" in dict(pairs) for _, pairs in mine.maps)):
            return True
        return any(m.devices is not None and m.rank != self.rank
                   and "cpu" in m.devices.map_to(self.name, mine).values()
                   for m in self.members.members())

    def device_map_to(self, peer: int, reply: bool) -> dict[str, str] | None:
        """The device map a message to ``peer`` follows: for a request, this
        agent's map to it; for an answer, the caller's map to this agent,
        inverted (PyTorch's reverse device map). None where there is none."""
        key = (peer, reply)
        try:
            return self._routes[key]
        except KeyError:
            pass
        m, mine = self.members.get(peer), self.me.devices
        theirs = m.devices if m is not None else None
        if reply:
            pairs = theirs.map_to(self.name, mine) if theirs else {}
            found = devices.inverse(pairs.items()) or None
        else:
            found = (mine.map_to(self.members.peer_name(peer), theirs) if mine else {}) or None
        self._routes[key] = found
        return found

    def peer_place(self, peer: int) -> str:
        """Where ``peer`` runs, for CUDA tensors: ``"process"`` (this process),
        ``"host"`` (this host, as this user, numbering the GPUs as this process
        does: CUDA IPC reaches it) or ``"remote"`` (staged through host memory)."""
        m = self.members.get(peer)
        if peer == self.rank or (m is not None and m.incarnation in _IN_THIS_PROCESS):
            return "process"
        if m is None or not same_identity(m.local):
            return "remote"
        mine, theirs = self.me.devices, m.devices
        if mine is None or theirs is None or mine.visible != theirs.visible:
            return "remote"  # (CUDA IPC handles name a device by its index here)
        return "host"

    def expel(self, rank: int, dead: bool = True, why: str | None = None) -> None:
        """Coordinator only: drop ``rank`` from the group now, as the failure
        detector would (``dead``) or as a leave, e.g. because its process is
        known to have exited. Everyone is told; calls to it fail at once."""
        if self.control.coordinator is None:
            raise RuntimeError(
                f"only the coordinator (rank 0) can expel a member, not {self.name!r}")

        control = self.control

        def run() -> None:
            if rank in self.members and rank != self.rank:
                control.coordinator.banish(rank)  # that process is not taken back
                control.send_all(control.coordinator.on_leave(rank, dead=dead, why=why))
                self.remove_member(rank, dead=dead, why=why)

        self.io.call_soon(run)

    def remove_member(self, rank: int, dead: bool = False, why: str | None = None) -> None:
        why = why or ("died" if dead else "left the group")
        self._routes.clear()
        m = self.members.remove(rank, why)
        if m is None:
            return
        self.cpu_mapped = self._maps_cpu()
        (log.warning if dead else log.info)("nbrpc agent %r: worker %r (rank %d) %s",
                                            self.name, m.name, rank, why)
        self.events.add("member-dead" if dead else "member-left", "", m.name, 0, 0)
        self.io.forget(rank)
        self.codes.forget(rank)
        self.caller.fail_calls_to(rank, m.name, why)
        for hook in self.gone_hooks:
            try:
                hook(rank)
            except Exception:
                log.exception("a member-gone hook failed for rank %d", rank)
        if rank == 0 and self.state == "stopping":
            self.leaving.cut_short(f"the coordinator {m.name!r} {why}")
        if dead:  # a killed process leaves its shared-memory segments behind
            try:
                shm.sweep_orphans()
            except Exception:
                log.exception("sweeping shared-memory segments of rank %d failed", rank)

    def is_member(self, rank: int) -> bool:
        """Whether ``rank`` is in this agent's current member table."""
        return rank in self.members

    def silent_for(self, rank: int) -> float | None:
        """Coordinator only: seconds since member ``rank`` was last heard from
        (a worker busy in a call that holds its GIL, or stopped, stays a member
        while its connection is up: this says how long it has been quiet);
        None elsewhere, or for a rank that is not a watched member."""
        coordinator = self.control.coordinator
        seen = coordinator.last_seen.get(rank) if coordinator is not None else None
        return None if seen is None else max(0.0, time.monotonic() - seen)

    def gone_why(self, rank: int) -> str | None:
        """Why ``rank`` is no longer a member ("died (its connection closed)"), or None."""
        return self.members.gone_why(rank)

    # -- incoming messages: the agent's dispatch ----------------------------
    def dispatch(self, env: Envelope) -> None:
        """The I/O loop's callback (and a reading channel's; the callee's, for
        requests it held while joining): hand ``env`` to the part that handles
        its kind (:attr:`routes`)."""
        if env.run != self.io.run and not self._before_run(env):
            return
        handler = self.routes.get(env.kind)
        if handler is None:
            self.io.note_drop("unknown kind", f"kind {env.kind} from rank {env.sender}")
        else:
            handler(env)

    def _before_run(self, env: Envelope) -> bool:
        """May ``env``, of another run than this agent's (the transport let it
        through because one of the two is not known yet: 0), go on? A joiner's
        Join and the answer to it do (the control handler checks which), and
        requests that reach a joiner are held until it knows the run (then
        looked at again); the rest is refused as a recorded message."""
        if env.kind == CONTROL or (self.io.run == 0 and env.kind in (REQUEST, INLINE)):
            return True
        self.io.note_drop("wrong run", f"kind {env.kind} from rank {env.sender}, run "
                                       f"{env.run:x} (this is run {self.io.run:x})")
        return False

    # -- calls: the caller and callee parts ----------------------------------
    def rpc_async(self, to: Any, fn: Callable, args: tuple | None = None,
                  kwargs: dict | None = None, timeout: float = -1.0,
                  keep: Any = None) -> RpcFuture:
        """Run ``fn(*args, **kwargs)`` on ``to``; returns a future of the result
        (:meth:`Caller.rpc_async <.caller.Caller.rpc_async>`)."""
        __tracebackhide__ = True
        return self.caller.rpc_async(to, fn, args, kwargs, timeout, keep)

    def rpc_sync(self, to: Any, fn: Callable, args: tuple | None = None,
                 kwargs: dict | None = None, timeout: float = -1.0, keep: Any = None) -> Any:
        """Run ``fn(*args, **kwargs)`` on ``to`` and wait for the result
        (:meth:`Caller.rpc_sync <.caller.Caller.rpc_sync>`)."""
        __tracebackhide__ = True
        return self.caller.rpc_sync(to, fn, args, kwargs, timeout, keep)

    def request(self, to: Any, msg: Any, timeout: float = -1.0, inline: bool = False,
                keep: Any = None,
                then: Callable[[Any, BaseException | None], None] | None = None,
                tagged: bool = False, sync: bool = False,
                along: int | None = None) -> RpcFuture:
        """Send a typed request; the future completes with the handler's answer
        (:meth:`Caller.request <.caller.Caller.request>` says what the options do)."""
        __tracebackhide__ = True
        return self.caller.request(to, msg, timeout, inline, keep, then, tagged, sync, along)

    def unanswered_since(self, started: float) -> int:
        """Calls this agent sent at or after ``started`` (``time.perf_counter()``)
        that have no answer yet."""
        return self.caller.unanswered_since(started)

    def user_error(self, op: str, sender: int, e: BaseException) -> None:
        """Log a failure of code run for ``sender`` (:meth:`Callee.user_error
        <.callee.Callee.user_error>`)."""
        self.callee.user_error(op, sender, e)

    @property
    def sent(self) -> int:
        """Requests sent since start."""
        return sum(self.caller.sent_to.values())

    @property
    def served(self) -> int:
        """Requests answered since start."""
        return sum(self.callee.served_to.values())

    @property
    def late_replies(self) -> int:
        """Answers that came after their call timed out (or to no call), discarded."""
        return self.caller.late_replies

    @property
    def readmitted(self) -> int:
        """Members (or the coordinator) taken back after a wrong suspicion."""
        return self.control.readmitted

    # -- leaving -------------------------------------------------------------
    def shutdown(self, graceful: bool = True, timeout: float = 0,
                 leak_check: bool = False) -> None:
        """Leave the group. Graceful: first wait until the whole (static) group
        has no call, in any direction, still outstanding; then run the
        ``shutdown_hooks`` (the RRef layer reports leaks if ``leak_check`` and
        deletes its user RRefs) and wait again for what they sent
        (:class:`~.shutdown.Shutdown`)."""
        self.leaving.shutdown(graceful, timeout, leak_check)

    def _stop_local(self) -> None:
        """Stop this agent's threads; calls still waiting fail."""
        self.state = "stopped"
        self.io.stop()
        _IN_THIS_PROCESS.discard(self.io.incarnation)
        if self._gc_held:
            self._gc_held = False
            gcfreeze.release()
        stuck = self.pool.stop(timeout=2.0)
        if stuck:
            log.warning("nbrpc agent %r: worker threads still running user code at "
                        "shutdown: %s", self.name, ", ".join(stuck))
        self.caller.fail_all()
        if _Default.agent is self:
            _Default.agent = None

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
                "protocol_busy": self.leaving.busy(),
                "messages_sent": self.io.sent_msgs,
                "messages_received": self.io.recv_msgs,
                "bytes_sent": self.io.sent_bytes,
                "bytes_received": self.io.recv_bytes,
                "dropped_bad_signature": self.io.dropped_bad,
                "dropped": dict(self.io.dropped),
                "readmitted": self.control.readmitted,
                "in_flight": len(self.caller.pending),
                "timeouts": self.caller.timeouts,
                "late_replies": self.caller.late_replies,
                "remote_errors": self.caller.remote_errors,
                "code_cache": self.codes.stats(),
                "threads": self.pool.size,
                "busy_threads": self.pool.busy,
                "queued": self.pool.queued,
                "channels": self.io.channels.served if self.io.channels is not None else 0,
                "channels_busy": self.callee.channels_busy,
            },
            "in_flight": [
                {"msg_id": mid, "op": p.op, "peer": self.peer_name(p.peer),
                 "age": now - p.started}
                for mid, p in list(self.caller.pending.items())
            ],
            "events": self.events.records(events),
        }
        for name, section in self.snapshot_sections.items():
            snap[name] = section()
        return snap

    def __repr__(self) -> str:
        return f"<nbrpc Agent {self.name!r} rank={self.rank} {self.state} at {self.address}>"


