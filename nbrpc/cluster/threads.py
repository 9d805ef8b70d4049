"""How many CPU threads torch uses in each worker of a cluster.

torch gives every process one intra-op thread per CPU it may run on
(``torch.get_num_threads()``). A cluster puts several engines on one host, and
each would then run its matrix products on every CPU of the host at once: on
this project's 2-core machine, two cluster workers training a small model at
the same time made 205 steps/s between them with torch's default and 673 with
one thread each; four workers 76 against 708 (``benchmarks/bench_compute.py``).
Their OpenMP threads outnumber the CPUs, and each parallel region then waits
for the kernel to wake threads that lost their CPU (the engines' idle OpenMP
threads sleep, ``OMP_WAIT_POLICY=PASSIVE``, rather than spin). ``torchrun``
sets ``OMP_NUM_THREADS=1`` for each of several processes on a host for the
same reason.

So a cluster divides the CPUs: ``Cluster(torch_threads="auto")`` (the default)
gives each worker ``max(1, cpus // sharing)`` threads, where ``cpus`` is what
the worker's process may run on (its affinity: a Slurm or cgroup CPU set
counts, not the host's total) and ``sharing`` the number of the cluster's
workers that run on those same CPUs of the same machine. A worker whose
environment sets ``OMP_NUM_THREADS`` keeps it (the user chose). An int gives
every worker that many; ``None`` leaves torch's default. The driver (the
kernel) is not changed: it is the user's own process.

A worker's count is set when it starts (:func:`apply`, run on its engine's
main thread before it serves any call): torch applies it to each thread the
first time that thread runs an operator, so every thread nbrpc starts later in
the worker (its pool, the threads serving callers' channels) uses it too. The
workers already running when more are added keep theirs. The cost: a worker
computing alone while the others idle has fewer threads than it could have had
(347 steps/s instead of 676 in the same benchmark).

numpy's BLAS (OpenBLAS in its wheels; MKL or BLIS in other builds) keeps a
thread pool of its own, one thread per CPU, made when ``import torch`` loads
numpy, before a worker is given its count: four workers each running
``x = tanh(x @ W)`` on 128 x 128 numpy matrices at once made 1,732 steps/s
between them with that default and 36,562 with one BLAS thread each
(``bench_compute.py``; a worker alone lost nothing here). So :func:`apply`
sets the same count for the BLAS libraries loaded in the worker, through
``threadpoolctl`` (the library scikit-learn and joblib use for it); one whose
own variable is set in the worker's environment (``OPENBLAS_NUM_THREADS``,
``MKL_NUM_THREADS``, ...) keeps what it chose.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..transport import local

log = logging.getLogger(__name__)

AUTO = "auto"


@dataclass(frozen=True)
class CpuShare:
    """What a worker's process may run on: ``cpus`` CPUs, named by ``cpu_set``
    (equal for two processes on the same machine with the same affinity), and
    its ``OMP_NUM_THREADS`` if its environment sets one."""

    cpus: int
    cpu_set: str
    omp_env: str | None = None


def check_setting(value: object) -> int | str | None:
    """``torch_threads`` as a cluster takes it: ``"auto"``, None or an int >= 1.

    >>> check_setting("auto"), check_setting(None), check_setting(4)
    ('auto', None, 4)
    >>> check_setting(0)
    Traceback (most recent call last):
    ValueError: torch_threads must be 'auto', None or a whole number >= 1 (torch's intra-op threads per worker), got 0
    """
    if value is None or value == AUTO:
        return value  # type: ignore[return-value]
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    raise ValueError("torch_threads must be 'auto', None or a whole number >= 1 (torch's "
                     f"intra-op threads per worker), got {value!r}")


def cpu_share() -> CpuShare:
    """This process's :class:`CpuShare` (run in a worker when it starts)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not Linux)
        cpus = list(range(os.cpu_count() or 1))
    try:
        machine = local.boot_id()
    except OSError:
        machine = f"unknown-{os.getpid()}"  # never assume a shared machine
    digest = hashlib.blake2b(f"{machine}:{cpus}".encode(), digest_size=8).hexdigest()
    return CpuShare(len(cpus), digest, os.environ.get("OMP_NUM_THREADS") or None)


def plan(setting: int | str | None, shares: Mapping[str, CpuShare]) -> dict[str, int]:
    """The thread count to set in each worker (those left as they are are not
    in it), for the workers' :class:`CpuShare`.

    >>> two_cpus = CpuShare(2, "a")
    >>> plan("auto", {"worker1": two_cpus, "worker2": two_cpus, "worker3": CpuShare(8, "b")})
    {'worker1': 1, 'worker2': 1, 'worker3': 8}
    >>> plan("auto", {"worker1": two_cpus, "worker2": CpuShare(2, "a", omp_env="2")})
    {'worker1': 1}
    >>> plan(3, {"worker1": two_cpus}), plan(None, {"worker1": two_cpus})
    ({'worker1': 3}, {})
    """
    if setting is None:
        return {}
    if setting != AUTO:
        return dict.fromkeys(shares, int(setting))
    sharing = Counter(s.cpu_set for s in shares.values())
    return {name: max(1, s.cpus // sharing[s.cpu_set])
            for name, s in shares.items() if s.omp_env is None}


# The variables that set each BLAS library's threads when it loads (threadpoolctl's
# ``internal_api`` names): a library one of them is set for keeps that count.
BLAS_ENV = {"openblas": ("OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS"),
            "mkl": ("MKL_NUM_THREADS",), "blis": ("BLIS_NUM_THREADS",)}

# threadpoolctl's controllers of the BLAS libraries loaded here, and len(sys.modules)
# when they were looked for: finding them walks every loaded shared library (0.8 ms),
# reading a count through one is a call into it (1 us), and a status probe reads them
# twice a second while a live view runs. A BLAS library comes with the import of an
# extension module (numpy, scipy), so a longer sys.modules means look again.
_blas: tuple[int, list[Any]] = (-1, [])


def _blas_libs() -> list[Any]:
    """threadpoolctl's controllers of the BLAS libraries loaded in this process."""
    global _blas
    modules, libs = _blas
    if modules != len(sys.modules):
        from threadpoolctl import ThreadpoolController

        modules = len(sys.modules)  # (before the look: an import meanwhile means look again)
        libs = ThreadpoolController().select(user_api="blas").lib_controllers
        _blas = (modules, libs)
    return libs


def apply(n: int) -> int:
    """Use ``n`` intra-op threads in this process from now on (run on a
    worker's engine, on its main thread): torch's, and those of the BLAS
    libraries loaded here (numpy's) whose own variable is not set; and in the
    processes it starts (``OMP_NUM_THREADS``, as ``torchrun`` sets it).
    Returns torch's count."""
    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)
    for lib in _blas_libs():
        if not any(os.environ.get(v) for v in BLAS_ENV.get(lib.internal_api, ())):
            lib.set_num_threads(n)
            # threadpoolctl >= 3.8 lets one thread at a time set OpenBLAS's shared pool,
            # the first that does: give it up, or the user's own limits (scikit-learn's,
            # on the threads that serve calls) would silently do nothing in this worker
            getattr(lib, "clear_controlling_thread", lambda: None)()
    return torch.get_num_threads()


def blas_threads() -> str:
    """The BLAS libraries loaded in this process and their threads, as the
    status of a worker shows them ("" where none is loaded).

    >>> import numpy  # (torch loads it too)
    >>> api, n = blas_threads().split(", ")[0].split()  # e.g. 'openblas 2'
    >>> api in BLAS_ENV and int(n) >= 1
    True
    """
    return ", ".join(f"{lib.internal_api} {lib.num_threads}" for lib in _blas_libs())
