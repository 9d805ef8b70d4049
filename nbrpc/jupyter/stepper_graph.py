"""The backward stepper's drawing: the distributed graph, which nodes each stage ran.

One lane per worker holds its part of the graph (``stepper.graph()``): the
entry points at the top (the roots; a *send* function per message this worker
sent, where that message's gradients come back), autograd nodes below (named
without the ``Backward`` suffix they all share; the full name shows on hover),
leaves on the last rows, then the tensors received from other workers (their
``RecvRpcBackward`` nodes, dashed: their gradients go back to the sender). Lanes narrow, fewer boxes to a row, until the drawing fits
``MAX_WIDTH`` (a 900 px notebook column); past one box to a row it scrolls.

Purple arrows are gradients travelling between workers, labelled with their
norm once sent. They never cross a lane: each drops out of its received tensor
into a channel under the lanes, rises in the gap beside the lane it goes to,
and enters its send box from a channel above the lanes; every arrow has a
track of its own in each channel and gap. The stage that just ran is orange
(its lane and its nodes), earlier stages green. Text and lines take the
notebook theme's colours (``svg(..., themed=True)``: the text colour around
the drawing); the hues that mean something (a worker, a state, a gradient) fill
boxes, swatches and lines, and colour text only through view.css's
``.nbrpc-kind-*`` shades, which read on a light and a dark theme.

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

from .svg import BACKING, KIND_COLOURS, MUTED, RULE, STRIPE, clip, esc, svg

log = logging.getLogger(__name__)

MAX_NODES = 60  # nodes drawn per worker; the rest are counted
MAX_WORKERS = 16
MAX_ROWS = 40  # rows of the panel's lists
MAX_WIDTH = 860  # the drawing's width budget: a 900 px column less its margins
PER_ROW = 4  # boxes to a row at most, fewer when the lanes must fit MAX_WIDTH
NODE_W, NODE_H, SLOT_W, ROW_H = 108, 28, 116, 40  # a box, and the grid it sits on
LINE_CHARS = 17  # characters of a box's label line (11 px text in NODE_W)
PAD, HEAD = 10, 24  # a lane's padding and title row
GAP, CHANNEL, TOP_BAND, LABEL_H = 12, 6, 10, 13  # room between lanes; an arrow's track
LEGEND_W = 620
WORKER_COLOURS = ["#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00",
                  "#F0E442", "#7f7f7f"]
# states: the box fill, translucent over the theme's background (the text colour
# reads on it at 4.5:1 or more, light or dark theme); a box not run yet is the
# background itself
LAST, EARLIER, NOT_YET = "#ff9800", "#4caf50", "none"
FILL_OPACITY = {LAST: 0.4, EARLIER: 0.3}
HOT_STROKE, ENTRY_STROKE, UNSENT = "#ef6c00", "#757575", "#9e9e9e"
GRADIENT = "nbrpc-kind-autograd"  # view.css's class for gradient text (its theme shade)
_SUFFIX = re.compile(r"Backward\d*$")
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
    """Each node's row level: its depth (longest path from the worker's entries,
    which are level 0), except that leaves sit on the last level and received
    leaves on one more, under everything: a gradient leaving one drops straight
    out of the lane."""
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
    recv = {n["id"]: n.get("recv") is not None for n in d["nodes"] if "leaf" in n}
    level = {n: depth[n] for n in kept if n not in recv}
    bottom = max(level.values(), default=0) + 1
    own = [n for n in kept if n in recv and not recv[n]]
    for n in own:
        level[n] = bottom
    for n in kept:  # received tensors on a row of their own, under everything
        if recv.get(n):
            level[n] = bottom + bool(own)
    return level, len(depth) - len(kept)


def short_name(name: str) -> str:
    """An autograd node's name without the ``Backward`` suffix every one of them has.

    >>> short_name("MkldnnRnnLayerBackward0"), short_name("AccumulateGrad"), short_name("Backward")
    ('MkldnnRnnLayer', 'AccumulateGrad', 'Backward')
    """
    return _SUFFIX.sub("", name) or name


def wrap(text: str, width: int = LINE_CHARS) -> list[str]:
    """``text`` on at most two lines of ``width`` characters: broken at a space, else
    between words of a CamelCase name, else anywhere; what still overflows is clipped.

    >>> wrap("ConvolutionBackwardOverrideable", 16), wrap("a leaf with a long name", 16)
    (['Convolution', 'BackwardOverrid…'], ['a leaf with a', 'long name'])
    """
    if len(text) <= width:
        return [text]
    cut = text.rfind(" ", 1, width + 1)
    if cut > 0:
        return [text[:cut], clip(text[cut + 1:], width)]
    humps = [m.start() for m in re.finditer(r"(?<=[a-z0-9])[A-Z]", text[: width + 1])]
    cut = humps[-1] if humps else width
    return [text[:cut], clip(text[cut:], width)]


def _node_label(node: dict[str, Any], replay: _Replay) -> str:
    if "leaf" not in node:
        return short_name(node["name"])
    if node.get("recv") is not None:
        what = f"{node['tensors']} tensors" if node.get("tensors") else node["shape"]
        return f"recv {replay.label.get(node['recv'], '?')} {what}"
    return f"leaf {node['shape']}"


def _node_lines(node: dict[str, Any], replay: _Replay) -> list[str]:
    """A box's label: a node's short name, wrapped; a leaf's kind, then its shape."""
    label = _node_label(node, replay)
    if "leaf" not in node or len(label) <= LINE_CHARS:
        return wrap(label)
    head, _, shape = label.partition(" [")
    return [head, clip(f"[{shape}", LINE_CHARS)]


