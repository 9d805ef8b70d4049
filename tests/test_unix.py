"""The plain Unix-socket transport between agents on one host (nbrpc.transport.unix).

Unit tests drive a UnixSender and a UnixReceiver over a real socket pair with
no I/O thread; the IOLoop tests below check what the loop adds: the handshake,
bounds, link state and reconnection.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Iterator

import pytest
from conftest import poll_for

from nbrpc.transport import IOLoop, local, new_key, pack
from nbrpc.transport.auth import connect_token
from nbrpc.transport.dealer import Dealer
from nbrpc.transport.frames import unpack
from nbrpc.transport.unix import (
    MAGIC,
    SEND_BUFFER,
    Refused,
    UnixReceiver,
    UnixSender,
    listen,
    path_of,
    stream_socket,
)

TOKEN = b"t" * 64


def _wire(frames: list[bytes]) -> bytes:
    return (struct.pack("<I", len(frames)) + b"".join(struct.pack("<Q", len(f)) for f in frames)
            + b"".join(frames))


@pytest.fixture
def link(tmp_path):
    """A connected sender and the receiver of its accepted connection."""
    path = str(tmp_path / "s")
    listener = listen(path)
    wants: list = []
    sender = UnixSender(f"unix://{path}", TOKEN, lambda sender: wants.append(sender))
    conn, _ = listener.accept()
    conn.setblocking(False)
    receiver = UnixReceiver(conn, TOKEN, max_size=1 << 25)
    yield sender, receiver, wants
    sender.close()
    receiver.close()
    listener.close()


def _read_all(receiver: UnixReceiver, want: int, sender: UnixSender | None = None) -> list:
    got: list = []
    deadline = time.monotonic() + 5
    while len(got) < want and time.monotonic() < deadline:
        if sender is not None:
            sender.flush()
        messages, closed = receiver.read()
        got += messages
        assert not closed
    return got


def test_messages_arrive_whole_and_in_order(link) -> None:
    sender, receiver, _ = link
    for i in range(100):
        sender.send_multipart([b"head%d" % i, b"", bytes([i]) * i])
    got = _read_all(receiver, 100)
    assert receiver.authenticated
    assert [[bytes(f) for f in m] for m in got] == [
        [b"head%d" % i, b"", bytes([i]) * i] for i in range(100)]
    got[5][2][0] = 7  # frames are private and writable (torch builds tensors on them)


def test_a_message_larger_than_the_socket_buffer_waits_for_the_io_thread(link) -> None:
    sender, receiver, wants = link
    room = sender.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    big = os.urandom(3 * room)  # several times what the kernel's socket buffer holds
    sender.send_multipart([b"h", big])
    sender.send_multipart([b"after"])
    assert sender.pending and wants  # the caller did not block; the rest waits
    got = _read_all(receiver, 2, sender)
    assert bytes(got[0][1]) == big and bytes(got[1][0]) == b"after"
    assert not sender.pending


def test_messages_queued_together_go_in_one_write(link, monkeypatch) -> None:
    """``more=True`` only queues; the last message writes them all in one sendmsg."""
    sender, receiver, _ = link
    calls: list[int] = []
    real = sender.sock

    class Counting:  # socket methods cannot be patched on the object itself
        def __getattr__(self, name):
            return getattr(real, name)

        def sendmsg(self, buffers):
            calls.append(len(buffers))
            return real.sendmsg(buffers)

    monkeypatch.setattr(sender, "sock", Counting())
    for i in range(9):
        sender.send_multipart([b"m%d" % i, bytes([i]) * i], more=True)
    assert not calls and sender.pending  # nothing written yet
    sender.send_multipart([b"m9", b""])
    assert len(calls) == 1 and not sender.pending
    got = _read_all(receiver, 10)
    assert [bytes(m[0]) for m in got] == [b"m%d" % i for i in range(10)]
    assert [bytes(m[1]) for m in got[:9]] == [bytes([i]) * i for i in range(9)]


def test_a_batch_larger_than_the_socket_buffer_is_cut_between_writes_and_arrives_whole(
        link) -> None:
    """A write that the kernel cuts short ends anywhere in the batch; the rest
    waits for the I/O thread and the stream stays in step."""
    sender, receiver, wants = link
    room = sender.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    parts = [os.urandom(room // 3 + i) for i in range(8)]  # ~2.7 buffers in all
    for i, p in enumerate(parts):
        sender.send_multipart([b"h%d" % i, p], more=i < len(parts) - 1)
    assert wants and sender.pending  # cut short: the I/O thread goes on
    sender.send_multipart([b"more"])  # queued behind (no write while blocked)
    got = _read_all(receiver, len(parts) + 1, sender)
    assert [bytes(m[1]) for m in got[:-1]] == parts and bytes(got[-1][0]) == b"more"
    assert not sender.pending


def test_a_message_above_the_maximum_is_skipped_and_the_stream_stays_in_step(link) -> None:
    sender, receiver, _ = link
    sender.send_multipart([b"a"])
    sender.send_multipart([b"x" * ((1 << 25) + 1)])
    sender.send_multipart([b"b"])
    got = _read_all(receiver, 2, sender)
    assert [bytes(m[0]) for m in got] == [b"a", b"b"]
    assert len(receiver.skipped) == 1 and "accepted" in receiver.skipped[0]


def test_without_the_token_nothing_is_read(tmp_path) -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    b.setblocking(False)
    receiver = UnixReceiver(b, TOKEN, 1 << 20)
    a.sendall(MAGIC + b"w" * 64 + _wire([b"payload"]))
    with pytest.raises(Refused):
        receiver.read()
    a.close()
    receiver.close()


def test_a_stream_out_of_step_is_refused() -> None:
    a, b = socket.socketpair(socket.AF_UNIX)
    b.setblocking(False)
    receiver = UnixReceiver(b, TOKEN, 1 << 20)
    a.sendall(MAGIC + TOKEN + struct.pack("<I", 0))  # a message of no frames
    with pytest.raises(Refused, match="0 frames"):
        receiver.read()
    a.close()
    receiver.close()


def test_a_sender_queues_while_its_peer_is_unreachable_then_delivers(tmp_path) -> None:
    path = str(tmp_path / "s")
    sender = UnixSender(f"unix://{path}", TOKEN, lambda sender: None)
    assert not sender.connected
    sender.send_multipart([b"early"])
    listener = listen(path)
    assert sender.connect()
    conn, _ = listener.accept()
    conn.setblocking(False)
    receiver = UnixReceiver(conn, TOKEN, 1 << 20)
    assert [bytes(m[0]) for m in _read_all(receiver, 1)] == [b"early"]
    for s in (sender, receiver, listener):
        s.close()


# -- through the I/O loop --------------------------------------------------------------
@contextlib.contextmanager
def _pair(unix: bool = True, **kw) -> Iterator[tuple[IOLoop, IOLoop, list]]:
    """Two started loops; ``a`` knows where ``b`` listens (``unix=False``: only
    its TCP address, as before the member table). Both stop at the end."""
    key = new_key()
    got: list = []
    a = IOLoop(key, 0, lambda env: None, name="nbrpc-io-test-a", **kw)
    b = IOLoop(key, 1, got.append, name="nbrpc-io-test-b", **kw)
    try:
        for loop in (a, b):
            loop.bind()
            loop.start()
        a.set_address(1, b.address, b.local_address if unix else None)
        yield a, b, got
    finally:
        a.stop()
        b.stop()


def test_loop_delivers_tensors_sized_buffers_and_counts_too_large() -> None:
    with _pair(max_message_size=1 << 20) as (a, b, got):
        big = os.urandom(600_000)
        a.send(1, 0, 1, b"p", [big])
        a.send(1, 0, 2, b"p", [bytes(2 << 20)])  # above b's maximum: skipped unread
        a.send(1, 0, 3, b"after")
        assert poll_for(lambda: len(got) == 2, timeout=5), got
        assert bytes(got[0].buffers[0]) == big and got[1].msg_id == 3
        assert b.dropped["too large"] == 1
        assert isinstance(a._dealers[1].sock, UnixSender)


def test_deferred_messages_wait_for_the_io_thread_and_go_in_order(monkeypatch) -> None:
    """``send(defer=True)`` queues and has the I/O thread write what queued by
    then; ``flush_to`` writes at once; ``take_queued`` takes back only the
    last message, and only while it is unsent."""
    with _pair() as (a, b, got):
        a.send(1, 0, 1, b"opens the connection")
        assert poll_for(lambda: got, timeout=5)
        dealer = a._dealers[1]
        due: list = []
        monkeypatch.setattr(a, "_flush_due", due.append)  # the I/O thread's flush, held
        # ...and any other flush of this connection the I/O thread might make
        # meanwhile (a late writability event of the first send, on a busy machine)
        held, flush = [True], Dealer.flush
        monkeypatch.setattr(Dealer, "flush",
                            lambda d: None if (held[0] and d is dealer) else flush(d))
        for i in range(2, 7):
            a.send(1, 0, i, b"deferred", defer=True)
        assert [e[2] for e in dealer.queue] == [2, 3, 4, 5, 6] and len(got) == 1
        assert poll_for(lambda: due == [dealer], timeout=5)  # one flush for all five
        assert a.take_queued(1, 5) is None  # not the last one
        frames = a.take_queued(1, 6)
        assert frames is not None and unpack(a._key, frames).msg_id == 6
        held[0] = False
        a.flush_to(1)  # on this thread
        assert not dealer.queue
        assert poll_for(lambda: len(got) == 5, timeout=5)
        assert [e.msg_id for e in got] == [1, 2, 3, 4, 5]
        assert a.take_queued(1, 5) is None  # sent already
        a.send_frames(1, frames)  # a message taken back can still go the usual way
        monkeypatch.undo()
        dealer.flush_due = False
        a.send(1, 0, 7, b"deferred", defer=True)  # the I/O thread writes it
        assert poll_for(lambda: len(got) == 7, timeout=5)
        assert [e.msg_id for e in got[5:]] == [6, 7]


def test_deferred_messages_left_in_a_dropped_connection_go_on_the_new_one(
        monkeypatch) -> None:
    """A peer first reached over TCP moves to its Unix socket once that is known
    (a redial): what was deferred on the old connection and not yet written
    goes on the new one, not down with the old."""
    with _pair(unix=False) as (a, b, got):  # over TCP: b's Unix socket not known yet
        a.send(1, 0, 1, b"over tcp")
        assert poll_for(lambda: got, timeout=5)
        old = a._dealers[1]
        due: list = []
        monkeypatch.setattr(a, "_flush_due", due.append)  # the I/O thread's flush, held
        a.send(1, 0, 2, b"deferred", defer=True)
        assert [e[2] for e in old.queue] == [2]
        a.set_address(1, b.address, b.local_address)  # the redial drops the old one
        assert poll_for(lambda: a._dealers.get(1) is not old, timeout=5)
        monkeypatch.undo()
        for dealer in due:  # the flushes the I/O thread was asked for, run now
            a.call_soon(a._flush_due, dealer)
        assert poll_for(lambda: len(got) == 2, timeout=5), got
        assert got[1].msg_id == 2 and isinstance(a._dealers[1].sock, UnixSender)


def test_a_message_a_sender_appends_to_a_connection_just_dropped_goes_on_the_new_one(
        ) -> None:
    """A sender takes the peer's connection; the loop drops it (a redial) before the
    sender appends its message and flushes: the flush finds the socket closed, and
    the message goes on the peer's new connection rather than down with the old."""
    with _pair(unix=False) as (a, b, got):  # over TCP: b's Unix socket not known yet
        a.send(1, 0, 1, b"over tcp")
        assert poll_for(lambda: got, timeout=5)
        taken = a._dealers[1]  # the sender has it ...
        a.set_address(1, b.address, b.local_address)  # ... the redial drops it ...
        assert poll_for(lambda: taken.dropped and taken.sock.closed, timeout=5)
        frames = pack(a._key, 0, 0, 2, b"late", [], dest=1)
        taken.queue.append((frames, sum(len(f) for f in frames), 2))  # ... then it sends
        taken.flush()
        assert poll_for(lambda: len(got) == 2, timeout=5), got
        assert got[1].msg_id == 2 and isinstance(a._dealers[1].sock, UnixSender)
        assert not taken.queue


