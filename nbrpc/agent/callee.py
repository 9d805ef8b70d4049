"""The callee side of an agent: run what peers ask, and answer.

:class:`Callee` is one part of an :class:`~nbrpc.agent.agent.Agent`
(``agent.callee``); the agent's dispatch hands it the REQUEST and INLINE
messages. A REQUEST is unpickled and run on the worker pool, an INLINE one
(protocol bookkeeping) on the I/O thread itself; the thread that ran the
handler sends the answer. A request that came on a caller's own channel
(:mod:`nbrpc.transport.channel`: ``rpc_sync``, ``to_here``) runs on that
channel's thread instead, and its answer goes back on the channel. A request
that cannot be unpickled is answered with an ``unread`` error, so that the
caller undoes what it carried. Requests that come while the agent joins are
held (``early``) until the member table arrives.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from typing import Any

import torch

from ..errors import DeviceRouteError, SerializationError
from ..serialize import a_type, dumps, find_unpicklable, loads
from ..transport import Envelope
from ..transport.channel import ChannelClosed
from .asyncfn import check_future, is_async
from .futures import on_done, outcome
from .messages import INLINE, REQUEST, RESPONSE, Call, Ok
from .pool import blocking
from .remote_errors import message_of, pack_error
from .wire import (
    LOGGED_ATTR,
    Deferred,
    MessageContext,
    describe_message,
    oversize,
    too_large,
    unread_error,
)

log = logging.getLogger(__name__)

MAX_EARLY = 10_000  # requests held while joining (peers that heard first call at once)


class Callee:
    """Requests in, answers out (see the module docstring).

    Owns the requests held while the agent joins (``early``), the requests
    answered per caller (``served_to``, under ``lock``, which it shares with
    the caller's counts) and ``channels_busy`` (channel threads running a
    request, under ``lock``). ``agent`` is the :class:`~nbrpc.agent.agent.Agent`
    it is part of; ``caller`` its :class:`~.caller.Caller` (fault injection of
    answers goes the caller's way).
    """

    def __init__(self, agent: Any, caller: Any, lock: threading.Lock) -> None:
        self.agent, self.caller, self.name = agent, caller, agent.name
        self.io, self.pool, self.events = agent.io, agent.pool, agent.events
        self.members, self.options, self.faults = agent.members, agent.options, agent.faults
        self.handlers = agent.handlers
        self.lock = lock
        # Requests that arrived before this agent had the member table (a peer
        # that heard first called at once): served once it arrives (I/O thread).
        self.early: list[Envelope] = []
        self.served_to: Counter[int] = Counter()  # requests answered, per caller (under lock)
        self.channels_busy = 0  # channel threads running a request (under lock)

    def on_request(self, env: Envelope) -> None:
        """A REQUEST (the agent's dispatch): run on the worker pool, or on the
        channel's own thread if it came on one (see :mod:`nbrpc.transport.channel`)."""
        if self.agent.state == "joining":
            self._hold(env)
        elif env.channel is not None and threading.get_ident() != self.io.thread_ident:
            self.serve(env)  # on the channel's own thread (see transport.channel)
        else:
            self.pool.submit(self.serve, env)

    def on_inline(self, env: Envelope) -> None:
        """An INLINE request: served at once, on the thread that read it (the
        I/O thread, or a channel's: see Caller.request's ``sync``)."""
        if self.agent.state == "joining":
            self._hold(env)
        else:
            self.serve(env)

    def _hold(self, env: Envelope) -> None:
        if len(self.early) < MAX_EARLY:
            self.early.append(env)
        else:
            self.io.note_drop("too early", f"request from rank {env.sender} before the "
                              f"member table ({MAX_EARLY} already held)")

    def serve_early(self) -> None:
        """The member table arrived: the requests held meanwhile go through
        the agent's dispatch again (they name members it now knows)."""
        early, self.early = self.early, []
        for held in early:
            self.agent.dispatch(held)

    def unreadable(self, env: Envelope, why: str) -> None:
        """The transport could not read a signed request (``why``): answer it
        with that reason, so that its caller raises at once (and undoes what
        the request carried) instead of waiting out its timeout."""
        if env.kind not in (REQUEST, INLINE) or env.run != self.io.run:
            return
        e = SerializationError(f"{self.name!r} could not read a request from "
                               f"{self.members.peer_name(env.sender)!r}: {why}")
        self.reply(env, dataclasses.replace(pack_error(e, self.name), unread=True), "?",
                   time.perf_counter())

    def serve(self, env: Envelope) -> None:
        __tracebackhide__ = True  # (left out of the traceback sent back)
        started = time.perf_counter()
        op = "?"
        wire = MessageContext(self.agent, env.sender)
        try:
            msg = loads(env.payload, env.buffers, wire)
        except BaseException as e:  # the caller undoes what the message carried
            e = unread_error(e, self.name)
            self.reply(env, dataclasses.replace(pack_error(e, self.name), unread=True),
                       op, started, wire.tag)
            return
        tag = wire.tag
        if wire.before is not None and threading.get_ident() != self.io.thread_ident:
            self._wait_before(wire.before)
        try:
            if tag is not None:  # (tagged: a (Tag, message) pair)
                msg = msg[1]
            op = msg.op
            handler = self.handlers.get(op)
            if handler is None:
                raise SerializationError(f"no handler for request op {op!r} on {self.name!r}")
            if env.channel is not None:  # a busy thread, as the pool's are, until it answers
                self._channel_busy(1)
            try:
                propagator = self.agent.propagator
                if tag is None or propagator is None:
                    result = handler(msg, env.sender)
                else:
                    with propagator.enter(tag):
                        result = handler(msg, env.sender)
            finally:
                if env.channel is not None:
                    self._channel_busy(-1)
        except BaseException as e:
            self.user_error(op, env.sender, e)
            self.reply(env, pack_error(e, self.name), op, started, tag, request=wire)
            return
        if type(result) is Deferred:
            on_done(result.future,
                    lambda f: self._reply_future(env, f, op, started, tag,
                                                 describe_message(msg), wire))
        else:
            self.reply(env, Ok(result), op, started, tag, describe_message(msg), wire)

    def _channel_busy(self, n: int) -> None:
        with self.lock:
            self.channels_busy += n

    def _wait_before(self, events: list[threading.Event]) -> None:
        """Wait (bounded by the RPC timeout, on a pool thread) for what the
        request's unpickling asked to precede its handler."""
        deadline = time.monotonic() + (self.options.rpc_timeout or 60.0)
        with blocking():
            for ev in events:
                while not ev.wait(0.25) and self.agent.state != "stopped":
                    if time.monotonic() > deadline:
                        log.warning("nbrpc agent %r: running a request before its RRef "
                                    "arguments were confirmed by their owners", self.name)
                        return

    def user_error(self, op: str, sender: int, e: BaseException) -> None:
        """Log, on this worker, a failure of code run for ``sender`` (as PyTorch
        prints it to the worker's stderr); the caller gets the exception too.
        One line at WARNING, the traceback at DEBUG."""
        if getattr(e, "remote_worker", None) or getattr(e, LOGGED_ATTR, False):
            return  # raised further away (logged there), or a stored error raised again
        try:
            setattr(e, LOGGED_ATTR, True)  # (copies raised from a stored error keep it)
        except Exception:  # an exception type without attributes
            pass
        log.warning("nbrpc agent %r: %s from %r raised %s: %s", self.name, op,
                    self.members.peer_name(sender), type(e).__name__, message_of(e))
        log.debug("the traceback", exc_info=e)

    def _reply_future(self, env: Envelope, f: torch.futures.Future, op: str, started: float,
                      tag: Any = None, what: str = "",
                      request: MessageContext | None = None) -> None:
        value, error = outcome(f)
        if error is not None:
            self.user_error(op, env.sender, error)
        reply: Any = Ok(value) if error is None else pack_error(error, self.name)
        self.reply(env, reply, op, started, tag, what, request)

    def reply(self, env: Envelope, reply: Any, op: str, started: float,
              tag: Any = None, what: str = "", request: MessageContext | None = None) -> None:
        peer = env.sender
        if request is not None and request.answering:  # what the answer leaves unsettled
            pending = request.pending_at_answer()
            if pending:
                reply = dataclasses.replace(reply, pending=pending)
        # tensors in the reply are recorded under the tag
        wire = MessageContext(self.agent, peer, tag, reply=True)
        try:
            payload, buffers = dumps(reply, wire)
        except SerializationError as e:
            wire.unsent()
            wire = MessageContext(self.agent, peer, reply=True)
            if type(reply) is Ok and not isinstance(e, DeviceRouteError):
                e = self._unpicklable_result(reply.value, what or op, e)  # (its value's name)
            payload, buffers = dumps(pack_error(e, self.name), wire)
        over = oversize(payload, buffers, self.members.get(peer))
        if over is not None:  # the caller would drop it unread: answer with why instead
            wire.unsent()
            wire = MessageContext(self.agent, peer, reply=True)
            name = self.members.peer_name(peer)
            e = too_large(f"the answer to {what or op}() from {self.name!r}", *over, name)
            reply = dataclasses.replace(pack_error(e, self.name),
                                        pending=getattr(reply, "pending", ()))
            payload, buffers = dumps(reply, wire)
        with self.lock:
            self.served_to[peer] += 1
        try:
            fault = self.faults.take(op, True) if self.faults.rules else None
            if fault is None:
                nbytes = self.io.send(peer, RESPONSE, env.msg_id, payload, buffers,
                                      via=env.channel)
            else:
                nbytes = self.caller.inject(fault, peer, RESPONSE, env.msg_id, payload, buffers)
        except ChannelClosed as e:  # the caller closed it: its process is gone
            wire.unsent()
            log.debug("nbrpc agent %r: the answer to %s from %r was not sent: %s",
                      self.name, op, self.members.peer_name(peer), e)
            return
        except BaseException:
            wire.unsent()
            raise
        self.events.add("serve" if type(reply) is Ok else "serve-error", op,
                        self.members.peer_name(env.sender), env.msg_id, nbytes,
                        time.perf_counter() - started)
        if wire.cuda:
            self.events.add("cuda", op, self.members.peer_name(env.sender), env.msg_id, 0,
                            None, wire.cuda_detail())

    def _unpicklable_result(self, value: Any, what: str, e: SerializationError
                            ) -> SerializationError:
        """The error for a result that does not pickle: its type, and the path
        and type of the part inside it that does not."""
        found = find_unpicklable(value, "result")
        if found is None:
            cause: BaseException = e.__cause__ or e
            path, inner = None, f"{type(cause).__name__}: {cause}"
        else:
            path, part, error = found
            inner = str(error) if path == "result" else f"{path} is {a_type(part)}: {error}"
        return SerializationError(
            f"the result of {what}() on {self.name!r} ({a_type(value)}) could not be pickled "
            f"to send back: {inner}. Return only picklable values (open files, locks, "
            "sockets and threads are not), or keep the value on the worker with remote() "
            "and send back what you need from it.", path, self.name)

    def handle_call(self, msg: Call, sender: int) -> Any:
        __tracebackhide__ = True  # (left out of the traceback sent back)
        fn = msg.fn
        if is_async(fn):
            return Deferred(check_future(fn, fn(*msg.args, **msg.kwargs)))
        return fn(*msg.args, **msg.kwargs)
