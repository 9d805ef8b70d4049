"""The RRef graph: who owns each value, who holds it, and what keeps it alive.

One lane (column) per worker, by rank. Each value is a node in its owner's
lane, one row per value, labelled with its id, type, size and creation site
(notebook cell and line). Each user fork is a line from the node to a dot in
the holder's lane: solid when registered or confirmed, dashed orange while
pending (a fork sent but not yet accepted is also an arrow from sender to
receiver), dotted red while its delete is in flight. Clicking a value shows
:func:`nbrpc.debug.why_alive` in the side panel.

Flagged (red, "leaked or orphaned"), from what the group's tables say:

* ``orphan``: a user fork (not pending, not deleting) whose value no live
  owner lists, or whose owner is no longer a member;
* ``unreferenced``: a ready value its owner still lists with no user forks,
  no owner-side RRef objects and no pending forks (nothing should keep it);
* ``gone-holder``: a fork registered for a worker that is no longer a member.

Amber: ``output``, a value that IPython's output history (``Out[n]``, ``_``)
keeps on some worker because a cell displayed its RRef; "Forget outputs"
drops those references everywhere.

>>> g = {"workers": ["a", "b"], "pending": [], "edges": [], "users": [
...     {"rref_id": "0:1", "fork_id": "0:2", "owner": "b", "parent": None,
...      "state": "confirmed", "site": "x.py:3", "worker": "a"}],
...     "values": {"0:1": {"owner": "b", "state": "ready", "type": "builtins.list",
...     "nbytes": 72, "site": "x.py:3", "age": 1.0, "owner_refs": 0, "users": {"0:2": "a"}}}}
>>> print(graph_text(graph_model(g)))
RRef graph: 1 value on 1 owner, 1 user fork, 0 pending forks, 0 deleting, 0 flagged
  0:1 on b: builtins.list, 72 B, x.py:3, held by a; ready
>>> 'data-key="0:1"' in rref_graph_html(g)
True
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from typing import Any

from .. import debug
from ..agent import current_agent
from .svg import BACKING, ERROR, MUTED, STRIPE, clip, esc, fmt_bytes, svg
from .view import View, button, toggle, varies

log = logging.getLogger(__name__)

LANE_LIMIT = 400  # values drawn per owner lane; the rest become one summary row
LIMIT = 800  # values drawn in all
TEXT_LIMIT = 60  # value lines in text()
COMPACT_OVER = 120  # more values drawn than this: one-line rows
TOP = 58
EDGE = {"held": ("#5b7083", ""), "pending": ("#E69F00", ' stroke-dasharray="5,3"'),
        "deleting": ("#D55E00", ' stroke-dasharray="1,3"'), "gone": ("#c62828", "")}
FLAG_TEXT = {
    "orphan": "a user fork whose value no live owner has",
    "unreferenced": "listed by its owner with no users, owner-side RRefs or pending forks",
    "gone-holder": "registered for a worker that is no longer a member",
    "output": "kept by IPython's output history (a cell displayed it)",
}
LEAKS = ("orphan", "unreferenced", "gone-holder")
# A value's box: its outline says what it is; its fill is that hue, faint, so that
# the theme's text colour reads on it in a light and a dark theme alike.
LEAK_BOX = ('fill="#c62828" fill-opacity="0.12"', "#c62828")
OUTPUT_BOX = ('fill="#E69F00" fill-opacity="0.15"', "#E69F00")
PLAIN_BOX = ('fill="currentColor" fill-opacity="0.03"', "#5b7083")
NO_FILL = 'fill="none"'



def _size(n: dict[str, Any]) -> str:
    """A value's size, and its device where it is off the CPU ("64.0 MiB on cuda:0")."""
    device = n.get("device")
    return fmt_bytes(n["nbytes"]) + (f" on {device}" if device else "")

