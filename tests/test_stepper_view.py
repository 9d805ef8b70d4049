"""The backward stepper's widget, without a browser: its state after Step, Run and
Reset, a failing stage, the final gradients against ``backward()`` and local
PyTorch, bounded drawing, and the gradient-norm plot. Four agents in this process."""

from __future__ import annotations

import re

import pytest
import torch
from conftest import local_group, poll_for
from test_autograd_inprocess import acting_as, explode, make_param, tanh_mm

from nbrpc import autograd as dist_autograd
from nbrpc.jupyter import stepper_view
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
    return set(re.findall(rf'<g data-key="(n:[^"]+)"><rect [^>]*fill="{LAST}"', view.html))


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
        assert "<td>b</td><td>leaf[4, 3]</td>" in view.panel
        # a wrong expectation says no
        wrong = StepperView(stepper, expected={x: 2 * normal[x]}, names=names)
        assert wrong.state.check[0]["equal"] is False and "<b>no</b>" in wrong.panel
        for v in (view, local_view, wrong):
            v.close()


def grad_in(ctx: int, w: RRef) -> torch.Tensor:
    return dist_autograd.get_gradients(ctx)[w.local_value()]


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
