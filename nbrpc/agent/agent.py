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
process exited) is declared dead after ``link_timeout``; one that is only
silent (busy, stopped) after ``failure_timeout``. Its calls fail with
:class:`WorkerGoneError`, upper layers' ``gone_hooks`` run (the RRef layer
releases the forks it held), and the shared-memory segments it left are
swept. Every ``heartbeat_interval`` members and the coordinator exchange
heartbeats; a member declared dead that is heard from again is taken back.

A REQUEST payload names its handler by ``op``. ``call`` is built in; upper
layers install more through :func:`register_extension` (the RRef layer adds
``remote``, ``rref_fetch``, ...).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future as Verdict
from concurrent.futures import TimeoutError as VerdictTimeout
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import (
    NotInitializedError,
    RendezvousError,
    RpcTimeoutError,
    SerializationError,
    ShutdownError,
    WorkerGoneError,
)
from ..serialize import current_context, dumps, loads, parallel_copy
from ..transport import Envelope, IOLoop, shm
from ..transport.frames import DEFAULT_MAX_MESSAGE
from . import gcfreeze
from .asyncfn import check_future, is_async
from .events import EventLog
from .faults import FaultPlan
from .futures import RpcFuture, on_done, outcome
from .group import Coordinator, WorkerInfo, check_worker_name
from .members import MemberTable
from .messages import (
    CONTROL,
    INLINE,
    REQUEST,
    RESPONSE,
    Call,
    DrainReport,
    DrainVerdict,
    Heartbeat,
    Join,
    Leave,
    Member,
    MemberJoined,
    MemberLeft,
    Members,
    Ok,
)
from .pool import WorkerPool, blocking
from .remote_errors import pack_error, rebuild_error

log = logging.getLogger(__name__)

_LOGGED = "_nbrpc_logged"  # set on an error user_error has logged
MAX_EARLY = 10_000  # requests held while joining (peers that heard first call at once)

_local = threading.local()
_EXTENSIONS: list[Callable[[Agent], None]] = []

def register_extension(install: Callable[[Agent], None]) -> None:
    """Run ``install(agent)`` for every agent created from now on.

    Upper layers use it to add request handlers (``agent.handlers[op] = fn``),
    per-agent state (``agent.ext[name] = obj``) and snapshot sections.
    """
    _EXTENSIONS.append(install)


def current_agent(what: str = "this call") -> Agent:
    """The agent of this thread: an agent's own threads use their agent, any
    other thread the process default set by ``init_rpc``."""
    agent = getattr(_local, "agent", None) or _Default.agent
    if agent is None:
        raise NotInitializedError(what)
    return agent


class _Default:
    agent: Agent | None = None  # the process default, set by nbrpc.rpc.init_rpc


def set_default_agent(agent: Agent | None) -> None:
    _Default.agent = agent


class Wire:
    """What a reducer sees (``nbrpc.serialize.current_context()``) while a
    message is pickled or unpickled: this agent, the peer at the other end,
    ``undo`` callbacks to run if the message is never sent, the value the
    message propagates (``tag``: the autograd context id) and a scratch dict
    for upper layers (``stash``: one autograd message id per message)."""

    __slots__ = ("agent", "peer", "undo", "tag", "stash", "before")

    def __init__(self, agent: Agent, peer: int, tag: Any = None) -> None:
        self.agent, self.peer, self.tag = agent, peer, tag
        self.undo: list[Callable[[], None]] | None = None
        self.stash: dict[str, Any] | None = None
        self.before: list[threading.Event] | None = None

    def run_after(self, event: threading.Event) -> None:
        """A request being unpickled: run its handler once ``event`` is set
        (bounded by the RPC timeout). Replies and inline messages do not wait."""
        if self.before is None:
            self.before = []
        self.before.append(event)

    def on_unsent(self, fn: Callable[[], None]) -> None:
        if self.undo is None:
            self.undo = []
        self.undo.append(fn)

    def unsent(self) -> None:
        for fn in self.undo or ():
            try:
                fn()
            except Exception:
                log.exception("undoing an unsent message's side effects failed")


