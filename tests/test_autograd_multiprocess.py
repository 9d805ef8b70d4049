"""Distributed autograd, DistributedOptimizer and RemoteModule with real processes.

Two worlds, each one ``torch.multiprocessing.spawn(_child, nprocs=3, join=False)``
whose processes call ``rpc.init_rpc(name, rank=rank, world_size=3)`` (env://, with
MASTER_ADDR/MASTER_PORT from a free port the parent chose) and ``rpc.shutdown()``,
as ``test_rref_multiprocess.py`` does (this file copies its patterns: result rows
on a ``multiprocessing`` queue, a ``faulthandler`` watchdog in every child, the
parent joining the processes one by one and killing, by pid, what outlives
``WORLD_TIMEOUT_S``).

=============  ==========================================================================
world/phase    what it checks
=============  ==========================================================================
train/rnn      PyTorch's RPC tutorial model split over two workers: EmbeddingTable and
               Decoder are RemoteModules on "ps" (rank 1), the LSTM is on "trainer"
               (rank 0). Forward, distributed backward, 3 steps of DistributedOptimizer
               (SGD, then a fresh model with Adam) over remote_parameters() + RRefs of
               the LSTM's parameters; every loss, the first step's gradients (on both
               workers) and the final parameters (fetched with to_here()) equal those
               of the same model trained locally with the local optimizer. ``.grad``
               stays None on both workers. RRef.backward(ctx) from a loss owned by ps
               sends gradients back to the trainer. ps holds no context afterwards.
train/shared   "trainer" (rank 0) and "trainer2" (rank 2) step one DistributedOptimizer
               each, in lock step, on the same parameter owned by ps; a slow SGD makes
               the steps overlap: the final value is the sum of every update of both
               (the per-owner lock lets one step run at a time)
kill/chain     trainer -> w1 -> w2 inside two contexts (one backward pending, one call
               in flight); the trainer SIGKILLs w1: the backward and the call fail
               naming w1 within DEATH_DETECTED_S, and once both contexts are left the
               survivor w2 holds no autograd context
=============  ==========================================================================

All comparisons with the local model are made in the trainer process (the rows
carry plain numbers back). Every RPC, barrier, join and poll has a deadline.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from conftest import poll_for, poll_or_fail
from torch import nn
from worlds import World, await_death, child, outcome, run_world, world_cache

from nbrpc import autograd as dist_autograd
from nbrpc import rpc
from nbrpc.agent import current_agent
from nbrpc.nn import RemoteModule
from nbrpc.optim import DistributedOptimizer
from nbrpc.rpc import RRef

pytestmark = pytest.mark.multiprocess

WORLD = 3
NAMES = {"train": ["trainer", "ps", "trainer2"], "kill": ["trainer", "w1", "w2"]}
RPC_TIMEOUT_S = 15.0  # every call and graceful shutdown
WATCHDOG_S = 35.0  # a child stuck this long dumps its threads and exits
WAIT_S = 15.0  # barriers and events between ranks
PHASE_BARRIER_S = 25.0  # the barrier after a phase (one rank may run it alone)
WORLD_TIMEOUT_S = 45.0  # the parent kills what is still alive after this
DEATH_DETECTED_S = 6.0  # from SIGKILL to the error (failure_timeout is 2 s)
ATOL, RTOL = 1e-6, 1e-5


def _close(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference; fails unless allclose."""
    a, b = a.detach(), b.detach()
    assert a.shape == b.shape, (a.shape, b.shape)
    assert torch.allclose(a, b, atol=ATOL, rtol=RTOL), (a, b)
    return float((a - b).abs().max()) if a.numel() else 0.0


# -- the tutorial's model (https://pytorch.org/tutorials/intermediate/rpc_tutorial.html) -----
NTOKEN, NINP, NHID, NLAYERS = 10, 4, 6, 2
SEQ, BATCH, STEPS = 5, 3, 3


