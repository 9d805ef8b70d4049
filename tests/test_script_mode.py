"""Multi-process tier: nbrpc in script mode, run exactly as PyTorch's RPC tutorials run.

One world of three processes (``worlds.run_world``: ``torch.multiprocessing.spawn``)
starts it all; each process calls ``rpc.init_rpc(name, rank=rank, world_size=3)``
(env://, with MASTER_ADDR/MASTER_PORT from a free port the parent chose) and
``rpc.shutdown()``. A spawn costs 1-2 s (importing torch), so the whole file uses that
one spawn, in phases run back to back inside the same three processes:

==========  =================================================================
phase       what it sets up
==========  =================================================================
main        env://, default options; rank 0 ("master") drives most checks,
            worker1 and worker2 serve
reinit      init_rpc again after shutdown, same MASTER_PORT (no "address in
            use"), with num_worker_threads=2 and rpc_timeout=20
tcp         init_method="tcp://127.0.0.1:PORT2" (the workers also call rank 0
            while it is already inside shutdown)
file        init_method="file:///tmp/.../rendezvous" (PyTorch's options class)
file_again  the same file again, right after the file phase's shutdown
            (rpc_timeout=4, so that a failed rendezvous costs 4 s, not 60)
final       rank 0 alone, no group: a file:// init_rpc that nobody joins
==========  =================================================================

Each check is a plain function run (mostly by rank 0) between init_rpc and shutdown;
its outcome (and traceback) is a row put on the parent's queue (see ``worlds.py``),
and the parent turns each one into its own pytest test. Phase-level failures
(init_rpc, shutdown) raise in the child, which reports a ``<crash>`` row and exits
with a non-zero code. A watchdog (``faulthandler.dump_traceback_later(exit=True)``)
bounds every phase of every child, every RPC has a timeout (at most the 60 s
default), and the parent kills what is still alive after ``WORLD_TIMEOUT_S``.
"""

from __future__ import annotations

import faulthandler
import json
import os
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import zmq
from conftest import poll_or_fail
from targets import echo, sleep_then, whoami
from worlds import World, child, run_world

import nbrpc.debug
from nbrpc import rpc
from nbrpc.agent import current_agent
from nbrpc.agent.messages import REQUEST, Call
from nbrpc.errors import (
    AlreadyInitializedError,
    NotInitializedError,
    RemoteError,
    RendezvousError,
    RpcTimeoutError,
    SerializationError,
    UnknownWorkerError,
)
from nbrpc.serialize import dumps
from nbrpc.transport import pack
from nbrpc.transport.frames import SIG_LEN
from nbrpc.transport.io import connect_token

pytestmark = pytest.mark.multiprocess

WORLD = 3
NAMES = ["master", "worker1", "worker2"]
PHASE_WATCHDOG_S = 45.0  # a child stuck this long in one phase dumps its threads and exits


# -- functions and classes run remotely (module level: every process imports them) --
def _add(a, b=0, *, scale=1):
    return (a + b) * scale


def _nested(hops: list) -> list:
    """Runs on one worker; calls the next hop with rpc_sync (A -> B -> C ...)."""
    me = [rpc.get_worker_info().name]
    if not hops:
        return me
    return me + rpc.rpc_sync(hops[0], _nested, args=(hops[1:],), timeout=20)


def _raise_value_error(msg: str):
    raise ValueError(msg)


def _nested_raise(to: str, msg: str):
    return rpc.rpc_sync(to, _raise_value_error, args=(msg,), timeout=20)


class _CustomError(Exception):
    def __init__(self, msg: str, code: int = 0) -> None:
        super().__init__(msg)
        self.code = code


def _raise_custom(msg: str, code: int):
    raise _CustomError(msg, code)


class _NeedsTwoArgs(Exception):
    """Pickles, but does not unpickle (its args are one string): becomes RemoteError."""

    def __init__(self, a, b) -> None:
        super().__init__(f"{a}/{b}")


def _raise_needs_two_args():
    raise _NeedsTwoArgs("left", "right")


def _receive_info(t: torch.Tensor) -> dict:
    """What arrived: the size of the storage behind the received tensor, and the tensor."""
    return {
        "storage_nbytes": t.untyped_storage().nbytes(),
        "contiguous": t.is_contiguous(),
        "value": t,
    }


_KEPT: list = []


def _keep(t: torch.Tensor) -> float:
    _KEPT.append(t)
    return float(t.sum())


def _kept(clear: bool = False) -> list:
    out = list(_KEPT)
    if clear:
        _KEPT.clear()
    return out


def _sleep_then_sum(t: torch.Tensor, secs: float) -> float:
    time.sleep(secs)  # deliberate: the caller changes its own copy meanwhile
    return float(t.sum())


def _raise_system_exit():
    raise SystemExit(3)


def _return_lock():
    return threading.Lock()


def _slice_of_large() -> torch.Tensor:
    return torch.arange(1_000_000, dtype=torch.float32)[10:20]


def _strided_of_large() -> torch.Tensor:
    return torch.arange(512 * 512, dtype=torch.float32).reshape(512, 512)[:, ::8]


def _inplace_add_(t: torch.Tensor) -> None:
    t.add_(1)


def _touch(path: str) -> None:  # what a forged message would run, were it ever unpickled
    Path(path).write_text("executed")


