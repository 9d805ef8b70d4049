"""Workers that compute at once on one host: torch's and BLAS's threads per worker.

Run it with ``.venv/bin/python benchmarks/bench_compute.py``; ``--quick`` is a
smoke test, ``--markdown`` prints the table as Markdown, ``--workers 2,4``
chooses the group sizes, ``--work torch,numpy`` the workloads.

Each case starts ``W`` workers on this host and, once all are ready, has the
driver call the workload on every worker at once (``rpc_async`` to each, then
waiting for all). Timed from the first call to the last answer (after one
untimed round); the figure is the steps of all workers per second. Then the
same with ``worker1`` alone computing while the others idle (a pipeline's
stages, or one trainer): what dividing the CPUs costs a worker that could have
had them all. The workloads:

``torch``
    ``_targets.train_steps``: SGD steps of a two-layer ``Linear(256, 256)``
    model on a batch of 256, the shape of a parameter server's trainers.
``numpy``
    ``_targets.numpy_steps``: ``x = tanh(x @ W)`` with 128 x 128 float32
    numpy matrices, numpy's BLAS (OpenBLAS in its wheels) doing the product:
    RL observers' or a data pipeline's numpy.

The cases:

``torch``
    ``torch.distributed.rpc`` (TensorPipe, default options): ``W`` workers and
    a driver started with ``torch.multiprocessing``'s spawn context, each with
    torch's default threads (one per CPU).
``nbrpc-auto``
    ``nbrpc.Cluster(progress=False).start(W)``: the default
    ``torch_threads="auto"`` divides the CPUs among the workers that share them,
    torch's threads and numpy's BLAS threads alike (:mod:`nbrpc.cluster.threads`).
``nbrpc-default``
    The same with ``Cluster(torch_threads=None)``: torch's default in every
    worker, as in the ``torch`` case.

The cases alternate, ``--repeat`` times; each value is the median.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import _targets
import torch
import torch.multiprocessing as mp
from bench_cluster import render  # benchmarks/ is on sys.path
from bench_rpc import free_port

HERE = Path(__file__).resolve().parent
CASES = ("torch", "nbrpc-auto", "nbrpc-default")
class Work(NamedTuple):
    """A workload: a function of ``_targets``, ``fn(steps, n, seed)``."""

    fn: str
    n: int  # the matrices' size
    steps: int  # per worker, by default
    what: str  # what a step is, for the table's header


WORK = {"torch": Work("train_steps", 256, 300,
                      "SGD steps of Linear(256, 256) + ReLU + Linear(256, 256), batch 256"),
        "numpy": Work("numpy_steps", 128, 3000,
                      "numpy steps x = tanh(x @ W), 128 x 128 float32")}


def one_round(rpc: Any, workers: list[str], work: str, steps: int,
              timeout: float) -> tuple[float, list]:
    """Every worker's ``work`` at once: (seconds, their answers)."""
    fn, n = getattr(_targets, WORK[work].fn), WORK[work].n
    t0 = time.perf_counter()
    futs = [rpc.rpc_async(w, fn, args=(steps, n, i), timeout=timeout)
            for i, w in enumerate(workers)]
    answers = [f.wait() for f in futs]
    return time.perf_counter() - t0, answers


def record(seconds: float, answers: list, steps: int) -> dict[str, float]:
    return {"steps_per_s": len(answers) * steps / seconds,
            "threads": statistics.median(a[2] for a in answers)}