class EmbeddingTable(nn.Module):
    """Encoding layers of the RNNModel (on the parameter server)."""

    def __init__(self, ntoken: int, ninp: int, dropout: float, seed: int) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        # the same weights wherever it is built: a private generator (the global
        # one is shared by the RPC threads, which may build two modules at once)
        g = torch.Generator().manual_seed(seed)
        nn.init.uniform_(self.encoder.weight, -0.1, 0.1, generator=g)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return self.drop(self.encoder(input))


class Decoder(nn.Module):
    """Decoding layer of the RNNModel (on the parameter server)."""

    def __init__(self, ntoken: int, nhid: int, dropout: float, seed: int) -> None:
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.decoder = nn.Linear(nhid, ntoken)
        g = torch.Generator().manual_seed(seed)
        nn.init.zeros_(self.decoder.bias)
        nn.init.uniform_(self.decoder.weight, -0.1, 0.1, generator=g)

    def forward(self, output: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.drop(output))


def _lstm() -> nn.LSTM:
    lstm = nn.LSTM(NINP, NHID, NLAYERS, dropout=0.0)
    g = torch.Generator().manual_seed(2)
    for p in lstm.parameters():
        nn.init.uniform_(p, -0.3, 0.3, generator=g)
    return lstm


class DistRNN(nn.Module):
    """The tutorial's RNNModel with RemoteModules: embedding and decoder on ``ps``."""

    def __init__(self, ps: str) -> None:
        super().__init__()
        self.emb = RemoteModule(f"{ps}/cpu", EmbeddingTable, args=(NTOKEN, NINP, 0.0, 1))
        self.rnn = _lstm()
        self.dec = RemoteModule(f"{ps}/cpu", Decoder, args=(NTOKEN, NHID, 0.0, 3))

    def forward(self, input: torch.Tensor, hidden: tuple) -> tuple:
        emb = self.emb(input)
        output, hidden = self.rnn(emb, hidden)
        return self.dec(output), hidden

    def parameter_rrefs(self) -> list[RRef]:
        return (self.emb.remote_parameters() + [RRef(p) for p in self.rnn.parameters()]
                + self.dec.remote_parameters())


class LocalRNN(nn.Module):
    """The same model, in one process."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = EmbeddingTable(NTOKEN, NINP, 0.0, 1)
        self.rnn = _lstm()
        self.dec = Decoder(NTOKEN, NHID, 0.0, 3)

    def forward(self, input: torch.Tensor, hidden: tuple) -> tuple:
        output, hidden = self.rnn(self.emb(input), hidden)
        return self.dec(output), hidden


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randint(0, NTOKEN, (SEQ, BATCH), generator=g),
             torch.randint(0, NTOKEN, (SEQ, BATCH), generator=g)) for _ in range(STEPS)]


def _zero_hidden() -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.zeros(NLAYERS, BATCH, NHID), torch.zeros(NLAYERS, BATCH, NHID))


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output.view(-1, NTOKEN), target.view(-1))


# -- run on ps ------------------------------------------------------------------------
def _module_grads(module_rref: RRef, ctx_id: int) -> dict:
    """The context's gradients of a module's parameters, and their ``.grad``."""
    module = module_rref.local_value()
    grads = dist_autograd.get_gradients(ctx_id)
    return {"grads": [grads.get(p) for p in module.parameters()],
            "grad_attr_none": [p.grad is None for p in module.parameters()]}


def _contexts_here() -> list[int]:
    return sorted(current_agent().ext["autograd"].contexts)


def _await_no_contexts(timeout: float, ids: list[int] | None = None) -> float:
    """Poll this worker's autograd contexts until none (of ``ids``, if given) is
    left; the seconds it took."""
    t0 = time.monotonic()
    contexts = current_agent().ext["autograd"].contexts
    poll_or_fail(lambda: not (set(contexts) & set(ids) if ids is not None else contexts),
                 timeout, lambda: f"no autograd context {ids or ''} on "
                                  f"{rpc.get_worker_info().name}: {_contexts_here()}")
    return time.monotonic() - t0


def _left_after(timeout: float) -> list[int]:
    """The contexts still here after ``timeout`` seconds (or [] as soon as none is)."""
    contexts = current_agent().ext["autograd"].contexts
    poll_for(lambda: not contexts, timeout, interval=0.02)
    return _contexts_here()


def _decoder_loss(dec_rref: RRef, hidden_out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A scalar loss owned by ps (for RRef.backward)."""
    return _loss(dec_rref.local_value()(hidden_out), target)