class _Counter:
    def __init__(self, start: int = 0) -> None:
        self.value = start

    def add(self, n: int) -> int:
        self.value += n
        return self.value

    def get(self) -> int:
        return self.value


@rpc.functions.async_execution
def _async_add_chained(to, x, y, z):
    # PyTorch's documented example: returns at once; the reply goes when .then fires.
    return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)


@rpc.functions.async_execution
def _async_fail(msg: str):
    fut = torch.futures.Future()
    fut.set_exception(ValueError(msg))
    return fut


@rpc.functions.async_execution
def _async_chain(hops: list, acc: int):
    """Each hop adds 1 on the way back; the worker thread is released at every level."""
    if not hops:
        fut = torch.futures.Future()
        fut.set_result(acc)
        return fut
    return rpc.rpc_async(hops[0], _async_chain, args=(hops[1:], acc), timeout=20).then(
        lambda fut: fut.wait() + 1)


class _AsyncExecutionClass:
    @staticmethod
    @rpc.functions.async_execution
    def static_async_add(to, x, y, z):
        return rpc.rpc_async(to, torch.add, args=(x, y)).then(lambda fut: fut.wait() + z)

    @classmethod
    @rpc.functions.async_execution
    def class_async_add(cls, to, x, y, z):
        ret_fut = torch.futures.Future()
        rpc.rpc_async(to, torch.add, args=(x, y)).then(
            lambda fut: ret_fut.set_result(fut.wait() + z))
        return ret_fut


# -- the checks rank 0 runs, by phase ----------------------------------------------------
PHASES = ("main", "reinit", "tcp", "file", "file_again")
# A phase whose init_rpc may fail (that is what it tests): the failure is recorded as the
# failure of its checks, and the processes go on instead of raising.
SOFT_INIT_PHASES = {"file_again": 4.0}  # phase -> rpc_timeout (bounds its rendezvous)
CHECKS: dict[str, dict[str, Callable[[], Any]]] = {p: {} for p in PHASES}  # run by rank 0
WORKER_CHECKS: dict[str, dict[str, Callable[[], Any]]] = {p: {} for p in PHASES}  # ranks 1, 2
AFTER_SHUTDOWN: dict[str, dict[str, Callable[[], Any]]] = {p: {} for p in PHASES}  # rank 0
FINAL: dict[str, Callable[[], Any]] = {}  # rank 0, after every phase, with no group running
_CTX: dict[str, Any] = {}  # set in the child: ports, paths, state shared between checks


def _check(phase: str, on_workers: bool = False, after_shutdown: bool = False):
    table = WORKER_CHECKS if on_workers else AFTER_SHUTDOWN if after_shutdown else CHECKS

    def register(fn):
        table[phase][fn.__name__] = fn
        return fn

    return register


def _counters() -> dict:
    """This process's counters (run here, or remotely on a worker)."""
    return nbrpc.debug.snapshot(events=1)["counters"]


# ---- main phase ----
@_check("main")
def worker_info_and_default_timeout():
    me = rpc.get_worker_info()
    assert (me.name, me.id) == ("master", 0)
    w2 = rpc.get_worker_info("worker2")
    assert (w2.name, w2.id) == ("worker2", 2)
    assert repr(w2) == "WorkerInfo(id=2, name=worker2)"
    assert rpc.get_rpc_timeout() == 60.0
    w1 = rpc.rpc_sync("worker1", rpc.get_worker_info, timeout=10)  # a WorkerInfo travels
    assert w1 == rpc.get_worker_info("worker1") and w1.name == "worker1"
    assert rpc.rpc_sync(w1, whoami, timeout=10) == "worker1"


@_check("main")
def builtin_functions():
    x, y = torch.arange(4.0), torch.ones(4)
    assert torch.equal(rpc.rpc_sync("worker1", torch.add, args=(x, y)), x + y)
    assert torch.equal(rpc.rpc_sync("worker2", torch.add, args=(x, y), kwargs={"alpha": 3}),
                       x + 3 * y)
    assert rpc.rpc_sync("worker2", divmod, args=(7, 2)) == (3, 1)
    assert rpc.rpc_sync("master", max, args=(3, 9)) == 9  # a call to oneself


@_check("main")
def python_functions_and_kwargs():
    assert rpc.rpc_sync("worker1", _add, args=(2, 3)) == 5
    assert rpc.rpc_sync("worker1", _add, args=(2,), kwargs={"b": 3, "scale": 4}) == 20
    assert rpc.rpc_sync("worker2", _add, kwargs={"a": 1, "b": 1}) == 2
    assert rpc.rpc_sync("worker1", whoami) == "worker1"
    assert rpc.rpc_async("worker2", whoami).wait() == "worker2"
    k = 7
    assert rpc.rpc_sync("worker1", lambda v: v * k, args=(3,)) == 21  # cloudpickle by value


@_check("main")
def destination_as_workerinfo_and_rank():
    w2 = rpc.get_worker_info("worker2")
    assert rpc.rpc_sync(w2, whoami) == "worker2"
    assert rpc.rpc_sync(2, whoami) == "worker2"
    assert rpc.rpc_sync(1, whoami) == "worker1"
    assert rpc.rpc_sync(0, whoami) == "master"
    assert rpc.rpc_async(rpc.get_worker_info("worker1"), whoami).wait() == "worker1"
    assert rpc.remote(w2, whoami).to_here(timeout=10) == "worker2"


