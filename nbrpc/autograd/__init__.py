"""Distributed autograd: the same API as ``torch.distributed.autograd``, plus
a backward pass you can run one stage at a time.

>>> import torch
>>> from nbrpc import autograd as dist_autograd
>>> from nbrpc.rpc.api import init_rpc, rpc_sync, shutdown, _free_port_options
>>> init_rpc("a", rank=0, world_size=1, rpc_backend_options=_free_port_options())
>>> w = torch.tensor([1.0, 2.0], requires_grad=True)
>>> with dist_autograd.context() as ctx:
...     y = rpc_sync("a", torch.mul, args=(w, w))
...     dist_autograd.backward(ctx, [y.sum()])
...     dist_autograd.get_gradients(ctx)[w]
tensor([2., 4.])
>>> w.grad is None  # gradients live in the context, never in .grad
True
>>> shutdown()
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from ..agent import Agent, current_agent, register_extension
from ..serialize import register_grad_hooks
from . import backward as _backward
from .context import AutogradContext, Contexts, contexts_of
from .engine import BackwardError, LocalPass, StageRecord
from .messages import Release
from .stepper import BackwardStepper

__all__ = ["AutogradContext", "BackwardError", "BackwardStepper", "LocalPass", "StageRecord",
           "backward", "backward_stepper", "context", "get_gradients", "is_available"]


def is_available() -> bool:
    """Whether distributed autograd can be used: always, with nbrpc (PyTorch's
    answers ``False`` in builds without distributed support, and code written
    for it may check before it imports the rest).

    >>> from nbrpc import autograd as dist_autograd
    >>> dist_autograd.is_available()
    True
    """
    return True


def context() -> contextlib.AbstractContextManager[int]:
    """A distributed autograd context: ``with context() as context_id:``.

    RPCs sent inside the block carry ``context_id``; tensors that require grad
    are recorded as they travel; leaving the block releases the context on
    every worker that took part. One context per thread at a time.

    >>> import torch
    >>> from nbrpc import rpc, autograd as dist_autograd
    >>> rpc.init_rpc("a", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> w = torch.tensor([3.0], requires_grad=True)
    >>> with dist_autograd.context() as ctx_id:
    ...     y = rpc.rpc_sync("a", torch.mul, args=(w, 2.0))  # recorded: a send and a recv
    ...     len(dist_autograd._current_context()._send_functions())
    2
    >>> dist_autograd.get_gradients(ctx_id)  # left: released
    Traceback (most recent call last):
      ...
    RuntimeError: Could not find autograd context with id: ...
    >>> rpc.shutdown()
    """
    return contexts_of(current_agent("nbrpc.autograd.context")).context()


def backward(context_id: int, roots: list[torch.Tensor], retain_graph: bool = False) -> None:
    """Run the backward pass from ``roots`` (scalars) across every worker the
    graph reaches; leaf gradients accumulate in the context on each worker
    (see :func:`get_gradients`), never in ``.grad``. ``retain_graph=True``
    keeps the graph for another pass, whose gradients add to the first's.

    >>> import torch
    >>> from nbrpc import rpc, autograd as dist_autograd
    >>> rpc.init_rpc("a", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> w = torch.tensor([3.0], requires_grad=True)
    >>> with dist_autograd.context() as ctx_id:
    ...     y = rpc.rpc_sync("a", torch.square, args=(w,))
    ...     dist_autograd.backward(ctx_id, [y.sum()], retain_graph=True)
    ...     first = dist_autograd.get_gradients(ctx_id)[w]
    ...     dist_autograd.backward(ctx_id, [y.sum()])
    ...     first, dist_autograd.get_gradients(ctx_id)[w]
    (tensor([6.]), tensor([12.]))
    >>> rpc.shutdown()
    """
    _backward.run_backward(current_agent("nbrpc.autograd.backward"), context_id, roots,
                           retain_graph)


def get_gradients(context_id: int) -> dict[torch.Tensor, torch.Tensor]:
    """``{tensor: gradient}`` for this worker's leaves in ``context_id`` (a
    copy: changing it changes nothing in the context).

    >>> import torch
    >>> from nbrpc import rpc, autograd as dist_autograd
    >>> rpc.init_rpc("a", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> w, b = torch.ones(2, requires_grad=True), torch.zeros(2, requires_grad=True)
    >>> with dist_autograd.context() as ctx_id:
    ...     y = rpc.rpc_sync("a", torch.add, args=(w * 3, b))
    ...     dist_autograd.backward(ctx_id, [y.sum()])
    ...     grads = dist_autograd.get_gradients(ctx_id)
    >>> grads[w], grads[b]
    (tensor([3., 3.]), tensor([1., 1.]))
    >>> rpc.shutdown()
    """
    ctx = contexts_of(current_agent("nbrpc.autograd.get_gradients")).get(context_id)
    with ctx.lock:
        return dict(ctx.grads)


def backward_stepper(context_id: int, roots: list[torch.Tensor],
                     retain_graph: bool = False) -> BackwardStepper:
    """The same pass as :func:`backward`, run one stage per ``.step()`` (see
    :class:`BackwardStepper`): each step says which worker ran which nodes,
    the leaf gradients it found, and the gradients it sent on.

    >>> import torch
    >>> from nbrpc import rpc, autograd as dist_autograd
    >>> rpc.init_rpc("a", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
    >>> w = torch.tensor([3.0], requires_grad=True)
    >>> with dist_autograd.context() as ctx_id:
    ...     y = rpc.rpc_sync("a", torch.mul, args=(w, 2.0))
    ...     stepper = dist_autograd.backward_stepper(ctx_id, [y.sum()])
    ...     stepper.pending
    ...     stage = stepper.step()
    ...     stage["nodes"], [s["norms"] for s in stage["sent"]]
    ...     [s["nodes"] for s in stepper.run()]  # the rest: the answer, then the leaf
    ...     dist_autograd.get_gradients(ctx_id)[w]
    [{'worker': 'a', 'trigger': 'roots'}]
    (['SumBackward0', 'RecvRpcBackward'], [[1.0]])
    [['MulBackward0', 'RecvRpcBackward'], ['AccumulateGrad']]
    tensor([2.])
    >>> rpc.shutdown()
    """
    return BackwardStepper(current_agent("nbrpc.autograd.backward_stepper"), context_id,
                           roots, retain_graph)


# -- PyTorch's private inspection functions (torch.distributed.autograd._*) ----------------
# Not part of PyTorch's documented API, but what its design notes and tests use
# to look at the graph an RPC made; here they answer from the same records the
# backward pass uses.
def _current_context() -> AutogradContext:
    """The calling thread's context (inside ``context()``, or in a handler of
    a request sent inside one): its ``_context_id()``, ``_send_functions()``,
    ``_recv_functions()`` and ``_known_worker_ids()``, as PyTorch's.

    >>> import torch
    >>> from nbrpc.rpc.api import init_rpc, rpc_sync, shutdown, _free_port_options
    >>> init_rpc("a", rank=0, world_size=1, rpc_backend_options=_free_port_options())
    >>> w = torch.ones(2, requires_grad=True)
    >>> with context() as ctx_id:
    ...     y = rpc_sync("a", torch.mul, args=(w, 3.0))
    ...     ctx = _current_context()
    ...     sends, recvs = ctx._send_functions(), ctx._recv_functions()
    >>> ctx._context_id() == ctx_id, len(sends), len(recvs)  # a call to itself: 2 messages
    (True, 2, 2)
    >>> [(n.name(), n.variable is w) for n, _ in next(iter(sends.values())).next_functions]
    [('torch::autograd::AccumulateGrad', True)]
    >>> last = list(recvs.values())[-1]  # the reply's
    >>> last is y.grad_fn, last.name()
    (True, 'torch::distributed::autograd::RecvRpcBackward')
    >>> shutdown()
    """
    return contexts_of(current_agent("nbrpc.autograd._current_context")).current_context()


def _retrieve_context(context_id: int) -> AutogradContext:
    """The context ``context_id`` on this worker (RuntimeError if it has none)."""
    return contexts_of(current_agent("nbrpc.autograd._retrieve_context")).get(context_id)


def _new_context() -> AutogradContext:
    """A new context, made the calling thread's until :func:`_release_context`
    (what ``context()`` does around its block)."""
    return contexts_of(current_agent("nbrpc.autograd._new_context")).new_context()


def _release_context(context_id: int) -> None:
    """Release ``context_id`` here and on every worker it reached."""
    contexts_of(current_agent("nbrpc.autograd._release_context")).release_context(context_id)


def _get_max_id() -> int:
    """The largest context id this worker can make (its rank in the high 16 bits)."""
    return contexts_of(current_agent("nbrpc.autograd._get_max_id")).max_id()


def _get_debug_info() -> dict[str, int]:
    """``num_current_backward_passes`` and ``num_autograd_contexts`` on this worker."""
    return contexts_of(current_agent("nbrpc.autograd._get_debug_info")).debug_info()


# -- installation into every agent ----------------------------------------------------------
def _on_send(t: torch.Tensor, wire: Any) -> Any:
    if getattr(wire, "tag", None) is None:
        return None
    return contexts_of(wire.agent).on_send(t, wire)


def _on_recv(t: torch.Tensor, token: Any, wire: Any) -> torch.Tensor:
    agent = getattr(wire, "agent", None)
    return t if agent is None else contexts_of(agent).on_recv(t, token, wire)


def _on_loaded(wire: Any) -> None:
    agent = getattr(wire, "agent", None)
    if agent is not None and getattr(wire, "stash", None):
        contexts_of(agent).on_loaded(wire)


def _install(agent: Agent) -> None:
    contexts = Contexts(agent)
    agent.ext["autograd"] = contexts
    agent.propagator = contexts
    agent.handlers[Release.op] = contexts.handle_release
    agent.ext["autograd_backward"] = functools.partial(_backward.run_backward, agent)
    _backward.install(contexts)
    agent.gone_hooks.append(contexts.on_member_gone)
    agent.snapshot_sections["autograd"] = contexts.snapshot


register_grad_hooks(_on_send, _on_recv, _on_loaded)
register_extension(_install)

