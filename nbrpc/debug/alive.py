"""What keeps an RRef's value alive, across the group, and how to let go.

:func:`why_alive` gathers the causes: user forks and their holders, owner-side
objects, forks and deletes in flight, and on every member the Python
references to its RRef objects, in words (:mod:`.referrers`). A reference
that IPython's output history holds (a cell displayed the RRef) is dropped
by :func:`forget_outputs` on one member, :func:`forget_outputs_everywhere`
on all; :func:`output_refs` lists them without walking the heap. The shell
itself is read through :mod:`nbrpc.ipython`.
"""

from __future__ import annotations

import gc
from typing import Any

from .. import ipython
from ..agent import current_agent, gcfreeze, internal
from ..rref import RRef
from .graph import rref_graph
from .referrers import Scope, references
from .words import plural


def why_alive(rref: Any, timeout: float = 10.0) -> dict[str, Any]:
    """What keeps an RRef's value alive, across the group.

    ``rref`` is an RRef or its id (``"0:3"``). Returns ``reasons`` (text, one
    per cause: user forks and their holders, owner-side objects, pending
    forks, deletes in flight), ``references`` (per worker, the Python
    references to its RRef objects: variables, containers, IPython's ``Out``
    history) and ``hints`` (how to let go).

    >>> from nbrpc import rpc, debug
    >>> rpc.init_rpc("d", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> kept = rpc.remote("d", dict)
    >>> debug.why_alive(kept)["reasons"]
    ["1 owner-side RRef object on 'd'"]
    >>> rpc.shutdown()
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
    return ipython.forget_outputs(_has_rref)


def forget_outputs_everywhere(timeout: float = 10.0) -> dict[str, int]:
    """:func:`forget_outputs` on this member and on every other one (by RPC):
    how many output-history references each dropped, by name (outside IPython,
    none).

    >>> from nbrpc import rpc, debug
    >>> rpc.init_rpc("d", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> debug.forget_outputs_everywhere()
    {'d': 0}
    >>> rpc.shutdown()
    """
    agent = current_agent("debug.forget_outputs_everywhere")
    dropped = {agent.name: forget_outputs()}  # here first (the notebook's kernel)
    futs = {w.name: agent.rpc_async(w.id, forget_outputs, (), timeout=timeout)
            for w in agent.worker_infos() if w.name != agent.name}
    dropped.update({name: f.wait() for name, f in futs.items()})
    return dict(sorted(dropped.items()))


def output_refs(timeout: float = 10.0) -> dict[str, dict[str, list[str]]]:
    """Per member, the RRefs that IPython's output history keeps (a cell displayed
    them): ``{worker: {rref id: ["Out[4]", "_"]}}``. Cheap: it looks at the output
    names only, not at every referrer (:func:`why_alive` does that). Members
    that keep none (and processes without IPython) are left out.

    >>> from nbrpc import rpc, debug
    >>> rpc.init_rpc("d", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> kept = rpc.remote("d", dict)
    >>> debug.output_refs()
    {}
    >>> rpc.shutdown()
    """
    agent = current_agent("debug.output_refs")
    futs = {w.name: agent.rpc_async(w.id, _outputs_here, (), timeout=timeout)
            for w in agent.worker_infos()}
    return {name: found for name, f in futs.items() if (found := f.wait())}


@internal
def _outputs_here() -> dict[str, list[str]]:
    """This member's RRefs held by IPython's output names (``Out[n]``, ``_``, ``_n``)."""
    agent = current_agent()
    found: dict[str, set[str]] = {}
    for where, value in ipython.output_history():
        items = value if isinstance(value, (list, tuple, set)) else (
            value.values() if isinstance(value, dict) else (value,))
        for x in list(items)[:1000]:
            if isinstance(x, RRef) and x._agent is agent:
                found.setdefault(str(x._id), set()).add(where)
    return {rid: sorted(w) for rid, w in sorted(found.items())}


def _has_rref(v: Any) -> bool:
    """An RRef, or a list, tuple, set or dict with one among its first 1000 items."""
    if isinstance(v, RRef):
        return True
    if isinstance(v, (list, tuple, set)):
        return any(isinstance(x, RRef) for x in list(v)[:1000])
    if isinstance(v, dict):
        return any(isinstance(x, RRef) for x in list(v.values())[:1000])
    return False
