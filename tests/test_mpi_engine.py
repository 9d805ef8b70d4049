"""The MPI launcher's pieces, with no MPI: which worker an MPI rank is, what
mpiexec is told to forward. The real thing runs in tests/test_mpi.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from nbrpc.cluster import mpi_engine
from nbrpc.cluster.cluster import Cluster


def fake(tmp_path: Path, name: str, version: str) -> str:
    exe = tmp_path / name
    exe.write_text(f"#!/bin/sh\necho '{version}'\n")
    exe.chmod(0o755)
    return str(exe)


def test_open_mpi_is_told_to_forward_the_engines_environment(tmp_path: Path) -> None:
    mpi_engine.version_text.cache_clear()
    ompi = fake(tmp_path, "ompi-mpiexec", "mpiexec (OpenRTE) 4.1.4")
    hydra = fake(tmp_path, "hydra-mpiexec", "HYDRA build details: Version: 4.0.2")
    assert mpi_engine.forwarded({"NBRPC_HOST", "IPP_CONNECTION_INFO"}, ompi) == [
        "-x", "IPP_CONNECTION_INFO", "-x", "NBRPC_HOST"]
    assert mpi_engine.forwarded({"NBRPC_HOST"}, hydra) == []  # Hydra forwards everything
    assert mpi_engine.forwarded({"NBRPC_HOST"}, str(tmp_path / "missing")) == []


def test_only_open_mpi_4_is_told_to_carry_on_when_a_rank_dies(tmp_path: Path) -> None:
    mpi_engine.version_text.cache_clear()
    ompi4 = fake(tmp_path, "ompi4-mpiexec", "mpiexec (OpenRTE) 4.1.4")
    ompi5 = fake(tmp_path, "ompi5-mpiexec", "mpiexec (Open MPI) 5.0.3")
    hydra = fake(tmp_path, "hydra-mpiexec", "HYDRA build details: Version: 4.0.2")
    assert mpi_engine.survive_args(ompi4) == ["--mca", "orte_abort_on_non_zero_status", "0"]
    assert mpi_engine.survive_args(ompi5) == mpi_engine.survive_args(hydra) == []


@pytest.mark.parametrize("env,expected", [
    ({"OMPI_COMM_WORLD_RANK": "0"}, ("worker3", ["--mpi", "--IPEngine.id=3"])),
    ({"PMI_RANK": "1"}, ("worker4", ["--mpi", "--IPEngine.id=4"])),
])
def test_each_mpi_rank_is_its_own_worker(env: dict, expected: tuple) -> None:
    assert mpi_engine.engine_argv(["--workers", "worker3=3,worker4=4", "--mpi"], env) == expected


def test_more_processes_than_workers_is_said_plainly() -> None:
    with pytest.raises(SystemExit, match="MPI rank 2 has no worker"):
        mpi_engine.engine_argv(["--workers", "worker1=1,worker2=2"], {"PMI_RANK": "2"})
    with pytest.raises(ValueError, match="NAME=RANK"):
        mpi_engine.parse_workers("worker1")


def test_the_mpi_launcher_is_known_by_name_and_class() -> None:
    from ipyparallel.cluster.launcher import MPIEngineSetLauncher, SSHEngineSetLauncher

    assert Cluster(launcher="mpi", host="127.0.0.1")._mpi
    assert Cluster(launcher=MPIEngineSetLauncher, host="127.0.0.1")._mpi
    assert not Cluster(launcher=SSHEngineSetLauncher, host="127.0.0.1")._mpi
    assert not Cluster(launcher="slurm", host="127.0.0.1")._mpi
