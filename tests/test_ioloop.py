"""The I/O loop alone: timers, hand-off, and delivery to itself."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import zmq
from conftest import free_ports, poll_for

from nbrpc.transport import IOLoop, local, new_key
from nbrpc.transport.dealer import Dealer
from nbrpc.transport.unix import UnixSender
from nbrpc.transport.zmqhub import close_monitor


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


def test_a_link_that_never_came_up_is_down_and_its_coming_up_is_told() -> None:
    """The link to a peer nobody listens for yet counts as down from the first
    message (a firewall that lets no connection through looks the same); once
    the peer listens, the link comes up, ``on_link_up`` hears it, and the held
    message arrives."""
    key, got, ups = new_key(), [], []
    (port,) = free_ports(1)
    a = IOLoop(key, 0, lambda env: None, name="nbrpc-io-test-a", ipc=False)
    b = IOLoop(key, 1, got.append, name="nbrpc-io-test-b", ipc=False)
    a.on_link_up = ups.append
    try:
        a.bind()
        a.start()
        a.set_address(1, f"tcp://127.0.0.1:{port}")
        t0 = time.monotonic()
        a.send(1, 0, 1, b"early")
        time.sleep(0.3)  # deliberate: connection attempts refused meanwhile
        since = a.link_down_since(1)
        assert since is not None and since <= t0 + 0.1 and not ups
        b.bind(port=port)
        b.start()
        assert poll_for(lambda: got, timeout=10)  # (zmq's reconnect interval backs off)
        assert a.link_down_since(1) is None and ups == [1]
    finally:
        a.stop()
        b.stop()


# -- peers on the same host: a Unix domain socket ------------------------------------
def _pair(ipc: bool = True, encrypt: bool = False) -> tuple[IOLoop, IOLoop, list]:
    key = new_key()
    got: list = []
    a = IOLoop(key, 0, lambda env: None, name="nbrpc-io-test-a", ipc=ipc, encrypt=encrypt)
    b = IOLoop(key, 1, got.append, name="nbrpc-io-test-b", ipc=ipc, encrypt=encrypt)
    for loop in (a, b):
        loop.bind()
        loop.start()
    return a, b, got


def _endpoint(loop: IOLoop, peer: int) -> str:
    sock = loop._dealers[peer].sock
    if isinstance(sock, UnixSender):
        return f"unix://{sock.path}"
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def test_same_host_peer_is_reached_over_its_unix_socket() -> None:
    a, b, got = _pair()
    try:
        assert b.local_address.startswith(local.host_identity() + "@unix://")
        directory = b._ipc_dir
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700  # no other user gets in
        a.set_address(1, b.address, b.local_address)
        a.send(1, 0, 7, b"hello")
        assert poll_for(lambda: got, timeout=5)
        assert bytes(got[0].payload) == b"hello"
        assert _endpoint(a, 1) == local.local_endpoint(b.local_address)
        assert a._is_local(1)  # (large buffers go through shared memory)
    finally:
        a.stop()
        b.stop()
    assert not os.path.exists(directory)  # removed with the loop


@pytest.mark.parametrize("case", ["other host", "ipc off"])
def test_other_host_or_no_ipc_uses_tcp(case: str) -> None:
    a, b, got = _pair(ipc=case != "ipc off")
    try:
        if case == "other host":  # another kernel: the path means nothing there
            published = "another-host@" + b.local_address.partition("@")[2]
        else:
            assert b.local_address == local.host_identity() + "@" and b._ipc_dir is None
            published = b.local_address  # (same host and user: shared memory, no socket)
        a.set_address(1, b.address, published)
        a.send(1, 0, 1, b"x")
        assert poll_for(lambda: got, timeout=5)
        assert _endpoint(a, 1).startswith("tcp://")
        assert a._is_local(1) == (case == "ipc off")
    finally:
        a.stop()
        b.stop()


def test_a_peer_of_another_user_gets_neither_unix_socket_nor_shared_memory() -> None:
    """Two users who share a key: the other's 0700 socket directory and 0600
    segments are out of reach, so its peer publishes another identity and is
    reached over TCP, with every byte by socket."""
    a, b, got = _pair()
    try:
        identity, _, endpoint = b.local_address.partition("@")
        assert identity.endswith(f":{os.geteuid()}")
        other_user = identity.rpartition(":")[0] + f":{os.geteuid() + 1}"
        a.set_address(1, b.address, f"{other_user}@{endpoint}")
        a.send(1, 0, 1, b"x", [bytes(4 << 20)])
        assert poll_for(lambda: got, timeout=5)
        assert _endpoint(a, 1).startswith("tcp://") and not a._is_local(1)
        assert not got[0].flags & 1  # (frames.FLAG_SHM: no segment named)
    finally:
        a.stop()
        b.stop()


def test_socket_directories_of_exited_processes_are_swept(tmp_path) -> None:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=30)
    dead = int(done.stdout)  # exited (and reaped): its directory is stale
    stale = tempfile.mkdtemp(prefix=f"{local.PREFIX}{dead}-", dir=tmp_path)
    mine = tempfile.mkdtemp(prefix=f"{local.PREFIX}{os.getpid()}-", dir=tmp_path)
    other = tmp_path / "unrelated"
    other.mkdir()
    assert local.sweep(str(tmp_path)) == 1
    assert not os.path.exists(stale) and os.path.exists(mine)  # a live process keeps its
    assert other.exists()


def test_a_cancelled_timer_lets_go_of_its_arguments_at_once() -> None:
    # (an RRef value's future waited in a cancelled 60 s expiry: held for 60 s)
    import gc
    import weakref

    from nbrpc.transport.timers import Timers

    class Value:
        pass

    timers, value = Timers(), Value()
    alive = weakref.ref(value)
    handle = timers.add(time.monotonic() + 60, print, (value,))
    del value
    timers.cancel(handle)
    gc.collect()
    assert alive() is None and len(timers) == 1  # (the entry itself waits for its time)


# -- tcp://: no frame over CHUNK ------------------------------------------------------
@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "curve"])
def test_large_frames_cross_tcp_in_parts_and_arrive_whole(encrypt: bool) -> None:
    """A head and buffers larger than frames.CHUNK cross a tcp:// connection cut
    into parts (the receiver's frame cap is about CHUNK) and arrive intact and
    writable, in the clear and with CURVE (which adds to each frame)."""
    from nbrpc.transport import frames

    a, b, got = _pair(ipc=False, encrypt=encrypt)
    a._shm = None  # (shared memory off: every byte crosses the socket)
    try:
        a.set_address(1, b.address)
        payload = bytes(range(256)) * (frames.CHUNK // 128 + 3)  # a head > CHUNK
        buffers = [os.urandom(3 * frames.CHUNK + 5), b"", os.urandom(100)]
        a.send(1, 0, 1, payload, buffers)
        a.send(1, 0, 2, b"small", [b"x"])  # unsplit, after it
        assert poll_for(lambda: len(got) == 2, timeout=10), b.dropped
        env = got[0]
        assert bytes(env.payload) == payload
        assert [bytes(x) for x in env.buffers] == buffers
        assert memoryview(env.buffers[0]).readonly is False  # (torch tensors over it)
        assert got[1].msg_id == 2 and not b.dropped
        assert _endpoint(a, 1).startswith("tcp://")
    finally:
        a.stop()
        b.stop()


def test_parts_that_do_not_fit_their_layout_are_dropped_and_the_stream_goes_on() -> None:
    import struct

    from conftest import intruder

    from nbrpc.transport import frames

    a, b, got = _pair(ipc=False)
    try:
        n = struct.Struct("<Q")
        with intruder(b.address, b._key) as s:  # (a peer with the token: past the handshake)
            s.send_multipart([b"", n.pack(10), b"x" * 4])  # fewer bytes than declared
            s.send_multipart([b"", n.pack(3), b"abcd"])  # a part larger than its frame
            s.send_multipart([b"", n.pack(2), b"ab", b"cd"])  # more parts than declared
            s.send_multipart([b"", b"abc"])  # a layout that is not <Q lengths
            s.send_multipart([b""])  # no layout at all
            s.send_multipart([b"", n.pack(1 << 40), b"x"])  # more than the receiver takes
            s.send_multipart(frames.split([b"not a message" * 30000]))  # whole, then refused
            assert poll_for(lambda: sum(b.dropped.values()) == 7, timeout=5), b.dropped
        assert b.dropped == {"framing": 6, "too large": 1}
        a.set_address(1, b.address)
        a.send(1, 0, 3, b"after")
        assert poll_for(lambda: got, timeout=5) and got[0].msg_id == 3
    finally:
        a.stop()
        b.stop()


def test_a_message_for_another_member_or_run_is_refused() -> None:
    """Signed with the group's key, but for rank 2, or for another run of the
    group: refused and counted before anything of it is read."""
    a, b, got = _pair(ipc=False)
    try:
        a.set_address(1, b.address)
        a.set_address(2, b.address)  # (what a recorded message to rank 2 looks like to b)
        b.run = a.run = 7
        a.send(2, 0, 1, b"for rank 2")
        a.run = 8
        a.send(1, 0, 2, b"of run 8")
        a.run = 0
        a.send(1, 0, 3, b"of no run yet (a joiner): the agent decides")
        a.run = 7
        a.send(1, 0, 4, b"this run")
        assert poll_for(lambda: len(got) == 2, timeout=5)
        assert [e.msg_id for e in got] == [3, 4] and [e.run for e in got] == [0, 7]
        assert b.dropped == {"wrong destination": 1, "wrong run": 1}
    finally:
        a.stop()
        b.stop()


def test_a_dropped_connection_that_connects_while_it_lingers_leaves_the_context_working() -> None:
    """A dropped DEALER lingers (its queued frames drain) after its monitor's
    reader is closed. libzmq's I/O thread sends each link event to the monitor
    with a blocking send, so an event then, with monitoring still on, stops
    that thread for good and every socket of the context with it: the agent
    went deaf after a restarted worker's old process died (its connection
    lost) while the dealer to it was closing. Here the event is a connect:
    the dealer's peer starts listening only after the drop."""
    ctx = zmq.Context()
    port = free_ports(1)[0]
    sock = ctx.socket(zmq.DEALER)
    monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
    sock.connect(f"tcp://127.0.0.1:{port}")
    sock.send(b"queued", zmq.NOBLOCK)  # no peer yet: the close lingers for it
    dealer = Dealer(1, lambda *a: None, lambda *a: None, sock, monitor)
    assert dealer.drop(linger=5000) == []
    close_monitor(dealer)  # as the loop's unwatch, at once
    late = ctx.socket(zmq.ROUTER)
    late.bind(f"tcp://127.0.0.1:{port}")  # the lingering dealer connects: an event
    drained = bool(late.poll(5000)) and late.recv_multipart()[1] == b"queued"  # as promised
    a, b = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    b.connect(f"tcp://127.0.0.1:{a.bind_to_random_port('tcp://127.0.0.1')}")
    b.send(b"ping")
    if not (drained and a.poll(5000)):  # (a wedged context cannot be terminated: left)
        pytest.fail(f"the context's I/O thread is stuck (queued frame drained: {drained}, "
                    "a new connection carried nothing)")
    for s in (a, b, late):
        s.close(linger=0)
    ctx.term()
