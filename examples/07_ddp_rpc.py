"""PyTorch's "Combining Distributed DataParallel with Distributed RPC Framework"
tutorial as a script, on CPUs: two trainers hold a dense layer replicated with
DistributedDataParallel (a gloo process group of their own), and share an
embedding table that lives on a parameter server as a RemoteModule. Each
iteration is one distributed autograd pass and one DistributedOptimizer step:
DDP averages the dense layer's gradients between the trainers during the
pass, distributed autograd takes the embedding's to the parameter server.

Checked at every step: the dense layer's gradient in the context is the mean
of the two trainers' own gradients (computed again locally, and all-reduced
by hand); at the end, both trainers' replicas are identical.

Written as PyTorch's RPC tutorials write their programs (``mp.spawn`` +
``init_rpc`` + ``shutdown``); only the imports name nbrpc instead of
``torch.distributed``. Run: ``python examples/07_ddp_rpc.py [--epochs N]``.
Ranks 0 and 1 are the trainers, 2 the master, 3 the parameter server.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from nbrpc import autograd as dist_autograd  # torch.distributed.autograd
from nbrpc import rpc  # torch.distributed.rpc
from nbrpc.nn import RemoteModule  # torch.distributed.nn.RemoteModule
from nbrpc.optim import DistributedOptimizer  # torch.distributed.optim.DistributedOptimizer

NUM_EMBEDDINGS = 100
EMBEDDING_DIM = 16
NUM_CLASSES = 8


class HybridModel(nn.Module):
    """The sparse part: an EmbeddingBag on the parameter server (a RemoteModule).
    The dense part: a Linear layer, replicated on every trainer by DDP."""

    def __init__(self, remote_emb_module: RemoteModule) -> None:
        super().__init__()
        self.remote_emb_module = remote_emb_module
        self.fc = DDP(nn.Linear(EMBEDDING_DIM, NUM_CLASSES))

    def forward(self, indices: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.fc(self.remote_emb_module.forward(indices, offsets))


def batches(rank: int, n: int = 10) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """``n`` bags of embedding indices per trainer (its own), each labelled by
    its first index: something the model can learn."""
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(n):
        indices = torch.randint(0, NUM_EMBEDDINGS, (40,), generator=g)
        offsets = torch.arange(0, 40, 5)
        out.append((indices, offsets, indices[offsets] % NUM_CLASSES))
    return out


def _run_trainer(remote_emb_module: RemoteModule, rank: int, epochs: int) -> dict:
    model = HybridModel(remote_emb_module)
    dense = list(model.fc.parameters())
    # The embedding's parameters as RRefs (remote_parameters()), and the local ones.
    opt = DistributedOptimizer(torch.optim.SGD, remote_emb_module.remote_parameters()
                               + [rpc.RRef(p) for p in dense], lr=0.05)
    criterion = nn.CrossEntropyLoss()
    losses = []
    for _ in range(epochs):
        epoch_loss = 0.0
        for indices, offsets, target in batches(rank):
            with dist_autograd.context() as context_id:
                emb = remote_emb_module.forward(indices, offsets)
                loss = criterion(model.fc(emb), target)
                dist_autograd.backward(context_id, [loss])
                grads = dist_autograd.get_gradients(context_id)
                # the same gradient, by hand: this trainer's own, averaged
                own = torch.autograd.grad(criterion(model.fc.module(emb.detach()), target),
                                          dense)
                for p, g in zip(dense, own):
                    dist.all_reduce(g)
                    assert torch.allclose(grads[p], g / dist.get_world_size(), atol=1e-6)
                opt.step(context_id)
            epoch_loss += loss.item()
        losses.append(epoch_loss / len(batches(rank)))
    return {"losses": losses, "fc": [p.detach().clone() for p in dense]}


def run(rank: int, world_size: int, ports: tuple[int, int], epochs: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports[0]))
    if rank <= 1:  # the trainers: a process group for DDP, then RPC
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ports[1]}",
                                rank=rank, world_size=2)
        rpc.init_rpc(f"trainer{rank}", rank=rank, world_size=world_size)
    elif rank == 2:  # the master: builds the embedding on the parameter server, runs the trainers
        rpc.init_rpc("master", rank=rank, world_size=world_size)
        torch.manual_seed(0)
        emb = RemoteModule("ps", nn.EmbeddingBag, args=(NUM_EMBEDDINGS, EMBEDDING_DIM),
                           kwargs={"mode": "sum"})
        futs = [rpc.rpc_async(f"trainer{r}", _run_trainer, args=(emb, r, epochs))
                for r in (0, 1)]
        results = [fut.wait() for fut in futs]
        same = all(torch.equal(a, b) for a, b in zip(results[0]["fc"], results[1]["fc"]))
        assert same, "the trainers' DDP replicas differ"
        for r, res in enumerate(results):
            print(f"trainer{r}: loss {res['losses'][0]:.3f} -> {res['losses'][-1]:.3f}",
                  flush=True)
        print(f"{epochs} epochs: the dense layer's gradient was the trainers' mean at every "
              "step; both replicas identical", flush=True)
    else:  # the parameter server: serves the embedding
        rpc.init_rpc("ps", rank=rank, world_size=world_size)
    rpc.shutdown()
    if rank <= 1:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=20)
    epochs = parser.parse_args().epochs
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    mp.spawn(run, args=(4, tuple(ports), epochs), nprocs=4, join=True)


if __name__ == "__main__":
    main()
