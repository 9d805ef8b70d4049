"""The backward engine's dependency counting, with no network: the "workers"
are LocalPass objects and the test carries their outboxes by hand."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable

import pytest
import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from nbrpc.autograd.backward import check_roots
from nbrpc.autograd.engine import BackwardError
from nbrpc.autograd.engine import LocalPass as _LocalPass

LocalPass = _LocalPass  # each test: by_engine set both ways (the by_engine fixture)


class Counted(torch.autograd.Function):
    """Identity whose backward counts its runs (and the gradients it saw)."""

    calls: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        Counted.calls.append(g.clone())
        return g


@pytest.fixture(autouse=True)
def _reset_counter():
    Counted.calls = []


@pytest.fixture(autouse=True, params=[False, True], ids=["node by node", "by engine"])
def by_engine(request, monkeypatch) -> bool:
    """Every test runs both ways a stage can run: one node at a time (step
    mode, and stages that leave nodes waiting) and in PyTorch's engine."""
    monkeypatch.setattr(sys.modules[__name__], "LocalPass",
                        functools.partial(_LocalPass, by_engine=request.param))
    return request.param


def collector() -> tuple[dict, callable]:
    got: dict = {}

    def accumulate(t, g):
        got[t] = g if t not in got else got[t] + g
    return got, accumulate


def test_a_node_fed_by_two_sends_runs_once_with_their_sum() -> None:
    # worker A: h = Counted(x * 3) is sent twice (two messages) to B
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    h = Counted.apply(x * 3)
    got, acc = collector()
    a = LocalPass("A", {1: [h], 2: [h]}, {}, acc)
    a.receive(1, [torch.ones(2)])
    record, outbox = a.run("send 1")
    assert record.nodes == [] and record.blocked == 1  # waits for send 2
    assert Counted.calls == [] and not got
    a.receive(2, [torch.full((2,), 2.0)])
    record, outbox = a.run("send 2")
    assert record.nodes == ["CountedBackward", "MulBackward0", "AccumulateGrad"]
    assert len(Counted.calls) == 1 and torch.equal(Counted.calls[0], torch.full((2,), 3.0))
    assert torch.equal(got[x], torch.full((2,), 9.0)) and x.grad is None
    assert outbox == [] and record.blocked == 0


def test_chain_between_two_workers_matches_local_autograd() -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, 2, requires_grad=True)
    # A sends x (msg 1) to B; B computes y = tanh(x_b @ w) and answers (msg 2)
    x_b = x.detach().requires_grad_()
    y = torch.tanh(x_b @ w)
    y_a = y.detach().requires_grad_()
    loss = (y_a * y_a).sum()
    got_a, acc_a = collector()
    got_b, acc_b = collector()
    a = LocalPass("A", {1: [x]}, {2: (1, [y_a])}, acc_a, roots=[loss])
    b = LocalPass("B", {2: [y]}, {1: (0, [x_b])}, acc_b)
    a.start()
    _, out = a.run()
    assert [(o.peer, o.msg_id) for o in out] == [(1, 2)]
    b.receive(2, out[0].grads)
    record, out = b.run()
    assert record.nodes[:2] == ["TanhBackward0", "MmBackward0"]
    assert [(o.peer, o.msg_id) for o in out] == [(0, 1)]
    a.receive(1, out[0].grads)
    a.run()
    xl, wl = x.detach().requires_grad_(), w.detach().requires_grad_()
    (torch.tanh(xl @ wl) ** 2).sum().backward()
    assert torch.allclose(got_a[x], xl.grad) and torch.allclose(got_b[w], wl.grad)
    assert x.grad is None and w.grad is None


def test_a_send_that_never_gets_gradients_is_flushed() -> None:
    # x is used locally and also sent (msg 5) to a worker that never answers
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    loss = (x * 2).sum()
    got, acc = collector()
    a = LocalPass("A", {5: [x]}, {}, acc, roots=[loss])
    a.start()
    record, _ = a.run()
    assert record.blocked == 1 and x not in got
    record, out = a.flush()
    assert record.nodes == ["AccumulateGrad"] and out == []
    assert torch.equal(got[x], torch.full((2,), 2.0)) and a.blocked() == 0


def test_multi_output_nodes_get_none_for_unused_outputs() -> None:
    x = torch.arange(4.0, requires_grad=True)
    first, _second = x.split(2)
    got, acc = collector()
    a = LocalPass("A", {}, {}, acc, roots=[(first * first).sum()])
    a.start()
    a.run()
    assert torch.equal(got[x], torch.tensor([0.0, 2.0, 0.0, 0.0]))


def test_python_functions_with_non_tensor_arguments() -> None:
    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, k, x, y):
            ctx.k = k
            return x * k + y

        @staticmethod
        def backward(ctx, g):
            return None, g * ctx.k, g

    x = torch.ones(2, requires_grad=True)
    y = torch.ones(2, requires_grad=True)
    got, acc = collector()
    a = LocalPass("A", {}, {}, acc, roots=[Scale.apply(5.0, x, y).sum()])
    a.start()
    a.run()
    assert torch.equal(got[x], torch.full((2,), 5.0)) and torch.equal(got[y], torch.ones(2))


