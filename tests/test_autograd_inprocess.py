"""Distributed autograd, DistributedOptimizer and RemoteModule with four agents
in this process; every gradient and step is compared with the same
computation done locally in PyTorch, in normal mode and in step mode."""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from conftest import local_group, poll_for
from torch import nn

from nbrpc import autograd as dist_autograd
from nbrpc.agent import current_agent
from nbrpc.agent.agent import _local
from nbrpc.autograd import engine
from nbrpc.errors import BackwardStageError, RpcTimeoutError
from nbrpc.nn import RemoteModule
from nbrpc.optim import DistributedOptimizer
from nbrpc.rpc import RRef, remote, rpc_async, rpc_sync

# normal and step mode; and each again in native mode (where a process has a
# torch.distributed group: leaves' AccumulateGrad and recv nodes run in
# PyTorch's engine on staged .grad), forced here without a process group
MODES = ["normal", "step", "native", "native-step"]


@pytest.fixture(autouse=True)
def _native_mode(request, monkeypatch) -> Iterator[None]:
    callspec = getattr(request.node, "callspec", None)
    if callspec is None or not str(callspec.params.get("mode", "")).startswith("native"):
        yield
        return
    monkeypatch.setattr(engine, "c10d_active", lambda: True)
    ran, run = [], engine.LocalPass._run_native
    monkeypatch.setattr(engine.LocalPass, "_run_native",
                        lambda self, *a: ran.append(1) or run(self, *a))
    yield
    assert ran, "the pass did not run in native mode"


@contextlib.contextmanager
def acting_as(agent) -> Iterator[None]:
    """This (test) thread calls through ``agent``, as a driver would."""
    _local.agent = agent
    try:
        yield
    finally:
        _local.agent = None


@pytest.fixture
def group():
    with local_group(["a", "b", "c", "d"], heartbeat_interval=0.1,
                     failure_timeout=1.0) as agents, acting_as(agents[0]):
        yield agents
        alive = [ag for ag in agents if ag.state == "ready"]  # (one test stops a worker)
        assert poll_for(lambda: not any(ag.ext["autograd"].contexts for ag in alive),
                        timeout=5), [ag.ext["autograd"].snapshot() for ag in alive]


# -- functions that run on the workers --------------------------------------------------
def make_param(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).requires_grad_()


def tanh_mm(x: torch.Tensor, w: RRef, then: str | None = None, w2: RRef | None = None):
    y = torch.tanh(x @ w.local_value())
    return y if then is None else rpc_sync(then, tanh_mm, (y, w2))


def grad_here(ctx: int, w: RRef) -> torch.Tensor | None:
    return dist_autograd.get_gradients(ctx).get(w.local_value())


def contexts_here() -> int:
    return len(current_agent().ext["autograd"].contexts)


def context_ids_here() -> set[int]:
    return set(current_agent().ext["autograd"].contexts)


def backward(mode: str, ctx: int, roots: list, retain_graph: bool = False) -> list:
    if mode in ("normal", "native"):
        dist_autograd.backward(ctx, roots, retain_graph=retain_graph)
        return []
    stepper = dist_autograd.backward_stepper(ctx, roots, retain_graph=retain_graph)
    records = []
    for _ in range(100):
        if stepper.done:
            break
        assert stepper.pending  # a stage is ready whenever the pass is not done
        records.append(stepper.step())
    assert stepper.done
    return records


