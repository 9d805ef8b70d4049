"""A calling thread's own channel (nbrpc.transport.channel).

Unit tests frame messages over a socket pair with no agent; the in-process
tests check what the agents do with channels: which calls take one, where
the callee runs them, the handshake, the bound, and every way a caller can
stop reading (timeout, Ctrl-C, its thread ending) without losing an answer
or a serving thread.
"""

from __future__ import annotations

import operator
import socket
import threading
import time

import pytest
from conftest import local_group, poll_for
from targets import sleep_then

from nbrpc.agent.messages import Call
from nbrpc.errors import RpcTimeoutError
from nbrpc.transport import channel, local, new_key, pack, unix
from nbrpc.transport.auth import connect_token
from nbrpc.transport.channel import ChannelClosed, write_all
from nbrpc.transport.unix import UnixReceiver


def _thread_name() -> str:
    return threading.current_thread().name


def _call_back(to: str, x: int) -> int:
    from nbrpc import rpc
    from nbrpc.agent import current_agent
    return current_agent().rpc_sync(to, operator.neg, (x,)) + rpc.get_worker_info().id


# -- framing, no agent -------------------------------------------------------------------
def test_write_all_frames_what_a_receiver_reads_empty_and_large_frames_included() -> None:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    big = bytes(range(256)) * 8192  # 2 MiB: more than the socket buffer holds
    got: list = []

    def read() -> None:
        r = UnixReceiver(b, b"", 1 << 24, authenticated=True)
        deadline = time.monotonic() + 10
        while len(got) < 2 and time.monotonic() < deadline:
            messages, closed = r.read()
            got.extend(messages)
            if closed:
                return
            time.sleep(0.001)

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert write_all(a, [b"head", b"", big]) > len(big)  # waits for the reader
        write_all(a, [b"x"])
        reader.join(10)
        assert [[bytes(f) for f in m] for m in got] == [[b"head", b"", big], [b"x"]]
    finally:
        a.close()
        b.close()


def test_write_all_gives_up_on_a_reader_that_takes_nothing() -> None:
    a, b = socket.socketpair()
    a.setblocking(False)
    try:
        with pytest.raises(ChannelClosed, match="took nothing"):
            write_all(a, [bytes(8 << 20)], timeout=0.2)
    finally:
        a.close()
        b.close()


# -- agents ------------------------------------------------------------------------------
@pytest.fixture
def pair():
    with local_group(["a", "b"], threads=2, rpc_timeout=10.0) as agents:
        yield agents


def _served(agent) -> int:
    return agent.snapshot(events=0)["counters"]["channels"]


def test_rpc_sync_runs_on_the_channel_thread_and_rpc_async_on_the_pool(pair) -> None:
    a, b = pair
    assert a.rpc_sync(1, _thread_name) == "nbrpc-io[b]-channel"
    assert a.rpc_async(1, _thread_name).wait().startswith("nbrpc-worker[b]")
    assert _served(b) == 1 and a.io.channel(1) is a.io.channel(1)  # one per thread
    # channels counted too (each side counts once its write returned)
    assert poll_for(lambda: a.io.sent_msgs >= 2 and b.io.sent_msgs >= 2, 5)
    assert a.rpc_sync(1, operator.add, (2, 3)) == 5


def test_each_thread_has_its_own_channel_and_a_thread_that_ends_frees_its_own(pair) -> None:
    a, b = pair
    a.rpc_sync(1, operator.pos, (1,))
    results = []
    t = threading.Thread(target=lambda: results.append(a.rpc_sync(1, _thread_name)))
    t.start()
    t.join(10)
    assert results == ["nbrpc-io[b]-channel"]
    del t  # its channel went with its thread-local state; the callee's thread leaves
    assert poll_for(lambda: _served(b) == 1, 5), _served(b)


def _busy_channels() -> int:
    from nbrpc.agent import current_agent
    return current_agent().snapshot(events=0)["counters"]["channels_busy"]


def test_a_call_on_a_channel_counts_as_a_busy_thread(pair) -> None:
    a, b = pair
    assert a.rpc_sync(1, _busy_channels) == 1
    assert poll_for(lambda: b.snapshot(events=0)["counters"]["channels_busy"] == 0, 5)


