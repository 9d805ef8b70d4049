"""An agent's sockets: the I/O thread that receives, and the senders' DEALERs.

One ROUTER socket is bound per agent; every message *to* this agent arrives
there. Every message *from* it leaves through a DEALER, one per peer, opened
the first time that peer is addressed: replies travel on the replier's own
DEALER, and a ROUTER never has to route. The I/O thread alone owns the ROUTER
(the only socket polled). A DEALER is never read, so :meth:`IOLoop.send`
writes it from the calling thread under that peer's lock (:mod:`.dealer`): a
hand-off between two Python threads costs ~35 us here, and queueing sends
through the I/O thread put two on every round trip. A request nobody waits
for yet (``rpc_async``, ``remote``) is queued instead (``defer``): the I/O
thread writes what has queued by then in one system call, unless the
caller's ``wait()`` writes it first.

Other threads hand work to the I/O thread through :meth:`IOLoop.call_soon`
(a deque; the loop is woken through a pipe only when it may be sleeping in
``poll``); it also runs timers (:meth:`call_later`: call deadlines). A plain
``zmq.Poller`` thread was chosen by measurement: about 1.8× the round trips
per second of ``zmq.asyncio`` in a minimal Python request/reply here.

Connections are authenticated before any message is read, on either
backend: zmq's (``tcp://``, :mod:`.zmqhub`: PLAIN with the group's token
checked by a ZAP handler, or CURVE with ``encrypt=True``) and plain Unix
sockets' (``unix://``, :mod:`.unix`). :func:`~.frames.unpack` then rejects a
message that is not signed with the key after one MAC over at most 64 KiB.
Messages that fail a check, replayed or stale messages, and unreadable
shared-memory segments are dropped unread and counted by reason
(``dropped``, :mod:`.drops`).

Same host: the loop also listens on a plain Unix domain socket in a private
directory, and a peer on the same host (same boot, network and mount
namespaces) connects there rather than over loopback TCP (:mod:`.local`), with
no libzmq in between (:mod:`.unix`: the same handshake token, signed frames
and bounds). Which backend a peer gets follows the scheme of its address.

Links: the agent learns within milliseconds that the process at the other
end of a connection is gone (the kernel closed it: a zmq socket monitor, or
a Unix socket's hang-up), with no heartbeat involved;
:meth:`IOLoop.link_down_since` tells since when. A process that is stopped
or busy (its GIL held) keeps its link up.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

import zmq

from . import channel, local, shm, unix
from .auth import connect_token  # (re-exported)
from .dealer import Dealer
from .drops import DropLog
from .frames import (
    DEFAULT_MAX_MESSAGE,
    FLAG_SHM,
    MAX_HEADER,
    SIG_LEN,
    BadMessage,
    Envelope,
    ReplayGuard,
    Sequencer,
    ShmRef,
    pack,
    unpack,
)
from .timers import Timers
from .zmqhub import LINGER_MS, ZmqHub, close_monitor

log = logging.getLogger(__name__)

MAX_HELD = 10_000  # messages held per peer whose address is not known yet
_MAX_SLEEP_MS = 500  # the loop wakes at least this often to look at new timers
# Seconds from a poll to its timers beyond which the loop polls once more first:
# the process was paused meanwhile (SIGSTOP, a debugger, a long call holding the
# GIL), and what arrived then (a reply, a connection's hello) must count before
# the deadlines that fell due in the pause.
STALL_S = 0.5
EXIT_STOP_S = 2.0  # at interpreter exit, how long each running loop may take to stop


class IOLoop:
    """Owns one bound ROUTER socket and the DEALER sockets to peers.

    ``on_message(envelope)`` runs on the I/O thread for every verified
    message; it must not block. An exception from it is logged and drops that
    message only: nothing a message does can stop the loop.
    """

    def __init__(
        self,
        key: bytes,
        local_id: int,
        on_message: Callable[[Envelope], None],
        name: str = "nbrpc-io",
        copy: Callable[[memoryview, memoryview], None] | None = None,
        max_message_size: int = DEFAULT_MAX_MESSAGE,
        max_age: float = 300.0,
        encrypt: bool = False,
        ipc: bool = True,
    ) -> None:
        self._key = key
        self.local_id = local_id
        self._on_message = on_message
        # on_unread(envelope, why): a signed message for this member and run
        # that cannot be handed on (its buffers are unreadable); the agent
        # answers a request with the reason rather than leave its caller waiting
        self.on_unread: Callable[[Envelope, str], None] | None = None
        # on_link_up(peer): the connection to ``peer`` is up again after being
        # down (on the I/O thread); the control part tells a peer it reported
        self.on_link_up: Callable[[int], None] | None = None
        self._name = name
        self.max_message_size = int(max_message_size)
        self._seq = Sequencer()
        # The group's run, signed into every message (see frames): 0 until this
        # member has heard it; messages of another run are refused from then on.
        self.run = 0
        self._guard = ReplayGuard(max_age)
        self._guard_lock = threading.Lock()  # (channel threads deliver too)
        self._token = connect_token(key)
        # messages dropped unread, by reason (a Counter); note_drop counts and logs
        self._drops = DropLog(name, lambda delay, fn: self.call_later(delay, fn))
        self.dropped, self.note_drop = self._drops.counts, self._drops.note
        # link state per peer: monotonic time since its link is down, None while up
        self._links: dict[int, float | None] = {}
        self._zmq = ZmqHub(key, self._token, self.max_message_size + MAX_HEADER + SIG_LEN,
                           encrypt, deliver=self.deliver, note_drop=self.note_drop,
                           links=self._links, link_up=self._link_up, name=name,
                           is_current=lambda peer, d: self._dealers.get(peer) is d,
                           call_later=self.call_later)
        self._dealers: dict[int, Dealer] = {}
        self._same_host: dict[int, bool] = {}
        self._shm = (shm.ShmWriter(copy or shm.plain_copy, self.call_later)
                     if shm.available() else None)
        self._dealers_lock = threading.Lock()
        self._addresses: dict[int, str] = {}
        self._ipc = ipc and not encrypt  # (encrypt: every connection is CURVE)
        self._ipc_dir: str | None = None
        self._unix: unix.UnixHub | None = None
        self.channels: channel.Channels | None = None  # callers' own (see .channel)
        self.local_address: str | None = None  # "IDENTITY@unix://..." (see .local), once bound
        self._local: dict[int, str] = {}  # peer -> its unix:// endpoint, if on this host
        # Messages to a member whose address has not reached us yet (a peer that
        # got the member table first may call us before we have it), sent in
        # order once it does; a forgotten peer's messages are dropped instead.
        self._held: dict[int, deque] = {}
        self._forgotten: set[int] = set()
        self._queue: deque = deque()
        self._timers = Timers()
        self._poll_until = float("inf")  # when the sleeping loop will wake by itself
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        # The wake pipe's fds (plain ints: no object closes them) are closed once,
        # by close(), or when the loop is let go without it (an Agent made and
        # never started; its hubs see to their own sockets). Not by the
        # finalizer at interpreter exit: a loop still running is stopped then
        # (_stop_running) and closes them itself.
        self._close_pipe = weakref.finalize(self, _close_fds, self._wake_r, self._wake_w)
        self._close_pipe.atexit = False
        self._sleeping = False
        self._stopping = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.address: str | None = None
        self.thread_ident: int | None = None
        # receive counters: written by the I/O thread only (send counters live
        # on each peer's Dealer, under its lock; see sent_msgs/sent_bytes)
        self.recv_msgs = self.recv_bytes = 0
        self._sent_to_self = [0, 0]  # messages, bytes
        self._poller: zmq.Poller | None = None

    # -- set-up ------------------------------------------------------------
    def bind(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Bind the ROUTER (port 0: any free port); returns ``tcp://host:port``."""
        self.address = self._zmq.bind(f"tcp://{_bracket(host)}:{port or '*'}")
        if self._ipc:
            self.local_address = self._bind_ipc()
        if self.local_address is None:  # (who we are, for shared memory: see local)
            self.local_address = f"{local.host_identity()}@"
        return self.address

    def _bind_ipc(self) -> str | None:
        """Also listen on a Unix domain socket (see :mod:`.local` and
        :mod:`.unix`); None if that fails."""
        try:
            self._ipc_dir = local.make_dir()
            where = f"{self._ipc_dir}/s"
            size = self.max_message_size + MAX_HEADER + SIG_LEN
            self.channels = channel.Channels(
                self._token, size, deliver=self.deliver, note_drop=self.note_drop,
                adopt=lambda r: self.call_soon(self._unix.adopt, r), name=self._name)
            self._unix = unix.UnixHub(
                where, self._token, size, deliver=self.deliver, note_drop=self.note_drop,
                call_later=self.call_later, links=self._links, link_up=self._link_up,
                name=self._name, serve_channel=self.channels.serve, directory=self._ipc_dir)
        except OSError as e:
            log.debug("%s: no Unix domain socket (%s); peers on this host use TCP",
                      self._name, e)
            local.remove_dir(self._ipc_dir)
            self._ipc_dir = None
            return None
        return f"{local.host_identity()}@unix://{where}"

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
        _running.add(self)
        self._thread.start()

    def set_address(self, peer: int, address: str, local_address: str | None = None) -> None:
        """Tell the loop where ``peer`` listens; a changed address reconnects.
        ``local_address``: its Unix domain socket, used (from the next
        connection on) if the peer is on this host. Messages held for it (sent
        before its address was known) go out first."""
        with self._dealers_lock:
            old = self._addresses.get(peer)
            self._addresses[peer] = address
            endpoint = local.local_endpoint(local_address) if self._ipc else None
            redial = False
            if endpoint is not None:
                # connected over TCP before this was known (a member's first
                # connection, to the coordinator): move over to the Unix socket
                redial = self._local.get(peer) != endpoint and peer in self._dealers
                self._local[peer] = endpoint
            elif old != address:
                self._local.pop(peer, None)
            self._forgotten.discard(peer)
            held = self._held.pop(peer, None)
            dealer = self._new_dealer(peer, address) if held else None
            if dealer is not None:  # before any other sender can see the dealer: in order
                dealer.queue.extend(held)
        if local_address is not None or old != address:
            self._same_host[peer] = local.same_identity(local_address)
        if old is not None and old != address:
            self.call_soon(self._drop_dealer, peer)
        elif redial:  # (what the old connection still holds drains, bounded by its linger)
            self.call_soon(self._drop_dealer, peer, LINGER_MS)
        if dealer is not None:
            dealer.flush()

    def forget(self, peer: int) -> None:
        with self._dealers_lock:
            self._addresses.pop(peer, None)
            self._local.pop(peer, None)
            self._forgotten.add(peer)
            dropped = self._held.pop(peer, ())
        if dropped:
            log.warning("dropping %d message(s) to peer %d: it left before its address "
                        "was known", len(dropped), peer)
        self.call_soon(self._drop_dealer, peer)

    @property
    def incarnation(self) -> int:
        """This loop's random identity, signed into every message it sends."""
        return self._seq.incarnation

    @property
    def refused_connections(self) -> int:
        """Connections refused: without the group's key (or, on the Unix
        socket, from another user, or not authenticated in time)."""
        return self._zmq.refused + (self._unix.refused if self._unix is not None else 0)

    @property
    def dropped_bad(self) -> int:
        """Messages dropped because their signature did not verify."""
        return self.dropped["bad signature"]

    def _link_up(self, peer: int) -> None:
        """A transport found the connection to ``peer`` up again (I/O thread)."""
        if self.on_link_up is not None:
            try:
                self.on_link_up(peer)
            except Exception:
                log.exception("%s: on_link_up(%d) failed", self._name, peer)

    def link_down_since(self, peer: int) -> float | None:
        """Since when (``time.monotonic()``) the connection to ``peer`` is down;
        None while it is up, or when this loop has no connection to ``peer``."""
        return self._links.get(peer)

    @property
    def sent_msgs(self) -> int:
        return (self._sent_to_self[0] + sum(d.sent_msgs for d in list(self._dealers.values()))
                + (self.channels.sent[0] if self.channels is not None else 0))

    @property
    def sent_bytes(self) -> int:
        return (self._sent_to_self[1] + sum(d.sent_bytes for d in list(self._dealers.values()))
                + (self.channels.sent[1] if self.channels is not None else 0))

    # -- thread-safe hand-off ----------------------------------------------
    def send(self, peer: int, kind: int, msg_id: int, payload: bytes,
             buffers: list = (), via: Any = None, defer: bool = False,
             first: list | None = None) -> int:
        """Sign and send one message to ``peer`` (safe from any thread; never
        blocks). Large buffers to a peer on this host go through shared memory.
        Returns the bytes handed over. ``via``: a channel to ``peer`` (see
        :meth:`channel`; an answer goes on the one its request came on),
        written before this returns; raises :class:`~.channel.ChannelClosed`
        if that fails; ``first``: a message :meth:`take_queued` took back, to
        write on ``via`` ahead of this one. ``defer``: nobody waits for this message right now
        (``rpc_async``, ``remote``): queue it and let the I/O thread write
        what has queued by then, several messages in one system call."""
        if buffers:
            if self._shm is not None and peer != self.local_id and self._is_local(peer):
                buffers = [self._to_shm(b) for b in buffers]
            # pyzmq sends an object without len() (a PickleBuffer) zero-copy
            # whatever its size, and every zero-copy send wakes pyzmq's
            # garbage-collector thread; small buffers are cheaper copied.
            buffers = [memoryview(b).tobytes()
                       if type(b) is not ShmRef and memoryview(b).nbytes < zmq.COPY_THRESHOLD
                       else b for b in buffers]
        frames = pack(self._key, kind, self.local_id, msg_id, payload, buffers,
                      incarnation=self._seq.incarnation, seq=self._seq.next(),
                      dest=peer, run=self.run)
        if via is not None:
            return via.write(frames, first)
        nbytes = sum(memoryview(f).nbytes for f in frames)
        self._send_frames(peer, (frames, nbytes, msg_id), defer)
        return nbytes

    def send_frames(self, peer: int, frames: list) -> None:
        """Send a message :meth:`take_queued` took back (already signed)."""
        self._send_frames(peer, (frames, sum(memoryview(f).nbytes for f in frames), 0))

    def flush_to(self, peer: int) -> None:
        """Write now what waits for ``peer`` (before a message that must not
        overtake it goes another way: this thread's channel)."""
        dealer = self._dealers.get(peer)
        if dealer is not None and dealer.queue:
            dealer.flush()

    def take_queued(self, peer: int, msg_id: int) -> list | None:
        """The frames of deferred message ``msg_id`` to ``peer``, taken out
        of its queue if nothing was queued after it and it is unsent (the
        caller then writes it on its channel); else None."""
        dealer = self._dealers.get(peer)
        return None if dealer is None else dealer.take_last(msg_id)

    def channel(self, peer: int) -> channel.Channel | None:
        """The calling thread's own channel to ``peer`` (made on first use;
        see :mod:`.channel`), or None where there is none: ``peer`` is on
        another host, channels were refused lately, or the loop stops."""
        endpoint = self._local.get(peer)
        if (self.channels is None or self._stopping or endpoint is None
                or not endpoint.startswith("unix://")):
            return None
        return self.channels.get(peer, endpoint)

    def _to_shm(self, b: Any) -> Any:
        m = memoryview(b)
        if m.nbytes < shm.MIN_BYTES:
            return b
        try:
            return ShmRef(self._shm.write(m), m.nbytes)
        except OSError as e:  # /dev/shm full or unwritable: the socket still works
            log.debug("shared memory unavailable (%s); sending %d bytes by socket",
                      e, m.nbytes)
            return b

    def _is_local(self, peer: int) -> bool:
        """Does ``peer`` share this host and user (it published our identity,
        see :mod:`.local`), so that it can open our shared-memory segments?"""
        return self._same_host.get(peer, False)

    def _send_frames(self, peer: int, entry: tuple, defer: bool = False) -> None:
        """Send ``entry``: (frames, their bytes, message id)."""
        if peer == self.local_id:  # to ourselves: no socket, but a real copy
            self._sent_to_self[0] += 1
            self._sent_to_self[1] += entry[1]
            self.call_soon(self.deliver, _copy_frames(entry[0]))
            return
        dealer = self._dealers.get(peer) or self._open_dealer(peer, entry)
        if dealer is None:  # held until the address is known, or dropped
            return
        dealer.queue.append(entry)
        if not defer:
            dealer.flush()
        elif not dealer.flush_due:  # (a flush already due sends this one too)
            dealer.flush_due = True
            self.call_soon(self._flush_due, dealer)

    def _flush_due(self, dealer: Dealer) -> None:
        dealer.flush_due = False  # (before the flush: a later deferral schedules anew)
        if self._dealers.get(dealer.peer) is dealer:
            dealer.flush()
        else:  # dropped meanwhile (a redial): what it holds goes on the new connection
            self._requeue(dealer)

    def _requeue(self, dealer: Dealer) -> None:
        """Send what waits in a dropped ``dealer``'s queue (deferred messages
        not yet written) as new messages to its peer: on the peer's current
        connection, or held or dropped as any message to that peer would be."""
        with dealer.lock:
            entries = list(dealer.queue)
            dealer.queue.clear()
        self._resend(dealer.peer, entries)

    def _resend(self, peer: int, entries: list) -> None:
        """Send queue entries of a dropped connection as new messages to ``peer``:
        on its current connection, or held or dropped as any message to it would be."""
        for entry in entries:
            self._send_frames(peer, entry, defer=True)

    def _open_dealer(self, peer: int, entry: tuple) -> Dealer | None:
        """The connection to ``peer``, made now; None when the message (``entry``)
        cannot go yet (held until ``peer``'s address is known) or at all (dropped)."""
        with self._dealers_lock:
            dealer = self._dealers.get(peer)
            if dealer is not None:
                return dealer
            address = self._addresses.get(peer)
            if address is None and not (self._stopping or self._zmq.closed
                                        or peer in self._forgotten):
                held = self._held.setdefault(peer, deque())
                if len(held) < MAX_HELD:
                    held.append(entry)
                    return None
            if address is None or self._stopping or self._zmq.closed:
                log.warning("dropping a message to peer %d: %s", peer,
                            "transport stopped" if address is not None or self._stopping
                            else "it left the group" if peer in self._forgotten
                            else f"its address is unknown and {MAX_HELD} messages wait")
                return None
            return self._new_dealer(peer, address)

    def _new_dealer(self, peer: int, address: str) -> Dealer | None:
        """Connect to ``peer`` (the caller holds the dealers' lock)."""
        if self._stopping or self._zmq.closed:
            return None
        endpoint = self._local.get(peer)
        if endpoint is not None and endpoint.startswith("unix://"):
            return self._new_unix_dealer(peer, endpoint)
        self._links[peer] = time.monotonic()  # down until connected
        dealer = self._dealers[peer] = Dealer(peer, self.note_drop, self._resend,
                                             *self._zmq.connect(endpoint or address))
        self.call_soon(self._watch, peer, dealer)
        return dealer

    def _new_unix_dealer(self, peer: int, endpoint: str) -> Dealer:
        """A plain Unix socket to ``peer`` (see :mod:`.unix`)."""
        sender = unix.UnixSender(endpoint, self._token,
                                 lambda s: self.call_soon(self._unix.want_write, s))
        dealer = self._dealers[peer] = Dealer(peer, self.note_drop, self._resend, sender)
        self._links[peer] = None if sender.connected else time.monotonic()
        self.call_soon(self._watch, peer, dealer)
        return dealer

    def _watch(self, peer: int, dealer: Dealer) -> None:
        """Poll ``dealer``'s monitor (on the I/O thread, which owns the poller)."""
        if self._poller is None or dealer.sock.closed or self._dealers.get(peer) is not dealer:
            close_monitor(dealer)
            return
        if dealer.monitor is None:  # a plain Unix socket: watched by the hub
            if self._unix is not None:
                self._unix.watch(peer, dealer)
            return
        self._zmq.watch(peer, dealer)

    def call_soon(self, fn: Callable, *args: Any) -> None:
        """Run ``fn(*args)`` on the I/O thread (safe from any thread)."""
        self._queue.append((fn, args))
        if self._sleeping:
            self._wake()

    def call_later(self, delay: float, fn: Callable, *args: Any) -> list:
        """Run ``fn(*args)`` on the I/O thread after ``delay`` s; returns a handle.

        Cancel with :meth:`cancel`. Safe from any thread.
        """
        entry = self._timers.add(time.monotonic() + delay, fn, args)
        # A call's deadline is usually far off: wake the loop only if it would
        # otherwise sleep past this one (waking costs a GIL round trip).
        if entry[0] < self._poll_until and self._sleeping:
            self._wake()
        return entry

    def cancel(self, handle: list) -> None:
        """Cancel a timer (see :class:`~.timers.Timers`)."""
        self._timers.cancel(handle)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):  # pipe full: the loop is awake anyway
            pass

    # -- stopping ----------------------------------------------------------
    def stop(self, timeout: float = 5.0) -> None:
        """Stop the loop, let queued frames drain (bounded), close everything."""
        if self._thread is not None and self._thread.is_alive():
            self.call_soon(self._request_stop)
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("nbrpc I/O thread did not stop within %.1f s", timeout)
        else:
            self._close()

    def _request_stop(self) -> None:
        self._stopping = True

    def _close(self) -> None:
        if self._closed:  # the pipe's fds may belong to someone else by now
            return
        self._closed = True
        _running.discard(self)
        if self._shm is not None:
            self._shm.close()
        with self._dealers_lock:
            for dealer in self._dealers.values():
                dealer.flush()  # (deferred messages a last flush missed)
                with dealer.lock:
                    dealer.close(LINGER_MS)
                close_monitor(dealer)
            self._dealers.clear()
        if self.channels is not None:
            self.channels.close()
        if self._unix is not None:
            self._unix.close()
        self._zmq.close()
        self._close_pipe()

    # -- the loop ----------------------------------------------------------
    def _run(self) -> None:
        self.thread_ident = threading.get_ident()
        poller = self._poller = zmq.Poller()
        poller.register(self._wake_r, zmq.POLLIN)
        self._zmq.start(poller)
        if self._unix is not None:
            self._unix.start(poller)
        router, queue, zmq_handlers = self._zmq.router, self._queue, self._zmq.handlers
        others = self._unix.handlers if self._unix is not None else {}
        stalled = False
        try:
            while not self._stopping:
                # Announce the sleep before reading the timers: a timer added
                # from now on either is seen below or wakes the poll (while
                # _poll_until is unknown, any new timer counts as earlier).
                self._poll_until = float("inf")
                self._sleeping = True
                timeout = self._timer_timeout()
                self._poll_until = time.monotonic() + timeout / 1000
                if queue:
                    timeout = 0
                ready = dict(poller.poll(timeout))
                polled = time.monotonic()
                self._sleeping = False
                if self._wake_r in ready:
                    try:
                        while os.read(self._wake_r, 4096):
                            pass
                    except BlockingIOError:
                        pass
                self._serve_queue()
                if router in ready:
                    self._zmq.recv_batch()
                if len(ready) > (router in ready) + (self._wake_r in ready):
                    for sock, events in ready.items():
                        if sock in others:
                            others[sock](sock, events)
                        elif sock in zmq_handlers:  # the ZAP socket, a link monitor
                            zmq_handlers[sock]()
                if self._timers:
                    # paused since the poll: poll again (at once: timers are due) first
                    stalled = not stalled and time.monotonic() - polled > STALL_S
                    if not stalled:
                        self._run_timers()
            self._serve_queue()  # what was queued before the stop request
        except Exception:  # a bug here must not silently kill the agent
            log.exception("nbrpc I/O thread crashed")
        finally:
            self._close()

    def _serve_queue(self) -> None:
        queue = self._queue
        for _ in range(len(queue)):
            fn, args = queue.popleft()
            try:
                fn(*args)
            except Exception:
                log.exception("nbrpc I/O callback %r failed", fn)

    def _drop_dealer(self, peer: int, linger: int = 0) -> None:
        with self._dealers_lock:
            entry = self._dealers.pop(peer, None)
            if entry is not None:
                self._links.pop(peer, None)
        if entry is not None:
            if entry.monitor is None and self._unix is not None:
                self._unix.forget(entry)
            self._resend(peer, entry.drop(linger))
            entry.flush()  # what a sender appended while drop() held the lock: resent
            self._zmq.unwatch(entry)

    def deliver(self, frames: list, via: Any = None) -> None:
        """Check and hand on one message (the I/O thread, or a channel's
        thread with the channel it came on, ``via``)."""
        try:
            env = unpack(self._key, frames, self.max_message_size)
        except BadMessage as e:
            self.note_drop(e.reason, str(e))
            return
        if env.dest != self.local_id or env.run != self.run and env.run and self.run:
            # signed by a member of this group's key, for someone else or for
            # another run of the group: a recorded message played back
            wrong = "wrong destination" if env.dest != self.local_id else "wrong run"
            self.note_drop(wrong, f"message {env.seq} of rank {env.sender} to rank "
                                  f"{env.dest}, run {env.run:x} (this is rank "
                                  f"{self.local_id}, run {self.run:x})")
            return
        with self._guard_lock:
            why = self._guard.check(env.incarnation, env.seq, env.sent_at, time.time())
        if why is not None:
            self.note_drop(why, f"message {env.seq} of rank {env.sender}, sent "
                                f"{time.time() - env.sent_at:.0f} s ago"
                                + (" (are the hosts' clocks set?)" if why == "stale" else ""))
            return
        if env.flags & FLAG_SHM:
            try:
                env.buffers = [shm.read(b.name, b.nbytes) if type(b) is ShmRef
                               else b for b in env.buffers]
            except (OSError, ValueError) as e:
                self.note_drop("unreadable segment", f"from rank {env.sender}: {e}")
                if self.on_unread is not None:  # (signed: its sender hears why)
                    env.channel = via
                    self.on_unread(env, f"a shared-memory segment it named is unreadable ({e})")
                return
        nbytes = env.payload.nbytes + sum(memoryview(b).nbytes for b in env.buffers)
        with self._guard_lock:
            self.recv_msgs += 1
            self.recv_bytes += nbytes
        env.channel = via
        try:
            self._on_message(env)
        except Exception:
            log.exception("dropped a message of kind %d from %d: its handler failed",
                          env.kind, env.sender)

    def _timer_timeout(self) -> int:
        """Milliseconds to sleep: until the next timer, and never above
        _MAX_SLEEP, so that a far deadline (a call's 60 s) needs no wake-up."""
        return self._timers.sleep_ms(time.monotonic(), _MAX_SLEEP_MS)

    def _run_timers(self) -> None:
        for fn, args in self._timers.pop_due(time.monotonic()):
            try:
                fn(*args)
            except Exception:
                log.exception("nbrpc timer %r failed", fn)


def _copy_frames(frames: list) -> list:
    """What a socket would deliver: private copies (buffers writable, for torch)."""
    return [bytes(frames[0])] + [bytearray(f) for f in frames[1:]]


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _close_fds(*fds: int) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


# The loops whose thread runs. At interpreter exit (a script, or a kernel, that
# never called shutdown()) each is stopped, so that its own thread closes its
# sockets, shared memory and socket directory, in order: no other thread may
# close a zmq socket under its poll, which is why the hubs' finalizers do not
# run at exit. (Registered after pyzmq's own exit hook: it runs before it.) A
# forked child has none: its parent's loops, threads and directories stay the parent's.
_running: weakref.WeakSet[IOLoop] = weakref.WeakSet()
os.register_at_fork(after_in_child=_running.clear)


def _stop_running() -> None:
    for loop in list(_running):
        loop.stop(EXIT_STOP_S)


atexit.register(_stop_running)