def test_a_second_pass_without_retain_graph_fails_like_pytorch() -> None:
    x = torch.ones(2, requires_grad=True)
    loss = (x.exp() * 2).sum()
    got, acc = collector()
    first = LocalPass("A", {}, {}, acc, roots=[loss], retain_graph=True)
    first.start()
    first.run()
    second = LocalPass("A", {}, {}, acc, roots=[loss])
    second.start()
    second.run()
    assert torch.allclose(got[x], 4 * x.detach().exp())
    third = LocalPass("A", {}, {}, acc, roots=[loss])
    third.start()
    # (nbrpc's BackwardError one node at a time, PyTorch's RuntimeError by its engine)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        third.run()


def test_gradients_for_an_unknown_send_are_refused() -> None:
    x = torch.ones(2, requires_grad=True)
    a = LocalPass("A", {1: [x * 2]}, {}, lambda t, g: None)
    with pytest.raises(BackwardError, match="no send function #9"):
        a.receive(9, [torch.ones(2)])
    a.receive(1, [torch.ones(2)])
    with pytest.raises(BackwardError, match="twice"):
        a.receive(1, [torch.ones(2)])


@pytest.mark.parametrize("roots,match", [
    ([], "No tensors provided"),
    ([torch.ones(2, requires_grad=True).sum().detach()], "requires_grad not set"),
    ([torch.ones(2, requires_grad=True) * 2], "not a scalar"),
    ([torch.ones((), requires_grad=True)], "valid gradient function"),
    (["loss"], "must be tensors"),
])
def test_roots_are_checked_as_in_pytorch(roots, match: str) -> None:
    with pytest.raises((RuntimeError, ValueError, TypeError), match=match):
        check_roots(roots)


# -- leaves: hooks and copies, as PyTorch's AccumulateGrad ---------------------------------
class Twice(torch.autograd.Function):
    """a + b; its backward hands the same gradient tensor to both (and says which)."""

    ptr = 0

    @staticmethod
    def forward(ctx, a, b):
        return a + b

    @staticmethod
    def backward(ctx, g):
        Twice.ptr = g.data_ptr()
        return g, g


class Same(torch.autograd.Function):
    ptr = 0

    @staticmethod
    def forward(ctx, a):
        return a.clone()

    @staticmethod
    def backward(ctx, g):
        Same.ptr = g.data_ptr()
        return g


class Spread(torch.autograd.Function):
    """Its backward returns a non-contiguous (expanded) gradient."""

    @staticmethod
    def forward(ctx, a):
        ctx.shape = a.shape
        return a.sum(0)

    @staticmethod
    def backward(ctx, g):
        return g.expand(ctx.shape)


@pytest.mark.parametrize("case", ["shared", "single", "non-contiguous"])
def test_leaf_gradients_are_copied_exactly_where_pytorch_copies_them(case: str) -> None:
    """Local autograd's .grad and the context's gradient agree on "is it the
    tensor the backward returned?" (no copy) or not (a copy, laid out as the leaf)."""

    def build(a, b):
        if case == "shared":
            return Twice.apply(a, b).sum(), lambda: Twice.ptr
        if case == "single":
            return Same.apply(a)[1].sum(), lambda: Same.ptr
        return Spread.apply(a).sum(), None

    def kept(grad, ptr):  # whether the stored gradient is the backward's own tensor
        return grad.data_ptr() == ptr() if ptr else not grad.is_contiguous()

    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    loss, ptr = build(a, b)
    loss.backward()
    local = kept(a.grad, ptr)
    got, accumulate = collector()
    loss, ptr = build(a, b)
    p = LocalPass("w", {}, {}, accumulate, roots=[loss])
    p.start()
    p.run()
    assert kept(got[a], ptr) == local == (case == "single")
    assert got[a].stride() == a.grad.stride() and torch.equal(got[a], a.grad)
    if case == "shared":
        assert got[a].data_ptr() != got[b].data_ptr()


