"""The I/O loop alone: timers, hand-off, and delivery to itself."""

from __future__ import annotations

import threading
import time

from conftest import poll_for

from nbrpc.transport import IOLoop, new_key


def _loop(received: list) -> IOLoop:
    loop = IOLoop(new_key(), 0, received.append, name="nbrpc-io-test")
    loop.bind()
    loop.start()
    assert poll_for(lambda: loop.thread_ident is not None)
    return loop


def test_short_timer_added_while_the_loop_sleeps_fires_on_time() -> None:
    loop = _loop([])
    try:
        assert poll_for(lambda: loop._sleeping)  # the loop is in its long (bounded) sleep
        for delay in (0.05, 0.01, 0.1):
            fired = threading.Event()
            t0 = time.monotonic()
            loop.call_later(delay, fired.set)
            assert fired.wait(2)
            assert delay <= time.monotonic() - t0 < delay + 0.2
    finally:
        loop.stop()


def test_cancelled_timer_never_fires() -> None:
    loop = _loop([])
    try:
        fired = []
        handle = loop.call_later(0.05, fired.append, 1)
        loop.cancel(handle)
        done = threading.Event()
        loop.call_later(0.15, done.set)
        assert done.wait(2) and fired == []
    finally:
        loop.stop()


def test_call_soon_runs_on_the_io_thread_and_self_delivery_copies() -> None:
    received: list = []
    loop = _loop(received)
    try:
        where = []
        loop.call_soon(lambda: where.append(threading.get_ident()))
        assert poll_for(lambda: where == [loop.thread_ident])
        buf = bytearray(b"abcd")
        loop.send(0, 1, 5, b"payload", [buf])
        assert poll_for(lambda: len(received) == 1)
        env = received[0]
        buf[0] = ord("X")  # the delivered copy is not the sender's memory
        assert (env.msg_id, bytes(env.payload), bytes(env.buffers[0])) == (5, b"payload", b"abcd")
    finally:
        loop.stop()


def test_cancelled_timers_do_not_accumulate() -> None:
    loop = _loop([])
    try:
        oldest = loop.call_later(30, print)  # a call still in flight: it stays on top
        for _ in range(5000):  # like 5000 answered calls with a 60 s timeout each
            loop.cancel(loop.call_later(60, print))
        done = threading.Event()
        loop.call_later(0.01, done.set)
        assert done.wait(2)
        assert poll_for(lambda: len(loop._timers) < 600)
        loop.cancel(oldest)
    finally:
        loop.stop()


def test_messages_to_a_peer_whose_address_is_not_known_yet_wait_and_keep_their_order() -> None:
    """A member may hear from a peer before the member table with that peer's
    address reaches it; its answers wait for the address instead of being lost."""
    key = new_key()
    got: list = []
    a = IOLoop(key, 0, lambda env: None, name="nbrpc-io-test-a")
    b = IOLoop(key, 1, got.append, name="nbrpc-io-test-b")
    try:
        for loop in (a, b):
            loop.bind()
            loop.start()
        for i in range(5):
            a.send(1, 0, i, b"early")  # b's address is not known to a yet
        assert not poll_for(lambda: got, timeout=0.2)
        a.set_address(1, b.address)
        a.send(1, 0, 5, b"late")  # after the held ones, never before
        assert poll_for(lambda: len(got) == 6, timeout=5), got
        assert [env.msg_id for env in got] == list(range(6))
        a.forget(2)  # a peer that left: its messages are dropped, not held
        a.send(2, 0, 9, b"gone")
        assert not a._held
    finally:
        a.stop()
        b.stop()
