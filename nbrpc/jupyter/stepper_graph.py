"""The backward stepper's drawing: the distributed graph, which nodes each stage ran.

One lane per worker holds its part of the graph (``stepper.graph()``): the
entry points at the top (the roots; a *send* function per message this worker
sent, where that message's gradients come back), autograd nodes below, leaves
at the bottom (received tensors dashed: their gradients go back to the
sender). Purple arrows between lanes are gradients travelling between workers,
labelled with their norm once sent. The stage that just ran is orange (its
lane and its nodes), earlier stages green.

The records name executed nodes by type only, so which nodes of the graph ran
is found by replaying the engine's dependency counting over the graph data
(the stages triggered as recorded); a replay whose node names differ from the
record's falls back to highlighting the worker alone.

Messages are labelled ``m1``, ``m2``, ... in a deterministic order (by sender,
then creation), so that text and markup compare equal between runs.

>>> a = {"worker": "a", "rank": 0, "roots": [0], "sends": [], "recvs": [], "nodes": [
...     {"id": 0, "name": "SumBackward0", "next": [1]},
...     {"id": 1, "name": "AccumulateGrad", "next": [], "leaf": "leaf[2]", "shape": [2]}]}
>>> stage = {"worker": "a", "trigger": "roots", "nodes": ["SumBackward0", "AccumulateGrad"],
...          "gradients": [], "sent": []}
>>> replay = _Replay({"workers": {"a": a}}, [stage])
>>> replay.exact, sorted(replay.ran.items())
([True], [(('a', 0), 1), (('a', 1), 1)])
"""

from __future__ import annotations

import logging
import math
import re
from collections import Counter
from typing import Any

from .svg import KIND_COLOURS, clip, esc, svg

log = logging.getLogger(__name__)

MAX_NODES = 60  # nodes drawn per worker; the rest are counted
MAX_WORKERS = 16
MAX_ROWS = 40  # rows of the panel's lists
PER_ROW, NODE_W, NODE_H, ROW_H = 4, 126, 22, 36
TOP, PAD = 34, 10
WORKER_COLOURS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00",
                  "#F0E442", "#000000"]
LAST, EARLIER, NOT_YET = "#ffcc80", "#c8e6c9", "#ffffff"
_TRIGGER = re.compile(r"^grads for send #(\d+) from (.+)$")


def fmt(x: float | None) -> str:
    """A norm with 4 significant digits (deterministic in text and markup)."""
    return "—" if x is None else f"{x:.4g}"


def total(norms: list[float | None]) -> float:
    return math.sqrt(sum((n or 0.0) ** 2 for n in norms))


