"""Backend options, accepted as PyTorch spells them so its code runs unchanged."""

from __future__ import annotations

import enum
import numbers
import os
from typing import Any

import torch

from ..agent.devices import DeviceConfig, visible_here
from ..agent.options import DEFAULT_FAILURE_TIMEOUT

DEFAULT_RPC_TIMEOUT_SEC = 60.0
DEFAULT_INIT_METHOD = "env://"
DEFAULT_NUM_WORKER_THREADS = 16
UNSET_RPC_TIMEOUT = -1.0
FAILURE_TIMEOUT_ENV = "NBRPC_FAILURE_TIMEOUT"
ENCRYPT_ENV = "NBRPC_ENCRYPT"
LOCAL_IPC_ENV = "NBRPC_LOCAL_IPC"

DeviceType = int | str | torch.device


class BackendType(enum.Enum):
    """nbrpc has one backend (ZeroMQ); TENSORPIPE is accepted as its alias.

    >>> BackendType.TENSORPIPE is BackendType.NBRPC
    True
    """

    TENSORPIPE = "TENSORPIPE"
    NBRPC = "TENSORPIPE"


class RpcBackendOptions:
    """What every backend's options have, as ``torch.distributed.rpc.RpcBackendOptions``:
    ``rpc_timeout`` (seconds, the default timeout of calls) and ``init_method``
    (the rendezvous URL). Pass a :class:`TensorPipeRpcBackendOptions` to ``init_rpc``.

    >>> RpcBackendOptions(rpc_timeout=20).rpc_timeout
    20.0
    >>> RpcBackendOptions(rpc_timeout="20")
    Traceback (most recent call last):
      ...
    TypeError: RpcBackendOptions(): incompatible constructor arguments: rpc_timeout is a number of seconds, not a str
    """

    def __init__(self, rpc_timeout: float = DEFAULT_RPC_TIMEOUT_SEC,
                 init_method: str = DEFAULT_INIT_METHOD) -> None:
        if isinstance(rpc_timeout, bool) or not isinstance(rpc_timeout, numbers.Real):
            raise TypeError(  # PyTorch's (pybind's) phrase first
                f"{type(self).__name__}(): incompatible constructor arguments: rpc_timeout "
                f"is a number of seconds, not a {type(rpc_timeout).__name__}"
                + (" (pass its .total_seconds())" if hasattr(rpc_timeout, "total_seconds")
                   else ""))
        self.rpc_timeout = float(rpc_timeout)
        self.init_method = init_method


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """Same signature as ``torch.distributed.rpc.TensorPipeRpcBackendOptions``.

    ``num_worker_threads``, ``rpc_timeout`` and ``init_method`` are honoured;
    ``_transports`` and ``_channels`` are accepted and ignored (nbrpc has one
    transport). ``device_maps`` and ``devices`` are parsed and checked as
    PyTorch does (keys and values as int, str or ``torch.device``, ``"cpu"``
    allowed on either side, one-to-one), and ``init_rpc`` checks every
    worker's maps against every worker's device count; nbrpc does not move
    CUDA tensors yet, so sending one still fails (move it with ``.cpu()``).

    Beyond PyTorch's: ``failure_timeout``, how long a worker may stay silent
    while its connection is up (busy in C code holding the GIL, stopped)
    before the group declares it dead. By default that never happens on Linux
    (busy is not dead, for minutes if need be; elsewhere: 30 s): a worker whose
    process exits is noticed within about a second, and one whose host
    vanishes from the network (power loss, a partition) within about three,
    whatever this is. Set it to declare hung workers dead too. With PyTorch's
    own options class, set ``NBRPC_FAILURE_TIMEOUT`` instead.
    ``max_message_size``: the most bytes a received message may declare.
    ``encrypt=True`` (or ``NBRPC_ENCRYPT=1``) encrypts every connection with
    ZeroMQ's CURVE, for traffic that crosses networks you do not trust; every
    worker must use the same setting. ``local_ipc=False`` (or
    ``NBRPC_LOCAL_IPC=0``) makes workers on one host talk over loopback TCP
    rather than a Unix domain socket.

    >>> TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=20).rpc_timeout
    20.0
    >>> TensorPipeRpcBackendOptions(failure_timeout=120).failure_timeout
    120.0
    >>> TensorPipeRpcBackendOptions(device_maps={"worker1": {"cpu": "cpu"}}).device_maps
    {'worker1': {device(type='cpu'): device(type='cpu')}}
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
        failure_timeout: float | None = None,
        max_message_size: int | None = None,
        encrypt: bool | None = None,
        local_ipc: bool | None = None,
    ) -> None:
        super().__init__(rpc_timeout, init_method)
        if int(num_worker_threads) < 1:
            raise ValueError(f"num_worker_threads must be >= 1, got {num_worker_threads}")
        self.num_worker_threads = int(num_worker_threads)
        self.failure_timeout = None if failure_timeout is None else _seconds(
            failure_timeout, "failure_timeout")
        self.max_message_size = max_message_size  # (checked with the agent's options)
        self.encrypt = encrypt
        self.local_ipc = local_ipc
        self.device_maps: dict[str, dict[torch.device, torch.device]] = {
            to: _to_device_map(m) for to, m in (device_maps or {}).items()}
        self.devices: list[torch.device] = [_to_device(d) for d in devices or []]

    def set_device_map(self, to: str, device_map: dict[DeviceType, DeviceType]) -> None:
        """Map this worker's devices to ``to``'s, adding to what is set already (one
        to one; ``"cpu"`` allowed); replies from ``to`` follow the inverse map.

        >>> opts = TensorPipeRpcBackendOptions()
        >>> opts.set_device_map("worker1", {"cuda:0": "cuda:1"})
        >>> opts.set_device_map("worker1", {"cuda:1": "cuda:2"})
        >>> opts.device_maps["worker1"][torch.device("cuda:1")]
        device(type='cuda', index=2)
        """
        full = _to_device_map(device_map)
        current = self.device_maps.setdefault(to, {})
        for k, v in full.items():
            if k in current and v != current[k]:
                raise ValueError("`set_device_map` only supports 1-to-1 mapping, trying"
                                 f" to map {k} to {v} and {current[k]}")
        current.update(full)

    def set_devices(self, devices: list[DeviceType]) -> None:
        """The local CUDA devices this worker serves (by default: those its maps and
        its peers' maps name)."""
        self.devices = [_to_device(d) for d in devices]


def _to_device(device: DeviceType) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("`set_devices` expect a list of CUDA devices, but got "
                         f"device type {device.type}.")
    return device


def _to_device_map(device_map: dict[DeviceType, DeviceType]) -> dict[torch.device, torch.device]:
    full: dict[torch.device, torch.device] = {}
    reverse: dict[torch.device, torch.device] = {}
    for k, v in device_map.items():
        k, v = torch.device(k), torch.device(v)
        if v in reverse:
            raise ValueError("`device_map` only supports 1-to-1 mapping, "
                             f"trying to map {k} and {reverse[v]} to {v}")
        full[k] = v
        reverse[v] = k
    return full


def device_config(opts: Any, count: int) -> DeviceConfig:
    """What a worker publishes of its devices: ``count`` CUDA devices, and the maps
    and devices of its options (ours or PyTorch's), as strings.

    >>> device_config(TensorPipeRpcBackendOptions(device_maps={"w1": {"cpu": "cuda:0"}}), 0)
    DeviceConfig(count=0, maps=(('w1', (('cpu', 'cuda:0'),)),), devices=(), home=None, visible=None)
    """
    return DeviceConfig(
        count=count, maps=published_maps(getattr(opts, "device_maps", None) or {}),
        devices=tuple(str(torch.device(d)) for d in getattr(opts, "devices", None) or ()),
        visible=visible_here())


def published_maps(maps: dict[str, dict[torch.device, torch.device]]
                   ) -> tuple[tuple[str, tuple[tuple[str, str], ...]], ...]:
    """Parsed device maps as a member publishes them: strings, sorted, empty ones out.

    >>> published_maps({"w2": {}, "w1": {torch.device("cpu"): torch.device("cpu")}})
    (('w1', (('cpu', 'cpu'),)),)
    """
    return tuple(sorted((to, tuple(sorted((str(k), str(v)) for k, v in m.items())))
                        for to, m in maps.items() if m))


def _seconds(value: Any, name: str) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number of seconds, got {value!r}") from None
    if not seconds > 0:
        raise ValueError(f"{name} must be > 0 seconds, got {value!r}")
    return seconds


def _named_in_mro(obj: Any, name: str) -> bool:
    """Whether ``obj``'s class is or derives from a class called ``name``: ours,
    or PyTorch's (checked by name, so that torch's RPC module is not imported)."""
    return any(c.__name__ == name for c in type(obj).__mro__)


def check_backend(backend: Any, opts: Any) -> None:
    """Refuse what ``torch.distributed.rpc.init_rpc`` refuses, with its exception
    types: a backend that is not a ``BackendType`` member (``TypeError``; ours or
    PyTorch's; nbrpc runs every one as its ZeroMQ backend), options that are not
    ``RpcBackendOptions`` (``TypeError``), and, with no backend, options from
    which no backend can be inferred (``TypeError``).

    >>> check_backend(BackendType.TENSORPIPE, TensorPipeRpcBackendOptions())
    >>> check_backend(None, None)
    >>> check_backend("TENSORPIPE", None)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    TypeError: Argument backend must be a member of BackendType, but got 'TENSORPIPE' ...
    """
    if backend is not None and not (isinstance(backend, enum.Enum)
                                    and type(backend).__name__ == "BackendType"):
        raise TypeError(
            f"Argument backend must be a member of BackendType, but got {backend!r} "
            f"({type(backend).__name__}): pass backend={BackendType.__name__}.TENSORPIPE "
            "(nbrpc's or torch.distributed.rpc's), or leave it out.")
    if opts is None:
        return
    if not _named_in_mro(opts, "RpcBackendOptions"):
        raise TypeError(
            "Argument rpc_backend_options must be an instance of RpcBackendOptions, but got "
            f"a {type(opts).__name__}: pass TensorPipeRpcBackendOptions(init_method=..., "
            "...) instead.")
    if _named_in_mro(opts, "TensorPipeRpcBackendOptions"):
        return
    if backend is None:
        raise TypeError(
            f"Could not infer backend for options {type(opts).__name__}: nbrpc's backend "
            "takes TensorPipeRpcBackendOptions (nbrpc's or torch.distributed.rpc's); pass "
            "those, or pass backend=BackendType.TENSORPIPE explicitly.")
    raise TypeError(
        "`rpc_backend_options` must be a `TensorPipeRpcBackendOptions`. Got "
        f"{type(opts)}: nbrpc's backend takes TensorPipeRpcBackendOptions (nbrpc's or "
        "torch.distributed.rpc's).")


def read_options(opts: Any) -> dict[str, Any]:
    """What an agent takes from ours or torch's options (and the environment).

    >>> read_options(None)["failure_timeout"] == DEFAULT_FAILURE_TIMEOUT or "env set"
    True
    """
    failure = getattr(opts, "failure_timeout", None)
    if failure is None:
        env = os.environ.get(FAILURE_TIMEOUT_ENV)
        failure = _seconds(env, FAILURE_TIMEOUT_ENV) if env else DEFAULT_FAILURE_TIMEOUT
    read = {
        "num_worker_threads": int(getattr(opts, "num_worker_threads", DEFAULT_NUM_WORKER_THREADS)),
        "rpc_timeout": float(getattr(opts, "rpc_timeout", DEFAULT_RPC_TIMEOUT_SEC)),
        "init_method": getattr(opts, "init_method", None) or DEFAULT_INIT_METHOD,
        "failure_timeout": float(failure),
    }
    encrypt = getattr(opts, "encrypt", None)
    if encrypt is None:
        encrypt = os.environ.get(ENCRYPT_ENV, "").lower() in ("1", "true", "yes", "on")
    read["encrypt"] = bool(encrypt)
    ipc = getattr(opts, "local_ipc", None)
    if ipc is None:
        ipc = os.environ.get(LOCAL_IPC_ENV, "1").lower() not in ("0", "false", "no", "off")
    read["local_ipc"] = bool(ipc)
    size = getattr(opts, "max_message_size", None)
    if size is not None:
        read["max_message_size"] = size
    # PyTorch's count; with PYTORCH_NVML_BASED_CUDA_CHECK=1 it asks NVML, not CUDA
    read["devices"] = device_config(opts, torch.cuda.device_count())
    return read
