"""``nbrpc.rpc``: the API of ``torch.distributed.rpc``, over ZeroMQ.

>>> from nbrpc import rpc
>>> rpc.init_rpc("me", rank=0, world_size=1, rpc_backend_options=rpc.api._free_port_options())
>>> rpc.rpc_async("me", divmod, args=(7, 2)).wait()
(3, 1)
>>> rpc.shutdown()
"""

from ..agent import RpcFuture, WorkerInfo
from ..errors import RemoteError
from ..rref import RRef
from . import api, functions
from .api import (
    get_rpc_timeout,
    get_worker_info,
    init_rpc,
    is_available,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from .options import (
    BackendType,
    RpcBackendOptions,
    TensorPipeRpcBackendOptions,
)

__all__ = [
    "BackendType", "RRef", "RemoteError", "api", "RpcBackendOptions", "RpcFuture",
    "TensorPipeRpcBackendOptions", "WorkerInfo", "functions", "get_rpc_timeout",
    "get_worker_info", "init_rpc", "is_available", "remote", "rpc_async", "rpc_sync", "shutdown",
]
