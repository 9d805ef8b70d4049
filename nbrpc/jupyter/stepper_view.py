"""The distributed backward pass, one stage at a time: graph, Step / Run / Reset, norms.

:class:`StepperState` says in words (panel, text) what a stepper has done;
:class:`StepperView` is the widget (``stepper.widget()``); the drawing and the
replay that finds which nodes each stage ran are in :mod:`.stepper_graph`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import Any

from ..debug import plural
from .stepper_graph import MAX_ROWS, WORKER_COLOURS, _node_label, _Replay, fmt, graph_svg, total
from .svg import esc
from .view import View, button

log = logging.getLogger(__name__)


# -- the state in words -------------------------------------------------------------------
class StepperState:
    """Everything a view shows of a stepper, computed from plain data (no widget)."""

    def __init__(self, stepper: Any, graph: dict[str, Any] | None = None,
                 expected: Mapping[Any, Any] | None = None,
                 names: Mapping[Any, str] | None = None, against: str = "backward()",
                 check: list[dict[str, Any]] | None = None) -> None:
        self.stepper = stepper
        self.graph = graph if graph is not None else stepper.graph()
        self.records = list(stepper.records)
        self.pending = list(stepper.pending)
        self.failed = stepper.failed
        self.replay = _Replay(self.graph, self.records)
        self.last = self.records[-1] if self.records else None
        self.expected, self.names, self.against = expected, names or {}, against
        self.check = check if check is not None else self._check()

    @property
    def done(self) -> bool:
        return not self.pending and self.failed is None

    def title(self) -> str:
        n = len(self.records)
        state = ("failed" if self.failed is not None else "done" if self.done
                 else f"{len(self.pending)} pending")
        return f"Backward stepper: {n} stage{'' if n == 1 else 's'} run, {state}"

    def _trig(self, rec: dict[str, Any]) -> str:
        return self.replay.trigger(rec["worker"], rec["trigger"])

    def gradients(self) -> list[tuple[str, str, list[int], float | None]]:
        """(worker, leaf, shape, norm) of every leaf gradient of the pass, by worker."""
        order = {d["worker"]: d["rank"] for d in self.graph["workers"].values()}
        rows = [(r["worker"], g["leaf"], g["shape"], g["norm"])
                for r in self.records for g in r["gradients"]]
        return sorted(rows, key=lambda t: (order.get(t[0], 1 << 30), t[1], t[2]))

    def _check(self) -> list[dict[str, Any]]:
        """Each expected leaf: its gradient here, and whether it equals the expected one."""
        if not self.expected or not self.done:
            return []
        import torch

        from ..autograd.engine import norm

        def dense(t: Any) -> Any:  # (a sparse gradient, as an EmbeddingBag's)
            return t if t is None or t.layout is torch.strided else t.to_dense()

        here = next((d["worker"] for d in self.graph["workers"].values() if d["roots"]), "")
        out = []
        for i, (leaf, want) in enumerate(list(self.expected.items())[:MAX_ROWS * 5]):
            got = self.stepper.gradient_of(leaf)
            name = self.names.get(leaf) or _leaf_name(leaf, want, i)
            same = (got is not None and want is not None and got.shape == want.shape
                    and bool(torch.allclose(dense(got), dense(want), rtol=1e-5, atol=1e-6)))
            out.append({"name": name, "shape": list(want.shape) if want is not None else None,
                        "norm": norm(got),
                        "equal": same,
                        "worker": leaf.owner_name() if hasattr(leaf, "owner_name") else here})
        return out

    def last_html(self) -> str:
        rec = self.last
        if rec is None:
            return "<p>No stage has run yet.</p>"
        nodes = ", ".join(f"{esc(n)}{f' ×{c}' if c > 1 else ''}"
                          for n, c in Counter(rec["nodes"]).items()) or "nothing"
        grads = "".join(f"<li>{esc(g['leaf'])}: ‖g‖ {fmt(g['norm'])}</li>"
                        for g in rec["gradients"][:MAX_ROWS])
        sent = "".join(f"<li>{esc(self.replay.label.get(s['msg_id'], '?'))} to "
                       f"{esc(self.replay.rank_name.get(s['to'], s['to']))}: ‖g‖ "
                       f"{fmt(total(s['norms']))}</li>" for s in rec["sent"][:MAX_ROWS])
        return (f"<p><b>Stage {len(self.records)}</b> on <b>{esc(rec['worker'])}</b>: "
                f"{esc(self._trig(rec))}<br>ran: {nodes}</p>"
                + (f"<p>leaf gradients:</p><ul>{grads}</ul>" if grads else "")
                + (f"<p>sent:</p><ul>{sent}</ul>" if sent else ""))

    def panel_html(self) -> str:
        parts = []
        if self.failed is not None:
            e = self.failed
            where = getattr(e, "remote_worker", None)
            parts.append(f'<div class="nbrpc-error"><b>{esc(type(e).__name__)}</b>'
                         f"{f' on {esc(where)}' if where else ''}: {esc(e)}</div>")
        parts.append(self.last_html())
        if self.pending:
            items = "".join(f"<li>{esc(p['worker'])}: {esc(self._trig(p))}</li>"
                            for p in self.pending[:MAX_ROWS])
            more = len(self.pending) - MAX_ROWS
            parts.append(f"<p>pending, in order:</p><ol>{items}</ol>"
                         + (f"<p>… and {more} more</p>" if more > 0 else ""))
        if self.done:
            parts.append(self.gradients_html())
        return "".join(parts)

    def gradients_html(self) -> str:
        """The final gradients: one table of the named leaves (where they live, the
        norm, and whether it equals the expected gradient) when ``expected`` names
        every leaf of the pass, else the leaves by worker, then the comparison."""
        grads = self.gradients()
        out = []
        if not self.check or len(self.check) != len(grads):
            rows = "".join(f"<tr><td>{esc(w)}</td><td>{esc(leaf)}</td><td>{fmt(n)}</td></tr>"
                           for w, leaf, _, n in grads[:MAX_ROWS])
            out.append(f"<p><b>Final gradients</b></p>{_table(['worker', 'leaf', '‖g‖'], rows)}")
        if self.check:
            rows = "".join(f"<tr><td>{esc(c['name'])}</td><td>{esc(c.get('worker', ''))}</td>"
                           f"<td>{fmt(c['norm'])}</td>"
                           f"<td>{'yes' if c['equal'] else '<b>no</b>'}</td></tr>"
                           for c in self.check[:MAX_ROWS])
            title = ("<p><b>Final gradients</b></p>" if len(self.check) == len(grads) else "")
            out.append(f"{title}<p>equal: to {esc(self.against)}'s gradient</p>"
                       f"{_table(['leaf', 'on', '‖g‖', 'equal'], rows)}")
        return "".join(out)

    def text(self) -> str:
        lines = [self.title()]
        if self.last is not None:
            lines.append(f"last: stage {len(self.records)} on {self.last['worker']}, "
                         f"{self._trig(self.last)}")
        if self.failed is not None:
            where = getattr(self.failed, "remote_worker", None)
            lines.append(f"error: {type(self.failed).__name__}"
                         f"{f' on {where}' if where else ''}: {self.failed}")
        pending = "; ".join(f"{p['worker']} ({self._trig(p)})" for p in self.pending[:MAX_ROWS])
        lines.append(f"pending: {pending or 'none'}")
        for d in sorted(self.graph["workers"].values(), key=lambda d: d["worker"]):
            names = Counter(n["name"] for n in d["nodes"])
            nodes = ", ".join(f"{n}{f' x{c}' if c > 1 else ''}" for n, c in sorted(names.items()))
            sends = len(d["sends"])
            lines.append(f"  {d['worker']}: {nodes}; {sends} send{'' if sends == 1 else 's'}")
        if self.done:
            lines += [f"  grad {w} {leaf}: norm {fmt(n)}" for w, leaf, _, n in self.gradients()]
        lines += [f"  equal to {self.against}'s: {c['name']}: {'yes' if c['equal'] else 'no'}"
                  for c in self.check]
        return "\n".join(lines)

    def static_html(self) -> str:
        return (f'<div class="nbrpc-static"><div><b>{esc(self.title())}</b></div>'
                f"{graph_svg(self.replay, self.last)}"
                f'<div class="nbrpc-panel">{self.panel_html()}</div></div>')


def _table(head: list[str], rows: str) -> str:
    """A table whose names never break mid-word: it scrolls sideways in its own box
    when the panel is narrower."""
    cells = "".join(f'<th style="text-align:left">{esc(h)}</th>' for h in head)
    return ('<div style="overflow-x:auto;max-width:100%"><table class="nbrpc-grads" '
            f'style="white-space:nowrap"><tr>{cells}</tr>{rows}</table></div>')


def _leaf_name(leaf: Any, want: Any, i: int) -> str:
    shape = list(want.shape) if want is not None else "?"
    owner = leaf.owner_name() + " " if hasattr(leaf, "owner_name") else ""
    return f"{owner}leaf {shape} #{i + 1}"


def stepper_html(stepper: Any) -> str:
    """The static view of a stepper (what a saved notebook shows): graph and state."""
    return StepperState(stepper).static_html()


# -- the widget ---------------------------------------------------------------------------
class StepperView(View):
    """A :class:`~nbrpc.autograd.BackwardStepper` as a widget (``stepper.widget()``).

    ``expected``: ``{leaf: gradient}`` (leaves: tensors here, or RRefs to tensors on
    their owners) to compare the final gradients with, e.g. those of a normal
    ``backward`` in another context; ``names``: ``{leaf: name}`` for that table;
    ``against``: what the expected gradients come from.

    The widget always shows the latest stage; ``view.snapshot()`` is a picture of
    it as it stands, which a notebook cell keeps while the pass goes on (shown
    after each step, it keeps the story of the pass in a saved notebook).
    """

    def __init__(self, stepper: Any, expected: Mapping[Any, Any] | None = None,
                 names: Mapping[Any, str] | None = None, against: str = "backward()",
                 max_run: int = 10_000) -> None:
        super().__init__()
        self.stepper, self.expected, self.names, self.against = stepper, expected, names, against
        self.max_run = max_run
        self.graph = stepper.graph()  # fixed for the context: asked once
        self.selected: str | None = None
        self._check: list[dict[str, Any]] | None = None
        self.state: StepperState
        self.refresh()

    def refresh(self) -> None:
        st = self.state = StepperState(self.stepper, self.graph, self.expected, self.names,
                                       self.against, self._check)
        if st.done and self.expected:
            self._check = st.check  # fetched once per pass
        over = st.done or st.failed is not None
        retain = self.stepper.retain_graph
        self.title = st.title()
        self.controls = [
            button("step", "Step", over, "run the next pending stage"),
            button("run", "Run", over, "run every remaining stage"),
            button("reset", "Reset", not retain,
                   "start the same backward pass over (the context's gradients are cleared)"
                   if retain else "Reset needs backward_stepper(..., retain_graph=True): "
                   "without it the stages that ran have freed their part of the graph"),
        ]
        self.filters = {"worker": [d["worker"] for d in st.replay.workers]}
        self.html = graph_svg(st.replay, st.last)
        self.panel = self._selected_html() + st.panel_html()
        self.status = (f"context {self.stepper.context_id}, pass {self.stepper.pass_id}, "
                       f"retain_graph={retain}")

    def text(self) -> str:
        return self.state.text()

    # -- actions -----------------------------------------------------------------------
    def step(self) -> dict[str, Any] | None:
        """Run the next stage and return its record; a stage that fails shows its
        error in the panel (and returns None)."""
        return self._act(self.stepper.step)

    def run(self) -> list[dict[str, Any]] | None:
        """Run the remaining stages (at most ``max_run``); returns their records."""
        return self._act(lambda: self.stepper.run(self.max_run))

    def reset(self) -> None:
        """Start the same pass over (needs ``retain_graph=True``)."""
        self._check, self.selected = None, None
        self._act(self.stepper.reset)
        self.graph = self.stepper.graph()  # messages sent since count in the new pass
        self.refresh()

    def _act(self, action: Any) -> Any:
        try:
            return action()
        except Exception as e:
            if self.stepper.failed is not e:
                raise
            log.info("a backward stage failed: %s", e)  # the panel shows it
            return None
        finally:
            self.refresh()

    def on_control(self, id: str, value: Any = None) -> None:
        actions = {"step": self.step, "run": self.run, "reset": self.reset}
        if id not in actions:
            super().on_control(id, value)
        actions[id]()

    def on_select(self, key: str) -> None:
        self.selected = key
        self.refresh()

    def _selected_html(self) -> str:
        if not self.selected:
            return ""
        kind, _, rest = self.selected.partition(":")
        if kind == "m":
            msg = next((m for m, lbl in self.state.replay.label.items() if lbl == rest), None)
            flown = self.state.replay.flown.get(msg) if msg is not None else None
            what = (f"norm {fmt(flown[0])}, sent in stage {flown[1]}" if flown
                    else "no gradients sent yet")
            return f"<p><b>message {esc(rest)}</b>: {what}</p><hr>"
        worker, _, ident = rest.partition(":")
        d = self.graph["workers"].get(worker)
        if kind == "e":
            msg = next((m for m, lbl in self.state.replay.label.items() if lbl == ident), None)
            k = self.state.replay.delivered.get(msg)
            what = "the roots" if ident == "roots" else f"send function of message {ident}"
            return (f"<p><b>{esc(what)}</b> on {esc(worker)}: "
                    f"{f'gradients in stage {k}' if k else 'no gradients yet'}</p><hr>")
        if kind != "n" or d is None or not ident.isdigit():
            return ""
        node = next(n for n in d["nodes"] if n["id"] == int(ident))
        k = self.state.replay.ran.get((worker, node["id"]))
        leaf = (f"<br>leaf {esc(_node_label(node, self.state.replay))}" if "leaf" in node else "")
        where = f" ({esc(node['device'])})" if "device" in node else ""
        return (f"<p><b>{esc(node['name'])}</b> on {esc(worker)}{where}{leaf}<br>"
                f"{f'ran in stage {k}' if k else 'not run yet'}; feeds "
                f"{plural(len(node['next']), 'node')}</p><hr>")


# -- plots --------------------------------------------------------------------------------
def plot_grad_norms(stepper: Any) -> Any:
    """The norm of the gradients each stage produced (sent onward and accumulated
    into leaves), one bar per stage coloured by worker: a ``matplotlib.figure.Figure``."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    records = list(stepper.records)
    workers = sorted({r["worker"] for r in records})
    colour = {w: WORKER_COLOURS[i % len(WORKER_COLOURS)] for i, w in enumerate(workers)}
    norms = [total([g["norm"] for g in r["gradients"]] + [n for s in r["sent"]
                                                         for n in s["norms"]]) for r in records]
    fig = Figure(figsize=(max(4.0, 0.6 * len(records) + 2), 3), layout="constrained")
    ax = fig.add_subplot()
    ax.bar(range(1, len(records) + 1), norms, color=[colour[r["worker"]] for r in records])
    ax.set_xticks(range(1, len(records) + 1))
    ax.set_xlabel("stage")
    ax.set_ylabel("‖gradients produced‖")
    ax.set_title("gradient norm per stage")
    if workers:
        ax.legend(handles=[Patch(color=colour[w], label=w) for w in workers])
    else:
        ax.text(0.5, 0.5, "no stage has run yet", ha="center", transform=ax.transAxes)
    return fig
