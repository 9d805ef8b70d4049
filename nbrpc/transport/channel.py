"""Direct channels: a calling thread's own connection to a peer on this host.

On a 2-core machine an ``rpc_sync`` spends most of its time waking threads,
not running Python: each wake-up of a thread on the other CPU costs tens of
µs (``benchmarks/bench_breakdown.py``). Through the agent's I/O threads and
pool, a call wakes four threads (the callee's I/O thread, then a pool thread;
the caller's I/O thread, then the waiting caller). A channel wakes two, the
least a round trip between two processes can:

.. code-block:: text

    caller thread T                         callee
    ---------------                         ------
    Channel.write(request)  ──────────────► channel thread (its own, reading
    Channel.read() …                          only this connection): runs the
                            ◄────────────── request, writes the answer back on
    T unpacks the answer itself               the same connection

This is Pyro5's shape (a thread per connection on the server, the caller
reading its own answer), kept inside nbrpc's guarantees:

* **Same authentication as every Unix connection** (:mod:`.unix`): the
  connection opens with ``CHANNEL_MAGIC`` and the group's token, compared
  before anything else is read; the same-user check and 0700 directory hold;
  every message is signed and checked (:func:`~.frames.unpack`, the replay
  guard) before anything is unpickled; declared sizes are checked before
  allocation. The callee acknowledges a channel with one byte once a thread
  serves it, so a request is never written to a channel nobody will read.
* **Bounded.** A callee serves at most ``MAX_CHANNELS`` channels, and no more
  than its agent's ``num_worker_threads`` (refused beyond: the caller uses the
  agent's ordinary path, and the pool's bound holds there); writes give up after
  ``WRITE_TIMEOUT`` (the connection is then closed); reads wait in slices, so
  a waiting notebook can be interrupted.
* **Nothing lost when the caller stops reading.** A caller interrupted while
  waiting hands its channel to its agent's I/O thread, which reads the answer
  as it reads any connection (:meth:`~.io.IOLoop.adopt_channel`).

Which calls take a channel is the agent's choice (``rpc_sync`` of a function:
:mod:`nbrpc.agent.caller`); everything else keeps the ordinary path.
"""

from __future__ import annotations

import logging
import select
import socket
import struct
import threading
import time
import weakref
from collections.abc import Callable

from .unix import CHANNEL_MAGIC, Refused, UnixReceiver, path_of, stream_socket

log = logging.getLogger(__name__)

ACCEPTED = b"\x01"  # the callee's one-byte answer: a thread serves this channel
MAX_CHANNELS = 64  # channels served at once by one callee
WRITE_TIMEOUT = 30.0  # seconds a write may wait for a reader that does not read
ACK_TIMEOUT = 5.0  # seconds a new channel waits for the callee's acknowledgement
RETRY_AFTER = 5.0  # seconds before a refused channel is tried again
_POLLIN, _POLLOUT = select.POLLIN, select.POLLOUT
_POLLERR = select.POLLERR | select.POLLHUP | select.POLLNVAL
_IOV_MAX = 1000


class ChannelClosed(Exception):
    """The connection is gone (the peer closed it, or a write timed out).
    ``written``: bytes of the failed write that went before it failed."""

    def __init__(self, why: str, written: int = 0) -> None:
        super().__init__(why)
        self.written = written
        self.first_written = False


def _framed(frames: list) -> list[memoryview]:
    """One message in ``unix`` framing: count, lengths, frames."""
    views = [memoryview(f).cast("B") for f in frames]
    n = len(views)
    return [memoryview(struct.pack(f"<I{n}Q", n, *[v.nbytes for v in views])), *views]


def write_all(sock: socket.socket, frames: list, timeout: float = WRITE_TIMEOUT,
              first: list | None = None) -> int:
    """Write one message (``unix`` framing), after ``first`` if given (both
    in one system call where they fit), on a non-blocking socket, waiting for
    room at most ``timeout`` s in all; returns the bytes written. Raises
    :class:`ChannelClosed` on failure (the stream is then out of step: the
    caller must close it); its ``first_written`` says whether ``first`` went
    whole (and will be read)."""
    views = _framed(frames)
    before = 0
    if first is not None:
        ahead = _framed(first)
        before = sum(v.nbytes for v in ahead)
        views = ahead + views
    total = sum(v.nbytes for v in views)
    try:
        _write_views(sock, views, timeout)
    except ChannelClosed as e:
        e.first_written = first is not None and e.written >= before
        raise
    return total


