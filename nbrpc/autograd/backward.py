"""Running a distributed backward pass: freely, or one stage at a time.

Normal mode (:func:`run_backward`), for ``backward(ctx, [loss])`` on A::

    A: stage "roots" ──Grads(#7, credit 1)──▶ B: stage "send #7"
    A: stage "send #6" ◀──answer: Back(#6, credit 1)──╯
       sends nothing: credit 1 is back, backward returns

Termination by credit (no reply is waited for on the way): the pass starts
with credit 1; a stage splits the credit it got among the gradients it
sends, or returns it to the initiator when it sends none (``Credit``,
handled on the I/O thread). All of it back means every stage has run. A
stage that fails returns its credit with the error, which fails the
caller's ``backward`` with the worker and traceback; the caller then tells
every worker to abort the pass. A worker left with blocked nodes (a tensor
sent but not used in the loss) says so; those are flushed before
``backward`` returns.

Fewer messages and hand-offs than one request per gradient: a stage's
gradients for the worker whose ``Grads`` triggered it travel in the answer
to that request (:class:`Back`, each with its share of the credit), and so
does the credit it returns when that worker began the pass; the initiator's
waiting thread runs the stages that answers bring it (no pool thread in
between). The common two-worker pass (A → B → A) is two messages and two
thread hand-offs; a request per gradient would take four messages and three.
(The initiator's ``Grads`` go through the pool, not over its own channel as
``rpc_sync``'s do: measured, the channel is slower here, with PyTorch's OpenMP
threads spinning on 2 cores.)

Step mode (:class:`BackwardStepper`): the same stages, but a stage returns the
gradients it would send, and the driver delivers them, one stage per
``step()``. The messages, who sends each and what answers it: :mod:`.messages`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from fractions import Fraction
from functools import partial
from itertools import repeat
from typing import Any

import torch

from ..agent import Agent
from ..agent.pool import blocking
from ..agent.remote_errors import pack_error, rebuild_error
from ..errors import BackwardStageError, NbrpcError, RpcTimeoutError
from ..serialize import Placed
from .context import AutogradContext, Contexts, contexts_of
from .engine import LocalPass, Outgoing, Stage, edge, end_point, next_edges
from .messages import Abort, Back, Credit, Flush, Grads, GraphQuery

log = logging.getLogger(__name__)

MAX_FLUSH_ROUNDS = 16
STAGE_WAIT = 600.0  # s: the most a stage waits for the others' engine calls to end
_pass_ids = itertools.count(1)


# -- checks -------------------------------------------------------------------------
_SIGNATURE = "(context_id: int, roots: list[Tensor], retain_graph: bool = False)"


def check_context_id(context_id: Any, what: str = "backward") -> int:
    """``context_id`` as an int, or ``TypeError`` as PyTorch's binding raises it."""
    if isinstance(context_id, bool) or not isinstance(context_id, int):
        raise TypeError(
            f"{what}(): incompatible function arguments: expected {_SIGNATURE}, got "
            f"context_id={context_id!r}. Pass the id from `with nbrpc.autograd.context() as "
            "context_id:`.")
    return context_id


def check_roots(roots: Any, received: Any = None) -> list[torch.Tensor]:
    """The roots as PyTorch checks them; ``received(t)``: ``t`` arrived in this
    context (also a valid root when it is a leaf: a received Parameter).

    >>> check_roots(None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: backward(): incompatible function arguments: ... got roots=None. ...
    """
    if isinstance(roots, torch.Tensor):
        roots = [roots]
    if roots is None or isinstance(roots, (str, bytes)) or not hasattr(roots, "__iter__"):
        raise TypeError(
            f"backward(): incompatible function arguments: expected {_SIGNATURE}, got "
            f"roots={roots!r:.60}. Pass a list of scalar tensors, e.g. [loss].")
    roots = list(roots)
    if not roots:
        raise RuntimeError("No tensors provided for gradient computation: pass the "
                           "roots, e.g. backward(context_id, [loss])")
    for r in roots:
        if not isinstance(r, torch.Tensor):
            raise TypeError(
                f"backward(): incompatible function arguments: roots must be tensors, got a "
                f"{type(r).__name__}. Pass a list of scalar tensors, e.g. [loss].")
        if not r.requires_grad:
            raise RuntimeError("requires_grad not set on root: the loss does not depend on "
                               "any tensor that requires grad")
        if r.numel() != 1:
            raise RuntimeError(f"The root of shape {list(r.shape)} is not a scalar, all roots "
                               "need to be scalar: call .sum() or .mean() on it")
        if r.grad_fn is None and not (received is not None and received(r)):
            raise RuntimeError("A root does not have a valid gradient function (it is a "
                               "leaf); compute the loss from it first")
    return roots


