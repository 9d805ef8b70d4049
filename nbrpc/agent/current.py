"""Which agent a thread uses: its own agent's, or the process default."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ..errors import NotInitializedError

if TYPE_CHECKING:
    from .agent import Agent


_local = threading.local()


def current_agent(what: str = "this call") -> Agent:
    """The agent of this thread: an agent's own threads use their agent, any
    other thread the process default set by ``init_rpc``."""
    agent = getattr(_local, "agent", None) or _Default.agent
    if agent is None:
        raise NotInitializedError(what)
    return agent


class _Default:
    agent: Agent | None = None  # the process default, set by nbrpc.rpc.init_rpc


def set_default_agent(agent: Agent | None) -> None:
    _Default.agent = agent