# -- world "train", phase rnn ---------------------------------------------------------------
def _train_rnn(optim_cls: type, kwargs: dict) -> dict:
    """Trains DistRNN and LocalRNN identically for STEPS steps; compares everything."""
    batches = _batches()
    # the local reference
    local = LocalRNN()
    local_opt = optim_cls(local.parameters(), **kwargs)
    hidden, local_losses, local_grads = _zero_hidden(), [], None
    for i, (data, target) in enumerate(batches):
        hidden = tuple(h.detach() for h in hidden)
        output, hidden = local(data, hidden)
        loss = _loss(output, target)
        local_opt.zero_grad()
        loss.backward()
        if i == 0:
            local_grads = {n: p.grad.clone() for n, p in local.named_parameters()}
        local_opt.step()
        local_losses.append(loss.item())

    # the distributed model, its initial weights checked against the local one's
    model = DistRNN("ps")
    fresh = LocalRNN()
    for mine, theirs in zip(model.emb.remote_parameters() + model.dec.remote_parameters(),
                            list(fresh.emb.parameters()) + list(fresh.dec.parameters())):
        _close(mine.to_here(timeout=RPC_TIMEOUT_S), theirs)
    for mine, theirs in zip(model.rnn.parameters(), fresh.rnn.parameters()):
        _close(mine, theirs)
    opt = DistributedOptimizer(optim_cls, model.parameter_rrefs(), **kwargs)
    hidden, losses, diffs = _zero_hidden(), [], {}
    for i, (data, target) in enumerate(batches):
        with dist_autograd.context() as ctx:
            hidden = tuple(h.detach() for h in hidden)
            output, hidden = model(data, hidden)
            loss = _loss(output, target)
            dist_autograd.backward(ctx, [loss])
            assert all(p.grad is None for p in model.rnn.parameters()), "LSTM .grad was set"
            if i == 0:  # the first step's gradients, on both workers
                grads = dist_autograd.get_gradients(ctx)
                for n, p in model.rnn.named_parameters():
                    diffs[f"grad rnn.{n}"] = _close(grads[p], local_grads[f"rnn.{n}"])
                for name, rm in (("emb", model.emb), ("dec", model.dec)):
                    got = rpc.rpc_sync("ps", _module_grads, args=(rm.get_module_rref(), ctx),
                                       timeout=RPC_TIMEOUT_S)
                    assert got["grad_attr_none"] and all(got["grad_attr_none"]), got
                    want = [g for n, g in local_grads.items() if n.startswith(name + ".")]
                    assert len(got["grads"]) == len(want) > 0
                    for j, (g, w) in enumerate(zip(got["grads"], want)):
                        assert g is not None, f"no gradient for {name} parameter {j} on ps"
                        diffs[f"grad {name}.{j}"] = _close(g, w)
                # the trainer's own context holds the LSTM's leaves only
                assert {id(t) for t in grads} == {id(p) for p in model.rnn.parameters()}, \
                    [tuple(t.shape) for t in grads]
            opt.step(ctx)
            losses.append(loss.item())
    assert all(p.grad is None for p in model.rnn.parameters())
    for rm in (model.emb, model.dec):
        with dist_autograd.context() as ctx:  # any context: .grad is what is checked
            got = rpc.rpc_sync("ps", _module_grads, args=(rm.get_module_rref(), ctx),
                               timeout=RPC_TIMEOUT_S)
        assert all(got["grad_attr_none"]), got
    for a, b in zip(losses, local_losses):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(b)), (losses, local_losses)
    # after the steps: remote parameters fetched, compared with the local model's
    for n, (mine, theirs) in enumerate(zip(model.emb.remote_parameters(),
                                           local.emb.parameters())):
        diffs[f"final emb.{n}"] = _close(mine.to_here(timeout=RPC_TIMEOUT_S), theirs)
    for n, (mine, theirs) in enumerate(zip(model.dec.remote_parameters(),
                                           local.dec.parameters())):
        diffs[f"final dec.{n}"] = _close(mine.to_here(timeout=RPC_TIMEOUT_S), theirs)
    for (n, mine), theirs in zip(model.rnn.named_parameters(), local.rnn.parameters()):
        diffs[f"final rnn.{n}"] = _close(mine, theirs)
    # the local parameters moved, so a distributed step that did nothing would have
    # failed the comparison above
    moved = max(float((a - b).abs().max()) for a, b in zip(local.parameters(),
                                                           LocalRNN().parameters()))
    assert moved > 1e-4, moved
    return {"losses": losses, "local_losses": local_losses, "max_diff": max(diffs.values()),
            "checked": len(diffs), "moved": moved}


