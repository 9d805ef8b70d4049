"""One local optimizer per owner of parameters, stepped with a context's gradients.

::

    trainer ──remote(_new_local_optimizer)──▶ each owner: _LocalOptimizer(params there)
    trainer ──rpc_async(_step_on_owner, ctx)─▶ each owner, concurrently:
              grads = get_gradients(ctx); optimizer.step()   (one step at a time per owner)
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

from .. import autograd as dist_autograd
from ..agent import Agent, current_agent
from ..autograd.engine import GRAD_STAGING
from ..errors import CompositeError
from ..rref import RRef


def _owner_lock(agent: Agent) -> threading.Lock:
    """One lock per worker: trainers sharing a parameter server step in turn."""
    return agent.ext.setdefault("optimizer_lock", threading.Lock())


class _LocalOptimizer:
    """Lives on the owner of ``params``; never sent anywhere."""

    def __init__(self, optim_cls: Callable[..., torch.optim.Optimizer], params: list[RRef],
                 args: tuple, kwargs: dict) -> None:
        self.params = [p.local_value() for p in params]
        self.optim = optim_cls(self.params, *args, **kwargs)

    def step(self, context_id: int) -> None:
        """``.grad`` is set to the context's gradients for the step only, then
        restored: parameters without a gradient in the context are skipped."""
        grads = dist_autograd.get_gradients(context_id)
        # (and no backward stage sets .grad meanwhile: engine.GRAD_STAGING)
        with _owner_lock(current_agent()), GRAD_STAGING:
            saved = [p.grad for p in self.params]
            try:
                for p in self.params:
                    p.grad = grads.get(p)
                self.optim.step()
            finally:
                for p, g in zip(self.params, saved):
                    p.grad = g


def _new_local_optimizer(optim_cls: Any, params: list[RRef], args: tuple,
                         kwargs: dict) -> RRef:
    return RRef(_LocalOptimizer(optim_cls, params, args, kwargs))


def _step_on_owner(local_optim: RRef, context_id: int) -> None:
    local_optim.local_value().step(context_id)


class DistributedOptimizer:
    """An optimizer over parameters that live on several workers.

    ``params_rref``: RRefs to parameters (``RemoteModule.remote_parameters()``,
    ``[RRef(p) for p in model.parameters()]``); one ``optimizer_class(params,
    *args, **kwargs)`` is created on each owner. ``step(context_id)`` steps all
    of them concurrently with the gradients of that distributed autograd
    context; a failure on any owner raises :class:`~nbrpc.errors.CompositeError`
    naming every owner that failed.

    >>> import torch
    >>> from nbrpc import autograd as dist_autograd
    >>> from nbrpc.rpc import RRef
    >>> from nbrpc.rpc.api import init_rpc, rpc_sync, shutdown, _free_port_options
    >>> init_rpc("ps", rank=0, world_size=1, rpc_backend_options=_free_port_options())
    >>> w = torch.nn.Parameter(torch.tensor([1.0, -1.0]))
    >>> opt = DistributedOptimizer(torch.optim.SGD, [RRef(w)], lr=0.5)
    >>> with dist_autograd.context() as ctx:
    ...     loss = rpc_sync("ps", torch.mul, args=(w, w)).sum()
    ...     dist_autograd.backward(ctx, [loss])
    ...     opt.step(ctx)
    >>> w.data
    tensor([0., 0.])
    >>> shutdown()
    """

    def __init__(self, optimizer_class: Callable[..., torch.optim.Optimizer],
                 params_rref: list[RRef], *args: Any, **kwargs: Any) -> None:
        params_rref = list(params_rref)
        bad = [p for p in params_rref if not isinstance(p, RRef)]
        if bad:
            raise TypeError(
                f"params_rref must be RRefs to parameters, got {type(bad[0]).__name__}; wrap "
                "local ones as [RRef(p) for p in model.parameters()] and use "
                "RemoteModule.remote_parameters() for remote ones")
        if not callable(optimizer_class):
            raise TypeError(f"optimizer_class must be a class such as torch.optim.SGD, got "
                            f"{optimizer_class!r}")
        self._agent = agent = current_agent("DistributedOptimizer")
        per_owner: dict[int, list[RRef]] = {}
        for p in params_rref:
            per_owner.setdefault(p.owner().id, []).append(p)
        futs = {agent.peer_name(owner): agent.rpc_async(
                    owner, _new_local_optimizer, (optimizer_class, rrefs, args, kwargs))
                for owner, rrefs in sorted(per_owner.items())}
        self.remote_optimizers: list[RRef] = list(_gather("creating the optimizers", futs)
                                                  .values())

    def step(self, context_id: int) -> None:
        """One step on every owner, concurrently, with ``context_id``'s gradients."""
        dist_autograd.get_gradients(context_id)  # a clear error for a wrong id, here
        futs = {o.owner_name(): self._agent.rpc_async(o.owner(), _step_on_owner,
                                                      (o, context_id))
                for o in self.remote_optimizers}
        _gather("DistributedOptimizer.step", futs)

    def __repr__(self) -> str:
        owners = ", ".join(o.owner_name() for o in self.remote_optimizers)
        return f"<DistributedOptimizer on {owners}>"


def _gather(what: str, futs: dict[str, Any]) -> dict[str, Any]:
    """Wait for every future; raise one error naming every failure."""
    values, errors = {}, {}
    for worker, fut in futs.items():
        try:
            values[worker] = fut.wait()
        except Exception as e:
            errors[worker] = e
    if errors:
        if len(errors) == 1:
            raise next(iter(errors.values()))
        raise CompositeError(what, errors)
    return values