class _Replay:
    """What the recorded stages did to the graph: per stage the nodes that ran,
    the messages whose gradients were sent (with norms) and delivered."""

    def __init__(self, graph: dict[str, Any], records: list[dict[str, Any]]) -> None:
        self.workers = sorted(graph["workers"].values(), key=lambda d: d["rank"])[:MAX_WORKERS]
        self.hidden_workers = len(graph["workers"]) - len(self.workers)
        self.by_name = {d["worker"]: d for d in self.workers}
        self.rank_name = {d["rank"]: d["worker"] for d in graph["workers"].values()}
        sends = sorted((d["rank"], s["msg_id"]) for d in graph["workers"].values()
                       for s in d["sends"])
        self.label = {m: f"m{i}" for i, (_, m) in enumerate(sends, 1)}
        self.ran: dict[tuple[str, int], int] = {}  # (worker, node id) -> stage number
        self.delivered: dict[int, int] = {}  # msg_id -> stage that took its gradients
        self.flown: dict[int, tuple[float, int]] = {}  # msg_id -> (norm, stage that sent)
        self.exact: list[bool] = []  # per stage: its nodes are known
        state = {d["worker"]: _Counting(d) for d in self.workers}
        for k, rec in enumerate(records, 1):
            w = state.get(rec["worker"])
            entries, flush = self._entries(rec)
            ran = w.stage(entries, flush) if w is not None and w.exact else None
            exact = ran is not None and Counter(w.names[n] for n in ran) == Counter(rec["nodes"])
            if not exact and w is not None:
                w.exact = False
                log.debug("stage %d on %s: replay differs from its record", k, rec["worker"])
            self.exact.append(exact)
            for n in ran if exact and ran else ():
                self.ran[(rec["worker"], n)] = k
            msg = self._msg_of(rec)
            if msg is not None:
                self.delivered[msg] = k
            for s in rec["sent"]:
                self.flown[s["msg_id"]] = (total(s["norms"]), k)

    def _msg_of(self, rec: dict[str, Any]) -> int | None:
        """The send function whose gradients triggered ``rec`` (its full id)."""
        m = _TRIGGER.match(rec["trigger"])
        d = self.by_name.get(rec["worker"])
        if m is None or d is None:
            return None
        low = int(m.group(1))
        return next((s["msg_id"] for s in d["sends"] if s["msg_id"] & 0xFFFF == low), None)

    def _entries(self, rec: dict[str, Any]) -> tuple[list[int], bool]:
        d = self.by_name.get(rec["worker"])
        if d is None:
            return [], False
        if rec["trigger"] == "roots":
            return list(d["roots"]), False
        msg = self._msg_of(rec)
        send = next((s for s in d["sends"] if s["msg_id"] == msg), None)
        return (list(send["enters"]) if send else []), rec["trigger"] == "flush"

    def trigger(self, worker: str, trigger: str) -> str:
        """A trigger with the message's deterministic label instead of its id."""
        msg = self._msg_of({"worker": worker, "trigger": trigger})
        m = _TRIGGER.match(trigger)
        if msg is None or m is None:
            return trigger
        return f"grads for {self.label[msg]} from {m.group(2)}"


class _Counting:
    """The engine's dependency counting (engine.LocalPass) over one worker's graph data."""

    def __init__(self, data: dict[str, Any]) -> None:
        self.next = {n["id"]: n["next"] for n in data["nodes"]}
        self.names = {n["id"]: n["name"] for n in data["nodes"]}
        self.deps: Counter[int] = Counter(data["roots"])
        self.deps.update(e for s in data["sends"] for e in s["enters"])
        self.deps.update(x for n in data["nodes"] for x in n["next"])
        self.waiting: set[int] = set()
        self.exact = True

    def stage(self, entries: list[int], flush: bool) -> list[int]:
        ready: list[int] = []
        out: list[int] = []

        def give(n: int) -> None:
            self.deps[n] -= 1
            self.waiting.add(n)
            if self.deps[n] == 0:
                ready.append(n)

        def drain() -> None:
            for _ in range(len(self.names) + 1):
                if not ready:
                    return
                n = ready.pop()
                self.waiting.discard(n)
                out.append(n)
                for x in self.next.get(n, ()):
                    give(x)

        for e in entries:
            give(e)
        drain()
        for _ in range(len(self.names) + 1 if flush else 0):  # run what still waits
            stuck = sorted(n for n in self.waiting if self.deps[n] > 0)
            if not stuck:
                break
            self.deps[stuck[0]] = 0
            ready.append(stuck[0])
            drain()
        return out


# -- drawing ---------------------------------------------------------------------------
def _levels(d: dict[str, Any]) -> tuple[dict[int, int], int]:
    """Each node's depth (longest path from the worker's entries, which are depth 0)."""
    depth = {n["id"]: 1 for n in d["nodes"]}
    indeg = Counter(x for n in d["nodes"] for x in set(n["next"]))
    order = [n["id"] for n in d["nodes"] if indeg[n["id"]] == 0]
    nxt = {n["id"]: set(n["next"]) for n in d["nodes"]}
    for i in range(len(depth)):  # Kahn's order: each node once
        if i >= len(order):
            break
        for x in sorted(nxt[order[i]]):
            depth[x] = max(depth[x], depth[order[i]] + 1)
            indeg[x] -= 1
            if indeg[x] == 0:
                order.append(x)
    kept = sorted(depth, key=lambda n: (depth[n], n))[:MAX_NODES]
    return {n: depth[n] for n in kept}, len(depth) - len(kept)


