"""An ipyparallel engine started by ``mpiexec`` as one of several workers.

With ``launcher="mpi"`` nbrpc starts all the workers of one ``start(n)`` (or
``add(n)``) with a single ``mpiexec -n N``, so that MPI places them over the
hostfile's or allocation's hosts as it places any job's ranks. Every process
of that job gets the same command line, so this module tells them apart by
their MPI rank (from the environment the MPI launcher sets: no MPI call is
made before the engine's own) and runs ipyparallel's engine as the worker of
that rank, with its nbrpc rank as the engine id::

    mpiexec -n 2 python -m nbrpc.cluster.mpi_engine --workers worker1=1,worker2=2 \\
        --mpi --profile-dir=... --cluster-id=...

Run as ``python -m nbrpc.cluster.mpi_engine --workers NAME=RANK,... ENGINE ARGS``.
"""

from __future__ import annotations

import functools
import os
import runpy
import shutil
import subprocess
import sys

from . import relay
from .engine import WORKER_ENV

# the rank of this process in MPI_COMM_WORLD, as Open MPI, MPICH/Hydra, PMIx and
# Slurm's srun set it
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID")
# what ipyparallel puts in an engine's environment (with the launcher's own)
IPP_VARIABLES = ("IPP_CONNECTION_INFO", "IPP_CLUSTER_ID", "IPP_PROFILE_DIR")


def mpi_rank(environ: dict[str, str] | os._Environ = os.environ) -> int:
    """This process's MPI rank, from its launcher's environment.

    >>> mpi_rank({"OMPI_COMM_WORLD_RANK": "3"}), mpi_rank({"PMI_RANK": "1"})
    (3, 1)
    >>> mpi_rank({})
    Traceback (most recent call last):
    ...
    RuntimeError: no MPI rank in the environment (none of OMPI_COMM_WORLD_RANK, PMIX_RANK, PMI_RANK, SLURM_PROCID): nbrpc.cluster.mpi_engine runs under mpiexec
    """
    for name in RANK_VARIABLES:
        if environ.get(name, "").isdigit():
            return int(environ[name])
    raise RuntimeError(f"no MPI rank in the environment (none of {', '.join(RANK_VARIABLES)}):"
                       " nbrpc.cluster.mpi_engine runs under mpiexec")


def parse_workers(text: str) -> list[tuple[str, int]]:
    """``worker1=1,worker2=2`` -> [(name, nbrpc rank)], in MPI rank order.

    >>> parse_workers("worker3=3,worker4=4")
    [('worker3', 3), ('worker4', 4)]
    """
    out = []
    for item in text.split(","):
        name, _, rank = item.partition("=")
        if not name or not rank.isdigit():
            raise ValueError(f"--workers takes NAME=RANK,...; got {text!r}")
        out.append((name, int(rank)))
    return out


def engine_argv(argv: list[str], environ: dict[str, str] | os._Environ = os.environ
                ) -> tuple[str, list[str]]:
    """(worker name, ipyparallel engine argv) for this MPI rank.

    >>> engine_argv(["--workers", "worker1=1,worker2=2", "--mpi"], {"PMI_RANK": "1"})
    ('worker2', ['--mpi', '--IPEngine.id=2'])
    """
    if len(argv) < 2 or argv[0] != "--workers":
        raise SystemExit("usage: python -m nbrpc.cluster.mpi_engine --workers NAME=RANK,... "
                         "[ipyparallel engine arguments]")
    workers = parse_workers(argv[1])
    index = mpi_rank(environ)
    if index >= len(workers):
        raise SystemExit(f"MPI rank {index} has no worker: mpiexec started more processes "
                         f"than the {len(workers)} workers named ({argv[1]})")
    name, rank = workers[index]
    return name, [*argv[2:], f"--IPEngine.id={rank}"]


@functools.lru_cache(maxsize=8)
def version_text(mpiexec: str) -> str:
    """What ``mpiexec --version`` prints ("" if it cannot be run), asked once."""
    exe = shutil.which(mpiexec)
    if exe is None:
        return ""
    try:
        r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return r.stdout + r.stderr


def is_open_mpi(mpiexec: str) -> bool:
    """Whether ``mpiexec`` is Open MPI's, which hands remote ranks only the
    variables named with ``-x`` (MPICH's Hydra forwards the whole environment)."""
    text = version_text(mpiexec)
    return "Open MPI" in text or "OpenRTE" in text


def forwarded(names: list[str] | set[str], mpiexec: str) -> list[str]:
    """``mpiexec`` arguments that hand the variables ``names`` to every rank,
    on whichever host (``-x NAME ...`` for Open MPI; none needed elsewhere)."""
    if not is_open_mpi(mpiexec):
        return []
    return [a for name in sorted(names) for a in ("-x", name)]


def survive_args(mpiexec: str) -> list[str]:
    """``mpiexec`` arguments that keep the other workers running when one
    rank dies: Open MPI 4's runtime (OpenRTE) otherwise aborts the whole job
    when any process exits badly or is killed, and a crashed worker would take
    every worker of its ``mpiexec`` with it. (MPICH's Hydra and Open MPI 5
    are left to their defaults: untested here.)

    >>> survive_args("no-such-mpiexec")
    []
    """
    if "OpenRTE" not in version_text(mpiexec):
        return []
    return ["--mca", "orte_abort_on_non_zero_status", "0"]


def main() -> None:
    name, args = engine_argv(sys.argv[1:])
    os.environ[WORKER_ENV] = name
    relay.start_engine_relay()  # (where the controller is reached through a relay)
    sys.argv = [sys.argv[0], *args]
    runpy.run_module("ipyparallel.engine", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
