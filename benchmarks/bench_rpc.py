"""nbrpc vs torch.distributed.rpc (TensorPipe), side by side on one machine.

Run it with ``make bench`` (or ``.venv/bin/python benchmarks/bench_rpc.py``);
``--quick`` runs a few iterations only (a smoke test), ``--markdown`` prints
the table as Markdown for the README, ``--cases autograd`` (or any comma list of
``rpc``, ``fork``, ``autograd``, ``pipeline``, ``trace``, ``cuda``) runs only those cases.

For each library the script starts two processes with
``torch.multiprocessing.spawn``; each calls
``init_rpc("workerN", rank=N, world_size=2)`` with ``MASTER_ADDR=127.0.0.1``
and a free ``MASTER_PORT`` (a different one per run) and the library's
default backend options (TensorPipe for torch). The create/fork/delete
cycles (7.) and the pipeline (13.) run afterwards in a group of their own, of three processes. Each process imports only
its own RPC library (``from nbrpc import rpc`` or
``import torch.distributed.rpc as rpc``). Rank 0 measures and writes its
results to a JSON file that this process reads; the others only serve. The
remote functions live in ``_targets.py`` so both libraries pickle them by
reference.

What is measured (rank 0 calling rank 1 over loopback):

1. ``rpc_sync`` of a no-op: median and p99 round trip (µs).
2. ``rpc_async`` throughput of no-op calls with at most 64 in flight
   (calls/s, median over a few rounds).
3. Echo of a float32 tensor of 4 KB, 1 MB and 64 MB (1 MB = 2**20 bytes):
   median round trip and bandwidth = 2 * size / median round trip
   (the tensor travels there and back; GB/s = 1e9 bytes/s). And of a sparse
   COO tensor shaped as an embedding table's gradient: 1,000 rows of 64
   floats out of 100,000 (256 KB of values): median round trip (µs).
4. ``remote()`` + ``RRef.to_here()`` of a small value: median (µs). The
   RRef is dropped at once; afterwards (untimed) a few more are made and the
   owner must free them all (else it is listed as a problem).
5. Start-up: from the first statement of the spawned function (``torch`` is
   already imported there by ``spawn``) to ``init_rpc`` returning, median
   over the two workers (ms). It includes the import of the RPC library,
   which is also shown alone (``import nbrpc.rpc`` /
   ``import torch.distributed.rpc`` after ``import torch``).
6. Memory: VmRSS increase of an agent over ``import torch`` after
   ``init_rpc`` and a few no-op calls, before any big tensor was sent (MiB),
   for the caller (rank 0) and the idle server (rank 1).
7. Create/fork/delete cycles across three workers (ranks 0, 1, 2): rank 0
   runs ``fork_cycles`` cycles of ``rref = remote(owner, Value, ...)`` (the
   owner alternates between workers 1 and 2), ``rpc_sync(other, use,
   args=(rref,))`` (forks the RRef to the other one, which calls
   ``to_here()``), ``del rref``; the clock stops when both owners have freed
   all their values (counted by ``Value.__del__`` there, polled by rank 0
   with ``rpc_sync`` every ~1 ms, polls included). Median over a few rounds
   (ms), and how much of it was waiting for the frees after the last cycle.
   Values not freed within ``fork_deadline_s`` of the last cycle are a
   failure (no number).
8. Distributed autograd (``nbrpc.autograd`` vs ``torch.distributed.autograd``):
   ``W`` (256×256, requires grad) is built on rank 1 by ``remote()``; rank 0
   holds ``x`` (256×256, requires grad) and the RRef. One iteration is
   ``with context() as ctx: y = rpc_sync(PEER, matmul_rref, args=(x, w_rref));
   backward(ctx, [y.sum()])`` (the owner computes ``x @ W``), context exit
   included: median (ms). The same plus ``DistributedOptimizer(SGD, [w_rref],
   lr=0.01).step(ctx)`` inside the context (the library's own optimizer).
   Reference: the same computation in one process (``(x @ W).sum().backward()``,
   plus ``SGD.step()``), measured in this (the parent) process before each
   repetition's runs, with no RPC agent alive anywhere (TensorPipe's busy-polling
   threads in a torch worker slow local compute on a 2-core machine down by up to
   10x); both columns show that one value. The gradients and the step are
   checked once after timing. And a deep graph, where running the autograd
   nodes is most of the work: the same iteration through a model of
   ``autograd_depth`` layers of ``Linear(64, 64)`` and ``tanh`` built on rank 1
   (``y = rpc_sync(PEER, mlp_rref, args=(x, mlp_rref))``, x 32×64), against
   the same model in one process. And micro-batches: the same x in
   ``autograd_splits`` slices, each its own ``rpc_async`` to the deep model,
   their outputs concatenated (``torch.futures.wait_all``) into one loss, as a
   pipeline feeds a stage: the peer's pass gets one message of gradients per
   slice, and its stages share the model's weights. And with DistributedDataParallel: the
   caller's ``DDP(Linear(n, n))`` (a gloo group of one, made for the
   measurement and destroyed after) feeds the same call, ``y = rpc_sync(PEER,
   matmul_rref, args=(ddp(x), w_rref))``; DDP's hooks run inside the pass (in
   nbrpc: the engine's native mode). Checked once: the layer's weight gradient.
9. Tracing (nbrpc only; torch has no equivalent, so its column repeats its
   untraced figure and the ratio is traced nbrpc over plain torch): 1. and 2.
   again inside ``nbrpc.debug.trace()``, and the time the block's exit takes to
   gather and pair the messages. Tracing reads the agents' always-on event
   logs, so rows 1.-2. are what "tracing off" costs.
10. Notebook code: ``rpc_sync`` of ``use_big(1)``, a function that uses a
    class with 60 methods (``_targets.BIG_SOURCE``), importable (both libraries)
    and, for nbrpc, the same source run in a namespace named ``__main__``, as a
    notebook cell's code is (cloudpickle pickles it by value; torch's pickler
    cannot send it at all). The two nbrpc variants alternate in rounds; medians
    (µs) and notebook-defined over importable (target: within 10%).
11. The pure-Python floor: a no-op call with Pyro5 (blocking sockets, one
    connection per proxy, a thread per connection), its server in a second
    process on 127.0.0.1, the client in this (the parent) process, with the
    ``marshal`` and ``serpent`` serializers, after each repetition's two
    libraries; shown against nbrpc's ``rpc_sync`` (skipped if Pyro5 is not
    installed: ``pip install Pyro5``, in the ``test`` extra).
12. CUDA tensors (where NVML finds a GPU; else left out, saying so): a group
    of its own whose two workers map their ``cuda:0`` to each other's. Echo
    of a float32 tensor on ``cuda:0`` of 4 KB and 64 MB, the clock stopped
    once the answer is usable on the caller's stream (bandwidth = 2 * size
    / median round trip); and one training step: a ``RemoteModule``
    ``Linear(1024, 1024)`` on the peer's ``cuda:0`` and a local one, batch
    64, distributed autograd and ``DistributedOptimizer(SGD)``, against the
    same two layers trained in one process (each library's rank 0 measures
    its own). This process never initializes CUDA (it forks nothing, but
    asks NVML only, as a fork server must).

13. A pipeline, as PyTorch's pipeline-parallelism tutorial splits ResNet50
    over two workers: rank 0 holds ``Shard`` objects (``_targets.Shard``:
    ``pipeline_depth`` layers of ``Linear(pipeline_width, pipeline_width)`` and
    ``ReLU`` each) made with ``remote()`` on ranks 1 and 2, and per iteration
    splits a batch of ``pipeline_batch`` rows into micro-batches; for each,
    ``y = p1.remote().forward(RRef(x))`` and ``p2.rpc_async().forward(y)``, the
    outputs concatenated (``torch.futures.wait_all``) into an MSE loss, then
    ``backward`` and ``DistributedOptimizer(SGD).step`` in the context: median
    (ms) for each count in ``pipeline_splits``, with each library's default
    threads. Rank 1's stages of the
    backward overlap rank 2's as the forward's do, where the library runs a
    pass's stages at once. Checked once before timing: the loss and the first
    layer's weight gradient against a local copy of both shards.

The targets from the issue are printed next to the metrics they apply to.
Every loop is bounded, and each library's run is killed after ``--timeout``
seconds (partial results are still shown). Calls that raise are counted and
listed under "problems"; the exit status is 1 when there are any.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _targets
import torch
import torch.multiprocessing as mp

LIBRARIES = ("nbrpc", "torch")
MODULES = {"nbrpc": "nbrpc.rpc", "torch": "torch.distributed.rpc"}
AUTOGRAD_MODULES = {"nbrpc": ("nbrpc.autograd", "nbrpc.optim"),
                    "torch": ("torch.distributed.autograd", "torch.distributed.optim")}
# --cases: the two-worker RPC set, the cycles, autograd, the same calls inside a trace,
# CUDA tensors along device maps (where a GPU is found: a group of its own)
CASES = ("rpc", "fork", "autograd", "pipeline", "trace", "cuda")
THREE_WORKERS = ("fork", "pipeline")  # the cases of the three-worker group
PEER = "worker1"
OWNERS = ("worker1", "worker2")  # of the create/fork/delete cycles
ECHO_SIZES = {"4 KB": 4 << 10, "1 MB": 1 << 20, "64 MB": 64 << 20}
CUDA_ECHO_SIZES = {"4 KB": 4 << 10, "64 MB": 64 << 20}
CUDA_STEP_N = 1024  # the training step's Linear(n, n) on each side, batch 64


@dataclasses.dataclass(frozen=True)
class Config:
    """Iteration counts: (warm-up, timed) pairs and the async set-up."""

    sync: tuple[int, int] = (200, 2000)
    async_calls: int = 2000
    async_rounds: int = 3
    async_window: int = 64
    echo: dict[str, tuple[int, int]] = dataclasses.field(default_factory=lambda: {
        "4 KB": (50, 1000), "1 MB": (10, 200), "64 MB": (2, 10)})
    sparse_echo: tuple[int, int] = (20, 300)
    remote: tuple[int, int] = (50, 500)
    remote_free_check: int = 20  # remote() + to_here() afterwards, whose values must be freed
    fork_cycles: int = 150
    fork_rounds: tuple[int, int] = (1, 5)  # (warm-up, timed) rounds of fork_cycles cycles
    fork_deadline_s: float = 60.0  # the frees must be over this long after the last cycle
    fork_poll_s: float = 0.001
    idle_calls: int = 20
    import_runs: int = 3
    autograd: tuple[int, int] = (50, 500)  # per case: fwd+bwd, and with the optimizer
    autograd_local: tuple[int, int] = (50, 500)  # the one-process reference
    autograd_n: int = 256  # x and W are n×n
    autograd_lr: float = 0.01
    autograd_depth: int = 24  # the deep graph: Linear(64, 64) + tanh layers, batch 32
    autograd_splits: int = 8  # micro-batches: slices of the deep graph's batch
    pipeline: tuple[int, int] = (3, 20)  # per micro-batch count
    pipeline_splits: tuple[int, ...] = (1, 4)
    pipeline_width: int = 1024
    pipeline_depth: int = 4
    pipeline_batch: int = 256
    cuda_echo: dict[str, tuple[int, int]] = dataclasses.field(default_factory=lambda: {
        "4 KB": (50, 1000), "64 MB": (5, 50)})
    cuda_step: tuple[int, int] = (20, 200)
    serve_timeout_s: float = 100.0  # rank 1 serves at most this long
    cases: tuple[str, ...] = CASES


QUICK = Config(sync=(20, 200), async_calls=500, async_rounds=1,
               echo={"4 KB": (5, 50), "1 MB": (2, 10), "64 MB": (1, 3)},
               sparse_echo=(5, 30), remote=(10, 50), fork_rounds=(1, 1), import_runs=1,
               autograd=(10, 40), autograd_local=(10, 40), pipeline=(1, 5),
               cuda_echo={"4 KB": (5, 50), "64 MB": (2, 5)}, cuda_step=(5, 20))


# -- helpers (both sides) ----------------------------------------------------------
def free_port(avoid: set[int]) -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now (and not in ``avoid``)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port
    raise RuntimeError("no free port found")


def percentile(samples: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(samples)
    k = max(0, min(len(ordered) - 1, round(q / 100.0 * len(ordered)) - 1))
    return ordered[k]


class CallsFailed(Exception):
    """Some calls of a benchmark raised; the timings of the others were kept."""


def time_calls(call: Callable[[], Any], warmup: int, timed: int,
               failures: list[str]) -> list[float]:
    """Run ``call`` warmup + timed times; the durations (s) of the timed calls that
    succeeded. A call that raises is counted in ``failures`` and not timed."""
    out = []
    for i in range(warmup + timed):
        t = time.perf_counter()
        try:
            call()
        except Exception as e:
            failures.append(f"call {i}: {type(e).__name__}: {e}")
            continue
        if i >= warmup:
            out.append(time.perf_counter() - t)
    if not out:
        raise CallsFailed(f"all {warmup + timed} calls failed; first: {failures[0]}")
    return out


def check_failures(failures: list[str], calls: int) -> None:
    if failures:
        raise CallsFailed(f"{len(failures)} of {calls} calls failed (timings kept for the "
                          f"others); first: {failures[0]}")


def bench_sync(rpc: Any, cfg: Config, failures: list[str]) -> dict[str, float]:
    samples = time_calls(lambda: rpc.rpc_sync(PEER, _targets.noop), *cfg.sync, failures)
    return {"sync_median_us": statistics.median(samples) * 1e6,
            "sync_p99_us": percentile(samples, 99) * 1e6}


def async_round(rpc: Any, calls: int, window: int) -> float:
    """``calls`` no-op rpc_async with at most ``window`` in flight; calls/s."""
    pending: deque = deque()
    t = time.perf_counter()
    for _ in range(calls):
        if len(pending) >= window:
            pending.popleft().wait()
        pending.append(rpc.rpc_async(PEER, _targets.noop))
    while pending:
        pending.popleft().wait()
    return calls / (time.perf_counter() - t)


def bench_async(rpc: Any, cfg: Config, failures: list[str]) -> dict[str, float]:
    async_round(rpc, max(1, cfg.async_calls // 10), cfg.async_window)  # warm-up
    rates = [async_round(rpc, cfg.async_calls, cfg.async_window) for _ in range(cfg.async_rounds)]
    return {"async_calls_per_s": statistics.median(rates)}


def busy_sync_reps(cfg: Config) -> tuple[int, int]:
    """Warm-up and timed rpc_sync calls beside a busy thread: a tenth of the
    plain row's (each costs a switch interval there, about 5 ms)."""
    return max(1, cfg.sync[0] // 10), max(1, cfg.sync[1] // 10)


def bench_busy_thread(rpc: Any, cfg: Config, failures: list[str]) -> dict[str, float]:
    """rpc_sync and rpc_async while another Python thread of the caller's process
    runs pure Python (a training loop, a data loader, a notebook's poller): a
    thread that dropped the GIL waits up to ``sys.getswitchinterval()`` (5 ms)
    to get it back, so what counts is how often a call drops it."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for _ in range(1000):
                x += 1

    th = threading.Thread(target=spin, daemon=True)
    th.start()
    try:
        samples = time_calls(lambda: rpc.rpc_sync(PEER, _targets.noop), *busy_sync_reps(cfg),
                             failures)
        rate = async_round(rpc, max(1, cfg.async_calls // 4), cfg.async_window)
    finally:
        stop.set()
        th.join(timeout=10)
    return {"busy_sync_median_us": statistics.median(samples) * 1e6,
            "busy_async_calls_per_s": rate}


def bench_echo(rpc: Any, label: str, reps: tuple[int, int],
               failures: list[str]) -> dict[str, float]:
    nbytes = ECHO_SIZES[label]
    x = torch.randn(nbytes // 4, dtype=torch.float32)
    samples = time_calls(lambda: rpc.rpc_sync(PEER, _targets.echo, args=(x,)), *reps, failures)
    back = rpc.rpc_sync(PEER, _targets.echo, args=(x,))  # checked after timing
    if not (isinstance(back, torch.Tensor) and torch.equal(back, x)):
        raise AssertionError(f"echo of {label} returned a different tensor")
    med = statistics.median(samples)
    return {f"echo_{label}_us": med * 1e6, f"echo_{label}_gbps": 2 * nbytes / med / 1e9}


def bench_sparse_echo(rpc: Any, reps: tuple[int, int], failures: list[str]) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    rows = torch.randperm(100_000, generator=gen)[:1000].sort().values
    x = torch.sparse_coo_tensor(rows[None], torch.randn(1000, 64, generator=gen),
                                (100_000, 64), check_invariants=True).coalesce()
    samples = time_calls(lambda: rpc.rpc_sync(PEER, _targets.echo, args=(x,)), *reps, failures)
    back = rpc.rpc_sync(PEER, _targets.echo, args=(x,))  # checked after timing
    if not (isinstance(back, torch.Tensor) and back.layout is torch.sparse_coo
            and torch.equal(back.coalesce().indices(), x.indices())
            and torch.equal(back.coalesce().values(), x.values())):
        raise AssertionError("echo of the sparse tensor returned a different tensor")
    return {"sparse_echo_us": statistics.median(samples) * 1e6}


def bench_notebook_code(rpc: Any, lib: str, cfg: Config,
                        failures: list[str]) -> dict[str, float]:
    """Row 10: an importable function against the same defined in a notebook cell."""
    fns = {"imported": _targets.use_big}
    if lib == "nbrpc":
        cell: dict[str, Any] = {"__name__": "__main__"}
        exec(_targets.BIG_SOURCE, cell)  # as a notebook cell would define it
        fns["notebook"] = cell["use_big"]
    samples: dict[str, list[float]] = {k: [] for k in fns}
    warmup, timed = cfg.sync
    rounds = 5
    for i in range(rounds):
        for key, fn in fns.items():
            samples[key] += time_calls(lambda fn=fn: rpc.rpc_sync(PEER, fn, args=(1,)),
                                       warmup if i == 0 else 0, timed // rounds, failures)
    for key, fn in fns.items():  # checked after timing
        if rpc.rpc_sync(PEER, fn, args=(1,)) != 4:
            raise AssertionError(f"use_big ({key}) returned a wrong value")
    return {f"{key}_fn_median_us": statistics.median(v) * 1e6 for key, v in samples.items()}


PYRO_SERVER = """
import sys
import Pyro5.api

class Target:
    def noop(self):
        return None

Pyro5.api.expose(Target)
daemon = Pyro5.api.Daemon(host="127.0.0.1")
print(daemon.register(Target, "target"), flush=True)
daemon.requestLoop()
"""


def bench_pyro(cfg: Config, limit_s: float) -> dict[str, Any]:
    """Row 11: Pyro5 no-op calls from this process to a server process (µs)."""
    try:
        import Pyro5
        import Pyro5.api
    except ImportError:
        return {"error": "Pyro5 is not installed (pip install Pyro5)"}
    server = subprocess.Popen([sys.executable, "-c", PYRO_SERVER], stdout=subprocess.PIPE,
                              text=True)
    out: dict[str, Any] = {}
    try:
        uri = _read_line(server, min(limit_s, 30.0))
        for serializer in ("marshal", "serpent"):
            Pyro5.config.SERIALIZER = serializer
            with Pyro5.api.Proxy(uri) as proxy:
                proxy._pyroBind()
                samples = time_calls(proxy.noop, *cfg.sync, [])
            out[f"pyro_{serializer}_us"] = statistics.median(samples) * 1e6
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        server.kill()  # (started here, stopped by its own handle)
        server.wait(10)
        if server.stdout:
            server.stdout.close()
    return out


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line ``proc`` prints, waiting at most ``timeout`` s."""
    got: list[str] = []
    reader = threading.Thread(target=lambda: got.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    if not got or not got[0].strip():
        raise TimeoutError(f"the Pyro5 server printed no URI within {timeout:g} s")
    return got[0].strip()


def bench_remote(rpc: Any, cfg: Config, failures: list[str]) -> dict[str, float]:
    samples = time_calls(lambda: rpc.remote(PEER, _targets.small, args=(1,)).to_here(),
                         *cfg.remote, failures)
    value = rpc.remote(PEER, _targets.small, args=(1,)).to_here()  # checked after timing
    if value != (2, "ok"):
        raise AssertionError(f"remote().to_here() returned {value!r}")
    return {"remote_median_us": statistics.median(samples) * 1e6}


class NotFreed(Exception):
    """Values an owner built were not all freed in time."""


class RoundFailed(Exception):
    """A round of create/fork/delete cycles raised."""


def wait_freed(rpc: Any, gen: int, expected: dict[str, int], deadline: float,
               poll_s: float) -> dict[str, tuple[int, int]]:
    """Poll each owner (``rpc_sync``, every ``poll_s``) until it has freed
    ``expected[owner]`` Values of generation ``gen``; past ``deadline``
    (``time.perf_counter()``) raise :class:`NotFreed`. The last (built, freed)."""
    counts: dict[str, tuple[int, int]] = {}
    left = set(expected)
    while True:
        for name in sorted(left):
            counts[name] = tuple(rpc.rpc_sync(name, _targets.value_counts, args=(gen,)))
            if counts[name][1] >= expected[name]:
                left.discard(name)
        if not left:
            return counts
        if time.perf_counter() > deadline:
            raise NotFreed("; ".join(f"{name} freed {counts[name][1]} of {expected[name]} "
                                     f"values ({counts[name][0]} built)" for name in expected))
        time.sleep(poll_s)


def check_counts(counts: dict[str, tuple[int, int]], expected: dict[str, int]) -> None:
    for name, want in expected.items():
        if counts[name] != (want, want):
            raise AssertionError(f"{name} built {counts[name][0]} and freed {counts[name][1]} "
                                 f"values; expected {want} of each")


def check_remote_frees(rpc: Any, cfg: Config, failures: list[str]) -> dict[str, float]:
    """Untimed: ``remote(PEER, Value).to_here()`` as in :func:`bench_remote`;
    the owner must free every value (within 10 s)."""
    gen, n = -1, cfg.remote_free_check
    for i in range(n):
        value = rpc.remote(PEER, _targets.Value, args=(gen, i)).to_here()
        if not (isinstance(value, _targets.Value) and value.i == i and not value.home):
            raise AssertionError(f"remote(Value).to_here() returned {value!r}")
    counts = wait_freed(rpc, gen, {PEER: n}, time.perf_counter() + 10.0, cfg.fork_poll_s)
    check_counts(counts, {PEER: n})
    return {}


def fork_round(rpc: Any, gen: int, cfg: Config) -> tuple[float, float]:
    """``cfg.fork_cycles`` create/fork/delete cycles, then wait until both owners
    have freed every value. (Total, waiting after the last cycle) in seconds."""
    expected = {name: len(range(k, cfg.fork_cycles, 2)) for k, name in enumerate(OWNERS)}
    t0 = time.perf_counter()
    for i in range(cfg.fork_cycles):
        owner, other = OWNERS[i % 2], OWNERS[1 - i % 2]
        rref = rpc.remote(owner, _targets.Value, args=(gen, i))
        got = rpc.rpc_sync(other, _targets.use, args=(rref,))
        del rref
        if got != i:
            raise AssertionError(f"cycle {i}: use(rref) on {other} returned {got!r}")
    t_cycles = time.perf_counter()
    counts = wait_freed(rpc, gen, expected, t_cycles + cfg.fork_deadline_s, cfg.fork_poll_s)
    done = time.perf_counter()
    check_counts(counts, expected)  # after the clock: built once, freed once
    return done - t0, done - t_cycles


def bench_fork(rpc: Any, cfg: Config, rec: dict[str, Any]) -> dict[str, float]:
    """Warm-up and timed rounds of :func:`fork_round`; the first failure ends them
    (values may still be alive). Each timed round also goes to ``rec["fork_rounds_ms"]``."""
    warmup, timed = cfg.fork_rounds
    rounds: list[list[float]] = rec.setdefault("fork_rounds_ms", [])
    for gen in range(warmup + timed):
        try:
            total, waiting = fork_round(rpc, gen, cfg)
        except NotFreed as e:
            raise NotFreed(f"round {gen + 1} ({'warm-up' if gen < warmup else 'timed'}): not "
                           f"all values freed {cfg.fork_deadline_s:g} s after the last "
                           f"cycle: {e}") from None
        except Exception as e:
            raise RoundFailed(f"round {gen + 1}: {type(e).__name__}: {e}") from e
        if gen >= warmup:
            rounds.append([total * 1e3, waiting * 1e3])
    return {"fork_total_ms": statistics.median(r[0] for r in rounds),
            "fork_wait_ms": statistics.median(r[1] for r in rounds)}


# -- distributed autograd (8.) ------------------------------------------------------------
def _check_close(what: str, got: Any, want: torch.Tensor) -> None:
    if not (isinstance(got, torch.Tensor) and got.shape == want.shape
            and torch.allclose(got, want, rtol=1e-4, atol=1e-3)):
        detail = (f"max |difference| {float((got - want).abs().max()):.3g}"
                  if isinstance(got, torch.Tensor) and got.shape == want.shape else repr(got))
        raise AssertionError(f"{what} is wrong: {detail}")


def bench_autograd(rpc: Any, lib: str, cfg: Config, failures: list[str],
                   optimizer: bool) -> dict[str, float]:
    """``cfg.autograd`` iterations of: a distributed autograd context, ``y =
    rpc_sync(PEER, matmul_rref, args=(x, w_rref))`` (W lives on PEER),
    ``backward(ctx, [y.sum()])``, and with ``optimizer`` a DistributedOptimizer
    step. Checked once after timing: ``y``, ``x``'s gradient, and the step."""
    dist_autograd, dist_optim = (importlib.import_module(m) for m in AUTOGRAD_MODULES[lib])
    n, lr = cfg.autograd_n, cfg.autograd_lr
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, n, generator=gen).requires_grad_()
    w_rref = rpc.remote(PEER, _targets.new_weight, args=(n, 1 + optimizer))
    w_rref.to_here()  # built before the clock starts
    opt = (dist_optim.DistributedOptimizer(torch.optim.SGD, [w_rref], lr=lr)
           if optimizer else None)

    def iteration(check: bool = False) -> tuple[torch.Tensor, dict]:
        with dist_autograd.context() as ctx:  # its exit (the release) is timed too
            y = rpc.rpc_sync(PEER, _targets.matmul_rref, args=(x, w_rref))
            dist_autograd.backward(ctx, [y.sum()])
            if opt is not None:
                opt.step(ctx)
            return y, (dist_autograd.get_gradients(ctx) if check else {})

    samples = time_calls(iteration, *cfg.autograd, failures)
    key = "autograd_step_ms" if optimizer else "autograd_ms"
    out = {key: statistics.median(samples) * 1e3}
    w0 = w_rref.to_here().detach()
    y, grads = iteration(check=True)
    with torch.no_grad():
        _check_close("y = x @ W", y, x @ w0)
        if opt is None:
            _check_close("x's gradient in the context", grads.get(x), torch.ones(n, n) @ w0.T)
        else:  # SGD: W -= lr * dW, dW = x.T @ ones
            _check_close("W after DistributedOptimizer.step", w_rref.to_here().detach(),
                         w0 - lr * (x.T @ torch.ones(n, n)))
    return out


def bench_autograd_deep(rpc: Any, lib: str, cfg: Config,
                        failures: list[str]) -> dict[str, float]:
    """``cfg.autograd`` iterations of a context, ``y = rpc_sync(PEER, mlp_rref,
    args=(x, mlp_rref))`` (a model of ``cfg.autograd_depth`` layers on PEER) and
    ``backward(ctx, [y.sum()])``. Checked once after timing: x's gradient."""
    dist_autograd = importlib.import_module(AUTOGRAD_MODULES[lib][0])
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    mlp_rref = rpc.remote(PEER, _targets.new_mlp, args=(cfg.autograd_depth, 64))
    mlp = mlp_rref.to_here()  # built before the clock starts; a copy to check with

    def iteration(check: bool = False) -> dict:
        with dist_autograd.context() as ctx:
            y = rpc.rpc_sync(PEER, _targets.mlp_rref, args=(x, mlp_rref))
            dist_autograd.backward(ctx, [y.sum()])
            return dist_autograd.get_gradients(ctx) if check else {}

    samples = time_calls(iteration, *cfg.autograd, failures)
    grads = iteration(check=True)
    (want,) = torch.autograd.grad(mlp(x).sum(), [x])
    _check_close("x's gradient through the deep model", grads.get(x), want)
    return {"autograd_deep_ms": statistics.median(samples) * 1e3}


def bench_autograd_microbatches(rpc: Any, lib: str, cfg: Config,
                                failures: list[str]) -> dict[str, float]:
    """``cfg.autograd`` iterations of a context, the deep graph's ``x`` in
    ``cfg.autograd_splits`` slices, each ``rpc_async(PEER, mlp_rref, ...)``,
    their outputs concatenated into one loss, and ``backward``. Checked once
    after timing: x's gradient and the first layer's weight gradient."""
    dist_autograd = importlib.import_module(AUTOGRAD_MODULES[lib][0])
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0)).requires_grad_()
    mlp_rref = rpc.remote(PEER, _targets.new_mlp, args=(cfg.autograd_depth, 64))
    mlp = mlp_rref.to_here()
    slices = x.split(x.shape[0] // cfg.autograd_splits)

    def iteration(check: bool = False) -> dict:
        with dist_autograd.context() as ctx:
            futs = [rpc.rpc_async(PEER, _targets.mlp_rref, args=(xs, mlp_rref))
                    for xs in slices]
            y = torch.cat(torch.futures.wait_all(futs))
            dist_autograd.backward(ctx, [y.sum()])
            if not check:
                return {}
            first = rpc.rpc_sync(PEER, _targets.first_weight_grad, args=(ctx, mlp_rref))
            return {"x": dist_autograd.get_gradients(ctx).get(x), "w": first}

    samples = time_calls(iteration, *cfg.autograd, failures)
    grads = iteration(check=True)
    want_x, want_w = torch.autograd.grad(mlp(x).sum(), [x, mlp[0].weight])
    _check_close("x's gradient through the micro-batches", grads["x"], want_x)
    _check_close("the first layer's weight gradient, summed over the micro-batches",
                 grads["w"], want_w)
    return {"autograd_micro_ms": statistics.median(samples) * 1e3}


def bench_autograd_ddp(rpc: Any, lib: str, cfg: Config,
                       failures: list[str]) -> dict[str, float]:
    """``cfg.autograd`` iterations of a context, ``y = rpc_sync(PEER,
    matmul_rref, args=(ddp(x), w_rref))`` with ``ddp`` a DistributedDataParallel
    Linear(n, n) here, and ``backward(ctx, [y.sum()])``. Checked once after
    timing: the Linear's weight gradient in the context."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist_autograd = importlib.import_module(AUTOGRAD_MODULES[lib][0])
    n = cfg.autograd_n
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, n, generator=gen)
    w_rref = rpc.remote(PEER, _targets.new_weight, args=(n, 1))
    w = w_rref.to_here().detach()  # built before the clock starts
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ddp = DistributedDataParallel(torch.nn.Linear(n, n))

        def iteration(check: bool = False) -> dict:
            with dist_autograd.context() as ctx:
                y = rpc.rpc_sync(PEER, _targets.matmul_rref, args=(ddp(x), w_rref))
                dist_autograd.backward(ctx, [y.sum()])
                return dist_autograd.get_gradients(ctx) if check else {}

        samples = time_calls(iteration, *cfg.autograd, failures)
        grads = iteration(check=True)
        weight = ddp.module.weight
        with torch.no_grad():  # d(sum((x Aᵀ + b) W))/dA = (1 Wᵀ)ᵀ x
            _check_close("the DDP layer's weight gradient", grads.get(weight),
                         (torch.ones(n, n) @ w.T).T @ x)
        if weight.grad is not None:
            raise AssertionError("the DDP layer's .grad was set by a distributed backward")
    finally:
        dist.destroy_process_group()
    return {"autograd_ddp_ms": statistics.median(samples) * 1e3}


def bench_pipeline(rpc: Any, lib: str, cfg: Config, failures: list[str]) -> dict[str, float]:
    """The pipeline (13. in the module docstring): ms per iteration for each
    micro-batch count, after a check against a local copy of both shards."""
    dist_autograd, dist_optim = (importlib.import_module(m) for m in AUTOGRAD_MODULES[lib])
    width, depth, batch = cfg.pipeline_width, cfg.pipeline_depth, cfg.pipeline_batch
    shards = [rpc.remote(owner, _targets.Shard, args=(k, width, depth))
              for k, owner in enumerate(OWNERS, 1)]
    params = [p for s in shards for p in s.remote().parameter_rrefs().to_here()]
    gen = torch.Generator().manual_seed(0)
    x, target = torch.randn(batch, width, generator=gen), torch.randn(batch, width, generator=gen)

    def forward(splits: int) -> torch.Tensor:
        futs = []
        for xs in x.split(batch // splits):
            y = shards[0].remote().forward(rpc.RRef(xs))
            futs.append(shards[1].rpc_async().forward(y))
        return torch.nn.functional.mse_loss(torch.cat(torch.futures.wait_all(futs)), target)

    local = torch.nn.Sequential(*(s.rpc_sync().copy() for s in shards))
    want = torch.nn.functional.mse_loss(local(x), target)
    (want_w,) = torch.autograd.grad(want, [local[0][0].weight])
    with dist_autograd.context() as ctx:
        loss = forward(max(cfg.pipeline_splits))
        dist_autograd.backward(ctx, [loss])
        got_w = rpc.rpc_sync(OWNERS[0], _targets.first_weight_grad, args=(ctx, shards[0]))
    _check_close("the pipeline's loss", loss.detach(), want.detach())
    _check_close("the first layer's weight gradient", got_w, want_w)

    opt = dist_optim.DistributedOptimizer(torch.optim.SGD, params, lr=1e-3)
    out = {}
    for splits in cfg.pipeline_splits:
        def iteration(splits: int = splits) -> None:
            with dist_autograd.context() as ctx:
                dist_autograd.backward(ctx, [forward(splits)])
                opt.step(ctx)
        samples = time_calls(iteration, *cfg.pipeline, failures)
        out[f"pipeline_{splits}_ms"] = statistics.median(samples) * 1e3
    return out


def bench_autograd_local(cfg: Config, failures: list[str]) -> dict[str, float]:
    """The reference: the same two computations in this process, no RPC."""
    n, lr = cfg.autograd_n, cfg.autograd_lr
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, n, generator=gen).requires_grad_()
    w = _targets.new_weight(n, 1)
    opt = torch.optim.SGD([w], lr=lr)

    def fwd_bwd() -> None:
        (x @ w).sum().backward()
        x.grad = w.grad = None

    def with_step() -> None:
        (x @ w).sum().backward()
        opt.step()
        x.grad = w.grad = None

    mlp = _targets.new_mlp(cfg.autograd_depth, 64)
    xd = torch.randn(32, 64, generator=gen).requires_grad_()

    def deep() -> None:
        mlp(xd).sum().backward()
        mlp.zero_grad(set_to_none=True)
        xd.grad = None

    plain = time_calls(fwd_bwd, *cfg.autograd_local, failures)
    stepped = time_calls(with_step, *cfg.autograd_local, failures)
    deeper = time_calls(deep, *cfg.autograd_local, failures)
    return {"autograd_local_ms": statistics.median(plain) * 1e3,
            "autograd_step_local_ms": statistics.median(stepped) * 1e3,
            "autograd_deep_local_ms": statistics.median(deeper) * 1e3}


Step = Callable[[list[str]], dict[str, float]]


def run_steps(steps: list[tuple[str, int, Step]], rec: dict[str, Any],
              save: Callable[[], None]) -> None:
    """Run benchmarks on rank 0 into ``rec["metrics"]`` and ``rec["errors"]``
    (problems by benchmark), saving after each one."""
    metrics: dict[str, float] = rec.setdefault("metrics", {})
    errors: dict[str, str] = rec.setdefault("errors", {})
    for name, calls, step in steps:
        failures: list[str] = []
        try:  # one broken benchmark must not hide the others
            metrics.update(step(failures))
            check_failures(failures, calls)
        except Exception as e:
            errors[name] = f"{type(e).__name__}: {e}"
        save()


def measure(rpc: Any, lib: str, cfg: Config, rec: dict[str, Any],
            save: Callable[[], None]) -> None:
    """The two-worker benchmarks (rank 0 calling rank 1) of the selected cases."""
    steps: list[tuple[str, int, Step]] = []
    if "rpc" in cfg.cases:
        steps += [
            ("rpc_sync", sum(cfg.sync), lambda f: bench_sync(rpc, cfg, f)),
            ("rpc_async", 0, lambda f: bench_async(rpc, cfg, f)),
            ("beside a busy thread", sum(busy_sync_reps(cfg)),
             lambda f: bench_busy_thread(rpc, cfg, f)),
        ]
        for label, reps in cfg.echo.items():
            steps.append((f"echo {label}", sum(reps),
                          lambda f, label=label, reps=reps: bench_echo(rpc, label, reps, f)))
        steps.append(("echo sparse", sum(cfg.sparse_echo),
                      lambda f: bench_sparse_echo(rpc, cfg.sparse_echo, f)))
        steps.append(("remote", sum(cfg.remote), lambda f: bench_remote(rpc, cfg, f)))
        steps.append(("notebook code", 2 * cfg.sync[1],
                      lambda f: bench_notebook_code(rpc, lib, cfg, f)))
        steps.append(("remote frees", 0, lambda f: check_remote_frees(rpc, cfg, f)))
    if "autograd" in cfg.cases:
        steps += [
            ("dist autograd fwd+bwd", sum(cfg.autograd) + 1,
             lambda f: bench_autograd(rpc, lib, cfg, f, optimizer=False)),
            ("dist autograd fwd+bwd+DistributedOptimizer.step", sum(cfg.autograd) + 1,
             lambda f: bench_autograd(rpc, lib, cfg, f, optimizer=True)),
            ("dist autograd through a deep model", sum(cfg.autograd) + 1,
             lambda f: bench_autograd_deep(rpc, lib, cfg, f)),
            ("dist autograd, micro-batches through a deep model", sum(cfg.autograd) + 1,
             lambda f: bench_autograd_microbatches(rpc, lib, cfg, f)),
            ("dist autograd with DDP", sum(cfg.autograd) + 1,
             lambda f: bench_autograd_ddp(rpc, lib, cfg, f)),
        ]
    if "cuda" in cfg.cases:
        for label, reps in cfg.cuda_echo.items():
            steps.append((f"CUDA echo {label}", sum(reps),
                          lambda f, label=label, reps=reps: bench_cuda_echo(rpc, label, reps, f)))
        steps.append(("CUDA training step", 2 * sum(cfg.cuda_step),
                      lambda f: bench_cuda_step(rpc, lib, cfg, f)))
    if "trace" in cfg.cases and lib == "nbrpc":
        steps.append(("traced rpc_sync and rpc_async", sum(cfg.sync),
                      lambda f: bench_traced(rpc, cfg, f)))
    run_steps(steps, rec, save)


def bench_cuda_echo(rpc: Any, label: str, reps: tuple[int, int],
                    failures: list[str]) -> dict[str, float]:
    """Echo of a float32 tensor on cuda:0 to the peer's cuda:0 (map {0: 0}) and
    back; the clock stops once the answer is usable on the caller's stream."""
    nbytes = CUDA_ECHO_SIZES[label]
    x = torch.randn(nbytes // 4, device="cuda:0")

    def call() -> None:
        rpc.rpc_sync(PEER, _targets.echo, args=(x,))
        torch.cuda.current_stream().synchronize()

    samples = time_calls(call, *reps, failures)
    back = rpc.rpc_sync(PEER, _targets.echo, args=(x,))  # checked after timing
    if not (isinstance(back, torch.Tensor) and back.device == x.device and torch.equal(back, x)):
        raise AssertionError(f"CUDA echo of {label} returned a different tensor")
    med = statistics.median(samples)
    return {f"cuda_echo_{label}_us": med * 1e6, f"cuda_echo_{label}_gbps": 2 * nbytes / med / 1e9}


def bench_cuda_step(rpc: Any, lib: str, cfg: Config, failures: list[str]) -> dict[str, float]:
    """One training step: a ``RemoteModule`` Linear(n, n) on the peer's cuda:0, a
    local Linear(n, n) on cuda:0, distributed autograd and
    ``DistributedOptimizer(SGD)``; and the same two layers in this process."""
    dist_autograd, dist_optim = (importlib.import_module(m) for m in AUTOGRAD_MODULES[lib])
    nn_module = importlib.import_module("nbrpc.nn" if lib == "nbrpc" else "torch.distributed.nn")
    n = CUDA_STEP_N
    remote_lin = nn_module.RemoteModule(f"{PEER}/cuda:0", torch.nn.Linear, args=(n, n))
    local_lin = torch.nn.Linear(n, n).to("cuda:0")
    x = torch.randn(64, n, device="cuda:0")
    params = remote_lin.remote_parameters() + [rpc.RRef(p) for p in local_lin.parameters()]
    opt = dist_optim.DistributedOptimizer(torch.optim.SGD, params, lr=0.01)

    def step() -> None:
        with dist_autograd.context() as ctx:
            dist_autograd.backward(ctx, [local_lin(remote_lin(x)).sum()])
            opt.step(ctx)
        torch.cuda.synchronize()

    a, b = torch.nn.Linear(n, n).to("cuda:0"), torch.nn.Linear(n, n).to("cuda:0")
    sgd = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.01)

    def local_step() -> None:
        sgd.zero_grad()
        b(a(x)).sum().backward()
        sgd.step()
        torch.cuda.synchronize()

    dist = statistics.median(time_calls(step, *cfg.cuda_step, failures))
    one = statistics.median(time_calls(local_step, *cfg.cuda_step, failures))
    return {"cuda_step_ms": dist * 1e3, "cuda_step_local_ms": one * 1e3}


def gpu_count() -> int:
    """GPUs here, asked of NVML: this process spawns the workers, so it must
    not initialize CUDA itself."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    return torch.cuda.device_count()


def bench_traced(rpc: Any, cfg: Config, failures: list[str]) -> dict[str, float]:
    """rpc_sync and rpc_async inside ``nbrpc.debug.trace()``, and the exit's cost."""
    from nbrpc import debug

    out: dict[str, float] = {}
    for key, bench in (("sync", bench_sync), ("async", bench_async)):
        tr = debug.trace()
        with tr:
            got = bench(rpc, cfg, failures)
            t0 = time.perf_counter()
        out.update({f"traced_{k}": v for k, v in got.items()})
        out[f"trace_exit_{key}_ms"] = (time.perf_counter() - t0) * 1e3
        out[f"trace_messages_{key}"] = len(tr.messages)
    return out


def cold_import_s(lib: str, runs: int) -> tuple[float | None, str | None]:
    """Median time of ``import <library>`` in a fresh interpreter (torch included),
    and the error of the first run that failed, if any."""
    code = (f"import time; t = time.perf_counter(); import {MODULES[lib]}; "
            "print('import_s', time.perf_counter() - t)")
    times, error = [], None
    for _ in range(runs):
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=120, check=False)
        words = proc.stdout.split()
        if proc.returncode == 0 and "import_s" in words:
            times.append(float(words[words.index("import_s") + 1]))
        elif error is None:
            error = (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
    return (statistics.median(times) if times else None), error


# -- the spawned worker ------------------------------------------------------------
def _worker(rank: int, lib: str, port: int, outdir: str, cfg: Config,
            world_size: int = 2) -> None:
    t_start = time.perf_counter()  # first statement: the process is up, torch imported
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    rec: dict[str, Any] = {"rank": rank, "rss_torch_mb": _targets.rss_mb()}  # spawn imported torch
    out = Path(outdir) / f"rank{rank}.json"

    def save() -> None:  # after every step, so a run killed at its deadline still reports
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, out)  # atomic: a kill never leaves half a file

    t = time.perf_counter()
    rpc = importlib.import_module(MODULES[lib])
    rec["import_s"] = time.perf_counter() - t
    rec["rss_lib_mb"] = _targets.rss_mb()  # before init_rpc
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    options = None
    if cfg.cases == ("cuda",):  # the CUDA group: each cuda:0 to the other's
        options = rpc.TensorPipeRpcBackendOptions()
        options.set_device_map(f"worker{1 - rank}", {"cuda:0": "cuda:0"})
    t = time.perf_counter()
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size,
                 rpc_backend_options=options)
    done = time.perf_counter()
    rec.update(init_call_s=done - t, start_to_init_s=done - t_start)
    save()
    try:
        if rank == 0:
            if world_size == 2:
                _lead(rpc, lib, cfg, rec, save)
            else:
                _lead_three(rpc, lib, cfg, rec, save)
        else:
            rec["released"] = _targets.wait_released(cfg.serve_timeout_s)
    finally:
        save()
        t = time.perf_counter()
        rpc.shutdown()
        rec["shutdown_s"] = time.perf_counter() - t
        save()


