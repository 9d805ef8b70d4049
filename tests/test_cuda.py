"""CUDA tensors over RPC, in three real processes on one host (``make test-gpu``).

Skipped where no GPU is found: availability is asked of NVML
(``PYTORCH_NVML_BASED_CUDA_CHECK=1``), so this process never initializes CUDA
before spawning its workers. The workers' maps:

* w0 -> w1: ``{"cuda:0": "cuda:0"}`` and w1 -> w0 the same (IPC both ways);
* w0 -> w2: ``{"cpu": "cuda:0"}`` (CPU tensors land on w2's GPU; its answers
  on cuda:0 come back to w0's CPU); w2 has no map at all.

Every result is compared with the same computation done in one process.
"""

from __future__ import annotations

import json
import os
import traceback

import pytest
import torch

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="no CUDA device here: the cuda tier runs where one is "
                              "(make test-gpu)"),
]

MAPS = {0: {"w1": {"cuda:0": "cuda:0"}, "w2": {"cpu": "cuda:0"}},
        1: {"w0": {"cuda:0": "cuda:0"}},
        2: {}}


def where(t: torch.Tensor) -> str:
    return str(t.device)


def on_gpu(n: int) -> torch.Tensor:
    return torch.arange(float(n), device="cuda:0")


def seeded_linear() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(8, 4)


def counts() -> dict:
    from nbrpc.serialize import cuda

    return dict(cuda.counts)


def _checks(rank: int, rpc, dist_autograd) -> dict:
    """What rank ``rank`` saw, check by check: {name: value or "error: ..."}."""
    seen: dict = {}

    def check(name, fn):
        try:
            seen[name] = fn()
        except Exception as e:  # noqa: BLE001 - what the call raised is the observation
            seen[name] = f"error: {type(e).__name__}: {e}"

    if rank == 0:
        x = torch.randn(1000, 250, device="cuda:0")
        check("echo small", lambda: (where(y := rpc.rpc_sync("w1", torch.mul, (x[:2], 1))),
                                     torch.equal(y, x[:2])))
        big = torch.randn(16 << 20, device="cuda:0")  # 64 MB
        check("echo 64MB by IPC", lambda: (
            torch.equal(rpc.rpc_sync("w1", torch.clone, (big,)), big),
            rpc.rpc_sync("w1", counts)["ipc"] > 0))
        check("a view keeps its elements", lambda: torch.equal(
            rpc.rpc_sync("w1", torch.clone, (x.t(),)), x.t()))
        check("made on the callee's GPU", lambda: (where(y := rpc.rpc_sync("w1", on_gpu, (5,))),
                                                   y.tolist()))
        check("remote and to_here", lambda: (
            where(y := rpc.remote("w1", torch.add, (x, 1)).to_here()), torch.equal(y, x + 1)))
        check("rpc_async then", lambda: rpc.rpc_async("w1", torch.mul, (x, 3)).then(
            lambda f: torch.equal(f.wait(), x * 3)).wait())

        def staged():
            from nbrpc.serialize import cuda
            cuda.no_ipc = "the test"
            try:
                before = counts()["staged"]
                y = rpc.rpc_sync("w1", torch.clone, (x.t(),))
                return where(y), torch.equal(y, x.t()), counts()["staged"] > before
            finally:
                cuda.no_ipc = None
        check("staged through host memory", staged)
        check("cpu lands on w2's gpu", lambda: (
            rpc.rpc_sync("w2", where, (torch.ones(2),)),
            where(y := rpc.rpc_sync("w2", torch.add, (torch.ones(2), 1))), y.tolist()))
        check("no map for cuda:0 to w2", lambda: rpc.rpc_sync("w2", torch.add, (x, 1)))
        check("to self, with no map to itself", lambda: rpc.rpc_sync("w0", torch.add, (x, 1)))
        w = torch.randn(250, 4, device="cuda:0", requires_grad=True)

        def autograd():
            with dist_autograd.context() as ctx:
                out = rpc.rpc_sync("w1", torch.matmul, (x, w))
                dist_autograd.backward(ctx, [out.sum()])
                got = dist_autograd.get_gradients(ctx)[w]
            expect = torch.autograd.grad(torch.matmul(x, w).sum(), w)[0]
            return where(got), torch.allclose(got, expect)
        check("dist autograd across GPUs", autograd)

        def training_step():
            from nbrpc.nn import RemoteModule
            from nbrpc.optim import DistributedOptimizer

            remote_lin = RemoteModule("w1/cuda:0", seeded_linear)
            local = seeded_linear().to("cuda:0")
            data = torch.randn(16, 8, device="cuda:0")
            opt = DistributedOptimizer(torch.optim.SGD, remote_lin.remote_parameters(), lr=0.1)
            with dist_autograd.context() as ctx:
                out = remote_lin(data)
                dist_autograd.backward(ctx, [out.pow(2).sum()])
                opt.step(ctx)
            local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
            local(data).pow(2).sum().backward()
            local_opt.step()
            after = [p.to_here() for p in remote_lin.remote_parameters()]
            return ([where(p) for p in after],
                    all(torch.allclose(a, b, atol=1e-6) for a, b in zip(after, local.parameters())))
        check("RemoteModule on w1's GPU, one SGD step", training_step)
    elif rank == 2:
        check("no request map", lambda: rpc.rpc_sync("w0", torch.add,
                                                     (torch.ones(2, device="cuda:0"), 1)))
        check("no response map", lambda: rpc.rpc_sync("w0", on_gpu, (3,)))
        check("still healthy", lambda: rpc.rpc_sync("w0", torch.add, (torch.ones(2), 1)).tolist())
    return seen


