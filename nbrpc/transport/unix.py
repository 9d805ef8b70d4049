"""Plain Unix domain stream sockets between agents on one host.

Peers on one host (see :mod:`.local`) skip libzmq: measured here, a round
trip between two Python threads costs ~59 µs over a plain Unix socket
against ~89 µs through pyzmq's DEALER/ROUTER, whose own I/O threads add a
hand-off on each side (``benchmarks/bench_transport_floor.py``). The shape of
the transport stays the same as with zmq: the caller's thread writes its
peer's socket directly, and the receiving agent's I/O thread reads every
connection. :class:`UnixSender` therefore has the few methods of a zmq
socket that :class:`~.io.IOLoop` uses (``send_multipart``, ``close``,
``closed``), and the loop picks the backend by the scheme of a peer's
address (``unix://`` here, ``tcp://`` for zmq).

Wire format, per message: ``<I`` frame count, that many ``<Q`` frame
lengths, then the frames (the signed frames of :mod:`.frames`).

What holds as with zmq:

* **Authentication before reading.** A connection's first bytes are a
  magic string and the group's connection token (``HMAC(key,
  "nbrpc-connect")``); until they match, nothing else it sends is read. The
  socket file sits in a private 0700 directory, and the connecting process
  must run as the same user (``SO_PEERCRED``). Every message is then signed
  and checked by :func:`~.frames.unpack` as before.
* **Bounded input.** Declared sizes are checked before anything is
  allocated: at most ``MAX_FRAMES`` frames, and frames adding up to the
  receiver's maximum message size; a larger message is skipped unread (the
  stream stays in step) and counted as "too large". A connection that does
  not authenticate within ``HELLO_TIMEOUT`` is closed, and at most
  ``MAX_UNAUTHENTICATED`` wait at a time.
* **Senders never block.** Sockets are non-blocking; what the kernel does not
  take at once waits in the sender's queue and the I/O thread writes it when
  the socket is writable.
* **Link state.** The receiving side never writes on a connection, so the
  sender's socket becomes readable only when the peer closed it (its process
  exited): the I/O thread watches that, as it watches zmq's socket monitor.
"""

from __future__ import annotations

import errno
import hmac
import logging
import os
import select
import socket
import struct
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from . import local
from .frames import MAX_FRAMES

log = logging.getLogger(__name__)

MAGIC = b"nbrpc-u1"
CHANNEL_MAGIC = b"nbrpc-c1"  # a caller thread's own channel (:mod:`.channel`)
HELLO_TIMEOUT = 10.0  # seconds a new connection has to authenticate
MAX_UNAUTHENTICATED = 64  # connections waiting to authenticate, at most
MAX_QUEUED = 100_000  # messages a sender queues while its peer does not read
_IOV_MAX = 1000  # buffers per sendmsg call (the kernel's limit is 1024)
SEND_BUFFER = 4 << 20  # bytes a socket may hold unread (shared memory takes 2 MiB and up)
_CHUNK = 256 << 10  # bytes read per recv for small messages
_READ_BUDGET = 8 << 20  # bytes read from one connection per wake-up
_COUNT = struct.Struct("<I")
_LEN_SIZE = 8  # each frame's length ("<Q") follows the count
_PEERCRED = struct.Struct("3i")
_GONE = (errno.ENOENT, errno.ECONNREFUSED, errno.EAGAIN)


class Refused(Exception):
    """A connection failed its handshake (it is closed)."""


def path_of(endpoint: str) -> str:
    """The file path of a ``unix://`` endpoint."""
    return endpoint.removeprefix("unix://")