class Propagator:
    """How an upper layer propagates a value with requests (the autograd layer:
    the context id). ``current()`` is the calling thread's value or None; the
    receiver runs the request's handler inside ``enter(value)``."""

    def current(self) -> Any:
        return None

    def enter(self, value: Any) -> Any:  # a context manager
        raise NotImplementedError

    def sent(self, value: Any, peer: int) -> None:
        """A request carrying ``value`` is going to ``peer``."""


class _Tag:
    """First item of a tagged payload: unpickling it sets the receiving
    Wire's tag before the message itself is rebuilt, so reducers see it."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple:
        return _restore_tag, (self.value,)


def _restore_tag(value: Any) -> type:
    current_context().tag = value
    return _Tag


@dataclass(slots=True)
class _Pending:
    future: RpcFuture
    peer: int
    op: str
    started: float
    timer: list | None = None
    keep: Any = None  # held until the answer (an RRef must outlive its call)
    then: Callable[[Any, BaseException | None], None] | None = None
    wire: Wire | None = None  # undo of what pickling did, if the callee cannot read it

    def settle(self, value: Any = None, error: BaseException | None = None) -> None:
        """Complete the future, then run ``then`` (on the completing thread).
        ``then`` is a plain call: a torch done-callback costs a GIL round trip."""
        if error is None:
            self.future.set_result(value)
        else:
            self.future.set_exception(error)
        if self.then is not None:
            try:
                self.then(value, error)
            except Exception:
                log.exception("a request's completion hook failed")
        self.keep = self.then = self.wire = None


@dataclass(slots=True)
class Deferred:
    """Returned by a handler whose answer is a future (``async_execution``)."""

    future: torch.futures.Future


@dataclass
class AgentOptions:
    num_worker_threads: int = 16
    rpc_timeout: float = 60.0
    host: str = "127.0.0.1"
    port: int = 0
    event_log_size: int = 10_000
    heartbeat_interval: float = 0.5  # seconds between heartbeats; 0 turns detection off
    # a member silent this long while its connection stays up (busy, stopped, or
    # its host unreachable) is declared dead
    failure_timeout: float = 30.0
    # a member whose connection closed (its process exited) and that has been
    # silent this long is declared dead
    link_timeout: float = 1.0
    max_message_size: int = DEFAULT_MAX_MESSAGE  # bytes a received message may declare
    max_message_age: float = 300.0  # older (by the sender's clock) is refused as a replay
    encrypt: bool = False  # CURVE-encrypt every connection (untrusted networks)
    control_retry: float = 1.0  # first retry of an unanswered protocol message (doubles)
    gc_freeze: bool = True  # keep full GC collections short while running (see gcfreeze)


class Agent:
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
                         max_age=opts.max_message_age, encrypt=opts.encrypt)
        self.address = self.io.bind(opts.host, opts.port)
        self._member = Member(name, rank, self.address)
        self.pool = WorkerPool(opts.num_worker_threads, f"nbrpc-worker[{name}]",
                               self._adopt_thread, self.io.call_later)
        self.events = EventLog(opts.event_log_size)
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
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self.members = MemberTable()
        self._coordinator = Coordinator(world_size) if rank == 0 else None
        self._joined = threading.Event()
        # Requests that arrived before this agent had the member table (a peer
        # that heard first called at once): served once it arrives (I/O thread).
        self._early: list[Envelope] = []
        self._join_error: str | None = None
        self._verdicts: dict[int, Verdict] = {}  # shutdown round -> "done?"
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
        if self.state == "ready":
            log.info("nbrpc agent %r (rank %d) ready at %s", self.name, self.rank, self.address)
        return True

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
            verdict = self._verdicts[rnd] = Verdict()
            active = len(self._pending) + self._busy()
            with self._lock:
                report = DrainReport(rnd, active, dict(self._sent), dict(self._served))
            self._send_control(0, report)
            try:
                done = verdict.result(timeout=max(0.0, deadline - time.monotonic()))
            except VerdictTimeout:
                raise RpcTimeoutError("graceful shutdown (waiting for the other workers)",
                                      limit) from None
            finally:
                del self._verdicts[rnd]
            if done or self._shutdown_cut:
                return
            if active:  # protocol work waits on other workers: do not spin
                time.sleep(0.005)

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
            self.io.set_address(m.rank, m.address)

    def expel(self, rank: int, dead: bool = True, why: str | None = None) -> None:
        """Coordinator only: drop ``rank`` from the group now, as the failure
        detector would (``dead``) or as a leave, e.g. because its process is
        known to have exited. Everyone is told; calls to it fail at once."""
        if self._coordinator is None:
            raise RuntimeError(f"only the coordinator (rank 0) can expel a member, not {self.name!r}")

        def run() -> None:
            if rank in self.members and rank != self.rank:
                self._dispatch(self._coordinator.on_leave(rank, dead=dead, why=why))
                self._remove_member(rank, dead=dead, why=why)

        self.io.call_soon(run)

    def _remove_member(self, rank: int, dead: bool = False, why: str | None = None) -> None:
        why = why or ("died (no heartbeat for "
                      f"{self.options.failure_timeout:g} s)" if dead else "left the group")
        m = self.members.remove(rank, why)
        if m is None:
            return
        (log.warning if dead else log.info)("nbrpc agent %r: worker %r (rank %d) %s",
                                            self.name, m.name, rank, why)
        self.events.add("member-dead" if dead else "member-left", "", m.name, 0, 0)
        self.io.forget(rank)
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
    def rpc_async(self, to: Any, fn: Callable, args: tuple | None = None,
                  kwargs: dict | None = None, timeout: float = -1.0,
                  keep: Any = None) -> RpcFuture:
        """Run ``fn(*args, **kwargs)`` on ``to``; returns a future of the result.
        ``keep`` is held until the answer (see :meth:`request`)."""
        if not callable(fn):
            raise TypeError(f"func must be callable, got {type(fn).__name__}")
        args, kwargs = call_args(args, kwargs)
        return self.request(to, Call(fn, args, kwargs), timeout, keep=keep)

    def request(self, to: Any, msg: Any, timeout: float = -1.0, inline: bool = False,
                keep: Any = None,
                then: Callable[[Any, BaseException | None], None] | None = None,
                ) -> RpcFuture:
        """Send a typed request; the future completes with the handler's answer.
        ``inline``: the handler is protocol bookkeeping run on the receiver's
        I/O thread (it must never block). ``keep`` is held until the answer;
        ``then(value, error)`` runs when it arrives (or the call fails)."""
        if self.state not in ("ready", "stopping"):
            raise ShutdownError(f"agent {self.name!r} is {self.state}; it takes no new calls")
        peer = self.resolve(to).rank
        timeout = check_timeout(timeout, self.options.rpc_timeout)
        tag = None if inline or self.propagator is None else self.propagator.current()
        if tag is not None:
            self.propagator.sent(tag, peer)
        wire = Wire(self, peer, tag)
        payload, buffers = dumps(msg if tag is None else (_Tag(tag), msg), wire)
        mid = next(self._ids)
        fut = RpcFuture(self._io_ident)
        p = _Pending(fut, peer, msg.op, time.perf_counter(), None, keep, then,
                     wire if wire.undo else None)
        self._pending[mid] = p
        if timeout > 0:
            p.timer = self.io.call_later(timeout, self._expire, mid, timeout)
        with self._lock:
            self._sent[peer] += 1
        kind = INLINE if inline else REQUEST
        try:
            fault = self.faults.take(msg.op, False) if self.faults.rules else None
            if fault is None:
                nbytes = self.io.send(peer, kind, mid, payload, buffers)
            else:
                nbytes = self._inject(fault, peer, kind, mid, payload, buffers)
        except BaseException:  # nothing left: no pending entry, no count, no timer
            self._pending.pop(mid, None)
            if p.timer is not None:
                self.io.cancel(p.timer)
            with self._lock:
                self._sent[peer] -= 1
            wire.unsent()
            raise
        self.events.add("send", msg.op, self.peer_name(peer), mid, nbytes, None, _what(msg))
        return fut

    def _inject(self, fault: tuple[str, float], peer: int, kind: int, mid: int,
                payload: bytes, buffers: list) -> int:
        """A test's fault: the message is lost, or sent late. A lost request is
        not counted as sent (the callee never counts it as served); a lost
        reply was served all the same, and the retry counts on both sides."""
        action, delay = fault
        log.info("fault injection: %s message %d to rank %d", action, mid, peer)
        if action == "drop":
            if kind != RESPONSE:
                with self._lock:
                    self._sent[peer] -= 1
            return 0
        self.io.call_later(delay, self._send_late, peer, kind, mid, payload, buffers)
        return 0

    def _send_late(self, peer: int, kind: int, mid: int, payload: bytes, buffers: list) -> None:
        if self.state in ("ready", "stopping") and peer in self.members:
            self.io.send(peer, kind, mid, payload, buffers)

    def _io_ident(self) -> int | None:
        return self.io.thread_ident

    def _expire(self, mid: int, timeout: float) -> None:
        p = self._pending.pop(mid, None)
        if p is None:
            return
        self.timeouts += 1
        name = self.peer_name(p.peer)
        self.events.add("timeout", p.op, name, mid, 0, time.perf_counter() - p.started)
        self._settle(p, error=RpcTimeoutError(f"RPC {p.op!r}", timeout, worker=name))

    def _settle(self, p: _Pending, value: Any = None, error: BaseException | None = None,
                ) -> None:
        """Complete a call's future. Its callbacks (``.then()``) run on the
        completing thread, and a callback may block (wait on another call, as
        PyTorch allows): a future that has callbacks is completed on a pool
        thread, never on the I/O thread that must deliver the answers they wait
        for. A future without any completes here, at no extra cost."""
        if (p.future.has_callbacks and self.state != "stopped"
                and threading.get_ident() == self.io.thread_ident):
            self.pool.submit(p.settle, value, error)
        else:
            p.settle(value, error)

    def _complete(self, env: Envelope) -> None:
        p = self._pending.get(env.msg_id)
        if p is None or p.peer != env.sender or self._pending.pop(env.msg_id, None) is None:
            self.late_replies += 1
            log.debug("discarding a late or stray reply %d from rank %d", env.msg_id,
                      env.sender)
            self._discard(env)
            return
        if p.timer is not None:
            self.io.cancel(p.timer)
        name = self.peer_name(p.peer)
        self.events.add("recv", p.op, name, env.msg_id, len(env.payload),
                        time.perf_counter() - p.started)
        try:
            reply = loads(env.payload, env.buffers, Wire(self, env.sender))
        except Exception as e:
            self._settle(p, error=SerializationError(
                f"the answer from {name!r} could not be unpickled here: "
                f"{type(e).__name__}: {e}"))
            return
        if type(reply) is Ok:
            self._settle(p, reply.value)
        else:
            self.remote_errors += 1
            if reply.unread and p.wire is not None:  # e.g. RRefs forked into it
                p.wire.unsent()
            self._settle(p, error=rebuild_error(reply))

    def _discard(self, env: Envelope) -> None:
        """A late reply is still unpickled, then dropped: RRefs forked into it
        must be received (and released) for their parents to let go."""
        if env.sender not in self.members:
            return
        try:
            loads(env.payload, env.buffers, Wire(self, env.sender))
        except Exception as e:
            log.debug("a late reply from rank %d did not unpickle: %s", env.sender, e)

    # -- calls: callee side --------------------------------------------------
    def _on_message(self, env: Envelope) -> None:
        kind = env.kind
        if kind == RESPONSE:
            self._complete(env)
        elif kind in (REQUEST, INLINE) and self.state == "joining":
            if len(self._early) < MAX_EARLY:
                self._early.append(env)
            else:
                self.io.note_drop("too early", f"request from rank {env.sender} before the "
                                  f"member table ({MAX_EARLY} already held)")
        elif kind == REQUEST:
            self.pool.submit(self._serve, env)
        elif kind == INLINE:
            self._serve(env)
        elif kind == CONTROL:
            self._on_control(env)
        else:
            self.io.note_drop("unknown kind", f"kind {kind} from rank {env.sender}")

    def _serve(self, env: Envelope) -> None:
        started = time.perf_counter()
        op = "?"
        wire = Wire(self, env.sender)
        try:
            msg = loads(env.payload, env.buffers, wire)
        except BaseException as e:  # the caller undoes what the message carried
            e = _unread_error(e, self.name)
            self._reply(env, dataclasses.replace(pack_error(e, self.name), unread=True),
                        op, started, wire.tag)
            return
        tag = wire.tag
        if wire.before is not None and threading.get_ident() != self.io.thread_ident:
            self._wait_before(wire.before)
        try:
            if tag is not None:  # (tagged: a (_Tag, message) pair)
                msg = msg[1]
            op = msg.op
            handler = self.handlers.get(op)
            if handler is None:
                raise SerializationError(f"no handler for request op {op!r} on {self.name!r}")
            if tag is None or self.propagator is None:
                result = handler(msg, env.sender)
            else:
                with self.propagator.enter(tag):
                    result = handler(msg, env.sender)
        except BaseException as e:
            self.user_error(op, env.sender, e)
            self._reply(env, pack_error(e, self.name), op, started, tag)
            return
        if type(result) is Deferred:
            on_done(result.future,
                    lambda f: self._reply_future(env, f, op, started, tag, _what(msg)))
        else:
            self._reply(env, Ok(result), op, started, tag, _what(msg))

    def _wait_before(self, events: list[threading.Event]) -> None:
        """Wait (bounded by the RPC timeout, on a pool thread) for what the
        request's unpickling asked to precede its handler."""
        deadline = time.monotonic() + (self.options.rpc_timeout or 60.0)
        with blocking():
            for ev in events:
                while not ev.wait(0.25) and self.state != "stopped":
                    if time.monotonic() > deadline:
                        log.warning("nbrpc agent %r: running a request before its RRef "
                                    "arguments were confirmed by their owners", self.name)
                        return

    def user_error(self, op: str, sender: int, e: BaseException) -> None:
        """Log, on this worker, a failure of code run for ``sender`` (as PyTorch
        prints it to the worker's stderr); the caller gets the exception too.
        One line at WARNING, the traceback at DEBUG."""
        if getattr(e, "remote_worker", None) or getattr(e, _LOGGED, False):
            return  # raised further away (logged there), or a stored error raised again
        try:
            setattr(e, _LOGGED, True)  # (copies raised from a stored error keep it)
        except Exception:  # an exception type without attributes
            pass
        log.warning("nbrpc agent %r: %s from %r raised %s: %s", self.name, op,
                    self.peer_name(sender), type(e).__name__, e)
        log.debug("the traceback", exc_info=e)

    def _reply_future(self, env: Envelope, f: torch.futures.Future, op: str, started: float,
                      tag: Any = None, what: str = "") -> None:
        value, error = outcome(f)
        if error is not None:
            self.user_error(op, env.sender, error)
        reply: Any = Ok(value) if error is None else pack_error(error, self.name)
        self._reply(env, reply, op, started, tag, what)

    def _reply(self, env: Envelope, reply: Any, op: str, started: float,
               tag: Any = None, what: str = "") -> None:
        peer = env.sender
        wire = Wire(self, peer, tag)  # tensors in the reply are recorded under the tag
        try:
            payload, buffers = dumps(reply, wire)
        except SerializationError as e:
            wire.unsent()
            wire = Wire(self, peer)
            if type(reply) is Ok:  # name the value, not the wrapper it travels in
                cause = e.__cause__ or e
                kind = type(reply.value)
                e = SerializationError(
                    f"the result of {what or op}() on {self.name!r}, a {kind.__module__}."
                    f"{kind.__qualname__}, could not be pickled to send back: "
                    f"{type(cause).__name__}: {cause}. Return only picklable values (open "
                    "files, locks and sockets are not), or keep the value on the worker "
                    "with remote() and send back what you need from it.")
            payload, buffers = dumps(pack_error(e, self.name), wire)
        with self._lock:
            self._served[peer] += 1
        try:
            fault = self.faults.take(op, True) if self.faults.rules else None
            if fault is None:
                nbytes = self.io.send(peer, RESPONSE, env.msg_id, payload, buffers)
            else:
                nbytes = self._inject(fault, peer, RESPONSE, env.msg_id, payload, buffers)
        except BaseException:
            wire.unsent()
            raise
        self.events.add("serve" if type(reply) is Ok else "serve-error", op,
                        self.peer_name(env.sender), env.msg_id, nbytes,
                        time.perf_counter() - started)

    def _handle_call(self, msg: Call, sender: int) -> Any:
        fn = msg.fn
        if is_async(fn):
            return Deferred(check_future(fn, fn(*msg.args, **msg.kwargs)))
        return fn(*msg.args, **msg.kwargs)

    # -- control -------------------------------------------------------------
    def _send_control(self, rank: int, msg: Any) -> None:
        payload, buffers = dumps(msg)
        self.io.send(rank, CONTROL, 0, payload, buffers)

    def _on_control(self, env: Envelope) -> None:
        msg = loads(env.payload, env.buffers)
        t = type(msg)
        now = time.monotonic()
        if env.sender == 0:
            self._coordinator_seen = now
        if self._coordinator is not None:
            self._coordinator.heard_from(env.sender, now)
        if t is Heartbeat:
            if msg.member is not None and msg.member.rank == env.sender:
                self._heard_heartbeat(msg)
            return
        if t is Members:
            if msg.error:
                self._join_error = msg.error
            else:
                self._set_members(msg.members)
                if self._coordinator is not None:
                    self._coordinator.watch_all(now)
                if self.state == "joining":  # peers may call us from now on
                    self.state = "ready"
                    early, self._early = self._early, []
                    for held in early:  # they name members this agent now knows
                        self._on_message(held)
            self._joined.set()
        elif t is MemberJoined:
            self._add_member(msg.member)
        elif t is MemberLeft:
            if msg.rank == self.rank:
                self._evicted()
            else:
                self._remove_member(msg.rank, msg.dead, msg.why)
        elif t is DrainVerdict:
            verdict = self._verdicts.get(msg.round)
            if verdict is not None and not verdict.done():
                verdict.set_result(msg.done)
        elif self._coordinator is None:
            log.warning("rank %d sent %s to a non-coordinator", env.sender, t.__name__)
        elif t is Leave:
            self._dispatch(self._coordinator.on_leave(msg.rank))
            self._remove_member(msg.rank)
        elif t is Join:
            self._on_join(msg)
        elif t is DrainReport:
            self._dispatch(self._coordinator.on_drain_report(env.sender, msg))

    def _on_join(self, join: Join) -> None:
        m = join.member
        holder = self._coordinator.members.get(m.rank)
        out = self._coordinator.on_join(join)
        refusal = next((r.error for _, r in out if type(r) is Members and r.error), None)
        if refusal is not None:
            log.error("nbrpc coordinator %r refused %r (rank %d): %s", self.name, m.name,
                      m.rank, refusal)
            if holder is not None:  # its rank is a member's: the refusal cannot reach it
                out = out[1:]  # (what follows tells the group, the holder included)
        failed = self._coordinator.failed
        if failed is not None and self.world_size is not None and self.state == "joining":
            # the static group cannot form: every rank's init_rpc fails, not at its
            # timeout; rank 0's once all the others have been told (they join to hear it)
            self._join_error = failed
            out = [(r, msg) for r, msg in out if r != self.rank]
        if m.rank != self.rank and (refusal is None or holder is None):
            self.io.set_address(m.rank, m.address)
        self._dispatch(out)
        if self._join_error and self._coordinator.everyone_told:
            self._joined.set()  # (after the sends: init_rpc stops the agent on waking)
        if (self.world_size is None and m.rank != self.rank
                and self._coordinator.members.get(m.rank) == m):
            # dynamic group: the coordinator is a member too (it calls the
            # joiner, and heartbeats and watches it from now on)
            self._add_member(m)
            self._coordinator.heard_from(m.rank, time.monotonic())

    def _dispatch(self, outbox: list) -> None:
        for rank, msg in outbox:
            try:
                self._send_control(rank, msg)
            except Exception as e:  # a member gone meanwhile
                log.debug("control message to rank %d not sent: %s", rank, e)

    # -- failure detection (on the I/O thread) ---------------------------------
    def _tick(self) -> None:
        if self.state == "stopped":
            return
        opts = self.options
        self.io.call_later(opts.heartbeat_interval, self._tick)
        now = time.monotonic()
        # Late by over a second: this process was stopped or its GIL held, so
        # nobody's silence meanwhile says anything about them.
        stalled = now - self._last_tick > opts.heartbeat_interval + max(1.0, opts.heartbeat_interval)
        self._last_tick = now
        if not self._joined.is_set() or self._join_error or self._shutdown_cut:
            return
        beat = Heartbeat(self._member, self.world_size)
        if self._coordinator is not None:
            if stalled:
                self._coordinator.watch_all(now)
            down = {r: self.io.link_down_since(r) for r in self._coordinator.last_seen}
            for rank in self._coordinator.expired(now, opts.failure_timeout,
                                                  opts.link_timeout, down):
                why = self._death(now, down.get(rank))
                self._dispatch(self._coordinator.on_leave(rank, dead=True, why=why))
                self._remove_member(rank, dead=True, why=why)
            self._dispatch([(rank, beat) for rank in self.members.ranks() if rank != 0])
            return
        if 0 not in self.members:
            return  # declared dead: its heartbeat, if it comes, takes it back
        if stalled or not self._coordinator_seen:
            self._coordinator_seen = now
        silent, down_since = now - self._coordinator_seen, self.io.link_down_since(0)
        if silent > opts.failure_timeout or (
                down_since is not None and now - down_since > opts.link_timeout
                and silent > opts.link_timeout):
            self._remove_member(0, dead=True, why=self._death(now, down_since))
            return
        self._dispatch([(0, beat)])

    def _death(self, now: float, down_since: float | None) -> str:
        if down_since is not None and now - down_since > self.options.link_timeout:
            return "died (its connection closed)"
        return f"died (no heartbeat for {self.options.failure_timeout:g} s)"

    def _heard_heartbeat(self, beat: Heartbeat) -> None:
        """A heartbeat from someone this agent no longer counts as a member:
        it was wrongly declared dead. The coordinator takes the member back
        (as a re-join); a member whose coordinator came back joins it again."""
        m = beat.member
        if self._coordinator is not None:
            if self._coordinator.readmits(m.rank) and self.state == "ready":
                log.warning("nbrpc coordinator %r: %r (rank %d) is alive after all; "
                            "taking it back", self.name, m.name, m.rank)
                self.readmitted += 1
                self._on_join(Join(m, beat.world_size))
        elif m.rank == 0 and 0 not in self.members and self.state == "ready":
            log.warning("nbrpc agent %r: the coordinator %r is alive after all; joining "
                        "it again", self.name, m.name)
            self.readmitted += 1
            self._rejoin(m.address)

    def _rejoin(self, address: str | None = None) -> None:
        self._coordinator_seen = time.monotonic()
        self.io.set_address(0, address or self._coordinator_address)
        self._dispatch([(0, Join(self._member, self.world_size))])

    def _evicted(self) -> None:
        """The coordinator declared this (busy or stopped, but alive) worker dead."""
        if self.state == "stopping":
            self._cut_shutdown("the coordinator declared this worker dead")
            return
        if self.state != "ready":
            return
        log.warning("nbrpc agent %r was declared dead by the coordinator (it was not heard "
                    "from in time); joining again. Calls to it meanwhile failed.", self.name)
        self.readmitted += 1
        self._rejoin()

    # -- observability -------------------------------------------------------
    def unanswered_since(self, started: float) -> int:
        """Calls this agent sent at or after ``started`` (``time.perf_counter()``)
        that have no answer yet."""
        return sum(p.started >= started for p in list(self._pending.values()))

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
                "threads": self.pool.size,
                "busy_threads": self.pool.busy,
                "queued": self.pool.queued,
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


