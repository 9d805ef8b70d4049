"""Unit tier: how many of a ROUTER's connections may be mid-handshake
(``zmqhub.PendingHandshakes``, pure state), and cutting one by its fd
(``zmqhub.cut_connection``, on real loopback sockets)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from nbrpc.transport.zmqhub import PENDING_MAX, PendingHandshakes, cut_connection


def test_connections_that_get_in_are_never_counted_against_the_limit() -> None:
    pending = PendingHandshakes(limit=4, window=6.0)
    for i in range(1000):  # a member's connections, each in at once
        assert pending.accepted(100 + i % 7, now=i * 0.001)
        pending.succeeded(now=i * 0.001)
        assert len(pending) == 0


def test_past_the_limit_each_new_connection_is_refused_until_one_ends() -> None:
    pending = PendingHandshakes(limit=PENDING_MAX, window=6.0)
    assert all(pending.accepted(fd, now=0.0) for fd in range(10, 10 + PENDING_MAX))
    assert not pending.accepted(500, now=0.1)
    assert not pending.accepted(501, now=0.2)  # refused ones are not counted either
    assert len(pending) == PENDING_MAX
    pending.closed(10)  # libzmq's handshake timeout, or the peer gave up
    assert pending.accepted(502, now=0.3)
    pending.succeeded(now=0.4)  # some connection got in
    assert pending.accepted(503, now=0.5)
    assert not pending.accepted(504, now=0.6)


def test_a_connection_older_than_the_handshake_timeout_is_pending_no_longer() -> None:
    pending = PendingHandshakes(limit=2, window=6.0)
    assert pending.accepted(10, now=0.0) and pending.accepted(11, now=1.0)
    assert not pending.accepted(12, now=5.9)
    assert pending.accepted(12, now=6.0)  # 10 is in, or closed, by now
    assert len(pending.expire(now=7.0)) == 1
    assert len(pending.expire(now=100.0)) == 0


def test_a_number_reused_after_a_missed_close_is_counted_once() -> None:
    pending = PendingHandshakes(limit=2, window=6.0)
    assert pending.accepted(10, now=0.0)
    assert pending.accepted(10, now=1.0)
    assert len(pending) == 1
    pending.closed(10)
    pending.closed(10)  # (a second close is harmless)
    assert len(pending) == 0
    pending.succeeded(now=2.0)  # (a success with nothing pending, too)
    assert len(pending) == 0


@pytest.fixture
def accepted() -> Iterator[tuple[socket.socket, socket.socket, int]]:
    """A client and the connection a listener accepted from it, on loopback."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        conn, _ = listener.accept()
    yield client, conn, port
    client.close()
    conn.close()


def test_cut_shuts_the_connection_down_and_leaves_the_fd_open(accepted) -> None:
    client, conn, port = accepted
    peer = cut_connection(conn.fileno(), port)
    assert peer == f"127.0.0.1:{client.getsockname()[1]}"
    assert client.recv(1) == b""  # the peer sees it go
    os.fstat(conn.fileno())  # the fd itself is still its owner's to close


def test_cut_touches_nothing_but_a_connection_accepted_on_that_port(accepted) -> None:
    client, conn, port = accepted
    assert cut_connection(client.fileno(), port) is None  # an outgoing connection
    assert cut_connection(conn.fileno(), port + 1) is None  # another port's
    r, w = os.pipe()
    try:
        assert cut_connection(r, port) is None  # not a socket
    finally:
        os.close(r)
        os.close(w)
    assert cut_connection(r, port) is None  # closed
    client.settimeout(0.2)
    conn.sendall(b"x")
    assert client.recv(1) == b"x"  # still up
