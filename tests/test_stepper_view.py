"""The backward stepper's widget, without a browser: its state after Step, Run and
Reset, a failing stage, the final gradients against ``backward()`` and local
PyTorch, bounded drawing, the gradient-norm plot, a drawing that fits a 900 px
column (lanes, labels, arrows around the lanes) and snapshots. Four agents in
this process."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import local_group, poll_for
from test_autograd_inprocess import (
    acting_as,
    explode,
    make_embedding,
    make_param,
    tanh_mm,
    weight_of,
)

from nbrpc import autograd as dist_autograd
from nbrpc.jupyter import stepper_graph, stepper_view
from nbrpc.jupyter.stepper_graph import LAST, MAX_NODES
from nbrpc.jupyter.stepper_view import StepperView, plot_grad_norms, stepper_html
from nbrpc.rpc import RRef, remote, rpc_sync


@pytest.fixture
def group():
    with local_group(["a", "b", "c", "d"]) as agents, acting_as(agents[0]):
        yield agents
        assert poll_for(lambda: not any(ag.ext["autograd"].contexts for ag in agents),
                        timeout=5)


# -- functions that run on the workers (shared with test_autograd_inprocess) -------------
def local(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


@pytest.fixture
def chain(group):
    """a -> b -> c -> b -> a: x on a, wb on b, wc on c; and the loss, locally."""
    wb, wc = remote("b", make_param, (1, 4, 3)), remote("c", make_param, (2, 3, 2))
    x = make_param(0, 5, 4)
    xl, bl, cl = local(x), local(wb.to_here()), local(wc.to_here())
    (torch.tanh(torch.tanh(xl @ bl) @ cl) ** 2).sum().backward()
    return x, wb, wc, {x: xl.grad, wb: bl.grad, wc: cl.grad}


def forward(x: torch.Tensor, wb: RRef, wc: RRef) -> torch.Tensor:
    out = rpc_sync("b", tanh_mm, (x, wb, "c", wc))
    return (out * out).sum()


def controls(view: StepperView) -> dict[str, dict]:
    return {c["id"]: c for c in view.controls}


def lit_nodes(view: StepperView) -> set[str]:
    """The data-keys of the boxes drawn in the last stage's colour."""
    return lit_nodes_in(view.html)


# -- Step, Run, Reset ---------------------------------------------------------------------
def test_each_step_highlights_its_stage_and_lists_the_pending_ones(chain) -> None:
    x, wb, wc, _ = chain
    with dist_autograd.context() as ctx:
        stepper = dist_autograd.backward_stepper(ctx, [forward(x, wb, wc)])
        view = stepper.widget()
        assert view.title == "Backward stepper: 0 stages run, 1 pending"
        assert "No stage has run yet" in view.panel and "<li>a: roots</li>" in view.panel
        assert not lit_nodes(view)
        workers = []
        for k in range(1, 6):
            view.on_control("step")
            rec = stepper.records[-1]
            workers.append(rec["worker"])
            assert view.state.replay.exact == [True] * k  # the nodes that ran are known
            lit = lit_nodes(view)
            assert lit and {key.split(":")[1] for key in lit} == {rec["worker"]}
            assert sorted(view.state.replay.ran[(rec["worker"], int(key.split(":")[2]))]
                          for key in lit) == [k] * len(lit)
            assert len(lit) == len(rec["nodes"])
            assert f"<b>Stage {k}</b> on <b>{rec['worker']}</b>" in view.panel
            assert f"last: stage {k} on {rec['worker']}" in view.text()
            for p in stepper.pending:
                assert f"<li>{p['worker']}: grads for m" in view.panel
            assert (controls(view)["step"]["disabled"]) == stepper.done
        assert workers == ["a", "b", "c", "b", "a"]
        assert controls(view)["run"]["disabled"] and "Final gradients" in view.panel
        # every node of the graph ran exactly once, in one of the five stages
        graph_nodes = {(w, n["id"]) for w, d in view.graph["workers"].items() for n in d["nodes"]}
        assert set(view.state.replay.ran) == graph_nodes
        view.close()


