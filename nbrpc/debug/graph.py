"""The group's RRefs merged from every member's snapshot: :func:`rref_graph`
(owners → users, with states), :func:`owner_map` (per worker, what it owns and
who holds it), :func:`rref_table` (one flat row per reference) and
:func:`to_networkx`. The graph and the map are dicts with a ``.widget()``.
"""

from __future__ import annotations

from typing import Any

from .. import views
from .snapshots import gather


class RRefGraph(dict):
    """The group's RRefs as plain data (a dict; see :func:`rref_graph`), with a view.

    >>> from nbrpc import rpc, debug
    >>> rpc.init_rpc("d", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> kept = rpc.remote("d", dict)
    >>> g = debug.rref_graph()
    >>> isinstance(g, dict), sorted(g)
    (True, ['edges', 'pending', 'users', 'values', 'workers'])
    >>> type(g.widget()).__name__  # in a notebook: the drawing
    'RRefGraphView'
    >>> rpc.shutdown()
    """

    def widget(self, **options: Any) -> Any:
        """The RRef graph widget (workers as lanes, values and their forks; click a
        value for ``why_alive``). Needs the notebook packages."""
        return views.make("rref_graph", self, **options)


class OwnerMap(dict):
    """Per worker, what it owns (a dict; see :func:`owner_map`), with a view and a plot.

    >>> from nbrpc import rpc, debug
    >>> rpc.init_rpc("d", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> kept = rpc.remote("d", dict)
    >>> omap = debug.owner_map()
    >>> {w: len(rows) for w, rows in omap.items()}, type(omap.widget()).__name__
    ({'d': 1}, 'OwnerMapView')
    >>> rpc.shutdown()
    """

    def widget(self, **options: Any) -> Any:
        """The owner map widget: per worker its values, their holders and bytes."""
        return views.make("owner_map", self, **options)


def rref_graph(snapshots: list[dict[str, Any]] | None = None) -> RRefGraph:
    """Every RRef in the group as plain data.

    ``values``: rref id → owner, state, type, size, creation site, age,
    owner-side object count, and ``users`` (fork id → holding worker).
    ``users``: every user fork with its worker, owner, parent, state.
    ``pending``: forks sent but not yet accepted (parent → child, with the
    rref id). ``edges``: (owner, holder, rref id, fork id, state) for drawing.
    ``workers``: the members' names, by rank.

    >>> from nbrpc import rpc, debug
    >>> rpc.init_rpc("d", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> kept = rpc.remote("d", list, args=("ab",))
    >>> g = debug.rref_graph()
    >>> g["workers"], {rid: (v["owner"], v["type"], v["state"]) for rid, v in g["values"].items()}
    (['d'], {'0:0': ('d', 'builtins.list', 'ready')})
    >>> rpc.shutdown()
    """
    snaps = gather(events=0) if snapshots is None else snapshots
    values: dict[str, dict[str, Any]] = {}
    users: list[dict[str, Any]] = []
    pending: list[dict[str, Any]] = []
    for snap in snaps:
        rr = snap.get("rrefs", {})
        rid_of = {c["fork_id"]: e["rref_id"] for key in ("owned", "users")
                  for e in rr.get(key, []) for c in e.get("pending_children", [])}
        for v in rr.get("owned", []):
            values[v["rref_id"]] = {
                "owner": snap["name"], "state": v["state"], "type": v["type"],
                "nbytes": v["nbytes"], "device": v.get("device"), "site": v["site"],
                "age": v["age"],
                "owner_refs": v["owner_refs"], "users": dict(v["forks"])}
        for u in rr.get("users", []):
            users.append({**{k: u[k] for k in ("rref_id", "fork_id", "owner", "parent",
                                                "state", "site")}, "worker": snap["name"]})
        for c in rr.get("children", []):
            pending.append({"fork_id": c["fork_id"], "rref_id": rid_of.get(c["fork_id"]),
                            "from": snap["name"], "to": c["to"], "age": c["age"]})
    state_of = {(u["worker"], u["fork_id"]): u["state"] for u in users}
    edges = [(v["owner"], holder, rid, fork, state_of.get((holder, fork), "registered"))
             for rid, v in sorted(values.items()) for fork, holder in sorted(v["users"].items())]
    return RRefGraph(values=values, users=users, pending=pending, edges=edges,
                     workers=[s["name"] for s in snaps])