LAYOUTS = {
    "contiguous": lambda: torch.randn(3, 4),
    "transposed": lambda: torch.randn(4, 3).t(),  # dense, not contiguous
    "size-1 dim": lambda: torch.randn(3, 4).as_strided((3, 1, 4), (4, 7, 1)),
    "overlapping": lambda: torch.randn(4).expand(3, 4),  # not dense: contiguous grads
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("grad_layout", ["contiguous", "transposed"])
def test_a_leafs_gradient_is_laid_out_as_pytorchs_accumulate_grad_lays_it(
        layout: str, grad_layout: str) -> None:
    """PyTorch's layout contract, against local autograd's ``.grad``: kept as
    it is when strided as the (dense) leaf, else a copy strided as the leaf,
    or contiguous for a leaf that is not dense."""
    leaf = LAYOUTS[layout]().detach().requires_grad_()  # (a leaf strided as made)
    weights = torch.randn(leaf.shape)
    if grad_layout == "transposed":  # the gradient comes out of mul strided as weights
        weights = torch.randn(tuple(reversed(leaf.shape))).permute(
            *reversed(range(leaf.dim())))
    (leaf * weights).sum().backward()
    got, accumulate = collector()
    p = LocalPass("w", {}, {}, accumulate, roots=[(leaf * weights).sum()])
    p.start()
    p.run()
    assert got[leaf].stride() == leaf.grad.stride(), (got[leaf].stride(), leaf.stride())
    assert torch.equal(got[leaf], leaf.grad)


def test_a_leafs_tensor_hooks_run_before_its_gradient_is_stored() -> None:
    w = torch.ones(3, requires_grad=True)
    seen = []
    w.register_hook(lambda g: seen.append(g.clone()))  # returns None: g unchanged
    w.register_hook(lambda g: g * 2)
    loss = (w * torch.tensor([1.0, 2.0, 3.0])).sum()
    got, accumulate = collector()
    p = LocalPass("w", {}, {}, accumulate, roots=[loss], retain_graph=True)
    p.start()
    p.run()
    loss.backward()  # the same in local autograd
    assert torch.equal(got[w], w.grad) and torch.equal(got[w], torch.tensor([2.0, 4.0, 6.0]))
    assert len(seen) == 2 and torch.equal(seen[0], torch.tensor([1.0, 2.0, 3.0]))


# -- hooks: every kind PyTorch's engine runs, in its order, checked against it ------------
def _hooked_model(log: list) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A small graph with every kind of backward hook, each logging what it saw
    and most changing the gradient: tensor hooks on a non-leaf and a leaf,
    ``retain_grad``, node pre-hooks and post hooks (on an interior node, a
    leaf's ``AccumulateGrad`` and a Python Function's node), and an
    ``nn.Module``'s full backward hooks, which PyTorch builds from those."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, requires_grad=True)
    lin = torch.nn.Linear(3, 3)
    lin.register_full_backward_pre_hook(
        lambda m, go: log.append(("module pre", go[0].sum().item())) or (go[0] * 2,))
    lin.register_full_backward_hook(
        lambda m, gi, go: log.append(("module", gi[0].sum().item())))
    h = lin(x)
    h.retain_grad()
    a = Counted.apply(h.tanh())
    a.register_hook(lambda g: log.append(("tensor a", g.sum().item())) or g * 3)
    a.grad_fn.register_prehook(lambda go: log.append(("pre a", go[0].sum().item())))
    a.grad_fn.register_hook(
        lambda gi, go: log.append(("post a", gi[0].sum().item())) or (gi[0] + 1,))
    m = a * x.sum(0)
    m.grad_fn.register_hook(lambda gi, go: log.append(("post m", len(gi), len(go))))
    removed = m.grad_fn.register_prehook(lambda go: log.append(("removed",)))
    removed.remove()
    acc = get_gradient_edge(lin.weight).node
    acc.register_prehook(lambda go: log.append(("pre W", go[0].sum().item())) or (go[0] / 4,))
    acc.register_hook(lambda gi, go: log.append(("post W", len(gi), go[0].sum().item())))
    x.register_hook(lambda g: log.append(("tensor x", g.sum().item())))
    return [x, lin.weight, lin.bias, h], m.sum()


def test_every_kind_of_hook_runs_as_in_local_autograd() -> None:
    (x, w, b, h), loss = _hooked_model([])
    loss.backward()
    want = {"x": x.grad, "W": w.grad, "b": b.grad, "h": h.grad}

    (x, w, b, h), loss = _hooked_model([])  # a fresh, identical model
    got, accumulate = collector()
    p = LocalPass("w", {}, {}, accumulate, roots=[loss])
    p.start()
    p.run()
    for name, t in (("x", x), ("W", w), ("b", b)):
        torch.testing.assert_close(got[t], want[name])
        assert t.grad is None  # (into the context only)
    torch.testing.assert_close(h.grad, want["h"])  # retain_grad, as PyTorch's DistEngine
    assert len(Counted.calls) == 2  # one run per pass


def test_hooks_run_in_pytorchs_order_and_see_its_values(by_engine: bool) -> None:
    """The log of every hook, in order, with what it saw: identical to local
    autograd's (``backward()`` with the weight's AccumulateGrad running). By
    the engine, an AccumulateGrad node's own hooks run once it returns."""
    local: list = []
    _, loss = _hooked_model(local)
    loss.backward()
    if by_engine:
        local = ([e for e in local if e[0] not in ("pre W", "post W")]
                 + [e for e in local if e[0] in ("pre W", "post W")])
    mine: list = []
    _, loss = _hooked_model(mine)
    got, accumulate = collector()
    p = LocalPass("w", {}, {}, accumulate, roots=[loss])
    p.start()
    p.run()
    assert [e[0] for e in mine] == [e[0] for e in local]
    for a, b in zip(mine, local):
        assert a[0] == b[0] and len(a) == len(b)
        for u, v in zip(a[1:], b[1:]):
            assert u == pytest.approx(v, rel=1e-5), (a, b)
    assert ("removed",) not in mine


def test_accumulate_grad_hooks_run_once_per_pass_with_the_summed_gradient() -> None:
    """PyTorch's test_post_hooks, and pre-hooks: a leaf used twice gets one
    gradient, so its node's hooks run once (1 + 2 + 2)."""
    calls = []
    t = torch.rand(10, 10, requires_grad=True)
    a = t + t
    first, second = a.grad_fn.next_functions[0][0], a.grad_fn.next_functions[1][0]
    first.register_hook(lambda gi, go: calls.append(1))
    first.register_hook(lambda gi, go: calls.append(2))
    second.register_hook(lambda gi, go: calls.append(2) or None)
    first.register_prehook(lambda go: calls.append(("pre", go[0][0, 0].item())))
    got, accumulate = collector()
    p = LocalPass("t", {}, {}, accumulate, roots=[a.sum()])
    p.start()
    p.run()
    assert calls == [("pre", 2.0), 1, 2, 2]
    assert list(got) == [t] and torch.equal(got[t], torch.full((10, 10), 2.0))


def test_a_hook_that_breaks_the_gradient_fails_as_in_pytorch() -> None:
    def grown(grad_inputs, grad_outputs):
        return (torch.ones(5),)

    def run(local: bool) -> str:
        w = torch.ones(2, requires_grad=True)
        y = (w * 2).tanh()
        y.grad_fn.register_hook(grown)
        with pytest.raises(RuntimeError) as err:
            if local:
                y.sum().backward()
            else:
                p = LocalPass("w", {}, {}, lambda t, g: None, roots=[y.sum()])
                p.start()
                p.run()
        return str(err.value)

    assert run(local=False) == run(local=True) == "hook 'grown' has changed the size of value"


def test_reading_a_nodes_hooks_leaves_them_as_they_were() -> None:
    """nbrpc reads a node's hook tables by registering a no-op and removing
    it: a later pass, local or distributed, runs exactly the user's hooks, and
    hooks registered after a pass are seen by the next one."""
    w = torch.ones(2, requires_grad=True)
    y = (w * 3).sum()
    calls = []
    for _ in range(2):
        p = LocalPass("w", {}, {}, lambda t, g: None, roots=[y], retain_graph=True)
        p.start()
        p.run()
        get_gradient_edge(w).node.register_hook(lambda gi, go: calls.append("late"))
    assert calls == ["late"]  # the second pass saw the hook added after the first
    y.backward()
    assert calls == ["late", "late", "late"] and torch.equal(w.grad, torch.full((2,), 3.0))


def test_a_gradient_is_used_on_the_device_of_the_tensor_it_belongs_to() -> None:
    """A gradient that came by another device (the stepper's by the CPU) is
    moved to its sent tensor's device before use. The meta device stands in
    for a GPU: autograd runs on it, with no data."""
    x = torch.empty(2, device="meta", requires_grad=True)
    h = x * 3
    got, acc = collector()
    a = LocalPass("A", {1: [h]}, {}, acc, norms=False)
    a.receive(1, [torch.ones(2)])  # arrives on the CPU
    a.run("send 1")
    assert got[x].device.type == "meta" and got[x].shape == (2,)


def test_gradients_go_back_to_the_devices_their_tensors_came_from(monkeypatch) -> None:
    """The forward's tensors came from cuda:1 and the CPU; their gradients are
    bound there (``Placed``), whatever map the backward's message follows, and
    land there (the copy stood in for: no GPU here)."""
    from nbrpc.autograd.backward import placed
    from nbrpc.autograd.context import AutogradContext, RecvFn
    from nbrpc.autograd.engine import Outgoing
    from nbrpc.serialize import Placed, dumps, loads, pickler

    ctx = AutogradContext(1)
    ctx.recvs[7] = RecvFn(0, [torch.ones(2), torch.ones(2)], ["cuda:1", "cpu"])
    out = placed(ctx, Outgoing(0, 7, [torch.full((2,), 2.0), None]))
    assert isinstance(out.grads[0], Placed) and out.grads[0].device == "cuda:1"
    assert out.grads[1] is None
    plain = Outgoing(0, 8, [torch.ones(2)])
    ctx.recvs[8] = RecvFn(0, [torch.ones(2)], ["cpu"])
    assert placed(ctx, plain) is plain  # CPU to CPU: as before, no wrapper
    moved: list[str] = []
    monkeypatch.setattr(pickler, "_onto", lambda t, d: moved.append(d) or t.clone())
    grads = loads(*dumps(out.grads))
    assert moved == ["cuda:1"] and torch.equal(grads[0], torch.full((2,), 2.0))


def test_the_graph_names_the_device_of_each_node_off_the_cpu() -> None:
    """The stepper's graph data marks each node's device where it is not the
    CPU (the meta device stands in for a GPU), and its lane's title lists them;
    a graph on the CPU is drawn as before."""
    from nbrpc.autograd.backward import graph_data
    from nbrpc.autograd.context import AutogradContext
    from nbrpc.jupyter.stepper_graph import lane_title

    class Agent:
        name, rank = "w0", 0

        def peer_name(self, rank: int) -> str:
            return f"w{rank}"

    x = torch.empty(2, device="meta", requires_grad=True)
    d = graph_data(Agent(), AutogradContext(1), roots=[(x * 2).sum()])
    assert [(n["name"], n.get("device")) for n in d["nodes"]] == [
        ("SumBackward0", "meta"), ("MulBackward0", "meta"), ("AccumulateGrad", "meta")]
    assert lane_title(d) == "w0 · meta"
    y = torch.ones(2, requires_grad=True)
    d = graph_data(Agent(), AutogradContext(2), roots=[(y * 2).sum()])
    assert all("device" not in n for n in d["nodes"]) and lane_title(d) == "w0"


@pytest.fixture
def engine_calls(monkeypatch) -> list[int]:
    """The test's calls of PyTorch's engine, each as its number of root edges."""
    from nbrpc.autograd import engine

    calls: list[int] = []
    real = engine._ENGINE

    class Spy:
        def run_backward(self, *args):
            calls.append(len(args[0]))
            return real.run_backward(*args)

    monkeypatch.setattr(engine, "_ENGINE", Spy())
    return calls


def test_a_stage_where_no_node_waits_is_one_call_of_pytorchs_engine(
        by_engine: bool, engine_calls: list[int]) -> None:
    """By the engine, a closed stage (a 30-node chain) is one engine call;
    one node at a time, each node's tensor hooks are one call."""
    w = torch.ones(3, requires_grad=True)
    y = w
    for _ in range(30):
        y = y * 1.5
    got, accumulate = collector()
    p = LocalPass("w", {}, {}, accumulate, roots=[y.sum()])
    p.start()
    record, _ = p.run()
    assert len(record.nodes) == 32  # sum, 30 muls, the leaf
    assert engine_calls == ([1] if by_engine else [1] * 31)
    torch.testing.assert_close(got[w], torch.full((3,), 1.5 ** 30))


def _micro_batches(hook: Callable | None = None) -> tuple[list, torch.nn.Linear, list]:
    """Two micro-batches through one ``Linear`` then ``tanh``, each sent back
    in its own message (as a pipeline stage's outputs): the two stages of the
    pass share the layer's weight and bias, which wait for both. Returns the
    outputs, the layer and the gradients that will arrive for them."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    if hook is not None:
        layer.weight.register_hook(hook)
    xs = torch.randn(6, 4).split(3)
    outs = [torch.tanh(layer(x)) for x in xs]
    return outs, layer, [torch.randn(3, 3), torch.randn(3, 3)]


def _micro_batches_by_local_autograd() -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's weight and bias gradients of :func:`_micro_batches`, by local
    autograd (a graph of its own)."""
    outs, layer, grads = _micro_batches()
    loss = sum((o * g).sum() for o, g in zip(outs, grads))
    return torch.autograd.grad(loss, [layer.weight, layer.bias])


def test_a_stage_that_leaves_only_leaves_waiting_is_one_call_of_pytorchs_engine(
        by_engine: bool, engine_calls: list[int]) -> None:
    """Micro-batches: the first one's stage feeds the shared weight and bias,
    which wait for the second's. By the engine both stages are one engine call
    each (it captures the first one's part of the leaves' gradients), and the
    leaves get the sum, as local autograd gives."""
    outs, layer, grads = _micro_batches()
    got, accumulate = collector()
    p = LocalPass("w", {1: [outs[0]], 2: [outs[1]]}, {}, accumulate)
    p.receive(1, [grads[0]])
    record, _ = p.run("send 1")
    assert record.nodes == ["TanhBackward0", "AddmmBackward0", "TBackward0"]
    assert record.blocked == 2 and not got  # weight and bias wait
    p.receive(2, [grads[1]])
    record, _ = p.run("send 2")
    assert record.blocked == 0 and sorted(record.nodes)[:2] == ["AccumulateGrad"] * 2
    # by the engine: stage 1 from its entry; stage 2 from its entry and what the
    # weight and bias held from stage 1 (one node at a time: a call per node)
    assert engine_calls == [1, 3] if by_engine else len(engine_calls) == 6
    want = _micro_batches_by_local_autograd()
    torch.testing.assert_close(got[layer.weight], want[0])
    torch.testing.assert_close(got[layer.bias], want[1])


def test_a_waiting_leaf_with_a_tensor_hook_gets_its_hook_once_on_the_sum() -> None:
    """A leaf's tensor hook runs once, on the leaf's whole gradient, as in
    local autograd: a stage that would leave such a leaf waiting runs its
    nodes one at a time (the engine would run the hook on a part)."""
    seen = []
    outs, layer, grads = _micro_batches(hook=lambda g: seen.append(g.clone()))
    got, accumulate = collector()
    p = LocalPass("w", {1: [outs[0]], 2: [outs[1]]}, {}, accumulate)
    for msg in (1, 2):
        p.receive(msg, [grads[msg - 1]])
        p.run(f"send {msg}")
    want = _micro_batches_by_local_autograd()[0]
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], want)
    torch.testing.assert_close(got[layer.weight], want)


