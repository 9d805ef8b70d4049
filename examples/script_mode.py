"""Script mode, as in PyTorch's RPC tutorials: only the import differs.

Run: ``python examples/script_mode.py`` (or ``make lab`` for now). Three
processes start with torch.multiprocessing.spawn; the "driver" calls the two
workers, keeps a counter on one of them through an RRef, and shuts down.
"""

from __future__ import annotations

import logging
import os
import socket

import torch
import torch.multiprocessing as mp

from nbrpc import rpc

log = logging.getLogger("script_mode")


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def add(self, k: int) -> int:
        self.n += k
        return self.n


def square_sum(x: torch.Tensor) -> torch.Tensor:
    return (x * x).sum()


def run(rank: int, world_size: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    name = "driver" if rank == 0 else f"worker{rank}"
    rpc.init_rpc(name, rank=rank, world_size=world_size)
    if rank == 0:
        x = torch.arange(6.0)
        futs = [rpc.rpc_async(f"worker{r}", square_sum, args=(x * r,)) for r in (1, 2)]
        print("sums of squares:", [f.wait().item() for f in futs])
        counter = rpc.remote("worker1", Counter)
        for k in (1, 2, 3):
            counter.rpc_sync().add(k)
        print("counter on", counter.owner_name(), "=", counter.to_here().n)
    rpc.shutdown()


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run, args=(3, port), nprocs=3, join=True)


if __name__ == "__main__":
    main()
