"""The agent layer: one agent per RPC participant."""

from .agent import (
           Agent,
           AgentOptions,
           Deferred,
           current_agent,
           register_extension,
           set_default_agent,
)
from .futures import RpcFuture
from .group import WorkerInfo

__all__ = ["Agent", "AgentOptions", "Deferred", "RpcFuture", "WorkerInfo", "current_agent",
           "register_extension", "set_default_agent"]
