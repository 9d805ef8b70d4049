"""Notebook 03 as a script: the RNN of PyTorch's "Getting Started with
Distributed RPC Framework" (part 2), with the embedding table and the decoder
on a parameter server and the LSTM on the trainer, trained with distributed
autograd and DistributedOptimizer on a small generated corpus.

As the tutorial writes it (``mp.spawn``, rank 0 "ps" only serves, rank 1
"trainer" runs the loop); only the imports name nbrpc. Run:
``python examples/03_rnn_parameter_server.py [--epochs N]``.
"""

from __future__ import annotations

import argparse
import os
import socket

import torch
import torch.multiprocessing as mp
from torch import nn

from nbrpc import autograd as dist_autograd  # torch.distributed.autograd
from nbrpc import rpc  # torch.distributed.rpc
from nbrpc.optim import DistributedOptimizer  # torch.distributed.optim
from nbrpc.rpc import RRef


def _call_method(method, rref, *args, **kwargs):
    return method(rref.local_value(), *args, **kwargs)


def _remote_method(method, rref, *args, **kwargs):
    return rpc.rpc_sync(rref.owner(), _call_method, args=[method, rref, *args], kwargs=kwargs)


def _parameter_rrefs(module):
    return [RRef(p) for p in module.parameters()]


class EmbeddingTable(nn.Module):
    def __init__(self, ntoken, ninp):
        super().__init__()
        self.encoder = nn.Embedding(ntoken, ninp)
        self.encoder.weight.data.uniform_(-0.5, 0.5)

    def forward(self, input):
        return self.encoder(input)


class Decoder(nn.Module):
    def __init__(self, ntoken, nhid):
        super().__init__()
        self.decoder = nn.Linear(nhid, ntoken)
        self.decoder.weight.data.uniform_(-0.5, 0.5)
        self.decoder.bias.data.zero_()

    def forward(self, output):
        return self.decoder(output)


class RNNModel(nn.Module):
    def __init__(self, ps, ntoken, ninp, nhid, nlayers):
        super().__init__()
        self.emb_table_rref = rpc.remote(ps, EmbeddingTable, args=(ntoken, ninp))
        self.rnn = nn.LSTM(ninp, nhid, nlayers)
        self.decoder_rref = rpc.remote(ps, Decoder, args=(ntoken, nhid))

    def forward(self, input, hidden):
        emb = _remote_method(EmbeddingTable.forward, self.emb_table_rref, input)
        output, hidden = self.rnn(emb, hidden)
        decoded = _remote_method(Decoder.forward, self.decoder_rref, output)
        return decoded, hidden

    def parameter_rrefs(self):
        return (_remote_method(_parameter_rrefs, self.emb_table_rref)
                + _parameter_rrefs(self.rnn)
                + _remote_method(_parameter_rrefs, self.decoder_rref))


def corpus(ntoken: int, seq_len: int, batch: int, n_batches: int) -> list:
    """Sentences where each token mostly determines the next (10% noise)."""
    g = torch.Generator().manual_seed(0)
    rule = torch.randperm(ntoken, generator=g)
    rows = []
    for _ in range(batch * n_batches):
        tokens = [int(torch.randint(ntoken, (1,), generator=g))]
        for _ in range(seq_len):
            noisy = torch.rand(1, generator=g).item() < 0.1
            tokens.append(int(torch.randint(ntoken, (1,), generator=g)) if noisy
                          else int(rule[tokens[-1]]))
        rows.append(tokens)
    data = torch.tensor(rows).T
    return [(data[:-1, i:i + batch], data[1:, i:i + batch].reshape(-1))
            for i in range(0, data.shape[1], batch)]


def run_trainer(epochs: int) -> None:
    ntoken, ninp, nhid, nlayers, seq_len, batch = 10, 16, 32, 2, 12, 8
    torch.manual_seed(0)
    model = RNNModel("ps", ntoken, ninp, nhid, nlayers)
    opt = DistributedOptimizer(torch.optim.SGD, model.parameter_rrefs(), lr=1.0)
    batches = corpus(ntoken, seq_len, batch, 30)
    losses = []
    for _ in range(epochs):
        hidden = (torch.zeros(nlayers, batch, nhid), torch.zeros(nlayers, batch, nhid))
        for data, target in batches:
            hidden = tuple(h.detach() for h in hidden)
            with dist_autograd.context() as context_id:
                output, hidden = model(data, hidden)
                loss = nn.functional.cross_entropy(output.reshape(-1, ntoken), target)
                dist_autograd.backward(context_id, [loss])
                opt.step(context_id)
            losses.append(loss.item())
    print(f"{len(losses)} iterations: loss {losses[0]:.2f} -> {losses[-1]:.2f}", flush=True)


def run_worker(rank: int, world_size: int, port: int, epochs: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if rank == 1:
        rpc.init_rpc("trainer", rank=rank, world_size=world_size)
        run_trainer(epochs)
    else:
        rpc.init_rpc("ps", rank=rank, world_size=world_size)
    rpc.shutdown()  # blocks until all RPCs finish


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    epochs = parser.parse_args().epochs
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(run_worker, args=(2, port, epochs), nprocs=2, join=True)


if __name__ == "__main__":
    main()
