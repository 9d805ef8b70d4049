"""One worker's agent state as plain data (:func:`snapshot`), and every member's
(:func:`gather`): what the graphs, tables and traces of this package are made of."""

from __future__ import annotations

from typing import Any

from ..agent import current_agent, internal


def snapshot(events: int | None = 200) -> dict[str, Any]:
    """This worker's agent state: counters, in-flight calls, recent events, RRefs.

    >>> from nbrpc import rpc, debug
    >>> rpc.init_rpc("d", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> _ = rpc.rpc_sync("d", abs, args=(-1,))
    >>> snap = debug.snapshot()
    >>> snap["name"], snap["counters"]["requests_sent"]
    ('d', 1)
    >>> events = {e["event"] for e in snap["events"] if e["op"] == "call"}
    >>> sorted(events & {"send", "recv"})  # sent, answered (its "serve" follows the answer)
    ['recv', 'send']
    >>> rpc.shutdown()
    """
    return current_agent("debug.snapshot").snapshot(events)


@internal
def _snapshot_here(events: int | None) -> dict[str, Any]:
    return current_agent().snapshot(events)


def gather(events: int | None = 200, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Snapshots of every member of the group, by rank (one RPC to each, in parallel).

    >>> from nbrpc import rpc, debug
    >>> rpc.init_rpc("d", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> [(s["name"], s["rank"]) for s in debug.gather(events=0)]
    [('d', 0)]
    >>> rpc.shutdown()
    """
    agent = current_agent("debug.gather")
    futs = [agent.rpc_async(w.id, _snapshot_here, (events,), timeout=timeout)
            for w in agent.worker_infos()]
    return [f.wait() for f in futs]
