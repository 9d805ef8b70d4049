"""Device maps: options as ``torch.distributed.rpc`` parses them, the group's check
and each member's plan against PyTorch's own functions on the same inputs, and
``init_rpc`` against TensorPipe's on this machine's devices (none on CI).

No GPU is needed: PyTorch checks maps against each worker's device count, which
is a number here; the data path for CUDA tensors is not part of this file.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch.distributed.rpc import backend_registry as torch_registry

from nbrpc.agent.devices import DeviceConfig, check, plan
from nbrpc.errors import DeviceMapError
from nbrpc.rpc import TensorPipeRpcBackendOptions
from nbrpc.rpc.options import device_config

DEVICES = ["cpu", "cuda:0", "cuda:1", "cuda:2"]


def _torch_args(configs: dict[str, DeviceConfig]) -> tuple:
    names = list(configs)
    counts = {n: c.count for n, c in configs.items()}
    maps = {n: {to: {torch.device(k): torch.device(v) for k, v in pairs} for to, pairs in c.maps}
            for n, c in configs.items()}
    devices = {n: [torch.device(d) for d in c.devices] for n, c in configs.items()}
    return names, counts, maps, devices


def _torch_verdict(configs: dict[str, DeviceConfig], static: bool) -> str | None:
    try:
        torch_registry._validate_device_maps(*_torch_args(configs), is_static_group=static)
    except ValueError as e:
        return str(e)
    return None


def _ours(configs: dict[str, DeviceConfig], static: bool) -> str | None:
    try:
        check(configs, static)
    except DeviceMapError as e:
        return str(e).split("\nCheck the device_maps")[0]
    return None


def _random_config(rng: random.Random, names: list[str]) -> DeviceConfig:
    count = rng.randint(0, 3)
    maps = []
    for to in rng.sample(names + ["stranger"], rng.randint(0, 2)):
        pairs = {rng.choice(DEVICES): rng.choice(DEVICES) for _ in range(rng.randint(1, 2))}
        maps.append((to, tuple(pairs.items())))
    devices = tuple(rng.choice(DEVICES[1:]) for _ in range(rng.choice([0, 0, 1, 2])))
    return DeviceConfig(count, tuple(sorted(maps)), devices)


@pytest.mark.parametrize("static", [True, False])
def test_the_group_check_says_what_pytorch_says_on_the_same_configurations(static: bool) -> None:
    rng = random.Random(2026)
    verdicts = {"ok": 0, "refused": 0}
    for _ in range(600):
        names = [f"w{i}" for i in range(rng.randint(1, 3))]
        configs = {n: _random_config(rng, names) for n in names}
        theirs, ours = _torch_verdict(configs, static), _ours(configs, static)
        assert ours == theirs, configs
        verdicts["refused" if ours else "ok"] += 1
    assert min(verdicts.values()) > 50, verdicts  # both outcomes well exercised


def test_each_members_plan_is_pytorchs_reverse_maps_and_device_list() -> None:
    rng = random.Random(7)
    planned = 0
    for _ in range(1000):
        names = [f"w{i}" for i in range(rng.randint(1, 3))]
        configs = {n: _random_config(rng, names) for n in names}
        if _ours(configs, static=True) is not None:
            continue
        args = _torch_args(configs)
        for me in names:
            ours = plan(me, configs)
            reverse = torch_registry._create_reverse_mapping(me, args[0], args[2])
            devices = torch_registry._create_device_list(args[3][me], args[2][me], reverse)
            assert {n: {torch.device(k): torch.device(v) for k, v in pairs}
                    for n, pairs in ours.reverse_maps} == reverse
            assert [torch.device(d) for d in ours.devices] == devices
            planned += 1
    assert planned > 100


# -- options, as TensorPipeRpcBackendOptions parses them ---------------------------
def test_options_take_ints_strings_and_devices_and_cpu_on_either_side() -> None:
    # (an int names a device of the current accelerator: PyTorch resolves it only
    # where there is one, so CPU-only tests use strings and torch.device)
    opts = TensorPipeRpcBackendOptions(device_maps={"w1": {"cuda:0": "cuda:1",
                                                           "cpu": torch.device("cpu")}})
    opts.set_device_map("w2", {torch.device("cuda", 1): "cuda:0"})
    opts.set_device_map("w1", {"cuda:2": "cpu"})
    assert opts.device_maps == {
        "w1": {torch.device("cuda:0"): torch.device("cuda:1"), torch.device("cpu"): torch.device("cpu"),
               torch.device("cuda:2"): torch.device("cpu")},
        "w2": {torch.device("cuda:1"): torch.device("cuda:0")}}
    opts.set_devices([torch.device("cuda", 1), "cuda:0"])
    assert opts.devices == [torch.device("cuda:1"), torch.device("cuda:0")]
    assert device_config(opts, count=2) == DeviceConfig(
        2, (("w1", (("cpu", "cpu"), ("cuda:0", "cuda:1"), ("cuda:2", "cpu"))),
            ("w2", (("cuda:1", "cuda:0"),))), ("cuda:1", "cuda:0"))


@pytest.mark.parametrize("make", [
    lambda o: type(o)(device_maps={"w1": {"cuda:0": "cuda:1", "cuda:2": "cuda:1"}}),
    lambda o: o.set_device_map("w1", {"cuda:0": "cpu", "cuda:1": "cpu"}),
    lambda o: (o.set_device_map("w1", {"cuda:0": "cuda:1"}),
               o.set_device_map("w1", {"cuda:0": "cuda:2"})),
    lambda o: o.set_devices(["cpu"]),
    lambda o: type(o)(devices=["cpu"]),
])
def test_option_errors_are_pytorchs(make) -> None:
    from torch.distributed import rpc as torch_rpc

    with pytest.raises(ValueError) as ours:
        make(TensorPipeRpcBackendOptions())
    with pytest.raises(ValueError) as theirs:
        make(torch_rpc.TensorPipeRpcBackendOptions())
    assert str(ours.value) == str(theirs.value)


def test_a_map_to_a_gpu_this_machine_lacks_is_refused_as_pytorch_refuses_it() -> None:
    configs = {"w0": DeviceConfig(0, (("w1", (("cuda:0", "cpu"),)),)), "w1": DeviceConfig(0)}
    with pytest.raises(DeviceMapError, match="source devices with invalid indices") as e:
        check(configs)
    assert e.value.node == "w0" and isinstance(e.value, ValueError)
    assert "set_device_map" in str(e.value)  # then what to change


# -- init_rpc, nbrpc against TensorPipe on this machine's devices --------------------
def _init_child(rank: int, backend: str, port: int, maps: dict, out: str) -> None:
    import json
    import os

    if backend == "torch":
        import torch.distributed.rpc as rpc
    else:
        from nbrpc import rpc
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, rpc_timeout=20,
                                           device_maps=maps.get(str(rank)))
    try:
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    except Exception as e:  # noqa: BLE001 - what init_rpc raised is the observation
        seen = {"error": isinstance(e, ValueError), "lines": str(e).splitlines()[:3]}
    else:
        seen = {"ok": rpc.rpc_sync(f"w{1 - rank}", torch.add, args=(torch.ones(2), rank)).tolist()}
        rpc.shutdown()
    with open(f"{out}.{rank}", "w") as f:
        json.dump(seen, f)


def _init_both(backend: str, maps: dict, tmp_path) -> list[dict]:
    import json

    import torch.multiprocessing as mp
    from conftest import free_ports

    out = str(tmp_path / backend)
    mp.start_processes(_init_child, args=(backend, free_ports(1)[0], maps, out), nprocs=2,
                       join=True, start_method="spawn")
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in (0, 1)]


@pytest.mark.torch_rpc
@pytest.mark.parametrize("maps, expect", [
    ({"0": {"w1": {"cpu": "cpu"}}, "1": {"w0": {"cpu": "cpu"}}},
     [{"ok": [1.0, 1.0]}, {"ok": [2.0, 2.0]}]),
    # rank 1's map names a GPU that rank 0 lacks: both ranks refuse, as TensorPipe's
    ({"1": {"w0": {"cpu": "cuda:1"}}}, "Node w1 has target devices with invalid indices"),
], ids=["cpu-to-cpu", "missing-target-gpu"])
def test_init_rpc_checks_device_maps_as_tensorpipe_does(maps, expect, tmp_path) -> None:
    """(Every other refusal is compared with PyTorch's checks above, without processes.)"""
    if torch.cuda.device_count():
        pytest.skip("the cases assume a machine without CUDA devices")
    ours, theirs = _init_both("nbrpc", maps, tmp_path), _init_both("torch", maps, tmp_path)
    assert ours == theirs
    if isinstance(expect, str):  # every rank refused, with PyTorch's words first
        assert all(seen["error"] and seen["lines"][0].startswith(expect) for seen in ours)
    else:
        assert ours == expect


def test_a_tensor_on_a_device_nbrpc_does_not_move_is_refused_with_the_way_round_it() -> None:
    """CPU tensors travel, and CUDA ones along device maps; another device's (the
    meta device: every machine has it) is refused when pickled, naming its
    device and what to do instead."""
    from nbrpc.errors import SerializationError
    from nbrpc.serialize import dumps

    with pytest.raises(SerializationError, match=r"tensor on meta: move it with \.cpu\(\)"):
        dumps({"x": torch.empty(3, device="meta")})


# -- where each tensor of a message lands -----------------------------------------------
# PyTorch's texts, as its CUDA RPC tests match them (rpc_test.py)
NO_REQUEST_MAP = ("TensorPipe RPC backend only supports CPU tensors by default.*"
                  "`set_device_map` on `TensorPipeRpcBackendOptions`")
NO_RESPONSE_MAP = "Response device mapping is not available"


@pytest.mark.parametrize("device, mapping, is_request, lands", [
    ("cpu", None, True, "cpu"),  # CPU tensors need no map
    ("cpu", {"cuda:0": "cuda:1"}, True, "cpu"),  # nor a map that does not name "cpu"
    ("cpu", {"cpu": "cuda:0"}, True, "cuda:0"),  # test_device_map_cpu_to_gpu_default
    ("cuda:0", {"cuda:0": "cpu"}, True, "cpu"),  # test_device_map_gpu_to_cpu_default
    ("cuda:1", {"cuda:0": "cuda:1", "cuda:1": "cuda:0"}, False, "cuda:0"),
    ("cuda:0", None, True, NO_REQUEST_MAP),  # test_device_maps_missing_config
    ("cuda:0", None, False, NO_RESPONSE_MAP),  # ..._missing_config_response
    ("cuda:1", {"cuda:0": "cuda:0"}, True, "Request device mapping is not available for "
                                           "destination w1 for device cuda:1 but received"),
])
def test_each_tensor_lands_where_pytorchs_rules_put_it(device, mapping, is_request, lands
                                                     ) -> None:
    from nbrpc.agent.devices import target_device
    from nbrpc.errors import DeviceRouteError

    if lands.startswith(("cpu", "cuda")):
        assert target_device(device, mapping, "w1", is_request, "w0") == lands
        return
    with pytest.raises(DeviceRouteError, match=lands) as e:
        target_device(device, mapping, "w1", is_request, "w0")
    assert isinstance(e.value, RuntimeError) and e.value.worker == "w1"
    assert "\nnbrpc: " in str(e.value)  # then nbrpc's advice


class _Message:
    """A message's context as a reducer sees it: maps "cpu" to a GPU."""

    maps_cpu = True
    undo = None

    def __init__(self, lands: str) -> None:
        self.lands = lands

    def target(self, device: str) -> str:
        return self.lands if device == "cpu" else device


@pytest.mark.parametrize("lands", ["cuda:0", "cpu"])
def test_a_cpu_tensor_a_map_sends_to_a_gpu_is_copied_there_on_arrival(monkeypatch, lands) -> None:
    """Pickling asks the message's map where a CPU tensor lands; the receiver puts
    it there before autograd sees it (the copy is stood in for: no GPU here)."""
    from nbrpc.serialize import dumps, loads, pickler

    moved: list[str] = []

    def onto(t: torch.Tensor, device: str) -> torch.Tensor:
        moved.append(device)
        return t.clone()

    monkeypatch.setattr(pickler, "_onto", onto)
    x = torch.arange(6.0).reshape(2, 3).requires_grad_()
    got = loads(*dumps({"x": x, "view": x.detach().t()}, _Message(lands)))
    assert moved == ([lands, lands] if lands != "cpu" else [])
    assert torch.equal(got["x"], x) and got["x"].requires_grad
    assert torch.equal(got["view"], x.detach().t())


def test_requests_follow_the_senders_map_and_answers_the_callers_inverted() -> None:
    """Each agent's routes, in a group whose maps name only the CPU (all this
    machine has); the agents share this process, so each is "process" to the
    other."""
    from conftest import local_group

    w0 = DeviceConfig(0, (("w1", (("cpu", "cpu"),)),))
    with local_group(["w0", "w1"], per_rank={0: {"devices": w0}}) as (a0, a1):
        assert a0.device_map_to(1, reply=False) == {"cpu": "cpu"}
        assert a0.device_map_to(1, reply=True) is None  # w1 has no map to w0
        assert a1.device_map_to(0, reply=True) == {"cpu": "cpu"}  # w0's map, inverted
        assert a1.device_map_to(0, reply=False) is None
        assert a0.cpu_mapped and a1.cpu_mapped
        assert a0.peer_place(1) == a1.peer_place(0) == a0.peer_place(0) == "process"
        assert torch.equal(a0.rpc_sync("w1", torch.add, (torch.ones(2), 1)), torch.full((2,), 2.))
        assert torch.equal(a1.rpc_sync("w0", torch.add, (torch.ones(2), 2)), torch.full((2,), 3.))


def test_with_gpus_each_pair_maps_home_to_home_unless_a_map_is_given() -> None:
    """``Cluster(gpus=True)``: a member's record names its own device; between
    two members with homes and no map, requests go home to home and answers
    back. A map given for a pair wins. (The peer's count is claimed, not real:
    only routes are asked, no tensor moves.)"""
    from conftest import local_group

    from nbrpc.cluster.gpus import config

    driver = config(0, (("w2", (("cpu", "cpu"),)),), True, count=0)  # a kernel with no GPU
    worker = DeviceConfig(count=2, home="cuda:1")
    with local_group(["w0", "w1", "w2"], per_rank={0: {"devices": driver},
                                                   1: {"devices": worker},
                                                   2: {"devices": worker}}) as (a0, a1, a2):
        assert driver.home == "cpu" and a0.cpu_mapped
        assert a0.device_map_to(1, reply=False) == {"cpu": "cuda:1"}
        assert a0.device_map_to(1, reply=True) == {"cpu": "cuda:1"}  # w1's {cuda:1: cpu}, inverted
        assert a1.device_map_to(0, reply=False) == {"cuda:1": "cpu"}
        assert a1.device_map_to(0, reply=True) == {"cuda:1": "cpu"}
        assert a1.device_map_to(2, reply=False) == {"cuda:1": "cuda:1"}
        assert a0.device_map_to(2, reply=False) == {"cpu": "cpu"}  # the map given
        assert plan("w1", {m.name: m.devices for m in a1.members.members()}).devices == ("cuda:1",)
    with pytest.raises(DeviceMapError, match="Node w1 has an invalid home device cuda:1"):
        check({"w1": DeviceConfig(count=1, home="cuda:1")})


def test_cuda_ipc_only_to_a_process_of_this_host_that_numbers_the_gpus_alike(monkeypatch) -> None:
    """Where a CUDA tensor goes by IPC: a peer on this host whose
    CUDA_VISIBLE_DEVICES is this process's (IPC handles name a device by its
    index). Agents of one process hand over in-process; here they are made to
    look like processes of their own."""
    from conftest import local_group

    from nbrpc.agent import agent as agent_module

    per_rank = {0: {"devices": DeviceConfig(1)}, 1: {"devices": DeviceConfig(1)},
                2: {"devices": DeviceConfig(1, visible="1")}}
    with local_group(["w0", "w1", "w2", "w3"], per_rank=per_rank) as (a0, *_):
        assert a0.peer_place(1) == "process"
        monkeypatch.setattr(agent_module, "_IN_THIS_PROCESS", set())
        assert a0.peer_place(0) == "process"  # itself
        assert a0.peer_place(1) == "host"  # same host, same numbering
        assert a0.peer_place(2) == "remote"  # another numbering: staged
        assert a0.peer_place(3) == "remote"  # published no devices: staged


def test_cpu_tensors_ask_their_route_only_while_a_map_in_the_group_names_the_cpu() -> None:
    """``Agent.cpu_mapped`` (the reducer's cue to ask where a CPU tensor lands)
    follows the group: set by this agent's maps or its home on the CPU, or by a
    current member's map to it; cleared when that member has gone."""
    from types import SimpleNamespace

    from nbrpc.agent.agent import Agent
    from nbrpc.agent.members import MemberTable
    from nbrpc.agent.messages import Member

    def agent(mine: DeviceConfig | None, *others: Member) -> SimpleNamespace:
        table = MemberTable()
        me = Member("w0", 0, "tcp://127.0.0.1:1", devices=mine)
        for m in (me, *others):
            table.add(m)
        return SimpleNamespace(me=me, name="w0", rank=0, members=table)

    to_w0 = Member("w1", 1, "tcp://127.0.0.1:2",
                   devices=DeviceConfig(1, (("w0", (("cuda:0", "cpu"),)),)))
    plain = Member("w2", 2, "tcp://127.0.0.1:3", devices=DeviceConfig(1))
    assert not Agent._maps_cpu(agent(None, plain))
    assert not Agent._maps_cpu(agent(DeviceConfig(1, (("w1", (("cuda:0", "cuda:0"),)),)), plain))
    assert Agent._maps_cpu(agent(DeviceConfig(0, (("w1", (("cpu", "cpu"),)),))))
    assert Agent._maps_cpu(agent(DeviceConfig(0, home="cpu")))
    with_w1 = agent(None, to_w0, plain)
    assert Agent._maps_cpu(with_w1)
    with_w1.members.remove(1, "left the group")
    assert not Agent._maps_cpu(with_w1)