def test_stages_begun_together_end_in_any_order_and_the_last_finishes_the_weight() -> None:
    """Two micro-batches' stages begun before either's engine call ran (as two
    threads run them): the second reaches the weight and bias with every edge
    given, but the first's part is still on its way, so the weight is finished
    by whichever stage ends last, with the sum. (By the engine: one node at a
    time, a stage runs whole in begin().)"""
    outs, layer, grads = _micro_batches()
    got, accumulate = collector()
    p = _LocalPass("w", {1: [outs[0]], 2: [outs[1]]}, {}, accumulate, by_engine=True)
    p.receive(1, [grads[0]])
    first = p.begin("send 1")
    p.receive(2, [grads[1]])
    second = p.begin("send 2")
    assert first.pending and second.pending and p.running == 2
    assert second.ends == [] and len(second.held) == 2  # the first's parts are out
    p.execute(second)
    p.end(second)
    assert not got  # not before the first's part is in
    p.execute(first)
    record, _ = p.end(first)
    assert p.running == 0 and record.blocked == 0 and not p._inflight
    want = _micro_batches_by_local_autograd()
    torch.testing.assert_close(got[layer.weight], want[0])
    torch.testing.assert_close(got[layer.bias], want[1])


def test_a_stage_run_one_node_at_a_time_waits_for_the_pending_ones() -> None:
    """A stage that leaves a non-leaf waiting runs its nodes one at a time, so
    it begins only once no engine call is pending (begin() says None and
    changes nothing meanwhile); the gradients are local autograd's."""
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    y = torch.tensor([3.0, 4.0], requires_grad=True)
    h = x * 3  # waits for both sends below
    a, b, c = h + 1, h * 2, y * 5
    got, acc = collector()
    p = _LocalPass("A", {1: [a], 2: [b], 3: [c]}, {}, acc, by_engine=True)
    p.receive(3, [torch.ones(2)])
    pending = p.begin("send 3")
    assert pending.pending
    p.receive(1, [torch.ones(2)])
    assert p.begin("send 1") is None and p.running == 1
    p.execute(pending)
    p.end(pending)
    record, _ = p.end(p.begin("send 1"))
    assert record.nodes == ["AddBackward0"] and record.blocked == 1
    p.receive(2, [torch.ones(2)])
    p.run("send 2")
    assert torch.equal(got[x], torch.full((2,), 9.0)) and torch.equal(got[y], torch.full((2,), 5.0))