@_check("main")
def nested_calls_a_b_c():
    assert rpc.rpc_sync("worker1", _nested, args=(["worker2"],), timeout=20) == [
        "worker1", "worker2"]
    # and back to the caller, whose own pool serves the last hop
    assert rpc.rpc_sync("worker1", _nested, args=(["worker2", "master"],), timeout=20) == [
        "worker1", "worker2", "master"]


@_check("main")
def concurrent_200_rpc_async_wait_all():
    futs = []
    for i in range(200):
        to = NAMES[1 + i % 2]
        if i % 2:
            futs.append(rpc.rpc_async(to, _add, args=(i, 1), timeout=30))
        else:
            futs.append(rpc.rpc_async(to, torch.add, args=(torch.tensor([i]), 1), timeout=30))
    assert all(isinstance(f, torch.futures.Future) for f in futs)
    values = torch.futures.wait_all(futs)
    for i, v in enumerate(values):
        got = v if i % 2 else int(v.item())
        assert got == i + 1, (i, v)


@_check("main")
def then_chains():
    fut = rpc.rpc_async("worker1", _add, args=(1, 2), timeout=20)
    chained = fut.then(lambda f: f.wait() * 10).then(lambda f: f.value() + 1)
    assert chained.wait() == 31
    assert fut.done() and fut.value() == 3
    # .then on a tensor result, as in the tutorials
    t = rpc.rpc_async("worker2", torch.add, args=(torch.ones(2), 1), timeout=20).then(
        lambda f: f.wait() * 2).wait()
    assert torch.equal(t, torch.full((2,), 4.0))
    # an error travels down the chain (torch wraps a callback's error in RuntimeError)
    bad = rpc.rpc_async("worker1", _raise_value_error, args=("chained boom",), timeout=20)
    with pytest.raises((ValueError, RuntimeError), match="chained boom"):
        bad.then(lambda f: f.wait() + 1).wait()


@_check("main")
def collect_all():
    futs = [rpc.rpc_async(NAMES[i % 3], _add, args=(i, i), timeout=20) for i in range(6)]
    done = torch.futures.collect_all(futs).wait()
    assert [f.value() for f in done] == [2 * i for i in range(6)]


@_check("main")
def remote_exceptions_keep_type_message_and_worker():
    with pytest.raises(ValueError, match="boom 42") as ei:
        rpc.rpc_sync("worker1", _raise_value_error, args=("boom 42",))
    e = ei.value
    assert type(e) is ValueError
    assert e.remote_worker == "worker1"
    assert "_raise_value_error" in e.remote_traceback
    assert "boom 42" in e.remote_traceback
    # rpc_async: the future holds the same exception
    fut = rpc.rpc_async("worker2", _raise_value_error, args=("async boom",))
    with pytest.raises(ValueError, match="async boom") as ei:
        fut.wait()
    assert ei.value.remote_worker == "worker2"
    assert fut.done()
    # a user-defined exception class, with its attributes
    with pytest.raises(_CustomError, match="custom") as ei:
        rpc.rpc_sync("worker2", _raise_custom, args=("custom", 17))
    assert ei.value.code == 17 and ei.value.remote_worker == "worker2"
    # through a nested call: still a ValueError
    with pytest.raises(ValueError, match="deep boom"):
        rpc.rpc_sync("worker1", _nested_raise, args=("worker2", "deep boom"), timeout=20)
    # a type that cannot be rebuilt here: RemoteError with the facts
    with pytest.raises(RemoteError) as ei:
        rpc.rpc_sync("worker1", _raise_needs_two_args)
    assert ei.value.worker == "worker1"
    assert ei.value.type_name.endswith("_NeedsTwoArgs")
    assert "left/right" in ei.value.message
    assert isinstance(ei.value, RuntimeError)
    assert rpc.rpc_sync("worker1", _add, args=(1, 1)) == 2  # still usable


@_check("main")
def unpicklable_values_and_base_exceptions_fail_cleanly():
    with pytest.raises(SerializationError):  # an argument: raised at the call
        rpc.rpc_async("worker1", echo, args=(threading.Lock(),))
    with pytest.raises(SerializationError, match="lock"):  # a result: raised by the caller
        rpc.rpc_sync("worker1", _return_lock, timeout=10)
    with pytest.raises(RemoteError) as ei:  # not an Exception: reported, worker survives
        rpc.rpc_sync("worker2", _raise_system_exit, timeout=10)
    assert ei.value.worker == "worker2" and "SystemExit" in ei.value.type_name
    assert rpc.rpc_sync("worker2", _add, args=(1, 1), timeout=10) == 2
    assert rpc.rpc_sync("worker1", _add, args=(1, 1), timeout=10) == 2