def _unread_error(e: BaseException, name: str) -> BaseException:
    """The error for a request that ``name`` could not unpickle (nothing of it ran)."""
    if not isinstance(e, Exception):
        return e
    hint = ""
    if isinstance(e, (AttributeError, ImportError)):
        hint = (" The RPC pickler does not serialize the code of functions and classes "
                "imported from a module (it does for those defined in __main__ or a "
                "notebook cell): the callee imports them by name, so install the same "
                "code on every worker, or define them in the notebook or script.")
    error = SerializationError(f"{name!r} could not unpickle the request: "
                               f"{type(e).__name__}: {e}.{hint}")
    error.__cause__ = e
    return error


INTERNAL = "nbrpc:"  # the prefix of internal calls' names in the event log


def internal(fn: Callable) -> Callable:
    """Mark ``fn`` as nbrpc's own introspection (snapshots, probes, trace reads):
    traces leave its calls out unless asked for them."""
    fn.__nbrpc_internal__ = True  # type: ignore[attr-defined]
    return fn


def _what(msg: Any) -> str:
    """What a request is about, for its event: the function called, or the RRef."""
    fn = getattr(msg, "fn", None)
    if fn is not None:  # Box.method; torch.mul's qualname is _VariableFunctionsClass.mul
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        name = getattr(fn, "__name__", name) if name[0] == "_" else name
        return INTERNAL + name if getattr(fn, "__nbrpc_internal__", False) else name
    rref_id = getattr(msg, "rref_id", None)
    return "" if rref_id is None else f"RRef {rref_id}"