def _node_label(node: dict[str, Any], replay: _Replay) -> str:
    if "leaf" not in node:
        return node["name"]
    if node.get("recv") is not None:
        return f"recv {replay.label.get(node['recv'], '?')} {node['shape']}"
    return f"leaf {node['shape']}"


def graph_svg(replay: _Replay, last: dict[str, Any] | None) -> str:
    """The lanes, nodes and gradient arrows, as an SVG element."""
    last_stage = len(replay.exact)
    parts, lanes, pos, send_pos = [], [], {}, {}
    x0 = PAD
    for i, d in enumerate(replay.workers):
        w = d["worker"]
        depth, more = _levels(d)
        entries = ([("roots", "roots", None)] if d["roots"] else []) + [
            (replay.label[s["msg_id"]], f"send {replay.label[s['msg_id']]} (to {s['to']})", s)
            for s in d["sends"]]
        rows: dict[int, list] = {0: [e[0] for e in entries]}
        for n in depth:
            rows.setdefault(depth[n], []).append(n)
        width = NODE_W * min(PER_ROW, max(len(r) for r in rows.values()) or 1) + 2 * PAD
        y = TOP + 24
        for lvl in sorted(rows):
            items = rows[lvl]
            for j, item in enumerate(items):
                if j and j % PER_ROW == 0:
                    y += ROW_H
                pos[(w, item)] = (x0 + PAD + (j % PER_ROW) * NODE_W, y)
            y += ROW_H
        lanes.append((w, i, x0, width, y + (14 if more else 0), more, entries, depth))
        x0 += width + PAD
    height = max((ln[4] for ln in lanes), default=TOP + 60) + 40
    for w, i, x, width, bottom, more, entries, depth in lanes:
        hot = last is not None and last["worker"] == w
        parts.append(
            f'<g data-f="worker" data-f-worker="{esc(w)}"><rect x="{x}" y="{TOP - 20}" '
            f'width="{width}" height="{bottom - TOP + 24}" rx="6" '
            f'fill="{"#fff3e0" if hot else "#fafafa"}" stroke="{"#ef6c00" if hot else "#bbb"}" '
            f'stroke-width="{2.5 if hot else 1}"/><text x="{x + 8}" y="{TOP - 4}" '
            f'font-weight="bold" fill="{WORKER_COLOURS[i % len(WORKER_COLOURS)]}">'
            f"{esc(clip(w, 24))}</text>")
        if more:
            parts.append(f'<text x="{x + 8}" y="{bottom + 2}" fill="#c62828">… and {more} more '
                         "nodes</text>")
        d = replay.by_name[w]
        nodes = {n["id"]: n for n in d["nodes"]}
        for key, _, send in entries:  # edges first, under the boxes
            targets = d["roots"] if send is None else send["enters"]
            parts += [_edge(pos[(w, key)], pos[(w, t)]) for t in targets if (w, t) in pos]
        for n in depth:
            parts += [_edge(pos[(w, n)], pos[(w, t)]) for t in nodes[n]["next"] if (w, t) in pos]
        for key, label, send in entries:
            k = 1 if send is None else replay.delivered.get(send["msg_id"])
            ran = (k is not None and k <= last_stage) if send is not None else last_stage > 0
            fill = LAST if ran and k == last_stage else EARLIER if ran else NOT_YET
            if send is not None:
                send_pos[send["msg_id"]] = pos[(w, key)]
            parts.append(_box(pos[(w, key)], label, fill, "#555", f"e:{w}:{key}",
                              f"{label} on {w}", dash="2,2"))
        for n in depth:
            k = replay.ran.get((w, n))
            node = nodes[n]
            fill = LAST if k == last_stage else EARLIER if k else NOT_YET
            recv = node.get("recv") is not None
            stroke = "#7b1fa2" if recv else "#1b5e20" if "leaf" in node else "#666"
            tip = f"{node['name']} on {w}" + (f", ran in stage {k}" if k else ", not run yet")
            parts.append(_box(pos[(w, n)], _node_label(node, replay), fill, stroke,
                              f"n:{w}:{n}", tip, dash="4,2" if recv else ""))
    for link in _links(replay):
        parts.append(_link(link, pos, send_pos, replay))
    parts.append(_legend(height - 16))
    return svg(max(x0, 780), height, "".join(parts), "distributed backward graph")  # the legend