def test_loop_refuses_a_connection_that_never_authenticates(monkeypatch) -> None:
    from nbrpc.transport import unix
    monkeypatch.setattr(unix, "HELLO_TIMEOUT", 0.2)
    with _pair() as (a, b, got):
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(unix.path_of(local.local_endpoint(b.local_address)))
            assert poll_for(lambda: b.dropped["refused connection"] == 1, timeout=5)
            s.settimeout(2)
            assert s.recv(1) == b""  # closed by b
        a.send(1, 0, 1, b"still fine")
        assert poll_for(lambda: got, timeout=5)


def test_a_hello_that_came_while_the_loop_was_paused_counts_before_its_deadline(
        monkeypatch) -> None:
    """A process paused just after it accepted a connection (SIGSTOP, a
    debugger, a long call holding the GIL) runs its timers before it reads
    again: the hello that arrived meanwhile is read first, not refused (a
    refused member's link looked closed, and the coordinator declared it dead)."""
    from nbrpc.transport import unix
    monkeypatch.setattr(unix, "HELLO_TIMEOUT", 0.2)
    accept = unix.UnixHub._on_accept

    def paused(self, sock, events: int) -> None:
        accept(self, sock, events)
        time.sleep(1.0)  # the pause: the peer's hello arrives meanwhile

    monkeypatch.setattr(unix.UnixHub, "_on_accept", paused)
    with _pair() as (a, b, got):
        a.send(1, 0, 1, b"one")
        assert poll_for(lambda: got, timeout=5)
        assert b.dropped["refused connection"] == 0


