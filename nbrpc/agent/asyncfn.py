"""Functions whose RPC answer is the future they return (``@async_execution``).

A marked function frees its worker thread as soon as it returns its future;
the agent answers the call when that future completes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# Set on a function whose RPC answer is the future it returns (the same
# attribute as PyTorch's @async_execution, so either decorator works).
ASYNC_ATTR = "_wrapped_async_rpc_function"


def is_async(fn: Any) -> bool:
    """Was ``fn`` (or the function of bound method ``fn``) marked @async_execution?"""
    return getattr(getattr(fn, "__func__", fn), ASYNC_ATTR, None) is not None


def mark_async(fn: Callable, original: Callable | None = None) -> Callable:
    """Mark ``fn`` as returning a future that is the call's answer."""
    setattr(fn, ASYNC_ATTR, original or fn)
    return fn


def check_future(fn: Any, result: Any) -> torch.futures.Future:
    """The future an @async_execution function returned, or a clear TypeError."""
    if not isinstance(result, torch._C.Future):
        raise TypeError(
            f"{_qualname(fn)} is decorated with @async_execution, so it must return "
            f"a torch.futures.Future; it returned {type(result).__name__}.")
    return result


def _qualname(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)