def call_args(args: Any, kwargs: Any) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` of a call, checked: a tuple (or list) and a dict.

    >>> call_args([1, 2], None)
    ((1, 2), {})
    >>> call_args(5, None)
    Traceback (most recent call last):
    ...
    TypeError: args must be a tuple of positional arguments, e.g. args=(5,); got int 5
    """
    if args is None:
        args = ()
    elif not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of positional arguments, e.g. args=({args!r},); "
                        f"got {type(args).__name__} {_short(args)}")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict of keyword arguments, e.g. kwargs={{'x': 1}}; "
                        f"got {type(kwargs).__name__} {_short(kwargs)}")
    return tuple(args), kwargs


def check_timeout(timeout: Any, default: float) -> float:
    """A call's timeout in seconds: -1 (or None) means ``default``, 0 no timeout.

    >>> check_timeout(-1, 60.0), check_timeout(2, 60.0)
    (60.0, 2.0)
    >>> check_timeout(float("nan"), 60.0)
    Traceback (most recent call last):
    ...
    ValueError: timeout must be seconds >= 0 (0: no timeout) or -1 (the default, 60 s); got nan
    """
    if timeout is None:
        return default
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
        raise TypeError(f"timeout must be a number of seconds (0: no timeout, -1: the "
                        f"default {default:g} s); got {type(timeout).__name__} {_short(timeout)}")
    if timeout == -1:
        return default
    if timeout == float("inf"):
        return 0.0
    if not timeout >= 0:  # (nan fails every comparison)
        raise ValueError(f"timeout must be seconds >= 0 (0: no timeout) or -1 (the default, "
                         f"{default:g} s); got {timeout!r}")
    return float(timeout)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_options(opts: AgentOptions) -> None:
    for field in ("heartbeat_interval", "failure_timeout", "link_timeout", "max_message_age"):
        value = getattr(opts, field)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
            raise ValueError(f"{field} must be a number of seconds >= 0, got {value!r}")
    if opts.heartbeat_interval and opts.failure_timeout < 2 * opts.heartbeat_interval:
        raise ValueError(
            f"failure_timeout ({opts.failure_timeout:g} s) must be at least twice "
            f"heartbeat_interval ({opts.heartbeat_interval:g} s)")
    if not isinstance(opts.max_message_size, int) or opts.max_message_size < 1 << 20:
        raise ValueError(f"max_message_size must be an int of at least 1 MiB, got "
                         f"{opts.max_message_size!r}")
