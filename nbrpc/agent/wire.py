"""What travels with a message, and small checks shared by both sides.

:class:`MessageContext` is what reducers see while a message is pickled or unpickled;
:class:`Pending` is a call waiting for its answer; :class:`Deferred` is a
handler's answer that is a future; the rest checks a call's arguments and
timeout and names a request for the event log.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CodeCacheMiss, MessageTooLargeError, SerializationError
from ..serialize import CodeCache, a_type, current_context, find_unpicklable
from .devices import target_device
from .futures import RpcFuture

log = logging.getLogger(__name__)

LOGGED_ATTR = "_nbrpc_logged"  # set on an error user_error has logged

MISS_TYPE_NAME = f"{CodeCacheMiss.__module__}.{CodeCacheMiss.__qualname__}"  # an Err's type_name


class MessageContext:
    """What a reducer sees (``nbrpc.serialize.current_context()``) while a
    message is pickled or unpickled: this agent (an
    :class:`~nbrpc.agent.agent.Agent`: not imported here, as agent.py imports
    this module), the peer at the other end,
    ``undo`` callbacks to run if the message is never sent, the value the
    message propagates (``tag``: the autograd context id), a scratch dict
    for upper layers (``stash``: one autograd message id per message) and
    what an answer settles: a request's sender runs ``answered`` callbacks once
    the answer shows the callee read it, with what the answer says it left
    ``pending``; its callee runs ``answering`` callbacks as it answers, which
    name what is not settled yet (an RRef forked into the request: its owner
    has not confirmed the copy)."""

    __slots__ = ("agent", "peer", "undo", "tag", "stash", "before", "refs_ok", "full", "refs",
                 "answered", "answering", "reply", "cuda")

    def __init__(self, agent: Any, peer: int, tag: Any = None, refs_ok: bool = False,
                 reply: bool = False) -> None:
        self.agent, self.peer, self.tag = agent, peer, tag
        self.reply = reply  # an answer: its tensors follow the caller's device map, inverted
        self.cuda: dict[str, int] | None = None  # CUDA bytes it carried, by route
        self.undo: list[Callable[[], None]] | None = None
        self.stash: dict[str, Any] | None = None
        self.before: list[threading.Event] | None = None
        # notebook code by value, once (nbrpc.serialize.code): may this message
        # name definitions by hash (requests: their answer confirms), which it
        # sent in full, and whether it named any by hash
        self.refs_ok = refs_ok
        self.full: list[bytes] | None = None
        self.refs = False
        self.answered: list[Callable[[tuple], None]] | None = None
        self.answering: list[Callable[[], list]] | None = None

    @property
    def codes(self) -> CodeCache:
        return self.agent.codes

    @property
    def maps_cpu(self) -> bool:
        """Whether a device map of this agent's group names "cpu" (so CPU
        tensors may land on a GPU and the reducer must ask :meth:`target`)."""
        return self.agent.cpu_mapped

    def target(self, device: str) -> str:
        """The peer's device a tensor on ``device`` goes to (PyTorch's rules:
        :func:`~.devices.target_device`); raises
        :class:`~nbrpc.errors.DeviceRouteError` where no map sends it."""
        agent = self.agent
        return target_device(device, agent.device_map_to(self.peer, self.reply),
                             agent.members.peer_name(self.peer), not self.reply, agent.name)

    def note_cuda(self, route: str, nbytes: int) -> None:
        """A CUDA tensor of ``nbytes`` went by ``route`` ("ipc", "staged",
        "in-process"): traces show it on the message."""
        if self.cuda is None:
            self.cuda = {}
        self.cuda[route] = self.cuda.get(route, 0) + nbytes

    def cuda_detail(self) -> str:
        """What :meth:`note_cuda` recorded, as an event's detail ("ipc=67108864")."""
        return " ".join(f"{k}={v}" for k, v in sorted((self.cuda or {}).items()))

    def peer_place(self) -> str:
        """Where the peer runs: ``"process"`` (this one), ``"host"`` (this host,
        as this user) or ``"remote"``."""
        return self.agent.peer_place(self.peer)

    def run_after(self, event: threading.Event) -> None:
        """A request being unpickled: run its handler once ``event`` is set
        (bounded by the RPC timeout). Replies and inline messages do not wait."""
        if self.before is None:
            self.before = []
        self.before.append(event)

    def on_unsent(self, fn: Callable[[], None]) -> None:
        if self.undo is None:
            self.undo = []
        self.undo.append(fn)

    def unsent(self) -> None:
        for fn in self.undo or ():
            try:
                fn()
            except Exception:
                log.exception("undoing an unsent message's side effects failed")

    def on_answered(self, fn: Callable[[tuple], None]) -> None:
        """A request being pickled: run ``fn(pending)`` when an answer shows the
        callee read it (not if it could not, nor if no answer ever comes)."""
        if self.answered is None:
            self.answered = []
        self.answered.append(fn)

    def read_by_callee(self, pending: tuple) -> None:
        for fn in self.answered or ():
            try:
                fn(pending)
            except Exception:
                log.exception("a hook on a request's answer failed")

    def on_answering(self, fn: Callable[[], list]) -> None:
        """A request being unpickled: as it is answered, ``fn()`` names what of
        it is not settled yet (the answer carries that as ``pending``)."""
        if self.answering is None:
            self.answering = []
        self.answering.append(fn)

    def pending_at_answer(self) -> tuple:
        out: list = []
        for fn in self.answering or ():
            try:
                out += fn()
            except Exception:
                log.exception("a hook on answering a request failed")
        return tuple(out)


