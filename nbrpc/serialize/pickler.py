"""Pickling for messages: cloudpickle, with tensors carried out of band.

Pure functions and a small registry; no sockets, no agent.

* Functions and classes defined in ``__main__`` (a notebook cell, a script)
  are pickled by value, importable ones by reference (cloudpickle's rule);
  their code carries its source lines, for tracebacks (:mod:`.source`).
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
import copyreg
import io
import marshal
import pickle
import types
from collections import ChainMap
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np
import torch

from ..errors import SerializationError
from . import code
from .code import entry_for
from .source import reduce_code

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
    None); ``on_recv(tensor, token, context)`` gets it back on the receiver and
    returns the tensor the message delivers (the same values, recorded);
    ``on_loaded(context)`` is called once a message with a context is read
    (the recv function of the message is made then)."""

    on_send: Callable[[torch.Tensor, Any], Any] | None = None
    on_recv: Callable[[torch.Tensor, Any, Any], torch.Tensor] | None = None
    on_loaded: Callable[[Any], None] | None = None


def register_grad_hooks(on_send: Callable[[torch.Tensor, Any], Any],
                        on_recv: Callable[[torch.Tensor, Any, Any], torch.Tensor],
                        on_loaded: Callable[[Any], None] | None = None) -> None:
    """Record tensors that require grad as they travel (see :class:`_GradHooks`)."""
    _GradHooks.on_send, _GradHooks.on_recv = on_send, on_recv
    _GradHooks.on_loaded = on_loaded


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
    ctx = _context.get()
    if t.device.type == "cpu":
        if ctx is not None and getattr(ctx, "maps_cpu", False):  # it may go to a GPU
            return _reduce_to(t, ctx.target("cpu"))
        return _reduce_cpu(t, t)
    if t.device.type != "cuda":
        return _reduce_to(t, str(t.device))  # (refused, saying why)
    if ctx is None or not hasattr(ctx, "target"):
        raise SerializationError(
            f"a tensor on {t.device} was pickled outside an RPC message, where no device "
            "map says where it goes: send it with rpc_sync/rpc_async/remote, or .cpu() it.")
    # PyTorch's error where no map names its device
    return _reduce_to(t, ctx.target(str(t.device)))


def _reduce_to(t: torch.Tensor, target: str) -> tuple:
    """``t``, pickled to land on the receiver's ``target`` device."""
    if t.device.type == "cpu":
        return _reduce_cpu(t, t, None if target == "cpu" else target)
    ctx = _context.get()
    if (t.device.type != "cuda" or t.layout is not torch.strided or t.is_quantized
            or ctx is None or not hasattr(ctx, "peer_place")):
        raise SerializationError(
            f"nbrpc moves CPU tensors, and strided CUDA tensors along device maps in RPC "
            f"messages; this one is a {t.layout} tensor on {t.device}: move it with .cpu() "
            "before sending (and make a sparse or quantized CUDA tensor dense).")
    from . import cuda  # (only where a CUDA tensor is sent)

    return cuda.reduce(t, target, ctx, _reduce_cpu)


def grad_meta(t: torch.Tensor) -> tuple[bool, bool, Any]:
    """What the receiver needs to rebuild ``t`` for autograd: whether it requires
    grad, whether it is a Parameter, and the grad hook's token (it records the
    send with distributed autograd)."""
    requires_grad = t.requires_grad
    token = None
    if requires_grad and _GradHooks.on_send is not None:
        token = _GradHooks.on_send(t, _context.get())
    return requires_grad, type(t) is torch.nn.Parameter, token