def local(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_()


# -- correctness against local PyTorch ----------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_three_hop_chain(group, mode: str) -> None:
    wb, wc = remote("b", make_param, (1, 4, 3)), remote("c", make_param, (2, 3, 2))
    x = make_param(0, 5, 4)
    with dist_autograd.context() as ctx:
        out = rpc_sync("b", tanh_mm, (x, wb, "c", wc))  # a -> b -> c -> b -> a
        records = backward(mode, ctx, [(out * out).sum()])
        gx = dist_autograd.get_gradients(ctx)[x]
        gb, gc = rpc_sync("b", grad_here, (ctx, wb)), rpc_sync("c", grad_here, (ctx, wc))
    xl, bl, cl = local(x), local(wb.to_here()), local(wc.to_here())
    (torch.tanh(torch.tanh(xl @ bl) @ cl) ** 2).sum().backward()
    assert torch.allclose(gx, xl.grad) and torch.allclose(gb, bl.grad)
    assert torch.allclose(gc, cl.grad)
    assert x.grad is None
    if mode.endswith("step"):  # a, b, c, b, a: each stage one worker's local run
        assert [r["worker"] for r in records] == ["a", "b", "c", "b", "a"]
        assert records[2]["nodes"][:2] == ["TanhBackward0", "MmBackward0"]
        assert records[2]["trigger"].endswith("from b")


@pytest.mark.parametrize("mode", MODES)
def test_fan_out_to_three_workers(group, mode: str) -> None:
    ws = {w: remote(w, make_param, (i, 4, 4)) for i, w in enumerate("bcd")}
    x = make_param(9, 2, 4)
    with dist_autograd.context() as ctx:
        futs = [rpc_async(w, tanh_mm, (x, r)) for w, r in ws.items()]
        loss = sum((f.wait() * (k + 1)).sum() for k, f in enumerate(futs))
        records = backward(mode, ctx, [loss])
        gx = dist_autograd.get_gradients(ctx)[x]
        grads = {w: rpc_sync(w, grad_here, (ctx, r)) for w, r in ws.items()}
    xl = local(x)
    wl = {w: local(r.to_here()) for w, r in ws.items()}
    sum((torch.tanh(xl @ wl[w]) * (k + 1)).sum() for k, w in enumerate("bcd")).backward()
    assert torch.allclose(gx, xl.grad)
    for w in "bcd":
        assert torch.allclose(grads[w], wl[w].grad)
    if mode.endswith("step"):  # x's accumulator on a ran once, after all three answered
        final = [r for r in records if r["worker"] == "a" and r["gradients"]]
        assert len(final) == 1 and sum(r["worker"] == "a" for r in records) == 4


@pytest.mark.parametrize("mode", MODES)
def test_the_same_tensor_sent_twice(group, mode: str) -> None:
    wb = remote("b", make_param, (3, 3, 3))
    x = make_param(4, 2, 3)
    h = x * 2  # a non-leaf sent in two messages, and twice in one message
    with dist_autograd.context() as ctx:
        y1 = rpc_sync("b", tanh_mm, (h, wb))
        y2 = rpc_sync("b", torch.mul, (h, h))
        backward(mode, ctx, [y1.sum() + y2.sum()])
        gx = dist_autograd.get_gradients(ctx)[x]
        gb = rpc_sync("b", grad_here, (ctx, wb))
    xl, bl = local(x), local(wb.to_here())
    hl = xl * 2
    (torch.tanh(hl @ bl).sum() + (hl * hl).sum()).backward()
    assert torch.allclose(gx, xl.grad) and torch.allclose(gb, bl.grad)


def scale_in_place_mm(x: torch.Tensor, w: RRef) -> tuple[str, torch.Tensor]:
    """Changes its argument in place (allowed: a received tensor is no leaf)."""
    kind = type(x.grad_fn).__name__
    x.mul_(3.0)
    return kind, torch.tanh(x @ w.local_value())


@pytest.mark.parametrize("mode", MODES)
def test_received_tensors_are_recv_node_outputs_and_may_change_in_place(
        group, mode: str) -> None:
    """As in PyTorch: a tensor received in a context (an argument, a result)
    has a RecvRpcBackward grad_fn, in-place operations on it are recorded, and
    a tensor changed in place after it was sent gets the gradient of what was
    sent."""
    wb = remote("b", make_param, (7, 4, 3))
    x = make_param(8, 2, 4)
    with dist_autograd.context() as ctx:
        h = x * 2
        kind, y = rpc_sync("b", scale_in_place_mm, (h, wb))
        h.mul_(5.0)  # after it was sent
        assert (kind, type(y.grad_fn).__name__, y.is_leaf) == (
            "RecvRpcBackward", "RecvRpcBackward", False)
        y.add_(1.0)
        backward(mode, ctx, [(y * y).sum() + h.sum()])
        gx = dist_autograd.get_gradients(ctx)[x]
        gb = rpc_sync("b", grad_here, (ctx, wb))
    xl, bl = local(x), local(wb.to_here())
    hl = xl * 2
    yl = torch.tanh((hl * 3.0) @ bl) + 1.0
    ((yl * yl).sum() + (hl * 5.0).sum()).backward()
    assert torch.allclose(gx, xl.grad) and torch.allclose(gb, bl.grad)


def test_a_call_in_inference_mode_inside_a_context_sends_its_tensors(group) -> None:
    """Recording a sent leaf's gradient edge needs autograd: it works from a
    thread in inference mode (it failed while the message was pickled)."""
    x = make_param(10, 2, 2)
    with dist_autograd.context(), torch.inference_mode():
        y = rpc_sync("b", torch.mul, (x, 2.0))
    assert torch.equal(y, x.detach() * 2)


def test_a_tensor_received_in_another_context_fails_backward_with_the_reason(group) -> None:
    x = make_param(11, 2, 2)
    with dist_autograd.context():
        y = rpc_sync("b", torch.mul, (x, 2.0))
    with dist_autograd.context() as ctx:
        with pytest.raises(BackwardStageError, match="in another distributed autograd"):
            dist_autograd.backward(ctx, [(y * 3).sum()])
        z = rpc_sync("b", torch.mul, (x, 2.0))  # the same agents, a new pass: fine
        dist_autograd.backward(ctx, [z.sum()])
        assert torch.equal(dist_autograd.get_gradients(ctx)[x], torch.full((2, 2), 2.0))


def sparse_step(idx: torch.Tensor, psw: torch.Tensor, s: torch.Tensor, emb: RRef,
                w: RRef) -> tuple[torch.Tensor, torch.Tensor]:
    bags = emb.local_value()(idx, torch.tensor([0, 2]), per_sample_weights=psw)
    return bags, torch.sparse.mm(s, w.local_value())


def make_embedding(seed: int) -> nn.EmbeddingBag:
    torch.manual_seed(seed)
    return nn.EmbeddingBag(6, 3, mode="sum", sparse=True)


def sparse_grad_here(ctx: int, emb: RRef) -> torch.Tensor:
    return dist_autograd.get_gradients(ctx)[emb.local_value().weight]


def weight_of(emb: RRef) -> RRef:
    return RRef(emb.local_value().weight)


@pytest.mark.parametrize("mode", MODES)
def test_sparse_tensors_and_sparse_gradients_cross_workers(group, mode: str) -> None:
    """A sparse tensor that requires grad is recorded as it travels (it used
    to arrive without requires_grad), and sparse gradients (an EmbeddingBag's,
    a sparse input's) go back: each equal to local autograd's."""
    emb, wb = remote("b", make_embedding, (3,)), remote("b", make_param, (4, 3, 2))
    s = torch.sparse_coo_tensor([[0, 1, 1], [2, 0, 1]], [0.5, -1.0, 2.0], (2, 3),
                                requires_grad=True, check_invariants=True)
    psw, idx = make_param(5, 4), torch.tensor([0, 2, 2, 5])
    el, wl, sl, pl = emb.to_here(), local(wb.to_here()), s.detach().requires_grad_(), local(psw)
    opt = DistributedOptimizer(torch.optim.SGD, [rpc_sync("b", weight_of, (emb,))], lr=0.5)
    with dist_autograd.context() as ctx:
        bags, mm = rpc_sync("b", sparse_step, (idx, psw, s, emb, wb))
        backward(mode, ctx, [(bags * bags).sum() + (mm * mm).sum()])
        mine = dist_autograd.get_gradients(ctx)
        g_emb = rpc_sync("b", sparse_grad_here, (ctx, emb))
        g_w = rpc_sync("b", grad_here, (ctx, wb))
        opt.step(ctx)  # SGD with a sparse gradient, on b
    bl = el(idx, torch.tensor([0, 2]), per_sample_weights=pl)
    ((bl * bl).sum() + (torch.sparse.mm(sl, wl) ** 2).sum()).backward()
    assert mine[s].layout is torch.sparse_coo and g_emb.layout is torch.sparse_coo
    assert torch.allclose(mine[s].to_dense(), sl.grad.to_dense())
    assert torch.allclose(g_emb.to_dense(), el.weight.grad.to_dense())
    assert torch.allclose(mine[psw], pl.grad) and torch.allclose(g_w, wl.grad)
    torch.optim.SGD(el.parameters(), lr=0.5).step()
    assert torch.allclose(emb.to_here().weight, el.weight)


def graph_here(ctx_id: int) -> dict:
    """This worker's records of ``ctx_id``, through PyTorch's private API."""
    ctx = dist_autograd._retrieve_context(ctx_id)
    return {"current": dist_autograd._current_context()._context_id(),
            "sends": [[n.name() for n, _ in f.next_functions]
                      for f in ctx._send_functions().values()],
            "recvs": len(ctx._recv_functions()), "known": ctx._known_worker_ids()}


def relay_graph(x: torch.Tensor, ctx_id: int) -> tuple[torch.Tensor, dict]:
    y = rpc_sync("c", torch.mul, (x, 2.0))
    return y, graph_here(ctx_id)


class _DebugInfoAt(torch.autograd.Function):
    """Identity; its backward reads the debug counters where it runs."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _DebugInfoAt.seen.append(dist_autograd._get_debug_info())
        return g


def through_debug_info(x: torch.Tensor) -> torch.Tensor:
    return _DebugInfoAt.apply(x) * 3.0


def debug_info_seen() -> list:
    return _DebugInfoAt.seen


def test_pytorchs_private_context_api_shows_the_graph(group) -> None:
    """``_current_context()`` (also in a handler: the request's context),
    ``_retrieve_context``, the send and recv functions with PyTorch's node
    names, known workers, ``_new_context``/``_release_context`` and the debug
    counters, on a chain a -> b -> c."""
    x = make_param(12, 2, 2)
    with pytest.raises(RuntimeError, match="Current thread doesn't have a valid autograd"):
        dist_autograd._current_context()
    with dist_autograd.context() as ctx_id:
        y, on_b = rpc_sync("b", relay_graph, (x, ctx_id))
        ctx = dist_autograd._current_context()
        assert ctx is dist_autograd._retrieve_context(ctx_id) and ctx._context_id() == ctx_id
        assert [[n.name() for n, _ in f.next_functions] for f in
                ctx._send_functions().values()] == [["torch::autograd::AccumulateGrad"]]
        (recv,) = ctx._recv_functions().values()
        assert recv is y.grad_fn and ctx._known_worker_ids() == {1}
        recv_name = "torch::distributed::autograd::RecvRpcBackward"
        assert on_b == {"current": ctx_id, "sends": [[recv_name]], "recvs": 2,
                        "known": {0, 2}}  # (the reply is sent after the handler returns)
        assert dist_autograd._get_max_id() == (1 << 48) - 1
        assert dist_autograd._get_debug_info() == {"num_current_backward_passes": 0,
                                                   "num_autograd_contexts": 1}
        z = rpc_sync("b", through_debug_info, (x,))
        dist_autograd.backward(ctx_id, [z.sum()])
        assert rpc_sync("b", debug_info_seen)[-1]["num_current_backward_passes"] == 1
    with pytest.raises(RuntimeError, match=f"Could not find autograd context with id: {ctx_id}"):
        dist_autograd._retrieve_context(ctx_id)
    new = dist_autograd._new_context()  # by hand, as context() does
    try:
        with pytest.raises(RuntimeError, match="Already have an autograd context id"):
            dist_autograd._new_context()
        rpc_sync("b", torch.mul, (x, 2.0))
        assert new._context_id() in rpc_sync("b", context_ids_here)
    finally:
        dist_autograd._release_context(new._context_id())
    assert poll_for(lambda: new._context_id() not in rpc_sync("b", context_ids_here))
    with pytest.raises(RuntimeError, match="Current thread doesn't have"):
        dist_autograd._current_context()
    with pytest.raises(RuntimeError, match="Could not find autograd context"):
        dist_autograd._release_context(new._context_id())


def tripled_sum(p: torch.Tensor) -> torch.Tensor:
    assert isinstance(p, nn.Parameter) and p.is_leaf  # a leaf on the receiver too
    return (p * 3).sum()


@pytest.mark.parametrize("mode", MODES)
def test_a_sent_parameter_gets_its_gradient_back(group, mode: str) -> None:
    p = nn.Parameter(torch.tensor([1.0, 2.0]))
    p.grad = mine = torch.ones(2)
    with dist_autograd.context() as ctx:
        backward(mode, ctx, [rpc_sync("b", tripled_sum, (p,)) * 2])
        assert torch.equal(dist_autograd.get_gradients(ctx)[p], torch.full((2,), 6.0))
    assert p.grad is mine and torch.equal(mine, torch.ones(2))


@pytest.mark.parametrize("mode", MODES)
def test_values_fetched_with_to_here_and_rref_proxies(group, mode: str) -> None:
    wb = remote("b", make_param, (5, 3))
    wc = remote("c", make_param, (6, 3))
    with dist_autograd.context() as ctx:
        y = wb.to_here() * 2  # the owner's reply is recorded
        z = wc.rpc_sync().mul(3.0)  # so is a proxy call's
        backward(mode, ctx, [(y * z).sum()])
        gb, gc = rpc_sync("b", grad_here, (ctx, wb)), rpc_sync("c", grad_here, (ctx, wc))
    bl, cl = local(wb.to_here()), local(wc.to_here())
    ((bl * 2) * (cl * 3)).sum().backward()
    assert torch.allclose(gb, bl.grad) and torch.allclose(gc, cl.grad)


@pytest.mark.parametrize("mode", MODES)
def test_retain_graph_twice_accumulates_in_the_context(group, mode: str) -> None:
    wb = remote("b", make_param, (7, 3, 3))
    x = make_param(8, 1, 3)
    with dist_autograd.context() as ctx:
        loss = rpc_sync("b", tanh_mm, (x, wb)).sum()
        backward(mode, ctx, [loss], retain_graph=True)
        backward(mode, ctx, [loss], retain_graph=True)
        gx = dist_autograd.get_gradients(ctx)[x]
        gb = rpc_sync("b", grad_here, (ctx, wb))
    xl, bl = local(x), local(wb.to_here())
    torch.tanh(xl @ bl).sum().backward()
    assert torch.allclose(gx, 2 * xl.grad) and torch.allclose(gb, 2 * bl.grad)


def test_a_second_backward_without_retain_graph_fails(group) -> None:
    wb = remote("b", make_param, (7, 3, 3))
    x = make_param(8, 1, 3)
    with dist_autograd.context() as ctx:
        loss = rpc_sync("b", tanh_mm, (x, wb)).sum()
        dist_autograd.backward(ctx, [loss])
        with pytest.raises(RuntimeError, match="a second time"):
            dist_autograd.backward(ctx, [loss])


def test_step_mode_reports_the_distributed_graph(group) -> None:
    wb = remote("b", make_param, (1, 4, 3))
    x = make_param(0, 5, 4)
    with dist_autograd.context() as ctx:
        loss = rpc_sync("b", tanh_mm, (x, wb)).sum()
        stepper = dist_autograd.backward_stepper(ctx, [loss])
        graph = stepper.graph()
        assert stepper.pending == [{"worker": "a", "trigger": "roots"}]
        first = stepper.step()
        assert first["sent"] and first["sent"][0]["to"] == 1 and stepper.pending[0]["worker"] == "b"
        stepper.run()
        assert stepper.done and repr(stepper).endswith(f"{len(stepper.records)} stage(s) run, done>")
        with pytest.raises(RuntimeError, match="done"):
            stepper.step()
    names = {w: [n["name"] for n in d["nodes"]] for w, d in graph["workers"].items()}
    assert "MmBackward0" in names["b"] and "SumBackward0" in names["a"]
    assert {(link["from"], link["to"]) for link in graph["links"]} == {("a", "b"), ("b", "a")}
    recv_leaf = [n for n in graph["workers"]["b"]["nodes"] if n.get("recv") is not None]
    assert recv_leaf and recv_leaf[0]["shape"] == [5, 4]


def test_agents_report_their_contexts_as_plain_data(group) -> None:
    a, b = group[:2]
    wb = remote("b", make_param, (1, 4, 3))
    x = make_param(0, 5, 4)
    with dist_autograd.context() as ctx:
        loss = rpc_sync("b", tanh_mm, (x, wb)).sum()
        dist_autograd.backward(ctx, [loss])
        assert poll_for(lambda: any(c["id"] == ctx for c in b.snapshot()["autograd"]))
        (mine,) = a.snapshot()["autograd"]
        (theirs,) = b.snapshot()["autograd"]
    assert mine["id"] == ctx and mine["creator"] == "a" and mine["known_workers"] == ["b"]
    assert [s["to"] for s in mine["sends"]] == ["b"] and [r["from"] for r in mine["recvs"]] == ["b"]
    assert theirs["gradients"][0]["shape"] == [4, 3] and theirs["stages"]
    assert mine["stages"][0]["trigger"] == "roots"


def test_unused_sent_tensor_does_not_block_gradients(group) -> None:
    x = make_param(2, 3)
    with dist_autograd.context() as ctx:
        rpc_sync("b", torch.mul, (x, 5.0))  # sent, answer never used in the loss
        dist_autograd.backward(ctx, [(x * 2).sum()])
        assert torch.equal(dist_autograd.get_gradients(ctx)[x], torch.full((3,), 2.0))


class Explode(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        raise ValueError("boom in backward")


def explode(x: torch.Tensor) -> torch.Tensor:
    return Explode.apply(x) * 2


def test_an_error_on_a_worker_fails_backward_with_its_name(group) -> None:
    x = make_param(2, 3)
    with dist_autograd.context() as ctx:
        y = rpc_sync("c", explode, (x,))
        # as PyTorch's: a RuntimeError "Error on Node N: ...", the original inside
        with pytest.raises(BackwardStageError, match="^Error on Node 2: boom in backward") as info:
            dist_autograd.backward(ctx, [y.sum()])
        assert isinstance(info.value, RuntimeError) and info.value.worker == "c"
        original = info.value.original
        assert info.value.__cause__ is original and isinstance(original, ValueError)
        assert original.remote_worker == "c" and "backward" in original.remote_traceback
        assert x not in dist_autograd.get_gradients(ctx)


# -- contexts -------------------------------------------------------------------------
def nested_ctx(x: torch.Tensor) -> int:
    with dist_autograd.context():
        return 1


def test_context_rules(group) -> None:
    with dist_autograd.context() as ctx:
        assert ctx >> 48 == 0  # the creator's rank in the high bits
        with pytest.raises(RuntimeError, match="cannot be nested"):
            with dist_autograd.context():
                pass
        with pytest.raises(RuntimeError, match="cannot be nested"):  # the callee is inside it
            rpc_sync("b", nested_ctx, (torch.ones(1),))
    with pytest.raises(RuntimeError, match="Could not find autograd context"):
        dist_autograd.get_gradients(ctx)


def test_concurrent_contexts_on_two_threads_keep_separate_gradients(group) -> None:
    a = group[0]
    wb = remote("b", make_param, (1, 3, 3))
    results: dict[int, torch.Tensor] = {}

    def train(k: int) -> None:
        with acting_as(a):
            x = torch.full((1, 3), float(k), requires_grad=True)
            with dist_autograd.context() as ctx:
                for _ in range(5):
                    loss = rpc_sync("b", tanh_mm, (x, wb)).sum()
                    dist_autograd.backward(ctx, [loss], retain_graph=False)
                results[k] = rpc_sync("b", grad_here, (ctx, wb))

    threads = [threading.Thread(target=train, args=(k,)) for k in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    bl = wb.to_here()
    for k in (1, 2):
        w = local(bl)
        for _ in range(5):
            torch.tanh(torch.full((1, 3), float(k)) @ w).sum().backward()
        assert torch.allclose(results[k], w.grad)


class _Meet(torch.autograd.Function):
    """Identity whose backward waits (10 s at most) until two backwards are in
    it at once: what the stages of one pass do when they run at once."""

    barrier = threading.Barrier(2, timeout=10)

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        _Meet.barrier.wait()
        return g


def meet_mm(x: torch.Tensor, w: RRef) -> torch.Tensor:
    return _Meet.apply(x) @ w.local_value()


def test_the_stages_of_one_pass_run_at_once_on_a_worker(group) -> None:
    """Two micro-batches through one model on b, in one context: b gets two
    messages of gradients and runs their stages at once, as PyTorch's engine
    runs them on the RPC threads (a pipeline's stages overlap so). Each stage's
    backward meets the other's; one after the other, the first would wait out
    the barrier and fail the pass. The weight gets both parts."""
    _Meet.barrier.reset()
    wb = remote("b", make_param, (1, 3, 3))
    xs = [make_param(k, 2, 3) for k in (2, 3)]
    with dist_autograd.context() as ctx:
        futs = [rpc_async("b", meet_mm, (x, wb)) for x in xs]
        loss = torch.cat(torch.futures.wait_all(futs)).sum()
        dist_autograd.backward(ctx, [loss])
        got = rpc_sync("b", grad_here, (ctx, wb))
        grads = dist_autograd.get_gradients(ctx)
    w = local(wb.to_here())
    xl = [x.detach().requires_grad_() for x in xs]
    torch.cat([x @ w for x in xl]).sum().backward()
    torch.testing.assert_close(got, w.grad)
    for x, x_local in zip(xs, xl):
        torch.testing.assert_close(grads[x], x_local.grad)


def test_leaving_a_context_releases_it_everywhere(group) -> None:
    wb = remote("b", make_param, (1, 3, 1))
    with dist_autograd.context():
        rpc_sync("b", tanh_mm, (make_param(1, 1, 3), wb))
        rpc_sync("c", contexts_here)  # no tensor, but the call ran inside the context
        assert rpc_sync("b", contexts_here) == 1 and rpc_sync("c", contexts_here) == 1
    assert poll_for(lambda: rpc_sync("b", contexts_here) + rpc_sync("c", contexts_here) == 0)


def relay(x: torch.Tensor, via: str, to: str) -> torch.Tensor:
    return rpc_sync(via, torch.mul, (x, 2.0)) if to is None else rpc_sync(via, relay, (x, to, None))


def test_contexts_reached_through_a_dead_worker_are_released(group) -> None:
    a, b, c, d = group
    with dist_autograd.context():
        rpc_sync("b", relay, (make_param(1, 2), "c", "d"))  # a -> b -> c -> d
        assert poll_for(lambda: all(ag.ext["autograd"].contexts for ag in (b, c, d)))
        b._stop_local()  # b dies: it alone knew c
        assert poll_for(lambda: b.rank not in a.members, timeout=5)
    assert poll_for(lambda: not c.ext["autograd"].contexts and not d.ext["autograd"].contexts)


# -- DistributedOptimizer and RemoteModule ------------------------------------------------------
@pytest.mark.parametrize("optim_cls,kwargs", [(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                              (torch.optim.Adam, {"lr": 0.05})])
@pytest.mark.parametrize("mode", MODES)
def test_distributed_optimizer_steps_match_local_ones(group, mode: str, optim_cls, kwargs) -> None:
    wb, wc = remote("b", make_param, (1, 4, 3)), remote("c", make_param, (2, 3, 2))
    x = make_param(0, 5, 4)
    xl, bl, cl = local(x), local(wb.to_here()), local(wc.to_here())
    opt = DistributedOptimizer(optim_cls, [wb, wc, RRef(x)], **kwargs)
    local_opt = optim_cls([bl, cl, xl], **kwargs)
    for _ in range(3):
        with dist_autograd.context() as ctx:
            out = rpc_sync("b", tanh_mm, (x, wb, "c", wc))
            backward(mode, ctx, [(out * out).sum()])
            opt.step(ctx)
        local_opt.zero_grad()
        (torch.tanh(torch.tanh(xl @ bl) @ cl) ** 2).sum().backward()
        local_opt.step()
    assert torch.allclose(wb.to_here(), bl, atol=1e-6) and torch.allclose(wc.to_here(), cl, atol=1e-6)
    assert torch.allclose(x, xl, atol=1e-6) and x.grad is None
    assert "b" in repr(opt) and "c" in repr(opt)


def test_a_training_step_sends_no_rref_protocol_messages(group) -> None:
    """Parameter-server shape: W's RRef goes to its owner in the forward call and
    the optimizer's RRefs to theirs in step(); the answers accept them, so a
    step is its calls, gradients and release only (PyTorch adds a ChildAccept
    and its answer for each)."""
    a = group[0]
    wb = remote("b", make_param, (1, 4, 3))
    x = make_param(0, 5, 4)
    opt = DistributedOptimizer(torch.optim.SGD, [wb], lr=0.1)
    start = time.time()
    for _ in range(3):
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [rpc_sync("b", tanh_mm, (x, wb)).sum()])
            opt.step(ctx)
    assert poll_for(lambda: not a.ext["rref"].state.children and a.unanswered_since(0) == 0)
    sent = Counter(e["op"] for ag in group for e in ag.events.records()
                   if e["event"] == "send" and e["time"] >= start)
    assert sent == {"call": 6, "autograd_grads": 3, "autograd_release": 3}, sent


def broken_step(*args, **kwargs) -> None:
    raise OSError("disk on fire")


class Broken(torch.optim.SGD):
    def step(self, closure=None):
        raise ValueError(f"cannot step on {current_agent().name}")


def test_every_failing_owner_is_reported(group) -> None:
    from nbrpc.errors import CompositeError
    wb, wc = remote("b", make_param, (1, 3)), remote("c", make_param, (2, 3))
    opt = DistributedOptimizer(Broken, [wb, wc], lr=0.1)
    with dist_autograd.context() as ctx:
        with pytest.raises(CompositeError) as info:
            opt.step(ctx)
    assert sorted(info.value.errors) == ["b", "c"]
    assert "cannot step on b" in str(info.value) and "cannot step on c" in str(info.value)
    with pytest.raises(TypeError, match="must be RRefs"):
        DistributedOptimizer(torch.optim.SGD, [torch.ones(1)], lr=0.1)


def seeded(module: nn.Module, seed: int) -> None:
    """Weights from a private generator (workers share this process's global one)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


class Embed(nn.Module):
    def __init__(self, ntoken: int, ninp: int) -> None:
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        seeded(self, 0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.encoder(ids)


class Decode(nn.Module):
    def __init__(self, ntoken: int, nhid: int) -> None:
        super().__init__()
        self.decoder = nn.Linear(nhid, ntoken)
        seeded(self, 1)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(h)


@pytest.mark.parametrize("mode", MODES)
def test_rnn_split_between_parameter_server_and_trainer(group, mode: str) -> None:
    """PyTorch's RPC tutorial model: embedding and decoder on the server (b),
    the LSTM on the trainer (a)."""
    ntoken, ninp, nhid = 10, 6, 5
    emb = RemoteModule("b/cpu", Embed, args=(ntoken, ninp))
    dec = RemoteModule("rank:1/cpu", Decode, kwargs={"ntoken": ntoken, "nhid": nhid})
    lstm = nn.LSTM(ninp, nhid, num_layers=2)
    seeded(lstm, 2)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, ntoken, (4, 3), generator=g)
    target = torch.randint(0, ntoken, (4 * 3,), generator=g)
    params = emb.remote_parameters() + dec.remote_parameters() + [RRef(p) for p in lstm.parameters()]
    opt = DistributedOptimizer(torch.optim.SGD, params, lr=0.05)
    # the same model, locally
    l_emb, l_dec = Embed(ntoken, ninp), Decode(ntoken, nhid)
    l_lstm = nn.LSTM(ninp, nhid, num_layers=2)
    l_lstm.load_state_dict(lstm.state_dict())
    l_params = list(l_emb.parameters()) + list(l_dec.parameters()) + list(l_lstm.parameters())
    l_opt = torch.optim.SGD(l_params, lr=0.05)
    for _ in range(2):
        with dist_autograd.context() as ctx:
            out, _ = lstm(emb(ids))
            loss = nn.functional.cross_entropy(dec(out).reshape(-1, ntoken), target)
            backward(mode, ctx, [loss])
            grads = dist_autograd.get_gradients(ctx)
            lstm_grads = [grads[p] for p in lstm.parameters()]
            opt.step(ctx)
        l_opt.zero_grad()
        l_out, _ = l_lstm(l_emb(ids))
        nn.functional.cross_entropy(l_dec(l_out).reshape(-1, ntoken), target).backward()
        for g, p in zip(lstm_grads, l_lstm.parameters()):
            assert torch.allclose(g, p.grad, atol=1e-6)
        l_opt.step()
    remote_now = [p.to_here() for p in emb.remote_parameters() + dec.remote_parameters()]
    local_now = list(l_emb.parameters()) + list(l_dec.parameters())
    for r, p in zip(remote_now, local_now):
        assert torch.allclose(r, p, atol=1e-6)
    assert all(p.grad is None for p in lstm.parameters())


def test_remote_module_api(group) -> None:
    lin = RemoteModule("c", nn.Linear, args=(3, 2))
    assert repr(lin) == "RemoteModule(Linear on c/cpu)"
    assert lin.forward_async(torch.ones(1, 3)).wait().shape == (1, 2)
    assert lin.get_module_rref().owner_name() == "c"
    lin.eval()
    assert not lin.training and rpc_sync("c", is_training, (lin.get_module_rref(),)) is False
    for name in ("parameters", "state_dict", "to", "cuda", "zero_grad", "buffers"):
        with pytest.raises(ValueError, match=f"``{name}`` not supported"):
            getattr(lin, name)()
    with pytest.raises(ValueError, match="rank:"):
        RemoteModule("rank:x/cpu", nn.Linear, args=(1, 1))
    with pytest.raises(ValueError, match="the CPU or a CUDA device"):
        RemoteModule("c/meta", nn.Linear, args=(1, 1))
    wrapped = nn.Sequential(lin)  # composes into a local model, with no local parameters
    assert wrapped(torch.ones(2, 3)).shape == (2, 2) and list(wrapped.parameters()) == []


def test_a_remote_module_on_a_gpu_its_worker_lacks_is_refused_at_once() -> None:
    """``worker/cuda:N`` parses as PyTorch's; a worker that published its
    device count (every init_rpc member does) is checked before anything is
    created there. (Modules on a GPU: tests/test_cuda.py, where one is.)"""
    from nbrpc.agent.devices import DeviceConfig
    from nbrpc.nn.remote_module import parse_remote_device

    assert parse_remote_device("w1/cuda:1") == ("w1", "cuda:1")
    assert parse_remote_device("rank:1/cuda") == (1, "cuda")
    with local_group(["a", "b"], per_rank={1: {"devices": DeviceConfig(0)}}) as agents, \
            acting_as(agents[0]):
        with pytest.raises(ValueError, match="'b' has 0 CUDA device.*'b/cpu'"):
            RemoteModule("b/cuda:0", nn.Linear, args=(1, 1))
        assert RemoteModule("b/cpu", nn.Linear, args=(1, 1))(torch.ones(1)).shape == (1,)


class NotAModule:
    def __init__(self, *args, **kwargs) -> None:
        pass


def own_attributes(module: RemoteModule) -> dict:
    return {k: v for k, v in module.__dict__.items() if k not in nn.Module().__dict__}


def forward_of(module: RemoteModule, x: torch.Tensor) -> torch.Tensor:
    return module(x)


def share(module_rref: RRef) -> RemoteModule:
    return RemoteModule.init_from_module_rref("b/cpu", module_rref)


def test_remote_module_errors_pickling_and_sharing_match_pytorch(group) -> None:
    """PyTorch's RemoteModule tests: a class that builds no module fails at the
    first call with PyTorch's ValueError; only the module's own attributes
    travel; init_from_module_rref shares one module between RemoteModules."""
    bad = RemoteModule("c/cpu", NotAModule, (1,), {"first_kwarg": 2})
    with pytest.raises(ValueError, match=r"Expect `module_cls\(\*args, \*\*kwargs\)` returns "
                       r"an instance of <class nn.Module>, but it returns an instance of "):
        bad.forward()
    lin = RemoteModule("c", nn.Linear, args=(3, 2))
    lin.new_attr = 1  # set after construction: not sent
    sent = rpc_sync("b", own_attributes, (lin,))
    own = set(RemoteModule_pickled()) - {"training"}  # (nn.Module's own)
    assert set(sent) == own and "new_attr" not in sent
    assert set(own_attributes(lin)) == own | {"new_attr"}  # nothing unlisted but that
    x = torch.ones(1, 3)
    shared = rpc_sync("b", share, (lin.get_module_rref(),))  # made on b, sent back
    assert shared.on == "c" and torch.equal(shared(x), lin(x))
    assert torch.equal(rpc_sync("a", forward_of, (shared, x)), lin(x))
    shared.eval()
    assert rpc_sync("c", is_training, (lin.get_module_rref(),)) is False
    with pytest.raises(TypeError, match="module_rref must be an RRef"):
        RemoteModule.init_from_module_rref("c/cpu", lin)


def RemoteModule_pickled() -> tuple[str, ...]:  # noqa: N802 - names the constant
    from nbrpc.nn.remote_module import _PICKLED_ATTRIBUTES
    return _PICKLED_ATTRIBUTES


def is_training(rref: RRef) -> bool:
    return rref.local_value().training


@pytest.mark.parametrize("mode", ["local", "distributed"])
def test_rref_backward(group, mode: str) -> None:
    wb = remote("b", make_param, (1, 3))
    loss = wb.remote().sum()
    if mode == "local":  # as PyTorch: only the owner runs a local backward
        with pytest.raises(RuntimeError, match="User RRefs require 'dist_autograd_ctx_id'"):
            loss.backward()
        assert rpc_sync("b", grad_of_value, (wb,)) is None
        rpc_sync("b", backward_on_owner, (loss,))
        assert torch.equal(rpc_sync("b", grad_of_value, (wb,)), torch.ones(3))
        return
    with dist_autograd.context() as ctx:
        loss.backward(ctx)
        assert torch.equal(rpc_sync("b", grad_here, (ctx, wb)), torch.ones(3))
        assert rpc_sync("b", grad_of_value, (wb,)) is None


def test_rref_backward_right_after_remote_waits_for_the_value(group) -> None:
    """PyTorch's test_user_rref_backward, made deterministic: the Remote is held
    back, so the owner gets the backward request first. It waits for the
    value (it answered "never created" when its pool ran them in that order)."""
    a = group[0]
    x = make_param(0, 5)
    a.faults.add("remote", "delay", delay=0.3)  # the backward's request reaches b first
    with dist_autograd.context() as ctx:
        loss = remote("b", torch.sum, (x * 2,))
        loss.backward(ctx)
        assert a.faults.fired == [("remote", "request", "delay")]
        assert torch.equal(dist_autograd.get_gradients(ctx)[x], torch.full((5,), 2.0))
    a.faults.add("remote", "delay", delay=0.3)
    with dist_autograd.context() as ctx:
        words = remote("b", str, ("foo",))
        with pytest.raises(RuntimeError, match=r"RRef should contain a tensor for \.backward"):
            words.backward(ctx)


def backward_on_owner(rref: RRef) -> None:
    assert rref.is_owner()
    rref.backward()


def grad_of_value(rref: RRef) -> torch.Tensor | None:
    return rref.local_value().grad


def test_step_mode_gradients_are_identical_to_normal_mode(group) -> None:
    wb, wc = remote("b", make_param, (1, 4, 3)), remote("c", make_param, (2, 3, 2))
    x = make_param(0, 5, 4)
    seen = {}
    for mode in MODES:
        with dist_autograd.context() as ctx:
            h = x * 2
            out = rpc_sync("b", tanh_mm, (h, wb, "c", wc)) + rpc_sync("c", torch.mul, (h, h)).sum()
            backward(mode, ctx, [(out * out).sum()])
            seen[mode] = (dist_autograd.get_gradients(ctx)[x],
                          rpc_sync("b", grad_here, (ctx, wb)), rpc_sync("c", grad_here, (ctx, wc)))
    assert all(torch.equal(n, s) for n, s in zip(seen["normal"], seen["step"]))


# -- the answer carries the gradients back (messages.Back) --------------------------------
def _sent(agent, op: str, since: float) -> int:
    return sum(1 for e in agent.events.records()
               if e["event"] == "send" and e["op"] == op and e["time"] >= since)


def test_a_two_worker_pass_is_one_request_and_its_answer(group) -> None:
    """a -> b -> a: b's gradients for a and the credit ride in the answer to
    a's Grads (was: a Grads back from b, a Credit, and two empty answers)."""
    a, b = group[0], group[1]
    wb = remote("b", make_param, (1, 4, 3))
    x = make_param(0, 5, 4)
    with dist_autograd.context() as ctx:
        out = rpc_sync("b", tanh_mm, (x, wb))
        since = a.events.clock()
        dist_autograd.backward(ctx, [(out * out).sum()])
        gx = dist_autograd.get_gradients(ctx)[x]
        gb = rpc_sync("b", grad_here, (ctx, wb))
    assert _sent(a, "autograd_grads", since) == 1
    assert _sent(b, "autograd_grads", since) == 0
    assert _sent(a, "autograd_credit", since) + _sent(b, "autograd_credit", since) == 0
    xl, bl = local(x), local(wb.to_here())
    (torch.tanh(xl @ bl) ** 2).sum().backward()
    assert torch.allclose(gx, xl.grad) and torch.allclose(gb, bl.grad)


def test_a_chain_through_a_third_worker_returns_gradients_in_answers_and_requests(group) -> None:
    """a -> b -> c -> b -> a: c answers b (its sender) with b's gradients; b's
    stage for them, run by its pool, sends a's as a request (b did not get
    them from a's message), and a's stage returns the credit locally."""
    a, b, c = group[0], group[1], group[2]
    wb, wc = remote("b", make_param, (1, 4, 3)), remote("c", make_param, (2, 3, 2))
    x = make_param(0, 5, 4)
    with dist_autograd.context() as ctx:
        out = rpc_sync("b", tanh_mm, (x, wb, "c", wc))
        since = a.events.clock()
        dist_autograd.backward(ctx, [(out * out).sum()])
        gx = dist_autograd.get_gradients(ctx)[x]
    assert [_sent(w, "autograd_grads", since) for w in (a, b, c)] == [1, 2, 0]
    assert sum(_sent(w, "autograd_credit", since) for w in (a, b, c)) == 0
    xl, bl, cl = local(x), local(wb.to_here()), local(wc.to_here())
    (torch.tanh(torch.tanh(xl @ bl) @ cl) ** 2).sum().backward()
    assert torch.allclose(gx, xl.grad)


def test_a_late_answer_still_completes_the_pass(group) -> None:
    b = group[1]
    wb = remote("b", make_param, (1, 4, 3))
    x = make_param(0, 5, 4)
    b.faults.add("autograd_grads", "delay", delay=0.3, reply=True)
    with dist_autograd.context() as ctx:
        out = rpc_sync("b", tanh_mm, (x, wb))
        dist_autograd.backward(ctx, [(out * out).sum()])
        gx = dist_autograd.get_gradients(ctx)[x]
    assert b.faults.fired == [("autograd_grads", "reply", "delay")]
    xl, bl = local(x), local(wb.to_here())
    (torch.tanh(xl @ bl) ** 2).sum().backward()
    assert torch.allclose(gx, xl.grad)


def test_a_lost_answer_fails_the_pass_within_the_timeout_and_the_next_one_works(group) -> None:
    """The answer holds gradients and credit: lost, the pass cannot finish, so
    backward fails at the call's timeout (it does not hang, nor return with a
    gradient missing), and the agents serve the next pass."""
    a, b = group[0], group[1]
    wb = remote("b", make_param, (1, 4, 3))
    x = make_param(0, 5, 4)
    a.options.rpc_timeout = 0.5
    try:
        b.faults.add("autograd_grads", "drop", reply=True)
        with dist_autograd.context() as ctx:
            out = rpc_sync("b", tanh_mm, (x, wb))
            with pytest.raises(RpcTimeoutError):
                dist_autograd.backward(ctx, [(out * out).sum()])
        with dist_autograd.context() as ctx:
            out = rpc_sync("b", tanh_mm, (x, wb))
            dist_autograd.backward(ctx, [(out * out).sum()])
            gx = dist_autograd.get_gradients(ctx)[x]
    finally:
        a.options.rpc_timeout = 10.0
    xl, bl = local(x), local(wb.to_here())
    (torch.tanh(xl @ bl) ** 2).sum().backward()
    assert torch.allclose(gx, xl.grad)
