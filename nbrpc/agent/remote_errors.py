"""How a failure on the callee travels back and is raised again on the caller.

The callee sends an :class:`~nbrpc.agent.messages.Err`: the exception pickled
on its own (so that a type the caller cannot import does not spoil the whole
answer), its type name, message and traceback text. The caller raises the
original exception, with the remote traceback as its ``__cause__`` (the
frames of the user's code: the callee's own are left out, and a notebook
cell's frame is named as IPython names it, ``Cell In[7], line 2``) and
``remote_worker`` / ``remote_traceback`` attributes, or a
:class:`~nbrpc.errors.RemoteError` when the type cannot be rebuilt there.
"""

from __future__ import annotations

from typing import Any

import cloudpickle

from ..errors import RemoteError, RemoteTraceback
from ..serialize import format_exception
from .futures import TRACEBACK_ATTR
from .messages import Err


def pack_error(e: BaseException, worker: str) -> Err:
    """The message that carries ``e`` back to the caller."""
    tb = getattr(e, TRACEBACK_ATTR, None) or format_exception(e)
    try:
        exc_pickle = cloudpickle.dumps(e) if isinstance(e, Exception) else None
    except Exception:
        exc_pickle = None
    # an error that came from further away keeps the worker it was raised on
    worker = getattr(e, "remote_worker", None) or worker
    return Err(worker, f"{type(e).__module__}.{type(e).__qualname__}", message_of(e), tb,
               exc_pickle)


def message_of(e: BaseException) -> str:
    """``str(e)``, or a note saying it failed: an exception whose ``__str__``
    raises must not cost its caller the answer.

    >>> message_of(ValueError("no"))
    'no'
    """
    try:
        return str(e)
    except Exception as why:
        return f"<the message could not be written: {type(why).__name__}: {why}>"


def rebuild_error(err: Err) -> BaseException:
    """The exception to raise on the caller for ``err``."""
    exc: Any = None
    why = ("the callee could not pickle it, or it is a BaseException such as SystemExit, "
           "which is only described")
    if err.exc_pickle is not None:
        try:
            exc = cloudpickle.loads(err.exc_pickle)
        except Exception as e:
            why = f"unpickling it raised {type(e).__name__}: {e}"
    if not isinstance(exc, Exception):
        return RemoteError(err.worker, err.type_name, err.message, err.traceback, why)
    exc.__dict__.pop(TRACEBACK_ATTR, None)  # the callee's; it is in the cause below
    exc.__dict__.pop("_nbrpc_logged", None)  # (the callee's logging mark)
    # a traceback with frames is the cause; one that is only the message
    # (an error made by the callee, not raised) would repeat it
    framed = err.traceback.lstrip().startswith("Traceback")
    exc.__cause__ = RemoteTraceback(f'\n"""\n{err.traceback.rstrip()}\n"""') if framed else None
    try:
        exc.remote_worker = err.worker
        exc.remote_traceback = err.traceback
    except Exception:
        pass
    if hasattr(exc, "add_note"):
        shown = "; its traceback is shown above" if framed else ""
        exc.add_note(f"(raised on worker {err.worker!r}{shown})")
    return exc
