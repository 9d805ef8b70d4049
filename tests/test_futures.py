"""Errors stored in torch futures: read without raising, raised as fresh copies."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from nbrpc.agent import RpcFuture, fresh, outcome, wait_result
from nbrpc.errors import RemoteTraceback, RpcTimeoutError, UnknownWorkerError, WorkerGoneError

ERRORS = [WorkerGoneError("w1", "died"), RpcTimeoutError("RPC 'call'", 1.5, "w1"),
          UnknownWorkerError("w9", ["w1"]), FileNotFoundError(2, "no such file"),
          ValueError("plain"), KeyError("k")]


@pytest.mark.parametrize("error", ERRORS, ids=lambda e: type(e).__name__)
def test_fresh_copies_keep_type_message_and_fields(error: BaseException) -> None:
    error.__cause__ = RemoteTraceback("remote tb")
    new = fresh(error)
    assert new is not error and type(new) is type(error) and str(new) == str(error)
    assert new.__dict__ == error.__dict__ and new.__cause__ is error.__cause__


class Held:
    pass


def _wait_and_fail(fut: torch.futures.Future) -> weakref.ref:
    held = Held()  # a local of the frame the error is raised through
    try:
        fut.wait() if isinstance(fut, RpcFuture) else wait_result(fut)
    except WorkerGoneError:
        pass
    return weakref.ref(held)


@pytest.mark.parametrize("make", [RpcFuture, torch.futures.Future])
def test_an_error_raised_out_of_a_future_does_not_pin_the_raising_frames(make) -> None:
    """The stored error must not get a traceback: torch keeps it in C++, where a
    cycle through it is never collected (RpcFuture.wait, and wait_result for the
    plain torch futures of RRef values)."""
    fut = make()
    fut.set_exception(WorkerGoneError("w1", "died"))
    ref = _wait_and_fail(fut)
    gc.collect()
    assert ref() is None
    value, error = outcome(fut)
    assert value is None and isinstance(error, WorkerGoneError) and error.__traceback__ is None


def test_outcome_of_a_value() -> None:
    fut = torch.futures.Future()
    fut.set_result(3)
    assert outcome(fut) == (3, None)


def test_a_settled_future_answers_from_python_and_from_torch_alike() -> None:
    """The agent's ``settle`` keeps the outcome in Python before it completes
    the torch future: a thread woken by torch's completion callback (as
    ``wait()`` is) already finds it there, so ``wait()``, ``value()`` and
    ``done()`` need not go back into torch (which drops the GIL); torch's own
    consumers (``then``, ``wait_all``) see the same value."""
    fut = RpcFuture()
    seen = []
    torch._C.Future.add_done_callback(fut, lambda f: seen.append((f._outcome, f.value())))
    child = fut.then(lambda f: f.value() + 1)
    assert not fut.done() and fut._outcome is None
    fut.settle(41)
    assert seen == [((41, None), 41)]
    assert fut.done() and torch._C.Future.done(fut)
    assert fut.wait() == fut.value() == torch._C.Future.value(fut) == 41
    assert child.wait() == 42 and torch.futures.wait_all([fut]) == [41]


def test_a_settled_error_is_raised_fresh_from_python_and_from_torch() -> None:
    fut = RpcFuture()
    seen = []
    torch._C.Future.add_done_callback(fut, lambda f: seen.append(f._outcome))
    fut.settle(error=WorkerGoneError("w1", "died"))
    assert len(seen) == 1 and isinstance(seen[0][1], WorkerGoneError)
    with pytest.raises(WorkerGoneError, match="w1"):
        fut.wait()
    with pytest.raises(WorkerGoneError, match="w1"):
        torch.futures.wait_all([fut])
    value, error = outcome(fut)
    assert value is None and type(error) is WorkerGoneError and error.__traceback__ is None
