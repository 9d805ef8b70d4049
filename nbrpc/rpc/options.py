"""Backend options, accepted as PyTorch spells them so its code runs unchanged."""

from __future__ import annotations

import enum
from typing import Any

DEFAULT_RPC_TIMEOUT_SEC = 60.0
DEFAULT_INIT_METHOD = "env://"
DEFAULT_NUM_WORKER_THREADS = 16
UNSET_RPC_TIMEOUT = -1.0


class BackendType(enum.Enum):
    """nbrpc has one backend (ZeroMQ); TENSORPIPE is accepted as its alias."""

    TENSORPIPE = "TENSORPIPE"
    NBRPC = "TENSORPIPE"


class RpcBackendOptions:
    def __init__(self, rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
                 init_method: str = DEFAULT_INIT_METHOD) -> None:
        self.rpc_timeout = float(rpc_timeout)
        self.init_method = init_method


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """Same signature as ``torch.distributed.rpc.TensorPipeRpcBackendOptions``.

    ``num_worker_threads``, ``rpc_timeout`` and ``init_method`` are honoured;
    ``_transports`` and ``_channels`` are accepted and ignored (nbrpc has one
    transport); device maps are refused because nbrpc moves CPU tensors only.

    >>> TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=20).rpc_timeout
    20.0
    """

    def __init__(
        self,
        *,
        num_worker_threads: int = DEFAULT_NUM_WORKER_THREADS,
        rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
        init_method: str = DEFAULT_INIT_METHOD,
        device_maps: dict | None = None,
        devices: list | None = None,
        _transports: list | None = None,
        _channels: list | None = None,
    ) -> None:
        super().__init__(rpc_timeout, init_method)
        if int(num_worker_threads) < 1:
            raise ValueError(f"num_worker_threads must be >= 1, got {num_worker_threads}")
        self.num_worker_threads = int(num_worker_threads)
        if device_maps:
            _refuse_devices()
        self.device_maps: dict = {}
        self.devices = list(devices or [])

    def set_device_map(self, to: str, device_map: dict) -> None:
        _refuse_devices()

    def set_devices(self, devices: list) -> None:
        self.devices = list(devices)


def _refuse_devices() -> None:
    raise ValueError(
        "nbrpc sends CPU tensors only, so device maps are not supported; move tensors "
        "with .cpu() before sending and .to(device) after receiving.")


def read_options(opts: Any) -> tuple[int, float, str]:
    """(num_worker_threads, rpc_timeout, init_method) from ours or torch's options."""
    if opts is None:
        return DEFAULT_NUM_WORKER_THREADS, DEFAULT_RPC_TIMEOUT_SEC, DEFAULT_INIT_METHOD
    if getattr(opts, "device_maps", None):
        _refuse_devices()
    return (
        int(getattr(opts, "num_worker_threads", DEFAULT_NUM_WORKER_THREADS)),
        float(getattr(opts, "rpc_timeout", DEFAULT_RPC_TIMEOUT_SEC)),
        getattr(opts, "init_method", None) or DEFAULT_INIT_METHOD,
    )
