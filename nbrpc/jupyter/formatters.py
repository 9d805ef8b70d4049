"""Rich displays of nbrpc's core objects, registered with IPython when the extension loads.

Core classes carry no HTML: ``%load_ext nbrpc`` registers a ``text/html``
formatter for each here (an RRef, a future, a cluster status, a backward
stepper, an RRef graph, an owner map, a message trace) and ``%unload_ext nbrpc`` removes
them. A formatter that fails logs why and returns None, so IPython falls
back to the object's ``text/plain``. The HTML of the graphs, maps, traces,
steppers and cluster statuses is their view module's static form.

>>> from IPython.core.interactiveshell import InteractiveShell
>>> ip = InteractiveShell.instance()
>>> register(ip)
>>> from nbrpc.cluster import ClusterStatus
>>> data, _ = ip.display_formatter.format(ClusterStatus("-", "stopped", []))
>>> data["text/html"]
'<div><b>nbrpc cluster (no workers): stopped</b></div>'
>>> unregister(ip)
>>> "text/html" in ip.display_formatter.format(ClusterStatus("-", "stopped", []))[0]
False
>>> InteractiveShell.clear_instance()
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from ..agent import futures as _futures
from ..agent.agent import _Default
from ..autograd.stepper import BackwardStepper
from ..cluster.status import ClusterStatus
from ..debug import OwnerMap, RRefGraph
from ..debug.trace import Trace
from ..rref import RRef
from .cluster_view import cluster_html
from .owner_map_view import owner_map_html
from .rref_graph_view import rref_graph_html
from .stepper_view import stepper_html
from .svg import esc
from .trace_view import trace_html
from .view import varies

log = logging.getLogger(__name__)

_FUTURE_COLOURS = {"pending": "#1565c0", "done": "#2e7d32", "failed": "#c62828"}


def _safe(fn: Callable[[Any], str | None]) -> Callable[[Any], str | None]:
    """A formatter never raises into the cell: it logs and lets text/plain show."""

    @functools.wraps(fn)
    def formatter(obj: Any) -> str | None:
        try:
            return fn(obj)
        except Exception:  # noqa: BLE001 - a display must not break the cell
            log.warning("nbrpc: no HTML display of a %s", type(obj).__name__, exc_info=True)
            return None

    return formatter


# -- RRefs and futures -----------------------------------------------------------------
def rref_html(rref: RRef) -> str:
    """An RRef in one line: id, owner, the value's type when known here, whether
    the owner has confirmed this copy, and where it was created."""
    owner = rref.owner_name()
    if rref.is_owner():
        role, typ = "owner", _local_type(rref)
    else:
        role, typ = f"user (fork {rref._fork})", None
    confirmed = "confirmed" if rref.confirmed_by_owner() else "not yet confirmed"
    parts = [f"<b>RRef</b> <code>{esc(rref._id)}</code> owned by <b>{esc(owner)}</b>",
             esc(role)]
    if typ:
        parts.append(f"<code>{esc(typ)}</code>")
    parts.append(varies(esc(confirmed)))  # a race with the owner's acknowledgement
    parts.append(f"created at {esc(rref._site)}")
    return f'<span class="nbrpc-rref">{" · ".join(parts)}</span>'


def _local_type(rref: RRef) -> str | None:
    entry = rref._ctx.state.owned.get(rref._id)
    fut = getattr(entry, "value", None)
    if fut is None or not fut.done():
        return None
    try:
        value = fut.value()
    except Exception as e:  # noqa: BLE001 - the creation failed: say so
        return f"failed: {type(e).__name__}"
    return f"{type(value).__module__}.{type(value).__qualname__}"


def future_html(fut: _futures.RpcFuture) -> str:
    """A future: pending, done or failed; while pending, the call's op and peer
    (found among the default agent's calls in flight)."""
    if not fut.done():
        state, what = "pending", _pending_call(fut)
    else:
        try:
            fut.value()
            state, what = "done", ""
        except Exception as e:  # noqa: BLE001 - the failure is what we show
            state, what = "failed", f"{type(e).__name__}: {e}"
    colour = _FUTURE_COLOURS[state]
    tail = f" · {esc(what)}" if what else ""
    return (f'<span class="nbrpc-future"><b>RpcFuture</b> '
            f'<b style="color:{colour}">{state}</b>{tail}</span>')


def _pending_call(fut: Any) -> str:
    agent = _Default.agent
    pending = agent.caller.pending if agent is not None else None
    if not pending:
        return ""
    for p in list(pending.values())[:100_000]:  # bounded: the calls in flight
        if p.future is fut:
            return f"{p.op} to {agent.peer_name(p.peer)}"
    return ""


# -- the registry --------------------------------------------------------------------------
FORMATTERS: dict[type, Callable[[Any], str | None]] = {
    RRef: _safe(rref_html),
    _futures.RpcFuture: _safe(future_html),
    ClusterStatus: _safe(cluster_html),
    BackwardStepper: _safe(stepper_html),
    RRefGraph: _safe(rref_graph_html),
    OwnerMap: _safe(owner_map_html),
    Trace: _safe(trace_html),
}


def register(ip: Any) -> None:
    """Register the ``text/html`` formatters with IPython's shell ``ip``."""
    html = ip.display_formatter.formatters["text/html"]
    for cls, fn in FORMATTERS.items():
        html.for_type(cls, fn)


def unregister(ip: Any) -> None:
    """Remove what :func:`register` added (formatters registered by others stay)."""
    html = ip.display_formatter.formatters["text/html"]
    for cls, fn in FORMATTERS.items():
        if html.type_printers.get(cls) is fn:
            html.pop(cls)