def _child(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from nbrpc import autograd as dist_autograd
    from nbrpc import rpc

    try:
        opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=8, rpc_timeout=60,
                                               device_maps=MAPS[rank])
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=3, rpc_backend_options=opts)
        seen = _checks(rank, rpc, dist_autograd)
        rpc.shutdown()
    except Exception:  # noqa: BLE001
        seen = {"<crash>": traceback.format_exc()}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(seen, f, default=str)


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict[int, dict]:
    import torch.multiprocessing as mp
    from conftest import free_ports

    out = str(tmp_path_factory.mktemp("cuda") / "seen")
    mp.start_processes(_child, args=(free_ports(1)[0], out), nprocs=3, join=True,
                       start_method="spawn")
    got = {r: json.loads(open(f"{out}.{r}").read()) for r in range(3)}
    for rows in got.values():
        assert "<crash>" not in rows, rows["<crash>"]
    return got


@pytest.mark.parametrize("name, expect", [
    ("echo small", ["cuda:0", True]),
    ("echo 64MB by IPC", [True, True]),
    ("a view keeps its elements", True),
    ("made on the callee's GPU", ["cuda:0", [0.0, 1.0, 2.0, 3.0, 4.0]]),
    ("remote and to_here", ["cuda:0", True]),
    ("rpc_async then", True),
    ("staged through host memory", ["cuda:0", True, True]),
    ("cpu lands on w2's gpu", ["cuda:0", "cpu", [2.0, 2.0]]),
    ("dist autograd across GPUs", ["cuda:0", True]),
    ("RemoteModule on w1's GPU, one SGD step", [["cuda:0", "cuda:0"], True]),
])
def test_the_driver_sees_what_one_process_computes(seen, name, expect) -> None:
    assert seen[0][name] == expect


def test_a_cuda_tensor_no_map_sends_fails_with_pytorchs_words(seen) -> None:
    assert seen[0]["no map for cuda:0 to w2"].startswith("error: DeviceRouteError: TensorPipe RPC "
                                                         "backend only supports CPU tensors")
    # as TensorPipe, a call to itself follows its map to itself, which w0 lacks
    assert "for destination w0" in seen[0]["to self, with no map to itself"]
    assert "Request device mapping is not available" in seen[2]["no request map"]
    assert "Response device mapping is not available" in seen[2]["no response map"]
    assert seen[2]["still healthy"] == [2.0, 2.0]
