"""Plain-data views of agents and RRef lifetimes, for scripts, tests and widgets.

This package's face; each concept lives in its own module:

* :mod:`.snapshots`: per worker, :func:`snapshot` (this one) and
  :func:`gather` (everyone).
* :mod:`.graph`: merged across the group, :func:`rref_graph` (owners →
  users, with states), :func:`owner_map` (per worker, what it owns and who
  holds it), :func:`rref_table` (one flat row per reference), :func:`to_networkx`.
* :mod:`.alive`: :func:`why_alive` (which users, pending messages and Python
  references keep a value alive: IPython's ``Out`` history included, named by
  :mod:`.referrers`) and :func:`forget_outputs` (let go of RRefs that IPython
  keeps because a cell displayed them).
* :mod:`.trace`: :func:`trace`, the messages exchanged while a block ran.

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

from .alive import forget_outputs, forget_outputs_everywhere, output_refs, why_alive
from .graph import OwnerMap, RRefGraph, owner_map, rref_graph, rref_table, to_networkx
from .snapshots import gather, snapshot
from .trace import Trace, trace
from .words import plural

__all__ = ["OwnerMap", "RRefGraph", "Trace", "forget_outputs", "forget_outputs_everywhere",
           "gather", "output_refs", "owner_map", "plural", "rref_graph", "rref_table", "snapshot",
           "to_networkx", "trace", "why_alive"]
