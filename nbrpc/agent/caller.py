"""The caller side of an agent: send a request, match its answer.

Mixed into :class:`~nbrpc.agent.agent.Agent`; uses its I/O loop, pool, member
table and counters. A request is pickled on the calling thread (signed there by
the transport) and its :class:`~.wire.Pending` entry waits for the RESPONSE
with the same message id, a timeout, or the peer's departure. A callee that
missed code named by hash (:mod:`nbrpc.serialize.code`) gets the request
again, once, with every definition in full.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import RpcTimeoutError, SerializationError, ShutdownError
from ..serialize import dumps, loads
from ..transport import Envelope
from .futures import RpcFuture
from .messages import INLINE, REQUEST, RESPONSE, Call, Ok
from .remote_errors import rebuild_error
from .wire import _MISS, Pending, Wire, _Tag, _what, call_args, check_timeout

log = logging.getLogger(__name__)


class Caller:
    """Requests out, answers in (see the module docstring)."""

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
                tagged: bool = False) -> RpcFuture:
        """Send a typed request; the future completes with the handler's answer.
        ``inline``: the handler runs on the receiver's I/O thread (protocol
        bookkeeping, or a handler that only looks up a future: it must never
        block); it carries the propagated value (the autograd context) only if
        ``tagged``, as other requests always do. ``keep`` is held until the
        answer; ``then(value, error)`` runs when it arrives (or the call fails)."""
        if self.state not in ("ready", "stopping"):
            raise ShutdownError(f"agent {self.name!r} is {self.state}; it takes no new calls")
        peer = self.resolve(to).rank
        timeout = check_timeout(timeout, self.options.rpc_timeout)
        tag = (None if (inline and not tagged) or self.propagator is None
               else self.propagator.current())
        if tag is not None:
            self.propagator.sent(tag, peer)
        p = Pending(RpcFuture(self._io_ident), peer, msg.op, time.perf_counter(), None,
                     keep, then)
        self._send_request(p, msg, tag, timeout, INLINE if inline else REQUEST)
        return p.future

    def _send_request(self, p: Pending, msg: Any, tag: Any, timeout: float, kind: int,
                      may_resend: bool = True) -> None:
        peer = p.peer
        wire = Wire(self, peer, tag, refs_ok=True)
        payload, buffers = dumps(msg if tag is None else (_Tag(tag), msg), wire)
        mid = next(self._ids)
        p.wire = wire if wire.undo or wire.full else None
        if wire.refs and may_resend:
            p.resend = (msg, tag, timeout, kind)
        self._pending[mid] = p
        if timeout > 0:
            p.timer = self.io.call_later(timeout, self._expire, mid, timeout)
        with self._lock:
            self._sent[peer] += 1
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

    def _resend(self, p: Pending) -> None:
        """The callee missed code named by hash (it restarted, or evicted it):
        send the request again, once, with every definition in full."""
        msg, tag, timeout, kind = p.resend
        p.resend = None
        if timeout > 0:
            timeout = max(timeout - (time.perf_counter() - p.started), 1e-3)
        log.info("nbrpc agent %r: %s to %r resent with its code in full", self.name, p.op,
                 self.peer_name(p.peer))
        try:
            self._send_request(p, msg, tag, timeout, kind, may_resend=False)
        except BaseException as e:
            self._settle(p, error=e)

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

    def _settle(self, p: Pending, value: Any = None, error: BaseException | None = None,
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
        if type(reply) is Ok or not reply.unread:
            if p.wire is not None and p.wire.full:  # it holds those definitions now
                self.codes.confirm(p.peer, p.wire.full)
        elif p.wire is not None:  # unread: undo what it carried (e.g. RRefs forked into it)
            p.wire.unsent()
        if type(reply) is Ok:
            self._settle(p, reply.value)
            return
        if reply.unread and reply.type_name == _MISS and p.resend:
            self.codes.forget(p.peer)
            self.codes.resent += 1
            self.pool.submit(self._resend, p)
            return
        self.remote_errors += 1
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

    def unanswered_since(self, started: float) -> int:
        """Calls this agent sent at or after ``started`` (``time.perf_counter()``)
        that have no answer yet."""
        return sum(p.started >= started for p in list(self._pending.values()))