# -- one stage on this worker ---------------------------------------------------------
def run_stage(agent: Agent, ctx: AutogradContext, lp: LocalPass, trigger: str,
              feed: Any) -> tuple[dict[str, Any], list[Outgoing]]:
    """``feed(lp)`` delivers what triggered the stage; then the stage runs.
    Its engine call (if PyTorch's engine runs it) runs without the context's
    lock, so stages of one pass that other messages start meanwhile run at
    once, as in PyTorch's engine (a pipeline's micro-batches)."""
    with ctx.lock:
        if lp.failed:
            raise RuntimeError(f"the distributed backward pass was aborted: {lp.failed}")
        outer, ctx.running = ctx.running, lp  # (debug_info; outer: a stage re-entered)
        try:
            feed(lp)
            stage = _begin(ctx, lp, trigger)
        except BaseException as e:
            lp.failed = f"{type(e).__name__} on {agent.name!r}: {e}"
            raise
        finally:
            ctx.running = outer
    if stage.pending:
        try:
            lp.execute(stage)
        except BaseException as e:
            with ctx.lock:
                lp.failed = f"{type(e).__name__} on {agent.name!r}: {e}"
                lp.abandon(stage)
                ctx.idle.notify_all()
            raise
    with ctx.lock:
        try:
            record, outbox = lp.end(stage)
        except BaseException as e:
            lp.failed = f"{type(e).__name__} on {agent.name!r}: {e}"
            raise
        finally:
            ctx.idle.notify_all()
        data = ctx.add_stage(record)
    ctx.known.update(o.peer for o in outbox)
    agent.events.add("autograd-stage", trigger, agent.name, ctx.id, len(record.nodes))
    return data, outbox


def _begin(ctx: AutogradContext, lp: LocalPass, trigger: str) -> Stage:
    """Begin a stage (``ctx.lock`` held). One that runs its nodes one at a time
    (or a flush) waits until the pass's running engine calls have ended; they
    end on their own, so the wait is bounded (``STAGE_WAIT``)."""
    deadline = time.monotonic() + STAGE_WAIT
    while True:
        stage = lp.begin_flush() if trigger == "flush" else lp.begin(trigger)
        if stage is not None:
            return stage
        left = deadline - time.monotonic()
        if left <= 0:
            raise RpcTimeoutError(f"a backward stage on this worker (waiting {STAGE_WAIT:g} s "
                                  "for the pass's running stages)", STAGE_WAIT)
        ctx.idle.wait(min(left, 1.0))


# -- normal mode ----------------------------------------------------------------------
class Waiter:
    """The initiator's view of one pass: credit returned so far (1 in all),
    workers left with blocked nodes, the first error; and the stages that
    answers brought back here, which the waiting thread runs (:meth:`post`)."""

    def __init__(self, known: set[int]) -> None:
        self.returned, self.blocked = Fraction(0), set()
        self.error: BaseException | None = None
        self.known = known  # the context's workers (a death among them fails the pass)
        self.done = threading.Event()
        self.work: deque[Callable[[], None]] = deque()
        self._wake = threading.Event()
        self._lock = threading.Lock()

    def give_back(self, credit: Fraction, rank: int, blocked: bool,
                  error: BaseException | None = None) -> None:
        with self._lock:
            self.returned += credit
            if blocked:
                self.blocked.add(rank)
            if error is not None and self.error is None:
                self.error = error
            if self.returned == 1 or self.error is not None:
                self.done.set()
                self._wake.set()

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the waiting thread (it never raises but to interrupt)."""
        self.work.append(fn)
        self._wake.set()

    def wait(self, timeout: float) -> None:
        """Run what is posted until the pass is over. Bounded, and
        interruptible (short slices)."""
        deadline = time.monotonic() + timeout
        work, wake = self.work, self._wake
        with blocking():
            while not self.done.is_set():
                if work:
                    work.popleft()()
                    continue
                if wake.wait(0.25):
                    wake.clear()
                elif time.monotonic() > deadline:
                    raise RpcTimeoutError("distributed backward pass (waiting for the "
                                          "workers' stages)", timeout)
        if self.error is not None:
            raise self.error

    def restart(self) -> None:
        with self._lock:
            self.returned, self.blocked = Fraction(0), set()
            self.done.clear()


def split(credit: Fraction, n: int) -> list[Fraction]:
    return [credit / n] * n


def give_back(agent: Agent, ctx_id: int, pass_id: tuple[int, int], credit: Fraction,
              blocked: bool, error: BaseException | None = None) -> None:
    """Return a finished part's credit to the initiator (with an error, if it failed)."""
    initiator = pass_id[0]
    if initiator == agent.rank:
        waiter = contexts_of(agent).waiters.get(pass_id)
        if waiter is not None:
            waiter.give_back(credit, agent.rank, blocked, error)
        return
    err = None if error is None else pack_error(error, agent.name)
    try:
        agent.request(initiator, Credit(ctx_id, pass_id, credit, blocked, err), inline=True)
    except Exception as e:  # the initiator is gone: nobody waits
        log.debug("credit for pass %s not returned: %s", pass_id, e)


