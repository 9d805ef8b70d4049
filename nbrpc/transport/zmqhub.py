"""The I/O thread's ZeroMQ side: the ROUTER that ``tcp://`` peers connect to,
its authentication, and the DEALERs to peers with their link monitors.

Peers on other hosts (and every peer with ``local_ipc=False`` or
``encrypt=True``) talk over zmq; peers on one host over plain Unix sockets
(:mod:`.unix`). :class:`~.io.IOLoop` owns both hubs and picks by the scheme of
a peer's address.

Connections are authenticated before any message is read: the ROUTER speaks
ZeroMQ's PLAIN mechanism, and its ZAP handler (served on the I/O thread)
accepts a connection only if its password is ``HMAC(key, "nbrpc-connect")``,
which only key holders can compute. A peer without the key never completes a
handshake, so nothing it sends is allocated or read (the token travels in
clear; on a network someone can sniff, use ``encrypt=True``, where CURVE's
handshake does the same job without revealing anything).

What a connection costs before that: libzmq reads handshake commands as it
reads any frame, up to the socket's maximum frame size (``ZMQ_MAXMSGSIZE``),
for up to ``HANDSHAKE_MS``. That maximum is ``frames.CHUNK`` (256 KiB, and
the 33 bytes CURVE wraps a frame in): a larger frame is refused before it is
allocated and its connection closed,
and messages with larger parts cross ``tcp://`` cut into parts
(:func:`~.frames.split`, put back together by :meth:`ZmqHub._recv_split`
straight into each frame's buffer). So a peer without the key makes an agent
hold at most ``CHUNK`` bytes per connection, for at most ``HANDSHAKE_MS``
(``tests/test_security_handshake.py``: a 512 MB handshake frame, plain or
CURVE, grows the agent by nothing). And at most ``PENDING_MAX`` connections
are mid-handshake at once: the ROUTER's monitor reports each connection it
accepts, with its fd, and one accepted while that many others may still be
mid-handshake is cut at once (``shutdown(2)`` on the fd: libzmq sees the
peer go, and closes it itself). libzmq reports a handshake's success without
its fd, so :class:`PendingHandshakes` counts a success against the oldest
connection still pending, and forgets a connection once it is older than
``HANDSHAKE_MS``: by then it is in, or libzmq has closed it. So a peer without
the key holds at most ``PENDING_MAX * CHUNK`` (16 MiB) of an agent, however
many connections it opens. A connected peer is
bounded too: a message's declared size is checked against the maximum
message size before anything is allocated for it, and libzmq reads at most
``RCVHWM`` queued messages per peer.

Encryption (``encrypt=True``): every connection uses ZeroMQ's CURVE
(Curve25519 key exchange, then every frame encrypted and authenticated by
libsodium). The server key pair of every agent is derived from the group
key, so a peer without the key cannot even complete a connection: nothing it
sends reaches the I/O thread. For traffic that crosses networks you do not
trust; on one host or a private network, signing alone is enough and faster.

Links: every DEALER is watched by a libzmq socket monitor, so the agent
learns within milliseconds that the process at the other end is gone (the
kernel closed its connection), with no heartbeat involved.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import socket
import sys
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from .auth import curve_keys, zap_answer
from .frames import CHUNK, MAX_FRAMES, BadMessage, layout

log = logging.getLogger(__name__)

RCVHWM = 1000  # messages queued per sending peer before libzmq stops reading it
LINGER_MS = 500  # how long a DEALER's close lets queued frames drain
HANDSHAKE_MS = 5_000  # a connection not authenticated by then is closed
PENDING_MAX = 64  # connections mid-handshake at once, at most (more are cut)
WRAP_BYTES = 64  # what CURVE adds to a frame on the wire (33 bytes: nonce, MAC, command)
TRIM_AFTER = 64 << 20  # bytes received in parts before the heap is trimmed
TRIM_DELAY = 0.5  # seconds after that, and once the flow pauses
_RECV_BATCH = 256  # messages read per wake-up before call_soon work is served again
_LINK_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
_ROUTER_EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
# plain ints: pyzmq's enum members cost an enum construction per ``&`` (~0.5 µs)
_RCVMORE, _EVENTS, _POLLIN = int(zmq.RCVMORE), int(zmq.EVENTS), int(zmq.POLLIN)

# A lost host (power loss, a partition, a frozen VM) closes no connection, but
# its kernel stops acknowledging what is sent to it, while a peer that is only
# busy (GIL held, stopped, swapping) keeps being acknowledged by its kernel. A
# DEALER's TCP connection whose data stays unacknowledged is closed by the
# kernel (TCP_USER_TIMEOUT, through ZMQ_TCP_MAXRT): its monitor then reports
# the link down, as for a process that exited. Linux counts UNACKED_MS from the
# first retransmission, one RTO (at least 200 ms) after the send: on a LAN the
# connection goes about a second after the first message that got no answer
# (measured: 1.02 s). Heartbeats keep data in flight to the coordinator and from it.
# The cost: Linux closes a connection whose peer takes nothing (zero window) as
# long, too: a process stopped (SIGSTOP, a debugger) with more sent to it than
# its socket buffer holds. Its kernel answers the redial at once, so its link is
# not down long enough to count, but the message cut off is lost.
UNACKED_MS = 600
# Where the kernel closes such a connection (TCP_USER_TIMEOUT is Linux's), a
# member's link is proof enough that its process is alive, however long its
# Python stays silent; elsewhere the agent needs a silence rule for lost hosts.
LOST_HOSTS_CLOSE_LINKS = sys.platform.startswith("linux")
# Dialling a lost host again: SYNs that go unanswered are given up after
# CONNECT_MS (not the kernel's two minutes) and tried again, backing off from
# 100 ms to REDIAL_MAX_MS, so a link that comes back is found within seconds.
CONNECT_MS = 2000
REDIAL_MAX_MS = 2000
# Idle connections (a ROUTER's accepted ones; a DEALER nobody writes) are
# probed (TCP keepalive): a half-open connection from a host that vanished is
# closed within seconds, not kept for ever.
KEEPALIVE_IDLE_S, KEEPALIVE_INTVL_S, KEEPALIVE_CNT = 10, 2, 3


class PendingHandshakes:
    """Which of a ROUTER's accepted connections may still be mid-handshake,
    from its monitor's events (pure state: no sockets, no clock of its own).

    libzmq reports a connection accepted and one closed with its fd, but a
    handshake's success with no fd. So a success is counted against the
    oldest connection still pending (the count is right, the attribution
    may not be), and a connection accepted more than ``window`` seconds ago
    is pending no longer: by then libzmq has let it in or closed it.

    >>> pending = PendingHandshakes(limit=2, window=5.0)
    >>> pending.accepted(10, now=0.0), pending.accepted(11, now=0.1)
    (True, True)
    >>> pending.accepted(12, now=0.2)  # a third at once: cut it
    False
    >>> pending.succeeded(now=0.3); pending.accepted(12, now=0.4)
    True
    >>> pending.closed(11); len(pending)
    1
    >>> len(pending.expire(now=6.0))
    0
    """

    def __init__(self, limit: int = PENDING_MAX, window: float = HANDSHAKE_MS / 1000 + 1) -> None:
        self.limit, self.window = limit, window
        self._open: OrderedDict[int, float] = OrderedDict()  # fd -> when accepted, oldest first

    def __len__(self) -> int:
        return len(self._open)

    def expire(self, now: float) -> PendingHandshakes:
        """Forget connections accepted more than ``window`` ago."""
        while self._open and next(iter(self._open.values())) <= now - self.window:
            self._open.popitem(last=False)
        return self

    def accepted(self, fd: int, now: float) -> bool:
        """Connection ``fd`` was accepted: False when ``limit`` others may
        still be mid-handshake (then cut it; it is not counted)."""
        self.expire(now)
        self._open.pop(fd, None)  # (a number reused after a close we missed)
        if len(self._open) >= self.limit:
            return False
        self._open[fd] = now
        return True

    def succeeded(self, now: float) -> None:
        """A handshake succeeded, on some connection."""
        if self.expire(now)._open:
            self._open.popitem(last=False)

    def closed(self, fd: int) -> None:
        self._open.pop(fd, None)


def cut_connection(fd: int, port: int) -> str | None:
    """Shut down the TCP connection libzmq holds as ``fd`` (without closing
    the fd, which is libzmq's: libzmq sees the peer go and closes it), if it
    is still a connection accepted on ``port``. Returns the peer's address,
    or None when ``fd`` is no longer such a connection."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:  # closed already (EBADF), or no longer a socket
        return None
    with sock:
        try:
            if sock.type != socket.SOCK_STREAM or sock.family not in (
                    socket.AF_INET, socket.AF_INET6) or sock.getsockname()[1] != port:
                return None
            peer = sock.getpeername()
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # gone meanwhile
            return None
    return f"{peer[0]}:{peer[1]}"


class ZmqHub:
    """The ROUTER, its ZAP handler and the DEALERs' monitors. The DEALERs
    themselves are written by the senders (see :class:`~.io.IOLoop`); all
    else here runs on the I/O thread. ``handlers`` maps each socket to poll,
    other than the ROUTER (polled first, :meth:`recv_batch`), to what to call.
    """

    def __init__(self, key: bytes, token: bytes, max_size: int, encrypt: bool, *,
                 deliver: Callable[[list], None], note_drop: Callable[[str, str], None],
                 links: dict, link_up: Callable[[int], None],
                 is_current: Callable[[int, Any], bool], name: str,
                 call_later: Callable[..., Any]) -> None:
        self._token = token
        self._deliver, self._note_drop, self._links, self._name = deliver, note_drop, links, name
        self._link_up = link_up  # (peer): its connection is up again, after being down
        self._is_current = is_current  # (peer, dealer): still that peer's dealer?
        self._call_later = call_later
        self._untrimmed, self._trim_due = 0, False  # bytes received in parts since a trim
        self.ctx = zmq.Context()
        router = self.router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVHWM, RCVHWM)
        # No frame over tcp:// is larger than CHUNK (frames.split), and libzmq
        # refuses a larger one before allocating it, in the handshake too: a
        # peer without the key makes us hold at most that, for HANDSHAKE_MS.
        router.setsockopt(zmq.MAXMSGSIZE, CHUNK + WRAP_BYTES)
        router.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
        router.setsockopt(zmq.TCP_KEEPALIVE, 1)  # (a host that vanished: see UNACKED_MS)
        router.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
        router.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL_S)
        router.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_CNT)
        self._max_size = max_size  # bytes a message's frames may add up to
        self._curve = curve_keys(key) if encrypt else None
        self._zap: zmq.Socket | None = None
        if self._curve is not None:
            router.setsockopt(zmq.CURVE_SERVER, 1)
            router.setsockopt(zmq.CURVE_SECRETKEY, self._curve[1])
        else:  # (bound before the ROUTER: no handshake ever goes unchecked)
            self._zap = self.ctx.socket(zmq.REP)
            self._zap.setsockopt(zmq.LINGER, 0)
            self._zap.bind("inproc://zeromq.zap.01")
            router.setsockopt(zmq.PLAIN_SERVER, 1)
            router.setsockopt(zmq.ZAP_DOMAIN, b"nbrpc")
        self.refused = 0  # connections refused: no key, or too many mid-handshake
        # Every connection the ROUTER accepts, closes or lets in, for
        # PendingHandshakes (RCVHWM 0: an event missed would go uncounted).
        self._pending, self._port = PendingHandshakes(), 0
        self._router_events = self.ctx.socket(zmq.PAIR)
        self._router_events.setsockopt(zmq.RCVHWM, 0)
        router.monitor("inproc://nbrpc.router-events", _ROUTER_EVENTS)
        self._router_events.connect("inproc://nbrpc.router-events")
        self.handlers: dict[Any, Callable[[], None]] = {}
        self._monitors: dict[zmq.Socket, tuple[int, Any]] = {}  # monitor -> (peer, dealer)
        self._poller: zmq.Poller | None = None
        # A hub dropped without close() (an Agent made, never started, and let
        # go) must not leave its context to the garbage collector, which may
        # finalize the context before its sockets: term() then waits for them
        # for ever. This closes them first; close() runs it too. Not at
        # interpreter exit (a script that never called shutdown()): the I/O
        # thread may still be polling these sockets, and a zmq socket is not
        # to be closed under another thread's poll; the loop is stopped then
        # and closes them from its own thread (io._stop_running).
        self._finalizer = weakref.finalize(self, _drop, self.ctx,
                                           [router, self._zap, self._router_events])
        self._finalizer.atexit = False

    @property
    def closed(self) -> bool:
        return self.ctx.closed

    def bind(self, where: str) -> str:
        """Bind the ROUTER at ``tcp://host:port``; returns the address bound."""
        try:
            self.router.bind(where)
        except zmq.ZMQError as e:
            raise OSError(
                f"nbrpc could not bind {where}: {e}. Choose another port, or stop the "
                "process that holds it."
            ) from e
        bound = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._port = int(bound.rpartition(":")[2])
        return bound

    def start(self, poller: zmq.Poller) -> None:
        self._poller = poller
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._router_events, zmq.POLLIN)
        self.handlers[self._router_events] = self._on_router_events
        if self._zap is not None:
            poller.register(self._zap, zmq.POLLIN)
            self.handlers[self._zap] = self._authenticate

    # -- incoming ------------------------------------------------------------
    def recv_batch(self) -> None:
        """Deliver what the ROUTER holds (at most ``_RECV_BATCH`` messages)."""
        # getsockopt, not the .rcvmore/.events properties (pyzmq resolves those
        # through a slow __getattr__), and EVENTS rather than waiting for the
        # zmq.Again exception that a non-blocking recv raises when empty.
        router, getsockopt, deliver = self.router, self.router.getsockopt, self._deliver
        RCVMORE, EVENTS, POLLIN = _RCVMORE, _EVENTS, _POLLIN
        for _ in range(_RECV_BATCH):
            if not getsockopt(EVENTS) & POLLIN:
                return
            router.recv()  # connection identity: unused
            frames = []
            while getsockopt(RCVMORE):  # the head as bytes; buffers zero-copy
                frames.append(router.recv(copy=not frames))
                if not frames[0]:  # a message cut into parts (frames.split)
                    frames = self._recv_split()
                    break
            if frames:
                deliver(frames)

    def _recv_split(self) -> list | None:
        """The rest of a message cut into parts (:func:`~.frames.split`), put
        back together: its layout frame, then each frame's parts received
        straight into that frame's buffer. None (counted) when the parts do
        not fit the layout; whatever is left of the message is then skipped."""
        router, getsockopt = self.router, self.router.getsockopt
        try:
            if not getsockopt(_RCVMORE):
                raise BadMessage("framing", "a layout frame is missing")
            lengths = layout(router.recv(), self._max_size)
            frames = []
            for length in lengths:
                buf = bytearray(length)  # (writable: torch's tensors use it in place)
                view, pos = memoryview(buf), 0
                while pos < length:
                    if not getsockopt(_RCVMORE):
                        raise BadMessage("framing", "fewer parts than the layout declares")
                    got = router.recv_into(view[pos:])
                    if not 0 < got <= length - pos:
                        raise BadMessage("framing", "a part does not fit its frame")
                    pos += got
                frames.append(buf)
            if getsockopt(_RCVMORE):
                raise BadMessage("framing", "more parts than the layout declares")
            self._parts_received(sum(lengths))
            return frames
        except BadMessage as e:
            skipped = 0
            for _ in range(MAX_FRAMES * 64):  # (parts of at most CHUNK bytes)
                if not getsockopt(_RCVMORE):
                    break
                skipped += router.recv_into(bytearray())  # (discards the part)
            self._parts_received(skipped)
            self._note_drop(e.reason, str(e))
            return None

    def _parts_received(self, nbytes: int) -> None:
        """libzmq received ``nbytes`` in parts of at most CHUNK bytes, each
        in its own malloc'd block. glibc keeps freed blocks of that size in
        the I/O thread's arena rather than returning them (a 1 GB tensor
        would stay in the process's RSS as free heap): hand them back to
        the system once ``TRIM_AFTER`` bytes have come, when the flow
        pauses (``trim_heap`` runs on the I/O thread, ~50 ms per GB)."""
        self._untrimmed += nbytes
        if self._untrimmed >= TRIM_AFTER and not self._trim_due:
            self._trim_due = True
            self._call_later(TRIM_DELAY, self._trim)

    def _trim(self) -> None:
        if self.router.closed:
            return
        if self.router.getsockopt(_EVENTS) & _POLLIN:  # still coming: later
            self._call_later(TRIM_DELAY, self._trim)
            return
        self._trim_due, self._untrimmed = False, 0
        trim_heap()

    def _on_router_events(self) -> None:
        """Count the connections mid-handshake (:class:`PendingHandshakes`),
        and cut each one accepted while ``PENDING_MAX`` others may be."""
        pending, cut = self._pending, []
        for _ in range(4096):
            try:
                event = recv_monitor_message(self._router_events, zmq.NOBLOCK)
            except zmq.Again:
                break
            kind, fd, now = event["event"], event["value"], time.monotonic()
            if kind == zmq.EVENT_ACCEPTED:
                if not pending.accepted(fd, now):
                    cut.append(fd)
            elif kind == zmq.EVENT_DISCONNECTED:
                pending.closed(fd)
                if fd in cut:  # (gone already: its number may be anyone's next)
                    cut.remove(fd)
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                pending.succeeded(now)
        for fd in cut:  # every event read first: none of these has closed since
            peer = cut_connection(fd, self._port)
            if peer is not None:
                self.refused += 1
                self._note_drop("refused connection",
                                f"a connection from {peer} while {len(pending)} others "
                                f"were mid-handshake (at most {pending.limit})")

    def _authenticate(self) -> None:
        """Answer ZAP requests (RFC 27): a connection is let in only with the
        group's connection token as its PLAIN password."""
        zap = self._zap
        for _ in range(64):
            try:
                request = zap.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            reply, refused = zap_answer(request, self._token)
            if refused is not None:
                self.refused += 1
                self._note_drop("refused connection",
                                f"a connection from {refused} without the group's key")
            zap.send_multipart(reply)

    # -- outgoing ------------------------------------------------------------
    def connect(self, address: str) -> tuple[zmq.Socket, zmq.Socket]:
        """A DEALER connected to ``address`` (non-blocking sends, the group's
        credentials) and its link monitor."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.LINGER, LINGER_MS)
        sock.setsockopt(zmq.MAXMSGSIZE, 1 << 16)  # (receives handshake commands only)
        sock.setsockopt(zmq.TCP_MAXRT, UNACKED_MS)  # a lost host: the link goes down
        sock.setsockopt(zmq.CONNECT_TIMEOUT, CONNECT_MS)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, REDIAL_MAX_MS)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL_S)
        sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_CNT)
        if self._curve is not None:
            server_public, _, public, secret = self._curve
            sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        else:
            sock.setsockopt(zmq.PLAIN_USERNAME, b"nbrpc")
            sock.setsockopt(zmq.PLAIN_PASSWORD, self._token)
        monitor = sock.get_monitor_socket(_LINK_EVENTS)
        sock.connect(address)
        return sock, monitor

    def watch(self, peer: int, dealer: Any) -> None:
        """Poll ``dealer``'s monitor for its link's state."""
        self._monitors[dealer.monitor] = (peer, dealer)
        self.handlers[dealer.monitor] = lambda m=dealer.monitor: self._on_link_events(m)
        self._poller.register(dealer.monitor, zmq.POLLIN)

    def _on_link_events(self, monitor: zmq.Socket) -> None:
        peer, dealer = self._monitors[monitor]
        for _ in range(64):
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                return
            except zmq.ZMQError:
                self.unwatch(dealer)
                return
            if not self._is_current(peer, dealer):
                continue
            if event == zmq.EVENT_CONNECTED:
                was = self._links.get(peer)
                self._links[peer] = None
                if was is not None:
                    self._link_up(peer)
            elif event == zmq.EVENT_DISCONNECTED and self._links.get(peer) is None:
                self._links[peer] = time.monotonic()
                log.info("%s: the connection to peer %d closed", self._name, peer)

    def unwatch(self, dealer: Any) -> None:
        """Stop watching ``dealer``'s monitor, and close it."""
        if dealer.monitor is not None and self._monitors.pop(dealer.monitor, None):
            self.handlers.pop(dealer.monitor, None)
            if self._poller is not None:
                self._poller.unregister(dealer.monitor)
        close_monitor(dealer)

    def close(self) -> None:
        """Close the monitors, the ROUTER and ZAP, then the context (every
        DEALER must be closed before: the context waits for its sockets).
        The finalizer's own work (:func:`_drop`), done now, once."""
        for _, dealer in list(self._monitors.values()):
            close_monitor(dealer)
        self._monitors.clear()
        self._finalizer()


def _drop(ctx: zmq.Context, sockets: list) -> None:
    """Close ``sockets`` (the first, the ROUTER, has a monitor: it is turned
    off before its reader goes), then what else of ``ctx``'s is open, then ``ctx``."""
    router, *others = sockets
    try:
        router.disable_monitor()
    except zmq.ZMQError:
        pass
    for sock in (router, *others):
        if sock is not None and not sock.closed:
            sock.close(linger=0)
    ctx.destroy(linger=0)


def close_monitor(dealer: Any) -> None:
    if dealer.monitor is not None and not dealer.monitor.closed:
        dealer.monitor.close(linger=0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Return the C heap's free pages to the system (glibc's ``malloc_trim``;
    nothing elsewhere)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