@_check("main")
def timeout_raises_fast_and_agent_stays_usable():
    t0 = time.monotonic()
    with pytest.raises(RpcTimeoutError) as ei:
        rpc.rpc_sync("worker1", sleep_then, args=(2.0, "late-sync"), timeout=0.5)
    elapsed = time.monotonic() - t0
    assert 0.4 <= elapsed < 1.5, elapsed
    assert isinstance(ei.value, TimeoutError) and isinstance(ei.value, RuntimeError)
    assert "worker1" in str(ei.value)
    t1 = time.monotonic()
    fut = rpc.rpc_async("worker1", sleep_then, args=(2.0, "late-async"), timeout=0.5)
    with pytest.raises(RpcTimeoutError):
        fut.wait()
    assert time.monotonic() - t1 < 1.5
    # usable at once, while worker1 is still sleeping in two of its threads
    t2 = time.monotonic()
    assert rpc.rpc_sync("worker1", _add, args=(40, 2), timeout=5) == 42
    assert rpc.rpc_sync("worker2", _add, args=(1, 2), timeout=5) == 3
    assert time.monotonic() - t2 < 1.0
    # timeout=0: no timeout at all
    assert rpc.rpc_sync("worker2", sleep_then, args=(0.6, "ok"), timeout=0) == "ok"
    _CTX["late_replies_expected"] = _counters()["late_replies"] + 2
    return {"timeout_elapsed_s": round(elapsed, 3)}


@_check("main")
def unknown_worker_name_lists_known_names():
    with pytest.raises(UnknownWorkerError) as ei:
        rpc.rpc_sync("nobody", whoami)
    msg = str(ei.value)
    assert "nobody" in msg
    for name in NAMES:
        assert name in msg, msg
    assert isinstance(ei.value, RuntimeError)
    with pytest.raises(UnknownWorkerError):
        rpc.rpc_async("nobody", whoami)
    with pytest.raises(UnknownWorkerError):
        rpc.rpc_sync(7, whoami)
    with pytest.raises(UnknownWorkerError):
        rpc.remote("nobody", _Counter)
    with pytest.raises(RuntimeError):
        rpc.get_worker_info("nobody")


@_check("main")
def strided_view_sends_only_its_own_elements():
    # Sizes stay below the shared-memory threshold (large buffers to a local peer skip
    # the socket), so that bytes_sent sees every byte that travels: at least the view's
    # own bytes (the data went over the socket), and not the base storage's.
    x = torch.arange(128 * 256, dtype=torch.float32).reshape(128, 256)  # 128 KiB base
    v = x[:, ::2]
    assert not v.is_contiguous()
    own = v.numel() * v.element_size()  # 64 KiB
    sent0 = _counters()["bytes_sent"]
    info = rpc.rpc_sync("worker1", _receive_info, args=(v,), timeout=20)
    sent = _counters()["bytes_sent"] - sent0
    assert torch.equal(info["value"], v)
    # it arrives with its strides (as in PyTorch), in storage just large enough for them
    span = (1 + sum((n - 1) * st for n, st in zip(v.shape, v.stride()))) * v.element_size()
    assert info["storage_nbytes"] == span and not info["contiguous"], (info, span, own)
    assert own <= sent < own + 4096, (sent, own, x.nbytes)
    ev = [e for e in nbrpc.debug.snapshot(events=20)["events"]
          if e["event"] == "send" and e["peer"] == "worker1"][-1]
    assert own <= ev["nbytes"] < own + 4096, ev
    # a transposed view and a single column also round-trip by value
    assert torch.equal(rpc.rpc_sync("worker2", echo, args=(x.t(),)), x.t())
    col = x[:, 3]
    got = rpc.rpc_sync("worker2", _receive_info, args=(col,))
    assert torch.equal(got["value"], col) and got["storage_nbytes"] == col.numel() * 4
    # a large strided view (shared-memory sized): the receiver still holds only its elements
    big = torch.randn(1024, 1024)  # 4 MiB
    bv = big[::2, ::4]  # 512 KiB of it
    got = rpc.rpc_sync("worker2", _receive_info, args=(bv,), timeout=20)
    assert torch.equal(got["value"], bv)
    assert got["storage_nbytes"] == bv.numel() * 4, got["storage_nbytes"]
    # and in replies: a returned view arrives holding only its own elements
    r = rpc.rpc_sync("worker1", _slice_of_large, timeout=10)
    assert r.tolist() == [float(i) for i in range(10, 20)]
    assert r.untyped_storage().nbytes() == 40
    r = rpc.rpc_sync("worker2", _strided_of_large, timeout=10)
    assert torch.equal(r, torch.arange(512 * 512, dtype=torch.float32).reshape(512, 512)[:, ::8])
    assert r.untyped_storage().nbytes() == r.numel() * 4
    return {"view_bytes": own, "bytes_sent": sent, "base_bytes": x.nbytes}


@_check("main")
def slice_of_large_tensor_sends_only_the_slice():
    big = torch.arange(4_000_000, dtype=torch.float32)  # 16 MB base storage
    s = big[1_000_000:1_000_100]
    assert s.is_contiguous() and s.untyped_storage().nbytes() == big.nbytes
    own = s.numel() * s.element_size()
    sent0 = _counters()["bytes_sent"]
    info = rpc.rpc_sync("worker2", _receive_info, args=(s,), timeout=20)
    sent = _counters()["bytes_sent"] - sent0
    assert torch.equal(info["value"], s)
    assert info["storage_nbytes"] == own
    assert sent < own + 4096, (sent, own, big.nbytes)
    return {"slice_bytes": own, "bytes_sent": sent, "base_bytes": big.nbytes}


