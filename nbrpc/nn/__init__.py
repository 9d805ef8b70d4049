"""``RemoteModule``: a module that lives on another worker (as
``torch.distributed.nn.RemoteModule``)."""

from .remote_module import RemoteModule

__all__ = ["RemoteModule"]
