"""A peer's outgoing connection in an :class:`~.io.IOLoop`: its socket, the
messages waiting for it, and the lock that writers combine on.

Any thread may send. A sender appends its message to the queue and writes
what is queued if it gets the lock at once; a sender that finds the lock
taken leaves (it never sleeps): the holder looks at the queue again after
letting go. A message nobody waits for yet (``IOLoop.send(defer=True)``)
only queues; the I/O thread writes what has queued by then, several
messages in one system call on a Unix socket, and a thread that is about to
wait for its answer may write it first itself, or take it back to send it
another way (:meth:`Dealer.take_last`: ``to_here`` right after ``remote``).

A connection the loop drops (a redial, the peer moving to its Unix socket)
is closed and marked ``dropped`` under its lock. A sender that took the
dealer just before may still append to it: whatever a flush finds on a
dropped dealer goes to ``reroute`` (the peer's current connection), never
onto the closed socket, so no message is lost between the drop and the close.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import zmq

from .frames import CHUNK, split


class Link(Protocol):
    """What the loop needs of a peer's outgoing connection; a zmq DEALER
    (``tcp://``) and :class:`~.unix.UnixSender` (``unix://``) both have it.
    ``send_multipart`` never blocks; ``close`` lets queued frames drain for
    at most ``linger`` ms."""

    closed: bool

    def send_multipart(self, frames: list, copy: bool = False) -> Any: ...

    def close(self, linger: int | None = None) -> None: ...


class Dealer:
    """A peer's outgoing socket, its lock and the messages waiting for the lock."""

    __slots__ = ("peer", "note_drop", "reroute", "sock", "monitor", "lock", "queue",
                 "flush_due", "dropped", "sent_msgs", "sent_bytes")

    def __init__(self, peer: int, note_drop: Callable[[str, str], None],
                 reroute: Callable[[int, list], None], sock: Link,
                 monitor: zmq.Socket | None = None) -> None:
        self.peer = peer
        self.note_drop = note_drop  # counts a message the socket cannot take
        self.reroute = reroute  # sends queue entries again, on the peer's current connection
        self.sock = sock
        self.monitor = monitor  # a zmq socket's monitor; None for a Unix socket
        self.lock = threading.Lock()
        self.queue: deque = deque()  # (frames, nbytes, message id)
        self.flush_due = False  # the I/O thread will flush (deferred messages wait)
        self.dropped = False  # closed by the loop, which no longer lists it (see drop)
        self.sent_msgs = self.sent_bytes = 0  # under lock

    def flush(self) -> None:
        """Send what is queued. Combining: whoever holds the lock sends
        everything queued; a thread that finds it taken leaves and never
        sleeps. A message the socket cannot take is counted by ``note_drop``."""
        queue, lock = self.queue, self.lock
        batches = self.monitor is None  # a Unix socket: several messages per write
        while queue:
            if not lock.acquire(blocking=False):
                return  # the holder re-checks the queue after releasing
            stranded: list = []  # appended to a dropped dealer: sent again elsewhere
            try:
                sock = self.sock
                while queue:
                    entry = queue.popleft()
                    out, size, _ = entry
                    if sock.closed:
                        if self.dropped:
                            stranded.append(entry)
                        continue
                    try:
                        if batches:
                            sock.send_multipart(out, copy=False, more=True)
                        else:  # (no frame over CHUNK on tcp://: see frames.split)
                            sock.send_multipart(split(out) if size > CHUNK else out,
                                                copy=False)
                    except BufferError as e:  # a Unix socket whose peer reads nothing
                        self.note_drop("send queue full", str(e))
                        continue
                    self.sent_msgs += 1
                    self.sent_bytes += size
                if batches and not sock.closed:
                    sock.push()
            finally:
                lock.release()
            if stranded:
                self.reroute(self.peer, stranded)

    def drop(self, linger: int) -> list:
        """Close the socket (its own queue drains within ``linger`` ms) and mark the
        dealer dropped; returns what waited in its queue, for the caller to send
        again. The loop no longer lists it: a flush hands later messages to
        ``reroute``."""
        with self.lock:
            stranded = list(self.queue)
            self.queue.clear()
            self.close(linger)
            self.dropped = True
        return stranded

    def close(self, linger: int) -> None:
        """Close the socket (the caller holds ``lock``), its monitoring stopped
        first. A closed zmq socket lives on while it lingers, and may still
        connect or lose its connection; libzmq sends each such event to the
        monitor with a blocking send from its I/O thread, so one event for a
        monitor whose reader has been closed stops that thread for good: no
        socket of the context sends or receives again (the agent goes deaf)."""
        if self.monitor is not None and not self.sock.closed:
            self.sock.disable_monitor()
        self.sock.close(linger=linger)

    def take_last(self, msg_id: int) -> list | None:
        """The frames of message ``msg_id``, taken out of the queue if it is
        the last one there (nothing queued after it) and unsent; else None."""
        with self.lock:  # (a flush in progress may be writing it: wait for it)
            queue = self.queue
            if queue and queue[-1][2] == msg_id:
                return queue.pop()[0]
        return None
