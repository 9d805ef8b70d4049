"""One worker's part of a distributed backward pass: dependency counting over
its local autograd graph, and the nodes run one at a time. No I/O.

PyTorch's FAST mode, in Python. The entry points of a worker's graph are the
roots (on the worker that called ``backward``) and every *send function* of
the context: the tensors this worker sent that require grad, each expecting
the gradient its receiver computes. ::

    worker A (roots)                        worker B
    loss ─▶ SumBackward0 ─▶ recv#7 ══grads══▶ send#7 ─▶ MmBackward0 ─┬▶ W (leaf)
                                                                    └▶ recv#6
    x (leaf) ◀─ send#6 ◀═════════════════grads═══════════════════════════╛

1. When a pass first reaches a worker, count, for every node reachable from
   the roots and all send functions, how many edges lead into it
   (:meth:`LocalPass.__init__`).
2. A gradient arriving at an entry (``start`` for the roots, ``receive`` for
   a send function) is added to the input buffer of the node it enters, and
   that node's count drops by one.
3. :meth:`LocalPass.run` is one *stage*: nodes whose count is zero run, in
   PyTorch's order (latest created first), their outputs feed the nodes they
   point to, until none is ready. A node therefore runs once per pass with
   all of its gradients summed, however many messages brought them.
4. A leaf's gradient accumulates in the context (never in ``.grad``), after
   the leaf's tensor hooks (``leaf.register_hook``), and as PyTorch's
   ``AccumulateGrad`` stores it: the tensor itself, unless it also went to
   other edges or breaks the leaf's layout (then a copy laid out as the leaf;
   :func:`_keepable`). A leaf
   that was *received* belongs to a recv function: once all its leaves that
   the pass can reach have their gradients, they are returned in the outbox,
   to be sent to the worker that sent them (step 2 there).

A node waiting on a send function that never gets a gradient (a tensor sent
but not used in the loss) stays blocked; :meth:`LocalPass.flush` runs such
nodes with what they have, once the rest of the pass is over.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import Node, get_gradient_edge

GradList = list  # list[torch.Tensor | None], one per tensor of a message


class BackwardError(RuntimeError):
    """Raised by the engine for a graph it cannot run (a message says why)."""


@dataclass(slots=True)
class Outgoing:
    """Gradients for the tensors of received message ``msg_id``, to ``peer``."""

    peer: int
    msg_id: int
    grads: GradList


@dataclass
class StageRecord:
    """What one stage did, as plain data (for the stepper and the widgets)."""

    worker: str
    trigger: str  # "roots", "grads for send #<id> from <worker>", "flush"
    nodes: list[str] = field(default_factory=list)  # executed, in order
    gradients: list[dict[str, Any]] = field(default_factory=list)  # leaves: name, shape, norm
    sent: list[dict[str, Any]] = field(default_factory=list)  # to, msg_id, norms
    blocked: int = 0  # nodes still waiting for gradients after this stage

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def edge(t: torch.Tensor) -> tuple[Node, int]:
    """Where a gradient for ``t`` enters the graph: (node, input number)."""
    e = get_gradient_edge(t)
    return e.node, e.output_nr


def norm(g: torch.Tensor | None) -> float | None:
    return None if g is None else float(torch.linalg.vector_norm(g.detach().double()))


class LocalPass:
    """The state of one backward pass on one worker.

    ``sends``: ``{msg_id: tensors}`` of the context's send functions; ``recvs``:
    ``{msg_id: (peer, leaves)}``; ``accumulate(leaf, grad)`` adds a leaf's
    gradient to the context. Not thread-safe: the caller serializes calls.

    >>> w = torch.tensor([2.0, 3.0], requires_grad=True)
    >>> got = {}
    >>> p = LocalPass("me", {}, {}, lambda t, g: got.__setitem__("w", g),
    ...               roots=[(w * w).sum()])
    >>> p.start()
    >>> p.run()[0].nodes
    ['SumBackward0', 'MulBackward0', 'AccumulateGrad']
    >>> got["w"]
    tensor([4., 6.])
    """

    def __init__(self, worker: str, sends: dict[int, list[torch.Tensor]],
                 recvs: dict[int, tuple[int, list[torch.Tensor]]],
                 accumulate: Callable[[torch.Tensor, torch.Tensor], None],
                 roots: list[torch.Tensor] | None = None, retain_graph: bool = False,
                 names: Callable[[torch.Tensor], str] | None = None,
                 norms: bool = True) -> None:
        self.worker, self.retain_graph = worker, retain_graph
        # gradient norms in the records (step mode); a norm of a large gradient
        # costs as much as a small matmul, so normal mode leaves them out
        self._norm = norm if norms else (lambda g: None)
        self._accumulate = accumulate
        self._name = names or (lambda t: f"leaf{tuple(t.shape)}")
        self._sends = {m: [edge(t) for t in ts] for m, ts in sends.items()}
        # where each sent tensor lives: its gradient is used there
        self._send_devices = {m: [t.device for t in ts] for m, ts in sends.items()}
        self._root_tensors = list(roots or ())
        self._roots = [edge(r) for r in self._root_tensors]
        # 1. count the edges into every node reachable from any entry
        self.deps: dict[Node, int] = {}
        todo = [n for n, _ in self._roots]
        todo += [n for es in self._sends.values() for n, _ in es]
        for n in todo:
            self.deps[n] = self.deps.get(n, 0) + 1
        todo = list(dict.fromkeys(todo))  # each node's edges are counted once
        seen = set(todo)
        while todo:
            for nxt, _ in todo.pop().next_functions:
                if nxt is None:
                    continue
                self.deps[nxt] = self.deps.get(nxt, 0) + 1
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        # received leaves the pass can reach: {id(leaf): (msg_id, index)}
        self._recv_of: dict[int, tuple[int, int]] = {}
        self._recv_out: dict[int, list] = {}  # msg_id -> grads so far
        self._recv_left: dict[int, int] = {}  # msg_id -> reachable leaves not done
        self._recv_peer: dict[int, int] = {}
        for m, (peer, leaves) in recvs.items():
            reach = [i for i, t in enumerate(leaves) if t.requires_grad and edge(t)[0] in seen]
            if reach:
                self._recv_peer[m] = peer
                self._recv_out[m] = [None] * len(leaves)
                self._recv_left[m] = len(reach)
                for i in reach:
                    self._recv_of[id(leaves[i])] = (m, i)
        self._buffers: dict[Node, dict[int, torch.Tensor | None]] = {}
        self._ready: list[tuple[int, int, Node]] = []
        self._tie = itertools.count()
        self._received: set[int] = set()
        self._shared: set[int] = set()  # ids of gradients a node gave to several edges
        self.stages = 0
        self.failed: str | None = None

    # -- 2. gradients arriving at entries -------------------------------------------
    def start(self, root_grads: Iterable[torch.Tensor] | None = None) -> None:
        """Feed the roots (ones, or ``root_grads``)."""
        grads = list(root_grads) if root_grads is not None else None
        for i, (node, nr) in enumerate(self._roots):
            self._give(node, nr, grads[i] if grads else torch.ones_like(self._root_tensors[i]))

    def receive(self, msg_id: int, grads: GradList) -> None:
        """Gradients for the tensors of send function ``msg_id``."""
        edges = self._sends.get(msg_id)
        if edges is None:
            raise BackwardError(
                f"{self.worker!r} has no send function #{msg_id} in this context (it was "
                "released, or the message never recorded one)")
        if msg_id in self._received:
            raise BackwardError(f"send function #{msg_id} on {self.worker!r} got gradients "
                                "twice in one backward pass")
        if len(grads) != len(edges):
            raise BackwardError(f"send function #{msg_id} sent {len(edges)} tensor(s) but got "
                                f"{len(grads)} gradient(s)")
        self._received.add(msg_id)
        for (node, nr), g, device in zip(edges, grads, self._send_devices[msg_id]):
            if g is not None and g.device != device:  # (came by the CPU: the step mode)
                g = g.to(device)
            self._give(node, nr, g)

    @torch.no_grad()
    def _give(self, node: Node, nr: int, g: torch.Tensor | None) -> None:
        buf = self._buffers.get(node)
        if buf is None:
            buf = self._buffers[node] = {}
        if g is not None:
            old = buf.get(nr)
            buf[nr] = g if old is None else old + g
        else:
            buf.setdefault(nr, None)
        left = self.deps[node] - 1
        self.deps[node] = left
        if left == 0:  # PyTorch's order: the node created last runs first
            heapq.heappush(self._ready, (-node._sequence_nr(), next(self._tie), node))

    # -- 3. one stage --------------------------------------------------------------
    def run(self, trigger: str = "roots") -> tuple[StageRecord, list[Outgoing]]:
        """One stage: run every node that is ready, and what becomes ready.
        Returns its record and the gradients to send to other workers."""
        record, outbox = StageRecord(self.worker, trigger), []
        self.stages += 1
        self._drain(record, outbox)
        return self._close(record, outbox)

    def flush(self) -> tuple[StageRecord, list[Outgoing]]:
        """The pass is over elsewhere: run blocked nodes with what they have
        (a send function they wait for will never get a gradient)."""
        record, outbox = StageRecord(self.worker, "flush"), []
        self.stages += 1
        for _ in range(len(self.deps) + 1):  # bounded: each round runs >= 1 node
            waiting = [n for n in self._buffers if self.deps.get(n, 0) > 0]
            if not waiting:
                break
            node = max(waiting, key=lambda n: n._sequence_nr())  # upstream first
            self.deps[node] = 0
            heapq.heappush(self._ready, (-node._sequence_nr(), next(self._tie), node))
            self._drain(record, outbox)
        return self._close(record, outbox)

    @torch.no_grad()  # as PyTorch's engine without create_graph
    def _drain(self, record: StageRecord, outbox: list[Outgoing]) -> None:
        while self._ready:
            node = heapq.heappop(self._ready)[2]
            buf = self._buffers.pop(node, {})
            record.nodes.append(type(node).__name__)
            if node.next_functions == () and hasattr(node, "variable"):
                self._leaf(node.variable, buf.get(0), record, outbox)
                continue
            outs = _call(node, buf, self.retain_graph)
            given = [_fit(g, nxt, nr) if g is not None and nxt is not None else None
                     for (nxt, nr), g in zip(node.next_functions, outs)]
            ids = [id(g) for g in given if g is not None]
            if len(ids) > 1 and len(set(ids)) < len(ids):  # one tensor to several edges: a leaf copies it
                self._shared.update(i for i in ids if ids.count(i) > 1)
            for (nxt, nr), g in zip(node.next_functions, given):
                if nxt is not None:
                    self._give(nxt, nr, g)
        self._shared.clear()  # (ids of freed tensors may be reused)

    def _close(self, record: StageRecord,
               outbox: list[Outgoing]) -> tuple[StageRecord, list[Outgoing]]:
        for out in outbox:
            record.sent.append({"to": out.peer, "msg_id": out.msg_id,
                                "norms": [self._norm(g) for g in out.grads]})
        record.blocked = self.blocked()
        return record, outbox

    def _leaf(self, leaf: torch.Tensor, g: torch.Tensor | None, record: StageRecord,
              outbox: list[Outgoing]) -> None:
        recv = self._recv_of.get(id(leaf))
        if recv is None:  # 4. a leaf of this worker: into the context
            if g is not None:
                for hook in list((leaf._backward_hooks or {}).values()):
                    changed = hook(g)  # a tensor hook returns a new gradient or None
                    if changed is not None:
                        g = changed
                g = _keepable(g, leaf, id(g) in self._shared)
                self._accumulate(leaf, g)
                record.gradients.append({"leaf": self._name(leaf),
                                         "shape": list(leaf.shape), "norm": self._norm(g)})
            return
        m, i = recv
        self._recv_out[m][i] = g
        self._recv_left[m] -= 1
        if self._recv_left[m] == 0:  # the recv function fires: back to its sender
            outbox.append(Outgoing(self._recv_peer[m], m, self._recv_out.pop(m)))

    def blocked(self) -> int:
        """Nodes holding gradients but still waiting for others."""
        return sum(1 for n in self._buffers if self.deps.get(n, 0) > 0)


def _call(node: Node, buf: dict[int, Any], retain_graph: bool) -> tuple:
    """Run one autograd node on its input buffer; one gradient per next edge."""
    if node.metadata.get("nbrpc_released"):
        raise BackwardError(
            f"Trying to backward through the graph a second time ({node.name()} already "
            "ran in a distributed backward pass with retain_graph=False). Specify "
            "retain_graph=True on the first backward to run it again.")
    n_in = len(node._input_metadata)
    if not any(buf.get(i) is not None for i in range(n_in)):
        return (None,) * len(node.next_functions)  # nothing flows: skip the work
    if isinstance(node, BackwardCFunction):  # a torch.autograd.Function in Python
        out = _call_python_function(node, buf, n_in)
    else:
        out = node(*(buf.get(i) for i in range(n_in)))
        if not isinstance(out, (tuple, list)):  # a node with one edge returns it bare
            out = (out,)
    if not retain_graph:
        node.metadata["nbrpc_released"] = True
    return out


def _keepable(g: torch.Tensor, leaf: torch.Tensor, shared: bool) -> torch.Tensor:
    """The gradient to store for ``leaf``, as PyTorch's ``AccumulateGrad``: ``g``
    itself (no copy) unless it is ``shared`` (it also went to other edges) or
    its layout breaks the leaf's contract; then a copy, laid out as the leaf.

    >>> leaf = torch.zeros(2, 3, requires_grad=True)
    >>> g = torch.ones(2, 3)
    >>> _keepable(g, leaf, False) is g, _keepable(g, leaf, True) is g
    (True, False)
    >>> _keepable(torch.ones(3).expand(2, 3), leaf, False).stride()  # as the leaf
    (3, 1)
    """
    if g.is_sparse:
        if shared or not (g._indices().is_contiguous() and g._values().is_contiguous()):
            return g.clone()
        return g
    if g.layout != torch.strided:
        return g.clone()
    if not shared and _obeys_layout(g, leaf):
        return g
    if _dense(leaf):
        return torch.empty_strided(leaf.shape, leaf.stride(), dtype=g.dtype,
                                   device=g.device).copy_(g)
    return g.clone(memory_format=torch.contiguous_format)


def _dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: the strides of the dims of size > 1, sorted,
    are those of a contiguous layout (some permutation of the dims)."""
    expected = 1
    for stride, size in sorted((st, sz) for sz, st in zip(t.shape, t.stride()) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _obeys_layout(g: torch.Tensor, leaf: torch.Tensor) -> bool:
    """PyTorch's layout contract: ``g`` strided as a dense ``leaf`` (dims of
    size 1 aside), else contiguous."""
    if leaf.is_sparse:
        return False
    if _dense(leaf):
        return g.shape == leaf.shape and all(
            sz == 1 or gs == ls for sz, gs, ls in zip(g.shape, g.stride(), leaf.stride()))
    return g.is_contiguous()


def _fit(g: torch.Tensor, node: Node, nr: int) -> torch.Tensor:
    """As PyTorch's engine (validate_outputs): a gradient of a broadcast input
    is summed back to that input's shape, and cast to its dtype."""
    meta = node._input_metadata[nr]
    if g.shape != meta.shape:
        g = g.sum_to_size(meta.shape)
    if g.dtype != meta.dtype:
        g = g.to(meta.dtype)
    return g


def _call_python_function(node: Any, buf: dict[int, Any], n_in: int) -> tuple:
    """A Python autograd.Function's backward: zeros for missing gradients (its
    default), one result per forward argument mapped onto the tensor edges."""
    grads = []
    for i in range(n_in):
        g = buf.get(i)
        if g is None:
            meta = node._input_metadata[i]
            g = torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)
        grads.append(g)
    out = node.apply(*grads)
    out = out if isinstance(out, tuple) else (out,)
    wanted = iter(g for g, need in zip(out, node.needs_input_grad) if need)
    return tuple(next(wanted, None) if nxt is not None else None
                 for nxt, _ in node.next_functions)


def total_norm(grads: Iterable[torch.Tensor | None]) -> float:
    """Euclidean norm over several gradients (None counts as zero)."""
    return math.sqrt(sum((norm(g) or 0.0) ** 2 for g in grads))