class _Lane:
    """One worker's column: its entries and nodes by row level, and its width in slots."""

    def __init__(self, replay: _Replay, d: dict[str, Any]) -> None:
        self.worker, self.data = d["worker"], d
        self.level, self.more = _levels(d)
        self.entries = ([("roots", ["roots"], None)] if d["roots"] else []) + [
            (replay.label[s["msg_id"]], [f"send {replay.label[s['msg_id']]}", f"to {s['to']}"],
             s) for s in d["sends"]]
        self.rows: dict[int, list[Any]] = {0: [e[0] for e in self.entries]}
        for n in self.level:
            self.rows.setdefault(self.level[n], []).append(n)
        self.cols = min(PER_ROW, max(map(len, self.rows.values())) or 1)  # _fit narrows it
        self.x = self.width = self.bottom = 0.0  # set by place()

    @property
    def span(self) -> float:
        """The lane's width at ``cols`` boxes to a row."""
        return self.cols * SLOT_W - (SLOT_W - NODE_W) + 2 * PAD

    def place(self, x: float, top: float, pos: dict[tuple[str, Any], tuple[float, float]]) -> None:
        """Lay the boxes out in a lane whose top left corner is (``x``, ``top``)."""
        self.x, self.width = x, self.span
        y = top + HEAD
        for lvl in sorted(self.rows):
            for j, item in enumerate(self.rows[lvl]):
                if j and j % self.cols == 0:
                    y += ROW_H
                pos[(self.worker, item)] = (x + PAD + (j % self.cols) * SLOT_W, y)
            y += ROW_H
        self.bottom = y - (ROW_H - NODE_H) + PAD + (16 if self.more else 0)


def _fit(lanes: list[_Lane], gaps: list[float]) -> None:
    """Fewer boxes to a row, widest lane first, until the lanes fit ``MAX_WIDTH``
    (or every lane is one box wide; then the drawing scrolls)."""
    while sum(gaps) + sum(ln.span for ln in lanes) > MAX_WIDTH:
        wide = [ln for ln in lanes if ln.cols > 1]
        if not wide:
            return
        # the lane with the most boxes to a row; of equal ones, the shortest grows least
        max(wide, key=lambda ln: (ln.cols, -sum(map(len, ln.rows.values())))).cols -= 1


