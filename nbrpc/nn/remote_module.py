"""A module created and run on another worker, called like a local one."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..agent import current_agent
from ..agent.agent import MessageContext
from ..errors import NbrpcError
from ..rpc.api import remote, rpc_sync
from ..rref import RRef
from ..serialize import current_context

# Methods of nn.Module that would act on the (empty) local shell, not the
# remote module: they raise, as in PyTorch's RemoteModule.
_NOT_SUPPORTED = (
    "register_buffer", "register_parameter", "add_module", "register_module", "apply",
    "cuda", "ipu", "xpu", "mtia", "cpu", "type", "float", "double", "half", "bfloat16", "to",
    "to_empty", "register_backward_hook", "register_full_backward_hook",
    "register_full_backward_pre_hook", "register_forward_pre_hook", "register_forward_hook",
    "state_dict", "load_state_dict", "parameters", "named_parameters", "buffers",
    "named_buffers",
    "requires_grad_", "zero_grad", "share_memory", "get_parameter",
    "get_buffer",
)


# What travels when a RemoteModule is sent over RPC (as PyTorch's
# _REMOTE_MODULE_PICKLED_ATTRIBUTES): an attribute added later stays here.
_PICKLED_ATTRIBUTES = ("on", "device", "module_cls_name", "module_rref", "training")


def _create_module(module_cls: Any, args: tuple, kwargs: dict, device: str = "cpu"
                   ) -> nn.Module:
    module = module_cls(*args, **kwargs)
    if not isinstance(module, nn.Module):  # PyTorch's text first: code matches on it
        raise ValueError(
            "Expect `module_cls(*args, **kwargs)` returns an instance of <class nn.Module>, "
            f"but it returns an instance of {type(module)}. Pass RemoteModule a subclass "
            f"of torch.nn.Module (or a function that builds one), not {module_cls!r}.")
    return module.to(device)


def _rebuild_remote_module(state: dict[str, Any]) -> RemoteModule:
    module = RemoteModule.__new__(RemoteModule)
    nn.Module.__init__(module)
    module.__dict__.update(state)
    return module


def _param_rrefs(module_rref: RRef, recurse: bool) -> list[RRef]:
    return [RRef(p) for p in module_rref.local_value().parameters(recurse)]


def _set_training(module_rref: RRef, mode: bool) -> None:
    module_rref.local_value().train(mode)


def parse_remote_device(remote_device: str) -> tuple[str | int, str]:
    """``"worker1/cpu"``, ``"rank:1/cpu"`` or ``"worker1"`` → (worker, device)."""
    if not isinstance(remote_device, str) or not remote_device:
        raise ValueError(f"remote_device must be a string like 'worker1/cpu' or "
                         f"'rank:1/cpu', got {remote_device!r}")
    worker, _, device = remote_device.partition("/")
    device = str(torch.device(device or "cpu"))
    if torch.device(device).type not in ("cpu", "cuda"):
        raise ValueError(f"remote_device {remote_device!r}: nbrpc runs remote modules on "
                         "the CPU or a CUDA device; use 'worker/cpu' or 'worker/cuda:0'")
    if worker.startswith("rank:"):
        try:
            return int(worker[5:]), device
        except ValueError:
            raise ValueError(f"remote_device {remote_device!r}: 'rank:' must be followed by "
                             "an integer, as in 'rank:1/cpu'") from None
    if not worker:
        raise ValueError(f"remote_device {remote_device!r} names no worker; write "
                         "'worker1/cpu' or 'rank:1/cpu'")
    return worker, device


def _check_device(member: Any, device: str, remote_device: str) -> None:
    """Refuse a CUDA device the worker does not have, where its count is known
    (it published it when it joined), rather than at the module's first call."""
    config = getattr(member, "devices", None)
    index = torch.device(device).index or 0
    if device != "cpu" and config is not None and index >= config.count:
        raise ValueError(
            f"remote_device {remote_device!r}: {member.name!r} has {config.count} CUDA "
            f"device(s), so no {device}; put the module on '{member.name}/cpu', or on a "
            "worker with a GPU (its tensors then travel along device maps: "
            "TensorPipeRpcBackendOptions.set_device_map)")


