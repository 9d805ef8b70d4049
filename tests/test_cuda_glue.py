"""The CUDA data path's Python (``nbrpc.serialize.cuda``) where there is no GPU:
its device primitives (pinned memory, stream waits, copies onto a device, the
IPC handle and its opening) are stood in for by CPU ones, and everything
around them runs for real: the choice of route by where the peer runs, the
pickled form, the in-process hand-off table, autograd's metadata, the counts.

What this cannot check, CUDA itself (streams, events, IPC, copies), is
``tests/test_cuda.py``'s, on a machine with a GPU (``make test-gpu``).
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from nbrpc.serialize import cuda, dumps, loads, pickler


class Sent:
    """A tensor pickled as a CUDA tensor bound for ``target`` would be (the
    reducer calls ``cuda.reduce`` as ``_reduce_tensor`` does for one)."""

    def __init__(self, t: torch.Tensor, target: str) -> None:
        self.t, self.target = t, target

    def __reduce__(self) -> tuple:
        return cuda.reduce(self.t, self.target, pickler.current_context(), pickler._reduce_cpu)


class Message:
    """A message's context, as the reducers see it."""

    maps_cpu = False
    tag = stash = None

    def __init__(self, place: str) -> None:
        self.place = place
        self.undo: list = []

    def peer_place(self) -> str:
        return self.place

    def on_unsent(self, fn) -> None:
        self.undo.append(fn)


@pytest.fixture
def device(monkeypatch) -> dict[str, list]:
    """CPU stand-ins for the device primitives; what they were asked, by name."""
    seen: dict[str, list] = {"wait": [], "copy": [], "onto": [], "share": [], "open": []}
    shared: dict[int, torch.Tensor] = {}
    ids = itertools.count()

    def copy_onto(src: torch.Tensor, dev: str) -> torch.Tensor:
        seen["copy"].append(dev)
        return src.clone()

    def share(d: torch.Tensor) -> tuple:
        key = next(ids)
        shared[key] = d  # the sender's memory, as the handle names it
        seen["share"].append(key)
        return (key, d.dtype)

    def open_(args: tuple) -> torch.Tensor:
        seen["open"].append(args[0])
        return shared.pop(args[0])

    monkeypatch.setattr(cuda, "_pinned", lambda d: torch.empty(d.shape, dtype=d.dtype))
    monkeypatch.setattr(cuda, "_wait", lambda dev: seen["wait"].append(str(dev)))
    monkeypatch.setattr(cuda, "_copy_onto", copy_onto)
    monkeypatch.setattr(cuda, "_share", share)
    monkeypatch.setattr(cuda, "_open", open_)
    monkeypatch.setattr(pickler, "_onto", lambda t, dev: seen["onto"].append(dev) or t.clone())
    monkeypatch.setattr(cuda, "counts", dict.fromkeys(cuda.counts, 0))
    monkeypatch.setattr(cuda, "no_ipc", None)  # (whatever NBRPC_CUDA_IPC says here)
    seen["shared"] = shared  # type: ignore[assignment]
    return seen


def _round_trip(value: Any, place: str) -> Any:
    return loads(*dumps(value, Message(place)), Message(place))


@pytest.mark.parametrize("place, route", [("remote", "staged"), ("host", "ipc"),
                                          ("process", "in-process")])
def test_each_place_takes_its_route_and_the_tensor_arrives_whole(device, place, route) -> None:
    x = torch.arange(12.0).reshape(3, 4)
    got = _round_trip({"x": Sent(x, "cuda:1"), "view": Sent(x.t(), "cuda:1")}, place)
    assert torch.equal(got["x"], x) and torch.equal(got["view"], x.t())
    assert cuda.counts[route] == 2 and sum(cuda.counts.values()) == 2
    if route == "staged":  # through host memory, copied onto cuda:1 on arrival
        assert device["onto"] == ["cuda:1", "cuda:1"] and device["copy"] == []
        assert device["wait"] == ["cpu", "cpu"]  # the sender's stream, before the copy out
    elif route == "ipc":  # each handle opened once, copied into the receiver's memory
        assert device["open"] == device["share"] and len(device["share"]) == 2
        assert device["copy"] == ["cuda:1", "cuda:1"] and not device["shared"]
    else:  # copied on the sender, taken from the table by the receiver
        assert device["copy"] == ["cuda:1", "cuda:1"] and not cuda._handoffs


def test_a_tensor_bound_for_the_cpu_is_staged_whatever_the_place(device) -> None:
    x = torch.ones(3)
    for place in ("remote", "host", "process"):
        assert torch.equal(_round_trip(Sent(x, "cpu"), place), x)
    assert cuda.counts["staged"] == 3 and device["onto"] == [] and device["share"] == []