def natural(text: str) -> tuple:
    """Sort key: ``worker2`` before ``worker10``, ``0:9`` before ``0:10``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p)
                 for p in re.split(r"(\d+)", str(text)) if p)


def short_type(typ: str | None) -> str:
    return "?" if not typ else typ.rsplit(".", 1)[-1]


# -- the model: plain data the drawing and text() read -------------------------------
def graph_model(graph: dict[str, Any], outputs: dict[str, dict[str, list[str]]] | None = None,
                select: str | None = None, limit: int = LIMIT,
                lane_limit: int = LANE_LIMIT) -> dict[str, Any]:
    """Nodes (one per value, plus ghosts for orphan forks), their holders, pending
    forks and flags, and which nodes are drawn (bounded per lane and in all)."""
    values, members = graph.get("values", {}), list(graph.get("workers") or [])
    nodes: dict[str, dict[str, Any]] = {}
    for rid, v in values.items():
        nodes[rid] = {"rid": rid, "owner": v["owner"], "type": v.get("type"),
                      "nbytes": v.get("nbytes"), "device": v.get("device"),
                      "site": v.get("site", "?"),
                      "state": v.get("state", "ready"), "owner_refs": v.get("owner_refs", 0),
                      "holders": {(h, f): "registered" for f, h in v.get("users", {}).items()},
                      "pending": [], "flags": [], "outputs": []}
    for u in graph.get("users", []):
        rid = u["rref_id"]
        node = nodes.get(rid)
        if node is None:
            owner_gone = bool(members) and u["owner"] not in members
            if u["state"] in ("pending", "deleting") and not owner_gone:
                continue  # on its way to the owner, or being deleted: not a leak
            node = nodes[rid] = {"rid": rid, "owner": u["owner"], "type": None, "nbytes": None,
                                 "site": u.get("site", "?"), "state": "missing",
                                 "owner_refs": 0, "holders": {}, "pending": [],
                                 "flags": ["orphan"], "outputs": []}
        node["holders"][(u["worker"], u["fork_id"])] = u["state"]
    fork_rid = {u["fork_id"]: u["rref_id"] for u in graph.get("users", [])}
    for p in graph.get("pending", []):
        rid = p.get("rref_id") or fork_rid.get(p["fork_id"])
        if rid in nodes:
            nodes[rid]["pending"].append((p["from"], p["to"], p["fork_id"]))
    for worker, found in (outputs or {}).items():
        for rid, names in found.items():
            if rid in nodes:
                nodes[rid]["outputs"] += [f"{n} on {worker}" for n in names]
    for n in nodes.values():
        if (n["state"] == "ready" and not n["holders"] and not n["owner_refs"]
                and not n["pending"]):
            n["flags"].append("unreferenced")
        if members and any(h not in members for h, _ in n["holders"]):
            n["flags"].append("gone-holder")
        if n["outputs"]:
            n["flags"].append("output")
    lanes = members + sorted({w for n in nodes.values()
                              for w in [n["owner"], *(h for h, _ in n["holders"])]}
                             - set(members), key=natural)
    by_lane: dict[str, list[dict[str, Any]]] = {w: [] for w in lanes}
    for rid in sorted(nodes, key=natural):
        by_lane[nodes[rid]["owner"]].append(nodes[rid])
    quota = _quota([len(ns) for ns in by_lane.values()], limit, lane_limit)
    drawn: dict[str, list[dict[str, Any]]] = {}
    hidden: dict[str, list[dict[str, Any]]] = {}
    for w, ns in by_lane.items():
        first = sorted(ns, key=lambda n: (n["rid"] != select, not _notable(n),
                                          natural(n["rid"])))[:quota]
        keep = {n["rid"] for n in first}
        drawn[w] = [n for n in ns if n["rid"] in keep]
        hidden[w] = [n for n in ns if n["rid"] not in keep]
    return {"lanes": lanes, "members": members, "nodes": nodes, "drawn": drawn,
            "hidden": hidden, "select": select}


def _notable(n: dict[str, Any]) -> bool:
    return bool(n["flags"] or n["pending"] or n["state"] != "ready"
                or any(s in ("pending", "deleting") for s in n["holders"].values()))


def _quota(sizes: list[int], limit: int, lane_limit: int) -> int:
    """The largest per-lane count q (at most ``lane_limit``) with sum(min(n, q)) <= limit."""
    lo, hi = 0, lane_limit
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(min(n, mid) for n in sizes) <= limit:
            lo = mid
        else:
            hi = mid - 1
    return max(lo, 1)


def counts(model: dict[str, Any]) -> dict[str, int]:
    nodes = [n for n in model["nodes"].values() if n["state"] != "missing"]
    holders = [s for n in model["nodes"].values() for s in n["holders"].values()]
    return {"values": len(nodes), "owners": len({n["owner"] for n in nodes}),
            "forks": len(holders), "pending": sum(len(n["pending"]) for n in
                                                  model["nodes"].values()),
            "deleting": holders.count("deleting"),
            "flagged": sum(any(f in LEAKS for f in n["flags"]) for n in model["nodes"].values()),
            "outputs": sum("output" in n["flags"] for n in model["nodes"].values())}


def graph_text(model: dict[str, Any], limit: int = TEXT_LIMIT) -> str:
    """Deterministic summary: one sorted line per value (no ages, times, addresses)."""
    c = counts(model)
    plural = lambda k, word: f"{c[k]} {word}{'' if c[k] == 1 else 's'}"  # noqa: E731
    lines = [f"RRef graph: {plural('values', 'value')} on {plural('owners', 'owner')}, "
             f"{plural('forks', 'user fork')}, {plural('pending', 'pending fork')}, "
             f"{c['deleting']} deleting, {c['flagged']} flagged"
             + (f", {c['outputs']} in output history" if c["outputs"] else "")]
    rids = sorted(model["nodes"], key=natural)
    for rid in rids[:limit]:
        n = model["nodes"][rid]
        holders = ", ".join(h + ("" if s in ("registered", "confirmed") else f" ({s})")
                            for (h, _), s in sorted(n["holders"].items(),
                                                    key=lambda kv: natural(kv[0][0])))
        flags = f" [{', '.join(n['flags'])}]" if n["flags"] else ""
        lines.append(f"  {rid} on {n['owner']}: {n['type'] or '?'}, {_size(n)}, "
                     f"{n['site']}, held by {holders or 'nobody'}; {n['state']}{flags}")
    if len(rids) > limit:
        lines.append(f"  … and {len(rids) - limit:,} more")
    return "\n".join(lines)


# -- drawing ----------------------------------------------------------------------------
def graph_svg(model: dict[str, Any]) -> str:
    """The lanes, value nodes, fork lines and summaries of ``model`` as SVG."""
    lanes = model["lanes"] or ["(no workers)"]
    col = max(110.0, min(200.0, 1100.0 / len(lanes)))
    x = {w: 10 + i * col for i, w in enumerate(lanes)}
    n_drawn = sum(len(v) for v in model["drawn"].values())
    compact = n_drawn > COMPACT_OVER
    row = 18 if compact else 32
    y, rows = TOP, []  # (y, lane, node or None for a lane's summary row)
    for w in lanes:
        for n in model["drawn"].get(w, []):
            rows.append((y, w, n))
            y += row
        if model["hidden"].get(w):
            rows.append((y, w, None))
            y += 18
    height = y + 10
    width = max(20 + col * len(lanes), 600)  # at least the legend
    parts = [_legend()]
    for i, w in enumerate(lanes):
        owned = [n for n in model["nodes"].values()
                 if n["owner"] == w and n["state"] != "missing"]
        size = sum(n["nbytes"] or 0 for n in owned)
        gone = bool(model["members"]) and w not in model["members"]
        parts.append(
            f'<g data-f="worker" data-f-worker="{esc(w)}"><rect x="{x[w]:.0f}" y="{TOP - 22}" '
            f'width="{col:.0f}" height="{height - TOP + 22:.0f}" '
            f'{STRIPE if i % 2 == 0 else NO_FILL}/>'
            f'<text x="{x[w] + col / 2:.0f}" y="{TOP - 10}" text-anchor="middle" '
            f'font-weight="bold"{" " + ERROR if gone else ""}>{esc(clip(w, int(col / 7.4)))}'
            f'{" (gone)" if gone else ""}<title>{esc(w)}: owns '
            f'{debug.plural(len(owned), "value")}, {fmt_bytes(size)}</title></text></g>')
    for y0, _, n in rows:
        if n is not None:
            parts.append(_edges(n, y0 + row / 2, x, col))
    for y0, w, n in rows:
        if n is None:
            parts.append(_summary(w, model["hidden"][w], x[w], y0, col))
        else:
            parts.append(_node(n, x[w], y0, col, row, compact, n["rid"] == model["select"]))
    label = f"RRef graph of {', '.join(model['lanes'])}"
    return svg(width, height, "".join(parts), label, themed=True)


def _legend() -> str:
    items = [("held", "held"), ("pending", "pending fork"), ("deleting", "delete in flight")]
    out, x0 = [], 10
    for kind, text in items:
        stroke, dash = EDGE[kind]
        out.append(f'<line x1="{x0}" y1="12" x2="{x0 + 24}" y2="12" stroke="{stroke}" '
                   f'stroke-width="2"{dash}/><text x="{x0 + 28}" y="16">{text}</text>')
        x0 += 40 + 6.6 * len(text)
    for (fill, stroke), text in ((LEAK_BOX, "leaked / orphaned"), (OUTPUT_BOX, "in Out[n]")):
        out.append(f'<rect x="{x0}" y="5" width="14" height="12" {fill} '
                   f'stroke="{stroke}" stroke-width="2"/><text x="{x0 + 18}" y="16">{text}</text>')
        x0 += 30 + 6.6 * len(text)
    return "".join(out)


def _edges(n: dict[str, Any], cy: float, x: dict[str, float], col: float) -> str:
    ox = x[n["owner"]]
    out = []
    for (holder, fork), state in sorted(n["holders"].items(), key=lambda kv: natural(kv[0][0])):
        kind = state if state in ("pending", "deleting") else "held"
        if n["state"] == "missing":
            kind = "gone"
        stroke, dash = EDGE[kind]
        hx = x.get(holder, ox) + col / 2
        sx = ox + col - 8 if hx > ox + col / 2 else ox + 8
        fill = f'fill="{stroke}"' if kind == "held" else BACKING  # hollow: not confirmed
        dot = (f'<circle cx="{hx:.0f}" cy="{cy:.0f}" r="4" {fill} '
               f'stroke="{stroke}" stroke-width="1.5"/>')
        out.append(f'<g data-f="worker" data-f-worker="{esc(n["owner"])} {esc(holder)}">'
                   f'<line x1="{sx:.0f}" y1="{cy:.0f}" x2="{hx:.0f}" y2="{cy:.0f}" '
                   f'stroke="{stroke}" stroke-width="1.6"{dash}/>{dot}<title>'
                   f'{esc(n["rid"])}: fork {esc(fork)} held by {esc(holder)} ({esc(state)})'
                   "</title></g>")
    for src, dst, fork in sorted(n["pending"]):
        x0, x1 = x.get(src, ox) + col / 2, x.get(dst, ox) + col / 2
        stroke, dash = EDGE["pending"]
        out.append(f'<g data-f="worker" data-f-worker="{esc(src)} {esc(dst)}">'
                   f'<path d="M{x0:.0f},{cy + 3:.0f} Q{(x0 + x1) / 2:.0f},{cy + 14:.0f} '
                   f'{x1:.0f},{cy + 3:.0f}" fill="none" stroke="{stroke}" stroke-width="1.6"'
                   f'{dash}/><circle cx="{x1:.0f}" cy="{cy + 3:.0f}" r="2.5" fill="{stroke}"/>'
                   f"<title>fork {esc(fork)} of {esc(n['rid'])} sent by {esc(src)} to "
                   f"{esc(dst)}: not accepted yet</title></g>")
    return "".join(out)


def _node(n: dict[str, Any], x0: float, y0: float, col: float, row: float, compact: bool,
          selected: bool) -> str:
    leak = any(f in LEAKS for f in n["flags"])
    fill, stroke = LEAK_BOX if leak else OUTPUT_BOX if "output" in n["flags"] else PLAIN_BOX
    if n["state"] in ("pending", "error"):
        stroke = "#1565c0" if n["state"] == "pending" else "#c62828"
    if selected:
        stroke = "#ff6f00"
    width, chars = col - 16, int((col - 24) / 6.4)
    dash = ' stroke-dasharray="4,2"' if n["state"] in ("missing", "pending") else ""
    head = f"{n['rid']} {short_type(n['type'])}"
    sub = f"{_size(n)} · {n['site']}"
    text = (f'<text x="{x0 + 12:.0f}" y="{y0 + 12:.0f}">{esc(clip(head + " " + sub, chars))}</text>'
            if compact else
            f'<text x="{x0 + 12:.0f}" y="{y0 + 12:.0f}" font-weight="bold">'
            f'{esc(clip(head, chars))}</text><text x="{x0 + 12:.0f}" y="{y0 + 24:.0f}" '
            f'{MUTED}>{esc(clip(sub, chars))}</text>')
    tip = [f"RRef {n['rid']} owned by {n['owner']}: {n['type'] or '?'} "
           f"({_size(n)}), {n['state']}", f"created at {n['site']}",
           f"owner-side RRefs: {n['owner_refs']}",
           "held by: " + (", ".join(f"{h} ({s})" for (h, _), s in sorted(n["holders"].items()))
                          or "nobody")]
    tip += [f"{f}: {FLAG_TEXT[f]}" for f in n["flags"]]
    states = {n["state"]} | ({"flagged"} if leak else set()) | (
        {"output"} if "output" in n["flags"] else set())
    holders = " ".join(sorted({esc(h) for h, _ in n["holders"]} | {esc(n["owner"])}))
    return (f'<g class="nbrpc-rref{" nbrpc-selected" if selected else ""}" '
            f'data-key="{esc(n["rid"])}" data-f="worker state" data-f-worker="{holders}" '
            f'data-f-state="{" ".join(sorted(states))}"><rect x="{x0 + 8:.0f}" y="{y0 + 1:.0f}" '
            f'width="{width:.0f}" height="{row - 3:.0f}" rx="4" {fill} stroke="{stroke}" '
            f'stroke-width="{3 if selected else 2 if leak else 1.2}"{dash}/>'
            # Out[n]'s numbers follow the kernel's execution count: not compared
            f"{text}<title>{esc(chr(10).join(tip))}"
            f"{varies(esc(chr(10) + ', '.join(n['outputs']))) if n['outputs'] else ''}"
            "</title></g>")


def _summary(w: str, hidden: list[dict[str, Any]], x0: float, y0: float, col: float) -> str:
    types = Counter(short_type(n["type"]) for n in hidden).most_common(3)
    what = ", ".join(f"{t} ×{k:,}" for t, k in types)
    return (f'<g data-key="more:{esc(w)}" data-f="worker" data-f-worker="{esc(w)}">'
            f'<text x="{x0 + 12:.0f}" y="{y0 + 13:.0f}" {ERROR}>'
            f'{esc(clip(f"… and {len(hidden):,} more ({what})", int((col - 16) / 6.4)))}'
            f"<title>{len(hidden):,} more values on {esc(w)} ({esc(what)}); click to list"
            "</title></text></g>")


def rref_graph_html(graph: dict[str, Any]) -> str:
    """The static view of an RRef graph (what a saved notebook shows)."""
    model = graph_model(graph)
    summary = graph_text(model, limit=0).splitlines()[0]
    return (f'<div class="nbrpc-static"><div><b>{esc(summary)}</b></div>'
            f"{graph_svg(model)}</div>")


def why_alive_html(why: dict[str, Any]) -> str:
    """:func:`nbrpc.debug.why_alive`'s answer as the side panel's HTML."""
    reasons = "".join(f"<li>{esc(r)}</li>" for r in why["reasons"]) or "<li>nothing</li>"
    refs = "".join(f"<li><b>{esc(w)}</b>: {esc(', '.join(rs))}</li>"
                   for w, rs in sorted(why["references"].items()) if rs)
    hints = "".join(f"<li>{esc(h)}</li>" for h in why["hints"])
    # references name frames and files (ipykernel's per-run file names): not compared
    return (f"<b>Why is RRef {esc(why['rref_id'])} alive?</b><ul>{reasons}</ul>"
            + (f"<b>Python references</b>{varies(f'<ul>{refs}</ul>')}" if refs else "")
            + (f"<b>To let go</b><ul>{hints}</ul>" if hints else ""))


class RRefGraphView(View):
    """The group's RRefs as a widget (``debug.rref_graph().widget()``, ``nbrpc.show()``).

    ``graph=None`` reads :func:`nbrpc.debug.rref_graph` now; Refresh and live mode
    always read fresh data. ``select`` pre-selects a value (its why_alive in the panel).
    """

    def __init__(self, graph: dict[str, Any] | None = None, select: str | None = None,
                 live: bool = False, limit: int = LIMIT, lane_limit: int = LANE_LIMIT) -> None:
        super().__init__()
        self._given, self.limit, self.lane_limit = graph, limit, lane_limit
        self.selected: str | None = None if select is None else str(select)
        self.why: dict[str, Any] | None = None
        self.forgot: dict[str, int] | None = None
        self.refresh()
        if self.selected is not None:
            self.on_select(self.selected)
        if live:
            self.on_control("live", True)

    # -- data ------------------------------------------------------------------------
    def refresh(self) -> None:
        t0 = time.perf_counter()
        if self._given is not None:  # the data given: drawn once, then fresh data
            graph, self._given = self._given, None
            outputs = graph.get("outputs") or (_outputs_now() if graph.get("workers") else None)
        else:
            graph, outputs = debug.rref_graph(), debug.output_refs()
        self.graph = graph
        self.model = graph_model(graph, outputs, self.selected, self.limit, self.lane_limit)
        c = counts(self.model)
        self.title = (f"RRef graph: {c['values']} value{'' if c['values'] == 1 else 's'} on "
                      f"{c['owners']} owner{'' if c['owners'] == 1 else 's'}")
        self.controls = [button("refresh", "Refresh"),
                         button("forget", "Forget outputs", title="drop IPython's Out[n] "
                                "references to RRefs on every worker"),
                         toggle("live", "live", self.is_live, "refresh every second")]
        states = sorted({s for n in self.model["nodes"].values() for s in (
            [n["state"]] + (["flagged"] if any(f in LEAKS for f in n["flags"]) else [])
            + (["output"] if "output" in n["flags"] else []))})
        self.filters = {"worker": self.model["lanes"], "state": states}
        self.html = graph_svg(self.model)
        self.render_ms = (time.perf_counter() - t0) * 1e3
        forgot = ("; forgot " + ", ".join(f"{k} on {w}" for w, k in self.forgot.items())
                  if self.forgot is not None else "")
        self.status = (f"{debug.plural(c['forks'], 'user fork')}, {c['pending']} pending, {c['deleting']} "
                       f"deleting, {c['flagged']} flagged, {c['outputs']} in Out[n]{forgot}; "
                       f"read at {time.strftime('%H:%M:%S')}")

    def text(self) -> str:
        out = graph_text(self.model)
        if self.why is not None:
            out += f"\nselected {self.why['rref_id']}:" + "".join(
                f"\n  {r}" for r in self.why["reasons"])
        return out

    # -- the person's actions -----------------------------------------------------------
    def on_control(self, id: str, value: Any = None) -> None:
        if id == "refresh":
            self.refresh()
        elif id == "forget":
            self.forgot = debug.forget_outputs_everywhere()
            self.refresh()
            if self.selected is not None:
                self.on_select(self.selected)
        elif id == "live":
            if value:
                self.live(1.0, alive=_agent_ready)
            else:
                self.stop_live()
            self.controls = [dict(c, value=self.is_live) if c["id"] == "live" else c
                             for c in self.controls]
        else:
            super().on_control(id, value)

    def on_select(self, key: str) -> None:
        if key.startswith("more:"):
            lane = key[5:]
            hidden = self.model["hidden"].get(lane, [])
            rows = "".join(f"<li>{esc(n['rid'])} {esc(short_type(n['type']))} "
                           f"{esc(fmt_bytes(n['nbytes']))}</li>" for n in hidden[:200])
            more = f"<li>… and {len(hidden) - 200:,} more</li>" if len(hidden) > 200 else ""
            self.panel = f"<b>{len(hidden):,} more values on {esc(lane)}</b><ul>{rows}{more}</ul>"
            return
        self.selected = key
        self.why = debug.why_alive(key)
        self.panel = why_alive_html(self.why)
        self.model["select"] = key


def _outputs_now() -> dict[str, dict[str, list[str]]] | None:
    """:func:`nbrpc.debug.output_refs` if this process is in a running group."""
    if not _agent_ready():
        return None
    try:
        return debug.output_refs()
    except Exception:  # noqa: BLE001 - flags are extras: the graph is drawn without them
        log.debug("could not read the output histories", exc_info=True)
        return None


def _agent_ready() -> bool:
    try:
        return current_agent().state == "ready"
    except Exception:  # noqa: BLE001 - no agent any more: stop refreshing
        return False