def owner_map(snapshots: list[dict[str, Any]] | None = None) -> OwnerMap:
    """Per worker, the values it owns: id, type, size, state, who holds them.

    >>> from nbrpc import rpc, debug
    >>> rpc.init_rpc("d", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> kept = rpc.remote("d", bytes, args=(1000,))
    >>> [(row["type"], row["nbytes"], row["held_by"]) for row in debug.owner_map()["d"]]
    [('builtins.bytes', 1033, [])]
    >>> rpc.shutdown()
    """
    snaps = gather(events=0) if snapshots is None else snapshots
    graph = rref_graph(snaps)
    out = OwnerMap({s["name"]: [] for s in snaps})
    for rid, v in sorted(graph["values"].items()):
        out.setdefault(v["owner"], []).append({
            "rref_id": rid, "type": v["type"], "nbytes": v["nbytes"], "state": v["state"],
            "device": v.get("device"), "held_by": sorted(set(v["users"].values())), "owner_refs": v["owner_refs"],
            "site": v["site"]})
    return out


def rref_table(snapshots: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One row per reference (owner-side or user fork), sorted by id and worker.

    >>> from nbrpc import rpc, debug
    >>> rpc.init_rpc("d", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> kept = rpc.remote("d", dict)
    >>> [(r["rref_id"], r["worker"], r["role"], r["type"]) for r in debug.rref_table()]
    [('0:0', 'd', 'owner', 'builtins.dict')]
    >>> rpc.shutdown()
    """
    graph = rref_graph(snapshots)
    rows = [{"rref_id": rid, "worker": v["owner"], "role": "owner", "fork_id": None,
             "state": v["state"], "type": v["type"], "nbytes": v["nbytes"], "site": v["site"]}
            for rid, v in graph["values"].items()]
    for u in graph["users"]:
        v = graph["values"].get(u["rref_id"], {})
        rows.append({"rref_id": u["rref_id"], "worker": u["worker"], "role": "user",
                     "fork_id": u["fork_id"], "state": u["state"], "type": v.get("type"),
                     "nbytes": v.get("nbytes"), "site": u["site"]})
    return sorted(rows, key=lambda r: (r["rref_id"], r["role"] != "owner", r["worker"]))


def to_networkx(graph: RRefGraph | None = None) -> Any:
    """The RRef graph as a ``networkx.MultiDiGraph``: worker nodes and value nodes
    (``"rref 0:3"``); edges owner → value (``owns``), value → holder (``held``,
    with fork id and state), parent → child (``pending``).

    >>> from nbrpc import rpc, debug
    >>> rpc.init_rpc("d", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> kept = rpc.remote("d", dict)
    >>> g = debug.to_networkx()
    >>> sorted(g.nodes), [kind for _, _, kind in g.edges(data="kind")]
    (['d', 'rref 0:0'], ['owns'])
    >>> rpc.shutdown()
    """
    import networkx as nx

    graph = rref_graph() if graph is None else graph
    g = nx.MultiDiGraph()
    for rid, v in graph["values"].items():
        node = f"rref {rid}"
        g.add_node(v["owner"], kind="worker")
        g.add_node(node, kind="value", **{k: v[k] for k in ("state", "type", "nbytes", "site")})
        g.add_edge(v["owner"], node, kind="owns")
        for fork, holder in v["users"].items():
            g.add_node(holder, kind="worker")
            g.add_edge(node, holder, kind="held", fork_id=fork)
    for u in graph["users"]:
        g.add_node(u["worker"], kind="worker")
    for p in graph["pending"]:
        g.add_edge(p["from"], p["to"], kind="pending", fork_id=p["fork_id"])
    return g