def _rref_backward() -> dict:
    """loss = Decoder(h) owned by ps; ``loss_rref.backward(ctx)`` from the trainer, twice
    (retain_graph=True first): the gradients, on both workers, are twice the local ones."""
    dec = RemoteModule("ps/cpu", Decoder, args=(NTOKEN, NHID, 0.0, 3))
    local_dec = Decoder(NTOKEN, NHID, 0.0, 3)
    g = torch.Generator().manual_seed(11)
    h_data = torch.randn(SEQ, BATCH, NHID, generator=g)
    target = torch.randint(0, NTOKEN, (SEQ, BATCH), generator=g)
    h_local = h_data.clone().requires_grad_()
    _loss(local_dec(h_local), target).backward()
    h = h_data.clone().requires_grad_()
    with dist_autograd.context() as ctx:
        loss_rref = rpc.remote("ps", _decoder_loss, args=(dec.get_module_rref(), h, target))
        loss_rref.backward(ctx, retain_graph=True)
        once = dist_autograd.get_gradients(ctx)[h].clone()
        loss_rref.backward(ctx)
        grads = dist_autograd.get_gradients(ctx)
        assert list(grads) == [h], [tuple(t.shape) for t in grads]
        diff_once = _close(once, h_local.grad)
        diff_h = _close(grads[h], 2 * h_local.grad)
        got = rpc.rpc_sync("ps", _module_grads, args=(dec.get_module_rref(), ctx),
                           timeout=RPC_TIMEOUT_S)
        diff_w = max(_close(a, 2 * p.grad) for a, p in zip(got["grads"], local_dec.parameters()))
        assert all(got["grad_attr_none"]), got
        with pytest.raises(RuntimeError, match="Already have an autograd context"):
            with dist_autograd.context():
                pass
    assert h.grad is None
    return {"diff_once": diff_once, "diff_h": diff_h, "diff_w": diff_w}


def _body_rnn(rank: int, sync: dict) -> dict:
    if rank != 0:
        return {}  # ps serves; every rank waits at the barrier after the phase
    out: dict[str, Any] = {}
    out["sgd"] = _train_rnn(torch.optim.SGD, {"lr": 0.5})
    out["adam"] = _train_rnn(torch.optim.Adam, {"lr": 0.05})
    out["rref_backward"] = _rref_backward()
    out["ps_contexts_drained_s"] = rpc.rpc_sync("ps", _await_no_contexts, args=(5.0,),
                                                timeout=RPC_TIMEOUT_S)
    assert not current_agent().ext["autograd"].contexts
    return out


# -- world "train", phase shared: two trainers, one parameter server ----------------------
SHARED_STEPS = 8
SHARED_SLEEP_S = 0.02
_SHARED: dict[str, Any] = {}
_SHARED_LOCK = threading.Lock()
_ACTIVE = {"now": 0, "max": 0, "steps": 0}


def _shared_weight() -> RRef:
    """On ps: one parameter for both trainers (made by the first to ask)."""
    with _SHARED_LOCK:
        if "w" not in _SHARED:
            _SHARED["w"] = nn.Parameter(torch.zeros(4))
        return RRef(_SHARED["w"])


def _weighted(w_rref: RRef, c: torch.Tensor) -> torch.Tensor:
    """On ps: w * c; the gradient of its sum with respect to w is c."""
    return w_rref.local_value() * c


