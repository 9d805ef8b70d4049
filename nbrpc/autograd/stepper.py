"""Step mode: a distributed backward pass run one stage at a time from here.

The stepper holds the gradients that normal mode would send between workers
as *pending stages*; each :meth:`BackwardStepper.step` delivers one of them
(or the roots), runs that worker's stage, and queues what the stage sends.
The stages, and the final gradients, are those of normal mode.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any

from .. import views
from ..agent import Agent, current_agent
from .backward import (
    _pass_ids,
    abort_everywhere,
    check_context_id,
    check_roots,
    graph_data,
    run_stage,
)
from .context import contexts_of
from .messages import Flush, Grads, GraphQuery

log = logging.getLogger(__name__)

MAX_FLUSH_ROUNDS = 16


@dataclass(frozen=True, slots=True)
class _Stage:
    rank: int
    kind: str  # "roots", "grads" or "flush"
    msg_id: int | None = None
    grads: list | None = None
    sender: int | None = None


class BackwardStepper:
    """A distributed backward pass that runs when told, one stage at a time.

    >>> import torch, nbrpc.autograd as dist_autograd
    >>> from nbrpc.rpc.api import init_rpc, rpc_sync, shutdown, _free_port_options
    >>> init_rpc("a", rank=0, world_size=1, rpc_backend_options=_free_port_options())
    >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
    >>> with dist_autograd.context() as ctx:
    ...     y = rpc_sync("a", torch.mul, args=(x, 3.0))  # "a" calls itself
    ...     stepper = dist_autograd.backward_stepper(ctx, [y.sum()])
    ...     print([s["trigger"] for s in stepper.pending])
    ...     print(stepper.step()["nodes"])
    ...     records = stepper.run()
    ...     print(dist_autograd.get_gradients(ctx)[x])
    ['roots']
    ['SumBackward0', 'RecvRpcBackward']
    tensor([3., 3.])
    >>> shutdown()
    """

    def __init__(self, agent: Agent, ctx_id: int, roots: Any,
                 retain_graph: bool = False) -> None:
        self._agent = agent
        self._ctx = contexts_of(agent).get(check_context_id(ctx_id, "backward_stepper"))
        self.roots = check_roots(roots, self._ctx.received)
        self.context_id, self.retain_graph = ctx_id, retain_graph
        self.pass_id = (agent.rank, next(_pass_ids))
        self._lp = self._ctx.new_pass(agent.name, self.pass_id, retain_graph, roots=self.roots,
                                      norms=True)
        self._queue: deque[_Stage] = deque([_Stage(agent.rank, "roots")])
        self._blocked: set[int] = set()
        self._flush_rounds = 0
        self.records: list[dict[str, Any]] = []
        self.failed: BaseException | None = None

    @property
    def pending(self) -> list[dict[str, Any]]:
        """The stages ready to run, in the order ``step()`` takes them."""
        return [{"worker": self._agent.peer_name(s.rank), "trigger": self._trigger(s)}
                for s in self._queue]

    @property
    def done(self) -> bool:
        return not self._queue

    def step(self) -> dict[str, Any]:
        """Run exactly one stage; returns its record: ``worker``, ``trigger``,
        ``nodes`` executed, leaf ``gradients`` (with norms), gradients ``sent``
        onward (with norms), nodes still ``blocked``."""
        if self.failed is not None:
            raise RuntimeError(f"this backward pass failed ({self.failed}); start a new one")
        if not self._queue:
            raise RuntimeError("nothing left to run: the backward pass is done (see .done)")
        stage = self._queue.popleft()
        try:
            data, outbox = self._run(stage)
        except BaseException as e:
            self.failed = e
            self._queue.clear()
            abort_everywhere(self._agent, self._ctx, self.pass_id, f"{type(e).__name__}: {e}")
            raise
        self.records.append(data)
        for peer, msg_id, grads in outbox:
            self._queue.append(_Stage(peer, "grads", msg_id, grads, stage.rank))
        if data["blocked"]:
            self._blocked.add(stage.rank)
        else:
            self._blocked.discard(stage.rank)
        if not self._queue and self._blocked and self._flush_rounds < MAX_FLUSH_ROUNDS:
            self._flush_rounds += 1  # nothing else can reach them: run what they hold
            self._queue.extend(_Stage(r, "flush") for r in sorted(self._blocked))
            self._blocked.clear()
        return data

    def run(self, max_stages: int = 100_000) -> list[dict[str, Any]]:
        """Run the remaining stages (at most ``max_stages``); returns their records."""
        out = []
        for _ in range(max_stages):
            if self.done:
                break
            out.append(self.step())
        return out

    def _run(self, stage: _Stage) -> tuple[dict[str, Any], list]:
        agent = self._agent
        if stage.rank == agent.rank:
            def feed(p: Any) -> None:
                if stage.kind == "roots":
                    p.start()
                elif stage.kind == "grads":
                    p.receive(stage.msg_id, stage.grads)
            data, outbox = run_stage(agent, self._ctx, self._lp, self._trigger(stage), feed)
            return data, [(o.peer, o.msg_id, o.grads) for o in outbox]
        if stage.kind == "flush":
            msg: Any = Flush(self.context_id, self.pass_id, self.retain_graph, step=True)
            answer = agent.request(stage.rank, msg).wait()
            if answer is None:
                return {"worker": agent.peer_name(stage.rank), "trigger": "flush",
                        "nodes": [], "gradients": [], "sent": [], "blocked": 0}, []
            return answer
        msg = Grads(self.context_id, self.pass_id, stage.msg_id, stage.grads,
                    self.retain_graph, step=True, origin=stage.sender)
        return agent.request(stage.rank, msg).wait()

    def _trigger(self, s: _Stage) -> str:
        if s.kind != "grads":
            return s.kind
        return f"grads for send #{s.msg_id & 0xFFFF} from {self._agent.peer_name(s.sender)}"

    def reset(self) -> None:
        """Start the same backward pass over: clear the context's gradients on
        every worker that took part, forget the stages run, queue the roots.
        Needs ``retain_graph=True`` (a pass without it frees the graph)."""
        if not self.retain_graph:
            raise RuntimeError("reset() needs a stepper made with retain_graph=True: without "
                               "it, the stages that ran have freed their part of the graph")
        agent = self._agent
        for data in self._workers().values():  # the gradients of earlier passes go
            if data["rank"] == agent.rank:
                _clear_gradients(self._ctx)
            else:
                agent.rpc_async(data["rank"], _clear_gradients_here, (self.context_id,)).wait()
        self._ctx.passes.pop(self.pass_id, None)
        self.pass_id = (agent.rank, next(_pass_ids))
        self._lp = self._ctx.new_pass(agent.name, self.pass_id, True, roots=self.roots,
                                      norms=True)
        self._queue = deque([_Stage(agent.rank, "roots")])
        self._blocked.clear()
        self._flush_rounds = 0
        self.records = []
        self.failed = None

    def gradient_of(self, leaf: Any) -> Any:
        """The context's gradient of ``leaf``: a tensor of this worker, or an RRef
        to a tensor on its owner (as ``DistributedOptimizer`` takes them); None
        if it has none (yet)."""
        if hasattr(leaf, "owner_name") and not leaf.is_owner():
            return self._agent.rpc_async(leaf.owner_name(), _gradient_here,
                                         (self.context_id, leaf)).wait()
        if hasattr(leaf, "owner_name"):
            leaf = leaf.local_value()
        with self._ctx.lock:
            return self._ctx.grads.get(leaf)

    def _workers(self) -> dict[str, dict[str, Any]]:
        """Each worker's part of the graph, found breadth first from this one."""
        agent = self._agent
        workers: dict[str, dict[str, Any]] = {}
        todo, seen = [agent.rank], {agent.rank}
        for _ in range(len(agent.members) + 1):  # breadth first over known workers
            if not todo:
                break
            nxt = []
            for rank in todo:
                if rank == agent.rank:
                    data = graph_data(agent, self._ctx, self.roots)
                else:
                    try:
                        data = agent.request(rank, GraphQuery(self.context_id)).wait()
                    except Exception as e:
                        log.info("no graph from rank %d: %s", rank, e)
                        continue
                workers[data["worker"]] = data
                nxt += [r for r in data["known"] if r not in seen and r in agent.members]
                seen.update(data["known"])
            todo = nxt
        return workers

    def graph(self) -> dict[str, Any]:
        """The distributed graph as plain data: per worker its autograd nodes
        (``MmBackward0``, ...), leaves (received ones marked with their message),
        sends and recvs; ``links``: send → recv pairs by autograd message id."""
        workers = self._workers()
        recv_at = {r["msg_id"]: (w, r) for w, d in workers.items() for r in d["recvs"]}
        links = []
        for w, d in workers.items():
            for s in d["sends"]:
                dest = recv_at.get(s["msg_id"])
                links.append({"msg_id": s["msg_id"], "from": w, "to": s["to"],
                              "send_enters": s["enters"],
                              "recv_leaves": dest[1]["leaves"] if dest else None})
        return {"context_id": self.context_id, "workers": workers, "links": links,
                "current": self.pending[0] if self._queue else None}

    def widget(self, **options: Any) -> Any:
        """The stepper as a widget: the distributed graph, Step / Run / Reset, the
        stage that just ran highlighted, gradient norms. Needs the notebook packages."""
        return views.make("stepper", self, **options)

    def __repr__(self) -> str:
        state = "done" if self.done else f"{len(self._queue)} stage(s) pending"
        return (f"<BackwardStepper context={self.context_id} {len(self.records)} stage(s) "
                f"run, {state}>")


def _clear_gradients(ctx: Any) -> None:
    with ctx.lock:
        ctx.grads.clear()


def _clear_gradients_here(ctx_id: int) -> None:
    """Runs on a worker of the pass (``reset``)."""
    _clear_gradients(contexts_of(current_agent("BackwardStepper.reset")).get(ctx_id))


def _gradient_here(ctx_id: int, rref: Any) -> Any:
    """Runs on the owner of ``rref`` (``gradient_of``)."""
    ctx = contexts_of(current_agent("BackwardStepper.gradient_of")).get(ctx_id)
    with ctx.lock:
        return ctx.grads.get(rref.local_value())
