"""The message trace as a sequence diagram, and its latency histogram.

One lifeline per worker, one arrow per request (solid) and per reply
(dashed), in time order, coloured by kind: calls, RRef values (``remote``,
``to_here``), the RRef protocol (forks, accepts, deletes), autograd
(gradients, credits). A bar on the callee's lifeline spans each request
from when it began to run there to when its reply left (a sequence diagram's
activation): which worker ran what, when, and what ran at once (side by
side). Hovering an arrow shows its size, id and latency;
clicking it shows all its fields; the checkboxes hide kinds and workers.
Rows are spaced by order (readable whatever the gaps between messages) or,
with "to scale", by time.

>>> from nbrpc.debug.trace import Trace
>>> t = Trace(workers=["driver", "worker1"], duration=0.001, messages=[
...     {"kind": "call", "op": "call", "what": "f", "src": "driver", "dst": "worker1",
...      "msg_id": 1, "nbytes": 300, "t0": 0.0, "t1": 0.0001},
...     {"kind": "reply", "op": "call", "what": "f", "src": "worker1", "dst": "driver",
...      "msg_id": 1, "nbytes": 90, "t0": 0.0002, "t1": 0.0003, "latency": 0.0003,
...      "error": None}])
>>> svg = trace_svg(t)
>>> svg.count('class="nbrpc-msg"'), 'data-f-kind="reply"' in svg
(2, True)
"""

from __future__ import annotations

from typing import Any

from ..debug.trace import Trace, cuda_words, family
from .svg import BACKING, ERROR, KIND_COLOURS, MUTED, RULE, clip, colour, esc, fmt_bytes, svg
from .view import View, toggle, varies

MAX_DRAWN = 1500  # arrows drawn; the rest are summarised (the trace keeps them all)
ROW = 18  # px between consecutive instants (order mode)
TOP, LEFT = 40, 70
# Arrow labels: 11 px text on a backing of the page's colour (it hides the lines
# under it), placed where no other label is; CHAR_W overestimates a sans-serif
# character so that a label never runs past the box it was given.
FONT, CHAR_W, LABEL_H = 11, 6.6, 14
SPOTS = (0.5, 0.35, 0.65, 0.2, 0.8)  # where along its arrow a label may go, in that order
BAR_W, BAR_STEP, BARS_SIDE_BY_SIDE = 8, 6, 4  # activation bars: px wide, offset, at most


def _lane_x(workers: list[str]) -> tuple[dict[str, float], float]:
    col = max(90.0, min(170.0, 1100.0 / max(1, len(workers))))
    return {w: LEFT + col / 2 + i * col for i, w in enumerate(workers)}, col


def _workers(trace: Trace) -> list[str]:
    names = list(trace.workers)
    for m in trace.messages:
        for w in (m["src"], m["dst"]):
            if w not in names:
                names.append(w)
    return names


def _rows(times: list[float], to_scale: bool, duration: float) -> dict[float, float]:
    """y of each instant: evenly spaced by order, or proportional to time."""
    ordered = sorted(set(times))
    if not to_scale:
        return {t: TOP + 20 + i * ROW for i, t in enumerate(ordered)}
    span = max(duration, ordered[-1] if ordered else 0.0, 1e-9)
    height = max(200.0, min(1600.0, ROW * len(ordered)))
    return {t: TOP + 20 + t / span * height for t in ordered}


class Labels:
    """Places the arrows' labels so that no two overlap.

    Each label is tried at a few points along its arrow (:data:`SPOTS`), just
    above it, as wide as its text and never wider than the gap between the
    arrow's two lifelines (a longer text is cut with "…"); where every spot is
    taken the arrow goes without a label (its ``<title>`` still has the full
    text, shown on hover).

    >>> labels = Labels()
    >>> labels.place("call f", 0, 100, 200, 100)
    (100.0, 95.0, 'call f')
    >>> labels.place("call g", 0, 100, 200, 100)  # the middle is taken: further along
    (40.0, 95.0, 'call g')
    """

    def __init__(self) -> None:
        self.boxes: list[tuple[float, float, float, float]] = []

    def place(self, text: str, x0: float, y0: float, x1: float, y1: float,
              room: float | None = None) -> tuple[float, float, str] | None:
        """(centre x, baseline y, text as drawn) of the label of the arrow from
        (x0, y0) to (x1, y1), or None where there is no room; ``room``: the width
        it may take (the gap between the arrow's ends when not given)."""
        room = abs(x1 - x0) - 12 if room is None else room
        chars = int(room / CHAR_W)
        if chars < 4:
            return None
        text = clip(text, chars)
        w = len(text) * CHAR_W + 4
        for f in SPOTS:
            cx, cy = x0 + f * (x1 - x0), y0 + f * (y1 - y0)
            # keep the whole label between the arrow's ends
            lo, hi = min(x0, x1) + w / 2 + 2, max(x0, x1) - w / 2 - 2
            cx = min(max(cx, lo), hi) if lo <= hi else (x0 + x1) / 2
            # just above the arrow where the label spans it (a slanted arrow is
            # higher at one end), so that its backing hides no part of the arrow
            slope = (y1 - y0) / (x1 - x0) if x1 != x0 else 0.0
            top = min(cy + slope * (x - cx) for x in (cx - w / 2, cx + w / 2))
            box = (cx - w / 2, top - 2 - LABEL_H, cx + w / 2, top - 2)
            if not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3]
                       for b in self.boxes):
                self.boxes.append(box)
                return cx, box[3] - 3, text
        return None