def test_loop_marks_the_link_down_when_the_peer_goes_and_reconnects() -> None:
    with _pair() as (a, b, got):
        a.send(1, 0, 1, b"one")
        assert poll_for(lambda: got, timeout=5)
        assert poll_for(lambda: a.link_down_since(1) is None, timeout=5)
        path = path_of(local.local_endpoint(b.local_address))
        b.stop()  # its connections close: a sees the hang-up at once
        assert poll_for(lambda: a.link_down_since(1) is not None, timeout=5)
        a.send(1, 0, 2, b"two")  # waits in a's queue meanwhile
        os.makedirs(os.path.dirname(path), mode=0o700)
        listener = listen(path)  # someone listens there again: a reconnects
        try:
            listener.settimeout(5)
            conn, _ = listener.accept()
            conn.setblocking(False)
            receiver = UnixReceiver(conn, connect_token(a._key), 1 << 20)
            (frames,) = _read_all(receiver, 1)
            assert bytes(unpack(a._key, frames).payload) == b"two"
            assert poll_for(lambda: a.link_down_since(1) is None, timeout=5)
            receiver.close()
        finally:
            listener.close()
            local.remove_dir(os.path.dirname(path))


def test_connect_token_is_what_the_handshake_carries() -> None:
    key = new_key()
    a, b = socket.socketpair(socket.AF_UNIX)
    b.setblocking(False)
    receiver = UnixReceiver(b, connect_token(key), 1 << 20)
    a.sendall(MAGIC + connect_token(key) + _wire(pack(key, 1, 0, 7, b"x")))
    messages, _ = receiver.read()
    assert len(messages) == 1 and receiver.authenticated
    a.close()
    receiver.close()


