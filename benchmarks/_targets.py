"""Remote functions for ``bench_rpc.py``.

They live in their own importable module so that both libraries pickle them
by reference (a function defined in ``__main__`` would be pickled by value by
nbrpc's cloudpickle, which is not what either library does in a real job).
This module must not import ``nbrpc`` or ``torch.distributed.rpc``: every
benchmark process loads exactly one RPC library.
"""

from __future__ import annotations

import threading
from typing import Any

_released = threading.Event()


def noop() -> None:
    """The cheapest possible call: no arguments, returns None."""
    return None


def echo(x: Any) -> Any:
    """Send the argument straight back (used with tensors)."""
    return x


def small(i: int) -> tuple[int, str]:
    """A small value for ``remote()`` + ``to_here()``."""
    return (i + 1, "ok")


# The shape of notebook code: a function that uses a class with 60 methods.
# Run here, it is importable (both libraries pickle it by reference); nbrpc's
# rank 0 also runs it in a namespace named __main__, where cloudpickle pickles
# it by value, as it does a notebook cell's code (bench_rpc.py, row 10).
BIG_SOURCE = (
    "class Big:\n"
    + "".join(f"    def m{i}(self, x):\n        return x + {i}\n\n" for i in range(60))
    + "\ndef use_big(x):\n    return Big().m3(x)\n"
)
exec(BIG_SOURCE)  # defines Big and use_big in this module


def rss_mb() -> float:
    """This process's resident set size (VmRSS) in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("VmRSS not found in /proc/self/status")


def release() -> bool:
    """Called by rank 0 on rank 1 when measuring is over."""
    _released.set()
    return True


def wait_released(timeout: float) -> bool:
    """Rank 1 blocks here (bounded) while it serves rank 0's calls."""
    return _released.wait(timeout)


# -- the create/fork/delete cycles ---------------------------------------------------
_made: list[int] = []  # the generation of every Value built on this worker by remote()
_freed: list[int] = []  # ... and of every one freed (list.append is atomic: no lock in __del__)


class Value:
    """A small value that counts, on the worker that built it, its own
    creation and its freeing (``__del__``). Copies made by pickling (what
    ``to_here()`` returns) are built with ``home=False`` and count nothing,
    so a worker that is both an owner and a user counts only what it owns.
    ``gen`` tells apart the values of successive rounds."""

    __slots__ = ("gen", "i", "home")

    def __init__(self, gen: int, i: int, home: bool = True) -> None:
        self.gen, self.i, self.home = gen, i, home
        if home:
            _made.append(gen)

    def __reduce__(self) -> tuple:
        return (Value, (self.gen, self.i, False))

    def __del__(self) -> None:
        if self.home:
            _freed.append(self.gen)


def value_counts(gen: int) -> tuple[int, int]:
    """(built, freed) Values of generation ``gen`` owned by this worker."""
    return _made.count(gen), _freed.count(gen)


def use(rref: Any) -> int:
    """Runs on the worker an RRef was forked to: fetch the value, return its index."""
    return rref.to_here().i


# -- distributed autograd ------------------------------------------------------------
def new_weight(n: int, seed: int) -> Any:
    """An ``n``×``n`` leaf tensor that requires grad, built on (and owned by) the
    worker that runs this: the target of ``remote()``, so the caller holds an RRef."""
    import torch  # here: nothing else in this module needs torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, n, generator=gen).requires_grad_()


def matmul_rref(x: Any, w_rref: Any) -> Any:
    """Runs on the owner of ``w_rref``: ``x @ W`` (recorded by distributed autograd)."""
    return x @ w_rref.local_value()


def new_mlp(depth: int, width: int) -> Any:
    """``depth`` layers of ``Linear(width, width)`` and ``tanh``, seeded: the
    deep graph's model, built on (and owned by) the worker that runs this."""
    import torch

    torch.manual_seed(depth)
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def mlp_rref(x: Any, mlp_rref: Any) -> Any:
    """Runs on the owner of ``mlp_rref``: the model on ``x``."""
    return mlp_rref.local_value()(x)


def first_weight_grad(ctx: int, model_rref: Any) -> Any:
    """Runs on the owner of ``model_rref`` (a ``Sequential``, or a :class:`Shard`
    holding one): its first layer's weight gradient in distributed autograd
    context ``ctx`` (whichever library runs it)."""
    model = model_rref.local_value()
    layers = model.seq if isinstance(model, Shard) else model
    return _dist_autograd().get_gradients(ctx)[layers[0].weight]


class Shard:
    """One stage of a pipeline (bench_rpc.py's ``pipeline`` case, as PyTorch's
    pipeline tutorial's ``ResNetShard``): ``depth`` layers of ``Linear(width,
    width)`` and ``ReLU``, seeded, built on the worker that owns it; ``forward``
    takes the RRef of its input and runs under the shard's lock."""

    def __init__(self, seed: int, width: int, depth: int) -> None:
        import torch

        torch.manual_seed(seed)
        self.lock = threading.Lock()
        layers = []
        for _ in range(depth):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        self.seq = torch.nn.Sequential(*layers)

    def forward(self, x_rref: Any) -> Any:
        x = x_rref.to_here()
        with self.lock:
            return self.seq(x)

    def parameter_rrefs(self) -> list:
        return [_rref_type()(p) for p in self.seq.parameters()]

    def copy(self) -> Any:
        """The layers, for a local copy of the pipeline."""
        import copy

        return copy.deepcopy(self.seq)


def _dist_autograd() -> Any:
    import sys

    return sys.modules.get("nbrpc.autograd") or sys.modules["torch.distributed.autograd"]


def _rref_type() -> Any:
    import sys

    return (sys.modules.get("nbrpc.rpc") or sys.modules["torch.distributed.rpc"]).RRef


# -- workers computing at once (bench_compute.py) -------------------------------------
def train_steps(steps: int, n: int, seed: int) -> tuple[int, float, int]:
    """``steps`` SGD steps of a two-layer ``Linear(n, n)`` model on a batch of
    ``n``, here: (steps, seconds they took, torch's intra-op threads here)."""
    import time

    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(n, n), torch.nn.ReLU(), torch.nn.Linear(n, n))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(n, n), torch.randn(n, n)
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return steps, time.perf_counter() - t0, torch.get_num_threads()


def numpy_steps(steps: int, n: int, seed: int) -> tuple[int, float, int]:
    """``steps`` layers of a numpy policy, ``x = tanh(x @ W)`` with ``n x n``
    float32 matrices (RL observers' or a data pipeline's numpy), here: (steps,
    seconds they took, threads of numpy's BLAS library here)."""
    import time

    import numpy as np
    from threadpoolctl import threadpool_info

    rng = np.random.default_rng(seed)
    w = (rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32)
    x = rng.standard_normal((n, n)).astype(np.float32)
    t0 = time.perf_counter()
    for _ in range(steps):
        x = np.tanh(x @ w)
    seconds = time.perf_counter() - t0
    blas = [lib["num_threads"] for lib in threadpool_info() if lib["user_api"] == "blas"]
    return steps, seconds, blas[0] if blas else 0