def test_text_and_markup_are_the_same_in_two_runs(chain) -> None:
    x, wb, wc, _ = chain
    seen = []
    for _ in range(2):
        with dist_autograd.context() as ctx:
            stepper = dist_autograd.backward_stepper(ctx, [forward(x, wb, wc)])
            view = StepperView(stepper)
            view.step()
            view.step()
            seen.append((view.text(), view.html, view.panel, stepper_html(stepper)))
            assert "pending: c (grads for m" in view.text()
            assert str(ctx) not in view.text() + view.html + view.panel
            data, _ = view._repr_mimebundle_()
            assert data["text/plain"] == view.text() and view.html in data["text/html"]
            view.close()
    assert seen[0] == seen[1]


def test_run_shows_final_gradients_equal_to_backward_and_to_local_pytorch(chain) -> None:
    x, wb, wc, local_grads = chain
    with dist_autograd.context() as ref:  # the normal pass, in another context
        dist_autograd.backward(ref, [forward(x, wb, wc)])
        stepper_ref = dist_autograd.backward_stepper  # (no pass: only to read gradients)
        grads = dist_autograd.get_gradients(ref)
        normal = {x: grads[x], wb: rpc_sync("b", grad_in, (ref, wb)),
                  wc: rpc_sync("c", grad_in, (ref, wc))}
    assert stepper_ref is not None
    names = {x: "x", wb: "wb", wc: "wc"}
    with dist_autograd.context() as ctx:
        stepper = dist_autograd.backward_stepper(ctx, [forward(x, wb, wc)])
        view = StepperView(stepper, expected=normal, names=names)
        local_view = StepperView(stepper, expected=local_grads, names=names, against="local")
        view.on_control("run")
        local_view.refresh()
        assert stepper.done and view.title == "Backward stepper: 5 stages run, done"
        assert controls(view)["step"]["disabled"] and controls(view)["run"]["disabled"]
        for v in (view, local_view):
            assert [(c["name"], c["equal"]) for c in v.state.check] == [
                ("x", True), ("wb", True), ("wc", True)]
        assert "equal to backward()'s: wb: yes" in view.text()
        assert "equal to local's: wc: yes" in local_view.text()
        for leaf, want in local_grads.items():
            assert torch.allclose(stepper.gradient_of(leaf), want)
        # expected names every leaf: one table of names, owners, norms and the check
        assert view.panel.count("<table") == 1 and "<td>wb</td><td>b</td>" in view.panel
        unnamed = StepperView(stepper, expected={x: normal[x]})  # not every leaf: both
        assert unnamed.panel.count("<table") == 2
        assert "<td>b</td><td>leaf[4, 3]</td>" in unnamed.panel
        unnamed.close()
        # a wrong expectation says no
        wrong = StepperView(stepper, expected={x: 2 * normal[x]}, names=names)
        assert wrong.state.check[0]["equal"] is False and "<b>no</b>" in wrong.panel
        for v in (view, local_view, wrong):
            v.close()


def grad_in(ctx: int, w: RRef) -> torch.Tensor:
    return dist_autograd.get_gradients(ctx)[w.local_value()]


def bags(idx: torch.Tensor, emb: RRef) -> torch.Tensor:
    return emb.local_value()(idx, torch.tensor([0, 2]))


def test_a_sparse_gradient_is_checked_and_its_norm_shown(group) -> None:
    """An EmbeddingBag's sparse gradient (on b): the final check compares it
    with local PyTorch's and the panel shows its norm (of its values)."""
    emb = remote("b", make_embedding, (4,))
    idx = torch.tensor([0, 2, 2, 5])
    el = emb.to_here()
    (el(idx, torch.tensor([0, 2])) ** 2).sum().backward()
    weight = rpc_sync("b", weight_of, (emb,))
    with dist_autograd.context() as ctx:
        y = rpc_sync("b", bags, (idx, emb))
        stepper = dist_autograd.backward_stepper(ctx, [(y ** 2).sum()])
        view = StepperView(stepper, expected={weight: el.weight.grad}, names={weight: "emb"})
        view.on_control("run")
        (check,) = view.state.check
        assert check["equal"] is True and check["name"] == "emb"
        assert check["norm"] == pytest.approx(float(el.weight.grad.coalesce().values().norm()))
        view.close()