def graph_svg(replay: _Replay, last: dict[str, Any] | None) -> str:
    """The lanes, nodes and gradient arrows, as an SVG element."""
    last_stage = len(replay.exact)
    lanes = [_Lane(replay, d) for d in replay.workers]
    index = {ln.worker: i for i, ln in enumerate(lanes)}
    links = [lk for lk in _links(replay) if lk["from"] in index and lk["to"] in index]
    # each link rises in the gap beside its target lane, on the side it comes from
    # (gap i is left of lane i; the last one is the right margin), on a track of its own
    rise_gap = [index[lk["to"]] + (index[lk["from"]] >= index[lk["to"]]) for lk in links]
    in_gap = Counter(rise_gap)
    gaps = [GAP + CHANNEL * in_gap[g] for g in range(len(lanes) + 1)]
    _fit(lanes, gaps)
    top = TOP_BAND + CHANNEL * len(links)  # under the channel the arrows arrive by
    pos: dict[tuple[str, Any], tuple[float, float]] = {}
    gap_x, x = [], 0.0  # where each gap starts
    for i, ln in enumerate(lanes):
        gap_x.append(x)
        ln.place(x + gaps[i], top, pos)
        x += gaps[i] + ln.width
    gap_x.append(x)
    width = max(x + gaps[-1], LEGEND_W)
    band = max((ln.bottom for ln in lanes), default=top + 60) + 6  # the channel under them
    height = band + LABEL_H * len(links) + 40
    parts: list[str] = []
    for i, ln in enumerate(lanes):
        parts += _lane(ln, i, ln.bottom, top, last, last_stage, pos, replay)
    used: Counter[int] = Counter()
    for k, (lk, g) in enumerate(zip(links, rise_gap)):
        used[g] += 1  # tracks from the gap's right, the nearest a lane on the left last
        xg = gap_x[g] + gaps[g] - GAP / 2 - CHANNEL * (used[g] - 0.5)
        parts.append(_link(lk, pos, replay, xg, TOP_BAND - 4 + CHANNEL * k,
                           band + LABEL_H * (k + 1)))
    parts.append(_legend(height - 22))
    return svg(width, height, "".join(parts), "distributed backward graph", themed=True)


def lane_title(d: dict[str, Any]) -> str:
    """A lane's title: the worker, and the devices its nodes run on where any
    is off the CPU.

    >>> lane_title({"worker": "w1", "nodes": [{"device": "cuda:0"}, {}, {"device": "cuda:0"}]})
    'w1 · cuda:0, cpu'
    >>> lane_title({"worker": "w1", "nodes": [{}]})
    'w1'
    """
    devices = [n.get("device", "cpu") for n in d["nodes"]]
    if all(x == "cpu" for x in devices):
        return d["worker"]
    return f"{d['worker']} · {', '.join(dict.fromkeys(devices))}"


