"""Distributed autograd contexts of one agent, and how tensors are recorded.

A context id is unique in the group: the creating worker's rank in the high
16 bits. While a thread is inside ``context()``, every request it sends
carries the id (the agent's :class:`~nbrpc.agent.Propagator`), and the callee
runs the handler inside the same id, so nested calls carry it further.

Recording happens while messages are pickled: a tensor that requires grad,
pickled for a message that carries a context id (a request sent inside the
context, or the reply to one), is added to a *send function* of that
message on the sender; the receiver adds the rebuilt tensor, made the
output of a ``RecvRpcBackward`` node of its graph (as in PyTorch; a
Parameter stays a leaf), to the *recv function* with the same autograd
message id. Both
belong to the context with that id on their worker. A message never sent
(or that the receiver could not read) takes its send function back.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import random
import threading
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.graph import GradientEdge, Node

from ..agent import Agent, MessageContext, Propagator
from ..errors import WorkerGoneError
from .engine import LocalPass, StageRecord, gets_recv_node, gradient_edge, norm, recv_tensors
from .messages import Release

log = logging.getLogger(__name__)

RANK_SHIFT = 48  # context and message ids: rank << 48 | counter
MAX_STAGE_RECORDS = 256
MAX_TOMBSTONES = 65_536
_WAITING = "autograd_recv"  # (a message's stash) its tensors that wait for a recv node

_thread = threading.local()  # .active: (registry, context id) of this thread, or None


@dataclass
class SendFn:
    """Tensors this worker sent in message ``msg_id`` to ``peer``, requiring
    grad: the message's ``SendRpcBackward``, as PyTorch's context lists it
    (``ctx._send_functions()``): its ``next_functions`` are where the
    gradients that come back for the tensors enter this worker's graph.

    >>> w = torch.ones(2, requires_grad=True)
    >>> send = SendFn(peer=1, tensors=[w], edges=[gradient_edge(w)])
    >>> send.name(), [(n.name(), nr) for n, nr in send.next_functions]
    ('torch::distributed::autograd::SendRpcBackward', [('torch::autograd::AccumulateGrad', 0)])
    """

    peer: int
    tensors: list[torch.Tensor] = field(default_factory=list)
    # where each one's gradient enters this graph, taken as it was sent (an
    # in-place operation on the tensor later moves its grad_fn)
    edges: list[GradientEdge] = field(default_factory=list)

    def name(self) -> str:
        return "torch::distributed::autograd::SendRpcBackward"  # PyTorch's C++ name

    @property
    def next_functions(self) -> tuple[tuple[Node, int], ...]:
        """``(node, input_nr)`` per tensor, in message order (a node's
        ``next_functions``). The pass runs from these edges (the record is
        not itself a node of torch's graph, as PyTorch's is)."""
        return tuple((e.node, e.output_nr) for e in self.edges)


@dataclass
class RecvFn:
    """Tensors received in message ``msg_id`` from ``peer``: the outputs of its
    recv node in this graph (a Parameter: a leaf)."""

    peer: int
    tensors: list[torch.Tensor] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)  # each one's device at its sender
    # where each one's gradient arrives: its recv node's input (kept: an
    # in-place operation on the tensor moves its grad_fn), or the tensor itself
    # (a Parameter: a leaf; one that does not require grad)
    ends: list[GradientEdge | torch.Tensor] = field(default_factory=list)

    def node(self) -> Node | None:
        """The message's ``RecvRpcBackward`` node; None if it has none (its
        tensors are Parameters, or the message is still being read)."""
        return next((e.node for e in self.ends if isinstance(e, GradientEdge)), None)


class AutogradContext:
    """One distributed autograd context on one worker."""

    def __init__(self, ctx_id: int) -> None:
        self.id = ctx_id
        self.creator = ctx_id >> RANK_SHIFT
        self.sends: dict[int, SendFn] = {}
        self.recvs: dict[int, RecvFn] = {}
        self.grads: dict[torch.Tensor, torch.Tensor] = {}
        self.known: set[int] = set()  # workers it exchanged tensors or gradients with
        self.passes: dict[tuple[int, int], LocalPass] = {}
        self.stages: deque[dict[str, Any]] = deque(maxlen=MAX_STAGE_RECORDS)
        # stages begin and end one at a time per context and worker; their
        # engine calls run unlocked, and a stage that runs its nodes one at a
        # time waits (``idle``) until no engine call runs
        self.lock = threading.RLock()
        self.idle = threading.Condition(self.lock)
        self.leaf_names: dict[int, str] = {}  # id(tensor) -> a name for the records
        self.running: LocalPass | None = None  # the pass whose stage runs here now

    # -- as PyTorch's DistAutogradContext (its private inspection methods) -----------------
    def _context_id(self) -> int:
        """This context's id."""
        return self.id

    def _send_functions(self) -> dict[int, SendFn]:
        """``{autograd message id: send function}`` of the messages this
        worker sent in the context with tensors that require grad, in order."""
        with self.lock:
            return dict(self.sends)

    def _recv_functions(self) -> dict[int, Node]:
        """``{autograd message id: RecvRpcBackward node}`` of the messages this
        worker received in the context with tensors that require grad (a
        message of Parameters only has none: they stay leaves)."""
        with self.lock:
            nodes = {m: r.node() for m, r in self.recvs.items()}
        return {m: n for m, n in nodes.items() if n is not None}

    def _known_worker_ids(self) -> set[int]:
        """The ranks this worker sent to or received from in the context."""
        with self.lock:
            return set(self.known)

    def accumulate(self, leaf: torch.Tensor, g: torch.Tensor) -> None:
        old = self.grads.get(leaf)
        self.grads[leaf] = g if old is None else old + g

    def new_pass(self, worker: str, pass_id: tuple[int, int], retain_graph: bool,
                 roots: list[torch.Tensor] | None = None, norms: bool = False) -> LocalPass:
        """The pass ``pass_id`` on this worker (made on its first gradient)."""
        lp = self.passes.get(pass_id)
        if lp is None:
            lp = self.passes[pass_id] = LocalPass(
                worker, {m: s.edges for m, s in self.sends.items()},
                {m: (r.peer, r.ends) for m, r in self.recvs.items()}, self.accumulate,
                roots=roots, retain_graph=retain_graph, names=self.leaf_name, norms=norms,
                grads=self.grads)
        return lp

    def received(self, t: torch.Tensor) -> bool:
        """``t`` arrived here in a message of this context."""
        with self.lock:
            return any(x is t for r in self.recvs.values() for x in r.tensors)

    def leaf_name(self, t: torch.Tensor) -> str:
        return self.leaf_names.get(id(t)) or f"leaf{list(t.shape)}"

    def add_stage(self, record: StageRecord) -> dict[str, Any]:
        data = record.as_dict()
        self.stages.append(data)
        return data

    def snapshot(self, names: Any) -> dict[str, Any]:
        with self.lock:
            return {
                "id": self.id,
                "creator": names(self.creator),
                "known_workers": sorted(names(r) for r in self.known),
                "sends": [{"msg_id": m, "to": names(s.peer),
                           "shapes": [list(t.shape) for t in s.tensors]}
                          for m, s in self.sends.items()],
                "recvs": [{"msg_id": m, "from": names(r.peer),
                           "shapes": [list(t.shape) for t in r.tensors]}
                          for m, r in self.recvs.items()],
                "gradients": [{"leaf": self.leaf_name(t), "shape": list(t.shape),
                               "norm": norm(g)} for t, g in self.grads.items()],
                "passes": len(self.passes),
                "blocked": sum(p.blocked() for p in self.passes.values()),
                "stages": list(self.stages),
            }


