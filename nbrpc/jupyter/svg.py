"""Small, shared pieces of the SVG that every view draws: escaping, colours, sizes.

Text and lines drawn on the view's own background follow the notebook's theme
(JupyterLab light or dark, Notebook 7, a saved notebook on GitHub) without any
stylesheet: an SVG drawn with ``svg(..., themed=True)`` paints with
``currentColor``, the colour of the HTML around it (JupyterLab's text colour
in either theme, black elsewhere), and :data:`MUTED`, :data:`RULE` and
:data:`STRIPE` are that colour at lower opacity. Only what has a meaning of
its own (the kinds of :data:`KIND_COLOURS`, states, errors) keeps a fixed hue,
never as text on the background except :data:`ERROR`, which takes
JupyterLab's error colour where there is one and a red tinted by the text
colour elsewhere. As HTML text, those hues have
theme-aware shades in ``static/view.css`` (``.nbrpc-state-*``,
``.nbrpc-kind-*``).

>>> esc('<a & "b">')
'&lt;a &amp; &quot;b&quot;&gt;'
>>> fmt_bytes(0), fmt_bytes(1536), fmt_bytes(3 * 2**30)
('0 B', '1.5 KiB', '3.0 GiB')
>>> colour("rref_fork") == colour("rref_delete"), colour("call") != colour("autograd_grads")
(True, True)
>>> clip("a_very_long_type_name", 8)
'a_very_…'
"""

from __future__ import annotations

import html

from ..debug.trace import family
from ..debug.words import fmt_bytes  # noqa: F401 (the views import it from here)

# One colour per family of messages and states (colour-blind-safe, Okabe-Ito).
KIND_COLOURS = {
    "call": "#0072B2",      # rpc_sync / rpc_async / rref.rpc_*()
    "rref": "#009E73",      # remote(), fetch (to_here), cancel
    "rref-protocol": "#E69F00",  # fork, child-accept, delete
    "autograd": "#CC79A7",  # gradients, credits, flushes, release
    "reply": "#56B4E9",
    "error": "#D55E00",
    "other": "#7f7f7f",
}
# Attributes of marks drawn on the view's background (see the module docstring).
FG = 'fill="currentColor"'
MUTED = 'fill="currentColor" fill-opacity="0.78"'  # secondary text: 4.5:1 on either theme
RULE = 'stroke="currentColor" stroke-opacity="0.45"'  # lifelines, grid lines, borders
STRIPE = 'fill="currentColor" fill-opacity="0.04"'  # alternate rows and lanes
# error text: JupyterLab's error colour; elsewhere red mixed with the text colour,
# which reads on a light and on a dark page (no one red does on both)
ERROR = ('fill="#c62828" '
         'style="fill: var(--jp-error-color1, color-mix(in srgb, #d32f2f 60%, currentColor))"')
# a backing for a label that lies over lines: the notebook's background where
# JupyterLab's variables say what it is, else none (a guess could be text-coloured)
BACKING = 'fill="none" style="fill: var(--jp-layout-color0, transparent)"'
STATE_COLOURS = {"ready": "#2e7d32", "busy": "#ef6c00", "starting": "#1565c0",
                 "dead": "#c62828", "stopped": "#7f7f7f", "left": "#7f7f7f"}


def colour(kind: str) -> str:
    return KIND_COLOURS.get(kind) or KIND_COLOURS.get(family(kind)) or KIND_COLOURS["other"]


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def clip_middle(text: str, width: int) -> str:
    """``text`` in ``width`` characters, cut in the middle: names that differ at
    their ends (``worker10``, ``worker11``) stay apart.

    >>> clip_middle("worker10", 6), clip_middle("driver", 6)
    ('wo…r10', 'driver')
    """
    if len(text) <= width:
        return text
    tail = width // 2
    return text[: width - 1 - tail] + "…" + text[len(text) - tail:]


def svg(width: float, height: float, body: str, label: str, themed: bool = False) -> str:
    """A standalone ``<svg>`` element (it also reads inside a saved notebook on GitHub).
    ``themed``: marks with no fill of their own (text) take the surrounding text
    colour, so they read on a light and a dark background alike."""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{esc(label)}" '
            f'font-family="sans-serif" font-size="11"{" " + FG if themed else ""}>'
            + body + "</svg>")
