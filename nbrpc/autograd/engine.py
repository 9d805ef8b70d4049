"""One worker's part of a distributed backward pass: dependency counting over
its local autograd graph, and its nodes run by PyTorch's engine or one at a
time. No I/O.

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
   all of its gradients summed, however many messages brought them. A stage
   is one call of PyTorch's engine (:meth:`LocalPass._run_by_engine`) when,
   counted first (running nothing), the only nodes it leaves waiting are
   leaves with no tensor hooks: a weight that later messages' stages feed
   too (micro-batches through one layer, an RNN's steps), whose part of the
   gradient the engine captures and the leaf holds until its last stage.
   Other stages, and step mode, run the nodes one at a time (:func:`_call`).
   Both run every hook PyTorch runs (see "hooks" below). A stage for the
   engine is begun, its engine call made and the stage ended in three steps
   (:meth:`LocalPass.begin`, :meth:`~LocalPass.execute`,
   :meth:`~LocalPass.end`): the engine call owns the nodes it runs, so the
   stages that several messages start run at once, as PyTorch's engine runs
   them on the RPC threads; a leaf that two of them feed is finished by the
   last to end.
4. A leaf's gradient accumulates in the context (never in ``.grad``), after
   the leaf's tensor hooks (``leaf.register_hook``), and as PyTorch's
   ``AccumulateGrad`` stores it: the tensor itself, unless it also went to
   other edges or breaks the leaf's layout (then a copy laid out as the leaf;
   :func:`_keepable`).
5. The tensors *received* in a message of the context are the outputs of
   one ``RecvRpcBackward`` node (:class:`RecvRpc`, as in PyTorch: not leaves,
   their ``grad_fn``), where the pass ends on this worker; a received
   ``nn.Parameter`` stays a leaf (the receiver may optimize it) and ends it
   there. Once every received tensor of a message that the pass can reach has
   its gradient, they are returned in the outbox, to be sent to the worker
   that sent them (step 2 there).

A node waiting on a send function that never gets a gradient (a tensor sent
but not used in the loss) stays blocked; :meth:`LocalPass.flush` runs such
nodes with what they have, once the rest of the pass is over.

Native mode, where this process has a ``torch.distributed`` process group:
DistributedDataParallel (and other c10d libraries) hook a parameter's
``AccumulateGrad`` node in C++, where Python can neither see nor call the
hook; it reads and writes the gradient through ``.grad`` (PyTorch's own
engine hands it the context's instead). So there the ends of a stage run in
PyTorch's engine, a leaf's ``AccumulateGrad`` with every hook, on ``.grad`` set
to the leaf's gradient in the context for the stage (:meth:`LocalPass._staged`),
and a recv node's backward hands its gradients over instead of raising. DDP
then averages the context's gradients across its replicas during the pass, as
it does under PyTorch's distributed autograd.
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

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
        """The record's fields (its lists, not copies: a record is not reused;
        ``dataclasses.asdict`` deep-copied every gradient's entry, which cost
        more than running a deep graph's nodes)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


@dataclass(slots=True)
class Stage:
    """One stage from :meth:`LocalPass.begin` to :meth:`LocalPass.end`. A stage
    PyTorch's engine runs is ``pending`` in between: its roots (``edges``, with
    ``grads``) and ``captures`` are fixed, and :meth:`LocalPass.execute` makes
    the engine call, which needs no lock (other stages of the pass may begin
    and end meanwhile). ``ends``: the leaves and recv nodes it finishes;
    ``held``: the leaves it captures a part of (others' parts are still to
    come, or on their way in a running stage's engine call)."""

    record: StageRecord
    outbox: list[Outgoing] = field(default_factory=list)
    edges: tuple = ()
    grads: tuple = ()
    ends: list[Node] = field(default_factory=list)
    held: list[Node] = field(default_factory=list)
    captures: tuple = ()
    got: tuple | None = None
    pending: bool = False


RECV_NODE_NAME = "torch::distributed::autograd::RecvRpcBackward"  # PyTorch's C++ name


