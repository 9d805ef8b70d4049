"""Notebook 11 as a script: PyTorch's "Distributed Pipeline Parallelism Using
RPC" tutorial, with two MLP shards in place of ResNet50's (CPU only, seconds).

Each input batch is split into micro-batches; each micro-batch goes through
shard 1 on worker1 (``remote``, so its output stays there as an RRef) and on
to shard 2 on worker2 (``rpc_async`` with that RRef: worker2 fetches it from
worker1 directly), so worker1 can work on micro-batch i + 1 while worker2
works on micro-batch i. Trained with distributed autograd and
``DistributedOptimizer``, and checked at every step against the same model
trained locally.

Written as PyTorch's tutorial writes it (``mp.spawn`` + ``init_rpc`` +
``shutdown``, a master and two workers); only the imports name nbrpc instead
of ``torch.distributed``. Run:
``python examples/08_pipeline_parallelism.py [--splits 1 2 4 8] [--batches N]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import threading
import time

import torch
import torch.multiprocessing as mp
from torch import nn

from nbrpc import autograd as dist_autograd  # torch.distributed.autograd
from nbrpc import rpc  # torch.distributed.rpc
from nbrpc.optim import DistributedOptimizer  # torch.distributed.optim.DistributedOptimizer
from nbrpc.rpc import RRef

IN, HIDDEN, CLASSES = 256, 1024, 10
BATCH = 256
LR = 0.1


class ShardBase(nn.Module):
    """What both shards share: a lock (one micro-batch at a time through a
    shard, as the tutorial's ResNet shards), and their parameters as RRefs."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__()
        self._lock = threading.Lock()
        self.seq = nn.Sequential(*layers)

    def forward(self, x_rref: RRef) -> torch.Tensor:
        x = x_rref.to_here()
        with self._lock:
            return self.seq(x)

    def parameter_rrefs(self) -> list[RRef]:
        return [RRef(p) for p in self.parameters()]


class Shard1(ShardBase):
    def __init__(self) -> None:
        torch.manual_seed(1)  # (the same weights in every process that builds one)
        super().__init__(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU())


class Shard2(ShardBase):
    def __init__(self) -> None:
        torch.manual_seed(2)
        super().__init__(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))


class DistNet(nn.Module):
    """The two shards stitched together, the batch pipelined in ``split_size`` rows."""

    def __init__(self, split_size: int, workers: list[str]) -> None:
        super().__init__()
        self.split_size = split_size
        self.p1_rref = rpc.remote(workers[0], Shard1)
        self.p2_rref = rpc.remote(workers[1], Shard2)

    def forward(self, xs: torch.Tensor) -> torch.Tensor:
        out_futures = []
        for x in xs.split(self.split_size, dim=0):
            x_rref = RRef(x)
            y_rref = self.p1_rref.remote().forward(x_rref)
            z_fut = self.p2_rref.rpc_async().forward(y_rref)
            out_futures.append(z_fut)
        return torch.cat(torch.futures.wait_all(out_futures))

    def parameter_rrefs(self) -> list[RRef]:
        return (self.p1_rref.remote().parameter_rrefs().to_here()
                + self.p2_rref.remote().parameter_rrefs().to_here())

    def local_copy(self) -> nn.Sequential:
        """The same model in this process, with the shards' current weights."""
        shards = []
        for cls, rref in ((Shard1, self.p1_rref), (Shard2, self.p2_rref)):
            shard = cls()
            shard.load_state_dict(rref.rpc_sync().state_dict())
            shards.append(shard.seq)
        return nn.Sequential(*shards)


def data(batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Batches of points around 10 random centres, labelled by their centre."""
    g = torch.Generator().manual_seed(3)
    centres = torch.randn(CLASSES, IN, generator=g)
    out = []
    for _ in range(batches):
        labels = torch.randint(CLASSES, (BATCH,), generator=g)
        out.append((centres[labels] + 2 * torch.randn(BATCH, IN, generator=g), labels))
    return out


def run_master(num_split: int, batches: int) -> tuple[float, list[float]]:
    """Train on ``batches`` batches, each in ``num_split`` micro-batches; check each
    step's loss against the local model's. Returns the time and the losses."""
    model = DistNet(BATCH // num_split, ["worker1", "worker2"])
    local = model.local_copy()
    opt = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=LR)
    local_opt = torch.optim.SGD(local.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    losses, elapsed = [], 0.0
    for inputs, labels in data(batches):
        tik = time.perf_counter()
        with dist_autograd.context() as context_id:
            loss = loss_fn(model(inputs), labels)
            dist_autograd.backward(context_id, [loss])
            opt.step(context_id)
        elapsed += time.perf_counter() - tik
        losses.append(loss.item())

        local_opt.zero_grad()
        local_loss = loss_fn(local(inputs), labels)
        local_loss.backward()
        local_opt.step()
        if not torch.isclose(loss, local_loss, rtol=1e-4, atol=1e-6):
            raise AssertionError(f"step {len(losses)}: loss {loss.item()} against the "
                                 f"local model's {local_loss.item()}")
    return elapsed, losses


def run_worker(rank: int, world_size: int, port: int, splits: list[int], batches: int
               ) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if rank == 0:
        rpc.init_rpc("master", rank=rank, world_size=world_size)
        for num_split in splits:
            elapsed, losses = run_master(num_split, batches)
            print(f"number of splits = {num_split}, execution time = {elapsed:.3f} s, "
                  f"loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
                  "equal to the local model's at every step", flush=True)
    else:
        rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    rpc.shutdown()  # blocks until every RPC in the group is done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8],
                        help=f"micro-batches per batch of {BATCH} (divisors of {BATCH})")
    parser.add_argument("--batches", type=int, default=10)
    args = parser.parse_args()
    if any(n < 1 or BATCH % n for n in args.splits):
        parser.error(f"--splits: each must divide the batch of {BATCH}, got {args.splits}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_worker, args=(3, port, args.splits, args.batches), nprocs=3, join=True)


if __name__ == "__main__":
    main()