def _write_views(sock: socket.socket, views: list, timeout: float) -> None:
    written = 0
    deadline = None
    poller = None
    while views:
        try:
            sent = sock.sendmsg(views[:_IOV_MAX])
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as e:
            raise ChannelClosed(f"write failed: {e}", written) from e
        written += sent
        while views and sent >= views[0].nbytes:  # (empty frames too: shared memory)
            sent -= views.pop(0).nbytes
        if sent:
            views[0] = views[0][sent:]
        if not views:
            break
        if poller is None:  # the kernel's buffer is full: wait for room, bounded
            deadline = time.monotonic() + timeout
            poller = select.poll()
            poller.register(sock, _POLLOUT)
        left = deadline - time.monotonic()
        if left <= 0:
            raise ChannelClosed(f"the reader took nothing for {timeout:g} s", written)
        events = poller.poll(min(left, 1.0) * 1000)
        if events and events[0][1] & _POLLERR:
            raise ChannelClosed("the reader closed the connection", written)


class _End:
    """One end of a channel: its socket, written under a lock by any thread."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.lock, self.closed = sock, threading.Lock(), False
        self.sent_msgs = self.sent_bytes = 0

    def write(self, frames: list, first: list | None = None) -> int:
        """Write one message, after ``first`` if given (see :func:`write_all`);
        raises :class:`ChannelClosed` (and closes) on failure."""
        with self.lock:
            if self.closed:
                raise ChannelClosed("the channel is closed")
            try:
                n = write_all(self.sock, frames, first=first)
            except ChannelClosed:
                self.close()
                raise
            self.sent_msgs += 1 if first is None else 2
            self.sent_bytes += n
            return n

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes a thread polling it
            except OSError:
                pass


class Channel(_End):
    """The calling thread's end: write a request, read the answers (the
    thread that made it, its ``owner``, alone reads it)."""

    def __init__(self, peer: int, endpoint: str, token: bytes, max_size: int,
                 ack_timeout: float = ACK_TIMEOUT) -> None:
        self.peer, self.endpoint = peer, endpoint
        self.owner = threading.get_ident()
        sock = stream_socket()
        try:
            sock.settimeout(ack_timeout)
            sock.connect(path_of(endpoint))
            sock.sendall(CHANNEL_MAGIC + token)
            if sock.recv(1) != ACCEPTED:  # refused (closed), or a stray byte
                raise ChannelClosed(f"peer {peer} serves no more channels")
        except (OSError, ChannelClosed) as e:
            sock.close()
            raise ChannelClosed(f"no channel to peer {peer}: {e}") from e
        sock.setblocking(False)
        super().__init__(sock)
        # a thread that ends drops its channels: the connection closes with them
        self._finalizer = weakref.finalize(self, sock.close)
        self.receiver = UnixReceiver(sock, token, max_size, authenticated=True)
        self._poller = select.poll()
        self._poller.register(sock, _POLLIN)
        self.due = 0  # answers still to come (requests written minus answers read)

    def write(self, frames: list, first: list | None = None) -> int:
        """Write one request, after ``first`` (their answers are then due here)."""
        try:
            n = super().write(frames, first)
        except ChannelClosed as e:
            self.due += e.first_written
            raise
        self.due += 1 if first is None else 2
        return n

    def read(self, timeout: float) -> tuple[list[list], bool]:
        """Wait up to ``timeout`` s for data; (the messages complete now,
        whether the connection closed). Raises :class:`~.unix.Refused` for a
        stream out of step."""
        if self.closed:
            return [], True
        if not self._poller.poll(timeout * 1000):
            return [], False
        messages, closed = self.receiver.read()
        self.due -= len(messages)
        return messages, closed

    def detach(self) -> UnixReceiver:
        """Hand the connection over (to the loop, which reads it from now on,
        until the answers still due have come)."""
        self._finalizer.detach()
        self.closed = True
        self.receiver.due = self.due
        return self.receiver

    def close(self) -> None:
        super().close()
        self._finalizer()  # (once; nothing after detach())


class ServedChannel(_End):
    """The callee's end of one channel: written by whichever thread answers."""