def trace_svg(trace: Trace, to_scale: bool = False, limit: int = MAX_DRAWN) -> str:
    """The sequence diagram of ``trace`` as an SVG element."""
    workers = _workers(trace)
    xs, col = _lane_x(workers)
    drawn = [m for m in trace.messages if m["t0"] is not None or m["t1"] is not None][:limit]
    more = len(trace.messages) - len(drawn)
    events = trace.events[:limit]
    times = [t for m in drawn for t in (m["t0"], m["t1"]) if t is not None]
    times += [e["time"] for e in events]
    y = _rows(times, to_scale, trace.duration)
    bottom = max(y.values(), default=TOP + 20) + 30 + (16 if more else 0)
    width = LEFT + col * len(workers) + 10
    parts = ['<defs>' + "".join(
        f'<marker id="nbrpc-arrow-{k}" viewBox="0 0 10 10" refX="10" refY="5" '
        f'markerWidth="9" markerHeight="9" markerUnits="userSpaceOnUse" '
        'orient="auto-start-reverse">'
        f'<path d="M0,0 L10,5 L0,10 z" fill="{c}"/></marker>'
        for k, c in KIND_COLOURS.items()) + "</defs>"]
    for w in workers:
        parts.append(f'<g data-f="worker" data-f-worker="{esc(w)}">'
                     f'<text x="{xs[w]:.1f}" y="{TOP - 14}" text-anchor="middle" '
                     f'font-weight="bold">{esc(clip(w, int(col / 7.4)))}<title>{esc(w)}</title>'
                     f'</text><line x1="{xs[w]:.1f}" y1="{TOP - 6}" x2="{xs[w]:.1f}" '
                     f'y2="{bottom - 20}" {RULE} stroke-dasharray="2,3"/></g>')
    last_label = -1e9
    for t in sorted(y):  # a time axis on the left, labels at least 40 px apart
        if y[t] - last_label >= 40:
            parts.append(f'<text x="{LEFT - 8}" y="{y[t] + 4:.1f}" text-anchor="end" '
                         f'{MUTED}>{_ms(t)}</text>')
            last_label = y[t]
    for e in events:  # under the arrows and their labels
        x, ey = xs.get(e["worker"], LEFT), y[e["time"]]
        parts.append(
            f'<g data-f="worker" data-f-worker="{esc(e["worker"])}"><rect x="{x - 4:.1f}" '
            f'y="{ey - 4:.1f}" width="8" height="8" transform="rotate(45 {x:.1f} {ey:.1f})" '
            f'fill="currentColor" fill-opacity="0.7"><title>{esc(e["event"])} {esc(e["op"])} '
            f'{esc(e["detail"])} ({esc(e["peer"])}) at {_ms(e["time"])}</title></rect></g>')
    parts += [_bar(a, xs, y) for a in activations(drawn)]  # under the arrows
    labels = Labels()
    for i, m in enumerate(drawn):
        parts.append(_arrow(i, m, xs, y, col, labels))
    if more:
        parts.append(f'<text x="{LEFT}" y="{bottom - 8:.1f}" {ERROR}>… and {more} more '
                     "messages (t.messages and t.to_chrome_trace() have them all)</text>")
    return svg(width, bottom, "".join(parts), f"message trace of {', '.join(workers)}",
               themed=True)


