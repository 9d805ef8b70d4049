"""Plain-data views of agents and RRef lifetimes, for scripts, tests and widgets.

Per worker: :func:`snapshot` (this one) and :func:`gather` (everyone). Merged
across the group: :func:`rref_graph` (owners → users, with states),
:func:`owner_map` (per worker, what it owns and who holds it),
:func:`rref_table` (one flat row per reference), :func:`to_networkx`,
:func:`why_alive` (which users, pending messages and Python references keep
a value alive: IPython's ``Out`` history included) and :func:`forget_outputs`
(let go of RRefs that IPython keeps because a cell displayed them).

>>> from nbrpc import rpc, debug
>>> rpc.init_rpc("d", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
>>> _ = rpc.rpc_sync("d", abs, args=(-1,))
>>> snap = debug.snapshot()
>>> snap["name"], snap["counters"]["requests_sent"] >= 1
('d', True)
>>> [w["name"] for w in debug.gather()]
['d']
>>> kept = rpc.remote("d", list, args=("ab",))
>>> [row["type"] for row in debug.owner_map()["d"]]
['builtins.list']
>>> debug.why_alive(kept)["reasons"][0]
"1 owner-side RRef object on 'd'"
>>> rpc.shutdown()
"""

from __future__ import annotations

import gc
import sys
from typing import Any

from .. import views
from ..agent import current_agent, gcfreeze, internal
from ..rref import RRef
from .referrers import Scope, is_output_name, references
from .words import plural


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



def snapshot(events: int | None = 200) -> dict[str, Any]:
    """This worker's agent state: counters, in-flight calls, recent events, RRefs."""
    return current_agent("debug.snapshot").snapshot(events)


@internal
def _snapshot_here(events: int | None) -> dict[str, Any]:
    return current_agent().snapshot(events)


def gather(events: int | None = 200, timeout: float = 10.0) -> list[dict[str, Any]]:
    """Snapshots of every member of the group, by rank (one RPC to each, in parallel)."""
    agent = current_agent("debug.gather")
    futs = [agent.rpc_async(w.id, _snapshot_here, (events,), timeout=timeout)
            for w in agent.worker_infos()]
    return [f.wait() for f in futs]


# -- the RRef graph --------------------------------------------------------------
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
                "nbytes": v["nbytes"], "site": v["site"], "age": v["age"],
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
            "held_by": sorted(set(v["users"].values())), "owner_refs": v["owner_refs"],
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


# -- why is this alive? ---------------------------------------------------------
def why_alive(rref: Any, timeout: float = 10.0) -> dict[str, Any]:
    """What keeps an RRef's value alive, across the group.

    ``rref`` is an RRef or its id (``"0:3"``). Returns ``reasons`` (text, one
    per cause: user forks and their holders, owner-side objects, pending
    forks, deletes in flight), ``references`` (per worker, the Python
    references to its RRef objects: variables, containers, IPython's ``Out``
    history) and ``hints`` (how to let go).
    """
    agent = current_agent("debug.why_alive")
    rid = str(getattr(rref, "_id", rref))
    graph = rref_graph()
    futs = {w.name: agent.rpc_async(w.id, _references_here, (rid,), timeout=timeout)
            for w in agent.worker_infos()}
    references = {name: f.wait() for name, f in futs.items()}
    reasons: list[str] = []
    hints: list[str] = []
    value = graph["values"].get(rid)
    if value is None:
        reasons.append(f"RRef {rid} is owned by no live worker (already freed)")
    else:
        if value["owner_refs"]:
            reasons.append(f"{plural(value['owner_refs'], 'owner-side RRef object')} "
                           f"on {value['owner']!r}")
        for fork, holder in sorted(value["users"].items()):
            u = next((u for u in graph["users"]
                      if u["fork_id"] == fork and u["worker"] == holder), None)
            state = u["state"] if u else "registered (its RRef not received yet)"
            reasons.append(f"user fork {fork} held by {holder!r} ({state})")
    for p in graph["pending"]:
        if any(u["fork_id"] == p["fork_id"] and u["rref_id"] == rid for u in graph["users"]):
            reasons.append(f"fork {p['fork_id']} sent by {p['from']!r} to {p['to']!r} "
                           "is not accepted yet; the sender keeps its copy until then")
    for u in graph["users"]:
        if u["rref_id"] == rid and u["state"] == "deleting":
            reasons.append(f"{u['worker']!r} sent a delete for fork {u['fork_id']}; "
                           "it is in flight")
    for worker, refs in references.items():
        if any(r.startswith(("Out[", "IPython output")) for r in refs):
            hints.append(
                f"On {worker!r}, IPython's output history holds it (a cell displayed it): "
                "run nbrpc.debug.forget_outputs() there, and end cells that show RRefs "
                "with ';'. (%reset -f out is not enough: IPython keeps the last output "
                "in a hidden namespace.)")
        elif refs:
            hints.append(f"On {worker!r}, delete these references: {', '.join(refs)}.")
    return {"rref_id": rid, "reasons": reasons, "references": references, "hints": hints}