@_check("main")
def tensor_dtypes_and_shapes_round_trip():
    cases = [
        torch.randn(3, 4, dtype=torch.float64),
        torch.randn(5).to(torch.float16),
        torch.randn(5).to(torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.arange(-5, 5, dtype=torch.int8),
        torch.randn(4, dtype=torch.complex64),
        torch.tensor(3.5),  # 0-dim
        torch.empty(0, 3),
        torch.ones(1).expand(1000),  # stride 0
        torch.arange(24).reshape(2, 3, 4).permute(2, 0, 1),
    ]
    back = rpc.rpc_sync("worker1", echo, args=(cases,), timeout=20)
    for a, b in zip(cases, back):
        assert a.dtype == b.dtype and a.shape == b.shape, (a, b)
        assert torch.equal(a, b), (a, b)
    p = torch.nn.Parameter(torch.randn(3))
    q = rpc.rpc_sync("worker2", echo, args=(p,))
    assert isinstance(q, torch.nn.Parameter) and q.requires_grad and torch.equal(p, q)


@_check("main")
def arguments_are_copies_even_for_self_calls():
    t = torch.zeros(3)
    rpc.rpc_sync("master", _inplace_add_, args=(t,))
    rpc.rpc_sync("worker1", _inplace_add_, args=(t,))
    assert torch.equal(t, torch.zeros(3))


@_check("main")
def echo_16mb_tensor():
    t = torch.randn(4 * 1024 * 1024)  # 16 MiB of float32
    t0 = time.monotonic()
    back = rpc.rpc_sync("worker2", echo, args=(t,), timeout=30)
    secs = time.monotonic() - t0
    assert back.shape == t.shape and torch.equal(back, t)
    shm = Path("/dev/shm")
    segments = len(list(shm.glob(f"nbrpc-{os.getpid()}-*"))) if shm.is_dir() else None
    return {"echo_16mb_s": round(secs, 3), "own_shm_segments": segments}


@_check("main")
def large_buffers_are_not_reused_while_the_receiver_holds_them():
    # Same-size large tensors, one after another, each kept alive by the receiver:
    # a recycled buffer must never overwrite one that is still in use.
    n = 512 * 1024  # 2 MiB of float32 each
    sent = [torch.full((n,), float(i)) for i in range(6)]
    for t in sent:
        assert rpc.rpc_sync("worker2", _keep, args=(t,), timeout=20) == float(t[0]) * n
    kept = rpc.rpc_sync("worker2", _kept, timeout=20)
    assert len(kept) == len(sent)
    for a, b in zip(sent, kept):
        assert torch.equal(a, b), (float(a[0]), b.unique()[:5])
    # and concurrently, in both directions
    futs = [rpc.rpc_async(NAMES[1 + i % 2], echo, args=(torch.full((n,), float(i)),),
                          timeout=20) for i in range(12)]
    for i, back in enumerate(torch.futures.wait_all(futs)):
        assert torch.equal(back, torch.full((n,), float(i))), i
    # the sender's tensor may change right after the call returns; the receiver's may not
    t = torch.zeros(n)
    fut = rpc.rpc_async("worker1", _sleep_then_sum, args=(t, 0.2), timeout=20)
    t.fill_(1.0)
    assert fut.wait() == 0.0
    rpc.rpc_sync("worker2", _kept, kwargs={"clear": True}, timeout=20)


@_check("main")
def async_execution_nested_rpc_then():
    ones = torch.ones(2)
    ret = rpc.rpc_sync("worker1", _async_add_chained, args=("worker2", ones, 1, 1), timeout=20)
    assert torch.equal(ret, torch.full((2,), 3.0))
    ret = rpc.rpc_async("worker2", _async_add_chained, args=("master", ones, 2, 1),
                        timeout=20).wait()
    assert torch.equal(ret, torch.full((2,), 4.0))
    ret = rpc.rpc_sync("worker1", _AsyncExecutionClass.static_async_add,
                       args=("worker2", ones, 1, 2), timeout=20)
    assert torch.equal(ret, torch.full((2,), 4.0))
    ret = rpc.rpc_sync("worker1", _AsyncExecutionClass.class_async_add,
                       args=("worker2", ones, 1, 2), timeout=20)
    assert torch.equal(ret, torch.full((2,), 4.0))
    with pytest.raises(ValueError, match="async failure"):
        rpc.rpc_sync("worker1", _async_fail, args=("async failure",), timeout=20)


@_check("main")
def async_execution_through_remote():
    # torch.distributed.rpc runs an @async_execution function given to remote() the
    # same way: the RRef holds the future's value, not the future.
    rref = rpc.remote("worker1", _async_add_chained, args=("worker2", torch.ones(2), 1, 1))
    assert torch.equal(rref.to_here(timeout=20), torch.full((2,), 3.0))


@_check("main")
def async_execution_through_rref_proxy():
    # PyTorch's documented example: rref.rpc_sync().static_async_add(...)
    rref = rpc.remote("worker1", _AsyncExecutionClass)
    ret = rref.rpc_sync(timeout=20).static_async_add("worker2", torch.ones(2), 1, 2)
    assert torch.equal(ret, torch.full((2,), 4.0))


@_check("main")
def remote_to_here_and_rref_method_calls():
    rref = rpc.remote("worker1", _Counter, args=(5,))
    assert rref.owner() == rpc.get_worker_info("worker1")
    assert rref.owner_name() == "worker1" and not rref.is_owner()
    assert rref.rpc_sync().add(3) == 8
    assert rref.rpc_async().add(2).wait() == 10
    assert rref.remote().get().to_here(timeout=10) == 10
    copy = rref.to_here(timeout=10)
    assert isinstance(copy, _Counter) and copy.value == 10
    copy.add(100)  # a copy: the owner's value does not move
    assert rref.rpc_sync().get() == 10
    r2 = rpc.remote("worker2", torch.add, args=(torch.ones(2), 1))
    assert torch.equal(r2.to_here(timeout=10), torch.full((2,), 2.0))
    r3 = rpc.remote("worker1", _raise_value_error, args=("rref boom",))
    with pytest.raises(ValueError, match="rref boom"):
        r3.to_here(timeout=10)
    mine = rpc.remote("master", _Counter, args=(1,))
    assert mine.is_owner() and mine.rpc_sync().add(1) == 2
    assert mine.local_value().value == 2


@_check("main")
def tampered_messages_are_dropped():
    members = nbrpc.debug.snapshot(events=1)["members"]
    address = next(m["address"] for m in members if m["name"] == "worker1")
    before = rpc.rpc_sync("worker1", _counters, timeout=10)["dropped"]
    marker = Path(tempfile.gettempdir()) / f"nbrpc-tamper-{os.getpid()}-{time.time_ns()}"
    payload, buffers = dumps(Call(_touch, (str(marker),), {}))
    assert not buffers
    key = current_agent()._key  # the group key, to forge a message that was signed
    forged = pack(b"\x00" * 32, REQUEST, 0, 10**9, payload)  # signed with a wrong key
    signed = pack(key, REQUEST, 0, 10**9 + 1, payload)
    flipped = bytearray(signed[0])  # the head frame: signature ‖ header ‖ payload
    flipped[-len(payload) // 2] ^= 0xFF
    tampered_payload = [bytes(flipped)]  # payload changed in flight
    header = bytearray(signed[0])
    header[SIG_LEN + 12] ^= 0x01  # message id changed in flight
    tampered_header = [bytes(header)]
    truncated = [b"not a message"]
    harmless, _ = dumps(Call(_add, (1, 1), {}))
    recorded = pack(key, REQUEST, 0, 10**9 + 2, harmless, incarnation=77, seq=1,
                    dest=1, run=current_agent().io.run)  # (to worker1, in this run)
    bad = [forged, tampered_payload, tampered_header, truncated, recorded, recorded]
    want = {"bad signature": 3, "framing": 1, "replayed": 1}  # the first `recorded` is served
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.PLAIN_USERNAME, b"nbrpc")  # past the handshake (a sniffed token)
        sock.setsockopt(zmq.PLAIN_PASSWORD, connect_token(key))
        sock.connect(address)
        for frames in bad:
            sock.send_multipart(frames)
        got = poll_or_fail(lambda: (c := rpc.rpc_sync("worker1", _counters, timeout=10))[
            "dropped"] == _plus(before, want) and c, 5.0,
            "worker1 to count the dropped messages by reason")
        sock.close()
    finally:
        ctx.term()
    # The served `recorded` went out in rank 0's name: its answer is a stray reply here,
    # and rank 0's books count it as sent (else the shutdown's sums never balance).
    caller = current_agent().caller
    with caller.lock:
        caller.sent_to[1] += 1
    if "late_replies_expected" in _CTX:
        _CTX["late_replies_expected"] += 1
    time.sleep(0.1)  # a negative check: a message wrongly run would have written it by now
    assert not marker.exists(), "a tampered message was executed"
    assert rpc.rpc_sync("worker1", _add, args=(2, 2), timeout=10) == 4
    assert rpc.rpc_sync("worker1", _counters, timeout=10)["dropped"] == got["dropped"]


def _plus(counts: dict, more: dict) -> dict:
    return {k: counts.get(k, 0) + more.get(k, 0) for k in {*counts, *more}}


@_check("main")
def snapshot_events_zero_returns_no_events():
    rpc.rpc_sync("worker1", _add, args=(1, 1))
    assert nbrpc.debug.snapshot(events=1)["events"]  # there are events
    assert nbrpc.debug.snapshot(events=0)["events"] == []


@_check("main")
def init_rpc_twice_is_refused():
    with pytest.raises(AlreadyInitializedError):
        rpc.init_rpc("master", rank=0, world_size=WORLD)
    assert rpc.rpc_sync("worker1", whoami, timeout=10) == "worker1"  # still the same agent


@_check("main")
def late_replies_are_discarded():
    # runs last: the two timed-out calls above sleep 2 s; their replies come late (and
    # the forged request that tampered_messages_are_dropped had served was answered here)
    want = _CTX.get("late_replies_expected")
    assert want is not None, "the timeout check did not run"
    c = poll_or_fail(lambda: (c := _counters())["late_replies"] >= want and c, 5.0,
              "the late replies of the timed-out calls")
    assert c["late_replies"] == want, c
    assert c["in_flight"] == 0, c
    assert c["timeouts"] >= 2, c
    assert rpc.rpc_sync("worker1", _add, args=(5, 5), timeout=5) == 10


# ---- reinit phase: same port, num_worker_threads=2, rpc_timeout=20 ----
@_check("reinit")
def reinit_binds_the_same_port_again():
    snap = nbrpc.debug.snapshot(events=1)
    assert snap["address"].endswith(f":{_CTX['port']}"), snap["address"]
    assert [m["name"] for m in snap["members"]] == NAMES
    assert snap["counters"]["requests_sent"] == 0  # a fresh agent
    for name in NAMES:
        assert rpc.rpc_sync(name, whoami, timeout=10) == name


@_check("reinit")
def backend_options_are_honoured():
    assert rpc.get_rpc_timeout() == 20.0
    for name in NAMES[1:]:
        assert rpc.rpc_sync(name, rpc.get_rpc_timeout, timeout=10) == 20.0


@_check("reinit")
def async_execution_chain_deeper_than_the_pool():
    hops = ["worker2", "master", "worker1"] * 4  # 12 levels, 4 on each worker, 2 threads each
    futs = [rpc.rpc_async("worker1", _async_chain, args=(hops, 100 * i), timeout=20)
            for i in range(4)]  # and 4 chains at once: 16 levels pending per worker
    values = torch.futures.wait_all(futs)
    assert values == [100 * i + len(hops) for i in range(4)]
    for snap in nbrpc.debug.gather(events=1, timeout=10):
        assert snap["counters"]["threads"] <= 2, (snap["name"], snap["counters"])


# ---- tcp:// and file:// ----
@_check("tcp")
def tcp_init_method():
    snap = nbrpc.debug.snapshot(events=1)
    assert snap["address"].endswith(f":{_CTX['port2']}"), snap["address"]
    assert [m["name"] for m in snap["members"]] == NAMES
    for name in NAMES:
        assert rpc.rpc_sync(name, whoami, timeout=10) == name
    assert rpc.rpc_sync("worker1", _nested, args=(["worker2"],), timeout=10) == [
        "worker1", "worker2"]


@_check("tcp", on_workers=True)
def calls_keep_working_while_master_shuts_down():
    # rank 0 has nothing left to do and calls shutdown() at once; graceful shutdown
    # must let these calls (to it and between the workers) complete.
    me = rpc.get_worker_info().name
    other = "worker2" if me == "worker1" else "worker1"
    assert _CTX["master_shutting_down"].wait(20), "rank 0 never called shutdown()"
    for i in range(20):
        assert rpc.rpc_sync("master", _add, args=(i, 1), timeout=10) == i + 1
        assert rpc.rpc_sync(other, whoami, timeout=10) == other
        rref = rpc.remote("master", _Counter, args=(i,))
        assert rref.rpc_sync(timeout=10).add(1) == i + 1
        time.sleep(0.01)  # deliberate: spreads the calls over rank 0's shutdown


@_check("file")
def file_init_method():
    record = Path(_CTX["file_path"] + ".nbrpc")  # (beside c10d's FileStore file)
    # a static group's rendezvous record loses its address once everyone has
    # joined, so a re-init with the same path can never read it; it says only
    # that a static group runs there (a dynamic joiner is refused)
    assert json.loads(record.read_text())["static"] is True
    assert "address" not in record.read_text() and "key" not in record.read_text()
    for name in NAMES:
        assert rpc.rpc_sync(name, whoami, timeout=10) == name
    assert rpc.rpc_sync("worker2", _nested, args=(["worker1"],), timeout=10) == [
        "worker2", "worker1"]


@_check("main", after_shutdown=True)
def calls_after_shutdown_raise_not_initialized():
    with pytest.raises(NotInitializedError):
        rpc.rpc_sync("worker1", whoami)
    with pytest.raises(RuntimeError):
        rpc.get_worker_info()
    rpc.shutdown()  # a second shutdown is a no-op in nbrpc


@_check("file", after_shutdown=True)
def rendezvous_file_removed_by_shutdown():
    assert not Path(_CTX["file_path"] + ".nbrpc").exists()


@_check("file_again")
def reinit_with_the_same_file_path():
    # Rank 0 deletes the rendezvous file only after its agent has stopped. Here its
    # shutdown was slowed by 1 s at that point (_slow_unlink), as a loaded machine does:
    # ranks 1 and 2, already through shutdown, call init_rpc again with the same file
    # and must not join the dead address still written in it.
    for name in NAMES:
        assert rpc.rpc_sync(name, whoami, timeout=10) == name


def _final(fn):
    FINAL[fn.__name__] = fn
    return fn


@_final
def failed_file_init_removes_its_rendezvous_file():
    # rank 0 alone in a world of 2: nobody joins, init_rpc must fail in time, and must
    # not leave its published address behind for the next run's ranks to join.
    path = Path(_CTX["file_path"] + ".lonely")
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"file://{path}", rpc_timeout=0.5)
    t0 = time.monotonic()
    with pytest.raises(RendezvousError):
        rpc.init_rpc("lonely", rank=0, world_size=2, rpc_backend_options=opts)
    assert time.monotonic() - t0 < 3.0
    record = Path(f"{path}.nbrpc")  # beside c10d's FileStore file, if any
    assert not record.exists(), f"left behind: {record.read_text()}"