def forward(agent: Agent, ctx: AutogradContext, pass_id: tuple[int, int],
            outbox: list[Outgoing], retain_graph: bool, credit: Fraction, blocked: bool,
            sender: int | None = None) -> Back | None:
    """Send a stage's gradients, each with a share of its credit (or return it).
    Those for ``sender`` (the worker whose message triggered the stage) are
    returned instead, to go in the answer, with the credit when ``sender`` is
    the initiator."""
    shares = split(credit, len(outbox)) if outbox else []
    outbox = [placed(ctx, o) for o in outbox]
    back = [(o.msg_id, o.grads, c) for o, c in zip(outbox, shares) if o.peer == sender]
    sends = [(o, c) for o, c in zip(outbox, shares) if o.peer != sender]
    fold = sender is not None and sender == pass_id[0]  # the answer reaches the initiator
    returned = Fraction(0) if outbox else credit
    if (returned or blocked) and not fold:  # the initiator must hear of blocked nodes
        give_back(agent, ctx.id, pass_id, returned, blocked)
    for out, share in sends:
        msg = Grads(ctx.id, pass_id, out.msg_id, out.grads, retain_graph, credit=share)
        send_part(agent, ctx, pass_id, out.peer, msg, share)
    if fold and (returned or blocked):
        return Back(tuple(back), returned, blocked)
    return Back(tuple(back)) if back else None


def placed(ctx: AutogradContext, out: Outgoing) -> Outgoing:
    """``out`` with each gradient off the CPU, or for a tensor that came from
    off a CPU, bound for that tensor's device at its sender (the forward's
    device map, inverted), whatever maps this message would follow."""
    recv = ctx.recvs.get(out.msg_id)
    grads = _bound(out.grads, recv.origins if recv is not None else repeat("cpu"))
    return out if grads is out.grads else Outgoing(out.peer, out.msg_id, grads)


def _bound(grads: list, devices: Iterable[str]) -> list:
    """``grads``, each bound for its device (as :class:`Placed`) unless it and
    its device are the CPU; ``grads`` itself where none needs binding."""
    out = [g if g is None or (d == "cpu" and g.device.type == "cpu") else Placed(g, d)
           for g, d in zip(grads, devices)]
    return grads if all(a is b for a, b in zip(out, grads)) else out


def send_part(agent: Agent, ctx: AutogradContext, pass_id: tuple[int, int], peer: int,
              msg: Grads | Flush, share: Fraction) -> None:
    """Send a part of the pass; its answer may bring a part back (:func:`take_back`)."""
    def answered(value: Any, error: BaseException | None) -> None:
        if error is not None:  # never ran there (or did not answer): the pass fails
            give_back(agent, ctx.id, pass_id, share, False, error)
        else:
            take_back(agent, ctx, pass_id, peer, msg.retain_graph, value)
    try:
        agent.request(peer, msg, then=answered)
    except BaseException as e:
        answered(None, e)


def take_back(agent: Agent, ctx: AutogradContext, pass_id: tuple[int, int], peer: int,
              retain_graph: bool, back: Back | None) -> None:
    """``peer``'s answer: its credit (this worker began the pass) and the
    stages it gave this worker, run by the waiting initiator or the pool."""
    if back is None:
        return
    waiter = contexts_of(agent).waiters.get(pass_id) if pass_id[0] == agent.rank else None
    if back.credit or back.blocked:
        if waiter is not None:
            waiter.give_back(back.credit, peer, back.blocked)
    for msg_id, grads, share in back.grads:
        msg = Grads(ctx.id, pass_id, msg_id, grads, retain_graph, credit=share)
        run = partial(_run_grads, agent, ctx, msg, peer, None)
        if waiter is not None:
            waiter.post(run)
        else:
            agent.pool.submit(run)