def _reduce_cpu(t: torch.Tensor, data: torch.Tensor, device: str | None = None) -> tuple:
    """``t`` (as to autograd and type) with the elements of ``data``, a CPU tensor
    (``t`` itself, or its copy staged off a GPU), out of band; ``device``: where
    the receiver puts it (None: the CPU)."""
    if data.layout in _SPARSE_PARTS:
        return _reduce_sparse(t, data, device)
    if data.layout is not torch.strided or data.is_quantized:
        return t.__reduce_ex__(PROTOCOL)  # torch's own in-band pickling
    requires_grad, is_param, token = grad_meta(t)
    try:
        arr = (data.detach() if data.requires_grad or type(data) is torch.nn.Parameter
               else data).numpy()
    except TypeError:  # no numpy dtype: export the bytes through a torch view
        data = data.detach().contiguous()
        arr = data.reshape(-1).view(torch.uint8).numpy() if data.numel() else np.empty(0, np.uint8)
        return _rebuild_torch, (pickle.PickleBuffer(arr), t.dtype, tuple(t.shape), requires_grad,
                                is_param, token, device)
    strides = None
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)  # only the view's own elements travel
        strides = _layout_to_restore(data)
    return _rebuild_numpy, (pickle.PickleBuffer(arr), arr.dtype.str, arr.shape, requires_grad,
                            is_param, token, strides, device)


# A sparse tensor travels as its dense parts (each out of band, as any CPU
# tensor) with its size and autograd metadata: torch's own pickling of one
# drops ``requires_grad``, so distributed autograd would never see it (sparse
# gradients, as an EmbeddingBag's, are the parameter server's common case).
_SPARSE_PARTS: dict[torch.layout, Callable[[torch.Tensor], tuple[torch.Tensor, ...]]] = {
    torch.sparse_coo: lambda t: (t._indices(), t._values()),
    torch.sparse_csr: lambda t: (t.crow_indices(), t.col_indices(), t.values()),
    torch.sparse_csc: lambda t: (t.ccol_indices(), t.row_indices(), t.values()),
    torch.sparse_bsr: lambda t: (t.crow_indices(), t.col_indices(), t.values()),
    torch.sparse_bsc: lambda t: (t.ccol_indices(), t.row_indices(), t.values()),
}


def _reduce_sparse(t: torch.Tensor, data: torch.Tensor, device: str | None) -> tuple:
    """A sparse ``t`` (its elements: ``data``), for :func:`_rebuild_sparse`.

    >>> i = torch.tensor([[0, 1], [1, 0]])
    >>> s = torch.sparse_coo_tensor(i, torch.tensor([3.0, 4.0]), (2, 2), requires_grad=True,
    ...                             check_invariants=True)
    >>> r = loads(*dumps(s))
    >>> r.layout, r.requires_grad, torch.equal(r.to_dense(), s.to_dense())
    (torch.sparse_coo, True, True)
    """
    requires_grad, is_param, token = grad_meta(t)
    d = data.detach()
    coalesced = d.is_coalesced() if d.layout is torch.sparse_coo else None
    return _rebuild_sparse, (d.layout, _SPARSE_PARTS[d.layout](d), tuple(d.shape), coalesced,
                             requires_grad, is_param, token, device)


def _rebuild_sparse(layout: torch.layout, parts: tuple[torch.Tensor, ...], size: tuple,
                    coalesced: bool | None, requires_grad: bool, is_param: bool,
                    token: Any = None, device: str | None = None) -> torch.Tensor:
    if layout is torch.sparse_coo:
        t = torch.sparse_coo_tensor(*parts, size, is_coalesced=coalesced, check_invariants=True)
    else:
        t = torch.sparse_compressed_tensor(*parts, size, layout=layout, check_invariants=True)
    return finish_tensor(t, requires_grad, is_param, token, device)


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


def finish_tensor(t: torch.Tensor, requires_grad: bool, is_param: bool, token: Any,
                  device: str | None = None) -> torch.Tensor:
    """The received tensor as it was sent: on ``device`` (where the device map
    puts it; None: here, on the CPU), a Parameter or requiring grad, and known
    to distributed autograd."""
    if device is not None:
        t = _onto(t, device)
    if is_param:
        t = torch.nn.Parameter(t, requires_grad=requires_grad)
    elif requires_grad:
        t.requires_grad_(True)
    if token is not None and _GradHooks.on_recv is not None:
        t = _GradHooks.on_recv(t, token, _context.get())
    return t


