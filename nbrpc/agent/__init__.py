"""The agent layer: one agent per RPC participant."""

from .agent import (
    Agent,
    AgentOptions,
    Deferred,
    MessageContext,
    Propagator,
    current_agent,
    internal,
    register_extension,
    set_default_agent,
)
from .asyncfn import check_future, is_async, mark_async
from .futures import RpcFuture, detach, fresh, on_done, outcome, wait_result
from .group import WorkerInfo

__all__ = ["Agent", "AgentOptions", "Deferred", "MessageContext", "Propagator", "RpcFuture",
           "WorkerInfo", "check_future", "current_agent", "detach", "fresh", "internal",
           "is_async", "mark_async", "on_done", "outcome", "register_extension",
           "set_default_agent", "wait_result"]
