"""Serialization: cloudpickle with out-of-band tensor buffers. Knows nothing of sockets."""

from .code import CodeCache, entry_for
from .pickler import (
    current_context,
    dumps,
    loads,
    parallel_copy,
    register_grad_hooks,
    register_reducer,
)

__all__ = ["CodeCache", "current_context", "entry_for", "dumps", "loads", "parallel_copy", "register_grad_hooks",
           "register_reducer"]