def serve(receiver: UnixReceiver, served: ServedChannel, first: list[list],
          deliver: Callable[[list, object], None], note_drop: Callable[[str, str], None],
          stopping: Callable[[], bool]) -> None:
    """The callee's channel thread: deliver each message read from
    ``receiver`` with ``served`` (the answer goes back on it), until the
    caller closes the connection or the loop stops."""
    poller = select.poll()
    poller.register(receiver.sock, _POLLIN)
    messages, closed = first, False
    try:
        served.sock.sendall(ACCEPTED)  # (1 byte on a fresh socket: never waits)
        while not stopping():
            for frames in messages:
                deliver(frames, served)
            if closed or served.closed:
                break
            messages = []
            if poller.poll(1000):
                try:
                    messages, closed = receiver.read()
                except Refused as e:  # out of step: close it
                    note_drop("framing", f"a channel: {e}")
                    break
                for why in receiver.skipped:
                    note_drop("too large", why)
                receiver.skipped.clear()
    except OSError as e:
        log.debug("a channel closed: %s", e)
    except Exception:  # a bug here must not pass silently
        log.exception("nbrpc channel thread failed")
    finally:
        with served.lock:
            served.closed = True
            receiver.close()


class Channels:
    """One loop's channels: its calling threads' own (one per thread and
    peer, made on first use) and the ones it serves (a thread each, at most
    ``MAX_CHANNELS``)."""

    def __init__(self, token: bytes, max_size: int, *, deliver: Callable[[list, object], None],
                 note_drop: Callable[[str, str], None], adopt: Callable[[UnixReceiver], None],
                 name: str) -> None:
        self._token, self._max = token, max_size
        self._deliver, self._note_drop, self._adopt, self._name = deliver, note_drop, adopt, name
        self._tls = threading.local()
        self._mine: weakref.WeakSet[Channel] = weakref.WeakSet()
        self._served: set[ServedChannel] = set()
        self._no_channel: dict[int, float] = {}  # peer -> until when not to try again
        self._lock = threading.Lock()
        self.stopping = False
        self.on_thread_start: Callable[[], None] | None = None  # run by each serving thread
        self.limit = MAX_CHANNELS  # channels served at once (the agent: its pool's size)

    def get(self, peer: int, endpoint: str) -> Channel | None:
        """The calling thread's channel to ``peer`` at ``endpoint``, made now
        if need be; None where there is none (refused lately, or stopping)."""
        mine = getattr(self._tls, "by_peer", None)
        if mine is None:
            mine = self._tls.by_peer = {}
        chan = mine.get(peer)
        if chan is not None and not chan.closed and chan.endpoint == endpoint:
            return chan
        if self.stopping or time.monotonic() < self._no_channel.get(peer, 0.0):
            return None
        try:
            chan = Channel(peer, endpoint, self._token, self._max)
        except ChannelClosed as e:
            log.debug("%s: %s; calls to it take the usual path for a while", self._name, e)
            self._no_channel[peer] = time.monotonic() + RETRY_AFTER
            mine.pop(peer, None)
            return None
        mine[peer] = chan
        self._mine.add(chan)
        if self.stopping:  # (closed meanwhile: close() may not have seen it)
            chan.close()
            return None
        return chan

    def forget(self, chan: Channel, adopt: bool = False) -> None:
        """The calling thread stops using ``chan``: closed (broken), or, with
        ``adopt``, read from now on by the loop (answers may still come)."""
        mine = getattr(self._tls, "by_peer", {})
        if mine.get(chan.peer) is chan:
            del mine[chan.peer]
        if adopt and not chan.closed and chan.due > 0:
            self._adopt(chan.detach())
        else:
            chan.close()

    def serve(self, receiver: UnixReceiver, first: list[list]) -> bool:
        """Serve an accepted channel on a thread of its own; False when at
        the limit (the connection is then closed unacknowledged)."""
        with self._lock:
            if self.stopping or len(self._served) >= min(self.limit, MAX_CHANNELS):
                log.info("%s: refusing a channel: %d are served", self._name, len(self._served))
                return False
            served = ServedChannel(receiver.sock)
            self._served.add(served)

        def run() -> None:
            try:
                if self.on_thread_start is not None:
                    self.on_thread_start()
                serve(receiver, served, first, self._deliver, self._note_drop,
                      lambda: self.stopping)
            finally:
                with self._lock:
                    self._served.discard(served)

        threading.Thread(target=run, name=f"{self._name}-channel", daemon=True).start()
        return True

    @property
    def served(self) -> int:
        """Channels served now (a thread each)."""
        return len(self._served)

    @property
    def sent(self) -> tuple[int, int]:
        """(messages, bytes) written on channels, both ends."""
        ends = [*list(self._mine), *list(self._served)]
        return sum(c.sent_msgs for c in ends), sum(c.sent_bytes for c in ends)

    def close(self) -> None:
        """Close every channel; serving threads leave within their poll slice."""
        self.stopping = True
        for chan in list(self._mine):
            chan.close()
        with self._lock:
            served = list(self._served)
        for s in served:
            s.close()