def stream_socket() -> socket.socket:
    """A Unix stream socket whose send buffer holds a message of up to
    ``SEND_BUFFER`` bytes (the kernel caps it at ``net.core.wmem_max``), so a
    tensor below the shared-memory threshold is written in one call, without
    waiting for the reader's thread to make room."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with_send_buffer(sock)
    return sock


def with_send_buffer(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    except OSError:  # (a cap is applied silently; an error only where it is unsupported)
        pass


def _drop(listener: socket.socket, directory: str | None) -> None:
    listener.close()
    local.remove_dir(directory)


def listen(path: str) -> socket.socket:
    """A non-blocking listening socket at ``path``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def accept(listener: socket.socket) -> socket.socket | None:
    """The next waiting connection, if any and if it comes from this user."""
    try:
        conn, _ = listener.accept()
    except (BlockingIOError, InterruptedError):
        return None
    conn.setblocking(False)
    with_send_buffer(conn)  # (it writes a channel's answers)
    try:
        _, uid, _ = _PEERCRED.unpack(
            conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
    except (OSError, AttributeError):
        uid = os.getuid()  # no SO_PEERCRED here: the 0700 directory still holds
    if uid != os.getuid():
        conn.close()
        raise Refused(f"a connection from user id {uid}")
    return conn


class UnixSender:
    """The outgoing connection to one peer (written under the caller's lock).

    ``want_write(sender)`` is called (from the writing thread) when bytes are
    left waiting for the socket to become writable; the I/O thread then calls
    :meth:`flush`. While the peer cannot be reached, messages wait (at most
    ``MAX_QUEUED``) and the I/O thread calls :meth:`connect` again.
    """

    def __init__(self, endpoint: str, token: bytes,
                 want_write: Callable[[UnixSender], None]) -> None:
        self.path = path_of(endpoint)
        self._hello = MAGIC + token
        self._want_write = want_write
        self._queue: deque[list] = deque()  # per message: its remaining memoryviews
        self._started = False  # the first queued message is partly written
        self._blocked = False  # the kernel's buffer was full: the I/O thread writes
        self.closed = False
        self.connected = False
        self.sock: socket.socket | None = None
        self.connect()

    def fileno(self) -> int:
        return self.sock.fileno() if self.sock is not None else -1

    @property
    def pending(self) -> bool:
        return bool(self._queue)

    def connect(self) -> bool:
        """(Re)connect; True when connected. The handshake goes first."""
        self.drop_sock()
        sock = stream_socket()
        sock.setblocking(False)
        try:
            sock.connect(self.path)
        except OSError as e:
            sock.close()
            if e.errno not in _GONE:
                log.debug("cannot connect to %s: %s", self.path, e)
            return False
        self.sock, self.connected = sock, True
        if self._started:  # a message cut short by the old connection cannot resume
            self._queue.popleft()
            self._started = False
        self._queue.appendleft([memoryview(self._hello)])
        self._write()
        return True

    def send_multipart(self, frames: list, copy: bool = False, more: bool = False) -> None:
        """Queue one message and write what the socket takes now; ``more``:
        another follows at once, so only queue (the last one writes them all,
        as many as fit in one ``sendmsg``)."""
        if self.closed:
            return
        if len(self._queue) >= MAX_QUEUED:
            raise BufferError(f"{MAX_QUEUED} messages wait for {self.path}")
        views = [memoryview(f).cast("B") for f in frames]
        n = len(views)
        head = struct.pack(f"<I{n}Q", n, *[v.nbytes for v in views])
        self._queue.append([memoryview(head), *views])
        if not more:
            self.push()

    def push(self) -> None:
        """Write what is queued, unless the I/O thread waits to (socket full)."""
        if self.connected and not self._blocked:
            self._write()

    def flush(self) -> bool:
        """Write what waits (the I/O thread, when writable); True if all went."""
        if self.connected:
            self._write()
        return not self._queue

    def _write(self) -> None:
        """Write queued messages, several per ``sendmsg`` (at most ``_IOV_MAX``
        buffers), until all went or the kernel's buffer is full."""
        queue, sock = self._queue, self.sock
        self._blocked = False
        while queue:
            batch: list = []
            for views in queue:
                batch += views[:_IOV_MAX - len(batch)]
                if len(batch) >= _IOV_MAX:
                    break
            try:
                sent = sock.sendmsg(batch)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as e:  # the peer closed: what waits stays for a reconnect
                log.debug("write to %s failed: %s", self.path, e)
                self.connected = False
                return
            full = sent < sum(v.nbytes for v in batch)
            while queue:  # drop what went (empty frames too: shared memory leaves one)
                views = queue[0]
                before = len(views)
                while views and views[0].nbytes <= sent:
                    sent -= views.pop(0).nbytes
                if views:  # cut short here
                    self._started = self._started or sent > 0 or len(views) < before
                    if sent:
                        views[0] = views[0][sent:]
                    break
                queue.popleft()
                self._started = False
            if full:  # the kernel's buffer is full: the I/O thread goes on
                self._blocked = True
                self._want_write(self)
                return

    def drop_sock(self) -> None:
        """Close the connection (the peer hung up, or we close); what waits stays."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.connected = False

    def close(self, linger: int | None = 0) -> None:
        """Close, first writing what waits for up to ``linger`` ms."""
        if self.closed:
            return
        self.closed = True
        deadline = time.monotonic() + (linger or 0) / 1000
        while self._queue and self.connected and time.monotonic() < deadline:
            self._write()
            if self._queue and self.sock is not None:
                try:
                    select.select([], [self.sock], [], max(0.0, deadline - time.monotonic()))
                except (OSError, ValueError):
                    break
        self._queue.clear()
        self.drop_sock()


class UnixReceiver:
    """One incoming connection (read by the I/O thread only).

    :meth:`read` returns the complete messages that arrived, each a list of
    frames (views of one private, writable buffer per message: tensors are
    built on them). Messages skipped as too large are listed in ``skipped``.
    """

    def __init__(self, sock: socket.socket, token: bytes, max_size: int,
                 authenticated: bool = False) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self._token = token
        self.authenticated = authenticated  # (True: our own outgoing channel)
        self.channel = False  # it opened with CHANNEL_MAGIC (see :mod:`.channel`)
        self.due: int | None = None  # adopted channel: answers still to come
        self._max = max_size
        self._chunk = bytearray(_CHUNK)
        self._buf = bytearray()  # bytes read and not yet parsed
        self._big: bytearray | None = None  # a large message being filled in place
        self._big_fill = 0
        self._big_lengths: list[int] = []
        self._skip = 0  # bytes of a too-large message still to discard
        self.skipped: list[str] = []

    def read(self) -> tuple[list[list], bool]:
        """(the messages now complete, whether the peer closed the connection).
        Raises Refused for a failed handshake or a stream out of step."""
        out: list[list] = []
        budget = _READ_BUDGET
        while budget > 0:
            if self._big is not None:
                target = memoryview(self._big)[self._big_fill:]
            else:
                target = memoryview(self._chunk)
            try:
                n = self.sock.recv_into(target)
            except (BlockingIOError, InterruptedError):
                return out, False
            except OSError:
                return out, True
            if not n:
                return out, True
            budget -= n
            drained = n < target.nbytes  # (poll is level-triggered: no recv to find out)
            if self._big is not None:
                self._big_fill += n
                if self._big_fill == len(self._big):
                    out.append(_split(self._big, self._big_lengths))
                    self._big = None
            else:
                data = target[:n]
                if self._skip:
                    cut = min(self._skip, n)
                    self._skip -= cut
                    data = data[cut:]
                self._buf += data
                self._parse(out)
            if drained:
                break
        return out, False

    def _parse(self, out: list) -> None:
        buf = self._buf
        if not self.authenticated:
            size = len(MAGIC) + len(self._token)
            if len(buf) < size:
                return
            magic = bytes(buf[:len(MAGIC)])
            if magic not in (MAGIC, CHANNEL_MAGIC) or not hmac.compare_digest(
                    bytes(buf[len(MAGIC):size]), self._token):
                raise Refused("a connection without the group's key")
            self.authenticated, self.channel = True, magic == CHANNEL_MAGIC
            del buf[:size]
            if self.channel:  # what follows is read by the channel's own thread
                return
        pos = 0
        while len(buf) - pos >= _COUNT.size:
            n = _COUNT.unpack_from(buf, pos)[0]
            if not 1 <= n <= MAX_FRAMES:
                raise Refused(f"a message of {n} frames")  # out of step: close
            head_end = pos + _COUNT.size + n * _LEN_SIZE
            if len(buf) < head_end:
                break
            lengths = struct.unpack_from(f"<{n}Q", buf, pos + _COUNT.size)
            total = sum(lengths)
            if total > self._max:  # skipped unread; the stream stays in step
                self.skipped.append(f"{total} bytes declared, at most {self._max} accepted")
                have = min(total, len(buf) - head_end)
                self._skip = total - have
                pos = head_end + have
                continue
            if len(buf) - head_end < total:
                if total > _CHUNK:  # read the rest straight into its own buffer
                    big = bytearray(total)
                    have = len(buf) - head_end
                    big[:have] = buf[head_end:]
                    self._big, self._big_fill, self._big_lengths = big, have, lengths
                    pos = len(buf)
                break
            out.append(_split(buf[head_end:head_end + total], lengths))
            pos = head_end + total
        if pos:
            del buf[:pos]

    def close(self) -> None:
        self.sock.close()


def _hung_up(sock: socket.socket) -> bool:
    """Did the peer close ``sock``? (Its receiver never writes: any byte, the
    end of the stream or an error all mean the connection is done.)"""
    try:
        sock.recv(1, socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        pass
    return True


def _split(data: bytearray, lengths: list[int]) -> list:
    """Frames as views of one private buffer (writable: torch builds on them)."""
    view, frames, pos = memoryview(data), [], 0
    for n in lengths:
        frames.append(view[pos:pos + n])
        pos += n
    return frames


class UnixHub:
    """The I/O thread's side of the Unix sockets: the listener, the connections
    it accepted, and a watch on each sender's connection. Everything here runs
    on the I/O thread; ``handlers`` maps each socket to poll to what to call
    with its poll events.
    """

    def __init__(self, path: str, token: bytes, max_size: int, *,
                 deliver: Callable[[list], None], note_drop: Callable[[str, str], None],
                 call_later: Callable, links: dict, link_up: Callable[[int], None], name: str,
                 serve_channel: Callable[[UnixReceiver, list], bool] | None = None,
                 directory: str | None = None) -> None:
        self.listener = listen(path)
        # The listener, and ``directory`` (the private one that holds ``path``,
        # now the hub's), go at close(), or when the hub is let go without it
        # (an Agent made and never started), as the zmq hub's sockets do; not
        # at interpreter exit, where a hub still running keeps them.
        self._finalizer = weakref.finalize(self, _drop, self.listener, directory)
        self._finalizer.atexit = False
        self._token, self._max = token, max_size
        self._deliver, self._note_drop, self._call_later = deliver, note_drop, call_later
        self._links, self._link_up, self._name = links, link_up, name
        self._serve_channel = serve_channel  # (receiver, first messages) -> taken?
        # (keyed by file descriptor: that is what zmq's poller reports for them)
        self.handlers: dict[int, Callable] = {self.listener.fileno(): self._on_accept}
        self._receivers: dict[int, UnixReceiver] = {}
        self._senders: dict[int, tuple[int, object]] = {}  # fd -> (peer, dealer)
        self._poller = None
        self.refused = 0

    def start(self, poller) -> None:
        self._poller = poller
        poller.register(self.listener.fileno(), 1)

    # -- incoming ------------------------------------------------------------
    def _on_accept(self, _sock, _events: int) -> None:
        for _ in range(64):
            try:
                conn = accept(self.listener)
            except Refused as e:
                self._refuse(str(e))
                continue
            except OSError as e:  # out of file descriptors: try again on the next wake
                log.warning("%s: cannot accept a connection: %s", self._name, e)
                return
            if conn is None:
                return
            waiting = sum(not r.authenticated for r in self._receivers.values())
            if waiting >= MAX_UNAUTHENTICATED:
                conn.close()
                self._refuse(f"{waiting} connections already wait to authenticate")
                continue
            fd = conn.fileno()
            receiver = self._receivers[fd] = UnixReceiver(conn, self._token, self._max)
            self.handlers[fd] = self._on_readable
            self._poller.register(fd, 1)
            self._call_later(HELLO_TIMEOUT, self._hello_deadline, receiver)

    def _hello_deadline(self, receiver: UnixReceiver) -> None:
        if not receiver.authenticated and self._receivers.get(receiver.fd) is receiver:
            self._drop_receiver(receiver)
            self._refuse(f"a connection that did not authenticate within {HELLO_TIMEOUT:g} s")

    def _refuse(self, why: str) -> None:
        self.refused += 1
        self._note_drop("refused connection", why)

    def _on_readable(self, fd: int, _events: int) -> None:
        receiver = self._receivers.get(fd)
        if receiver is None:
            return
        try:
            messages, closed = receiver.read()
        except Refused as e:
            self._drop_receiver(receiver)
            if receiver.authenticated:  # a key holder's stream out of step
                self._note_drop("framing", str(e))
            else:
                self._refuse(str(e))
            return
        if receiver.channel and not closed:  # a caller's own channel: its own thread
            self._unwatch_receiver(receiver)
            if self._serve_channel is None or not self._serve_channel(receiver, messages):
                receiver.close()  # (no acknowledgement: the caller goes the usual way)
            return
        for why in receiver.skipped:
            self._note_drop("too large", why)
        receiver.skipped.clear()
        for frames in messages:
            self._deliver(frames)
        if receiver.due is not None and messages:  # an adopted channel
            receiver.due -= len(messages)
            closed = closed or receiver.due <= 0
        if closed:
            self._drop_receiver(receiver)

    def _drop_receiver(self, receiver: UnixReceiver) -> None:
        self._unwatch_receiver(receiver)
        receiver.close()

    def _unwatch_receiver(self, receiver: UnixReceiver) -> None:
        if self._receivers.pop(receiver.fd, None) is not None:
            self.handlers.pop(receiver.fd, None)
            if self._poller is not None:
                self._poller.unregister(receiver.fd)

    def adopt(self, receiver: UnixReceiver) -> None:
        """Read ``receiver`` like an accepted connection until the answers
        still due on it (``receiver.due``) have come, then close it (a
        caller's channel whose thread stopped waiting: its timeout, Ctrl-C)."""
        if self._poller is None:
            receiver.close()
            return
        self._receivers[receiver.fd] = receiver
        self.handlers[receiver.fd] = self._on_readable
        self._poller.register(receiver.fd, 1)

    # -- outgoing ------------------------------------------------------------
    def watch(self, peer: int, dealer, retry: float = 0.05) -> None:
        """Watch ``dealer``'s sender (connected: for hang-up and writability;
        not: reconnect with back-off, until the dealer is dropped)."""
        sender: UnixSender = dealer.sock
        if sender.closed or self._poller is None:
            return
        if sender.sock is None:
            if not self._locked(dealer, sender.connect):
                self._links.setdefault(peer, time.monotonic())
                self._call_later(retry, self.watch, peer, dealer, min(1.0, retry * 2))
                return
        fd = sender.sock.fileno()
        if fd not in self._senders:
            self._senders[fd] = (peer, dealer)
            self.handlers[fd] = self._on_sender_event
            was = self._links.get(peer)
            self._links[peer] = None
            if was is not None:
                self._link_up(peer)
        self._poller.register(fd, 1 | (2 if sender.pending else 0))

    def want_write(self, sender: UnixSender) -> None:
        """``sender`` has bytes waiting for its socket: poll it for writability."""
        fd = sender.fileno()
        if fd in self._senders and self._senders[fd][1].sock is sender and not sender.closed:
            self._poller.register(fd, 3)

    def _locked(self, dealer, fn: Callable[[], Any]) -> Any:
        """``fn()`` under ``dealer``'s lock. Senders combine on that lock: one
        that finds it taken leaves its frames for the holder, so this sends
        what was left meanwhile once it lets go."""
        with dealer.lock:
            result = fn()
        dealer.flush()
        return result

    def _on_sender_event(self, fd: int, events: int) -> None:
        peer, dealer = self._senders[fd]
        sender: UnixSender = dealer.sock
        if events & ~2 and _hung_up(sender.sock):
            self._unwatch_fd(fd)
            self._locked(dealer, sender.drop_sock)
            if not sender.closed:
                log.info("%s: the connection to peer %d closed", self._name, peer)
                self._links[peer] = time.monotonic()
                self._call_later(0.05, self.watch, peer, dealer)
            return
        if events & 2 and self._locked(dealer, sender.flush) and not sender.pending:
            self._poller.register(fd, 1)  # all written: only hang-ups matter again

    def _unwatch_fd(self, fd: int) -> None:
        if self._senders.pop(fd, None) is not None:
            self.handlers.pop(fd, None)
            self._poller.unregister(fd)

    def forget(self, dealer) -> None:
        """``dealer`` was dropped (it is closed after this)."""
        fd = dealer.sock.fileno()
        if fd in self._senders and self._senders[fd][1] is dealer:
            self._unwatch_fd(fd)

    def close(self) -> None:
        for receiver in list(self._receivers.values()):
            receiver.close()
        self._receivers.clear()
        self._finalizer()  # the listener, the directory
