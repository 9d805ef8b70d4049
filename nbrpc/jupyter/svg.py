"""Small, shared pieces of the SVG that every view draws: escaping, colours, sizes.

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
STATE_COLOURS = {"ready": "#2e7d32", "busy": "#ef6c00", "starting": "#1565c0",
                 "dead": "#c62828", "stopped": "#7f7f7f", "left": "#7f7f7f"}


def colour(kind: str) -> str:
    return KIND_COLOURS.get(kind) or KIND_COLOURS.get(family(kind)) or KIND_COLOURS["other"]


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def fmt_bytes(n: int | float | None) -> str:
    if n is None:
        return "?"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def svg(width: float, height: float, body: str, label: str) -> str:
    """A standalone ``<svg>`` element (it also reads inside a saved notebook on GitHub)."""
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
            f'viewBox="0 0 {width:.0f} {height:.0f}" role="img" aria-label="{esc(label)}" '
            'font-family="sans-serif" font-size="11">' + body + "</svg>")
