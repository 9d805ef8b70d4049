"""Serialization: cloudpickle with out-of-band tensor buffers. Knows nothing of sockets."""

from .pickler import (
    current_context,
    dumps,
    loads,
    parallel_copy,
    register_grad_hooks,
    register_reducer,
)

__all__ = ["current_context", "dumps", "loads", "parallel_copy", "register_grad_hooks",
           "register_reducer"]