def test_reset_starts_the_same_pass_over_without_doubling_gradients(chain) -> None:
    x, wb, wc, local_grads = chain
    with dist_autograd.context() as ctx:
        stepper = dist_autograd.backward_stepper(ctx, [forward(x, wb, wc)], retain_graph=True)
        view = StepperView(stepper, expected=local_grads)
        assert not controls(view)["reset"]["disabled"]
        view.run()
        first = [c["equal"] for c in view.state.check]
        view.on_control("reset")
        assert stepper.records == [] and view.state.check == [] and not lit_nodes(view)
        assert stepper.gradient_of(x) is None and stepper.gradient_of(wc) is None
        assert view.title == "Backward stepper: 0 stages run, 1 pending"
        assert view.step()["worker"] == "a"
        view.on_control("reset")  # in the middle of a pass, too
        wb.to_here()  # b sends wb inside the context: a send that gets no gradient
        view.on_control("reset")
        records = view.run()
        assert [r["trigger"] for r in records][-1] == "flush"  # b's wb waited for it
        assert all(view.state.replay.exact)  # the graph was read again
        assert first == [True, True, True] == [c["equal"] for c in view.state.check]
        for leaf, want in local_grads.items():  # one pass's worth, not two
            assert torch.allclose(stepper.gradient_of(leaf), want)
        view.close()


def test_reset_is_disabled_without_retain_graph_and_says_why(chain) -> None:
    x, wb, wc, _ = chain
    with dist_autograd.context() as ctx:
        view = StepperView(dist_autograd.backward_stepper(ctx, [forward(x, wb, wc)]))
        reset = controls(view)["reset"]
        assert reset["disabled"] and "retain_graph=True" in reset["title"]
        view._on_front_end(view, {"event": "control", "id": "reset"}, None)  # a stale click
        assert "RuntimeError" in view.panel and "retain_graph=True" in view.panel
        view.run()
        view.close()


def test_a_failing_stage_shows_its_error_and_stops_the_buttons(group) -> None:
    x = make_param(2, 3)
    with dist_autograd.context() as ctx:
        y = rpc_sync("c", explode, (x,))
        stepper = dist_autograd.backward_stepper(ctx, [y.sum()], retain_graph=True)
        view = StepperView(stepper)
        view.on_control("step")  # a's roots: fine
        view.on_control("step")  # c's stage raises
        assert isinstance(stepper.failed, ValueError)
        assert '<div class="nbrpc-error"><b>ValueError</b> on c: boom in backward' in view.panel
        assert "error: ValueError on c: boom in backward" in view.text()
        assert view.title.endswith("failed")
        assert controls(view)["step"]["disabled"] and controls(view)["run"]["disabled"]
        assert not controls(view)["reset"]["disabled"]  # a reset may try again
        view.close()


# -- bounds, clicks, statics ----------------------------------------------------------------
def long_chain(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = x * 1.01
    return x


def test_a_big_graph_is_drawn_bounded(group) -> None:
    x = make_param(3, 4)
    with dist_autograd.context() as ctx:
        y = rpc_sync("b", long_chain, (x, 150))
        stepper = dist_autograd.backward_stepper(ctx, [y.sum()])
        view = StepperView(stepper)
        drawn = view.html.count('<g data-key="n:b:')
        assert drawn == MAX_NODES and "… and 91 more nodes" in view.html
        view.run()
        assert stepper.done and all(view.state.replay.exact)
        assert "MulBackward0 x150" in view.text()
        assert torch.allclose(stepper.gradient_of(x), torch.full((4,), 1.01 ** 150))
        view.close()


def test_clicking_a_node_or_message_shows_it(chain) -> None:
    x, wb, wc, _ = chain
    with dist_autograd.context() as ctx:
        view = StepperView(dist_autograd.backward_stepper(ctx, [forward(x, wb, wc)]))
        view.run()
        mm = next(n["id"] for n in view.graph["workers"]["c"]["nodes"]
                  if n["name"] == "MmBackward0")
        view._on_front_end(view, {"event": "select", "key": f"n:c:{mm}"}, None)
        assert view.panel.startswith("<p><b>MmBackward0</b> on c<br>ran in stage 3")
        view.on_select("m:m1")
        assert re.match(r"<p><b>message m1</b>: norm [\d.]+, sent in stage \d", view.panel)
        view.close()


def test_plot_of_gradient_norms_has_one_bar_per_stage(chain) -> None:
    from matplotlib.figure import Figure

    x, wb, wc, _ = chain
    with dist_autograd.context() as ctx:
        stepper = dist_autograd.backward_stepper(ctx, [forward(x, wb, wc)])
        empty = plot_grad_norms(stepper)
        stepper.run()
        fig = plot_grad_norms(stepper)
    assert isinstance(fig, Figure) and isinstance(empty, Figure)
    (ax,) = fig.axes
    assert len(ax.patches) == 5
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "b", "c"]
    colours = {p.get_facecolor() for p in ax.patches}
    assert len(colours) == 3  # by worker
    assert stepper_view.WORKER_COLOURS  # the lanes' colours