def _lead(rpc: Any, lib: str, cfg: Config, rec: dict[str, Any],
          save: Callable[[], None]) -> None:
    """Rank 0: a few calls, the memory reading, the benchmarks, then release rank 1."""
    try:
        for _ in range(cfg.idle_calls):
            rpc.rpc_sync(PEER, _targets.noop)
        rec["rss_idle_mb"] = _targets.rss_mb()
        rec["peer_rss_idle_mb"] = rpc.rpc_sync(PEER, _targets.rss_mb)
        save()
        measure(rpc, lib, cfg, rec, save)
    except Exception:
        rec["fatal"] = traceback.format_exc()
    finally:
        try:
            rpc.rpc_sync(PEER, _targets.release)
        except Exception as e:
            rec.setdefault("errors", {})["release"] = f"{type(e).__name__}: {e}"


def _lead_three(rpc: Any, lib: str, cfg: Config, rec: dict[str, Any],
                save: Callable[[], None]) -> None:
    """Rank 0 of the three-worker group: the create/fork/delete cycles and the
    pipeline, then release ranks 1 and 2."""
    steps: list[tuple[str, int, Step]] = []
    if "fork" in cfg.cases:
        steps.append(("create/fork/delete cycles", 0, lambda f: bench_fork(rpc, cfg, rec)))
    if "pipeline" in cfg.cases:
        steps.append(("pipeline", 0, lambda f: bench_pipeline(rpc, lib, cfg, f)))
    try:
        run_steps(steps, rec, save)
    except Exception:
        rec["fatal"] = traceback.format_exc()
    finally:
        for peer in OWNERS:
            try:
                rpc.rpc_sync(peer, _targets.release)
            except Exception as e:
                rec.setdefault("errors", {})[f"release {peer}"] = f"{type(e).__name__}: {e}"