@contextmanager
def _slow_unlink(path: str, delay: float):
    """Delay os.unlink(path) (only that path) by ``delay`` seconds."""
    real = os.unlink

    def slow(p, *args, **kwargs):
        if str(p) == path:
            time.sleep(delay)  # deliberate: the slow machine this stands for
        return real(p, *args, **kwargs)

    os.unlink = slow
    try:
        yield
    finally:
        os.unlink = real


def _phase_options(phase: str) -> Any:
    if phase == "main":
        return None  # env:// with MASTER_ADDR/MASTER_PORT, all defaults
    if phase == "reinit":
        return rpc.TensorPipeRpcBackendOptions(num_worker_threads=2, rpc_timeout=20)
    if phase == "tcp":
        return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{_CTX['port2']}")
    if phase == "file":  # PyTorch's own options class is accepted too
        import torch.distributed.rpc as torch_rpc

        return torch_rpc.TensorPipeRpcBackendOptions(init_method=f"file://{_CTX['file_path']}")
    if phase == "file_again":
        return rpc.TensorPipeRpcBackendOptions(init_method=f"file://{_CTX['file_path']}",
                                               rpc_timeout=SOFT_INIT_PHASES[phase])
    raise ValueError(phase)


# -- the spawned process -------------------------------------------------------------------
def _child(rank: int, world: str, port: int, results: Any, shared: dict) -> None:
    with child(rank, world, port, results) as report:
        file_path = shared["file_path"]
        _CTX.update(port=port, port2=shared["port2"], file_path=file_path,
                    master_shutting_down=shared["master_shutting_down"])

        def run(phase: str, checks: dict) -> None:
            for name, fn in checks.items():
                report.attempt(phase, name, fn)

        for phase in PHASES:
            faulthandler.dump_traceback_later(PHASE_WATCHDOG_S, exit=True)
            checks = CHECKS[phase] if rank == 0 else {
                f"{name}@rank{rank}": fn for name, fn in WORKER_CHECKS[phase].items()}
            t0 = time.monotonic()
            try:
                rpc.init_rpc(NAMES[rank], rank=rank, world_size=WORLD,
                             rpc_backend_options=_phase_options(phase))
            except Exception:
                if phase not in SOFT_INIT_PHASES:
                    raise
                error = f"init_rpc failed on rank {rank}:\n{traceback.format_exc()}"
                report.write(phase, "<init failed>", ok=False, error=error)
                for name in checks:
                    report.write(phase, name, ok=False, error=error)
                continue
            report.write(phase, "<init>", secs=time.monotonic() - t0, pid=os.getpid())
            run(phase, checks)
            t2 = time.monotonic()
            if phase == "file" and rank == 0:
                with _slow_unlink(file_path + ".nbrpc", 1.0):
                    rpc.shutdown()
            elif phase == "tcp" and rank == 0:
                _CTX["master_shutting_down"].set()  # (the workers' calls start now)
                rpc.shutdown()
            else:
                rpc.shutdown()
            report.write(phase, "<shutdown>", secs=time.monotonic() - t2)
            if rank == 0:
                run(phase, AFTER_SHUTDOWN[phase])
        if rank == 0:
            faulthandler.dump_traceback_later(PHASE_WATCHDOG_S, exit=True)
            run("final", FINAL)