class RemoteModule(nn.Module):
    """``module_cls(*args, **kwargs)`` created on the worker ``remote_device``
    names (``"worker1/cpu"``, ``"rank:1/cpu"``, ``"worker1/cuda:0"``: moved to
    that device there); calling this object runs it there. Tensors to and from
    a module on a GPU travel along the device maps (``set_device_map``).

    ``forward(*args)`` blocks, ``forward_async(*args)`` returns a future;
    ``remote_parameters()`` gives RRefs for :class:`~nbrpc.optim.DistributedOptimizer`;
    ``get_module_rref()`` the module itself. Inside a distributed autograd
    context the call is recorded, so gradients flow back through it.
    ``train()``/``eval()`` switch the remote module's mode. Sent over RPC, it
    arrives as a RemoteModule of the same module (only its own attributes
    travel, as in PyTorch: one set on it later does not).

    >>> import torch
    >>> from nbrpc.rpc.api import init_rpc, shutdown, _free_port_options
    >>> init_rpc("w1", rank=0, world_size=1, rpc_backend_options=_free_port_options())
    >>> torch.manual_seed(0) and None
    >>> lin = RemoteModule("w1/cpu", torch.nn.Linear, args=(3, 2))
    >>> lin(torch.ones(1, 3)).shape
    torch.Size([1, 2])
    >>> [p.to_here().shape for p in lin.remote_parameters()]
    [torch.Size([2, 3]), torch.Size([2])]
    >>> lin.parameters()
    Traceback (most recent call last):
    ...
    ValueError: Method ``parameters`` not supported for RemoteModule: the module lives on 'w1'. Use remote_parameters() for RRefs to its parameters, or get_module_rref().
    >>> shutdown()
    """

    def __init__(self, remote_device: str, module_cls: Any, args: tuple | None = None,
                 kwargs: dict | None = None) -> None:
        super().__init__()
        worker, self.device = parse_remote_device(remote_device)
        agent = current_agent("RemoteModule")
        member = agent.resolve(worker)
        self.on = member.name
        _check_device(member, self.device, remote_device)
        self.module_cls_name = getattr(module_cls, "__name__", repr(module_cls))
        self.module_rref: RRef = remote(
            self.on, _create_module,
            (module_cls, tuple(args or ()), dict(kwargs or {}), self.device))

    @staticmethod
    def init_from_module_rref(remote_device: str, module_rref: RRef,
                              _module_interface_cls: Any = None) -> RemoteModule:
        """A RemoteModule for a module that already exists: ``module_rref`` (from
        another RemoteModule's :meth:`get_module_rref`, or ``remote()``), e.g.
        to share one module between several RemoteModules, on any worker.

        Calls go to the RRef's owner, as in PyTorch; nbrpc also names that
        worker in ``on`` and its repr (``remote_device`` only gives the device).
        """
        if _module_interface_cls is not None:
            raise NotImplementedError(
                "_module_interface_cls is for TorchScript, which nbrpc does not run; "
                "leave it out (calls work on any nn.Module)")
        _, device = parse_remote_device(remote_device)
        if not isinstance(module_rref, RRef):
            raise TypeError(f"module_rref must be an RRef to an nn.Module, got "
                            f"{type(module_rref).__name__}")
        module = RemoteModule.__new__(RemoteModule)
        nn.Module.__init__(module)
        module.on, module.device, module.module_rref = module_rref.owner_name(), device, module_rref
        module.module_cls_name = "module"  # (its class is known on the owner only)
        return module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module_rref.rpc_sync().__call__(*args, **kwargs)

    def forward_async(self, *args: Any, **kwargs: Any) -> torch.futures.Future:
        return self.module_rref.rpc_async().__call__(*args, **kwargs)

    def remote_parameters(self, recurse: bool = True) -> list[RRef]:
        """RRefs to the remote module's parameters (for DistributedOptimizer)."""
        return rpc_sync(self.on, _param_rrefs, (self.module_rref, recurse))

    def get_module_rref(self) -> RRef:
        return self.module_rref

    def __reduce_ex__(self, protocol: int) -> Any:
        if not isinstance(current_context(), MessageContext):  # PyTorch's text first
            raise NbrpcError(
                "Cannot pickle RemoteModule in python pickler. RemoteModule can only be "
                f"pickled when using RPC: this one holds the module on {self.on!r} through an "
                "RRef, which only an RPC can hand over. Send it as an argument or result of "
                "rpc_sync/rpc_async/remote, or save get_module_rref().to_here().")
        return _rebuild_remote_module, ({k: self.__dict__[k] for k in _PICKLED_ATTRIBUTES},)

    def train(self, mode: bool = True) -> RemoteModule:
        rpc_sync(self.on, _set_training, (self.module_rref, mode))
        self.training = mode
        return self

    def __repr__(self) -> str:
        return f"RemoteModule({self.module_cls_name} on {self.on}/{self.device})"


def _not_supported(name: str) -> Any:
    def method(self: RemoteModule, *args: Any, **kwargs: Any) -> Any:
        raise ValueError(
            f"Method ``{name}`` not supported for RemoteModule: the module lives on "
            f"{self.on!r}. Use remote_parameters() for RRefs to its parameters, or "
            "get_module_rref().")
    method.__name__ = name
    return method


for _name in _NOT_SUPPORTED:
    setattr(RemoteModule, _name, _not_supported(_name))