def _lane(ln: _Lane, i: int, bottom: float, top: float, last: dict[str, Any] | None,
          last_stage: int, pos: dict, replay: _Replay) -> list[str]:
    """One lane's markup: its box and title, its edges, then its boxes over them (one
    group, which the worker filter hides)."""
    w, d = ln.worker, ln.data
    hot = last is not None and last["worker"] == w
    paint = (f'fill="{LAST}" fill-opacity="0.12" stroke="{HOT_STROKE}" stroke-width="2.5"'
             if hot else f'{STRIPE} {RULE} stroke-width="1"')
    # the name in the text colour, after a swatch of the worker's hue (its bars' in
    # plot_grad_norms)
    parts = [f'<g data-f="worker" data-f-worker="{esc(w)}"><rect x="{ln.x:.0f}" y="{top:.0f}" '
             f'width="{ln.width:.0f}" height="{bottom - top:.0f}" rx="6" {paint}/>'
             f'<rect x="{ln.x + 8:.0f}" y="{top + 6:.0f}" width="9" height="9" rx="2" '
             f'fill="{WORKER_COLOURS[i % len(WORKER_COLOURS)]}"/>'
             f'<text x="{ln.x + 21:.0f}" y="{top + 15:.0f}" font-weight="bold">'
             f"{esc(clip(lane_title(d), max(6, int((ln.width - 13) // 7))))}</text>"]
    if ln.more:
        parts.append(f'<text x="{ln.x + 8:.0f}" y="{bottom - 6:.0f}" {MUTED}>… and '
                     f"{ln.more} more nodes</text>")
    nodes = {n["id"]: n for n in d["nodes"]}
    for key, _, send in ln.entries:  # edges first, under the boxes
        targets = d["roots"] if send is None else send["enters"]
        parts += [_edge(pos[(w, key)], pos[(w, t)]) for t in targets if (w, t) in pos]
    for n in ln.level:
        parts += [_edge(pos[(w, n)], pos[(w, t)]) for t in nodes[n]["next"] if (w, t) in pos]
    for key, lines, send in ln.entries:
        k = 1 if send is None else replay.delivered.get(send["msg_id"])
        ran = (k is not None and k <= last_stage) if send is not None else last_stage > 0
        fill = LAST if ran and k == last_stage else EARLIER if ran else NOT_YET
        what = " ".join(lines) if send is None else f"{lines[0]} ({lines[1]})"
        parts.append(_box(pos[(w, key)], lines, fill, ENTRY_STROKE, f"e:{w}:{key}",
                          f"{what} on {w}", dash="2,2"))
    for n in ln.level:
        k = replay.ran.get((w, n))
        node = nodes[n]
        fill = LAST if k == last_stage else EARLIER if k else NOT_YET
        recv = node.get("recv") is not None
        stroke = "#7b1fa2" if recv else "#2e7d32" if "leaf" in node else ENTRY_STROKE
        leaf = f" ({_node_label(node, replay)})" if "leaf" in node else ""
        tip = f"{node['name']}{leaf} on {w}, " + (f"ran in stage {k}" if k else "not run yet")
        parts.append(_box(pos[(w, n)], _node_lines(node, replay), fill, stroke,
                          f"n:{w}:{n}", tip, dash="4,2" if recv else ""))
    parts.append("</g>")
    return parts


def _edge(a: tuple[float, float], b: tuple[float, float]) -> str:
    return (f'<line x1="{a[0] + NODE_W / 2:.0f}" y1="{a[1] + NODE_H:.0f}" '
            f'x2="{b[0] + NODE_W / 2:.0f}" y2="{b[1]:.0f}" {RULE}/>')


def _paint(fill: str) -> str:
    """A box's fill: a state colour, or (not run yet) the theme's background."""
    if fill == NOT_YET:
        return BACKING
    return f'fill="{fill}" fill-opacity="{FILL_OPACITY[fill]}"'


def _box(p: tuple[float, float], lines: list[str], fill: str, stroke: str, key: str, tip: str,
         dash: str = "") -> str:
    dashes = f' stroke-dasharray="{dash}"' if dash else ""
    y0 = p[1] + (18 if len(lines) == 1 else 12)
    text = "".join(f'<text x="{p[0] + 5:.0f}" y="{y0 + 11 * i:.0f}">{esc(line)}</text>'
                   for i, line in enumerate(lines))
    return (f'<g data-key="{esc(key)}"><rect x="{p[0]:.0f}" y="{p[1]:.0f}" width="{NODE_W}" '
            f'height="{NODE_H}" rx="4" {_paint(fill)} stroke="{stroke}"{dashes}/>'
            f"{text}<title>{esc(tip)}</title></g>")


def _links(replay: _Replay) -> list[dict[str, Any]]:
    out = []
    for d in replay.workers:
        for r in d["recvs"]:
            leaves = [n for n in r["leaves"] if n is not None]
            if leaves and r["msg_id"] in replay.label:
                out.append({"msg_id": r["msg_id"], "from": d["worker"], "leaf": leaves[0],
                            "to": r["from"]})
    return sorted(out, key=lambda k: replay.label[k["msg_id"]])


