"""Serialization: cloudpickle with out-of-band tensor buffers. Knows nothing of sockets."""

from .code import CodeCache, entry_for
from .explain import a_type, find_unpicklable
from .pickler import (
    Placed,
    current_context,
    dumps,
    loads,
    parallel_copy,
    register_grad_hooks,
    register_reducer,
)
from .source import cell_label, format_exception

__all__ = ["CodeCache", "Placed", "a_type", "cell_label", "current_context", "entry_for", "dumps",
           "find_unpicklable", "format_exception", "loads", "parallel_copy",
           "register_grad_hooks", "register_reducer"]