@pytest.mark.parametrize("place", ["remote", "host", "process"])
def test_parameters_and_requires_grad_survive_every_route(device, place) -> None:
    p = torch.nn.Parameter(torch.ones(2, 2))
    w = torch.ones(3, requires_grad=True)
    got = _round_trip([Sent(p, "cuda:0"), Sent(w, "cuda:0")], place)
    assert type(got[0]) is torch.nn.Parameter and got[0].requires_grad
    assert got[1].requires_grad and got[1].grad_fn is None  # a leaf, as on the sender


def test_an_unsent_hand_off_is_taken_back_and_a_second_delivery_is_refused(device) -> None:
    msg = Message("process")
    payload, buffers = dumps(Sent(torch.ones(2), "cuda:0"), msg)
    assert len(cuda._handoffs) == 1
    for undo in msg.undo:  # the message was never sent
        undo()
    assert not cuda._handoffs
    payload, buffers = dumps(Sent(torch.ones(2), "cuda:0"), Message("process"))
    loads(payload, buffers)
    with pytest.raises(RuntimeError, match="taken already or dropped"):
        loads(payload, buffers)


def test_a_trace_shows_the_cuda_bytes_each_message_carried_and_by_which_route(
        device, trio_default) -> None:
    """Real agents (in one process: the hand-off route), the device stood in
    for: the request's CUDA bytes are noted on its message and summed in the
    trace's text; a message without any is left as it was."""
    from nbrpc import debug

    a, _, _ = trio_default
    x = torch.ones(256)  # 1 KiB
    with debug.trace() as t:
        got = a.rpc_sync("b", torch.clone, (Sent(x, "cuda:0"),))
        a.rpc_sync("b", torch.clone, (x,))
    assert torch.equal(got, x)
    request, plain = (m for m in t.messages if m["kind"] == "call")
    assert request["cuda"] == {"in-process": 1024} and "cuda" not in plain
    assert "  CUDA tensors: 1.0 KiB handed over in-process" in str(t).splitlines()


def test_the_cuda_routes_read_back_from_the_event_log() -> None:
    from nbrpc import debug

    entry = lambda t, event, peer, detail="abs": (100.0 + t, event, "call", peer, 7, 10,  # noqa: E731
                                                  0.01, detail)
    t = debug.Trace(workers=["a", "b"], start=100.0, duration=0.5,
                    _offsets={"a": 0.0, "b": 0.0})
    t._build({"a": [entry(0.1, "send", "b"), entry(0.1, "cuda", "b", "ipc=67108864"),
                    entry(0.3, "recv", "b")],
              "b": [entry(0.2, "serve", "a"), entry(0.2, "cuda", "a", "staged=8")]})
    call_, reply = t.messages
    assert call_["cuda"] == {"ipc": 64 << 20} and reply["cuda"] == {"staged": 8}
    assert ("  CUDA tensors: 64.0 MiB by CUDA IPC, 8 B staged through host memory"
            in str(t).splitlines())
    from nbrpc.jupyter.trace_view import _field, trace_svg

    assert _field("cuda", reply["cuda"]) == "8 B staged through host memory"  # (its panel)
    assert "CUDA tensors: 64.0 MiB by CUDA IPC" in trace_svg(t)  # (its arrow's tooltip)


def test_a_process_that_cannot_export_ipc_handles_stages_and_says_so_once(
        device, monkeypatch, caplog) -> None:
    """An allocator that cannot export CUDA IPC handles (cudaMallocAsync, for
    one) makes the sender stage through host memory, from then on, with one
    warning; the tensor still arrives whole."""
    def cannot(d: torch.Tensor) -> tuple:
        device["share"].append("refused")
        raise RuntimeError("cudaMallocAsync does not yet support shareIpcHandle")

    monkeypatch.setattr(cuda, "_share", cannot)
    x = torch.arange(4.0)
    with caplog.at_level("WARNING", logger="nbrpc.serialize.cuda"):
        for _ in range(3):
            assert torch.equal(_round_trip(Sent(x, "cuda:0"), "host"), x)
    assert device["share"] == ["refused"]  # asked once, not again
    assert cuda.counts == {"ipc": 0, "staged": 3, "in-process": 0}
    assert device["onto"] == ["cuda:0"] * 3
    assert [r.getMessage() for r in caplog.records] == [
        "nbrpc: this process cannot share CUDA memory by IPC (RuntimeError: cudaMallocAsync "
        "does not yet support shareIpcHandle); CUDA tensors to processes on this host go "
        "through host memory instead"]


def test_a_receiver_that_cannot_open_an_ipc_handle_names_the_fix(device, monkeypatch) -> None:
    """Where processes of one host cannot share GPU memory, the receiver's
    error says so and how to send through host memory instead."""
    from nbrpc.errors import SerializationError

    def cannot(args: tuple) -> torch.Tensor:
        raise RuntimeError("CUDA error: invalid device context")

    monkeypatch.setattr(cuda, "_open", cannot)
    with pytest.raises(SerializationError, match=r"CUDA IPC \(RuntimeError: CUDA error: invalid "
                       r"device context\)\..*set NBRPC_CUDA_IPC=0 in every worker's environment"):
        _round_trip(Sent(torch.ones(2), "cuda:0"), "host")