def test_callee_calls_back_from_its_channel_thread(pair) -> None:
    a, b = pair
    assert a.rpc_sync(1, _call_back, ("a", 5)) == -5 + 1  # b calls a while serving a


def test_a_timed_out_call_leaves_the_channel_usable(pair) -> None:
    a, b = pair
    with pytest.raises(RpcTimeoutError):
        a.rpc_sync(1, sleep_then, (1.0, 1), timeout=0.2)
    # the late answer is read by the I/O thread (the channel was handed over),
    # which then closes the channel: the callee's thread for it leaves
    assert poll_for(lambda: a.late_replies == 1, 5)
    assert poll_for(lambda: _served(b) == 0, 5), _served(b)
    assert a.rpc_sync(1, operator.pos, (7,)) == 7
    assert _served(b) == 1


def test_an_interrupted_wait_loses_nothing(pair, monkeypatch) -> None:
    a, b = pair
    a.rpc_sync(1, operator.pos, (1,))
    chan = a.io.channel(1)
    real = chan.read

    def interrupted(timeout: float):
        chan.read = real  # once
        raise KeyboardInterrupt

    chan.read = interrupted
    fut = a.request(1, Call(sleep_then, (0.2, 42), {}), sync=True)
    with pytest.raises(KeyboardInterrupt):
        fut.wait()
    assert fut.wait() == 42  # the I/O thread read the answer
    assert poll_for(lambda: _served(b) == 0, 5)  # and then closed the channel
    assert a.io.channel(1) is not chan  # a new one for the next call


def test_over_the_limit_calls_take_the_usual_path(pair, monkeypatch) -> None:
    a, b = pair
    monkeypatch.setattr(channel, "MAX_CHANNELS", 0)
    assert a.rpc_sync(1, _thread_name).startswith("nbrpc-worker[b]")
    assert a.io.channel(1) is None  # refused lately: not tried again at once


def test_no_more_channels_than_worker_threads(pair) -> None:
    a, b = pair  # (2 worker threads each)
    names: list = []
    gate, done = threading.Barrier(3, timeout=10), threading.Event()

    def call() -> None:  # (alive until checked: a thread's channel ends with it)
        gate.wait()
        names.append(a.rpc_sync(1, _thread_name))
        done.wait(10)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        assert poll_for(lambda: len(names) == 3, 10), names
        assert _served(b) == 2 and names.count("nbrpc-io[b]-channel") == 2, names
    finally:
        done.set()
        for t in threads:
            t.join(10)


def test_a_channel_without_the_key_is_refused_and_a_forged_message_dropped(pair) -> None:
    a, b = pair
    path = unix.path_of(local.local_endpoint(b.io.local_address))
    evil = b"cos\nsystem\n(S'echo pwned'\ntR."
    with socket.socket(socket.AF_UNIX) as s:  # a wrong token: refused, nothing read
        s.connect(path)
        s.sendall(unix.CHANNEL_MAGIC + bytes(len(connect_token(b._key))) + evil)
        assert poll_for(lambda: b.io.dropped["refused connection"] == 1)
        s.settimeout(5)
        assert s.recv(1) == b""  # closed, no acknowledgement
    frames = pack(new_key(), 1, 0, 1, evil)  # signed with another key
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(unix.CHANNEL_MAGIC + connect_token(b._key))
        s.settimeout(5)
        assert s.recv(1) == channel.ACCEPTED
        write_all(s, frames)
        assert poll_for(lambda: b.io.dropped["bad signature"] == 1)
    assert a.rpc_sync(1, operator.pos, (3,)) == 3


# -- requests nobody waits for yet: queued, written in batches -----------------------------
def _hold_io_flushes(a, monkeypatch) -> None:
    """The I/O thread's flush of deferred requests does nothing from now on:
    only the calling thread's own writes send them."""
    monkeypatch.setattr(a.io, "_flush_due", lambda dealer: None)


def test_waiting_on_an_async_call_writes_its_request_on_the_waiting_thread(
        pair, monkeypatch) -> None:
    a, b = pair
    assert a.rpc_async(1, operator.pos, (1,)).wait() == 1  # (the connection is up)
    _hold_io_flushes(a, monkeypatch)
    fut = a.rpc_async(1, operator.neg, (3,))
    assert fut.unsent is not None and a.io._dealers[1].queue  # queued, not written
    assert fut.wait() == -3  # wait() wrote it (the I/O thread would not have)
    assert not a.io._dealers[1].queue