# -- the parent --------------------------------------------------------------------
def run_library(lib: str, port: int, cfg: Config, limit_s: float,
                world_size: int = 2) -> dict[str, Any]:
    """Spawn the workers of ``lib``, wait (bounded) and collect their records."""
    with tempfile.TemporaryDirectory(prefix=f"bench_{lib}_") as outdir:
        t = time.perf_counter()
        problem = _join_bounded(mp.spawn(_worker, args=(lib, port, outdir, cfg, world_size),
                                         nprocs=world_size, join=False), limit_s)
        result: dict[str, Any] = {"wall_s": time.perf_counter() - t, "problem": problem,
                                  "world_size": world_size}
        for rank in range(world_size):
            path = Path(outdir) / f"rank{rank}.json"
            result[f"rank{rank}"] = _read_record(path)
    return result


def _read_record(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _join_bounded(ctx: Any, limit_s: float) -> str | None:
    """Wait for the spawned processes; kill them past ``limit_s``. A problem, or None."""
    deadline = time.monotonic() + limit_s
    try:
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                return f"timed out after {limit_s:g} s (processes killed)"
        return None
    except Exception as e:  # a worker raised or died: torch reports it here
        return f"{type(e).__name__}: {str(e).strip().splitlines()[-1] if str(e).strip() else ''}"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
                p.join(5)


# -- the table ---------------------------------------------------------------------
@dataclasses.dataclass
class Row:
    """One line of the table; ``test`` judges the ratio, or nbrpc's value if ``absolute``."""

    metric: str
    nbrpc: float | None
    torch: float | None
    fmt: str = "{:.1f}"
    target: str = ""
    test: Callable[[float], bool] | None = None
    absolute: bool = False
    ratio_ok: bool = True
    spread: str = ""  # range of the per-repetition ratios, when repeated

    def ratio(self) -> float | None:
        if not self.ratio_ok or self.nbrpc is None or not self.torch:
            return None
        return self.nbrpc / self.torch

    def met(self) -> bool | None:
        value = self.nbrpc if self.absolute else self.ratio()
        return None if self.test is None or value is None else self.test(value)


def _get(res: dict[str, Any], rank: int, key: str) -> float | None:
    return res[f"rank{rank}"].get(key)


def _metric(res: dict[str, Any], key: str) -> float | None:
    return res["rank0"].get("metrics", {}).get(key)


def _median_ranks(res: dict[str, Any], key: str, scale: float = 1.0) -> float | None:
    vals = [v * scale for v in (_get(res, r, key) for r in (0, 1)) if v is not None]
    return statistics.median(vals) if vals else None


def _over_torch(res: dict[str, Any], rank: int) -> float | None:
    """Idle-agent VmRSS minus VmRSS after import torch, for one rank (MiB)."""
    idle = _get(res, 0, "rss_idle_mb" if rank == 0 else "peer_rss_idle_mb")
    base = _get(res, rank, "rss_torch_mb")
    return None if idle is None or base is None else idle - base


def build_rows(nb: dict[str, Any], tc: dict[str, Any], cfg: Config,
               local: dict[str, float] | None = None,
               pyro: dict[str, Any] | None = None) -> list[Row]:
    """The table's rows; ``local``: the one-process reference (:func:`bench_autograd_local`)."""
    def pair(get: Callable[[dict[str, Any]], float | None]) -> tuple[float | None, float | None]:
        return get(nb), get(tc)

    def metric(key: str) -> tuple[float | None, float | None]:
        return pair(lambda r: _metric(r, key))

    def ranks(key: str) -> tuple[float | None, float | None]:
        return pair(lambda r: _median_ranks(r, key, 1e3))

    def three(key: str) -> tuple[float | None, float | None]:  # the three-worker group
        return pair(lambda r: _metric(r["fork"], key) if r.get("fork") else None)

    def both(key: str) -> tuple[float | None, float | None]:  # one value, no library
        value = (local or {}).get(key)
        return value, value

    rows: list[Row] = []
    if "rpc" in cfg.cases:
        rows += [
            Row("rpc_sync no-op, median (µs)", *metric("sync_median_us"),
                target="ratio ≤ 0.6", test=lambda x: x <= 0.6),
            Row("rpc_sync no-op, p99 (µs)", *metric("sync_p99_us")),
            Row("rpc_async no-op, ≤64 in flight (calls/s)", *metric("async_calls_per_s"),
                fmt="{:.0f}", target="ratio ≥ 3", test=lambda x: x >= 3.0),
            Row("rpc_sync no-op beside a busy Python thread, median (µs)",
                *metric("busy_sync_median_us"), fmt="{:.0f}"),
            Row("rpc_async no-op beside a busy Python thread (calls/s)",
                *metric("busy_async_calls_per_s"), fmt="{:.0f}"),
        ]
        for label in ECHO_SIZES:
            rows.append(Row(f"echo {label} tensor, median RTT (µs)",
                            *metric(f"echo_{label}_us"), fmt="{:.0f}"))
            big = label == "64 MB"
            rows.append(Row(f"echo {label} tensor, bandwidth (GB/s)",
                            *metric(f"echo_{label}_gbps"), fmt="{:.3f}",
                            target="ratio ≥ 2" if big else "",
                            test=(lambda x: x >= 2.0) if big else None))
        rows.append(Row("echo sparse COO tensor (1,000 of 100,000 rows × 64), median RTT (µs)",
                        *metric("sparse_echo_us"), fmt="{:.0f}"))
        sync = metric("sync_median_us")[0]
        for serializer in ("marshal", "serpent"):
            rows.append(Row(f"rpc_sync no-op vs Pyro5 ({serializer}) no-op, median (µs; torch "
                            "column: Pyro5)", sync, (pyro or {}).get(f"pyro_{serializer}_us")))
        rows.append(Row("remote() + to_here(), median (µs)", *metric("remote_median_us"),
                        target="ratio ≤ 0.6", test=lambda x: x <= 0.6))
        imported, notebook = metric("imported_fn_median_us"), metric("notebook_fn_median_us")
        rows += [
            Row("rpc_sync of a function using a 60-method class, importable (µs)", *imported),
            Row("… the same defined in a notebook cell (torch: cannot send it) (µs)",
                notebook[0], imported[1]),
            Row("… notebook-defined over importable, nbrpc", None if None in (
                notebook[0], imported[0]) else notebook[0] / imported[0], None, fmt="{:.3f}",
                target="≤ 1.10", test=lambda x: x <= 1.10, absolute=True),
        ]
    if "fork" in cfg.cases:
        n = cfg.fork_cycles
        rows += [
            Row(f"{n} create/fork/delete cycles, 3 workers, until all freed (ms)",
                *three("fork_total_ms")),
            Row("… of which waiting for the frees after the last cycle (ms)",
                *three("fork_wait_ms"), fmt="{:.2f}"),
        ]
    if "pipeline" in cfg.cases:
        rows += [
            Row(f"pipeline over 2 workers ({cfg.pipeline_depth}× Linear({cfg.pipeline_width}, "
                f"{cfg.pipeline_width}) + ReLU each, batch {cfg.pipeline_batch}), "
                f"{k} micro-batch{'es' if k > 1 else ''}: fwd + bwd + step, median (ms/iter)",
                *three(f"pipeline_{k}_ms"), fmt="{:.1f}")
            for k in cfg.pipeline_splits
        ]
    if "autograd" in cfg.cases:
        n = cfg.autograd_n
        rows += [
            Row(f"dist autograd: rpc_sync(x @ W, {n}×{n}) + backward, median (ms/iter)",
                *metric("autograd_ms"), fmt="{:.2f}", target="ratio ≤ 0.5",
                test=lambda x: x <= 0.5),
            Row("… the same in one process, no RPC (ms/iter)", *both("autograd_local_ms"),
                fmt="{:.2f}", ratio_ok=False),
            Row("dist autograd + DistributedOptimizer(SGD).step, median (ms/iter)",
                *metric("autograd_step_ms"), fmt="{:.2f}"),
            Row("… the same in one process, no RPC (ms/iter)",
                *both("autograd_step_local_ms"), fmt="{:.2f}", ratio_ok=False),
            Row(f"dist autograd through {cfg.autograd_depth} layers on the peer "
                "(Linear(64, 64) + tanh, batch 32) + backward, median (ms/iter)",
                *metric("autograd_deep_ms"), fmt="{:.2f}"),
            Row("… the same in one process, no RPC (ms/iter)",
                *both("autograd_deep_local_ms"), fmt="{:.2f}", ratio_ok=False),
            Row(f"… the same batch as {cfg.autograd_splits} micro-batches, each an rpc_async, "
                "one backward, median (ms/iter)", *metric("autograd_micro_ms"), fmt="{:.2f}"),
            Row(f"dist autograd: rpc_sync(DDP(Linear({n}, {n}))(x) @ W) + backward, DDP "
                "in a gloo group of one, median (ms/iter)",
                *metric("autograd_ddp_ms"), fmt="{:.2f}"),
        ]
    if "cuda" in cfg.cases:
        def cuda(key: str) -> tuple[float | None, float | None]:
            return pair(lambda r: _metric(r["cuda"], key) if r.get("cuda") else None)

        small = "4 KB"
        rows += [
            Row("CUDA echo 64 MB, map {0: 0}, bandwidth (GB/s)", *cuda("cuda_echo_64 MB_gbps"),
                fmt="{:.2f}", target="ratio ≥ 2", test=lambda x: x >= 2.0),
            Row(f"CUDA echo {small}, map {{0: 0}}, median RTT (µs)",
                *cuda(f"cuda_echo_{small}_us"), fmt="{:.0f}", target="ratio ≤ 1",
                test=lambda x: x <= 1.0),
            Row(f"training step: RemoteModule Linear({CUDA_STEP_N}) on the peer's GPU + a "
                "local one, dist autograd + DistributedOptimizer(SGD) (ms)",
                *cuda("cuda_step_ms"), fmt="{:.2f}", target="ratio ≤ 1",
                test=lambda x: x <= 1.0),
            Row("… the same two layers in one process (ms; each column its own run)",
                *cuda("cuda_step_local_ms"), fmt="{:.2f}", ratio_ok=False),
        ]
    if "trace" in cfg.cases:
        rows += [
            Row("rpc_sync no-op inside debug.trace(), median (µs)",
                _metric(nb, "traced_sync_median_us"), _metric(tc, "sync_median_us")),
            Row("rpc_async no-op inside debug.trace() (calls/s)",
                _metric(nb, "traced_async_calls_per_s"), _metric(tc, "async_calls_per_s"),
                fmt="{:.0f}"),
            Row("debug.trace() exit after the rpc_sync run (ms)",
                _metric(nb, "trace_exit_sync_ms"), None, fmt="{:.1f}"),
        ]
    if "rpc" not in cfg.cases:
        return rows
    rows += [
        Row("import of the RPC library, torch already imported (ms)", *ranks("import_s"),
            ratio_ok=False),
        Row("import of the RPC library in a fresh interpreter (ms)",
            *pair(lambda r: None if r["cold_import_s"] is None else r["cold_import_s"] * 1e3),
            fmt="{:.0f}"),
        Row("init_rpc() call alone (ms)", *ranks("init_call_s")),
        Row("start of worker → init_rpc returned (ms)", *ranks("start_to_init_s")),
    ]
    for rank, who in ((0, "caller, rank 0"), (1, "idle server, rank 1")):
        rows.append(Row(f"agent RSS over import torch, {who} (MiB)",
                        *pair(lambda r, rank=rank: _over_torch(r, rank)),
                        target="nbrpc < 30 MiB", test=lambda x: x < 30.0, absolute=True))
    rows.append(Row("rpc.shutdown() (ms)", *ranks("shutdown_s"), fmt="{:.0f}"))
    return rows


def _cells(row: Row) -> list[str]:
    def num(v: float | None, fmt: str) -> str:
        return "n/a" if v is None else fmt.format(v)

    met = row.met()
    met_cell = "" if not row.target else ("n/a" if met is None else ("yes" if met else "NO"))
    return [row.metric, num(row.nbrpc, row.fmt), num(row.torch, row.fmt),
            num(row.ratio(), "{:.2f}x"), row.spread, row.target, met_cell]


HEADER = ["metric", "nbrpc", "torch", "nbrpc/torch", "ratio range", "target", "met"]


def merge_repetitions(reps: list[list[Row]]) -> list[Row]:
    """One row per metric: the median of each library's values over the
    repetitions, and the range of the per-repetition ratios (the noise)."""
    merged = []
    for versions in zip(*reps, strict=True):
        nb = [r.nbrpc for r in versions if r.nbrpc is not None]
        tc = [r.torch for r in versions if r.torch is not None]
        ratios = [x for x in (r.ratio() for r in versions) if x is not None]
        spread = f"{min(ratios):.2f}–{max(ratios):.2f}" if len(ratios) > 1 else ""
        merged.append(dataclasses.replace(
            versions[0], nbrpc=statistics.median(nb) if nb else None,
            torch=statistics.median(tc) if tc else None, spread=spread))
    return merged


def render_text(rows: list[Row]) -> str:
    table = [HEADER] + [_cells(r) for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(HEADER))]

    def fmt(line: list[str]) -> str:
        first = line[0].ljust(widths[0])
        rest = [c.rjust(w) if i < 4 else c.ljust(w)
                for i, (c, w) in enumerate(zip(line[1:], widths[1:], strict=True))]
        return "  ".join([first, *rest]).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([fmt(HEADER), rule] + [fmt(line) for line in table[1:]])


