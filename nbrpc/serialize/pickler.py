"""Pickling for messages: cloudpickle, with tensors carried out of band.

Pure functions and a small registry; no sockets, no agent.

* Functions and classes defined in ``__main__`` (a notebook cell, a script)
  are pickled by value, importable ones by reference (cloudpickle's rule).
* A CPU tensor becomes a pickle-protocol-5 out-of-band buffer holding exactly
  its own elements: a contiguous tensor (or a contiguous slice of a larger
  storage) is exported without a copy; a strided view is made contiguous
  first, so the receiver never gets the whole base storage.
* Upper layers (RRefs, distributed autograd) register reducers for their own
  types with :func:`register_reducer`; while a message is pickled or
  unpickled, :func:`current_context` returns what the agent passed in, so a
  reducer knows the agent and the peer without this module importing them.
"""

from __future__ import annotations

import contextvars
import io
import pickle
import types
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np
import torch

from ..errors import SerializationError

PROTOCOL = 5

# type -> reducer(obj) returning a (callable, args) pair, as for copyreg.
# Populated at import by the layers that own the types (documented, not hidden).
_REDUCERS: dict[type, Callable[[Any], tuple]] = {}
_context: contextvars.ContextVar[Any] = contextvars.ContextVar("nbrpc_pickle_ctx", default=None)


def register_reducer(cls: type, reducer: Callable[[Any], tuple]) -> None:
    """Pickle exact instances of ``cls`` with ``reducer(obj) -> (fn, args)``."""
    _REDUCERS[cls] = reducer


class _GradHooks:
    """Set by the autograd layer: ``on_send(tensor, context)`` is called for
    each tensor that requires grad as it is pickled and returns a token (or
    None); ``on_recv(tensor, token, context)`` gets it back on the receiver."""

    on_send: Callable[[torch.Tensor, Any], Any] | None = None
    on_recv: Callable[[torch.Tensor, Any, Any], None] | None = None


def register_grad_hooks(on_send: Callable[[torch.Tensor, Any], Any],
                        on_recv: Callable[[torch.Tensor, Any, Any], None]) -> None:
    """Record tensors that require grad as they travel (see :class:`_GradHooks`)."""
    _GradHooks.on_send, _GradHooks.on_recv = on_send, on_recv


def current_context() -> Any:
    """The context object of the message being pickled or unpickled, or None."""
    return _context.get()


# -- tensors -----------------------------------------------------------------
# Byte-level work is done in numpy: each torch op releases and retakes the GIL,
# and with the agent's other threads about, each retake can cost a thread
# switch (measured: a 16-byte tensor's reduce took 26 us in the agent's threads
# through torch views, 5 us alone). One torch call each way: .numpy() and
# torch.from_numpy(). dtypes numpy lacks (bfloat16, float8, ...) go through
# torch views instead.
def _reduce_tensor(t: torch.Tensor) -> tuple:
    if t.layout is not torch.strided or t.is_quantized or t.device.type != "cpu":
        if t.device.type != "cpu":
            raise SerializationError(
                f"nbrpc sends CPU tensors; got one on {t.device}. Move it with .cpu() "
                "before sending (device maps are not supported)."
            )
        return t.__reduce_ex__(PROTOCOL)  # torch's own in-band pickling
    requires_grad, is_param = t.requires_grad, type(t) is torch.nn.Parameter
    token = None
    if requires_grad and _GradHooks.on_send is not None:
        token = _GradHooks.on_send(t, _context.get())
    try:
        arr = (t.detach() if requires_grad or is_param else t).numpy()
    except TypeError:  # no numpy dtype: export the bytes through a torch view
        data = t.detach().contiguous()
        arr = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else np.empty(0, np.uint8)
        return _rebuild_torch, (
            pickle.PickleBuffer(arr), t.dtype, tuple(t.shape), requires_grad, is_param, token)
    strides = None
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)  # only the view's own elements travel
        strides = _layout_to_restore(t)
    return _rebuild_numpy, (pickle.PickleBuffer(arr), arr.dtype.str, arr.shape, requires_grad,
                            is_param, token, strides)


def _layout_to_restore(t: torch.Tensor) -> tuple[int, ...] | None:
    """The strides a non-contiguous tensor gets back on arrival (as PyTorch's RPC
    keeps them), or None where the layout overlaps itself or would take more than
    4x its own elements on arrival (a column of a matrix arrives contiguous)."""
    shape, stride = t.shape, t.stride()
    if t.numel() == 0 or any(st <= 0 for n, st in zip(shape, stride) if n > 1):
        return None
    span = 1 + sum((n - 1) * st for n, st in zip(shape, stride))
    return tuple(stride) if span <= 4 * t.numel() else None


