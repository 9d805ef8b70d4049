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
    """The group's RRefs as plain data (a dict; see :func:`rref_graph`), with a view."""

    def widget(self, **options: Any) -> Any:
        """The RRef graph widget (workers as lanes, values and their forks; click a
        value for ``why_alive``). Needs the notebook packages."""
        return views.make("rref_graph", self, **options)


class OwnerMap(dict):
    """Per worker, what it owns (a dict; see :func:`owner_map`), with a view and a plot."""

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
    """Per worker, the values it owns: id, type, size, state, who holds them."""
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
    """One row per reference (owner-side or user fork), sorted by id and worker."""
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
    with fork id and state), parent → child (``pending``)."""
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

