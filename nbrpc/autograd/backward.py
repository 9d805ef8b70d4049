"""Running a distributed backward pass: freely, or one stage at a time.

Normal mode (:func:`run_backward`), for ``backward(ctx, [loss])`` on A::

    A: stage "roots" ──Grads(#7)──▶ B: stage "send #7" ──Grads(#6)──▶ A: stage "send #6"
                                    B  ◀───────── reply (A's subtree done) ──┘
    A  ◀── reply (B's subtree done) ─┘   backward returns

Each ``Grads`` request is answered when its stage and every request that
stage sent have been answered, so the caller's ``backward`` returns when the
whole pass is over (PyTorch does the same). An error anywhere travels back up
with its worker and traceback; the caller then tells every worker to abort
the pass. Replies also name the workers left with blocked nodes (a tensor
sent but not used in the loss); those are flushed before ``backward`` returns.

Step mode (:class:`BackwardStepper`): the same stages, but a stage returns the
gradients it would send, and the driver delivers them, one stage per
``step()``.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..agent import Agent, Deferred, RpcFuture
from .context import AutogradContext, Contexts, contexts_of
from .engine import LocalPass, Outgoing, edge

log = logging.getLogger(__name__)

MAX_FLUSH_ROUNDS = 16
_pass_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class Grads:
    """Gradients for send function ``msg_id`` of context ``ctx_id``, pass ``pass_id``."""

    op = "autograd_grads"
    ctx_id: int
    pass_id: tuple[int, int]
    msg_id: int
    grads: list
    retain_graph: bool
    step: bool = False  # step mode: run the stage, return what it would send
    origin: int | None = None  # step mode: the worker whose stage produced them


@dataclass(frozen=True, slots=True)
class Flush:
    op = "autograd_flush"
    ctx_id: int
    pass_id: tuple[int, int]
    retain_graph: bool
    step: bool = False


@dataclass(frozen=True, slots=True)
class Abort:
    op = "autograd_abort"
    ctx_id: int
    pass_id: tuple[int, int]
    reason: str
    told: frozenset[int]


@dataclass(frozen=True, slots=True)
class GraphQuery:
    op = "autograd_graph"
    ctx_id: int


# -- checks -------------------------------------------------------------------------
def check_roots(roots: Any) -> list[torch.Tensor]:
    if isinstance(roots, torch.Tensor):
        roots = [roots]
    roots = list(roots)
    if not roots:
        raise ValueError("backward needs at least one root tensor, e.g. [loss]")
    for r in roots:
        if not isinstance(r, torch.Tensor):
            raise TypeError(f"roots must be tensors, got {type(r).__name__}")
        if not r.requires_grad:
            raise RuntimeError("requires_grad not set on root: the loss does not depend on "
                               "any tensor that requires grad")
        if r.numel() != 1:
            raise RuntimeError(f"a root of shape {list(r.shape)} is not a scalar; all roots "
                               "need to be scalars (call .sum() or .mean() on it)")
        if r.grad_fn is None:
            raise RuntimeError("a root does not have a valid gradient function (it is a "
                               "leaf); compute the loss from it first")
    return roots


# -- one stage on this worker ---------------------------------------------------------
def run_stage(agent: Agent, ctx: AutogradContext, lp: LocalPass, trigger: str,
              feed: Any) -> tuple[dict[str, Any], list[Outgoing]]:
    """``feed(lp)`` delivers what triggered the stage; then the stage runs."""
    with ctx.lock:
        if lp.failed:
            raise RuntimeError(f"the distributed backward pass was aborted: {lp.failed}")
        try:
            feed(lp)
            record, outbox = lp.flush() if trigger == "flush" else lp.run(trigger)
        except BaseException as e:
            lp.failed = f"{type(e).__name__} on {agent.name!r}: {e}"
            raise
        data = ctx.add_stage(record)
    ctx.known.update(o.peer for o in outbox)
    agent.events.add("autograd-stage", trigger, agent.name, ctx.id, len(record.nodes))
    return data, outbox


# -- normal mode ----------------------------------------------------------------------
class _Join:
    """Completes ``future`` once ``n`` requests are answered: with the merged
    blocked-worker sets, or the first error."""

    def __init__(self, n: int, own: set[int], agent: Agent) -> None:
        self.future = RpcFuture(agent._io_ident)
        self.left, self.blocked, self.error = n, set(own), None
        self._lock = threading.Lock()

    def done(self, value: Any, error: BaseException | None) -> None:
        with self._lock:
            if error is not None and self.error is None:
                self.error = error
            elif error is None and value:
                self.blocked |= value
            self.left -= 1
            last = self.left == 0
        if last:
            if self.error is not None:
                self.future.set_exception(self.error)
            else:
                self.future.set_result(self.blocked)


def _send_all(agent: Agent, ctx: AutogradContext, pass_id: tuple[int, int],
              outbox: list[Outgoing], retain_graph: bool, blocked: set[int]) -> Any:
    """Send the stage's gradients; the answer once all their subtrees are done."""
    if not outbox:
        return blocked
    join = _Join(len(outbox), blocked, agent)
    for out in outbox:
        try:
            agent.request(out.peer, Grads(ctx.id, pass_id, out.msg_id, out.grads, retain_graph),
                          then=join.done)
        except BaseException as e:
            join.done(None, e)
    return Deferred(join.future)


