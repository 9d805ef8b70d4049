"""Device maps across the group: each member's devices, checked together, as plain data.

A member publishes a :class:`DeviceConfig` in its :class:`~.messages.Member`
record: how many CUDA devices its host shows it, its device maps (for each
callee, which of its devices lands on which of the callee's), and the devices
it declared. Devices are strings as ``str(torch.device)`` writes them
(``"cpu"``, ``"cuda:0"``), so this layer needs no torch. Once a member has the
group's table it checks every member's configuration with :func:`check` (the
rules and messages of ``torch.distributed.rpc``'s TensorPipe backend, so every
rank of a static group fails ``init_rpc`` with the same error) and derives its
own :func:`plan`: the reverse maps its replies follow, and the devices it
serves.

>>> a = DeviceConfig(count=2, maps=(("b", (("cuda:0", "cuda:1"),)),))
>>> b = DeviceConfig(count=2)
>>> check({"a": a, "b": b})
>>> plan("b", {"a": a, "b": b})
DevicePlan(reverse_maps=(('a', (('cuda:1', 'cuda:0'),)),), devices=('cuda:1',))
>>> check({"a": a, "b": DeviceConfig(count=1)})  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
nbrpc.errors.DeviceMapError: Node a has target devices with invalid indices in its device map for b
device map = {device(type='cuda', index=0): device(type='cuda', index=1)}
device count = 1
Check the device_maps and devices in a's TensorPipeRpcBackendOptions ...
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..errors import DeviceMapError, DeviceRouteError
from .messages import fast_pickle

Map = tuple[tuple[str, str], ...]  # (local device, remote device) pairs


def visible_here() -> str | None:
    """This process's ``CUDA_VISIBLE_DEVICES`` (None: unset), as a member publishes it."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


@fast_pickle
@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """What one member says of its devices (``Member.devices``)."""

    count: int = 0  # CUDA devices visible to the process
    maps: tuple[tuple[str, Map], ...] = ()  # (callee name, its map), sorted by name
    devices: tuple[str, ...] = ()  # declared with ``devices=`` / ``set_devices``; () = derived
    # its own device in a cluster started with gpus=True (a GPU, or "cpu"): with
    # no map to a peer that has one too, its map is {its home: the peer's home}
    home: str | None = None
    # its CUDA_VISIBLE_DEVICES (None: unset): CUDA IPC between two processes of
    # one host only where both number the GPUs alike
    visible: str | None = None

    def map_to(self, name: str, peer: DeviceConfig | None = None) -> dict[str, str]:
        """Its map to ``name``: the one set, else home to ``peer``'s home.

        >>> a, b = DeviceConfig(1, home="cpu"), DeviceConfig(2, home="cuda:1")
        >>> a.map_to("b", b), b.map_to("a", a), a.map_to("b")
        ({'cpu': 'cuda:1'}, {'cuda:1': 'cpu'}, {})
        """
        pairs = dict(next((m for to, m in self.maps if to == name), ()))
        if not pairs and self.home is not None and peer is not None and peer.home is not None:
            return {self.home: peer.home}
        return pairs


@dataclass(frozen=True)
class DevicePlan:
    """One member's share of the group's configuration: the map its replies to
    each caller follow (the caller's map, inverted), and the devices it serves."""

    reverse_maps: tuple[tuple[str, Map], ...] = ()
    devices: tuple[str, ...] = ()


def _torch_repr(device: str) -> str:
    """How ``torch.device`` prints, so errors read as PyTorch's.

    >>> _torch_repr("cuda:1"), _torch_repr("cpu")
    ("device(type='cuda', index=1)", "device(type='cpu')")
    """
    kind, _, index = device.partition(":")
    return f"device(type='{kind}', index={index})" if index else f"device(type='{kind}')"


def _map_repr(pairs: Iterable[tuple[str, str]]) -> str:
    return "{" + ", ".join(f"{_torch_repr(k)}: {_torch_repr(v)}" for k, v in pairs) + "}"


def _list_repr(devices: Iterable[str]) -> str:
    return "[" + ", ".join(map(_torch_repr, devices)) + "]"


def _index(device: str) -> int:
    return int(device.partition(":")[2] or 0)


def valid(devices: Iterable[str], count: int) -> bool:
    """CPU, or a CUDA device this host has (PyTorch's ``_tensorpipe_validate_devices``).

    >>> valid(["cpu", "cuda:1"], 2), valid(["cuda:2"], 2)
    (True, False)
    """
    return all(d == "cpu" or (d.startswith("cuda:") and 0 <= _index(d) < count)
               for d in devices)


