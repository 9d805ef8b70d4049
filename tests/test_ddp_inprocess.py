"""DistributedDataParallel under distributed autograd, with agents in this
process: DDP's reducer hooks a parameter's ``AccumulateGrad`` in C++, and a
distributed backward pass must run those hooks on the context's gradients, as
PyTorch's does (``torch/testing/_internal/distributed/ddp_under_dist_autograd_test.py``
checks the same across processes, in ``tests/test_torch_suites.py``).

A process group of one (gloo) cannot show an average, so DDP's gradients go
through a communication hook that doubles them: a context's gradients for the
DDP module's parameters are twice what local autograd gives without DDP."""

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from conftest import local_group
from test_autograd_inprocess import acting_as, make_param, tanh_mm
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nbrpc import autograd as dist_autograd
from nbrpc.optim import DistributedOptimizer
from nbrpc.rpc import RRef, remote, rpc_sync


@pytest.fixture
def group() -> Iterator[list]:
    """Agents a and b, and a gloo process group of one in this process (which
    puts the engine in native mode); both gone afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with local_group(["a", "b"]) as agents, acting_as(agents[0]):
            yield agents
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def doubled(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook: the bucket's gradients, times two."""
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer() * 2)
    return fut


class Sandwich(nn.Module):
    """fc1 here, a matmul on worker b, fc2 here: under DDP, fc2's gradients
    arrive in the pass's first stage and fc1's in a later one, after b's."""

    def __init__(self, wb: RRef) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2 = nn.Linear(4, 3), nn.Linear(2, 1)
        self.wb = wb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(rpc_sync("b", tanh_mm, (self.fc1(x), self.wb)))


def _local_grads(model: nn.Module, wb: torch.Tensor, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same computation in one process, without DDP or RPC."""
    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    h = torch.tanh((x @ params["fc1.weight"].T + params["fc1.bias"]) @ wb)
    (h @ params["fc2.weight"].T + params["fc2.bias"]).sum().backward()
    return {n: p.grad for n, p in params.items()}


def doubling_ddp(seed: int) -> tuple[Sandwich, DDP, torch.Tensor, dict[str, torch.Tensor]]:
    """A Sandwich under DDP with the doubling hook, an input, and the local
    gradients its parameters should get (before doubling)."""
    wb = remote("b", make_param, (seed, 3, 2))
    model = Sandwich(wb)
    ddp = DDP(model)
    ddp.register_comm_hook(None, doubled)
    x = make_param(seed + 10, 5, 4).detach()
    return model, ddp, x, _local_grads(model, wb.to_here().detach(), x)


def test_ddp_hooks_run_on_the_contexts_gradients_in_every_stage(group) -> None:
    model, ddp, x, expected = doubling_ddp(1)
    for _ in range(2):  # the reducer is ready for a second iteration
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [ddp(x).sum()])
            got = dist_autograd.get_gradients(ctx)
            assert rpc_sync("b", _grad_of, (ctx, model.wb)) is not None  # (b's W)
        for name, p in model.named_parameters():
            assert torch.allclose(got[p], 2 * expected[name]), name
            assert p.grad is None  # the context's, not .grad


def _grad_of(ctx: int, w: RRef) -> torch.Tensor | None:
    return dist_autograd.get_gradients(ctx).get(w.local_value())


def test_a_users_grad_is_kept_and_the_optimizer_steps_with_ddps_gradients(group) -> None:
    model, ddp, x, expected = doubling_ddp(2)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    mine = {p: torch.full_like(p, 7.0) for p in model.parameters()}
    for p, g in mine.items():
        p.grad = g
    opt = DistributedOptimizer(torch.optim.SGD, [RRef(p) for p in model.parameters()], lr=0.1)
    with dist_autograd.context() as ctx:
        dist_autograd.backward(ctx, [ddp(x).sum()])
        opt.step(ctx)
    for name, p in model.named_parameters():
        assert p.grad is mine[p] and torch.equal(p.grad, torch.full_like(p, 7.0))
        assert torch.allclose(p.detach(), before[name] - 0.1 * 2 * expected[name]), name