def _run_grads(agent: Agent, ctx: AutogradContext, msg: Grads, origin: int,
               sender: int | None) -> Any:
    """The stage for gradients from ``origin`` (a request from ``sender``, or
    an answer: ``sender`` None, nothing to answer)."""
    lp = ctx.new_pass(agent.name, msg.pass_id, msg.retain_graph, norms=msg.step)
    trigger = f"grads for send #{msg.msg_id & 0xFFFF} from {agent.peer_name(origin)}"
    return _serve_stage(agent, ctx, lp, msg, trigger,
                        lambda p: p.receive(msg.msg_id, msg.grads), sender)


def _serve_stage(agent: Agent, ctx: AutogradContext, lp: LocalPass, msg: Grads | Flush,
                 trigger: str, feed: Any, sender: int) -> Any:
    """Step mode: run the stage, answer with its record and what it would send.
    Normal mode: run it, pass the credit on (or back, with the error if it
    failed); the answer is what goes back to ``sender`` (:class:`Back`)."""
    if msg.step:  # (they go through the stepper's driver: by the CPU)
        data, outbox = run_stage(agent, ctx, lp, trigger, feed)
        return data, [(o.peer, o.msg_id, _bound(o.grads, repeat("cpu"))) for o in outbox]
    try:
        data, outbox = run_stage(agent, ctx, lp, trigger, feed)
    except BaseException as e:  # the initiator fails the pass with this error
        give_back(agent, ctx.id, msg.pass_id, msg.credit, False, e)
        return None
    return forward(agent, ctx, msg.pass_id, outbox, msg.retain_graph, msg.credit,
                   bool(data["blocked"]), sender=sender)


def handle_grads(msg: Grads, sender: int) -> Any:
    agent = _agent()
    origin = sender if msg.origin is None else msg.origin
    return _run_grads(agent, contexts_of(agent).get(msg.ctx_id), msg, origin, sender)


def handle_flush(msg: Flush, sender: int) -> Any:
    agent = _agent()
    ctx = contexts_of(agent).get(msg.ctx_id)
    lp = ctx.passes.get(msg.pass_id)
    if lp is None or not lp.blocked():
        if msg.step:
            return None
        return forward(agent, ctx, msg.pass_id, [], msg.retain_graph, msg.credit, False,
                       sender=sender)  # nothing to run: the credit goes back
    return _serve_stage(agent, ctx, lp, msg, "flush", lambda p: None, sender)


def handle_credit(msg: Credit, sender: int) -> None:
    """Inline on the initiator's I/O thread: never blocks."""
    waiter = contexts_of(_agent()).waiters.get(msg.pass_id)
    if waiter is not None:
        waiter.give_back(msg.credit, sender, msg.blocked,
                         None if msg.error is None else rebuild_error(msg.error))


def handle_abort(msg: Abort, sender: int) -> None:
    agent = _agent()
    ctx = contexts_of(agent).contexts.get(msg.ctx_id)
    if ctx is not None:
        abort_everywhere(agent, ctx, msg.pass_id, msg.reason, msg.told)


def run_backward(agent: Agent, ctx_id: int, roots: Any, retain_graph: bool = False) -> None:
    """The distributed backward pass from this worker's ``roots`` (normal mode).

    Termination by credit: the pass starts with credit 1; every stage hands
    its credit on, split among the gradients it sends, or returns it to this
    worker when it sends none. All of it back means every stage has run."""
    contexts = contexts_of(agent)
    ctx = contexts.get(check_context_id(ctx_id))
    roots = check_roots(roots, ctx.received)
    pass_id = (agent.rank, next(_pass_ids))
    lp = ctx.new_pass(agent.name, pass_id, retain_graph, roots=roots)
    waiter = contexts.waiters[pass_id] = Waiter(ctx.known)
    timeout = agent.options.rpc_timeout or 60.0
    try:
        data, outbox = run_stage(agent, ctx, lp, "roots", lambda p: p.start())
        forward(agent, ctx, pass_id, outbox, retain_graph, Fraction(1), bool(data["blocked"]))
        waiter.wait(timeout)
        for _ in range(MAX_FLUSH_ROUNDS):  # bounded: each round runs blocked nodes
            if not waiter.blocked:
                break
            blocked = sorted(waiter.blocked)
            waiter.restart()
            for rank, share in zip(blocked, split(Fraction(1), len(blocked))):
                if rank == agent.rank:
                    data, out = run_stage(agent, ctx, lp, "flush", lambda p: None)
                    forward(agent, ctx, pass_id, out, retain_graph, share,
                            bool(data["blocked"]))
                else:
                    send_part(agent, ctx, pass_id, rank,
                              Flush(ctx_id, pass_id, retain_graph, credit=share), share)
            waiter.wait(timeout)
        else:
            log.warning("distributed backward of context %d: nodes still blocked on %s after "
                        "%d flush rounds", ctx_id, sorted(waiter.blocked), MAX_FLUSH_ROUNDS)
    except BaseException as e:
        lp.failed = lp.failed or f"{type(e).__name__}: {e}"
        abort_everywhere(agent, ctx, pass_id, lp.failed)
        if isinstance(e, Exception) and not isinstance(e, NbrpcError):  # a stage raised
            worker = getattr(e, "remote_worker", None) or agent.name
            rank = agent.rank_of(worker)
            rank = agent.rank if rank is None else rank
            raise BackwardStageError(rank, worker, e, ctx_id) from e
        if hasattr(e, "add_note"):
            e.add_note(f"(in the distributed backward pass of autograd context {ctx_id})")
        raise
    finally:
        contexts.waiters.pop(pass_id, None)