def test_a_channel_call_first_writes_what_this_thread_queued_for_that_peer(
        pair, monkeypatch) -> None:
    a, b = pair
    assert a.rpc_sync(1, operator.pos, (1,)) == 1
    _hold_io_flushes(a, monkeypatch)
    fut = a.rpc_async(1, operator.neg, (5,))
    assert a.rpc_sync(1, operator.pos, (2,)) == 2  # on the channel, after the queued one
    assert poll_for(fut.done, 5) and fut.wait() == -5


def test_to_here_right_after_remote_takes_the_creation_along_on_its_channel(
        pair, monkeypatch) -> None:
    from nbrpc.rref import remote
    a, b = pair
    _hold_io_flushes(a, monkeypatch)  # (else the I/O thread may write it first)
    r = remote(a, "b", _thread_name, (), {}, -1)
    assert r.to_here() == "nbrpc-io[b]-channel"  # created on the channel's thread
    assert r.confirmed_by_owner()  # the creation's answer came first, on the same channel
    assert a.io.channel(1).due == 0 and not a.io._dealers[1].queue
    monkeypatch.undo()
    a.io._dealers[1].flush_due = False
    later = remote(a, "b", _thread_name, (), {}, -1)
    assert poll_for(later.confirmed_by_owner, 5)  # the I/O thread wrote it meanwhile
    assert later.to_here().startswith("nbrpc-worker[b]")  # created on the pool


def _fails() -> None:
    raise ValueError("no value")


def test_a_failed_creation_taken_along_fails_to_here(pair, monkeypatch) -> None:
    from nbrpc.rref import remote
    a, b = pair
    _hold_io_flushes(a, monkeypatch)
    r = remote(a, "b", _fails, (), {}, -1)
    with pytest.raises(ValueError, match="no value"):
        r.to_here()
    assert r.confirmed_by_owner()  # the owner keeps the error as the value (as PyTorch)
    with pytest.raises(ValueError, match="no value"):
        r.to_here()
    assert a.rpc_sync(1, operator.pos, (4,)) == 4  # the channel is in step


def test_a_timed_out_to_here_with_its_creation_along_loses_neither_answer(
        pair, monkeypatch) -> None:
    """Both answers were due on the channel when its thread stopped reading:
    the I/O thread reads both, then closes it."""
    from nbrpc.rref import remote
    a, b = pair
    _hold_io_flushes(a, monkeypatch)
    r = remote(a, "b", sleep_then, (0.5, 3), {}, -1)
    with pytest.raises(RpcTimeoutError):
        r.to_here(timeout=0.2)
    assert poll_for(r.confirmed_by_owner, 5)  # the creation's answer
    assert poll_for(lambda: a.late_replies == 1, 5)  # and the fetch's, late
    assert poll_for(lambda: _served(b) == 0, 5)  # then the channel closed
    assert r.to_here() == 3


def test_a_creation_taken_along_still_goes_when_no_channel_can_take_it(
        pair, monkeypatch) -> None:
    """No channel (refused) or a channel that fails before the creation went:
    the creation and the fetch take the usual path, in that order."""
    from nbrpc.rref import remote
    a, b = pair
    _hold_io_flushes(a, monkeypatch)
    monkeypatch.setattr(channel, "MAX_CHANNELS", 0)
    r = remote(a, "b", _thread_name, (), {}, -1)
    assert r.to_here().startswith("nbrpc-worker[b]")  # created on the pool
    assert poll_for(r.confirmed_by_owner, 5)
    monkeypatch.setattr(channel, "MAX_CHANNELS", 64)
    a.io.channels._no_channel.clear()
    assert a.rpc_sync(1, operator.pos, (1,)) == 1  # a channel again

    def broken(frames, first=None):
        raise ChannelClosed("the reader closed the connection")

    monkeypatch.setattr(a.io.channel(1), "write", broken)
    s = remote(a, "b", _thread_name, (), {}, -1)
    assert s.to_here().startswith("nbrpc-worker[b]")
    assert poll_for(s.confirmed_by_owner, 5)