def handle_grads(msg: Grads, sender: int) -> Any:
    agent = _agent()
    ctx = contexts_of(agent).get(msg.ctx_id)
    lp = ctx.new_pass(agent.name, msg.pass_id, msg.retain_graph)
    origin = sender if msg.origin is None else msg.origin
    trigger = f"grads for send #{msg.msg_id & 0xFFFF} from {agent._peer_name(origin)}"
    data, outbox = run_stage(agent, ctx, lp, trigger, lambda p: p.receive(msg.msg_id, msg.grads))
    if msg.step:
        return data, [(o.peer, o.msg_id, o.grads) for o in outbox]
    return _send_all(agent, ctx, msg.pass_id, outbox, msg.retain_graph,
                     {agent.rank} if data["blocked"] else set())


def handle_flush(msg: Flush, sender: int) -> Any:
    agent = _agent()
    ctx = contexts_of(agent).get(msg.ctx_id)
    lp = ctx.passes.get(msg.pass_id)
    if lp is None or not lp.blocked():
        return None if msg.step else set()
    data, outbox = run_stage(agent, ctx, lp, "flush", lambda p: None)
    if msg.step:
        return data, [(o.peer, o.msg_id, o.grads) for o in outbox]
    return _send_all(agent, ctx, msg.pass_id, outbox, msg.retain_graph,
                     {agent.rank} if data["blocked"] else set())


def handle_abort(msg: Abort, sender: int) -> None:
    agent = _agent()
    contexts = contexts_of(agent)
    ctx = contexts.contexts.get(msg.ctx_id)
    if ctx is None:
        return
    lp = ctx.passes.get(msg.pass_id)
    if lp is not None and not lp.failed:
        lp.failed = msg.reason
    told = msg.told | ctx.known | {agent.rank}
    for rank in sorted(ctx.known - msg.told - {agent.rank}):
        if rank in agent._members:
            contexts.tell(rank, Abort(msg.ctx_id, msg.pass_id, msg.reason, told))