def test_the_views_registry_makes_it(chain) -> None:
    x, wb, wc, _ = chain
    with dist_autograd.context() as ctx:
        stepper = dist_autograd.backward_stepper(ctx, [forward(x, wb, wc)])
        view = stepper.widget(against="a local model")
        assert isinstance(view, StepperView) and view.against == "a local model"
        assert view.filters == {"worker": ["a", "b", "c"]}
        stepper.run()
        view.close()


# -- readable at a 900 px column --------------------------------------------------------------
def boxes(svg: str) -> dict[str, tuple[float, float, float, float]]:
    """data-key -> (x, y, width, height) of every node and entry box."""
    return {k: tuple(map(float, xywh)) for k, *xywh in re.findall(
        r'<g data-key="([ne]:[^"]+)"><rect x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" '
        r'height="([\d.]+)"', svg)}


def lanes(svg: str) -> dict[str, tuple[float, float, float, float]]:
    return {w: tuple(map(float, xywh)) for w, *xywh in re.findall(
        r'data-f-worker="([^" ]+)"><rect x="([\d.]+)" y="([\d.]+)" width="([\d.]+)" '
        r'height="([\d.]+)"', svg)}


def segments(path: str) -> list[tuple[float, float, float, float]]:
    """The straight pieces of an SVG path made of M, H and V commands."""
    x = y = 0.0
    out = []
    for cmd, a, b in re.findall(r"([MHV])([\d.]+)(?:,([\d.]+))?", path):
        nx, ny = (float(a), float(b)) if cmd == "M" else (float(a), y) if cmd == "H" else (
            x, float(a))
        if cmd != "M":
            out.append((x, y, nx, ny))
        x, y = nx, ny
    return out


def crosses(seg: tuple[float, float, float, float], box: tuple[float, float, float, float]) -> bool:
    """Whether a horizontal or vertical segment runs through the inside of a box."""
    x1, y1, x2, y2 = seg
    bx, by, bw, bh = box
    if y1 == y2:
        return by < y1 < by + bh and min(x1, x2) < bx + bw and max(x1, x2) > bx
    return bx < x1 < bx + bw and min(y1, y2) < by + bh and max(y1, y2) > by


def synthetic(workers: int, per_level: int, name: str = "MkldnnRnnLayerBackward0") -> dict:
    """A graph: every worker with ``per_level`` nodes on each of 3 levels, a leaf under
    each, and a received tensor whose gradient goes back to the previous worker."""
    out = {}
    for r in range(workers):
        nodes = [{"id": i, "name": name, "next": [i + per_level] if i < 2 * per_level else
                  [3 * per_level + i % per_level]} for i in range(3 * per_level)]
        nodes += [{"id": 3 * per_level + j, "name": "AccumulateGrad", "next": [],
                   "leaf": f"leaf[{j}]", "shape": [j + 1]} for j in range(per_level)]
        nodes.append({"id": 99, "name": "RecvRpcBackward", "next": [], "leaf": "recv",
                      "shape": [2, 3], "recv": 1000 + r})
        out[f"worker{r}"] = {
            "worker": f"worker{r}", "rank": r, "roots": list(range(per_level)) if r == 0 else [],
            "sends": [{"msg_id": 1000 + (r + 1) % workers, "to": f"worker{(r + 1) % workers}",
                       "enters": list(range(per_level))}],
            "recvs": [{"msg_id": 1000 + r, "from": f"worker{(r - 1) % workers}",
                       "leaves": [99]}],
            "nodes": nodes}
    return {"workers": out}


def drawing(graph: dict) -> str:
    return stepper_graph.graph_svg(stepper_graph._Replay(graph, []), None)


def svg_width(svg: str) -> float:
    return float(re.match(r'<svg [^>]*width="(\d+)"', svg).group(1))


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_the_drawing_fits_a_900_px_column(workers: int) -> None:
    svg = drawing(synthetic(workers, per_level=4))
    assert svg_width(svg) <= stepper_graph.MAX_WIDTH
    drawn = lanes(svg)
    assert len(drawn) == workers  # every worker's lane is in it, none under another
    spans = sorted((x, x + w) for x, _, w, _ in drawn.values())
    assert all(a[1] < b[0] for a, b in zip(spans, spans[1:]))
    for key, (x, y, w, h) in boxes(svg).items():  # each box inside its own lane
        lx, ly, lw, lh = drawn[key.split(":")[1]]
        assert lx <= x and x + w <= lx + lw and ly <= y and y + h <= ly + lh, key


