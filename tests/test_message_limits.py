"""A message larger than its receiver accepts fails the call at once, on the
caller, naming both sizes and the option to change: members tell each other
their ``max_message_size`` when they join, so neither side sends what the other
would drop unread (which left the caller waiting its whole timeout and the
group's graceful shutdown waiting for an answer that never came)."""

from __future__ import annotations

import pytest
import torch
from conftest import local_group

from nbrpc.errors import MessageTooLargeError

SMALL = 1 << 20  # the least a member may accept
BIG = torch.zeros((3 << 20) // 4)  # 3 MiB


def echo(x):
    return x


def make_big():
    return torch.zeros((3 << 20) // 4)


@pytest.fixture
def group():
    """'a' accepts the default 4 GiB, 'b' only 1 MiB; calls would wait 30 s."""
    with local_group(["a", "b"], rpc_timeout=30, per_rank={1: {"max_message_size": SMALL}}) as g:
        yield g


def test_a_request_larger_than_the_callee_accepts_fails_on_the_caller(group) -> None:
    a, b = group
    for call in (lambda: a.rpc_sync("b", echo, (BIG,)),
                 lambda: a.rpc_async("b", echo, (BIG,)).wait()):
        with pytest.raises(MessageTooLargeError) as e:
            call()
        assert (e.value.limit, e.value.worker) == (SMALL, "b") and e.value.size > 3 << 20
        assert "more than 'b' accepts (1.0 MiB, its max_message_size)" in str(e.value)
        assert "TensorPipeRpcBackendOptions(max_message_size=...)" in str(e.value)
    assert b.io.dropped.get("too large", 0) == 0  # nothing was sent to be dropped
    assert a.rpc_sync("b", echo, (torch.ones(3),)).tolist() == [1.0, 1.0, 1.0]  # still healthy
    assert a.caller.sent_to[1] == b.callee.served_to[0]  # no request left unanswered: shutdown has none to wait for


def test_an_answer_larger_than_the_caller_accepts_fails_the_call_with_why(group) -> None:
    a, b = group
    with pytest.raises(MessageTooLargeError) as e:
        b.rpc_sync("a", make_big)
    assert e.value.limit == SMALL and e.value.size > 3 << 20
    assert str(e.value).startswith("the answer to ")
    assert "from 'a' is 3.0 MiB, more than 'b' accepts" in str(e.value)
    assert b.io.dropped.get("too large", 0) == 0
    assert b.rpc_sync("a", echo, (torch.ones(2),)).tolist() == [1.0, 1.0]


def test_under_the_limit_everything_goes_as_usual(group) -> None:
    a, b = group
    half = torch.zeros((1 << 19) // 4)  # 512 KiB: fits b's 1 MiB
    assert torch.equal(a.rpc_sync("b", echo, (half,)), half)
    assert b.rpc_sync("a", torch.numel, (BIG,)) == BIG.numel()  # a takes up to 4 GiB


def test_a_request_whose_segment_cannot_be_read_fails_on_the_caller_at_once(monkeypatch) -> None:
    """The callee drops a signed request whose shared-memory buffer it cannot
    open (here: the read fails as if the segment were gone); it answers with
    why, and the caller raises at once instead of waiting out its 30 s."""
    import time

    from nbrpc.errors import SerializationError
    from nbrpc.transport import shm

    def unreadable(name, nbytes, *rest):
        raise OSError(2, "No such file or directory", name)

    with local_group(["a", "b"], rpc_timeout=30) as (a, b):
        monkeypatch.setattr(shm, "read", unreadable)
        for call in (lambda: a.rpc_sync("b", echo, (BIG,)),
                     lambda: a.rpc_async("b", echo, (BIG,)).wait()):
            t0 = time.monotonic()
            with pytest.raises(SerializationError, match="could not read a request from 'a'"):
                call()
            assert time.monotonic() - t0 < 10
        assert b.io.dropped["unreadable segment"] == 2
        monkeypatch.undo()
        assert torch.equal(a.rpc_sync("b", echo, (BIG,)), BIG)