def check(configs: Mapping[str, DeviceConfig], static: bool = True) -> None:
    """Raise :class:`~nbrpc.errors.DeviceMapError` (a ``ValueError``) for the first
    problem in the group's configurations, checked in PyTorch's order and worded
    as PyTorch words it. A dynamic group (``static=False``) does not check map
    targets that have not joined yet."""
    names = list(configs)
    for node in names:
        home, count = configs[node].home, configs[node].count
        if home is not None and not valid([home], count):
            raise DeviceMapError(f"Node {node} has an invalid home device {home} (gpus=True "
                                 f"gives each worker one)\ndevice count = {count}", node)
    for node in names:
        devices, count = configs[node].devices, configs[node].count
        if len(set(devices)) != len(devices):
            raise DeviceMapError(f"Node {node} has duplicated devices\n"
                                 f"devices = {_list_repr(devices)}", node)
        if not valid(devices, count):
            raise DeviceMapError(f"Node {node} has devices with invalid indices\n"
                                 f"devices = {_list_repr(devices)}\n"
                                 f"device count = {count}", node)
    for source in names:
        config = configs[source]
        targets = [to for to, _ in config.maps]
        if static and not set(targets) <= set(names):
            raise DeviceMapError(
                f"Node {source} has invalid target node names in its device maps\n"
                f"device maps = dict_keys({targets!r})\nnode names = {names!r}", source)
        for target, pairs in config.maps:
            where = f"in its device map for {target}\ndevice map = {_map_repr(pairs)}"
            sources, dests = [k for k, _ in pairs], [v for _, v in pairs]
            if len(set(dests)) != len(pairs):
                raise DeviceMapError(f"Node {source} has duplicated target devices {where}",
                                     source)
            if config.devices:
                if not set(sources) <= set(config.devices):
                    raise DeviceMapError(
                        f"Node {source} has unexpected source devices {where}\n"
                        f"devices = {_list_repr(config.devices)}", source)
            elif not valid(sources, config.count):
                raise DeviceMapError(f"Node {source} has source devices with invalid indices "
                                     f"{where}\ndevice count = {config.count}", source)
            other = configs.get(target)
            if other is not None and other.devices:
                if not set(dests) <= set(other.devices):
                    raise DeviceMapError(
                        f"Node {source} has unexpected target devices {where}\n"
                        f"devices = {_list_repr(other.devices)}", source)
            elif other is not None and not valid(dests, other.count):
                raise DeviceMapError(f"Node {source} has target devices with invalid indices "
                                     f"{where}\ndevice count = {other.count}", source)


def plan(me: str, configs: Mapping[str, DeviceConfig]) -> DevicePlan:
    """``me``'s reverse maps (callers' maps to ``me``, inverted) and its devices:
    the declared ones, or else every non-CPU device in its own maps and its
    reverse maps, by index (PyTorch's ``_create_device_list``)."""
    mine = configs[me]
    reverse = tuple((node, tuple((v, k) for k, v in pairs.items()))
                    for node, config in configs.items()
                    if (pairs := config.map_to(me, mine if node != me else None)))
    if mine.devices:
        devices = list(mine.devices)
    else:
        found = {pair[0] for _, pairs in (*mine.maps, *reverse) for pair in pairs}
        found |= {mine.home} if mine.home else set()
        devices = [d for d in found if d != "cpu"]
    return DevicePlan(reverse, tuple(sorted(devices, key=_index)))


# -- where each tensor of a message lands ---------------------------------------
_NO_MAP = ("TensorPipe RPC backend only supports CPU tensors by default, please move your "
           "tensors to CPU before sending them over RPC, or call `set_device_map` on "
           "`TensorPipeRpcBackendOptions` to explicitly configure device mapping. "
           "{kind} device mapping is not available for destination {peer}")


def target_device(device: str, mapping: Mapping[str, str] | None, peer: str,
                  request: bool, me: str = "") -> str:
    """Where a tensor on ``device`` lands at ``peer``: PyTorch's
    ``getDevicesForRemote``. A request follows the sender's map to ``peer``, a
    reply the inverse of the caller's map (``mapping`` is that, or None where
    there is none). A CPU tensor stays on the CPU unless the map names
    ``"cpu"``; any other device must be in the map.

    >>> target_device("cpu", None, "w1", True), target_device("cpu", {"cpu": "cuda:0"}, "w1", True)
    ('cpu', 'cuda:0')
    >>> target_device("cuda:1", {"cuda:1": "cpu"}, "w1", True)
    'cpu'
    >>> target_device("cuda:0", None, "w1", True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    nbrpc.errors.DeviceRouteError: TensorPipe RPC backend only supports CPU tensors by default, ... Request device mapping is not available for destination w1, but found tensor on device: cuda:0
    nbrpc: ...
    """
    if not mapping:
        if device == "cpu":
            return "cpu"
        raise DeviceRouteError(_NO_MAP.format(kind="Request" if request else "Response",
                                              peer=peer)
                               + f", but found tensor on device: {device}"
                               + _advice(device, peer, request, me), peer)
    target = mapping.get(device)
    if target is not None:
        return target
    if device == "cpu":
        return "cpu"
    raise DeviceRouteError(_NO_MAP.format(kind="Request" if request else "Response", peer=peer)
                           + f" for device {device} but received a tensor on that device."
                           + _advice(device, peer, request, me), peer)


def _advice(device: str, peer: str, request: bool, me: str) -> str:
    if request:
        return (f"\nnbrpc: give this worker a map for {device}, e.g. "
                f"options.set_device_map({peer!r}, {{{device!r}: 'cuda:0'}}) before init_rpc "
                "(replies come back along the same map, inverted), or in a notebook start "
                "the cluster with %rpc_cluster start N --gpus (Cluster(gpus=True), or "
                "Cluster(device_maps=...)); or send .cpu().")
    return (f"\nnbrpc: the result holds a tensor on {device}, which the caller's map to "
            f"{me or 'this worker'} does not name: add {{...: {device!r}}} to "
            f"{peer!r}'s set_device_map({me or 'this worker'!r}, ...), or return .cpu().")


def inverse(pairs: Iterable[tuple[str, str]]) -> dict[str, str]:
    """A map read backwards: where a reply's tensors go.

    >>> inverse({"cuda:0": "cuda:1", "cpu": "cuda:0"}.items())
    {'cuda:1': 'cuda:0', 'cuda:0': 'cpu'}
    """
    return {v: k for k, v in pairs}
