"""Notebook 06 as a script: a pipeline of two RemoteModules and a local layer,
trained with distributed autograd and DistributedOptimizer, checked at every
step against the same model trained locally.

Written as PyTorch's RPC tutorials write their programs (``mp.spawn`` +
``init_rpc`` + ``shutdown``); only the imports name nbrpc instead of
``torch.distributed``. Run: ``python examples/06_remote_module.py [--epochs N]``.
Rank 0 ("trainer") runs the training loop; ranks 1 and 2 hold the remote layers.
"""

from __future__ import annotations

import argparse
import copy
import os
import socket

import torch
import torch.multiprocessing as mp
from torch import nn

from nbrpc import autograd as dist_autograd  # torch.distributed.autograd
from nbrpc import rpc  # torch.distributed.rpc
from nbrpc.nn import RemoteModule  # torch.distributed.nn.RemoteModule
from nbrpc.optim import DistributedOptimizer  # torch.distributed.optim.DistributedOptimizer


def seed(n: int) -> None:
    torch.manual_seed(n)


class Pipeline(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        rpc.rpc_sync("worker1", seed, args=(1,))
        rpc.rpc_sync("worker2", seed, args=(2,))
        torch.manual_seed(0)
        self.first = RemoteModule("worker1/cpu", nn.Linear, args=(16, 32))
        self.middle = nn.Sequential(nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.last = RemoteModule("worker2/cpu", nn.Linear, args=(32, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.last(self.middle(self.first(x)))

    def parameter_rrefs(self) -> list:
        return (self.first.remote_parameters()
                + [rpc.RRef(p) for p in self.middle.parameters()]
                + self.last.remote_parameters())


def train(epochs: int) -> None:
    model = Pipeline()
    local = nn.Sequential(model.first.get_module_rref().to_here(), copy.deepcopy(model.middle),
                          model.last.get_module_rref().to_here())
    g = torch.Generator().manual_seed(3)
    teacher = torch.randn(16, 4, generator=g)
    x = torch.randn(512, 16, generator=g)
    y = torch.tanh(x @ teacher)
    dist_opt = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=0.3)
    local_opt = torch.optim.SGD(local.parameters(), lr=0.3)
    losses, local_losses = [], []
    for _ in range(epochs):
        for xb, yb in zip(x.split(64), y.split(64)):
            with dist_autograd.context() as context_id:
                loss = nn.functional.mse_loss(model(xb), yb)
                dist_autograd.backward(context_id, [loss])
                dist_opt.step(context_id)
            losses.append(loss.item())
            local_opt.zero_grad()
            local_loss = nn.functional.mse_loss(local(xb), yb)
            local_loss.backward()
            local_opt.step()
            local_losses.append(local_loss.item())
    assert torch.allclose(torch.tensor(losses), torch.tensor(local_losses), rtol=1e-4)
    print(f"{len(losses)} steps: loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
          "equal to the local model's at every step", flush=True)


def run(rank: int, world_size: int, port: int, epochs: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    name = "trainer" if rank == 0 else f"worker{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world_size)
    if rank == 0:
        train(epochs)
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    epochs = parser.parse_args().epochs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(3, port, epochs), nprocs=3, join=True)


if __name__ == "__main__":
    main()