class RecvRpc(torch.autograd.Function):
    """The recv function of a message received in a distributed autograd
    context: its tensors become the outputs of one ``RecvRpcBackward`` node
    (as PyTorch's), so they are no leaves, in-place operations on them are
    recorded, and hooks on them run where PyTorch runs them. The node is never
    executed: a distributed backward pass stops there and sends the gradients
    back to the sender (:class:`LocalPass`); a local ``backward()`` reaching it
    fails. Use :func:`recv_tensors`."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor,
                box: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        # the tensors come in a tuple: not inputs, so the outputs are they,
        # with this node as their grad_fn (no views, no copies); ``anchor``
        # makes the node record (a Function records only with an input that
        # requires grad)
        ctx.set_materialize_grads(False)  # an output the loss does not use: None
        return box

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, None]:
        if ctx in _RECV_SINK:  # run by PyTorch's engine for a pass (native mode)
            _RECV_SINK[ctx] = grads
            return None, None
        raise RuntimeError(
            "this tensor was received over RPC inside a distributed autograd context: its "
            "gradient goes back to the worker that sent it only in a distributed backward "
            "pass. Call nbrpc.autograd.backward(context_id, [loss]) (as "
            "torch.distributed.autograd.backward) instead of loss.backward() or "
            "torch.autograd.grad(); or .detach() the tensor to use it locally.")


RecvRpcBackward = RecvRpc._backward_cls
# recv nodes a pass has PyTorch's engine run (native mode): node -> the
# gradients its backward got (None until it runs); any other run raises
_RECV_SINK: dict[Node, tuple | None] = {}
# As PyTorch's C++ node shows itself to Python: ``name()`` (its type, and so
# the ``grad_fn=<RecvRpcBackward>`` of a tensor's repr, keeps the short name),
# and no ``next_functions`` (graph walkers never see the anchor; torch's own
# engine follows the C++ edges, and this one stops at the node: next_edges)
RecvRpcBackward.name = lambda self: RECV_NODE_NAME
RecvRpcBackward.next_functions = property(lambda self: ())
_ANCHOR = torch.empty(0, requires_grad=True)  # the recv nodes' one input (never reached)


def gets_recv_node(t: torch.Tensor) -> bool:
    """Whether ``t``, received in a context's message and requiring grad, is
    to be a recv node's output: not a Parameter (it stays a leaf), nor made in
    inference mode (no autograd there)."""
    return (t.requires_grad and not isinstance(t, torch.nn.Parameter)
            and not torch.is_inference_mode_enabled())


def recv_tensors(ts: list[torch.Tensor]) -> Node:
    """Make ``ts`` (received in one message, none requiring grad) the outputs
    of one recv node, in place: the same tensor objects, ``ts[i]`` its output
    ``i``. Returns the node.

    >>> a, b = torch.ones(2), torch.zeros(3)
    >>> node = recv_tensors([a, b])
    >>> node.name(), a.grad_fn is b.grad_fn is node, (a.output_nr, b.output_nr), a.is_leaf
    ('torch::distributed::autograd::RecvRpcBackward', True, (0, 1), False)
    """
    with torch.enable_grad():  # recorded whatever the receiving thread's mode
        out = RecvRpc.apply(_ANCHOR, tuple(ts))
    return out[0].grad_fn


def end_point(end: GradientEdge | torch.Tensor) -> tuple[Node, int] | None:
    """Where a received tensor's gradient arrives: ``end`` is its recv node's
    input (a ``GradientEdge``), or the tensor itself (a leaf: its
    ``AccumulateGrad``; None if it does not require grad)."""
    if isinstance(end, torch.Tensor) and not end.requires_grad:
        return None
    return edge(end)


def gradient_edge(t: torch.Tensor) -> GradientEdge:
    """Where a gradient for ``t`` enters the graph now. A leaf's is found
    through autograd, so inference mode is set aside (it would record nothing).

    >>> x = torch.ones(2, requires_grad=True)
    >>> with torch.inference_mode():
    ...     gradient_edge(x).node.name()
    'torch::autograd::AccumulateGrad'
    """
    with torch.inference_mode(False):
        if t.layout is torch.strided:
            return get_gradient_edge(t)
        # sparse: no views, which get_gradient_edge makes; a clone's node
        # leads to the same edge, and keeps the graph behind it alive as
        # get_gradient_edge's view does (a Python node does not own it)
        with torch.enable_grad():
            keeper = t.clone().grad_fn
        node, nr = keeper.next_functions[0]
        return GradientEdge(node, nr, ownership_token=keeper)


def edge(x: torch.Tensor | GradientEdge) -> tuple[Node, int]:
    """Where a gradient enters the graph, as (node, input number): a tensor's
    now, or a ``GradientEdge`` taken earlier (a sent tensor's, as it was sent)."""
    e = gradient_edge(x) if isinstance(x, torch.Tensor) else x
    return e[0], e[1]


def norm(g: torch.Tensor | None) -> float | None:
    """A gradient's 2-norm, for the records (a sparse one's: of its values).

    >>> norm(torch.tensor([3.0, 4.0])), norm(torch.tensor([[0.0, 3.0], [4.0, 0.0]]).to_sparse())
    (5.0, 5.0)
    """
    if g is None:
        return None
    g = g.detach()
    if g.layout is torch.sparse_coo:
        g = g.coalesce().values()  # (an index given twice: its values add up)
    elif g.layout is not torch.strided:
        g = g.values()
    return float(torch.linalg.vector_norm(g.double()))


class LocalPass:
    """The state of one backward pass on one worker.

    ``sends``: ``{msg_id: tensors}`` of the context's send functions (each a
    tensor, or the ``GradientEdge`` it had when it was sent); ``recvs``:
    ``{msg_id: (peer, ends)}``, where the gradient of each tensor received in
    the message arrives: its recv node's input (a ``GradientEdge``), or the
    tensor (a leaf, or one that does not require grad); ``accumulate(leaf,
    grad)`` adds a leaf's
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

    def __init__(self, worker: str, sends: dict[int, list[torch.Tensor | GradientEdge]],
                 recvs: dict[int, tuple[int, list[GradientEdge | torch.Tensor]]],
                 accumulate: Callable[[torch.Tensor, torch.Tensor], None],
                 roots: list[torch.Tensor] | None = None, retain_graph: bool = False,
                 names: Callable[[torch.Tensor], str] | None = None,
                 norms: bool = True, by_engine: bool | None = None,
                 grads: dict[torch.Tensor, torch.Tensor] | None = None,
                 native: bool | None = None) -> None:
        self.worker, self.retain_graph = worker, retain_graph
        # native mode (see "Native mode" in the module docstring): leaves'
        # AccumulateGrad nodes run in PyTorch's engine, on .grad set to the
        # context's gradient (``grads``) for the stage; by default where this
        # process has a torch.distributed process group (DDP's hooks)
        if native is None:
            native = grads is not None and c10d_active()
        elif native and grads is None:
            raise ValueError("native mode keeps the context's gradients: pass grads=")
        self._native, self._grads = native, grads
        # gradient norms in the records (step mode); a norm of a large gradient
        # costs as much as a small matmul, so normal mode leaves them out
        self._norm = norm if norms else (lambda g: None)
        # a closed stage runs in PyTorch's engine (_run_by_engine), unless
        # by_engine is False; step mode (norms) runs nodes one at a time, to
        # report each
        self._by_engine = (not norms) if by_engine is None else by_engine
        self._accumulate = accumulate
        self._name = names or (lambda t: f"leaf{tuple(t.shape)}")
        self._sends = {m: [edge(t) for t in ts] for m, ts in sends.items()}
        # where each sent tensor lives: its gradient is used there
        self._send_devices = {m: [n._input_metadata[nr].device for n, nr in es]
                              for m, es in self._sends.items()}
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
            for nxt, _ in next_edges(todo.pop()):
                if nxt is None:
                    continue
                self.deps[nxt] = self.deps.get(nxt, 0) + 1
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        # where received tensors the pass can reach end it here (their recv
        # node's inputs, a received Parameter's AccumulateGrad):
        # {node: [(input number, msg_id, index in the message)]}
        self._recv_of: dict[Node, list[tuple[int, int, int]]] = {}
        self._recv_out: dict[int, list] = {}  # msg_id -> grads so far
        self._recv_left: dict[int, int] = {}  # msg_id -> reachable tensors not done
        self._recv_peer: dict[int, int] = {}
        for m, (peer, ends) in recvs.items():
            reach = [(i, p) for i, end in enumerate(ends)
                     for p in (end_point(end),) if p is not None and p[0] in seen]
            if reach:
                self._recv_peer[m] = peer
                self._recv_out[m] = [None] * len(ends)
                self._recv_left[m] = len(reach)
                for i, (node, nr) in reach:
                    self._recv_of.setdefault(node, []).append((nr, m, i))
        # native mode: every leaf's AccumulateGrad the pass can reach (a received
        # Parameter's too), staged for each stage; those a stage ran
        self._leaf_nodes = [n for n in seen if _is_leaf(n)] if native else []
        self._touched: list[Node] = []
        self._buffers: dict[Node, dict[int, torch.Tensor | None]] = {}
        self._ready: list[tuple[int, int, Node]] = []
        self._tie = itertools.count()
        self._received: set[int] = set()
        self._shared: set[int] = set()  # ids of gradients a node gave to several edges
        self._sums: set[tuple[Node, int]] = set()  # buffers holding a sum made here
        # leaves captured by stages whose engine calls run now (how many), and
        # those stages: a stage that runs nodes one at a time waits for none
        self._inflight: Counter[Node] = Counter()
        self.running = 0
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
        self._hold(node, nr, g)
        left = self.deps[node] - 1
        self.deps[node] = left
        if left == 0:
            self._push(node)

    def _hold(self, node: Node, nr: int, g: torch.Tensor | None) -> None:
        """Add ``g`` to the gradients ``node`` holds for its input ``nr``: the
        first sum is a new tensor, which later ones add to in place (as
        PyTorch's input buffers do: a weight that 8 micro-batches feed would
        otherwise get 7 new tensors of its size)."""
        buf = self._buffers.get(node)
        if buf is None:
            buf = self._buffers[node] = {}
        old = buf.get(nr)
        if g is None:
            buf.setdefault(nr, None)
        elif old is None:
            buf[nr] = g
            self._sums.discard((node, nr))
        elif (node, nr) in self._sums and _adds_in_place(old, g):
            old.add_(g)
        else:
            buf[nr] = old + g  # (a tensor of this pass's own)
            self._sums.add((node, nr))

    def _push(self, node: Node) -> None:
        heapq.heappush(self._ready, (self._order(node), next(self._tie), node))

    @staticmethod
    def _order(node: Node) -> int:
        """PyTorch's order: the node created last runs first (a recv node,
        made before every node that used its tensor, after them)."""
        return -node._sequence_nr()

    # -- 3. one stage --------------------------------------------------------------
    def run(self, trigger: str = "roots") -> tuple[StageRecord, list[Outgoing]]:
        """One stage: run every node that is ready, and what becomes ready.
        Returns its record and the gradients to send to other workers."""
        stage = self.begin(trigger)
        if stage is None:
            raise BackwardError("a stage that runs its nodes one at a time waits for the "
                                "pass's running stages: use begin(), execute() and end()")
        try:
            self.execute(stage)
        except BaseException:
            self.abandon(stage)
            raise
        return self.end(stage)

    def begin(self, trigger: str = "roots") -> Stage | None:
        """Start a stage (the caller serializes :meth:`begin`, :meth:`end` and
        the rest). A stage that PyTorch's engine can run is left pending: run
        its :meth:`execute` (no lock needed), then :meth:`end`. Any other stage
        runs here, whole, but only once no stage is pending; until then this
        returns None and changes nothing (wait for an :meth:`end`, and ask
        again). Native mode runs every stage here."""
        plan = self._engine_stage() if self._by_engine else None
        if plan is None and self.running:
            return None
        stage = Stage(StageRecord(self.worker, trigger))
        self.stages += 1
        if plan is not None and not self._native:
            self._prepare(stage, *plan)
            stage.pending = True
            self.running += 1
            return stage
        with self._staged(stage.record):
            if plan is not None:
                self._run_by_engine(*plan, stage.record, stage.outbox)
            else:
                self._drain_nodes(stage.record, stage.outbox)
        return stage

    def execute(self, stage: Stage) -> None:
        """A pending stage's engine call (nothing for another stage): the nodes
        it runs belong to it alone, so it needs no lock. (Its hooks run here,
        on the calling thread.)"""
        if stage.edges and stage.captures:
            stage.got = _ENGINE.run_backward(stage.edges, stage.grads, self.retain_graph,
                                             False, stage.captures, True, False)

    def end(self, stage: Stage) -> tuple[StageRecord, list[Outgoing]]:
        """Finish a stage: what it captured goes to its leaves, recv nodes and
        held leaves. Returns its record and the gradients to send."""
        if stage.pending:
            stage.pending = False
            self.running -= 1
            self._finish(stage)
        return self._close(stage.record, stage.outbox)

    def abandon(self, stage: Stage) -> None:
        """A pending stage whose engine call failed: forget what it held."""
        if stage.pending:
            stage.pending = False
            self.running -= 1
            for node in stage.held:
                self._inflight[node] -= 1
            self._inflight = +self._inflight

    def flush(self) -> tuple[StageRecord, list[Outgoing]]:
        """The pass is over elsewhere: run blocked nodes with what they have
        (a send function they wait for will never get a gradient)."""
        stage = self.begin_flush()
        if stage is None:
            raise BackwardError("a flush waits for the pass's running stages")
        return self.end(stage)

    def begin_flush(self) -> Stage | None:
        """The flush as a stage, run here (see :meth:`flush`); None while a
        stage is pending (as :meth:`begin`)."""
        if self.running:
            return None
        stage = Stage(StageRecord(self.worker, "flush"))
        record, outbox = stage.record, stage.outbox
        self.stages += 1
        with self._staged(record):
            for _ in range(len(self.deps) + 1):  # bounded: each round runs >= 1 node
                waiting = [n for n in self._buffers if self.deps.get(n, 0) > 0]
                if not waiting:
                    break
                node = max(waiting, key=lambda n: n._sequence_nr())  # upstream first
                self.deps[node] = 0
                self._push(node)
                self._drain(record, outbox)
        return stage

    @contextlib.contextmanager
    def _staged(self, record: StageRecord) -> Iterator[None]:
        """Native mode: for the stage, each leaf's ``.grad`` is its gradient in
        the context (a received Parameter's: None), so that its
        ``AccumulateGrad`` adds to that and hooks reading ``.grad`` (DDP's)
        read and write that; afterwards the context takes what ``.grad`` holds
        and the leaf gets its own back. Every leaf of the pass, not only those
        the stage reaches: DDP averages all of a module's gradients in the
        stage where the last arrives, writing the others' too. One stage (or
        DistributedOptimizer step) at a time per process (``GRAD_STAGING``):
        two contexts' passes may share leaves."""
        if not self._native:
            yield
            return
        grads = self._grads
        with GRAD_STAGING:
            own: list[tuple[Node, torch.Tensor | None]] = []  # (node, the leaf's .grad)
            try:
                for node in self._leaf_nodes:
                    leaf = node.variable
                    mine = leaf.grad
                    leaf.grad = None if node in self._recv_of else grads.get(leaf)
                    own.append((node, mine))
                yield
            finally:
                for node, mine in own:
                    leaf = node.variable
                    g = leaf.grad
                    leaf.grad = mine
                    if g is not None and node not in self._recv_of:
                        grads[leaf] = g
                touched, self._touched = self._touched, []
                for node in dict.fromkeys(touched):
                    g = grads.get(node.variable)
                    if g is not None:
                        record.gradients.append({"leaf": self._name(node.variable),
                                                 "shape": list(node.variable.shape),
                                                 "norm": self._norm(g)})

    def _drain(self, record: StageRecord, outbox: list[Outgoing]) -> None:
        if self._by_engine:
            plan = self._engine_stage()
            if plan is not None:
                self._run_by_engine(*plan, record, outbox)
                return
        self._drain_nodes(record, outbox)

    @torch.no_grad()  # as PyTorch's engine without create_graph
    def _drain_nodes(self, record: StageRecord, outbox: list[Outgoing]) -> None:
        """Run the ready nodes one at a time, and what becomes ready."""
        while self._ready:
            node = heapq.heappop(self._ready)[2]
            buf = self._buffers.pop(node, {})
            record.nodes.append(type(node).__name__)
            if _is_end(node):
                if self._native:
                    slots = sorted(nr for nr, g in buf.items() if g is not None)
                    buf = self._run_native([GradientEdge(node, nr) for nr in slots],
                                           [buf[nr] for nr in slots], [node])[node]
                self._end(node, buf, record, outbox, hooked=self._native)
                continue
            given = _call(node, buf, self.retain_graph)
            ids = [id(g) for g in given if g is not None]
            if len(ids) > 1 and len(set(ids)) < len(ids):  # one tensor to several edges: a leaf copies it
                self._shared.update(i for i in ids if ids.count(i) > 1)
            for (nxt, nr), g in zip(node.next_functions, given):
                if nxt is not None:
                    self._give(nxt, nr, g)
        self._shared.clear()  # (ids of freed tensors may be reused)

    def _engine_stage(self) -> tuple[list[Node], list[Node]] | None:
        """What this stage runs, in order, and the leaves it leaves waiting
        (fed by this stage and by others still to come), if PyTorch's engine
        can run it: every node left waiting is a leaf without tensor hooks
        (the engine would run those on a part of the leaf's gradient). Else
        None. Counts only: runs nothing."""
        deps, left_of = self.deps, {}
        ready, order = list(self._ready), []
        while ready:
            node = heapq.heappop(ready)[2]
            order.append(node)
            for nxt, _ in next_edges(node):
                if nxt is None:
                    continue
                left = left_of.get(nxt, deps[nxt]) - 1
                left_of[nxt] = left
                if left == 0:
                    heapq.heappush(ready, (self._order(nxt), next(self._tie), nxt))
        waiting = [n for n, left in left_of.items() if left > 0]
        if waiting and (self._native or not all(map(_capturable, waiting))):
            return None
        deps.update(left_of)
        self._ready.clear()
        return order, waiting

    @torch.no_grad()  # as PyTorch's engine without create_graph
    def _run_by_engine(self, order: list[Node], waiting: list[Node], record: StageRecord,
                       outbox: list[Outgoing]) -> None:
        """A stage in one call of PyTorch's engine, here and now (see
        :meth:`_prepare`)."""
        stage = Stage(record, outbox)
        self._prepare(stage, order, waiting)
        if self._native:
            if stage.ends and stage.edges:
                bufs = self._run_native(list(stage.edges), list(stage.grads), stage.ends)
                for node in stage.ends:
                    self._end(node, bufs[node], record, outbox, hooked=True)
            return
        self.execute(stage)
        self._finish(stage)

    def _prepare(self, stage: Stage, order: list[Node], waiting: list[Node]) -> None:
        """A stage for PyTorch's engine: the gradients held for the stage's
        nodes (its entries, and what earlier stages gave them) are its roots,
        the leaves and recv nodes it reaches are captured (after their tensor
        hooks, which the engine runs), and every node on the way runs with its
        hooks, as in PyTorch's own backward. ``waiting``: leaves this stage
        feeds that wait for other stages too; what this stage gives them is
        captured and held (a later stage passes it to the engine as a root,
        where the engine adds it to the rest). So is what it gives a leaf
        whose other parts a running stage captures: the last to end finishes
        that leaf (:meth:`_finish`)."""
        edges, grads = [], []
        for node in order:
            _check_not_released(node)
            stage.record.nodes.append(type(node).__name__)
            for nr, g in self._buffers.pop(node, {}).items():
                if g is not None:
                    edges.append(GradientEdge(node, nr))
                    grads.append(g)
            if _is_end(node):
                (stage.held if self._inflight[node] else stage.ends).append(node)
        stage.held += waiting
        self._inflight.update(stage.held)
        stage.edges, stage.grads = tuple(edges), tuple(grads)
        stage.captures = tuple(GradientEdge(n, nr) for n in stage.ends + stage.held
                               for nr in range(len(n._input_metadata)))

    @torch.no_grad()  # as PyTorch's engine without create_graph
    def _finish(self, stage: Stage) -> None:
        """What a stage's engine call captured: its ends get their gradients,
        its held leaves add their part (a leaf whose every part is in then
        gets the sum)."""
        record, outbox = stage.record, stage.outbox
        got = stage.got if stage.got is not None else (None,) * len(stage.captures)
        counts = Counter(id(g) for g in got if g is not None)
        self._shared.update(i for i, n in counts.items() if n > 1)  # a leaf copies those
        at = 0
        for node in stage.ends:
            n = len(node._input_metadata)
            self._end(node, dict(enumerate(got[at:at + n])), record, outbox, hooked=True)
            at += n
        for node, g in zip(stage.held, got[at:]):  # (a leaf has one input; a leaf
            self._hold(node, 0, g)                  # that shares g stores a copy)
            self._inflight[node] -= 1
            if not self._inflight[node]:
                del self._inflight[node]
                if not self.deps[node]:  # every part is in (no tensor hooks to run)
                    self._end(node, self._buffers.pop(node, {}), record, outbox)
        self._shared.clear()

    def _run_native(self, edges: list[GradientEdge], grads: list[torch.Tensor],
                    ends: list[Node]) -> dict[Node, dict[int, torch.Tensor | None]]:
        """Native mode: PyTorch's engine runs from ``edges`` (with ``grads``) to
        ``ends``, and runs them as in a local ``backward()``: a leaf's
        ``AccumulateGrad`` adds to its staged ``.grad`` with every hook of the
        leaf and of the node (C++ ones: DDP's), a recv node's backward hands
        its gradients over (``_RECV_SINK``), after its hooks. Returns, per end,
        the gradients the pass takes on from it: a recv node's, a received
        Parameter's (its ``.grad``, reset), none for a leaf of this worker (the
        context takes its ``.grad`` at the end of the stage)."""
        recvs = [n for n in ends if type(n) is RecvRpcBackward]
        for n in recvs:
            _RECV_SINK[n] = None
        try:
            if edges:
                inputs = tuple(GradientEdge(n, nr) for n in ends
                               for nr in range(len(n._input_metadata)))
                _ENGINE.run_backward(tuple(edges), tuple(grads), self.retain_graph, False,
                                     inputs, True, True)
        finally:
            got = {n: _RECV_SINK.pop(n, None) for n in recvs}
        bufs: dict[Node, dict[int, torch.Tensor | None]] = {}
        for n in ends:
            if n in got:
                bufs[n] = dict(enumerate(got[n] or ()))
            elif n in self._recv_of:  # a received Parameter: back to its sender
                leaf = n.variable
                bufs[n], leaf.grad = {0: leaf.grad}, None
            else:
                bufs[n] = {}
        return bufs

    def _close(self, record: StageRecord,
               outbox: list[Outgoing]) -> tuple[StageRecord, list[Outgoing]]:
        for out in outbox:
            record.sent.append({"to": out.peer, "msg_id": out.msg_id,
                                "norms": [self._norm(g) for g in out.grads]})
        record.blocked = self.blocked()
        return record, outbox

    def _end(self, node: Node, buf: dict[int, torch.Tensor | None], record: StageRecord,
             outbox: list[Outgoing], hooked: bool = False) -> None:
        """Where the pass ends on this worker, a leaf's ``AccumulateGrad`` or a
        recv node, gets its gradients ``buf`` (by input; their tensor hooks
        already run if ``hooked``)."""
        points = self._recv_of.get(node)
        is_recv = type(node) is RecvRpcBackward
        if points is None and is_recv:
            raise BackwardError(
                f"a tensor {self.worker!r} received over RPC in another distributed "
                "autograd context (or in one since released) is part of this graph: its "
                "gradient can only go back in the context it arrived in. Compute the loss "
                "from tensors of one context, or .detach() the tensor.")
        if points is None:  # 4. a leaf of this worker: into the context
            self._leaf(node, buf.get(0), record, hooked)
            return
        # 5. received tensors: their hooks, as PyTorch's engine runs them on
        # RecvRpcBackward (a received Parameter's: its tensor hooks), then the
        # gradients go back with those of the message's other tensors
        grads = [buf.get(nr) for nr in range(len(node._input_metadata))]
        if not hooked and any(g is not None for g in grads):
            grads = (_tensor_pre_hooks(node, grads) if is_recv
                     else [_leaf_hooks(node.variable, grads[0])])
        pre, post = _hook_tables(node) if is_recv and not self._native else ({}, {})
        if pre:
            grads = list(_run_hooks(pre, tuple(grads)))
        for nr, m, i in points:
            self._recv_out[m][i] = grads[nr]
            self._recv_left[m] -= 1
            if self._recv_left[m] == 0:  # the recv function fires: back to its sender
                outbox.append(Outgoing(self._recv_peer[m], m, self._recv_out.pop(m)))
        if post:  # (RecvRpcBackward returns no gradients)
            _run_hooks(post, (), tuple(grads))

    def _leaf(self, node: Node, g: torch.Tensor | None, record: StageRecord,
              hooked: bool) -> None:
        """As PyTorch's DistAccumulateGradCaptureHook: the leaf's tensor hooks
        (unless ``hooked``), the node's pre-hooks, the gradient into the
        context, its post hooks (called with no outputs and the gradient, even
        an undefined one). Native mode: the node ran in PyTorch's engine, all
        of that done; the context takes the result at the end of the stage."""
        if self._native:
            self._touched.append(node)
            return
        leaf = node.variable
        if g is not None and not hooked:
            g = _leaf_hooks(leaf, g)
        pre, post = _hook_tables(node)
        if pre:
            (g,) = _run_hooks(pre, (g,))
        if g is not None:
            g = _keepable(g, leaf, id(g) in self._shared)
            self._accumulate(leaf, g)
            record.gradients.append({"leaf": self._name(leaf),
                                     "shape": list(leaf.shape), "norm": self._norm(g)})
        if post:
            _run_hooks(post, (), (g,))

    def blocked(self) -> int:
        """Nodes holding gradients but still waiting for others."""
        return sum(1 for n in self._buffers if self.deps.get(n, 0) > 0)


def _call(node: Node, buf: dict[int, Any], retain_graph: bool) -> list:
    """Run one autograd node on its input buffer as PyTorch's engine does
    (``call_function``): the hooks of the tensors it is the ``grad_fn`` of,
    its pre-hooks, the node, its outputs fitted to the next nodes' inputs,
    its post hooks. Returns one gradient per next edge (None where no
    gradient flows or the edge leads nowhere)."""
    _check_not_released(node)
    grads = [buf.get(i) for i in range(len(node._input_metadata))]
    edges = node.next_functions
    if all(g is None for g in grads):
        return [None] * len(edges)  # nothing flows: skip the work
    grads = _tensor_pre_hooks(node, grads)
    pre, post = _hook_tables(node)
    if pre:
        grads = _run_hooks(pre, tuple(grads))
    if isinstance(node, BackwardCFunction):  # a torch.autograd.Function in Python
        out = _call_python_function(node, grads)
    else:
        out = node(*grads)
        if not isinstance(out, (tuple, list)):  # a node with one edge returns it bare
            out = (out,)
    if not retain_graph:
        node.metadata["nbrpc_released"] = True
    out = [_fit(g, nxt, nr) if g is not None and nxt is not None else None
           for (nxt, nr), g in zip(edges, out)]
    if post:
        out = _run_hooks(post, tuple(out), tuple(grads))
    return [g if nxt is not None else None for (nxt, _), g in zip(edges, out)]


def _is_leaf(node: Node) -> bool:
    """An ``AccumulateGrad`` node: where a leaf's gradient arrives."""
    return node.next_functions == () and hasattr(node, "variable")


def _adds_in_place(total: torch.Tensor, g: torch.Tensor) -> bool:
    """Whether ``g`` can be added into ``total`` (a dense sum made by the pass)
    in place with the same result as ``total + g``."""
    return (total.layout == torch.strided and g.shape == total.shape
            and g.dtype == total.dtype and g.device == total.device)


def _capturable(node: Node) -> bool:
    """A node a stage run by the engine may leave waiting: a leaf whose tensor
    has no hooks (the engine runs a captured node's tensor hooks)."""
    return _is_leaf(node) and not node.variable._backward_hooks


def _is_end(node: Node) -> bool:
    """Where a pass ends on this worker: a leaf, or a received tensor's recv node."""
    return type(node) is RecvRpcBackward or _is_leaf(node)


def next_edges(node: Node) -> tuple:
    """The edges a pass follows out of ``node``: none out of a recv node (its
    gradient leaves this worker)."""
    return () if type(node) is RecvRpcBackward else node.next_functions


def _leaf_hooks(leaf: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A leaf's tensor hooks (``leaf.register_hook``) on its gradient ``g``."""
    for hook in list((leaf._backward_hooks or {}).values()):
        changed = hook(g)  # a tensor hook returns a new gradient or None
        if changed is not None:
            g = changed
    return g


def _check_not_released(node: Node) -> None:
    """A node run one at a time keeps its saved tensors (Python cannot free
    them), so a second pass without ``retain_graph`` is refused here."""
    if node.metadata.get("nbrpc_released"):
        raise BackwardError(
            f"Trying to backward through the graph a second time ({node.name()} already "
            "ran in a distributed backward pass with retain_graph=False). Specify "
            "retain_graph=True on the first backward to run it again.")


# -- hooks ------------------------------------------------------------------------------
# PyTorch runs a node's hooks in its C++ engine. Python can neither list them
# nor have that engine run just one node, so for a node run one at a time two
# ways in remain, each exact:
# * A node's pre-hooks and post hooks sit in two ordered dicts that every later
#   registration on the node shares: registering a no-op returns a handle to
#   the dict, and the no-op is removed at once (PyTorch keeps an empty dict on
#   the node then, as after any removed hook). Read once per node, cached in
#   ``node.metadata``.
# * The hooks of the tensors a node is the ``grad_fn`` of (``t.register_hook``,
#   ``t.retain_grad()``) are run by PyTorch's engine asked for the gradients
#   flowing into the node itself: it runs exactly those hooks on them and
#   executes nothing (``_tensor_pre_hooks``).
_HOOKS = "nbrpc_hooks"
_ENGINE = torch.autograd.Variable._execution_engine
_PROBING = threading.Lock()
# Who sets leaves' .grad to a context's gradients for a while (a native-mode
# stage, LocalPass._staged; DistributedOptimizer's step): one at a time per process
GRAD_STAGING = threading.RLock()


def c10d_active() -> bool:
    """Whether this process has a ``torch.distributed`` process group, so that
    libraries built on it (DDP) may have put C++ hooks on leaves' nodes.

    >>> c10d_active()
    False
    """
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def _noop(*args: Any) -> None:
    return None


def _hook_tables(node: Node) -> tuple[dict, dict]:
    """``node``'s pre-hooks and post hooks: PyTorch's own dicts (live)."""
    tables = node.metadata.get(_HOOKS)
    if tables is not None:
        return tables
    with _PROBING:  # (two passes may share a leaf: one dict per node)
        tables = node.metadata.get(_HOOKS)
        if tables is not None:
            return tables
        handle = node.register_prehook(_noop)
        pre = handle.hooks_dict_ref()
        handle.remove()
        handle = node.register_hook(_noop)
        post = handle.hooks_dict_ref()
        handle.remove()
        tables = node.metadata[_HOOKS] = (pre, post)
    return tables


def _tensor_pre_hooks(node: Node, grads: list) -> list:
    """``grads`` for ``node``'s inputs after the hooks of the tensors it made
    (and their ``retain_grad``), run by PyTorch's engine, which captures the
    gradients at the node's own inputs and so executes no node."""
    slots = [i for i, g in enumerate(grads) if g is not None]  # (the rest: None)
    edges = tuple(GradientEdge(node, i) for i in slots)
    hooked = _ENGINE.run_backward(edges, tuple(grads[i] for i in slots), True, False,
                                  edges, True, False)
    out = [None] * len(grads)
    for i, g in zip(slots, hooked):
        out[i] = g
    return out


def _run_hooks(table: dict, grads: tuple, *rest: tuple) -> tuple:
    """Call each hook of ``table`` on ``(grads, *rest)`` as PyTorch's
    ``_call_hooks``, and return ``grads`` as the hooks left them: a hook
    returns None or a replacement, a tuple of the same length whose entries
    keep each gradient's dtype, device and shape."""
    for hook in list(table.values()):
        res = hook(grads, *rest)
        if res is None or res is grads:
            continue
        _check_hook_result(grads, res, hook)
        grads = tuple(res)
    return grads


def _check_hook_result(prev: tuple, res: Any, hook: Any) -> None:
    """PyTorch's checks of a hook's replacement gradients, with its messages.

    >>> _check_hook_result((torch.ones(2),), (torch.ones(3),), print)
    Traceback (most recent call last):
    ...
    RuntimeError: hook 'print' has changed the size of value
    """
    name = getattr(hook, "__name__", type(hook).__name__)
    if not isinstance(res, tuple):
        raise TypeError(f"expected tuple, but hook returned '{type(res).__name__}'")
    if len(res) != len(prev):
        raise RuntimeError(f"hook '{name}' has returned an incorrect number of values "
                           f"(got {len(res)}, but expected {len(prev)})")
    for old, new in zip(prev, res):
        if new is None:
            continue
        if old is None:
            raise RuntimeError("can't replace a None gradient with a non-None value")
        if not isinstance(new, torch.Tensor):
            raise TypeError(f"expected Variable, but hook returned '{type(new).__name__}'")
        if new.dtype != old.dtype or new.layout != old.layout:
            raise RuntimeError(f"hook '{name}' has changed the type of value (was "
                               f"{old.type()} got {new.type()})")
        if new.device != old.device:
            raise RuntimeError(f"hook '{name}' has changed the type of value (was "
                               f"{old.device} got {new.device})")
        if new.shape != old.shape:
            raise RuntimeError(f"hook '{name}' has changed the size of value")


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
    if t.is_contiguous():  # (the common case, without a Python loop over dims)
        return True
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
    if g.shape == leaf.shape and g.is_contiguous() and leaf.is_contiguous():
        return True  # (the strides of dims of size > 1 follow from the shape)
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


def _call_python_function(node: Any, grads: list) -> tuple:
    """A Python autograd.Function's backward: zeros for missing gradients (its
    default), one result per forward argument mapped onto the tensor edges."""
    filled = []
    for i, g in enumerate(grads):
        if g is None:
            meta = node._input_metadata[i]
            g = torch.zeros(meta.shape, dtype=meta.dtype, device=meta.device)
        filled.append(g)
    out = node.apply(*filled)
    out = out if isinstance(out, tuple) else (out,)
    wanted = iter(g for g, need in zip(out, node.needs_input_grad) if need)
    return tuple(next(wanted, None) if nxt is not None else None
                 for nxt, _ in node.next_functions)


def total_norm(grads: Iterable[torch.Tensor | None]) -> float:
    """Euclidean norm over several gradients (None counts as zero)."""
    return math.sqrt(sum((norm(g) or 0.0) ** 2 for g in grads))