def test_gradients_held_for_a_node_are_summed_into_a_tensor_of_the_pass_own() -> None:
    """A node fed by three messages holds their sum: the first two make a new
    tensor, the third is added into it in place; no given gradient changes."""
    x = torch.ones(2, requires_grad=True)
    h = x * 1
    got, acc = collector()
    a = LocalPass("A", {1: [h], 2: [h], 3: [h]}, {}, acc)
    given = [torch.full((2,), float(k)) for k in (1, 2, 3)]
    a.receive(1, [given[0]])
    a.run("send 1")
    a.receive(2, [given[1]])
    a.run("send 2")
    node = h.grad_fn
    total = a._buffers[node][0]
    assert total is not given[0] and total is not given[1]
    a.receive(3, [given[2]])
    assert a._buffers[node][0] is total  # in place
    a.run("send 3")
    assert torch.equal(got[x], torch.full((2,), 6.0))
    assert [g.tolist() for g in given] == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]


# -- received tensors: the output of a recv node, as PyTorch's RecvRpcBackward -----------
class _LocalRecv(torch.autograd.Function):
    """A stand-in for the recv node that local autograd can run: the same
    inputs, made at the same point; its backward logs what it got."""

    got: list[torch.Tensor] = []

    @staticmethod
    def forward(ctx, anchor, box):
        return box[0]

    @staticmethod
    def backward(ctx, g):
        _LocalRecv.got.append(g.clone())
        return None, None


