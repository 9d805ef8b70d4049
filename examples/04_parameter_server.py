"""Notebook 04 as a script: a parameter server that batches the trainers'
updates with ``@rpc.functions.async_execution`` (synchronous data-parallel SGD).

Written as PyTorch's tutorial "Implementing Batch RPC Processing Using
Asynchronous Executions" writes it (``mp.spawn``, ``init_rpc``, a master that
creates the server with ``remote()`` and starts the trainers with
``rpc_async``); only the import names nbrpc. Run:
``python examples/04_parameter_server.py [--trainers N] [--batches B]``.
Rank 0 is the master, rank 1 the server ("ps"), ranks 2.. the trainers.
"""

from __future__ import annotations

import argparse
import os
import socket
import threading

import torch
import torch.multiprocessing as mp
from torch import nn

from nbrpc import rpc  # torch.distributed.rpc


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 3))


class BatchUpdateParameterServer:
    def __init__(self, batch_update_size: int, lr: float = 0.5) -> None:
        self.model = make_model()
        self.lock = threading.Lock()
        self.future_model = torch.futures.Future()
        self.batch_update_size = batch_update_size
        self.curr_update_size = 0
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr)
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)

    def get_model(self) -> nn.Module:
        return self.model

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(ps_rref: rpc.RRef, grads: list) -> torch.futures.Future:
        self = ps_rref.local_value()
        with self.lock:
            self.curr_update_size += 1
            for p, g in zip(self.model.parameters(), grads):
                p.grad += g
            fut = self.future_model
            if self.curr_update_size >= self.batch_update_size:
                for p in self.model.parameters():
                    p.grad /= self.batch_update_size
                self.curr_update_size = 0
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                fut.set_result(self.model)
                self.future_model = torch.futures.Future()
        return fut


def data(rank: int, trainers: int, batches: int) -> list:
    """This trainer's shard of three clusters of points in the plane."""
    g = torch.Generator().manual_seed(1)
    centres = torch.tensor([[0.0, 2.0], [-2.0, -1.0], [2.0, -1.0]])
    labels = torch.randint(0, 3, (32 * batches * trainers,), generator=g)
    points = centres[labels] + 0.7 * torch.randn(len(labels), 2, generator=g)
    i = rank - 2
    return list(zip(points[i::trainers].split(32), labels[i::trainers].split(32)))


def run_trainer(ps_rref: rpc.RRef, trainers: int, batches: int) -> tuple[float, float]:
    model = ps_rref.rpc_sync().get_model()
    losses = []
    for inputs, labels in data(rpc.get_worker_info().id, trainers, batches):
        loss = nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        losses.append(loss.item())
        model = rpc.rpc_sync(ps_rref.owner(), BatchUpdateParameterServer.update_and_fetch_model,
                             args=(ps_rref, [p.grad for p in model.parameters()]))
    return losses[0], losses[-1]


def run(rank: int, world_size: int, port: int, batches: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    trainers = world_size - 2
    name = "master" if rank == 0 else "ps" if rank == 1 else f"trainer{rank - 1}"
    rpc.init_rpc(name, rank=rank, world_size=world_size)
    if rank == 0:
        ps_rref = rpc.remote("ps", BatchUpdateParameterServer, args=(trainers,))
        futs = [rpc.rpc_async(f"trainer{t}", run_trainer, args=(ps_rref, trainers, batches))
                for t in range(1, trainers + 1)]
        for t, (first, last) in enumerate(torch.futures.wait_all(futs), 1):
            print(f"trainer{t}: loss {first:.3f} -> {last:.3f}", flush=True)
    rpc.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainers", type=int, default=2)
    parser.add_argument("--batches", type=int, default=15)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    world = args.trainers + 2
    mp.spawn(run, args=(world, port, args.batches), nprocs=world, join=True)


if __name__ == "__main__":
    main()