def _active_steps() -> dict:
    with _SHARED_LOCK:
        return dict(_ACTIVE)


class SlowSGD(torch.optim.SGD):
    """SGD whose step takes a while and counts how many run at once (on ps)."""

    def step(self, closure: Any = None) -> Any:
        with _SHARED_LOCK:
            _ACTIVE["now"] += 1
            _ACTIVE["max"] = max(_ACTIVE["max"], _ACTIVE["now"])
        try:
            params = [p for group in self.param_groups for p in group["params"]]
            grads = [p.grad.clone() for p in params]
            time.sleep(SHARED_SLEEP_S)  # another step, unserialized, would swap .grad here
            for p, g in zip(params, grads):
                assert torch.equal(p.grad, g), "the .grad of this step changed under it"
            return super().step(closure)
        finally:
            with _SHARED_LOCK:
                _ACTIVE["now"] -= 1
                _ACTIVE["steps"] += 1


def _coefficients(rank: int) -> torch.Tensor:
    """Each trainer's gradient: distinct, exact in float32 (lr = 1)."""
    base = torch.tensor([1.0, 2.0, 4.0, 8.0])
    return base if rank == 0 else base * 16


def _body_shared(rank: int, sync: dict) -> dict:
    if rank == 1:  # ps: serves until both trainers are done
        sync["barrier"].wait(WAIT_S)
        return {"active": _active_steps()}
    try:  # the barrier: both trainers are done (ps waits for it)
        w = rpc.rpc_sync("ps", _shared_weight, timeout=RPC_TIMEOUT_S)
        opt = DistributedOptimizer(SlowSGD, [w], lr=1.0)
        c = _coefficients(rank)
        t0 = time.monotonic()
        step_s = []
        for _ in range(SHARED_STEPS):
            with dist_autograd.context() as ctx:
                loss = rpc.rpc_sync("ps", _weighted, args=(w, c), timeout=RPC_TIMEOUT_S).sum()
                dist_autograd.backward(ctx, [loss])
                sync["trainers"].wait(WAIT_S)  # both step at (nearly) the same moment
                t = time.monotonic()
                opt.step(ctx)
                step_s.append(time.monotonic() - t)
        t1 = time.monotonic()
    finally:
        sync["barrier"].wait(WAIT_S)
    final = w.to_here(timeout=RPC_TIMEOUT_S)
    expected = -SHARED_STEPS * (_coefficients(0) + _coefficients(2))
    assert torch.equal(final, expected), (final, expected)
    active = rpc.rpc_sync("ps", _active_steps, timeout=RPC_TIMEOUT_S)
    return {"final": final.tolist(), "expected": expected.tolist(), "loop": [t0, t1],
            "step_s": [round(s, 3) for s in step_s], "active": active}


# -- world "kill": trainer -> w1 -> w2, w1 killed ------------------------------------------
_W2_WEIGHT: dict[str, torch.Tensor] = {}


def _w2_forward(h: torch.Tensor) -> torch.Tensor:
    """On w2: tanh(h @ W), W a parameter of w2."""
    W = _W2_WEIGHT.setdefault("W", nn.Parameter(torch.full((3, 2), 0.1)))
    return torch.tanh(h @ W)


def _w1_forward(x: torch.Tensor) -> torch.Tensor:
    """On w1: the middle of the chain."""
    return rpc.rpc_sync("w2", _w2_forward, args=(x * 2,), timeout=RPC_TIMEOUT_S) + 1


def _w1_relay_and_hang(x: torch.Tensor) -> torch.Tensor:
    """On w1: calls w2, says so, then waits (it is killed meanwhile)."""
    y = rpc.rpc_sync("w2", _w2_forward, args=(x * 3,), timeout=RPC_TIMEOUT_S)
    _CTX["sync"]["relayed"].set()
    time.sleep(WAIT_S)  # a hold: the test kills this process while it waits here
    return y