class Contexts(Propagator):
    """The autograd contexts of one agent (``agent.ext["autograd"]``)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.contexts: dict[int, AutogradContext] = {}
        self._released: set[int] = set()
        self._released_order: deque[int] = deque()
        self._lock = threading.Lock()
        start = random.getrandbits(40)  # a restarted rank does not reuse ids
        self._ids = itertools.count(start)
        self.waiters: dict[tuple[int, int], Any] = {}  # passes started here, running

    def new_id(self) -> int:
        return (self.agent.rank << RANK_SHIFT) | (next(self._ids) & ((1 << RANK_SHIFT) - 1))

    # -- the calling thread's context (Propagator) -------------------------------------
    def current(self) -> int | None:
        active = getattr(_thread, "active", None)
        return active[1] if active is not None and active[0] is self else None

    def sent(self, ctx_id: int, peer: int) -> None:
        ctx = self.contexts.get(ctx_id)
        if ctx is not None and peer != self.agent.rank:
            ctx.known.add(peer)  # it runs the call inside the context: release it there

    @contextlib.contextmanager
    def enter(self, ctx_id: int) -> Iterator[None]:
        """Run the body inside ``ctx_id`` (a handler of a request sent in it)."""
        prev = getattr(_thread, "active", None)
        self.get_or_create(ctx_id)
        _thread.active = (self, ctx_id)
        try:
            yield
        finally:
            _thread.active = prev

    @contextlib.contextmanager
    def context(self) -> Iterator[int]:
        ctx = self.new_context()
        try:
            yield ctx.id
        finally:
            _thread.active = None
            self.release(ctx.id)  # (one released inside the block already: nothing to do)

    def new_context(self) -> AutogradContext:
        """A new context, made the calling thread's until :meth:`release_context`."""
        if getattr(_thread, "active", None) is not None:
            raise RuntimeError(
                "Already have an autograd context id for this thread (id "
                f"{_thread.active[1]}): distributed autograd contexts cannot be nested. "
                "Leave the current `with nbrpc.autograd.context()` block first.")
        ctx = AutogradContext(self.new_id())
        with self._lock:
            self.contexts[ctx.id] = ctx
        _thread.active = (self, ctx.id)
        return ctx

    def release_context(self, ctx_id: int) -> None:
        """Release ``ctx_id`` here and on the workers it knows; the calling
        thread leaves it if it is the thread's."""
        active = getattr(_thread, "active", None)
        if active is not None and active[0] is self and active[1] == ctx_id:
            _thread.active = None
        self.get(ctx_id)  # (unknown: the error says so)
        self.release(ctx_id)

    def current_context(self) -> AutogradContext:
        """The calling thread's context (a handler's: the request's)."""
        ctx_id = self.current()
        if ctx_id is None:
            raise RuntimeError(
                "Current thread doesn't have a valid autograd context. Please wrap your "
                "code using: `with torch.distributed.autograd.context() as context_id` "
                "to generate a valid context (in nbrpc: `with "
                "nbrpc.autograd.context() as context_id:`).")
        return self.get(ctx_id)

    def max_id(self) -> int:
        """The largest id this worker can give a context or message."""
        return (self.agent.rank << RANK_SHIFT) | ((1 << RANK_SHIFT) - 1)

    def debug_info(self) -> dict[str, int]:
        """PyTorch's two counters: backward passes in progress here (started
        here and running, or with a stage running here now) and contexts."""
        contexts = list(self.contexts.values())
        running = set(self.waiters)
        for ctx in contexts:
            lp = ctx.running
            running.update(p for p, q in list(ctx.passes.items()) if q is lp or q.running)
        return {"num_current_backward_passes": len(running),
                "num_autograd_contexts": len(contexts)}

    # -- the table ---------------------------------------------------------------------
    def get(self, ctx_id: int) -> AutogradContext:
        ctx = self.contexts.get(ctx_id)
        if ctx is None:
            released = " (it was released)" if ctx_id in self._released else ""
            raise RuntimeError(
                f"Could not find autograd context with id: {ctx_id} on "
                f"{self.agent.name!r}{released}. Use the id yielded by "
                "`with nbrpc.autograd.context() as context_id:` inside that block.")
        return ctx

    def get_or_create(self, ctx_id: int) -> AutogradContext | None:
        """The context ``ctx_id``; None if it was released here already (a late message)."""
        ctx = self.contexts.get(ctx_id)
        if ctx is not None:
            return ctx
        with self._lock:
            if ctx_id in self._released:
                return None
            ctx = self.contexts.get(ctx_id)
            if ctx is None:
                ctx = self.contexts[ctx_id] = AutogradContext(ctx_id)
                self.agent.events.add("autograd-context", "", self.agent.name, ctx_id, 0)
            return ctx

    def drop(self, ctx_id: int) -> AutogradContext | None:
        """Forget ``ctx_id`` here (and remember that it is gone)."""
        with self._lock:
            ctx = self.contexts.pop(ctx_id, None)
            if ctx_id not in self._released:
                self._released.add(ctx_id)
                self._released_order.append(ctx_id)
                if len(self._released_order) > MAX_TOMBSTONES:
                    self._released.discard(self._released_order.popleft())
        return ctx

    # -- recording (called while messages are pickled) ---------------------------------------
    def on_send(self, t: torch.Tensor, wire: MessageContext) -> tuple | None:
        ctx = self.get_or_create(wire.tag)
        if ctx is None:
            return None
        stash = wire.stash if wire.stash is not None else {}
        wire.stash = stash
        msg_id = stash.get("autograd_msg")
        if msg_id is None:  # the message's first tensor: a new send function
            msg_id = stash["autograd_msg"] = self.new_id()
            with ctx.lock:
                ctx.sends[msg_id] = SendFn(wire.peer)
                ctx.known.add(wire.peer)
            wire.on_unsent(lambda: self._unsend(ctx, msg_id))
        send = ctx.sends[msg_id]
        send.tensors.append(t)
        send.edges.append(gradient_edge(t))
        if t.device.type == "cpu":
            return wire.tag, msg_id
        return wire.tag, msg_id, str(t.device)  # its gradient comes back there

    def _unsend(self, ctx: AutogradContext, msg_id: int) -> None:
        with ctx.lock:
            ctx.sends.pop(msg_id, None)

    def on_recv(self, t: torch.Tensor, token: tuple, wire: MessageContext) -> torch.Tensor:
        """``t``, received in a message of a context, recorded in the recv
        function of that message. A tensor that will be an output of the
        message's recv node is returned detached, and the node is made once
        the whole message is read (:meth:`on_loaded`)."""
        ctx_id, msg_id = token[0], token[1]
        origin = token[2] if len(token) > 2 else "cpu"
        ctx = self.get_or_create(ctx_id)
        if ctx is None:
            return t
        waits = gets_recv_node(t)
        if waits:
            t = t.detach()
        with ctx.lock:
            recv = ctx.recvs.get(msg_id)
            if recv is None:
                recv = ctx.recvs[msg_id] = RecvFn(wire.peer)
                ctx.known.add(wire.peer)
            i = len(recv.tensors)
            ctx.leaf_names[id(t)] = f"recv#{msg_id & 0xFFFF}[{i}]"
            recv.tensors.append(t)
            recv.origins.append(origin)
            recv.ends.append(t)  # (a tensor waiting for its node: no gradient yet)
        if waits:
            stash = wire.stash if wire.stash is not None else {}
            wire.stash = stash
            stash.setdefault(_WAITING, []).append((ctx, msg_id, i, t))
        return t

    @staticmethod
    def on_loaded(wire: MessageContext) -> None:
        """The message is read: its tensors that wait become the outputs of
        its recv node (one per message and context, as PyTorch's)."""
        waiting = wire.stash.pop(_WAITING, None) if wire.stash else None
        if not waiting:
            return
        groups: dict[tuple[int, int], list] = {}
        for ctx, msg_id, i, t in waiting:
            groups.setdefault((id(ctx), msg_id), []).append((ctx, msg_id, i, t))
        for items in groups.values():
            node = recv_tensors([t for *_, t in items])
            ctx, msg_id = items[0][0], items[0][1]
            with ctx.lock:
                recv = ctx.recvs.get(msg_id)
                if recv is None:  # (released meanwhile)
                    continue
                for nr, (_, _, i, _) in enumerate(items):
                    recv.ends[i] = GradientEdge(node, nr)

    # -- release -----------------------------------------------------------------------------
    def release(self, ctx_id: int, told: frozenset[int] = frozenset()) -> None:
        """Drop the context here and tell the workers it knows (they tell theirs).
        If one of them is gone, everyone is told: it may have known others."""
        ctx = self.drop(ctx_id)
        if ctx is None:
            return
        agent = self.agent
        members = set(agent.member_ranks()) - {agent.rank}
        targets = (ctx.known - told - {agent.rank}) & members
        if any(r not in members for r in ctx.known - {agent.rank}):
            targets = members - told
        told = told | targets | {agent.rank}
        for rank in sorted(targets):
            self.tell(rank, Release(ctx_id, told))
        agent.events.add("autograd-released", "", agent.name, ctx_id, 0)
        del ctx  # its tensors (and graphs) go here, on this thread

    def _spread_release(self, msg: Release) -> None:
        """A Release found its worker dead: it may have known others, so tell all."""
        agent = self.agent
        everyone = set(agent.member_ranks()) - {agent.rank}
        told = frozenset(msg.told | everyone)
        for rank in sorted(everyone - msg.told):
            self.tell(rank, Release(msg.ctx_id, told))

    def tell(self, rank: int, msg: Any) -> None:
        """A fire-and-forget request (counted by the shutdown drain)."""
        def done(_value: Any, error: BaseException | None) -> None:
            if error is not None:
                log.debug("%s to rank %d failed: %s", type(msg).__name__, rank, error)
                if type(msg) is Release and isinstance(error, WorkerGoneError):
                    self._spread_release(msg)
        try:
            self.agent.request(rank, msg, then=done)
        except Exception as e:  # the peer went meanwhile
            log.debug("%s to rank %d not sent: %s", type(msg).__name__, rank, e)

    def handle_release(self, msg: Release, sender: int) -> None:
        self.release(msg.ctx_id, msg.told)

    def on_member_gone(self, rank: int) -> None:
        """Contexts made by a worker that died or left can never be released by it;
        a backward pass it took part in cannot finish."""
        why = self.agent.gone_why(rank) or "left the group"
        for waiter in list(self.waiters.values()):
            if rank in waiter.known:
                waiter.give_back(0, rank, False, WorkerGoneError(self.agent.peer_name(rank), why))
        for ctx_id in [c for c in list(self.contexts) if c >> RANK_SHIFT == rank]:
            self.agent.pool.submit(self.release, ctx_id, frozenset({rank}))

    # -- observability ------------------------------------------------------------------------
    def snapshot(self) -> list[dict[str, Any]]:
        return [ctx.snapshot(self.agent.peer_name) for ctx in list(self.contexts.values())]


def contexts_of(agent: Agent) -> Contexts:
    return agent.ext["autograd"]
