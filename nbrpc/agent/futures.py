"""The future type returned by ``rpc_async``: a ``torch.futures.Future``.

It adds one thing: :meth:`RpcFuture.wait` from the main thread can be
interrupted (Jupyter's interrupt button raises KeyboardInterrupt within a
second) and leaves the future, the call and the agent intact, so the same
future can be waited on again. ``torch.futures.wait_all``, ``collect_all``
and ``.then()`` work as for any torch future. As in PyTorch, a callback may
block, e.g. wait on a new call: a future that has callbacks is completed on
one of the agent's pool threads, never on its I/O thread (which must stay
free to deliver the answers such a callback waits for).

Errors and reference cycles: a torch future holds its error in C++, where
Python's garbage collector cannot see it. An error raised out of the future
gets a traceback whose frames often reference that same future, and the
cycle future → error → traceback → frame → future is never collected (with
everything those frames hold: RRefs, tensors). So nbrpc never raises or keeps
a stored error with frames: :func:`detach` turns an error's traceback into
text before it is stored, :func:`outcome` reads a future without raising, and
:meth:`RpcFuture.wait` raises a fresh copy of the stored error.

The GIL: torch's ``value()`` (and ``wait()``) of a completed future releases
the GIL and takes it back, and taking it back waits for whichever thread got
it meanwhile (130 µs a call here beside one busy thread, against under 1 µs
alone). The agent completes an :class:`RpcFuture` through :meth:`RpcFuture.settle`,
which keeps the outcome in Python too, so its ``wait()``, ``value()`` and
``done()`` read it there and never drop the GIL for an answer that has come.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from ..serialize import format_exception
from .pool import blocking

_SLICE = 0.25  # seconds between checks while waiting; bounds interrupt latency


class RpcFuture(torch.futures.Future):
    """A torch future completed by an nbrpc agent: what ``rpc_async`` returns,
    a ``torch.futures.Future`` in every respect (``wait``, ``then``,
    ``torch.futures.wait_all``). ``wait()`` can be interrupted (Ctrl-C, Jupyter's
    interrupt button) without harm to the call or the agent; a remote error
    is raised from ``wait()`` as itself, with the remote traceback.

    >>> import torch
    >>> from nbrpc import rpc
    >>> rpc.init_rpc("f", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> fut = rpc.rpc_async("f", torch.add, args=(torch.ones(2), 1))
    >>> isinstance(fut, torch.futures.Future), fut.then(lambda f: f.value() * 2).wait()
    (True, tensor([4., 4.]))
    >>> rpc.rpc_async("f", int, args=("x",)).wait()
    Traceback (most recent call last):
      ...
    ValueError: invalid literal for int() with base 10: 'x'
    (raised on worker 'f'; its traceback is shown above)
    >>> rpc.shutdown()
    """

    def __init__(self, io_ident: Callable[[], int | None] | None = None) -> None:
        torch._C.Future.__init__(self, [])  # CPU only: skip the device-list conversion
        self._io_ident = io_ident
        self.has_callbacks = False  # then the agent completes it on a pool thread
        # pump(self): reads the answer on the waiting thread (its own channel)
        self.pump: Callable[[RpcFuture], None] | None = None
        # the request was queued, not written (nobody waited yet): its id, and
        # what writes it at once, which wait() calls rather than wait for the
        # I/O thread to (see IOLoop.send's ``defer``)
        self.msg_id: int | None = None
        self.unsent: Callable[[], None] | None = None
        # (value, error) once the agent settled it (see the module docstring)
        self._outcome: tuple[Any, BaseException | None] | None = None

    def settle(self, value: Any = None, error: BaseException | None = None) -> None:
        """Complete the future, as the agent does: the outcome is kept here
        first, then the torch future is completed (its callbacks run)."""
        if error is None:
            self._outcome = (value, None)
            torch._C.Future.set_result(self, value)
        else:
            self._outcome = (None, detach(error))
            self.set_exception(error)

    def done(self) -> bool:
        return self._outcome is not None or torch._C.Future.done(self)

    def then(self, callback: Callable[[torch.futures.Future], Any]) -> torch.futures.Future:
        self.has_callbacks = True
        return super().then(callback)

    def add_done_callback(self, callback: Callable[[torch.futures.Future], None]) -> None:
        self.has_callbacks = True
        super().add_done_callback(callback)

    def wait(self) -> Any:
        __tracebackhide__ = True  # (IPython leaves nbrpc's frames out of tracebacks)
        if not self.done():
            unsent, self.unsent = self.unsent, None
            if unsent is not None:
                unsent()
            if self.pump is not None:
                self.pump(self)
            if not self.done():
                self._block()
        try:
            return self.value()
        except Exception as e:  # a fresh copy of the stored error: its only frames
            e.__traceback__ = None  # are these, so it is raised at the caller's line
            raise

    def value(self) -> Any:
        __tracebackhide__ = True
        result, error = self._outcome or outcome(self, torch._C.Future.value)
        if error is not None:
            raise fresh(error)
        return result

    def _block(self) -> None:
        if self._io_ident is not None and threading.get_ident() == self._io_ident():
            raise RuntimeError(
                "A future was waited on from nbrpc's I/O thread, the thread that "
                "delivers the answer it waits for: that would deadlock. Wait from "
                "another thread, or chain a .then() (callbacks given to an nbrpc "
                "future run on a pool thread, where they may wait).")
        _block_until_done(self)


def wait_result(fut: torch.futures.Future) -> Any:
    """Wait for any torch future as :meth:`RpcFuture.wait` does: Ctrl-C can
    interrupt it, a pool thread waiting here lets its pool start another thread
    at once (see :mod:`nbrpc.agent.pool`), and an error is raised as a fresh
    copy (see the module docstring).

    >>> f = torch.futures.Future(); f.set_result(3); wait_result(f)
    3
    """
    if not fut.done():
        _block_until_done(fut)
    result, error = outcome(fut)
    if error is not None:
        raise fresh(error)
    return result


def on_done(fut: torch.futures.Future, callback: Callable[[Any], None]) -> None:
    """nbrpc's own done-callback, which never blocks: unlike ``.then()`` and
    ``add_done_callback`` from user code, it lets an :class:`RpcFuture` still
    complete on the I/O thread (no pool hop; see ``has_callbacks``).

    >>> f = torch.futures.Future(); seen = []
    >>> on_done(f, lambda g: seen.append(g.value())); f.set_result(1); seen
    [1]
    """
    torch._C.Future.add_done_callback(fut, callback)


def _block_until_done(fut: torch.futures.Future) -> None:
    """Wait in short slices (Ctrl-C stays prompt), counted as blocked in a pool."""
    done = threading.Lock()  # released by the completing thread
    done.acquire()
    on_done(fut, lambda _f: done.release())
    with blocking():
        while not done.acquire(timeout=_SLICE):  # slices keep Ctrl-C prompt
            pass


TRACEBACK_ATTR = "_nbrpc_traceback"


def detach(e: BaseException) -> BaseException:
    """Keep ``e``'s traceback as text (``pack_error`` sends it) and drop the
    frames, so that storing ``e`` in a future makes no uncollectable cycle."""
    tb = e.__traceback__
    if tb is not None:
        if getattr(e, TRACEBACK_ATTR, None) is None:
            try:
                setattr(e, TRACEBACK_ATTR, format_exception(e))
            except Exception:  # an exception type without attributes
                pass
        e.__traceback__ = None
    return e


def outcome(fut: torch.futures.Future, read: Callable | None = None
            ) -> tuple[Any, BaseException | None]:
    """``(value, None)`` or ``(None, error)`` of a completed future, without
    raising (see the module docstring for why).

    >>> f = torch.futures.Future(); f.set_exception(ValueError("no"))
    >>> outcome(f)
    (None, ValueError('no'))
    """
    try:
        return (read or type(fut).value)(fut), None
    except BaseException as e:
        return None, detach(e)


def fresh(e: BaseException) -> BaseException:
    """A copy of a stored error, to raise: its traceback will reference the
    raiser's frames, and it must not be the object the future holds."""
    cls = type(e)
    new = None
    # the nearest __new__ that accepts the class (an error deriving from both
    # RuntimeError and OSError needs OSError's)
    for base in cls.__mro__:
        make = base.__dict__.get("__new__")
        if make is None:
            continue
        try:
            new = make(cls, *e.args)
            break
        except TypeError:
            continue
    if new is None:  # an exotic exception type: raise the stored one
        return e
    try:
        new.args = e.args
        new.__dict__.update(e.__dict__)
        new.__dict__.pop(TRACEBACK_ATTR, None)  # it gets its own traceback
    except Exception:
        return e
    new.__cause__ = e.__cause__
    new.__suppress_context__ = True
    return new