def activations(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each request of ``messages`` whose run on its callee the trace saw
    begin and end (its reply left): the callee's *activation*, with the
    ``level`` it is drawn at, 0 unless it overlaps an earlier one on the same
    worker (then the lowest level free, at most ``BARS_SIDE_BY_SIDE - 1``).

    >>> msgs = [{"kind": k, "op": "call", "what": w, "src": s, "dst": d, "msg_id": i,
    ...          "t0": t0, "t1": t1} for k, w, s, d, i, t0, t1 in [
    ...     ("call", "f", "a", "b", 1, 0.0, 1.0), ("call", "g", "a", "b", 2, 0.5, 1.5),
    ...     ("reply", "f", "b", "a", 1, 3.0, 3.1), ("reply", "g", "b", "a", 2, 2.0, 2.1)]]
    >>> [(a["worker"], a["what"], a["start"], a["end"], a["level"]) for a in activations(msgs)]
    [('b', 'f', 1.0, 3.0, 0), ('b', 'g', 1.5, 2.0, 1)]
    """
    ends = {(m["src"], m["dst"], m["msg_id"]): m["t0"] for m in messages
            if m["kind"] == "reply" and m["t0"] is not None}
    acts = []
    for m in messages:
        end = ends.get((m["dst"], m["src"], m["msg_id"]))
        if m["kind"] != "reply" and m["t1"] is not None and end is not None:
            acts.append({"worker": m["dst"], "caller": m["src"], "kind": m["kind"], "op": m["op"],
                         "what": m["what"], "msg_id": m["msg_id"], "start": m["t1"],
                         "end": max(end, m["t1"])})
    acts.sort(key=lambda a: (a["worker"], a["start"]))
    busy: dict[str, list[float]] = {}  # per worker, per level: when its bar ends
    for a in acts:
        levels = busy.setdefault(a["worker"], [])
        free = next((i for i, until in enumerate(levels) if until <= a["start"]), len(levels))
        a["level"] = min(free, BARS_SIDE_BY_SIDE - 1)
        if free < len(levels):
            levels[free] = a["end"]
        elif free < BARS_SIDE_BY_SIDE:
            levels.append(a["end"])
    return acts


def _bar(a: dict[str, Any], xs: dict[str, float], y: dict[float, float]) -> str:
    x = xs[a["worker"]] - BAR_W / 2 + a["level"] * BAR_STEP
    y0, y1 = y[a["start"]], y[a["end"]]
    c = colour(a["op"])
    tip = (f"{a['worker']} ran {a['op']} {a['what']}".rstrip() + f" for {a['caller']} "
           f"(msg {a['msg_id']}): {(a['end'] - a['start']) * 1e3:.3f} ms, from "
           f"{_ms(a['start'])}")
    return (f'<g class="nbrpc-act" data-f="kind worker" data-f-kind="{esc(a["kind"])}" '
            f'data-f-worker="{esc(a["worker"])} {esc(a["caller"])}"><rect x="{x:.1f}" '
            f'y="{y0:.1f}" width="{BAR_W}" height="{max(2.0, y1 - y0):.1f}" fill="{c}" '
            f'fill-opacity="0.3" stroke="{c}" stroke-width="1"/><title>{esc(tip)}</title></g>')


def _arrow(i: int, m: dict[str, Any], xs: dict[str, float], y: dict[float, float],
           col: float, labels: Labels) -> str:
    kind = m["kind"]
    fam = family(m["op"])
    stroke = colour(fam)
    x0, x1 = xs[m["src"]], xs[m["dst"]]
    y0 = y[m["t0"]] if m["t0"] is not None else None
    y1 = y[m["t1"]] if m["t1"] is not None else None
    dash = ' stroke-dasharray="5,3"' if kind == "reply" else ""
    if y0 is None:  # left before the trace started
        y0, x0 = y1 - 8, x1 - (12 if x1 >= x0 else -12)
    if y1 is None:  # not arrived within the trace
        y1, x1 = y0 + 8, x0 + (0.5 * (x1 - x0) if x1 != x0 else 20)
    marker = f"nbrpc-arrow-{fam if fam in KIND_COLOURS else 'other'}"
    text = ("↩ " if kind == "reply" else "") + f"{m['op']} {m['what']}".strip()
    if x0 == x1:  # a member calling itself: a small loop, its label on its right
        shape = (f'<path d="M{x0:.1f},{y0:.1f} C{x0 + 40:.1f},{y0:.1f} {x0 + 40:.1f},{y1:.1f} '
                 f'{x0 + 1:.1f},{y1:.1f}" fill="none"')
        spot = labels.place(text, x0 + 34, (y0 + y1) / 2 + 9, x0 + col - 4,
                            (y0 + y1) / 2 + 9, room=col - 40)
    else:
        shape = f'<line x1="{x0:.1f}" y1="{y0:.1f}" x2="{x1:.1f}" y2="{y1:.1f}"'
        spot = labels.place(text, x0, y0, x1, y1)
    label = ""
    if spot is not None:
        lx, ly, shown = spot
        w = len(shown) * CHAR_W + 4
        label = (f'<rect class="nbrpc-label" x="{lx - w / 2:.1f}" y="{ly - LABEL_H + 3:.1f}" '
                 f'width="{w:.1f}" height="{LABEL_H}" rx="2" {BACKING}/>'
                 f'<text x="{lx:.1f}" y="{ly:.1f}" '
                 f'text-anchor="middle" font-size="{FONT}">{esc(shown)}</text>')
    error = m.get("error")
    tip = (f"{'reply to ' if kind == 'reply' else ''}{m['op']} {m['what']}".strip()
           + f": {m['src']} → {m['dst']}, msg {m['msg_id']}, {fmt_bytes(m['nbytes'])}")
    if m.get("latency") is not None:
        tip += f", latency {m['latency'] * 1e6:.0f} µs"
    if m.get("cuda"):  # (not in nbytes where they went by IPC)
        tip += f", CUDA tensors: {cuda_words(m['cuda'])}"
    if error:
        tip += f" ({error})"
    return (f'<g class="nbrpc-msg" data-key="{i}" data-f="kind worker" data-f-kind="{kind}" '
            f'data-f-worker="{esc(m["src"])} {esc(m["dst"])}">'
            f'{shape} stroke="{colour("error") if error else stroke}" stroke-width="1.6"{dash} '
            f'marker-end="url(#{marker})"/><line x1="{x0:.1f}" y1="{y0:.1f}" x2="{x1:.1f}" '
            f'y2="{y1:.1f}" stroke="transparent" stroke-width="8"/>'
            f'{label}<title>{esc(tip)}</title></g>')


def _ms(t: float) -> str:
    return f"{t * 1e3:.3f} ms"


def trace_html(trace: Trace) -> str:
    """The static view of a trace (what a saved notebook shows): its summary and diagram."""
    summary = "<br>".join(esc(line) for line in str(trace).splitlines())
    return (f'<div class="nbrpc-static"><div>{summary}</div>'
            f"{varies(trace_svg(trace))}</div>")


class TraceView(View):
    """A :class:`~nbrpc.debug.Trace` as a sequence diagram widget (``trace.widget()``)."""

    def __init__(self, trace: Trace, to_scale: bool = False, limit: int = MAX_DRAWN) -> None:
        super().__init__()
        self.trace, self.to_scale, self.limit = trace, to_scale, limit
        self.refresh()

    def refresh(self) -> None:
        t = self.trace
        kinds = sorted({m["kind"] for m in t.messages})
        self.title = (f"Message trace: {len(t.messages)} messages between "
                      f"{len(_workers(t))} workers")
        self.controls = [toggle("to_scale", "to scale", self.to_scale,
                                "space rows by time instead of by order")]
        self.filters = {"kind": kinds, "worker": _workers(t)}
        self.html = varies(trace_svg(t, self.to_scale, self.limit))
        lost = "; ".join(f"{k}: {v}" for k, v in sorted(t.lost.items()))
        self.status = (f"{t.duration * 1e3:.1f} ms traced; a bar on a lifeline is a request "
                       "running there (hover for its time)" + (f"; lost {lost}" if lost else ""))

    def text(self) -> str:
        return str(self.trace)

    def on_control(self, id: str, value: Any = None) -> None:
        if id != "to_scale":
            super().on_control(id, value)
        self.to_scale = bool(value)
        self.refresh()

    def on_select(self, key: str) -> None:
        m = self.trace.messages[int(key)]
        rows = "".join(f"<tr><td>{esc(k)}</td><td>{esc(_field(k, v))}</td></tr>"
                       for k, v in m.items())
        self.panel = f"<b>message {esc(key)}</b><table>{rows}</table>"


def _field(key: str, value: Any) -> str:
    if value is None or value == "":
        return "—"
    if key in ("t0", "t1"):
        return _ms(value)
    if key == "latency":
        return f"{value * 1e6:.0f} µs"
    if key == "nbytes":
        return fmt_bytes(value)
    if key == "cuda":
        return cuda_words(value)
    return str(value)


def plot_latencies(trace: Trace, bins: int = 30) -> Any:
    """A histogram of reply latencies (the callers' waits, µs, log scale) per kind,
    as a ``matplotlib.figure.Figure``."""
    import numpy as np
    from matplotlib.figure import Figure

    lat = {k: np.array(v) * 1e6 for k, v in trace.latencies().items() if v}
    fig = Figure(figsize=(6, 3), layout="constrained")
    ax = fig.add_subplot()
    if lat:
        lo = max(1.0, min(v.min() for v in lat.values()))
        hi = max(lo * 10, max(v.max() for v in lat.values()))
        edges = np.geomspace(lo, hi, bins + 1)
        kinds = sorted(lat)
        ax.hist([lat[k] for k in kinds], bins=edges, stacked=True,
                label=[f"{k} ({len(lat[k])})" for k in kinds], color=[colour(k) for k in kinds])
        ax.set_xscale("log")
        ax.legend()
    ax.set_xlabel("latency (µs, the caller's wait)")
    ax.set_ylabel("replies")
    ax.set_title("message latency")
    return fig
