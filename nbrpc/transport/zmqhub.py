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
handshake does the same job without revealing anything). Input from a
connected peer is bounded too: libzmq drops a frame larger than the maximum
message size before allocating it (``ZMQ_MAXMSGSIZE``) and reads at most
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

import logging
import time
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from .auth import curve_keys, zap_answer

log = logging.getLogger(__name__)

RCVHWM = 1000  # messages queued per sending peer before libzmq stops reading it
LINGER_MS = 500  # how long a DEALER's close lets queued frames drain
_RECV_BATCH = 256  # messages read per wake-up before call_soon work is served again
_LINK_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
# plain ints: pyzmq's enum members cost an enum construction per ``&`` (~0.5 µs)
_RCVMORE, _EVENTS, _POLLIN = int(zmq.RCVMORE), int(zmq.EVENTS), int(zmq.POLLIN)


class ZmqHub:
    """The ROUTER, its ZAP handler and the DEALERs' monitors. The DEALERs
    themselves are written by the senders (see :class:`~.io.IOLoop`); all
    else here runs on the I/O thread. ``handlers`` maps each socket to poll,
    other than the ROUTER (polled first, :meth:`recv_batch`), to what to call.
    """

    def __init__(self, key: bytes, token: bytes, max_size: int, encrypt: bool, *,
                 deliver: Callable[[list], None], note_drop: Callable[[str, str], None],
                 links: dict, is_current: Callable[[int, Any], bool], name: str) -> None:
        self._token = token
        self._deliver, self._note_drop, self._links, self._name = deliver, note_drop, links, name
        self._is_current = is_current  # (peer, dealer): still that peer's dealer?
        self.ctx = zmq.Context()
        router = self.router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.RCVHWM, RCVHWM)
        router.setsockopt(zmq.MAXMSGSIZE, max_size)  # refused before it is allocated
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
        self.refused = 0  # handshakes refused: no key
        self.handlers: dict[Any, Callable[[], None]] = {}
        self._monitors: dict[zmq.Socket, tuple[int, Any]] = {}  # monitor -> (peer, dealer)
        self._poller: zmq.Poller | None = None

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
        return self.router.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self, poller: zmq.Poller) -> None:
        self._poller = poller
        poller.register(self.router, zmq.POLLIN)
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
            deliver(frames)

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
                self._links[peer] = None
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
        """Close the ROUTER, ZAP and monitors, then the context (every DEALER
        must be closed before: the context waits for its sockets)."""
        for _, dealer in list(self._monitors.values()):
            close_monitor(dealer)
        self._monitors.clear()
        self.router.close(linger=0)
        if self._zap is not None:
            self._zap.close(linger=0)
        self.ctx.term()


def close_monitor(dealer: Any) -> None:
    if dealer.monitor is not None and not dealer.monitor.closed:
        dealer.monitor.close(linger=0)