def _edge(a: tuple[float, float], b: tuple[float, float]) -> str:
    return (f'<line x1="{a[0] + NODE_W / 2 - 4:.0f}" y1="{a[1] + NODE_H:.0f}" '
            f'x2="{b[0] + NODE_W / 2 - 4:.0f}" y2="{b[1]:.0f}" stroke="#999"/>')


def _box(p: tuple[float, float], label: str, fill: str, stroke: str, key: str, tip: str,
         dash: str = "") -> str:
    dashes = f' stroke-dasharray="{dash}"' if dash else ""
    return (f'<g data-key="{esc(key)}"><rect x="{p[0]:.0f}" y="{p[1]:.0f}" width="{NODE_W - 8}" '
            f'height="{NODE_H}" rx="4" fill="{fill}" stroke="{stroke}"{dashes}/>'
            f'<text x="{p[0] + 5:.0f}" y="{p[1] + 15:.0f}">{esc(clip(label, 20))}</text>'
            f"<title>{esc(tip)}</title></g>")


def _links(replay: _Replay) -> list[dict[str, Any]]:
    out = []
    for d in replay.workers:
        for r in d["recvs"]:
            leaves = [n for n in r["leaves"] if n is not None]
            if leaves and r["msg_id"] in replay.label:
                out.append({"msg_id": r["msg_id"], "from": d["worker"], "leaf": leaves[0],
                            "to": r["from"]})
    return sorted(out, key=lambda k: replay.label[k["msg_id"]])


def _link(link: dict[str, Any], pos: dict, send_pos: dict, replay: _Replay) -> str:
    a, b = pos.get((link["from"], link["leaf"])), send_pos.get(link["msg_id"])
    if a is None or b is None:
        return ""
    label = replay.label[link["msg_id"]]
    flown = replay.flown.get(link["msg_id"])
    x1, y1 = a[0] + NODE_W / 2, a[1] + NODE_H
    x2, y2 = b[0] + NODE_W - 8, b[1] + NODE_H / 2
    colour = KIND_COLOURS["autograd"] if flown else "#bbb"
    text = f"{label} ‖g‖ {fmt(flown[0])}" if flown else label
    dash = "" if flown else ' stroke-dasharray="4,3"'
    tip = (f"gradients for {label}: {link['from']} → {link['to']}"
           + (f", norm {fmt(flown[0])}, sent in stage {flown[1]}" if flown else ", not sent yet"))
    return (f'<g data-key="m:{label}" data-f="worker" data-f-worker="{esc(link["from"])} '
            f'{esc(link["to"])}"><path d="M{x1:.0f},{y1:.0f} C{x1:.0f},{y1 + 40:.0f} '
            f'{x2 + 60:.0f},{y2:.0f} {x2:.0f},{y2:.0f}" fill="none" stroke="{colour}" '
            f'stroke-width="{2 if flown else 1.2}"{dash}/>'
            f'<circle cx="{x2:.0f}" cy="{y2:.0f}" r="3" fill="{colour}"/>'
            f'<text x="{a[0] + 4:.0f}" y="{y1 + 11:.0f}" font-size="10" '
            f'fill="{colour if flown else "#888"}">{esc(text)}</text><title>{esc(tip)}</title></g>')


def _legend(y: float) -> str:
    items = [(LAST, "#555", "", "ran in the last stage"), (EARLIER, "#555", "", "ran earlier"),
             (NOT_YET, "#555", "", "not run yet"), (NOT_YET, "#7b1fa2", "4,2", "received leaf")]
    out, x = [], PAD
    for fill, stroke, dash, text in items:
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<rect x="{x}" y="{y - 9}" width="14" height="10" fill="{fill}" '
                   f'stroke="{stroke}"{dashes}/><text x="{x + 18}" y="{y}">{text}</text>')
        x += 28 + 6.5 * len(text)
    out.append(f'<text x="{x}" y="{y}" fill="{KIND_COLOURS["autograd"]}">⟶ gradients between '
               "workers (‖g‖: their norm)</text>")
    return "".join(out)
