"""The owner map: per worker, what it owns, who holds it, and how many bytes.

Left, one horizontal bar per worker: the bytes of the values it owns,
split by holder (a value held by k workers gives each an equal share, so the
bar's length is the bytes owned; values no user holds are "owner only").
Right (under the bars, where both would not fit a notebook's column), a
worker × worker matrix: owner rows, holder columns, each cell the
number of values and their bytes that the holder has a fork of. Clicking a
worker's row lists its values in the side panel. :func:`plot_owner_map`
draws the bars with matplotlib for static images.

>>> omap = {"a": [], "b": [{"rref_id": "0:1", "type": "torch.Tensor", "nbytes": 4096,
...     "state": "ready", "held_by": ["a"], "owner_refs": 0, "site": "x.py:3"}]}
>>> print(owner_map_text(omap))
Owner map: 1 value, 4.0 KiB on 2 workers
  a: owns 0 values, 0 B
  b: owns 1 value, 4.0 KiB; held by a: 1 (4.0 KiB)
>>> owner_map_svg(omap).count('class="nbrpc-owner"')
2
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from .. import debug
from .svg import ERROR, MUTED, RULE, STRIPE, clip, clip_middle, esc, fmt_bytes, svg
from .view import View, button

OWNER_ONLY = "(owner only)"
PANEL_LIMIT = 300  # values listed in the panel
MAX_WORKERS = 64  # rows and columns drawn; the rest are summarised
# one colour per holder (Okabe-Ito, its black swapped for an olive that shows on a
# dark background too, then others); the owner-only share is light grey
PALETTE = ["#0072B2", "#009E73", "#E69F00", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442",
           "#999933", "#7f7f7f", "#a6761d", "#1b9e77", "#7570b3"]
OWNER_ONLY_COLOUR = "#d0d0d0"
# a matrix cell's blue: its opacity grows with its bytes, up to a shade on which the
# theme's text colour (its count) still reads at 4.5:1 in both themes
CELL_COLOUR, CELL_SHADE = "#0072B2", (0.08, 0.55)
CHAR_W, BOLD_W = 6.6, 7.4  # px a character of 11 px sans-serif takes at most (bold)
PAGE_W = 900  # px of a notebook's output column, which the map fits where it can
COUNT_W = 22  # px a matrix cell needs to show its count (narrower: on hover only)
TIGHT_CHARS = 4  # characters of an upright column name (w17, w123)


def holders_of(omap: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Every holder, owners' order first, then the others (gone workers) sorted."""
    seen = [w for w in omap]
    extra = sorted({h for rows in omap.values() for r in rows for h in r["held_by"]}
                   - set(seen))
    return seen + extra