def parallel_copy(dst: memoryview, src: memoryview) -> None:
    """Copy bytes with torch's intra-op threads (about 2x a memcpy on 2 cores)."""
    if src.readonly or dst.readonly:
        dst[:] = src
        return
    torch.frombuffer(dst, dtype=torch.uint8).copy_(torch.frombuffer(src, dtype=torch.uint8))


def _writable(buf: Any) -> Any:
    return bytearray(buf) if memoryview(buf).readonly else buf


def _finish(t: torch.Tensor, requires_grad: bool, is_param: bool, token: Any) -> torch.Tensor:
    if is_param:
        t = torch.nn.Parameter(t, requires_grad=requires_grad)
    elif requires_grad:
        t.requires_grad_(True)
    if token is not None and _GradHooks.on_recv is not None:
        _GradHooks.on_recv(t, token, _context.get())
    return t


def _rebuild_numpy(buf: Any, dtype: str, shape: tuple, requires_grad: bool,
                   is_param: bool, token: Any = None,
                   strides: tuple[int, ...] | None = None) -> torch.Tensor:
    t = torch.from_numpy(np.frombuffer(_writable(buf), dtype=dtype).reshape(shape))
    if strides is not None:  # the sender's layout: a view arrives as a view-shaped tensor
        t = torch.empty_strided(shape, strides, dtype=t.dtype).copy_(t)
    return _finish(t, requires_grad, is_param, token)


def _rebuild_torch(buf: Any, dtype: torch.dtype, shape: tuple, requires_grad: bool,
                   is_param: bool, token: Any = None) -> torch.Tensor:
    if memoryview(buf).nbytes == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        t = torch.frombuffer(_writable(buf), dtype=torch.uint8).view(dtype).reshape(shape)
    return _finish(t, requires_grad, is_param, token)


register_reducer(torch.Tensor, _reduce_tensor)
register_reducer(torch.nn.Parameter, _reduce_tensor)


# -- pickler -----------------------------------------------------------------
# Functions and classes that cloudpickle decided to pickle by reference, by id.
# Deciding costs ~3 us a time (module and qualname lookups); the answer for an
# importable object does not change, so it is remembered (bounded).
_BY_REFERENCE: dict[int, Any] = {}
_BY_REFERENCE_MAX = 4096


class _Pickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        reducer = _REDUCERS.get(type(obj))
        if reducer is not None:
            return reducer(obj)
        if _BY_REFERENCE.get(id(obj)) is obj:
            return NotImplemented  # the C pickler saves it as a global
        result = cloudpickle.Pickler.reducer_override(self, obj)
        if result is NotImplemented and isinstance(obj, (type, types.FunctionType)):
            if getattr(obj, "__module__", None) != "__main__":
                if len(_BY_REFERENCE) >= _BY_REFERENCE_MAX:
                    _BY_REFERENCE.clear()
                _BY_REFERENCE[id(obj)] = obj
        return result


def dumps(obj: Any, context: Any = None) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle ``obj``; returns the payload and the out-of-band buffers.

    >>> payload, buffers = dumps({"x": torch.arange(4.0)})
    >>> len(buffers), buffers[0].raw().nbytes
    (1, 16)
    >>> loads(payload, buffers)["x"]
    tensor([0., 1., 2., 3.])
    """
    buffers: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    token = _context.set(context)
    try:
        _Pickler(f, protocol=PROTOCOL, buffer_callback=buffers.append).dump(obj)
    except SerializationError:
        raise
    except Exception as e:
        raise SerializationError(
            f"could not pickle {_describe(obj)}: {type(e).__name__}: {e}. Send only "
            "picklable values (open files, locks and sockets are not)."
        ) from e
    finally:
        _context.reset(token)
    return f.getvalue(), buffers


def loads(payload: bytes, buffers: list, context: Any = None) -> Any:
    """Inverse of :func:`dumps`; ``buffers`` are the received buffer frames."""
    token = _context.set(context)
    try:
        return pickle.loads(payload, buffers=buffers)
    finally:
        _context.reset(token)


def _describe(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) < 120 else text[:117] + "..."
