"""Devices in a cluster: the device maps each worker follows.

Two ways, which combine (a map given for a pair wins):

* ``Cluster(device_maps={"driver": {"worker1": {0: 0}}, "worker1": {"driver": {0: 0}}})``:
  each worker's maps to the others, as ``TensorPipeRpcBackendOptions.device_maps``
  would give them to ``init_rpc`` (keys and values as int, str or
  ``torch.device``, ``"cpu"`` allowed on either side).
* ``Cluster(gpus=True)`` (``%rpc_cluster start N --gpus``): worker *r* makes
  ``cuda:(r-1) mod G`` its device, *G* being its host's GPU count (round
  robin), and the driver ``cuda:0``, or the CPU where the kernel's host has no
  GPU. Between two members with no map given, tensors go from one's device
  to the other's, and answers back: a CPU tensor of a driver without a GPU
  lands on a worker's GPU, and the worker's result comes back to the CPU.
  The homes travel in each member's record, so workers added or restarted
  later fit in.

The whole group is checked as PyTorch checks ``init_rpc``'s maps
(:func:`nbrpc.agent.devices.check`) once the workers have joined.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from ..agent.devices import DeviceConfig, Map, visible_here
from .ipp import ClusterError

Maps = tuple[tuple[str, Map], ...]
NAME = re.compile(r"driver|worker[1-9][0-9]*")  # the names a Cluster gives its members


def parse_maps(device_maps: Mapping[str, Mapping[str, Mapping]] | None) -> dict[str, Maps]:
    """``{worker: {peer: {its device: the peer's}}}`` as each member publishes it.

    >>> parse_maps({"driver": {"worker1": {"cuda:0": "cuda:1", "cpu": "cpu"}}})
    {'driver': (('worker1', (('cpu', 'cpu'), ('cuda:0', 'cuda:1'))),)}
    >>> parse_maps({"driver": {"worker 1": {"cpu": "cpu"}}})
    Traceback (most recent call last):
    ...
    ValueError: device_maps names 'worker 1': a cluster's members are 'driver' and 'worker1', 'worker2', ...
    >>> parse_maps({"driver": {"worker1": {"cuda:0": "cuda:1", "cuda:1": "cuda:1"}}})
    Traceback (most recent call last):
    ...
    ValueError: device_maps['driver']['worker1']: `device_map` only supports 1-to-1 mapping, trying to map cuda:1 and cuda:0 to cuda:1
    """
    from ..rpc.options import _to_device_map, published_maps

    out: dict[str, Maps] = {}
    for name, maps in (device_maps or {}).items():
        if not isinstance(name, str) or not isinstance(maps, Mapping):
            raise TypeError(f"device_maps must map worker names to {{peer: {{device: device}}}}, "
                            f"e.g. {{'driver': {{'worker1': {{0: 0}}}}}}; got {name!r}: {maps!r}")
        for who in (name, *maps):
            if not isinstance(who, str) or not NAME.fullmatch(who):
                raise ValueError(f"device_maps names {who!r}: a cluster's members are 'driver' "
                                 "and 'worker1', 'worker2', ...")
        parsed = {}
        for peer, pairs in maps.items():
            try:
                parsed[peer] = _to_device_map(dict(pairs))
            except (ValueError, RuntimeError, TypeError) as e:
                raise type(e)(f"device_maps[{name!r}][{peer!r}]: {e}") from None
        out[name] = published_maps(parsed)
    return out


def home_device(rank: int, count: int) -> str:
    """A member's own device with ``gpus=True``: the driver's (rank 0) is cuda:0
    or the CPU, worker *r*'s the (r-1)-th of its host's GPUs, round robin.

    >>> [home_device(r, 2) for r in range(5)], home_device(0, 0)
    (['cuda:0', 'cuda:0', 'cuda:1', 'cuda:0', 'cuda:1'], 'cpu')
    """
    if rank == 0:
        return "cuda:0" if count else "cpu"
    if not count:
        raise ClusterError("gpus=True gives each worker a GPU, but this worker's host has "
                           "none (torch.cuda.device_count() is 0): start the cluster without "
                           "gpus=True (--gpus), or on hosts with GPUs")
    return f"cuda:{(rank - 1) % count}"


def config(rank: int, maps: Maps, gpus: bool, count: int) -> DeviceConfig:
    """What member ``rank`` of a cluster with device maps or GPUs publishes."""
    return DeviceConfig(count=count, maps=maps, home=home_device(rank, count) if gpus else None,
                        visible=visible_here())


def count_here() -> int:
    """This host's CUDA devices, asked of NVML where PyTorch can (so that this
    process, which may fork later, does not initialize CUDA)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return torch.cuda.device_count()


def check_group(agent: Any) -> None:
    """Check every member's maps against every member's devices (PyTorch's
    rules); a misfit raises :class:`~.ipp.ClusterError` naming it."""
    from ..agent import devices
    from ..errors import DeviceMapError

    configs = {m.name: m.devices or DeviceConfig() for m in agent.members.members()}
    try:
        devices.check(configs)
    except DeviceMapError as e:
        raise ClusterError(f"the cluster's device maps do not fit its workers' devices: {e}"
                           ) from None
