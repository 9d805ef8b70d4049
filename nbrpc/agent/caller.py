"""The caller side of an agent: send a request, match its answer.

:class:`Caller` is one part of an :class:`~nbrpc.agent.agent.Agent`
(``agent.caller``); it owns the calls in flight and the caller's counters and
uses the agent's I/O loop, pool and member table; the agent's dispatch hands
it the RESPONSE messages. A request is pickled on the calling thread (signed
there by the transport) and its :class:`~.wire.Pending` entry waits for the
RESPONSE with the same message id, a timeout, or the peer's departure. A
callee that missed code named by hash (:mod:`nbrpc.serialize.code`) gets the
request again, once, with every definition in full.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from functools import partial
from typing import Any

from ..errors import (
    DeviceRouteError,
    RpcTimeoutError,
    SerializationError,
    ShutdownError,
    WorkerGoneError,
)
from ..serialize import dumps, loads
from ..transport import Envelope
from ..transport.channel import Channel, ChannelClosed
from .futures import RpcFuture
from .messages import INLINE, REQUEST, RESPONSE, Call, Ok
from .remote_errors import rebuild_error
from .wire import (
    MISS_TYPE_NAME,
    MessageContext,
    Pending,
    Tag,
    call_args,
    check_timeout,
    describe_message,
    oversize,
    too_large,
    unpicklable_request,
)

log = logging.getLogger(__name__)

_SLICE = 0.05  # seconds a thread reading its channel waits before looking again
_LATE_HOOKS = 4096  # timed-out requests whose late answer still runs the wire's hooks


class Caller:
    """Requests out, answers in (see the module docstring).

    Owns the calls waiting for their answer (``pending``: msg id ->
    :class:`~.wire.Pending`), the ids it draws, the hooks of timed-out calls
    whose answer may still come (``late_hooks``), the requests sent per peer
    (``sent_to``, under ``lock``, which it shares with the callee's counts)
    and the counters ``timeouts``, ``late_replies`` and ``remote_errors``.
    ``agent`` is the :class:`~nbrpc.agent.agent.Agent` it is part of (its
    state and propagator are read per call).
    """

    def __init__(self, agent: Any, lock: threading.Lock) -> None:
        self.agent, self.name = agent, agent.name
        self.io, self.pool, self.events = agent.io, agent.pool, agent.events
        self.codes, self.members, self.options = agent.codes, agent.members, agent.options
        self.faults = agent.faults
        self.lock = lock
        self.pending: dict[int, Pending] = {}
        # requests that timed out with hooks on their answer: msg id -> (peer, wire)
        self.late_hooks: OrderedDict[int, tuple[int, MessageContext]] = OrderedDict()
        self.ids = itertools.count(1)
        self.sent_to: Counter[int] = Counter()  # requests sent, per peer (under lock)
        self.timeouts = self.late_replies = self.remote_errors = 0

    def rpc_async(self, to: Any, fn: Callable, args: tuple | None = None,
                  kwargs: dict | None = None, timeout: float = -1.0,
                  keep: Any = None) -> RpcFuture:
        """Run ``fn(*args, **kwargs)`` on ``to``; returns a future of the result.
        ``keep`` is held until the answer (see :meth:`request`)."""
        __tracebackhide__ = True
        if not callable(fn):
            raise TypeError(f"func must be callable, got {type(fn).__name__}")
        args, kwargs = call_args(args, kwargs)
        return self.request(to, Call(fn, args, kwargs), timeout, keep=keep)

    def rpc_sync(self, to: Any, fn: Callable, args: tuple | None = None,
                 kwargs: dict | None = None, timeout: float = -1.0, keep: Any = None) -> Any:
        """Run ``fn(*args, **kwargs)`` on ``to`` and wait for the result, over
        this thread's own channel to ``to`` where it has one (see
        :mod:`nbrpc.transport.channel`)."""
        __tracebackhide__ = True
        if not callable(fn):
            raise TypeError(f"func must be callable, got {type(fn).__name__}")
        args, kwargs = call_args(args, kwargs)
        return self.request(to, Call(fn, args, kwargs), timeout, keep=keep, sync=True).wait()

    def request(self, to: Any, msg: Any, timeout: float = -1.0, inline: bool = False,
                keep: Any = None,
                then: Callable[[Any, BaseException | None], None] | None = None,
                tagged: bool = False, sync: bool = False,
                along: int | None = None) -> RpcFuture:
        """Send a typed request; the future completes with the handler's answer.
        ``inline``: the handler runs on the receiver's I/O thread (protocol
        bookkeeping, or a handler that only looks up a future: it must never
        block); it carries the propagated value (the autograd context) only if
        ``tagged``, as other requests always do. ``keep`` is held until the
        answer; ``then(value, error)`` runs when it arrives (or the call fails).
        ``sync``: this thread waits for the answer next (``.wait()``, nothing
        in between), so it may go over the thread's own channel and the
        thread reads the answer itself; the callee then runs the handler on
        that channel's thread, so an ``inline`` one must be thread-safe
        (``rref_fetch`` is: the RRef state has its lock). ``along``: the id of
        a request to the same peer that may still be queued (deferred): if it
        is, it goes first on the same channel (``to_here`` right after
        ``remote``: both run on the callee's channel thread, in order)."""
        __tracebackhide__ = True
        agent = self.agent
        if agent.state not in ("ready", "stopping"):
            raise ShutdownError(f"agent {self.name!r} is {agent.state}; it takes no new calls")
        peer = self.members.resolve(to).rank
        timeout = check_timeout(timeout, self.options.rpc_timeout)
        propagator = agent.propagator
        tag = None if (inline and not tagged) or propagator is None else propagator.current()
        if tag is not None:
            propagator.sent(tag, peer)
        p = Pending(RpcFuture(self._io_ident), peer, msg.op, time.perf_counter(), None,
                     keep, then)
        self._send_request(p, msg, tag, timeout, INLINE if inline else REQUEST, sync=sync,
                           along=along)
        return p.future

    def _send_request(self, p: Pending, msg: Any, tag: Any, timeout: float, kind: int,
                      may_resend: bool = True, sync: bool = False,
                      along: int | None = None) -> None:
        __tracebackhide__ = True  # (IPython leaves nbrpc's frames out of tracebacks)
        peer = p.peer
        wire = MessageContext(self.agent, peer, tag, refs_ok=True)
        try:
            payload, buffers = dumps(msg if tag is None else (Tag(tag), msg), wire)
        except DeviceRouteError:
            wire.unsent()
            raise  # (PyTorch's words: the tensor is on a device no map sends)
        except SerializationError:
            wire.unsent()
            verb = msg.op if msg.op != "call" else "rpc_sync" if sync else "rpc_async"
            error = unpicklable_request(verb, self.members.peer_name(peer), msg)
            if error is None:
                raise
            raise error from None  # (its message has the pickler's; its frames are nbrpc's)
        over = oversize(payload, buffers, self.members.get(peer))
        if over is not None:  # the callee would drop it unread: fail now, not at the timeout
            wire.unsent()
            verb = msg.op if msg.op != "call" else "rpc_sync" if sync else "rpc_async"
            name = self.members.peer_name(peer)
            raise too_large(f"{verb}({name!r}, {describe_message(msg)}): the request", *over,
                            name)
        mid = next(self.ids)
        p.wire = wire if wire.undo or wire.full else None
        if wire.refs and may_resend:
            p.resend = (msg, tag, timeout, kind)
        self.pending[mid] = p
        why = self.members.gone_why(peer) if peer not in self.members else None
        if why is not None:  # it left while the request was pickled: fail_calls_to ran
            self.pending.pop(mid, None)  # before this call was pending (or it settled it)
            wire.unsent()
            raise WorkerGoneError(self.members.peer_name(peer), why)
        if timeout > 0:
            p.timer = self.io.call_later(timeout, self.expire, mid, timeout)
        with self.lock:
            self.sent_to[peer] += 1
        first = None  # the queued request ``along``, taken back: not yet handed to a write
        try:
            fault = self.faults.take(msg.op, False) if self.faults.rules else None
            if sync and along is not None and fault is None:
                first = self.io.take_queued(peer, along)  # (before the I/O thread writes it)
            chan = self.io.channel(peer) if sync and fault is None else None
            if chan is not None:
                first, taken = None, first
                nbytes = self._send_on(chan, p, timeout, kind, mid, payload, buffers, taken)
            elif fault is None:  # (a request nobody waits for yet is written in batches)
                if first is not None:
                    first, taken = None, first
                    self.io.send_frames(peer, taken)
                nbytes = self.io.send(peer, kind, mid, payload, buffers, defer=not sync)
                if not sync:
                    p.future.msg_id, p.future.unsent = mid, partial(self.io.flush_to, peer)
            else:
                nbytes = self.inject(fault, peer, kind, mid, payload, buffers)
        except BaseException:  # nothing left: no pending entry, no count, no timer
            if first is not None:  # (Ctrl-C while the channel opened) it still goes
                self.io.send_frames(peer, first)
            self.pending.pop(mid, None)
            if p.timer is not None:
                self.io.cancel(p.timer)
            with self.lock:
                self.sent_to[peer] -= 1
            wire.unsent()
            raise
        self.events.add("send", msg.op, self.members.peer_name(peer), mid, nbytes, None,
                        describe_message(msg))
        if wire.cuda:  # (CUDA tensors by IPC are not in nbytes: their handles are)
            self.events.add("cuda", msg.op, self.members.peer_name(peer), mid, 0, None,
                            wire.cuda_detail())

    def _send_on(self, chan: Channel, p: Pending, timeout: float, kind: int, mid: int,
                 payload: bytes, buffers: list, first: list | None = None) -> int:
        """Write the request on this thread's channel, after ``first`` (a
        queued request taken back); the future's ``wait()`` then reads the
        answers here (:meth:`_read_channel`). A channel that fails is dropped
        and what did not go on it goes the usual way (a message cut short on
        it is never read)."""
        self.io.flush_to(p.peer)  # what this thread queued before goes first
        try:
            nbytes = self.io.send(p.peer, kind, mid, payload, buffers, via=chan, first=first)
        except ChannelClosed as e:
            self.io.channels.forget(chan)
            if first is not None and not e.first_written:
                self.io.send_frames(p.peer, first)
            return self.io.send(p.peer, kind, mid, payload, buffers)
        deadline = time.monotonic() + timeout if timeout > 0 else float("inf")
        p.future.pump = partial(self._read_channel, chan, deadline)
        return nbytes

    def _read_channel(self, chan: Channel, deadline: float, fut: RpcFuture) -> None:
        """Read this thread's channel until ``fut`` is done (answers arrive
        here, to be checked and completed on this thread: no other thread
        wakes). Leaving early (the deadline: the timer then fails the call;
        the peer closed it; Ctrl-C) hands the channel to the I/O thread, which
        reads what still comes, and ``wait()`` goes on the usual way."""
        if chan.owner != threading.get_ident():
            return
        deliver, read = self.io.deliver, False
        try:
            while not fut.done():
                left = deadline - time.monotonic()
                if left <= 0 or self.agent.state == "stopped":
                    break
                messages, closed = chan.read(min(_SLICE, left))
                for frames in messages:
                    deliver(frames)
                    read = True
                if closed:
                    break
        except BaseException:  # (Ctrl-C)
            fut.pump = None
            if not fut.done():  # its answer is still to come: the I/O thread reads it
                self.io.channels.forget(chan, adopt=True)
            raise
        if not read:  # settled elsewhere (its timer, the peer gone) or not yet
            fut.pump = None
            self.io.channels.forget(chan, adopt=not chan.closed)

    def _resend(self, p: Pending) -> None:
        """The callee missed code named by hash (it restarted, or evicted it):
        send the request again, once, with every definition in full."""
        msg, tag, timeout, kind = p.resend
        p.resend = None
        if timeout > 0:
            timeout = max(timeout - (time.perf_counter() - p.started), 1e-3)
        log.info("nbrpc agent %r: %s to %r resent with its code in full", self.name, p.op,
                 self.members.peer_name(p.peer))
        try:  # (on the thread that reads its channel: again over it)
            self._send_request(p, msg, tag, timeout, kind, may_resend=False,
                               sync=p.future.pump is not None)
        except BaseException as e:
            self.settle(p, error=e)

    def inject(self, fault: tuple[str, float], peer: int, kind: int, mid: int,
               payload: bytes, buffers: list) -> int:
        """A test's fault: the message is lost, or sent late. A lost request is
        not counted as sent (the callee never counts it as served); a lost
        reply was served all the same, and the retry counts on both sides."""
        action, delay = fault
        log.info("fault injection: %s message %d to rank %d", action, mid, peer)
        if action == "drop":
            if kind != RESPONSE:
                with self.lock:
                    self.sent_to[peer] -= 1
            return 0
        self.io.call_later(delay, self._send_late, peer, kind, mid, payload, buffers)
        return 0

    def _send_late(self, peer: int, kind: int, mid: int, payload: bytes, buffers: list) -> None:
        if self.agent.state in ("ready", "stopping") and peer in self.members:
            self.io.send(peer, kind, mid, payload, buffers)

    def _io_ident(self) -> int | None:
        return self.io.thread_ident

    def expire(self, mid: int, timeout: float) -> None:
        p = self.pending.pop(mid, None)
        if p is None:
            return
        self.timeouts += 1
        if p.wire is not None and p.wire.answered:  # (an RRef sent home: its late
            with self.lock:                         # answer still lets the parent go)
                self.late_hooks[mid] = (p.peer, p.wire)
                forgot = (self.late_hooks.popitem(last=False)
                          if len(self.late_hooks) > _LATE_HOOKS else None)
            if forgot is not None:
                gone, (peer, _) = forgot
                log.warning("nbrpc agent %r: forgot what the answer to request %d from "
                            "rank %d was to settle (over %d timed out); RRefs it sent "
                            "home stay held", self.name, gone, peer, _LATE_HOOKS)
        name = self.members.peer_name(p.peer)
        self.events.add("timeout", p.op, name, mid, 0, time.perf_counter() - p.started)
        self.settle(p, error=RpcTimeoutError(f"RPC {p.op!r}", timeout, worker=name))

    def settle(self, p: Pending, value: Any = None, error: BaseException | None = None) -> None:
        """Complete a call's future. Its callbacks (``.then()``) run on the
        completing thread, and a callback may block (wait on another call, as
        PyTorch allows): a future that has callbacks is completed on a pool
        thread, never on the I/O thread that must deliver the answers they wait
        for. A future without any completes here, at no extra cost."""
        if (p.future.has_callbacks and self.agent.state != "stopped"
                and threading.get_ident() == self.io.thread_ident):
            self.pool.submit(p.settle, value, error)
        else:
            p.settle(value, error)

    def complete(self, env: Envelope) -> None:
        p = self.pending.get(env.msg_id)
        if p is None or p.peer != env.sender or self.pending.pop(env.msg_id, None) is None:
            self.late_replies += 1
            log.debug("discarding a late or stray reply %d from rank %d", env.msg_id,
                      env.sender)
            self._discard(env)
            return
        if p.timer is not None:
            self.io.cancel(p.timer)
        name = self.members.peer_name(p.peer)
        self.events.add("recv", p.op, name, env.msg_id, len(env.payload),
                        time.perf_counter() - p.started)
        try:
            reply = loads(env.payload, env.buffers, MessageContext(self.agent, env.sender))
        except Exception as e:
            self.settle(p, error=SerializationError(
                f"the answer from {name!r} could not be unpickled here: "
                f"{type(e).__name__}: {e}"))
            return
        if type(reply) is Ok or not reply.unread:
            if p.wire is not None and p.wire.full:  # it holds those definitions now
                self.codes.confirm(p.peer, p.wire.full)
            if p.wire is not None and p.wire.answered:
                p.wire.read_by_callee(reply.pending)
        elif p.wire is not None:  # unread: undo what it carried (e.g. RRefs forked into it)
            p.wire.unsent()
        if type(reply) is Ok:
            self.settle(p, reply.value)
            return
        if reply.unread and reply.type_name == MISS_TYPE_NAME and p.resend:
            self.codes.forget(p.peer)
            self.codes.resent += 1
            if threading.get_ident() == self.io.thread_ident:
                self.pool.submit(self._resend, p)
            else:  # the thread that reads its own channel
                self._resend(p)
            return
        self.remote_errors += 1
        self.settle(p, error=rebuild_error(reply))

    def _discard(self, env: Envelope) -> None:
        """A late reply is still unpickled, then dropped: RRefs forked into it
        must be received (and released) for their parents to let go, and what
        waited on the answer to a request that timed out runs (or is undone)."""
        with self.lock:
            late = self.late_hooks.get(env.msg_id)
            if late is not None and late[0] == env.sender:
                del self.late_hooks[env.msg_id]
            else:
                late = None
        if env.sender not in self.members:
            return
        try:
            reply = loads(env.payload, env.buffers, MessageContext(self.agent, env.sender))
        except Exception as e:
            log.debug("a late reply from rank %d did not unpickle: %s", env.sender, e)
            return
        if late is not None:
            if type(reply) is Ok or not reply.unread:
                late[1].read_by_callee(reply.pending)
            else:
                late[1].unsent()

    def unanswered_since(self, started: float) -> int:
        """Calls this agent sent at or after ``started`` (``time.perf_counter()``)
        that have no answer yet."""
        return sum(p.started >= started for p in list(self.pending.values()))

    def peers_waited_on(self) -> set[int]:
        """The ranks this agent's calls in flight wait on."""
        return {p.peer for p in list(self.pending.values())}

    def fail_calls_to(self, rank: int, name: str, why: str) -> None:
        """``rank`` (``name``) left the group, or is out of reach (``why``): its calls fail."""
        for mid, p in list(self.pending.items()):
            if p.peer == rank and self.pending.pop(mid, None) is not None:
                if p.timer is not None:
                    self.io.cancel(p.timer)
                self.settle(p, error=WorkerGoneError(name, why))

    def fail_all(self) -> None:
        """The agent stopped: every call still waiting fails."""
        for mid in list(self.pending):
            p = self.pending.pop(mid, None)
            if p is not None and not p.future.done():
                p.settle(error=ShutdownError(f"{self.name!r} shut down before "
                                             f"{self.members.peer_name(p.peer)!r} answered"))