# -- the parent side -----------------------------------------------------------------------
# every phase and the final checks within their watchdogs, and the spawn
WORLD_TIMEOUT_S = (len(PHASES) + 1) * PHASE_WATCHDOG_S + 30.0


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> World:
    """The one world, spawned by the first test that asks for it."""
    file_path = str(tmp_path_factory.mktemp("script_mode") / "rendezvous")
    return run_world("script", _child, WORLD, WORLD_TIMEOUT_S,
                     lambda ctx, port2: {"port2": port2, "file_path": file_path,
                                         "master_shutting_down": ctx.Event()}, ports=2)


# Checks expected to fail because of a known nbrpc bug: name -> reason (strict xfail).
KNOWN_BUGS: dict[str, str] = {}


def _params():
    """(phase, check, the rank that runs it): rank 0's checks, then the workers'."""
    for phase in PHASES:
        names = [(name, 0) for name in [*CHECKS[phase], *AFTER_SHUTDOWN[phase]]] + [
            (f"{name}@rank{r}", r) for name in WORKER_CHECKS[phase] for r in range(1, WORLD)]
        for name, rank in names:
            marks = ()
            if name in KNOWN_BUGS:
                marks = pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[name])
            yield pytest.param(phase, name, rank, id=f"{phase}-{name}", marks=marks)
    for name in FINAL:
        marks = pytest.mark.xfail(strict=True, reason=KNOWN_BUGS[name]) if name in KNOWN_BUGS else ()
        yield pytest.param("final", name, 0, id=f"final-{name}", marks=marks)


@pytest.mark.parametrize("phase,name,rank", list(_params()))
def test_check(world: World, phase: str, name: str, rank: int) -> None:
    world.ok(phase, name, rank)


def test_every_process_exits_cleanly(world: World) -> None:
    crashes = [r["error"] for r in world.rows if r["name"] == "<crash>"]
    assert world.exitcodes == [0] * WORLD, (world.exitcodes, crashes)
    for phase in set(PHASES) - set(SOFT_INIT_PHASES):
        for rank in range(WORLD):
            for what in ("<init>", "<shutdown>"):
                world.ok(phase, what, rank)


def test_no_shared_memory_segment_left_behind(world: World) -> None:
    pids = {r["pid"] for r in world.rows if r.get("pid")}
    assert len(pids) == WORLD
    shm_dir = Path("/dev/shm")
    if not shm_dir.is_dir():
        pytest.skip("no /dev/shm")
    left = [p.name for p in shm_dir.iterdir()
            if any(p.name.startswith(f"nbrpc-{pid}-") for pid in pids)]
    assert not left, left