def run_backward(agent: Agent, ctx_id: int, roots: Any, retain_graph: bool = False) -> None:
    """The distributed backward pass from this worker's ``roots`` (normal mode)."""
    roots = check_roots(roots)
    contexts = contexts_of(agent)
    ctx = contexts.get(ctx_id)
    pass_id = (agent.rank, next(_pass_ids))
    lp = ctx.new_pass(agent.name, pass_id, retain_graph, roots=roots)
    _, outbox = run_stage(agent, ctx, lp, "roots", lambda p: p.start())
    blocked = {agent.rank} if lp.blocked() else set()
    try:
        answer = _send_all(agent, ctx, pass_id, outbox, retain_graph, blocked)
        blocked = _wait(answer)
        for _ in range(MAX_FLUSH_ROUNDS):  # bounded: each round runs blocked nodes
            if not blocked:
                break
            flushed: set[int] = set()
            for rank in sorted(blocked):
                if rank == agent.rank:
                    _, out = run_stage(agent, ctx, lp, "flush", lambda p: None)
                    flushed |= _wait(_send_all(agent, ctx, pass_id, out, retain_graph,
                                               {rank} if lp.blocked() else set()))
                else:
                    flushed |= agent.request(rank, Flush(ctx_id, pass_id, retain_graph)).wait()
            blocked = flushed
        else:
            log.warning("distributed backward of context %d: nodes still blocked on %s after "
                        "%d flush rounds", ctx_id, sorted(blocked), MAX_FLUSH_ROUNDS)
    except BaseException as e:
        lp.failed = lp.failed or f"{type(e).__name__}: {e}"
        abort_everywhere(agent, ctx, pass_id, lp.failed)
        if hasattr(e, "add_note"):
            e.add_note(f"(in the distributed backward pass of autograd context {ctx_id})")
        raise


def abort_everywhere(agent: Agent, ctx: AutogradContext, pass_id: tuple[int, int],
                       reason: str) -> None:
    """The pass failed: every worker that took part stops its part."""
    told = frozenset(ctx.known | {agent.rank})
    for rank in sorted(ctx.known - {agent.rank}):
        if rank in agent._members:
            contexts_of(agent).tell(rank, Abort(ctx.id, pass_id, reason, told))


def _wait(answer: Any) -> set[int]:
    """Bounded: every request in the tree has the RPC timeout; interruptible."""
    return answer.future.wait() if type(answer) is Deferred else answer


def _agent() -> Agent:
    from ..agent import current_agent
    return current_agent("distributed autograd")


# -- the distributed graph as plain data ------------------------------------------------------
def graph_data(agent: Agent, ctx: AutogradContext,
               roots: list[torch.Tensor] | None = None) -> dict[str, Any]:
    """This worker's part of the context's graph: nodes from the roots and
    every send function, the leaves (received ones marked), sends and recvs."""
    ids: dict[Any, int] = {}
    nodes: list[dict[str, Any]] = []
    recv_of = {id(t): (m, i) for m, r in ctx.recvs.items() for i, t in enumerate(r.tensors)}

    def visit(node: Any) -> int:
        todo = [node]
        while todo:
            n = todo.pop()
            if n in ids:
                continue
            ids[n] = len(nodes)
            entry: dict[str, Any] = {"id": ids[n], "name": type(n).__name__, "next": []}
            nodes.append(entry)
            var = getattr(n, "variable", None) if n.next_functions == () else None
            if var is not None:
                recv = recv_of.get(id(var))
                entry["leaf"] = ctx.leaf_name(var)
                entry["shape"] = list(var.shape)
                entry["recv"] = None if recv is None else recv[0]
            todo += [m for m, _ in n.next_functions if m is not None]
        for n in list(ids):
            nodes[ids[n]]["next"] = [ids[m] for m, _ in n.next_functions if m in ids]
        return ids[node]

    with ctx.lock:
        root_ids = [visit(edge(r)[0]) for r in roots or ()]
        sends = [{"msg_id": m, "to": agent._peer_name(s.peer),
                  "enters": [visit(edge(t)[0]) for t in s.tensors]}
                 for m, s in ctx.sends.items()]
        recvs = [{"msg_id": m, "from": agent._peer_name(r.peer),
                  "leaves": [ids.get(edge(t)[0]) if t.requires_grad else None
                             for t in r.tensors]}
                 for m, r in ctx.recvs.items()]
    return {"worker": agent.name, "rank": agent.rank, "roots": root_ids, "nodes": nodes,
            "sends": sends, "recvs": recvs, "known": sorted(ctx.known)}


def handle_graph(msg: GraphQuery, sender: int) -> dict[str, Any]:
    agent = _agent()
    return graph_data(agent, contexts_of(agent).get(msg.ctx_id))


def install(contexts: Contexts) -> None:
    handlers = contexts.agent.handlers
    handlers[Grads.op] = handle_grads
    handlers[Flush.op] = handle_flush
    handlers[Abort.op] = handle_abort
    handlers[GraphQuery.op] = handle_graph