class Propagator:
    """How an upper layer propagates a value with requests (the autograd layer:
    the context id). ``current()`` is the calling thread's value or None; the
    receiver runs the request's handler inside ``enter(value)``."""

    def current(self) -> Any:
        return None

    def enter(self, value: Any) -> Any:  # a context manager
        raise NotImplementedError

    def sent(self, value: Any, peer: int) -> None:
        """A request carrying ``value`` is going to ``peer``."""


class Tag:
    """First item of a tagged payload: unpickling it sets the receiving
    MessageContext's tag before the message itself is rebuilt, so reducers see it."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple:
        return _restore_tag, (self.value,)


def _restore_tag(value: Any) -> type:
    current_context().tag = value
    return Tag


@dataclass(slots=True)
class Pending:
    future: RpcFuture
    peer: int
    op: str
    started: float
    timer: list | None = None
    keep: Any = None  # held until the answer (an RRef must outlive its call)
    then: Callable[[Any, BaseException | None], None] | None = None
    wire: MessageContext | None = None  # undo of what pickling did, if the callee cannot read it
    resend: tuple | None = None  # (msg, tag, timeout, kind): it named code by hash

    def settle(self, value: Any = None, error: BaseException | None = None) -> None:
        """Complete the future, then run ``then`` (on the completing thread).
        ``then`` is a plain call: a torch done-callback costs a GIL round trip."""
        self.future.settle(value, error)
        if self.then is not None:
            try:
                self.then(value, error)
            except Exception:
                log.exception("a request's completion hook failed")
        self.keep = self.then = self.wire = self.resend = None


@dataclass(slots=True)
class Deferred:
    """Returned by a handler whose answer is a future (``async_execution``)."""

    future: torch.futures.Future


def unread_error(e: BaseException, name: str) -> BaseException:
    """The error for a request that ``name`` could not unpickle (nothing of it ran)."""
    if not isinstance(e, Exception) or isinstance(e, CodeCacheMiss):
        return e  # (a miss: the caller resends with the definitions)
    hint = ""
    if isinstance(e, (AttributeError, ImportError)):
        hint = (" The RPC pickler does not serialize the code of functions and classes "
                "imported from a module (it does for those defined in __main__ or a "
                "notebook cell): the callee imports them by name, so install the same "
                "code on every worker, or define them in the notebook or script.")
    error = SerializationError(f"{name!r} could not unpickle the request: "
                               f"{type(e).__name__}: {e}.{hint}")
    error.__cause__ = e
    return error


def unpicklable_request(verb: str, worker: str, msg: Any) -> SerializationError | None:
    """The error for a call whose function or arguments do not pickle, naming
    the one that does not (by position or keyword, with the path inside it)
    and its type; None if the message holds no call, or each part pickles on
    its own. Only on the failure path: it pickles the parts again.

    >>> import threading
    >>> from nbrpc.agent.messages import Call
    >>> e = unpicklable_request("rpc_sync", "w1", Call(max, (1,), {"key": [threading.Lock()]}))
    >>> print(e)  # doctest: +ELLIPSIS
    rpc_sync('w1', max): could not pickle kwargs['key'][0] in keyword argument 'key' (a _thread.lock): cannot pickle '_thread.lock' object. Pass only picklable values ...
    """
    fn, args, kwargs = (getattr(msg, a, None) for a in ("fn", "args", "kwargs"))
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        return None
    parts = [("the function", "the function", fn)]
    parts += [(f"argument {i}", f"args[{i}]", v) for i, v in enumerate(args)]
    parts += [(f"keyword argument {k!r}", f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    found = next(((name, root, hit) for name, root, value in parts
                  if (hit := find_unpicklable(value, root)) is not None), None)
    if found is None:
        return None
    name, root, (path, part, error) = found
    what = name if path == root else f"{path} in {name}" if path.startswith(root) else path
    # (a nested function: its name)
    called = (describe_message(msg) or "?").rpartition("<locals>.")[2]
    return SerializationError(
        f"{verb}({worker!r}, {called}): could not pickle {what} ({a_type(part)}): "
        f"{error}. Pass only picklable values (open files, locks, sockets and threads are "
        "not), or create the object on the callee.", path, worker)


FITS_ANYWHERE = 1 << 20  # no member accepts less (AgentOptions' minimum max_message_size)


def oversize(payload: bytes, buffers: list, member: Any) -> tuple[int, int] | None:
    """(the message's size, ``member``'s limit) when ``member`` would drop it as too
    large, counted as its receiver counts (payload and buffers, wherever they
    travel); None when it fits. A small message without buffers costs one len().

    >>> from nbrpc.agent.messages import Member
    >>> m = Member("w1", 1, "tcp://127.0.0.1:1", max_message=2 << 20)
    >>> oversize(b"x", [], m), oversize(b"x", [bytearray(3 << 20)], m)
    (None, (3145729, 2097152))
    """
    if not buffers and len(payload) < FITS_ANYWHERE:
        return None
    limit = getattr(member, "max_message", None)
    if limit is None:
        return None
    size = len(payload) + sum(memoryview(b).nbytes for b in buffers)
    return (size, limit) if size > limit else None


def too_large(what: str, size: int, limit: int, worker: str) -> MessageTooLargeError:
    """The error for a message ``worker`` would drop: both sizes, and what to change.

    >>> print(too_large("rpc_sync('w1', echo): the request", 6 << 30, 4 << 30, "w1"))
    rpc_sync('w1', echo): the request is 6.0 GiB, more than 'w1' accepts (4.0 GiB, its max_message_size): send less in one call, or start 'w1' with a larger TensorPipeRpcBackendOptions(max_message_size=...).
    """
    return MessageTooLargeError(
        f"{what} is {_size(size)}, more than {worker!r} accepts ({_size(limit)}, its "
        f"max_message_size): send less in one call, or start {worker!r} with a larger "
        "TensorPipeRpcBackendOptions(max_message_size=...).", size, limit, worker)


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


INTERNAL = "nbrpc:"  # the prefix of internal calls' names in the event log


def internal(fn: Callable) -> Callable:
    """Mark ``fn`` as nbrpc's own introspection (snapshots, probes, trace reads):
    traces leave its calls out unless asked for them."""
    fn.__nbrpc_internal__ = True  # type: ignore[attr-defined]
    return fn


def named_by(describe: Callable[[tuple], str]) -> Callable[[Callable], Callable]:
    """Name the calls of the decorated function in the event log (and so in
    traces) by ``describe(args)`` rather than by its own name: for a helper that
    runs something else on the callee (an RRef's method, run by its owner)."""
    def mark(fn: Callable) -> Callable:
        fn.__nbrpc_what__ = describe  # type: ignore[attr-defined]
        return fn
    return mark


def describe_message(msg: Any) -> str:
    """What a request is about, for its event: the function called, or the RRef."""
    fn = getattr(msg, "fn", None)
    describe = getattr(fn, "__nbrpc_what__", None)
    if describe is not None:
        return describe(msg.args)
    if fn is not None:  # Box.method; torch.mul's qualname is _VariableFunctionsClass.mul
        name = getattr(fn, "__qualname__", None) or type(fn).__name__
        name = getattr(fn, "__name__", name) if name[0] == "_" else name
        return INTERNAL + name if getattr(fn, "__nbrpc_internal__", False) else name
    rref_id = getattr(msg, "rref_id", None)
    if rref_id is None:
        return ""
    more = getattr(msg, "more", ())
    return f"RRef {rref_id} and {len(more)} more" if more else f"RRef {rref_id}"


def call_args(args: Any, kwargs: Any) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` of a call, checked: a tuple (or list) and a dict.

    >>> call_args([1, 2], None)
    ((1, 2), {})
    >>> call_args(5, None)
    Traceback (most recent call last):
    ...
    TypeError: args must be a tuple of positional arguments, e.g. args=(5,); got int 5
    """
    if args is None:
        args = ()
    elif not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of positional arguments, e.g. args=({args!r},); "
                        f"got {type(args).__name__} {_short(args)}")
    if kwargs is None:
        kwargs = {}
    elif not isinstance(kwargs, dict):
        raise TypeError(f"kwargs must be a dict of keyword arguments, e.g. kwargs={{'x': 1}}; "
                        f"got {type(kwargs).__name__} {_short(kwargs)}")
    return tuple(args), kwargs


def check_timeout(timeout: Any, default: float) -> float:
    """A call's timeout in seconds: -1 (or None) means ``default``, 0 no timeout.

    >>> check_timeout(-1, 60.0), check_timeout(2, 60.0)
    (60.0, 2.0)
    >>> check_timeout(float("nan"), 60.0)
    Traceback (most recent call last):
    ...
    ValueError: timeout must be seconds >= 0 (0: no timeout) or -1 (the default, 60 s); got nan
    """
    if timeout is None:
        return default
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool):
        raise TypeError(f"timeout must be a number of seconds (0: no timeout, -1: the "
                        f"default {default:g} s); got {type(timeout).__name__} {_short(timeout)}")
    if timeout == -1:
        return default
    if timeout == float("inf"):
        return 0.0
    if not timeout >= 0:  # (nan fails every comparison)
        raise ValueError(f"timeout must be seconds >= 0 (0: no timeout) or -1 (the default, "
                         f"{default:g} s); got {timeout!r}")
    return float(timeout)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."