def render_markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADER) + " |",
             "|" + "|".join([":---", "---:", "---:", "---:", "---:", ":---", ":---:"]) + "|"]
    lines += ["| " + " | ".join(_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def describe(cfg: Config, quick: bool, markdown: bool) -> str:
    echo = ", ".join(f"{k}: {w}+{n}" for k, (w, n) in cfg.echo.items())
    iterations = []
    if "rpc" in cfg.cases:
        iterations.append(
            f"rpc_sync {cfg.sync[0]}+{cfg.sync[1]}; rpc_async {cfg.async_rounds} round(s) of "
            f"{cfg.async_calls} calls, ≤{cfg.async_window} in flight; echo {echo}; remote "
            f"{cfg.remote[0]}+{cfg.remote[1]}")
    if "fork" in cfg.cases:
        iterations.append(f"create/fork/delete {cfg.fork_rounds[0]}+{cfg.fork_rounds[1]} "
                          f"round(s) of {cfg.fork_cycles} cycles")
    if "autograd" in cfg.cases:
        iterations.append(f"dist autograd {cfg.autograd[0]}+{cfg.autograd[1]} per case, "
                          f"local reference {cfg.autograd_local[0]}+{cfg.autograd_local[1]}")
    if "pipeline" in cfg.cases:
        iterations.append(f"pipeline {cfg.pipeline[0]}+{cfg.pipeline[1]} per micro-batch count")
    selected = "" if cfg.cases == CASES else f" [--cases {','.join(cfg.cases)}]"
    lines = [
        f"nbrpc vs torch.distributed.rpc (TensorPipe, default options)"
        f"{' [--quick]' if quick else ''}{selected}",
        f"torch {torch.__version__}, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs, {platform.machine()}; 2 processes (3 for the cycles and "
        "the pipeline) on "
        f"127.0.0.1; load average "
        f"at the end {os.getloadavg()[0]:.2f} (other work on the machine skews the numbers)",
        "iterations (warm-up+timed): " + "; ".join(iterations),
    ]
    if "fork" in cfg.cases:
        lines.append(
            "create/fork/delete cycles: a separate group of 3 processes; rank 0 runs rref = "
            "remote(owner, Value), rpc_sync(other, use, args=(rref,)) (use calls to_here()), "
            "del rref, the owner alternating between ranks 1 and 2; the clock stops when "
            "both owners have freed every value (Value.__del__ counts, polled by rank 0 "
            f"every {cfg.fork_poll_s * 1e3:g} ms; not freed {cfg.fork_deadline_s:g} s after "
            "the last cycle = a failure)")
    if "pipeline" in cfg.cases:
        lines.append(
            "pipeline: in the group of 3 processes; rank 0 splits each batch into micro-batches, "
            "y = p1.remote().forward(RRef(x)) on rank 1, p2.rpc_async().forward(y) on rank 2, "
            "an MSE loss of the concatenated outputs, backward and DistributedOptimizer(SGD)."
            "step in a context (PyTorch's pipeline-parallelism tutorial, its ResNet shards as "
            "Linear stacks); checked once against a local copy of the shards")
    if "autograd" in cfg.cases:
        n = cfg.autograd_n
        lines.append(
            f"dist autograd: x ({n}×{n}, rank 0) and W ({n}×{n}, built on rank 1 by remote()), "
            "both requiring grad; per iteration `with context() as ctx: y = rpc_sync(worker1, "
            "matmul_rref, args=(x, w_rref)); backward(ctx, [y.sum()])` (worker1 computes "
            f"x @ W), plus DistributedOptimizer(SGD, [w_rref], lr={cfg.autograd_lr:g})"
            ".step(ctx) in the second case; the context's exit is timed; the library's own "
            "autograd and optimizer (torch.distributed.autograd / .optim for torch); "
            "reference: (x @ W).sum().backward() (+ SGD.step()) in the parent process with no "
            "RPC agent alive, one value shown in both columns")
    if "rpc" in cfg.cases:
        lines += [
            "bandwidth = 2 * tensor size / median round-trip time (GB/s = 1e9 bytes/s; "
            "1 MB = 2**20 bytes, float32 tensors)",
            "RSS over import torch: VmRSS after init_rpc + a few no-op calls minus VmRSS after "
            "import torch (MiB)",
            "`import torch` already loads torch.distributed.rpc, so importing it afterwards is "
            "free (no ratio shown); the fresh-interpreter import includes torch for both",
        ]
    return "\n".join(f"- {line}" for line in lines) if markdown else "\n".join(lines)


def problems(results: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    for lib, res in results.items():
        if res.get("cold_import_error"):
            out.append(f"{lib}: import in a fresh interpreter failed: {res['cold_import_error']}")
        if "world_size" in res:  # the two-worker run (not made for --cases fork)
            out += _run_problems(lib, res)
        if res.get("fork"):
            out += _run_problems(f"{lib} (3 workers)", res["fork"])
        if res.get("cuda"):
            out += _run_problems(f"{lib} (CUDA)", res["cuda"])
    return out


def _run_problems(who: str, res: dict[str, Any]) -> list[str]:
    out = []
    if res["problem"]:
        out.append(f"{who}: {res['problem']}")
    for rank in range(res["world_size"]):
        rec = res[f"rank{rank}"]
        if not rec:
            out.append(f"{who}: rank {rank} wrote no results")
        if rec.get("fatal"):
            out.append(f"{who}: rank {rank} failed:\n{rec['fatal']}")
        for name, err in rec.get("errors", {}).items():
            out.append(f"{who}: {name}: {err}")
        if rank > 0 and rec and rec.get("released") is False:
            out.append(f"{who}: rank {rank} was never released (served until its timeout)")
    return out


def fork_rounds(all_results: list[dict[str, dict[str, Any]]], markdown: bool) -> str:
    """Every timed round of the create/fork/delete cycles, by library and repetition."""
    lines = ["create/fork/delete cycles, every timed round (total ms / of which waiting "
             "for the frees ms):"]
    for lib in LIBRARIES:
        reps = []
        for k, results in enumerate(all_results, 1):
            rec = (results[lib].get("fork") or {}).get("rank0", {})
            rounds = rec.get("fork_rounds_ms") or []
            cells = ", ".join(f"{t:.0f}/{w:.1f}" for t, w in rounds) or "none"
            reps.append(f"rep {k}: {cells}")
        lines.append(f"{'  - ' if markdown else '  '}{lib}: " + "; ".join(reps))
    return "\n".join(lines if not markdown else [f"- {lines[0]}", *lines[1:]])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few iterations (a smoke test)")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds after which one library's processes are killed "
                         "(default 100, 60 with --quick)")
    ap.add_argument("--repeat", type=int, default=None,
                    help="run both libraries this many times, alternating, and report "
                         "medians (default 3, 1 with --quick): single runs on a small "
                         "VM vary by 2x")
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma list of the cases to run, of {', '.join(CASES)} (default: "
                         "all): rpc = the two-worker RPC set with start-up, import and "
                         "memory; fork = the create/fork/delete cycles; autograd = "
                         "distributed autograd and DistributedOptimizer")
    args = ap.parse_args(argv)
    cases = tuple(c for c in CASES if c in args.cases.split(","))
    unknown = set(args.cases.split(",")) - set(CASES)
    if unknown or not cases:
        ap.error(f"--cases: unknown {', '.join(sorted(unknown)) or 'empty list'}; "
                 f"choose from {', '.join(CASES)}")
    gpus = gpu_count() if "cuda" in cases else 0
    if "cuda" in cases and not gpus:
        print("cuda: no GPU here, so no CUDA rows", file=sys.stderr)
        cases = tuple(c for c in cases if c != "cuda")
        if not cases:
            ap.error("--cases cuda: no GPU here")
    cfg = dataclasses.replace(QUICK if args.quick else Config(), cases=cases)
    limit = args.timeout or (60.0 if args.quick else 100.0)
    cfg = dataclasses.replace(cfg, serve_timeout_s=limit)
    two_cfg = dataclasses.replace(cfg, cases=tuple(c for c in cases if c != "cuda"))
    repeat = max(1, args.repeat or (1 if args.quick else 3))
    ports: set[int] = set()
    # the three-worker group may wait fork_deadline_s for frees (once: a failure ends it)
    fork_limit = limit + cfg.fork_deadline_s
    fork_cfg = dataclasses.replace(cfg, serve_timeout_s=fork_limit)
    reps: list[list[Row]] = []
    issues: list[str] = []
    all_results: list[dict[str, dict[str, Any]]] = []
    for rep in range(repeat):
        results: dict[str, dict[str, Any]] = {lib: {} for lib in LIBRARIES}
        local: dict[str, float] = {}
        if "autograd" in cases:  # here: no agent of either library is alive now
            failures: list[str] = []
            try:
                local = bench_autograd_local(cfg, failures)
                check_failures(failures, 2 * sum(cfg.autograd_local))
            except Exception as e:
                issues.append(f"dist autograd local reference: {type(e).__name__}: {e}")
        for lib in LIBRARIES if "rpc" in cases or "autograd" in cases else ():
            port = free_port(ports)
            ports.add(port)
            print(f"[{rep + 1}/{repeat}] running {lib} (MASTER_PORT={port}) ...",
                  file=sys.stderr, flush=True)
            results[lib] = run_library(lib, port, two_cfg, limit)
            if "rpc" in cases:
                results[lib]["cold_import_s"], results[lib]["cold_import_error"] = (
                    cold_import_s(lib, cfg.import_runs))
            print(f"  {lib} done in {results[lib]['wall_s']:.1f} s", file=sys.stderr,
                  flush=True)
        for lib in LIBRARIES if set(THREE_WORKERS) & set(cases) else ():
            port = free_port(ports)
            ports.add(port)
            what = " and ".join(c for c in THREE_WORKERS if c in cases)
            print(f"[{rep + 1}/{repeat}] running {lib}, 3 workers: {what} "
                  f"(MASTER_PORT={port}) ...", file=sys.stderr, flush=True)
            fork = results[lib]["fork"] = run_library(lib, port, fork_cfg, fork_limit, 3)
            print(f"  {lib} done in {fork['wall_s']:.1f} s", file=sys.stderr, flush=True)
        for lib in LIBRARIES if "cuda" in cases and gpus else ():
            port = free_port(ports)
            ports.add(port)
            print(f"[{rep + 1}/{repeat}] running {lib}, CUDA tensors (MASTER_PORT={port}) ...",
                  file=sys.stderr, flush=True)
            cuda_cfg = dataclasses.replace(cfg, cases=("cuda",))
            results[lib]["cuda"] = run_library(lib, port, cuda_cfg, limit)
            print(f"  {lib} done in {results[lib]['cuda']['wall_s']:.1f} s", file=sys.stderr,
                  flush=True)
        pyro: dict[str, Any] = {}
        if "rpc" in cases:
            print(f"[{rep + 1}/{repeat}] running Pyro5 ...", file=sys.stderr, flush=True)
            pyro = bench_pyro(cfg, limit)
            if pyro.get("error"):
                issues.append(f"Pyro5: {pyro['error']}")
        reps.append(build_rows(results["nbrpc"], results["torch"], cfg, local, pyro))
        issues += problems(results)
        all_results.append(results)
    rows = merge_repetitions(reps)
    print(describe(cfg, args.quick, args.markdown))
    print(f"{'- ' if args.markdown else ''}values: median over {repeat} alternating "
          "repetition(s); ratio range: lowest and highest per-repetition ratio")
    print()
    print(render_markdown(rows) if args.markdown else render_text(rows))
    if "fork" in cases:
        print()
        print(fork_rounds(all_results, args.markdown))
    if issues:
        print("\nproblems:")
        print("\n".join(f"- {p}" for p in issues))
    return 1 if issues else 0


if __name__ == "__main__":
    sys.exit(main())