def split_bytes(omap: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """owner -> holder -> bytes (each value's bytes shared equally by its holders)."""
    out: dict[str, dict[str, float]] = {}
    for owner, rows in omap.items():
        share: dict[str, float] = defaultdict(float)
        for r in sorted(rows, key=lambda r: r["rref_id"]):  # the same sums in any order
            holders = r["held_by"] or [OWNER_ONLY]
            for h in holders:
                share[h] += (r["nbytes"] or 0) / len(holders)
        out[owner] = dict(share)
    return out


def matrix(omap: dict[str, list[dict[str, Any]]]) -> dict[tuple[str, str], tuple[int, int]]:
    """(owner, holder) -> (values the holder has a fork of, their bytes)."""
    cells: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for owner, rows in omap.items():
        for r in rows:
            for h in r["held_by"]:
                cells[owner, h][0] += 1
                cells[owner, h][1] += r["nbytes"] or 0
    return {k: (v[0], v[1]) for k, v in cells.items()}


def owner_map_text(omap: dict[str, list[dict[str, Any]]]) -> str:
    """Deterministic summary: one line per worker (by rank), holders sorted."""
    n = sum(len(rows) for rows in omap.values())
    total = sum(r["nbytes"] or 0 for rows in omap.values() for r in rows)
    lines = [f"Owner map: {n} value{'' if n == 1 else 's'}, {fmt_bytes(total)} on "
             f"{len(omap)} worker{'' if len(omap) == 1 else 's'}"]
    cells = matrix(omap)
    for owner, rows in omap.items():
        size = sum(r["nbytes"] or 0 for r in rows)
        held = "; held by " + ", ".join(
            f"{h}: {cells[owner, h][0]} ({fmt_bytes(cells[owner, h][1])})"
            for h in holders_of(omap) if (owner, h) in cells) if rows else ""
        lines.append(f"  {owner}: owns {len(rows)} value{'' if len(rows) == 1 else 's'}, "
                     f"{fmt_bytes(size)}{held if any(r['held_by'] for r in rows) else ''}")
    on_devices = device_bytes(omap)
    if on_devices:
        lines.append("  device memory held by RRef values: " + "; ".join(
            f"{owner} {device} {fmt_bytes(b)}" for (owner, device), b in on_devices.items()))
    return "\n".join(lines)


def device_bytes(omap: dict[str, list[dict[str, Any]]]) -> dict[tuple[str, str], int]:
    """Bytes of the values each worker owns off its CPU, by (owner, device).

    >>> device_bytes({"w1": [{"nbytes": 8, "device": "cuda:0"}, {"nbytes": 4, "device": None},
    ...                      {"nbytes": 2, "device": "cuda:0"}], "w2": [{"nbytes": 1}]})
    {('w1', 'cuda:0'): 10}
    """
    out: dict[tuple[str, str], int] = {}
    for owner, rows in omap.items():
        for r in rows:
            if r.get("device"):
                key = (owner, r["device"])
                out[key] = out.get(key, 0) + (r["nbytes"] or 0)
    return out


def column_label(name: str, width: int) -> str:
    """A holder's column heading in ``width`` characters: the name, or where it
    does not fit and ends in a number, its first letter and that number.

    >>> column_label("worker7", 8), column_label("worker17", 4), column_label("driver", 4)
    ('worker7', 'w17', 'd…er')
    """
    if len(name) <= width:
        return name
    m = re.fullmatch(r"(\D+)(\d+)", name)
    if m and 1 + len(m.group(2)) <= width:
        return m.group(1)[0] + m.group(2)
    return clip_middle(name, width)


def owner_map_svg(omap: dict[str, list[dict[str, Any]]], max_workers: int = MAX_WORKERS) -> str:
    """The bars (bytes owned, by holder) and the owner × holder matrix as one
    SVG: side by side where both fit a notebook's column (``PAGE_W``), else
    the matrix under the bars, its columns narrowed to fit (names give way to
    their numbers: ``worker17`` -> ``w17``, the full name on hover). Below
    ``COUNT_W`` px a column shows its counts on hover only, under an upright
    name."""
    owners = list(omap)[:max_workers]
    holders = holders_of(omap)[:max_workers]
    colours = {h: PALETTE[i % len(PALETTE)] for i, h in enumerate(holders)}
    colours[OWNER_ONLY] = OWNER_ONLY_COLOUR
    shares, cells = split_bytes(omap), matrix(omap)
    biggest = max([sum(s.values()) for s in shares.values()] + [1])
    name_w, bar_w, row, top = 90, 260, 22, 46
    heading = "values held (owner row → holder column)"
    n = max(1, len(holders))
    side = name_w + bar_w + 100 + 44 * n + 10 <= PAGE_W
    fit = (PAGE_W - name_w - 10) // n  # px a column may take under the bars
    tight = not side and fit < COUNT_W  # too narrow for counts: names turned upright
    lift = int(CHAR_W * TIGHT_CHARS) + 6 if tight else 0  # room for upright names
    if tight:
        heading += "; counts on hover"
    if side:  # the matrix right of the bars
        mx, my, cell_w = name_w + bar_w + 100, top, min(80, max(44, 440 // n))
    else:  # under them, as wide as the column allows
        mx, my = name_w, top + row * len(owners) + 24 + top + lift
        cell_w = max(10, min(80, fit))
    width = max(name_w + bar_w + 100, mx + max(cell_w * len(holders), BOLD_W * len(heading)) + 10)
    height = my + row * len(owners) + 40
    parts = [f'<text x="{name_w}" y="14" font-weight="bold">bytes owned, by holder</text>',
             f'<text x="{mx}" y="{my - top - lift + 14}" font-weight="bold">'
             f"{esc(heading)}</text>"]
    chars = TIGHT_CHARS if tight else max(3, int((cell_w - 2) / CHAR_W))
    numbered = [bool(re.fullmatch(r"\D+\d+", h)) for h in holders]
    short = any(len(h) > chars for h, num in zip(holders, numbered) if num)
    for j, h in enumerate(holders):
        cx = mx + j * cell_w + cell_w / 2
        # one form for all numbered names: w9, w10, not worker9, w10
        shown = column_label(h, min(chars, len(h) - 1) if short and numbered[j] else chars)
        where = (f'x="{cx + 4:.0f}" y="{my - 6}" transform="rotate(-90 {cx + 4:.0f} {my - 6})"'
                 if tight else f'x="{cx:.0f}" y="{my - 8}" text-anchor="middle"')
        parts.append(f"<text {where}>{esc(shown)}<title>{esc(h)}</title></text>")
    biggest_cell = max([b for _, b in cells.values()] + [1])
    for i, owner in enumerate(owners):
        y, ym = top + i * row, my + i * row
        rows = omap[owner]
        size = sum(r["nbytes"] or 0 for r in rows)
        segs, x = [], float(name_w)
        for h in [*holders, OWNER_ONLY]:
            b = shares[owner].get(h, 0.0)
            if b <= 0:
                continue
            w = bar_w * b / biggest
            segs.append(f'<rect x="{x:.1f}" y="{y + 3}" width="{max(w, 1):.1f}" '
                        f'height="{row - 6}" fill="{colours[h]}"><title>{esc(owner)}: '
                        f"{fmt_bytes(b)} held by {esc(h)}</title></rect>")
            x += w
        stripe = STRIPE if i % 2 == 0 else 'fill="transparent"'  # (a click target too)
        mark = (f'data-key="worker:{esc(owner)}" data-f="worker" '
                f'data-f-worker="{esc(owner)}"')
        label = f'font-weight="bold">{esc(clip(owner, 12))}</text>'
        parts.append(
            f'<g class="nbrpc-owner" {mark}><rect x="0" y="{y}" width="{width:.0f}" '
            f'height="{row}" {stripe}/><text x="4" y="{y + 15}" {label}'
            f'{"".join(segs)}<text x="{x + 4:.0f}" y="{y + 15}" {MUTED}>'
            f"{len(rows)} · {fmt_bytes(size)}</text>")
        if not side:  # the matrix's own row, with the owner's name again
            parts.append(f'</g><g class="nbrpc-owner-cells" {mark}><rect x="0" y="{ym}" '
                         f'width="{width:.0f}" height="{row}" {stripe}/>'
                         f'<text x="4" y="{ym + 15}" {label}')
        for j, h in enumerate(holders):
            n_held, b = cells.get((owner, h), (0, 0))
            cx = mx + j * cell_w
            lo, hi = CELL_SHADE
            shade = lo + (hi - lo) * (b / biggest_cell) if n_held else 0.0
            parts.append(
                f'<rect x="{cx + 1}" y="{ym + 1}" width="{cell_w - 2}" height="{row - 2}" '
                f'fill="{CELL_COLOUR}" fill-opacity="{shade:.2f}" {RULE}><title>{esc(h)} holds '
                f"{debug.plural(n_held, 'value')} of {esc(owner)}: {fmt_bytes(b)}</title></rect>"
                + (f'<text x="{cx + cell_w / 2:.0f}" y="{ym + 15}" text-anchor="middle">'
                   f"{n_held}</text>" if n_held and not tight else ""))
        parts.append("</g>")
    more = len(omap) - len(owners)
    y = my + row * len(owners) + 16
    legend, lx = [], float(name_w)
    for h in [*holders[:10], OWNER_ONLY]:
        legend.append(f'<rect x="{lx:.0f}" y="{y - 9}" width="10" height="10" '
                      f'fill="{colours[h]}"/><text x="{lx + 13:.0f}" y="{y}">'
                      f"{esc(clip(h, 14))}</text>")
        lx += 24 + CHAR_W * len(clip(h, 14))
    if more:
        legend.append(f'<text x="4" y="{y + 18}" {ERROR}>… and {more:,} more workers'
                      "</text>")
    return svg(max(width, lx), height + (18 if more else 0), "".join(parts + legend),
               f"owner map of {len(omap)} workers", themed=True)


def owner_map_html(omap: dict[str, list[dict[str, Any]]]) -> str:
    """The static view of an owner map (what a saved notebook shows)."""
    summary = owner_map_text(omap).splitlines()[0]
    return f'<div class="nbrpc-static"><div><b>{esc(summary)}</b></div>{owner_map_svg(omap)}</div>'


def values_html(owner: str, rows: list[dict[str, Any]], limit: int = PANEL_LIMIT) -> str:
    """The panel's list of one worker's values."""
    body = "".join(
        f"<tr><td>{esc(r['rref_id'])}</td><td>{esc(r['type'] or '?')}</td>"
        f"<td>{esc(fmt_bytes(r['nbytes']))}</td><td>{esc(', '.join(r['held_by']) or '—')}</td>"
        f"<td>{esc(r['site'])}</td></tr>" for r in rows[:limit])
    more = (f"<div>… and {len(rows) - limit:,} more</div>" if len(rows) > limit else "")
    return (f"<b>{esc(owner)} owns {debug.plural(len(rows), 'value')}</b><table><tr>"
            f"<th>id</th><th>type</th><th>size</th><th>held by</th><th>created at</th></tr>"
            f"{body}</table>{more}")


class OwnerMapView(View):
    """An :class:`~nbrpc.debug.OwnerMap` as a widget (``debug.owner_map().widget()``).

    ``omap=None`` reads :func:`nbrpc.debug.owner_map` now; Refresh reads it again.
    """

    def __init__(self, omap: dict[str, list[dict[str, Any]]] | None = None) -> None:
        super().__init__()
        self._given = omap
        self.selected: str | None = None
        self.refresh()

    def refresh(self) -> None:
        omap, self._given = (self._given, None) if self._given is not None else (
            debug.owner_map(), None)
        self.omap = omap
        n = sum(len(rows) for rows in omap.values())
        self.title = f"Owner map: {n} value{'' if n == 1 else 's'} on {len(omap)} workers"
        self.controls = [button("refresh", "Refresh")]
        self.filters = {"worker": list(omap)[:MAX_WORKERS]}
        self.html = owner_map_svg(omap)
        if self.selected in omap:
            self.panel = values_html(self.selected, omap[self.selected])
        total = sum(r["nbytes"] or 0 for rows in omap.values() for r in rows)
        self.status = f"{fmt_bytes(total)} owned in all"

    def text(self) -> str:
        return owner_map_text(self.omap)

    def on_control(self, id: str, value: Any = None) -> None:
        if id != "refresh":
            super().on_control(id, value)
        self.refresh()

    def on_select(self, key: str) -> None:
        owner = key.removeprefix("worker:")
        if owner not in self.omap:
            raise KeyError(f"no worker {owner!r} in this owner map; known: "
                           f"{', '.join(self.omap)}")
        self.selected = owner
        self.panel = values_html(owner, self.omap[owner])


def plot_owner_map(omap: dict[str, list[dict[str, Any]]] | None = None) -> Any:
    """Bytes owned per worker, stacked by holder, as a ``matplotlib.figure.Figure``
    (``omap=None``: :func:`nbrpc.debug.owner_map` now)."""
    from matplotlib.figure import Figure

    omap = debug.owner_map() if omap is None else omap
    owners = list(omap)[:MAX_WORKERS]
    named = holders_of(omap)[:len(PALETTE) - 1]
    shares = {o: dict(s) for o, s in split_bytes(omap).items()}
    for s in shares.values():  # holders past the palette: one "other holders" share
        s["other holders"] = sum(b for h, b in s.items() if h not in named and h != OWNER_ONLY)
    holders = [*named, "other holders", OWNER_ONLY]
    fig = Figure(figsize=(6, 0.6 + 0.35 * max(2, len(owners))), layout="constrained")
    ax = fig.add_subplot()
    left = [0.0] * len(owners)
    for i, h in enumerate(holders):
        widths = [shares[o].get(h, 0.0) for o in owners]
        if any(widths):
            ax.barh(owners, widths, left=left, label=h,
                    color=OWNER_ONLY_COLOUR if h == OWNER_ONLY else PALETTE[i % len(PALETTE)])
            left = [a + b for a, b in zip(left, widths)]
    ax.invert_yaxis()  # rank order, top down
    ax.set_xlabel("bytes owned")
    ax.set_title("bytes owned per worker, by holder")
    if any(left):
        ax.legend(fontsize=8)
    return fig