def test_frames_left_while_the_io_thread_held_the_lock_are_sent() -> None:
    # A sender that finds its peer's lock taken leaves its frames for the holder;
    # when the holder is the I/O thread (writing what waited for the socket), it
    # must send them too (they were stranded: RPCs timed out under load).
    with _pair() as (a, b, got):
        a.send(1, 0, 1, b"first")
        assert poll_for(lambda: got, timeout=5)
        dealer = a._dealers[1]
        with dealer.lock:  # as the I/O thread holds it while flushing
            a.send(1, 0, 2, b"left behind")
            assert dealer.queue  # left for the holder (checked while held: nothing races)
        fd = dealer.sock.fileno()
        a.call_soon(a._unix._on_sender_event, fd, 2)  # the socket became writable
        assert poll_for(lambda: len(got) == 2, timeout=5)
        assert bytes(got[1].payload) == b"left behind" and not dealer.queue


def test_sockets_ask_for_a_send_buffer_that_holds_a_tensor_below_shared_memory() -> None:
    """A message up to the kernel's cap is written in one call (not in slices,
    each waiting for the reader's thread); what the kernel grants is capped
    by net.core.wmem_max, so only the request is pinned where it is smaller."""
    with open("/proc/sys/net/core/wmem_max") as f:
        cap = int(f.read())
    with open("/proc/sys/net/core/wmem_default") as f:
        default = int(f.read())
    if cap <= default:
        pytest.skip(f"net.core.wmem_max ({cap}) allows no buffer above the default")
    sock = stream_socket()
    try:
        granted = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)  # (doubled by Linux)
        assert granted >= min(SEND_BUFFER, cap)
    finally:
        sock.close()
