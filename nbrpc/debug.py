"""Plain-data views of agents, for scripts, tests and (later) widgets.

>>> from nbrpc import rpc, debug
>>> rpc.init_rpc("d", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
>>> _ = rpc.rpc_sync("d", abs, args=(-1,))
>>> snap = debug.snapshot()
>>> snap["name"], snap["counters"]["requests_sent"] >= 1
('d', True)
>>> [w["name"] for w in debug.gather()]
['d']
>>> rpc.shutdown()
"""

from __future__ import annotations

from typing import Any

from .agent import current_agent


def snapshot(events: int | None = 200) -> dict[str, Any]:
    """This worker's agent state: counters, in-flight calls, recent events, RRefs."""
    return current_agent("debug.snapshot").snapshot(events)


def _snapshot_here(events: int | None) -> dict[str, Any]:
    return current_agent().snapshot(events)


def gather(events: int | None = 200, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Snapshots of every member of the group, by rank (one RPC to each, in parallel)."""
    agent = current_agent("debug.gather")
    futs = [agent.rpc_async(w.id, _snapshot_here, (events,), timeout=timeout)
            for w in agent.worker_infos()]
    return [f.wait() for f in futs]