def abort_everywhere(agent: Agent, ctx: AutogradContext, pass_id: tuple[int, int],
                     reason: str, told: frozenset[int] = frozenset()) -> None:
    """The pass failed: stop it here and tell the workers this one knows (they
    tell theirs; ``told``: those told already)."""
    lp = ctx.passes.get(pass_id)
    if lp is not None and not lp.failed:
        lp.failed = reason
    targets = ctx.known - told - {agent.rank}
    told = frozenset(told | ctx.known | {agent.rank})
    for rank in sorted(targets):
        if rank in agent.members:
            contexts_of(agent).tell(rank, Abort(ctx.id, pass_id, reason, told))


def _agent() -> Agent:
    from ..agent import current_agent
    return current_agent("distributed autograd")


# -- the distributed graph as plain data ------------------------------------------------------
def _device_of(node: Any) -> str:
    """The device of the gradient ``node`` takes (the first input's), or "cpu"."""
    try:
        return str(node._input_metadata[0].device)
    except (AttributeError, IndexError, RuntimeError):
        return "cpu"


def graph_data(agent: Agent, ctx: AutogradContext,
               roots: list[torch.Tensor] | None = None) -> dict[str, Any]:
    """This worker's part of the context's graph: nodes from the roots and
    every send function, the leaves and received tensors (their recv node, or
    a received Parameter's leaf, marked with the message), sends and recvs."""
    ids: dict[Any, int] = {}
    nodes: list[dict[str, Any]] = []
    recv_of: dict[Any, tuple[int, list[torch.Tensor]]] = {}  # end node -> (msg, tensors)
    for m, r in ctx.recvs.items():
        for t, end in zip(r.tensors, r.ends):
            point = end_point(end)
            if point is not None:
                recv_of.setdefault(point[0], (m, []))[1].append(t)

    def visit(node: Any) -> int:
        todo = [node]
        while todo:
            n = todo.pop()
            if n in ids:
                continue
            ids[n] = len(nodes)
            entry: dict[str, Any] = {"id": ids[n], "name": type(n).__name__, "next": []}
            device = _device_of(n)
            if device != "cpu":  # (a graph on the CPU stays as it was drawn before)
                entry["device"] = device
            nodes.append(entry)
            recv = recv_of.get(n)
            var = recv[1][0] if recv is not None else (
                getattr(n, "variable", None) if n.next_functions == () else None)
            if var is not None:
                entry["leaf"] = ctx.leaf_name(var)
                entry["shape"] = list(var.shape)
                entry["recv"] = None if recv is None else recv[0]
                if recv is not None and len(recv[1]) > 1:
                    entry["tensors"] = len(recv[1])  # (the message's; shape: the first's)
            todo += [m for m, _ in next_edges(n) if m is not None]
        for n in list(ids):
            nodes[ids[n]]["next"] = [ids[m] for m, _ in next_edges(n) if m in ids]
        return ids[node]

    with ctx.lock:
        root_ids = [visit(edge(r)[0]) for r in roots or ()]
        sends = [{"msg_id": m, "to": agent.peer_name(s.peer),
                  "enters": [visit(e.node) for e in s.edges]}
                 for m, s in ctx.sends.items()]
        recvs = [{"msg_id": m, "from": agent.peer_name(r.peer),
                  "leaves": [ids.get(p[0]) if p is not None else None
                             for p in map(end_point, r.ends)]}
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
    handlers[Credit.op] = handle_credit
    handlers[Abort.op] = handle_abort
    handlers[GraphQuery.op] = handle_graph