def _send_box(replay: _Replay, link: dict[str, Any]) -> tuple[str, str] | None:
    """The (worker, entry key) of the send function a link's gradients go back to."""
    label = replay.label[link["msg_id"]]
    d = replay.by_name.get(link["to"])
    if d is None or not any(s["msg_id"] == link["msg_id"] for s in d["sends"]):
        return None
    return link["to"], label


def _link(link: dict[str, Any], pos: dict, replay: _Replay, xg: float, y_top: float,
          y_bottom: float) -> str:
    """A gradient's way back, drawn around the lanes: down out of the received tensor to
    the channel under every lane, along it to the gap beside the sender's lane, up that
    gap to the channel above the lanes, along it and down into the send box."""
    target = _send_box(replay, link)
    a, b = pos.get((link["from"], link["leaf"])), pos.get(target) if target else None
    if a is None or b is None:
        return ""
    label = replay.label[link["msg_id"]]
    flown = replay.flown.get(link["msg_id"])
    x1, y1 = a[0] + NODE_W / 2, a[1] + NODE_H
    x2, y2 = b[0] + NODE_W * 0.75, b[1]
    colour = KIND_COLOURS["autograd"] if flown else UNSENT
    text = f"{label} ‖g‖ {fmt(flown[0])}" if flown else f"{label} (not sent yet)"
    ink = f'class="{GRADIENT}"' if flown else MUTED  # the label: text, in a theme shade
    dash = "" if flown else ' stroke-dasharray="4,3"'
    tip = (f"gradients for {label}: {link['from']} → {link['to']}"
           + (f", norm {fmt(flown[0])}, sent in stage {flown[1]}" if flown else ", not sent yet"))
    right = xg >= x1
    anchor = "start" if right else "end"
    tx, tw = (x1 + 4 if right else x1 - 4), 5.6 * len(text) + 2
    path = (f"M{x1:.0f},{y1:.0f} V{y_bottom:.0f} H{xg:.0f} V{y_top:.0f} H{x2:.0f} "
            f"V{y2 - 1:.0f}")
    return (f'<g data-key="m:{label}" data-f="worker" data-f-worker="{esc(link["from"])} '
            f'{esc(link["to"])}" class="nbrpc-grad"><path d="{path}" fill="none" '
            f'stroke="{colour}" stroke-width="{2 if flown else 1.2}"{dash}/>'
            f'<path d="M{x2 - 4:.0f},{y2 - 7:.0f} L{x2 + 4:.0f},{y2 - 7:.0f} L{x2:.0f},'
            f'{y2 - 1:.0f} Z" fill="{colour}" stroke="{colour}"/>'
            f'<rect x="{tx if right else tx - tw:.0f}" y="{y_bottom - 12:.0f}" width="{tw:.0f}" '
            f'height="11" {BACKING}/>'  # the label reads over lines
            f'<text x="{tx:.0f}" y="{y_bottom - 3:.0f}" text-anchor="{anchor}" font-size="10" '
            f'{ink}>{esc(text)}</text><title>{esc(tip)}</title></g>')


def _legend(y: float) -> str:
    items = [(LAST, ENTRY_STROKE, "", "ran in the last stage"),
             (EARLIER, ENTRY_STROKE, "", "ran earlier"),
             (NOT_YET, ENTRY_STROKE, "", "not run yet"),
             (NOT_YET, "#7b1fa2", "4,2", "received tensor")]
    out, x = [], PAD
    for fill, stroke, dash, text in items:
        dashes = f' stroke-dasharray="{dash}"' if dash else ""
        out.append(f'<rect x="{x}" y="{y - 9}" width="14" height="10" {_paint(fill)} '
                   f'stroke="{stroke}"{dashes}/><text x="{x + 18}" y="{y}">{text}</text>')
        x += 28 + 6 * len(text)
    out.append(f'<text x="{x}" y="{y}" class="{GRADIENT}">⟶ gradients (‖g‖: norm)</text>')
    out.append(f'<text x="{PAD}" y="{y + 14}" {MUTED} font-size="10">'
               "nodes are autograd functions, named without their “Backward” suffix "
               "(hover for the full name)</text>")
    return "".join(out)