def _onto(t: torch.Tensor, device: str) -> torch.Tensor:
    """``t`` (received, on the CPU) copied onto ``device``; the copy is complete
    on return, whatever stream reads it next."""
    return t.to(device)


def _rebuild_numpy(buf: Any, dtype: str, shape: tuple, requires_grad: bool,
                   is_param: bool, token: Any = None,
                   strides: tuple[int, ...] | None = None,
                   device: str | None = None) -> torch.Tensor:
    t = torch.from_numpy(np.frombuffer(_writable(buf), dtype=dtype).reshape(shape))
    if strides is not None:  # the sender's layout: a view arrives as a view-shaped tensor
        t = torch.empty_strided(shape, strides, dtype=t.dtype).copy_(t)
    return finish_tensor(t, requires_grad, is_param, token, device)


def _rebuild_torch(buf: Any, dtype: torch.dtype, shape: tuple, requires_grad: bool,
                   is_param: bool, token: Any = None, device: str | None = None
                   ) -> torch.Tensor:
    if memoryview(buf).nbytes == 0:
        t = torch.empty(shape, dtype=dtype)
    else:
        t = torch.frombuffer(_writable(buf), dtype=torch.uint8).view(dtype).reshape(shape)
    return finish_tensor(t, requires_grad, is_param, token, device)


class Placed:
    """A tensor that lands on ``device`` at the receiver, whatever the message's
    device map says: a gradient going back to where the tensor it belongs to
    came from (the forward's map, inverted, already allowed that way). Arrives
    as the tensor itself.

    >>> loads(*dumps([Placed(torch.ones(2), "cpu")]))
    [tensor([1., 1.])]
    """

    __slots__ = ("tensor", "device")

    def __init__(self, tensor: torch.Tensor, device: str) -> None:
        self.tensor, self.device = tensor, device


register_reducer(torch.Tensor, _reduce_tensor)
register_reducer(torch.nn.Parameter, _reduce_tensor)
register_reducer(Placed, lambda p: _reduce_to(p.tensor, p.device))


# -- pickler -----------------------------------------------------------------
# Functions and classes that cloudpickle decided to pickle by reference, by id.
# Deciding costs ~3 us a time (module and qualname lookups); the answer for an
# importable object does not change, so it is remembered (bounded).
_BY_REFERENCE: dict[int, Any] = {}
_BY_REFERENCE_MAX = 4096


class _Table:
    """The code table of one message being pickled (see :mod:`.code`): each
    by-value definition once, with its blob unless the peer holds it and the
    message may refer to it by hash (requests only: their answer confirms)."""

    __slots__ = ("codes", "peer", "refs_ok", "rows", "index", "full")

    def __init__(self, codes: Any, peer: int, refs_ok: bool) -> None:
        self.codes, self.peer, self.refs_ok = codes, peer, refs_ok
        self.rows: list[tuple[bytes, bytes | None, tuple]] = []
        self.index: dict[bytes, int] = {}
        self.full: list[bytes] = []  # digests sent with their definition

    def add(self, obj: Any) -> int | None:
        e = entry_for(obj)
        if e is None:
            return None
        i = self.index.get(e.digest)
        if i is None:
            i = self.index[e.digest] = len(self.rows)
            if self.refs_ok and self.codes.holds(self.peer, e.digest):
                self.rows.append((e.digest, None, e.classes))
                self.codes.sent_ref += 1
            else:
                self.rows.append((e.digest, e.blob, e.classes))
                self.full.append(e.digest)
                self.codes.sent_full += 1
        return i


_TABLE = 0  # first byte of a payload with a code table (a pickle starts with 0x80)
_objects: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "nbrpc_code_objects", default=None)


def _code_ref(i: int) -> Any:
    """Unpickling: the ``i``-th definition of the message's code table."""
    return _objects.get()[i]


