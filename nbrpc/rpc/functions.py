"""``nbrpc.rpc.functions``: decorators for functions that run remotely."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

from ..agent import mark_async

__all__ = ["async_execution"]

F = TypeVar("F", bound=Callable)


def async_execution(fn: F) -> F:
    """Mark ``fn`` as returning a ``torch.futures.Future`` when run by RPC.

    The callee's worker thread is released as soon as ``fn`` returns its
    future; the reply is sent when that future completes. Nested calls can
    then never exhaust the worker pool. (Same attribute as PyTorch's
    decorator, so functions decorated with either work.)

    >>> import torch
    >>> @async_execution
    ... def add_later(x):
    ...     fut = torch.futures.Future()
    ...     fut.set_result(x + 1)
    ...     return fut
    >>> add_later._wrapped_async_rpc_function is not None
    True
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)

    return mark_async(wrapper, fn)  # type: ignore[return-value]