def _received(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a tensor received in a context: the output of a recv node."""
    from nbrpc.autograd.engine import recv_tensors

    t = t.detach()
    recv_tensors([t])
    return t


def _received_model(log: list, recv: Callable) -> tuple[torch.Tensor, torch.Tensor, list]:
    """y arrives (``recv``), is changed in place, and feeds a loss with a branch
    made after it (whose nodes run before y's recv node, as in PyTorch); hooks
    on y and on its recv node log what they saw."""
    torch.manual_seed(0)
    w, w2 = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    y = recv(torch.randn(3, requires_grad=True))
    node = y.grad_fn
    y.register_hook(lambda g: log.append(("tensor y", g.sum().item())) or g * 3)
    node.register_prehook(lambda go: log.append(("pre recv", go[0].sum().item()))
                          or (go[0] + 1,))
    node.register_hook(lambda gi, go: log.append(("post recv", len(gi), len(go))))
    u = w2 * 5
    u.register_hook(lambda g: log.append(("tensor u", g.sum().item())))
    y.mul_(2)  # recorded: y is no leaf
    return node, u.sum() + (y * w).sum(), [w, w2]


def test_a_received_tensor_is_a_recv_nodes_output_and_its_hooks_run_as_pytorch_runs_them(
        by_engine: bool) -> None:
    """The recv node's tensor hooks, pre-hooks and post hooks run in PyTorch's
    order (last: the node was made before every node that used the tensor),
    and the gradient they leave goes back to the sender, as local autograd
    gives the same node's backward."""
    from nbrpc.autograd.engine import _ANCHOR, RecvRpcBackward

    local: list = []
    _LocalRecv.got = []
    _, loss, (w, w2) = _received_model(
        local, lambda t: _LocalRecv.apply(_ANCHOR, (t.detach(),)))
    loss.backward()
    mine: list = []
    node, loss, (w, w2) = _received_model(mine, _received)
    assert type(node) is RecvRpcBackward
    assert node.name() == "torch::distributed::autograd::RecvRpcBackward"
    got, accumulate = collector()
    p = LocalPass("w", {}, {7: (1, [GradientEdge(node, 0)])}, accumulate, roots=[loss])
    p.start()
    record, out = p.run()
    assert mine[:3] == local[:3] and [e[0] for e in mine] == [
        "tensor u", "tensor y", "pre recv", "post recv"]
    # post hooks get the node's outputs: RecvRpcBackward has none (the stand-in: one)
    assert mine[3] == ("post recv", 0, 1) and local[3] == ("post recv", 1, 1)
    assert record.nodes[-1] == "RecvRpcBackward"
    assert [(o.peer, o.msg_id) for o in out] == [(1, 7)]
    torch.testing.assert_close(out[0].grads[0], _LocalRecv.got[0])
    torch.testing.assert_close(got[w2], torch.full((3,), 5.0))


def test_a_received_tensor_refuses_a_local_backward_and_a_parameter_stays_a_leaf() -> None:
    from nbrpc.autograd.engine import gets_recv_node

    y = _received(torch.ones(2))
    assert not y.is_leaf and y.requires_grad
    with pytest.raises(RuntimeError, match=r"received over RPC .* nbrpc\.autograd\.backward"):
        (y * 2).sum().backward()
    with torch.no_grad():  # recorded whatever the receiving thread's grad mode
        assert _received(torch.ones(2)).grad_fn is not None
    assert gets_recv_node(torch.ones(2, requires_grad=True))
    # a Parameter stays a leaf (an optimizer on the receiver may own it)
    assert not gets_recv_node(torch.nn.Parameter(torch.ones(2)))
    assert not gets_recv_node(torch.ones(2))
    with torch.inference_mode():
        assert not gets_recv_node(torch.ones(2, requires_grad=True))


class _LocalRecv2(torch.autograd.Function):
    """The stand-in for a recv node with two outputs."""

    got: list = []

    @staticmethod
    def forward(ctx, anchor, box):
        return box

    @staticmethod
    def backward(ctx, *grads):
        _LocalRecv2.got.append(grads)
        return None, None


def test_the_tensors_of_one_message_share_one_recv_node(by_engine: bool) -> None:
    """As PyTorch's RecvRpcBackward: one node for a message's tensors; it runs
    once, its hooks see every gradient of the message (zeros where PyTorch's
    engine fills in an unused output: None here, and no gradient goes back
    for it), and the gradients go back together."""
    from nbrpc.autograd.engine import _ANCHOR, recv_tensors

    def model(log, recv):
        torch.manual_seed(1)
        w = torch.randn(3, requires_grad=True)
        a, b, unused = recv([torch.randn(3), torch.randn(3), torch.randn(2)])
        node = a.grad_fn
        node.register_prehook(lambda go: log.append(("pre", [g is not None for g in go])))
        return node, (a * w).sum() + (b * b).sum() + (a * b).sum()

    local: list = []
    _, loss = model(local, lambda ts: _LocalRecv2.apply(_ANCHOR, tuple(ts)))
    _LocalRecv2.got = []
    loss.backward()
    mine: list = []

    def recv(ts):
        recv_tensors(ts)
        return ts
    node, loss = model(mine, recv)
    assert len(node._input_metadata) == 3
    got, accumulate = collector()
    ends = [GradientEdge(node, i) for i in range(3)]
    p = LocalPass("w", {}, {7: (1, ends)}, accumulate, roots=[loss])
    p.start()
    record, out = p.run()
    assert record.nodes.count("RecvRpcBackward") == 1
    assert mine == [("pre", [True, True, False])] and local[0][1][:2] == [True, True]
    assert [(o.peer, o.msg_id) for o in out] == [(1, 7)]
    ga, gb, gu = out[0].grads
    want = _LocalRecv2.got[0]
    torch.testing.assert_close(ga, want[0])
    torch.testing.assert_close(gb, want[1])
    assert gu is None


def test_a_sent_tensors_gradient_enters_where_the_tensor_was_when_sent() -> None:
    """h is sent (msg 1), then changed in place: the gradient for what was sent
    enters h's graph as it was (PyTorch's send function is made at sending)."""
    x = torch.tensor([1.0, 2.0], requires_grad=True)
    h = x * 2
    sent = get_gradient_edge(h)
    h.mul_(3)
    got, accumulate = collector()
    p = LocalPass("A", {1: [sent]}, {}, accumulate, roots=[h.sum()])
    p.start()
    p.run()
    p.receive(1, [torch.ones(2)])
    p.run("send 1")
    torch.testing.assert_close(got[x], torch.full((2,), 2.0 + 6.0))


def test_the_graph_shows_a_messages_recv_node_once() -> None:
    """The stepper's graph data: a message's received tensors are one node,
    marked with the message and how many tensors it brought (drawn
    "recv m1 2 tensors"); a received tensor alone shows its shape."""
    from nbrpc.autograd.backward import graph_data
    from nbrpc.autograd.context import AutogradContext, RecvFn
    from nbrpc.autograd.engine import recv_tensors
    from nbrpc.jupyter.stepper_graph import _node_label, _Replay

    class Agent:
        name, rank = "w0", 0

        def peer_name(self, rank: int) -> str:
            return f"w{rank}"

    ctx = AutogradContext(1)
    a, b, c = torch.ones(2), torch.ones(3), torch.ones(4)
    node = recv_tensors([a, b])
    ctx.recvs[5] = RecvFn(1, [a, b], ["cpu", "cpu"], [GradientEdge(node, 0), GradientEdge(node, 1)])
    alone = recv_tensors([c])
    ctx.recvs[6] = RecvFn(1, [c], ["cpu"], [GradientEdge(alone, 0)])
    d = graph_data(Agent(), ctx, roots=[(a * b.sum() + c[:2]).sum()])
    recvs = sorted((n for n in d["nodes"] if n.get("recv") is not None), key=lambda n: n["recv"])
    assert [(n["name"], n["recv"], n.get("tensors"), n["next"]) for n in recvs] == [
        ("RecvRpcBackward", 5, 2, []), ("RecvRpcBackward", 6, None, [])]
    assert [r["leaves"] for r in d["recvs"]] == [[recvs[0]["id"]] * 2, [recvs[1]["id"]]]
    replay = _Replay({"workers": {"w0": d}}, [])
    assert [_node_label(n, replay).split(" ", 2)[2] for n in recvs] == ["2 tensors", "[4]"]


def test_a_tensor_received_in_another_context_is_refused_with_the_reason() -> None:
    """Its recv node belongs to no recv function of this pass: the gradient
    has nowhere to go (it was a plain leaf before received tensors had
    nodes, and took the gradient silently)."""
    y = _received(torch.ones(2))
    p = LocalPass("w", {}, {}, lambda t, g: None, roots=[(y * 2).sum()])
    p.start()
    with pytest.raises(BackwardError, match="received over RPC in another distributed"):
        p.run()


def test_a_recv_node_shows_itself_to_python_as_pytorchs_does() -> None:
    """PyTorch's ``name()``, no ``next_functions`` (graph walkers never see
    the anchor that makes the node record), the short name in a tensor's repr;
    torch's engine still reaches the node (a local backward is refused)."""
    from nbrpc.autograd.engine import recv_tensors

    a = torch.ones(2)
    node = recv_tensors([a])
    assert node.name() == "torch::distributed::autograd::RecvRpcBackward"
    assert node.next_functions == () and "grad_fn=<RecvRpcBackward>" in repr(a)
    with pytest.raises(RuntimeError, match=r"nbrpc\.autograd\.backward\(context_id"):
        (a * 2).sum().backward()


def _coo(requires_grad: bool = False) -> torch.Tensor:
    return torch.sparse_coo_tensor([[0, 1, 1], [2, 0, 1]], [0.5, -1.0, 2.0], (2, 3),
                                   requires_grad=requires_grad, check_invariants=True)


def test_where_a_sparse_tensors_gradient_enters() -> None:
    """Sparse tensors have no views (get_gradient_edge's way in): a leaf's
    edge is its accumulator, a result's its grad_fn, a received one's its recv
    node; the edge keeps the graph behind it alive, as get_gradient_edge's."""
    from nbrpc.autograd.engine import gradient_edge, recv_tensors

    s = _coo(requires_grad=True)
    e = gradient_edge(s)
    assert e.node.name() == "torch::autograd::AccumulateGrad" and e.node.variable is s
    assert e.output_nr == 0 and e.ownership_token is not None
    t = s * 2.0
    assert gradient_edge(t).node is t.grad_fn
    r = _coo()
    node = recv_tensors([torch.ones(1), r])
    e = gradient_edge(r)
    assert (e.node, e.output_nr) == (node, 1)
    with torch.inference_mode():
        assert gradient_edge(s).node.variable is s


def test_sparse_gradients_through_a_recv_node_and_a_send(by_engine: bool) -> None:
    """B receives a sparse tensor (its recv node's output) and uses it: the
    sparse gradient goes back; A feeds it to the send's edge and the sparse
    leaf gets what local autograd gives it."""
    from nbrpc.autograd.engine import gradient_edge, recv_tensors

    w = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], requires_grad=True)
    s = _coo(requires_grad=True)
    torch.sparse.mm(s, w).sum().backward()  # the same, locally
    want_s, want_w = s.grad, w.grad
    w.grad = None

    got_a, acc_a = collector()
    a = LocalPass("A", {1: [gradient_edge(s)]}, {}, acc_a)
    got_b, acc_b = collector()
    r = s.detach().clone()  # what B receives
    node = recv_tensors([r])
    b = LocalPass("B", {}, {1: (0, [GradientEdge(node, 0)])}, acc_b,
                  roots=[torch.sparse.mm(r, w).sum()])
    b.start()
    _, out = b.run()
    (g,) = out[0].grads
    assert g.layout is torch.sparse_coo
    a.receive(1, [g])
    a.run("send 1")
    assert got_a[s].layout is torch.sparse_coo
    torch.testing.assert_close(got_a[s].to_dense(), want_s.to_dense())
    torch.testing.assert_close(got_b[w], want_w)