def _off_context(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on a thread of its own, outside this thread's autograd context
    (so that the calls it makes carry none)."""
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e

    t = threading.Thread(target=run, name="test-off-context", daemon=True)
    t.start()
    t.join(RPC_TIMEOUT_S + 1)
    assert not t.is_alive(), "off-context call did not finish"
    if "error" in out:
        raise out.pop("error")
    return out["value"]


def _body_kill(rank: int, sync: dict) -> dict:
    if rank == 1:
        await_death(_CTX["results"], sync["victim_ready"], WAIT_S)
    if rank == 2:
        assert sync["done"].wait(WAIT_S + DEATH_DETECTED_S), "the trainer did not finish"
        return {"contexts_left": _contexts_here()}
    try:
        return _kill_trainer(sync)
    finally:
        sync["done"].set()


def _kill_trainer(sync: dict) -> dict:
    pid1 = rpc.rpc_sync("w1", os.getpid, timeout=RPC_TIMEOUT_S)
    x = torch.full((2, 3), 0.5, requires_grad=True)
    hung: dict[str, Any] = {}

    def call_in_flight() -> None:
        """Context B: a call to w1 (which relayed to w2) in flight at the kill."""
        try:
            with dist_autograd.context() as ctx_b:
                hung["ctx"] = ctx_b
                fut = rpc.rpc_async("w1", _w1_relay_and_hang, args=(x,), timeout=RPC_TIMEOUT_S)
                hung["sent"] = True
                try:
                    fut.wait()
                    hung["error"] = "no error"
                except Exception as e:
                    hung["error"] = f"{type(e).__name__}: {e}"
                hung["at"] = time.monotonic()
        except BaseException:
            hung["crash"] = traceback.format_exc()

    killed = threading.Event()
    early: dict[str, Any] = {"ready": threading.Event()}

    def left_at_the_kill() -> None:
        """Context C: a finished chain, left right after the kill (before the death
        is detected: the release is sent to the dead w1, which cannot pass it on)."""
        try:
            with dist_autograd.context() as ctx_c:
                early["ctx"] = ctx_c
                rpc.rpc_sync("w1", _w1_forward, args=(x,), timeout=RPC_TIMEOUT_S)
                early["ready"].set()
                killed.wait(WAIT_S)
            early["left_after_kill_s"] = time.monotonic() - early.get("t_kill", 0.0)
        except BaseException:
            early["crash"] = traceback.format_exc()
            early["ready"].set()

    with dist_autograd.context() as ctx_a:
        t_c = threading.Thread(target=left_at_the_kill, name="test-left-early", daemon=True)
        t_c.start()
        assert early["ready"].wait(WAIT_S) and "crash" not in early, early
        y = rpc.rpc_sync("w1", _w1_forward, args=(x,), timeout=RPC_TIMEOUT_S)
        local = torch.tanh((x.detach() * 2) @ torch.full((3, 2), 0.1)) + 1
        _close(y, local)
        t_b = threading.Thread(target=call_in_flight, name="test-in-flight", daemon=True)
        t_b.start()
        assert sync["relayed"].wait(WAIT_S), f"w1 did not relay to w2: {hung}"
        on_w2 = _off_context(lambda: rpc.rpc_sync("w2", _contexts_here, timeout=RPC_TIMEOUT_S))
        assert set(on_w2) == {ctx_a, hung["ctx"], early["ctx"]}, (on_w2, ctx_a, hung, early)
        sync["victim_ready"].wait(WAIT_S)  # its result queue is flushed
        t_kill = early["t_kill"] = time.monotonic()
        os.kill(pid1, signal.SIGKILL)
        killed.set()
        try:
            dist_autograd.backward(ctx_a, [y.sum()])
            backward_error = "no error"
        except Exception as e:
            backward_error = f"{type(e).__name__}: {e}"
        backward_s = time.monotonic() - t_kill
    t_b.join(DEATH_DETECTED_S + 1)
    t_c.join(1.0)
    assert not t_c.is_alive() and "crash" not in early, early
    assert not t_b.is_alive(), f"the call in flight to the dead w1 did not end: {hung}"
    assert "crash" not in hung, hung["crash"]
    call_s = hung["at"] - t_kill
    for what, err in (("backward", backward_error), ("call", hung["error"])):
        assert "'w1'" in err, f"the {what}'s error does not name w1: {err}"
    assert max(backward_s, call_s) < DEATH_DETECTED_S, (backward_s, call_s)
    # contexts A and B left once the death was known: the survivor w2 drops them
    drained_s = rpc.rpc_sync("w2", _await_no_contexts, args=(5.0, [ctx_a, hung["ctx"]]),
                             timeout=RPC_TIMEOUT_S)
    assert not current_agent().ext["autograd"].contexts
    # context C, left before: checked by a test of its own (a known nbrpc bug)
    left_on_w2 = rpc.rpc_sync("w2", _left_after, args=(3.0,), timeout=RPC_TIMEOUT_S)
    assert set(left_on_w2) <= {early["ctx"]}, (left_on_w2, early["ctx"])
    # and keeps working, in a new context too
    with dist_autograd.context() as ctx:
        z = rpc.rpc_sync("w2", _w2_forward, args=(x,), timeout=RPC_TIMEOUT_S)
        dist_autograd.backward(ctx, [z.sum()])
        gx = dist_autograd.get_gradients(ctx)[x]
    xl = x.detach().clone().requires_grad_()
    torch.tanh(xl @ torch.full((3, 2), 0.1)).sum().backward()
    _close(gx, xl.grad)
    rpc.rpc_sync("w2", _await_no_contexts, args=(5.0, [ctx]), timeout=RPC_TIMEOUT_S)
    return {"backward_s": round(backward_s, 2), "call_s": round(call_s, 2),
            "drained_s": round(drained_s, 3),
            "left_early_after_kill_s": round(early["left_after_kill_s"], 3),
            "left_early_still_on_w2": early["ctx"] in left_on_w2, "ctx_c": early["ctx"],
            "backward_error": backward_error,
            "call_error": hung["error"]}


# -- the spawned process -------------------------------------------------------------------
@dataclass(frozen=True)
class Phase:
    name: str
    body: Callable[[int, dict], dict]
    barrier_after: bool = False  # every rank waits for the others before going on


WORLDS: dict[str, list[Phase]] = {
    "train": [Phase("rnn", _body_rnn, barrier_after=True),
              Phase("shared", _body_shared, barrier_after=True)],
    "kill": [Phase("chain", _body_kill)],
}
_CTX: dict[str, Any] = {}  # set in the child


def _child(rank: int, world: str, port: int, results: Any, sync: dict) -> None:
    with child(rank, world, port, results) as report:
        _CTX["results"], _CTX["sync"] = results, sync
        torch.set_num_threads(1)  # 3 processes on 2 cores
        faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
        t0 = time.monotonic()
        opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=RPC_TIMEOUT_S)
        rpc.init_rpc(NAMES[world][rank], rank=rank, world_size=WORLD, rpc_backend_options=opts)
        report.write("-", "<init>", secs=time.monotonic() - t0, pid=os.getpid())
        for phase in WORLDS[world]:
            info, error, secs = outcome(lambda p=phase: p.body(rank, sync))
            if phase.barrier_after:
                try:
                    sync["barrier"].wait(PHASE_BARRIER_S)
                except BaseException:
                    error = (error or "") + traceback.format_exc()
            report.write(phase.name, "<body>", ok=error is None, secs=secs, info=info,
                         error=error)
        _, shutdown, secs = outcome(lambda: rpc.shutdown(timeout=RPC_TIMEOUT_S))
        report.write("-", "<shutdown>", ok=shutdown is None, secs=secs, error=shutdown)


# -- the parent side -----------------------------------------------------------------------
def _sync(ctx: Any) -> dict:
    return {"barrier": ctx.Barrier(WORLD), "trainers": ctx.Barrier(2), "done": ctx.Event(),
            "victim_ready": ctx.Event(), "relayed": ctx.Event()}


@pytest.fixture(scope="module")
def worlds() -> Callable[[str], World]:
    """Each world is spawned once, by the first test that asks for it."""
    return world_cache(lambda name: run_world(name, _child, WORLD, WORLD_TIMEOUT_S, _sync))


# -- the tests -----------------------------------------------------------------------------
@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_split_rnn_trains_like_the_local_model(worlds, optim: str) -> None:
    info = worlds("train").ok("rnn", "<body>", 0)["info"][optim]
    assert info["max_diff"] <= 1e-4 and info["checked"] >= 20, info
    print(optim, info)


def test_rref_backward_returns_gradients_to_the_trainer(worlds) -> None:
    info = worlds("train").ok("rnn", "<body>", 0)["info"]["rref_backward"]
    assert max(info.values()) <= 1e-4, info


def test_parameter_server_keeps_no_context_after_training(worlds) -> None:
    w = worlds("train")
    info = w.ok("rnn", "<body>", 0)["info"]
    assert info["ps_contexts_drained_s"] < 5.0, info
    w.ok("rnn", "<body>", 1)


def test_two_trainers_share_a_parameter_server(worlds) -> None:
    w = worlds("train")
    t0 = w.ok("shared", "<body>", 0)["info"]
    t2 = w.ok("shared", "<body>", 2)["info"]
    ps = w.ok("shared", "<body>", 1)["info"]
    assert t0["final"] == t0["expected"] == [-136.0, -272.0, -544.0, -1088.0], t0
    assert t2["final"] == t0["final"], (t0, t2)
    assert ps["active"]["steps"] == 2 * SHARED_STEPS, ps
    assert ps["active"]["max"] == 1, ps  # one step at a time on the owner
    # the steps did contend: in some pair, one trainer's step waited for the other's
    waited = [max(a, b) for a, b in zip(t0["step_s"], t2["step_s"])]
    assert max(waited) >= 1.8 * SHARED_SLEEP_S, waited
    (a0, b0), (a2, b2) = t0["loop"], t2["loop"]
    assert max(a0, a2) < min(b0, b2), (t0["loop"], t2["loop"])  # they ran concurrently
    print({"trainer": t0["step_s"], "trainer2": t2["step_s"]})


def test_train_world_exits_cleanly(worlds) -> None:
    w = worlds("train")
    for rank in range(WORLD):
        w.ok("-", "<shutdown>", rank)
    assert w.exitcodes == [0] * WORLD, (w.exitcodes, [r for r in w.rows if not r["ok"]])
    print({"train_world_s": round(w.secs, 1)})


def test_killed_worker_fails_backward_and_calls_promptly(worlds) -> None:
    w = worlds("kill")
    info = w.ok("chain", "<body>", 0)["info"]
    assert info["backward_s"] < DEATH_DETECTED_S and info["call_s"] < DEATH_DETECTED_S, info
    assert "'w1'" in info["backward_error"] and "'w1'" in info["call_error"], info
    assert w.exitcodes[1] == -signal.SIGKILL, w.exitcodes
    print(info)


def test_survivor_drops_the_contexts_of_a_chain_through_a_dead_worker(worlds) -> None:
    """Contexts A (backward failed) and B (call failed), left once w1's death was known:
    the trainer tells every member, w2 included, to release them."""
    w = worlds("kill")
    info = w.ok("chain", "<body>", 0)["info"]
    assert info["drained_s"] < 5.0, info
    assert set(w.ok("chain", "<body>", 2)["info"]["contexts_left"]) <= {info["ctx_c"]}


def test_survivor_drops_a_context_left_before_the_death_was_detected(worlds) -> None:
    """Context C: trainer -> w1 -> w2 finished, w1 SIGKILLed, C left 0-2 ms later."""
    w = worlds("kill")
    info = w.ok("chain", "<body>", 0)["info"]
    assert info["left_early_after_kill_s"] < 1.0, info  # before the death was detected
    assert not info["left_early_still_on_w2"], info
    assert w.ok("chain", "<body>", 2)["info"]["contexts_left"] == []


def test_kill_world_survivors_shut_down_cleanly(worlds) -> None:
    w = worlds("kill")
    secs = [w.ok("-", "<shutdown>", r)["secs"] for r in (0, 2)]
    assert [w.exitcodes[r] for r in (0, 2)] == [0, 0], w.exitcodes
    assert max(secs) < 5.0, secs
    print({"kill_world_s": round(w.secs, 1), "shutdown_s": [round(s, 2) for s in secs]})