def test_past_the_width_lanes_are_one_box_wide_and_the_drawing_scrolls() -> None:
    svg = drawing(synthetic(12, per_level=3))
    one = stepper_graph.NODE_W + 2 * stepper_graph.PAD
    assert all(w == one for _, _, w, _ in lanes(svg).values())
    assert svg_width(svg) > stepper_graph.MAX_WIDTH


def test_labels_drop_the_backward_suffix_and_the_full_name_shows_on_hover() -> None:
    svg = drawing(synthetic(2, per_level=1, name="ConvolutionBackwardOverrideableBackward0"))
    node = re.search(r'<g data-key="n:worker0:0">(.*?)</g>', svg).group(1)
    assert re.findall(r"<text [^>]*>([^<]*)</text>", node) == ["Convolution",
                                                               "BackwardOverride…"]
    assert "<title>ConvolutionBackwardOverrideableBackward0 on worker0" in node
    svg = drawing(synthetic(2, per_level=1))
    node = re.search(r'<g data-key="n:worker0:0">(.*?)</g>', svg).group(1)
    assert re.findall(r"<text [^>]*>([^<]*)</text>", node) == ["MkldnnRnnLayer"]
    recv = re.search(r'<g data-key="n:worker0:99">(.*?)</g>', svg).group(1)
    assert re.findall(r"<text [^>]*>([^<]*)</text>", recv) == ["recv m2 [2, 3]"]
    assert "…" not in "".join(re.findall(r"<text [^>]*>([^<]*)</text>", svg))


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_gradient_arrows_go_around_the_lanes(workers: int) -> None:
    svg = drawing(synthetic(workers, per_level=3))
    drawn, all_boxes = lanes(svg), boxes(svg)
    arrows = re.findall(r'<g data-key="m:(m\d+)"[^>]*><path d="([^"]+)"', svg)
    assert len(arrows) == workers
    for label, path in arrows:
        segs = segments(path)
        assert len(segs) == 5, path  # down, along, up, along, down
        inner = segs[1:4]  # between the lanes: they cross no lane at all
        assert not [(s, w) for s in inner for w, lane in drawn.items() if crosses(s, lane)]
        for s in (segs[0], segs[-1]):  # out of the leaf, into the send box: no other box
            hit = [k for k, b in all_boxes.items() if crosses(s, b)]
            assert not hit, (label, s, hit)


def test_the_chain_is_drawn_within_the_width_with_arrows_around_lanes(chain) -> None:
    x, wb, wc, _ = chain
    with dist_autograd.context() as ctx:
        view = StepperView(dist_autograd.backward_stepper(ctx, [forward(x, wb, wc)]))
        view.run()
        assert svg_width(view.html) <= stepper_graph.MAX_WIDTH
        drawn = lanes(view.html)
        for _, path in re.findall(r'<g data-key="m:(m\d+)"[^>]*><path d="([^"]+)"', view.html):
            assert not [w for s in segments(path)[1:4] for w, ln in drawn.items()
                        if crosses(s, ln)]
        view.close()


def test_snapshots_keep_each_step_while_the_view_moves_on(chain) -> None:
    x, wb, wc, _ = chain
    with dist_autograd.context() as ctx:
        view = StepperView(dist_autograd.backward_stepper(ctx, [forward(x, wb, wc)]))
        snaps = []
        for _ in range(2):
            view.step()
            snaps.append(view.snapshot())
        view.run()
        html = [s._repr_html_() for s in snaps]
        assert "1 stage run, 1 pending" in html[0] and "2 stages run" in html[1]
        assert repr(snaps[0]).startswith("Backward stepper: 1 stage run")
        assert "5 stages run, done" in view.static_html()
        assert lit_nodes_in(html[0]) != lit_nodes_in(html[1])
        view.close()


def lit_nodes_in(markup: str) -> set[str]:
    return set(re.findall(rf'<g data-key="(n:[^"]+)"><rect [^>]*fill="{LAST}"', markup))
