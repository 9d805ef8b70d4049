"""CUDA tensors in messages, moved along the group's device maps.

Where each tensor lands is decided before this module, by the message's
device map (:func:`nbrpc.agent.devices.target_device`, PyTorch's rules and
errors). This module moves it there, by the cheapest way that is safe for
where the receiver runs (``ctx.peer_place()``):

* **To another host, or to a receiver's CPU:** staged through pinned host
  memory on the sender, carried as a CPU tensor (signed, size-checked and
  counted like any other), and copied onto the mapped device on arrival.
* **To another process on this host:** CUDA IPC through PyTorch's own handles
  (``torch.multiprocessing``'s ``reduce_tensor``), which travel only inside
  signed messages. The receiver opens the sender's memory, waits for the
  event the sender recorded on its current stream as the message was
  pickled, copies into memory it owns on the mapped device, waits for that
  copy, and lets the handle go. PyTorch's IPC reference counter keeps the
  sender's block from being reused until then, even if the sender drops its
  tensor first.
* **Within this process** (a call to itself, or agents sharing a process):
  a copy on the mapped device, handed over through a process-local table.

Every copy has completed before the receiver's code sees the tensor, so it is
ready on whatever stream reads it next. ``NBRPC_CUDA_IPC=0`` stages through
host memory between processes on one host too (for comparison).

Nothing here runs on a machine without CUDA: only a CUDA tensor leads here.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch

from ..errors import SerializationError
from .pickler import finish_tensor, grad_meta

log = logging.getLogger(__name__)

HANDOFF_MAX = 4096  # copies waiting for their receiver in this process, at most

# how many tensors went each way, in this process (for traces and benchmarks)
counts = {"ipc": 0, "staged": 0, "in-process": 0}


# Why this process does not share CUDA memory by IPC, or None where it does: it
# then stages through host memory. NBRPC_CUDA_IPC=0, or the first failure to
# export a handle (an allocator that cannot, e.g. PYTORCH_CUDA_ALLOC_CONF=
# backend:cudaMallocAsync), which is warned of once.
no_ipc: str | None = ("NBRPC_CUDA_IPC=0" if os.environ.get("NBRPC_CUDA_IPC", "1") == "0"
                      else None)


def reduce(t: torch.Tensor, target: str, ctx: Any,
           reduce_cpu: Callable[..., tuple]) -> tuple:
    """Pickle the CUDA tensor ``t`` to land on ``target`` (``"cpu"`` or
    ``"cuda:N"``, the receiver's device) at the peer of ``ctx``."""
    place = ctx.peer_place()
    route = ("staged" if target == "cpu" else "in-process" if place == "process"
             else "ipc" if place == "host" and no_ipc is None else "staged")
    if route == "ipc":
        try:
            reduced = _reduce_ipc(t, target)
        except RuntimeError as e:  # it cannot export a handle: stage, now and from now on
            _give_up_ipc(e)
            route = "staged"
        else:
            _count(ctx, route, t)
            return reduced
    _count(ctx, route, t)
    if route == "in-process":
        return _reduce_handoff(t, target, ctx)
    return reduce_cpu(t, to_host(t), None if target == "cpu" else target)


def _count(ctx: Any, route: str, t: torch.Tensor) -> None:
    counts[route] += 1
    note = getattr(ctx, "note_cuda", None)
    if note is not None:
        note(route, t.element_size() * t.nelement())


def _give_up_ipc(e: BaseException) -> None:
    global no_ipc
    if no_ipc is None:
        no_ipc = f"{type(e).__name__}: {e}"
        log.warning("nbrpc: this process cannot share CUDA memory by IPC (%s); CUDA tensors "
                    "to processes on this host go through host memory instead", no_ipc)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in pinned host memory, copied once the work queued on
    the current stream (which made ``t``) is done; complete on return."""
    d = t.detach()
    host = _pinned(d)
    host.copy_(d, non_blocking=True)
    _wait(d.device)
    return host


# -- the device primitives (a test stands in for them where there is no GPU) -------
def _pinned(d: torch.Tensor) -> torch.Tensor:
    return torch.empty(d.shape, dtype=d.dtype, pin_memory=True)


def _wait(device: torch.device | str) -> None:
    """Until the work queued on ``device``'s current stream is done."""
    torch.cuda.current_stream(torch.device(device)).synchronize()


def _copy_onto(src: torch.Tensor, device: str) -> torch.Tensor:
    """A copy of ``src`` in memory of its own on ``device``, complete on return."""
    dev = torch.device(device)
    with torch.cuda.device(dev):
        out = torch.empty_like(src, device=dev)
        out.copy_(src)
        _wait(dev)
    return out


def _share(d: torch.Tensor) -> tuple:
    """PyTorch's IPC handle of ``d``'s memory (``torch.multiprocessing``'s
    reduction; it records an event on the current stream)."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(d)[1]


def _open(args: tuple) -> torch.Tensor:
    """The sender's tensor, mapped here; the current stream waits for its event."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(*args)


# -- CUDA IPC --------------------------------------------------------------------
def _reduce_ipc(t: torch.Tensor, target: str) -> tuple:
    return _rebuild_ipc, (_share(t.detach()), target, *grad_meta(t))


def _rebuild_ipc(args: tuple, target: str, requires_grad: bool, is_param: bool,
                 token: Any) -> torch.Tensor:
    try:
        src = _open(args)
    except RuntimeError as e:
        raise SerializationError(
            f"could not open a CUDA tensor that another process on this host sent by CUDA "
            f"IPC ({type(e).__name__}: {e}). Where processes of one host cannot share GPU "
            "memory (containers, a GPU in exclusive-process mode, a driver without IPC), "
            "set NBRPC_CUDA_IPC=0 in every worker's environment to send CUDA tensors "
            "through host memory instead.") from e
    out = _copy_onto(src, target)
    del src  # the sender's block may be reused from here
    return finish_tensor(out, requires_grad, is_param, token)


# -- within this process -----------------------------------------------------------
_handoffs: OrderedDict[int, torch.Tensor] = OrderedDict()
_handoff_lock = threading.Lock()
_handoff_ids = itertools.count()


def _reduce_handoff(t: torch.Tensor, target: str, ctx: Any) -> tuple:
    d = t.detach()
    _wait(d.device)  # what made it, first
    copy = _copy_onto(d, target)
    key = next(_handoff_ids)
    with _handoff_lock:
        _handoffs[key] = copy
        while len(_handoffs) > HANDOFF_MAX:  # receivers that never came (bounded)
            _handoffs.popitem(last=False)
            log.warning("nbrpc: dropped a CUDA tensor no receiver in this process took "
                        "(more than %d waiting)", HANDOFF_MAX)
    ctx.on_unsent(lambda: _take(key))
    return _rebuild_handoff, (key, *grad_meta(t))


def _take(key: int) -> torch.Tensor | None:
    with _handoff_lock:
        return _handoffs.pop(key, None)


def _rebuild_handoff(key: int, requires_grad: bool, is_param: bool, token: Any
                     ) -> torch.Tensor:
    t = _take(key)
    if t is None:
        raise RuntimeError("nbrpc: a CUDA tensor sent within this process was taken already "
                           "or dropped (a message delivered twice?)")
    return finish_tensor(t, requires_grad, is_param, token)