class _Pickler(cloudpickle.Pickler):
    table: _Table | None = None
    # cloudpickle's reducers, but code by value keeps its file name and carries
    # its source lines (see .source); one dict, as cloudpickle's, since the C
    # pickler looks up the type of most objects it saves in this table
    dispatch_table = ChainMap({**cloudpickle.Pickler._dispatch_table, types.CodeType: reduce_code},
                              copyreg.dispatch_table)

    def reducer_override(self, obj: Any) -> Any:
        reducer = _REDUCERS.get(type(obj))
        if reducer is not None:
            return reducer(obj)
        if _BY_REFERENCE.get(id(obj)) is obj:
            return NotImplemented  # the C pickler saves it as a global
        if self.table is not None and (type(obj) is types.FunctionType or isinstance(obj, type)):
            i = self.table.add(obj)
            if i is not None:
                return _code_ref, (i,)
        result = cloudpickle.Pickler.reducer_override(self, obj)
        if result is NotImplemented and isinstance(obj, (type, types.FunctionType)):
            if getattr(obj, "__module__", None) != "__main__":
                if len(_BY_REFERENCE) >= _BY_REFERENCE_MAX:
                    _BY_REFERENCE.clear()
                _BY_REFERENCE[id(obj)] = obj
        return result


def dumps(obj: Any, context: Any = None) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle ``obj``; returns the payload and the out-of-band buffers.

    With a ``context`` that has ``codes`` (a :class:`~.code.CodeCache`),
    ``peer`` and ``refs_ok``, by-value functions and classes go into a code
    table ahead of the pickle (:mod:`.code`), and ``context.full`` lists the
    digests sent with their definitions, ``context.refs`` whether any went by
    hash only.

    >>> payload, buffers = dumps({"x": torch.arange(4.0)})
    >>> len(buffers), buffers[0].raw().nbytes
    (1, 16)
    >>> loads(payload, buffers)["x"]
    tensor([0., 1., 2., 3.])
    """
    buffers: list[pickle.PickleBuffer] = []
    f = io.BytesIO()
    token = _context.set(context)
    pickler = _Pickler(f, protocol=PROTOCOL, buffer_callback=buffers.append)
    codes = getattr(context, "codes", None)
    if codes is not None:
        pickler.table = _Table(codes, context.peer, context.refs_ok)
    try:
        pickler.dump(obj)
    except SerializationError:
        raise
    except Exception as e:
        raise SerializationError(
            f"could not pickle {_describe(obj)}: {type(e).__name__}: {e}. Send only "
            "picklable values (open files, locks and sockets are not)."
        ) from e
    finally:
        _context.reset(token)
    table = pickler.table
    if table is None or not table.rows:
        return f.getvalue(), buffers
    head = marshal.dumps(table.rows)
    context.full = table.full
    context.refs = len(table.full) < len(table.rows)
    return b"".join((bytes((_TABLE,)), len(head).to_bytes(4, "little"), head,
                     f.getbuffer())), buffers


def loads(payload: bytes, buffers: list, context: Any = None) -> Any:
    """Inverse of :func:`dumps`; ``buffers`` are the received buffer frames.
    A code table is resolved first: a definition missing here raises
    :class:`~nbrpc.errors.CodeCacheMiss` before anything else is unpickled."""
    token = _context.set(context)
    try:
        obj = _loads(payload, buffers, context)
        if context is not None and _GradHooks.on_loaded is not None:
            _GradHooks.on_loaded(context)
        return obj
    finally:
        _context.reset(token)


def _loads(payload: bytes, buffers: list, context: Any) -> Any:
    if not (len(payload) and payload[0] == _TABLE):
        return pickle.loads(payload, buffers=buffers)
    view = memoryview(payload)
    n = int.from_bytes(view[1:5], "little")
    codes = getattr(context, "codes", None)
    if codes is None:
        raise SerializationError("a message naming code by hash arrived where no "
                                 "code cache is kept")
    objs = codes.resolve(marshal.loads(view[5:5 + n]))
    token = _objects.set(objs)
    try:
        return pickle.loads(view[5 + n:], buffers=buffers)
    finally:
        _objects.reset(token)


def _describe(obj: Any) -> str:
    text = repr(obj)
    return text if len(text) < 120 else text[:117] + "..."


code.use_pickler(dumps)  # cached definitions are pickled by this module's dumps