@internal
def _references_here(rid: str) -> list[str]:
    """Python references to this worker's RRef objects with id ``rid``, in words
    (see :mod:`.referrers`)."""
    agent = current_agent()
    live = agent.ext["rref"].live_objects()
    objs = [r for r in live if str(r._id) == rid]
    del live
    gcfreeze.thaw()  # gc.get_referrers skips frozen objects (the notebook's namespace)
    gc.collect()
    scope = Scope()
    return sorted({text for obj in objs for text in references(obj, scope, ignore=(objs,))})


@internal
def forget_outputs() -> int:
    """Drop IPython's output-history references to RRefs in this process
    (``Out[n]``, ``_``, ``__``, ``___``, ``_n``, the hidden namespace and the
    display hook); returns how many were dropped. Nothing happens outside IPython.

    >>> forget_outputs()
    0
    """
    ns = getattr(sys.modules.get("__main__"), "__dict__", {})
    get_ipython = ns.get("get_ipython")
    shell = get_ipython() if callable(get_ipython) else None
    if shell is None:
        return 0
    dropped = 0
    for d in (ns, getattr(shell, "user_ns_hidden", {})):
        for k in [k for k, v in d.items() if is_output_name(k) and _has_rref(v)]:
            d[k] = None
            dropped += 1
    out = ns.get("Out")
    if isinstance(out, dict):
        for k in [k for k, v in out.items() if _has_rref(v)]:
            del out[k]
            dropped += 1
    hook = getattr(shell, "displayhook", None)
    for attr in ("_", "__", "___"):
        if _has_rref(getattr(hook, attr, None)):
            setattr(hook, attr, None)
    last = getattr(shell, "last_execution_result", None)
    if last is not None and _has_rref(getattr(last, "result", None)):
        last.result = None
    gc.collect()
    return dropped


def forget_outputs_everywhere(timeout: float = 10.0) -> dict[str, int]:
    """:func:`forget_outputs` on this member and on every other one (by RPC):
    how many output-history references each dropped, by name."""
    agent = current_agent("debug.forget_outputs_everywhere")
    dropped = {agent.name: forget_outputs()}  # here first (the notebook's kernel)
    futs = {w.name: agent.rpc_async(w.id, forget_outputs, (), timeout=timeout)
            for w in agent.worker_infos() if w.name != agent.name}
    dropped.update({name: f.wait() for name, f in futs.items()})
    return dict(sorted(dropped.items()))


def output_refs(timeout: float = 10.0) -> dict[str, dict[str, list[str]]]:
    """Per member, the RRefs that IPython's output history keeps (a cell displayed
    them): ``{worker: {rref id: ["Out[4]", "_"]}}``. Cheap: it looks at the output
    names only, not at every referrer (:func:`why_alive` does that)."""
    agent = current_agent("debug.output_refs")
    futs = {w.name: agent.rpc_async(w.id, _outputs_here, (), timeout=timeout)
            for w in agent.worker_infos()}
    return {name: found for name, f in futs.items() if (found := f.wait())}


@internal
def _outputs_here() -> dict[str, list[str]]:
    """This member's RRefs held by IPython's output names (``Out[n]``, ``_``, ``_n``)."""
    agent = current_agent()
    ns = getattr(sys.modules.get("__main__"), "__dict__", {})
    if not callable(ns.get("get_ipython")):
        return {}
    found: dict[str, set[str]] = {}

    def note(value: Any, where: str) -> None:
        items = value if isinstance(value, (list, tuple, set)) else (
            value.values() if isinstance(value, dict) else (value,))
        for x in list(items)[:1000]:
            if isinstance(x, RRef) and x._agent is agent:
                found.setdefault(str(x._id), set()).add(where)

    out = ns.get("Out")
    for k, v in list(out.items()) if isinstance(out, dict) else []:
        note(v, f"Out[{k}]")
    for k, v in list(ns.items()):
        if is_output_name(k):
            note(v, k)
    return {rid: sorted(w) for rid, w in sorted(found.items())}


def _has_rref(v: Any) -> bool:
    if isinstance(v, RRef):
        return True
    if isinstance(v, (list, tuple, set)):
        return any(isinstance(x, RRef) for x in list(v)[:1000])
    if isinstance(v, dict):
        return any(isinstance(x, RRef) for x in list(v.values())[:1000])
    return False


from .trace import Trace, trace  # noqa: E402 - the trace module imports this package's deps

__all__ = ["OwnerMap", "RRefGraph", "Trace", "forget_outputs", "forget_outputs_everywhere",
           "gather", "output_refs", "owner_map", "plural", "rref_graph", "rref_table", "snapshot",
           "to_networkx", "trace", "why_alive"]