def measure(rpc: Any, workers: list[str], steps: dict[str, int],
            timeout: float) -> dict[str, dict]:
    """Each workload: all workers at once, then ``workers[0]`` alone (each
    after a warm-up round); keyed ``"<work> all"``, ``"<work> alone"``."""
    out = {}
    for work, n_steps in steps.items():
        for key, group in (("all", workers), ("alone", workers[:1])):
            one_round(rpc, group, work, max(1, n_steps // 10), timeout)
            out[f"{work} {key}"] = record(*one_round(rpc, group, work, n_steps, timeout),
                                          n_steps)
    return out


def run_nbrpc(n_workers: int, steps: dict[str, int], setting: str | None,
              timeout: float) -> dict:
    from nbrpc import Cluster, rpc

    with Cluster(progress=False, torch_threads=setting, timeout=timeout).start(n_workers) as c:
        return measure(rpc, c.names, steps, timeout)


def _torch_process(rank: int, world: int, port: int, steps: dict[str, int], out: str,
                   timeout: float) -> None:
    warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
    import torch.distributed.rpc as rpc

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    name = "driver" if rank == 0 else f"worker{rank}"
    opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=timeout)
    rpc.init_rpc(name, rank=rank, world_size=world, rpc_backend_options=opts)
    if rank == 0:
        workers = [f"worker{r}" for r in range(1, world)]
        Path(out).write_text(json.dumps(measure(rpc, workers, steps, timeout)))
    rpc.shutdown(graceful=True, timeout=timeout)


def run_torch(n_workers: int, steps: dict[str, int], timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        ctx = mp.start_processes(_torch_process, nprocs=n_workers + 1, join=False,
                                 args=(n_workers + 1, free_port(set()), steps, out, timeout),
                                 start_method="spawn")
        deadline = time.monotonic() + 3 * timeout
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"torch.distributed.rpc's case ran past {3 * timeout:g} s")
        return json.loads(Path(out).read_text())


def run_case(case: str, n_workers: int, steps: dict[str, int], timeout: float) -> dict:
    if case == "torch":
        return run_torch(n_workers, steps, timeout)
    return run_nbrpc(n_workers, steps, "auto" if case == "nbrpc-auto" else None, timeout)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="few steps, once (a smoke test)")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--repeat", type=int, default=None, help="alternating runs (default 3)")
    ap.add_argument("--workers", default="2,4", help="comma list of group sizes")
    ap.add_argument("--work", default="torch,numpy", help="comma list of workloads: "
                    + ", ".join(WORK))
    ap.add_argument("--steps", type=int, default=None,
                    help="steps per worker (default 300 torch, 3000 numpy)")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds, per case")
    args = ap.parse_args(argv)
    repeat = args.repeat or (1 if args.quick else 3)
    works = args.work.split(",")
    if unknown := set(works) - set(WORK):
        ap.error(f"unknown --work {sorted(unknown)}: choose from {', '.join(WORK)}")
    steps = {w: args.steps or WORK[w].steps // (15 if args.quick else 1) for w in works}
    sizes = [int(w) for w in args.workers.split(",")]
    # the workers import _targets by name, as a real job's module (both libraries)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(HERE), os.environ.get("PYTHONPATH")) if p)
    runs: dict[tuple[int, str], list[dict]] = {}
    for rep in range(repeat):
        for w in sizes:
            for case in CASES:
                print(f"[{rep + 1}/{repeat}] {w} workers, {case} ...", file=sys.stderr,
                      flush=True)
                runs.setdefault((w, case), []).append(
                    run_case(case, w, steps, args.timeout))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {cpus} CPUs; "
          f"median of {repeat} alternating run(s); per worker: "
          + "; ".join(f"{work}: {steps[work]} {WORK[work].what}" for work in works))
    head = ["work", "workers", "computing", "case", "threads per worker (torch's or BLAS's)",
            "steps/s, together", "over torch"]
    rows = []
    for work in works:
        for w in sizes:
            for part, what in (("all", "all"), ("alone", "worker1 alone")):
                key = f"{work} {part}"
                base = statistics.median(r[key]["steps_per_s"] for r in runs[(w, "torch")])
                for case in CASES:
                    rate = statistics.median(r[key]["steps_per_s"] for r in runs[(w, case)])
                    threads = statistics.median(r[key]["threads"] for r in runs[(w, case)])
                    rows.append([work, str(w), what, case, f"{threads:g}", f"{rate:,.0f}",
                                 f"{rate / base:.2f}x"])
    print(render(rows, args.markdown, head))
    return 0


if __name__ == "__main__":
    sys.exit(main())
