"""nbrpc clusters started by a real ``mpiexec`` (Debian's Open MPI) across hosts.

Three hosts from network namespaces (:func:`test_netns.build`): the driver (and
with it the controller and ``mpiexec``) in h1; a hostfile naming h2 and h3,
two slots each. Open MPI reaches the hosts through a fake ``ssh``
(``--mca plm_rsh_agent``) that runs its daemon in the namespace named as the
host, under a hostname of its own (a UTS namespace), as on real machines.

``Cluster(launcher="mpi")`` starts all four workers with one ``mpiexec -n 4``
(:mod:`nbrpc.cluster.mpi_engine` gives each MPI rank its worker), so they
spread over h2 and h3 as the hostfile says. Then the RPC, RRef and distributed
autograd checks; ``restart`` of one worker puts it back on its host under its
name and rank, with the others untouched; a worker killed (SIGKILL) takes none
of its ``mpiexec``'s other workers with it, and ``restart`` brings it back;
``stop`` leaves nothing running.

Needs root, iproute2, util-linux's ``unshare``, Open MPI and mpi4py (``make
test`` installs them where it may); skipped, with the reason, where they are
missing. Run with ``pytest -m mpi tests/test_mpi.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_netns import CLUSTER_CHECKS, REPO, Net, _cmdline, drive, hosts

pytestmark = pytest.mark.mpi

DRIVER_TIMEOUT = 150.0
MARK = "NBRPC-MPI-RESULT "
WORKER_HOSTS = ("h2", "h3")

# `ssh [OPTIONS] HOST CMD...` for Open MPI: CMD in the namespace HOST, whose
# hostname is HOST (its own UTS namespace), the environment passed through
FAKE_SSH = r'''#!/bin/sh
while [ $# -gt 0 ]; do
  case "$1" in -[bcDEeFIiJLlmOopQRSWw]) shift 2;; -*) shift;; *) break;; esac
done
host=$1; shift
exec ip netns exec "$host" unshare --uts sh -c 'hostname "$0" && exec sh -c "$1"' "$host" "$*"
'''


@pytest.fixture(scope="module")
def net() -> Iterator[Net]:
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("the MPI tier needs Linux and root (network namespaces)")
    missing = [b for b in ("ip", "unshare", "mpiexec", "orted") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"missing {missing}: apt-get install openmpi-bin iproute2 util-linux "
                    "(make test does, where it may)")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py is not installed (it is in nbrpc's test extras)")
    with hosts("nbmpi") as n:
        yield n


DRIVER = r'''
import json, os, sys, time
import torch
from nbrpc import rpc, autograd
from nbrpc.cluster import Cluster

cfg = json.loads(sys.argv[1])
out = {}


def where():
    import socket
    return {"host": socket.gethostname(), "netns": os.readlink("/proc/self/ns/net"),
            "pid": os.getpid(), "worker": os.environ.get("NBRPC_WORKER"),
            "mpi_rank": os.environ.get("OMPI_COMM_WORLD_RANK"),
            "mpi_size": os.environ.get("OMPI_COMM_WORLD_SIZE")}


''' + CLUSTER_CHECKS + r'''

options = {"mpi_args": ["--hostfile", cfg["hostfile"], "--mca", "plm_rsh_agent", cfg["ssh"]]}
t0 = time.monotonic()
cluster = Cluster(launcher="mpi", launcher_options=options, host=cfg["addr"],
                  controller_ip=cfg["addr"], threads=4, timeout=90, rpc_timeout=30,
                  progress=False)
try:
    cluster.start(4)
    out["start_s"] = round(time.monotonic() - t0, 1)
    out["workers"] = {w: rpc.rpc_sync(w, where) for w in cluster.names}
    out["add"] = rpc.rpc_sync("worker2", torch.add, args=(torch.ones(3), 2)).tolist()
    rref = rpc.remote("worker4", make, args=(1000,))
    out["rref"] = {"owner": rref.owner_name(), "via_worker1": rpc.rpc_sync(
        "worker1", fetch_sum, args=(rref,))}
    del rref
    out["grad_match"] = grad_matches("worker3")

    t1 = time.monotonic()
    cluster.restart("worker3", progress=False)
    out["restart_s"] = round(time.monotonic() - t1, 1)
    out["after"] = {w: rpc.rpc_sync(w, where) for w in cluster.names}

    # a rank that dies (SIGKILL) takes nobody with it: mpiexec carries on
    os.kill(out["after"]["worker2"]["pid"], 9)
    t3, deadline = time.monotonic(), time.monotonic() + 20
    while cluster.agent.gone_why(cluster.agent.rank_of("worker2")) is None:
        assert time.monotonic() < deadline, "worker2's death was not noticed"
        time.sleep(0.05)
    out["kill_noticed_s"] = round(time.monotonic() - t3, 1)
    out["survivors"] = {w: rpc.rpc_sync(w, where) for w in ("worker1", "worker4")}
    cluster.restart("worker2", progress=False)
    out["back"] = rpc.rpc_sync("worker2", where)
    out["status"] = str(cluster.status())
finally:
    t2 = time.monotonic()
    cluster.stop(timeout=30)
    out["stop_s"] = round(time.monotonic() - t2, 1)
print(cfg["mark"] + json.dumps(out), flush=True)
'''


def test_one_mpiexec_spreads_the_workers_and_restart_keeps_their_place(
        net: Net, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    ssh = tmp_path / "ssh"
    ssh.write_text(FAKE_SSH)
    ssh.chmod(0o755)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("".join(f"{net.ns(h)} slots=2\n" for h in WORKER_HOSTS))
    cfg = {"addr": net.addr("h1"), "hostfile": str(hostfile), "ssh": str(ssh), "mark": MARK}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NBRPC_", "OMPI_"))}
    env.update(PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path), PYTHONPATH=str(REPO),
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    cmd = ["ip", "netns", "exec", net.ns("h1"), sys.executable, "-c", DRIVER, json.dumps(cfg)]
    out = drive(cmd, env=env, cwd=tmp_path, timeout=DRIVER_TIMEOUT, mark=MARK)

    workers = out["workers"]
    inodes = {net.inode(h): net.ns(h) for h in WORKER_HOSTS}
    assert sorted(workers) == ["worker1", "worker2", "worker3", "worker4"]
    for name, w in workers.items():
        assert w["worker"] == name, w
        assert inodes.get(w["netns"]) == w["host"], f"{name} is not on a worker host: {w}"
        assert w["mpi_size"] == "4", w  # all four from one mpiexec
    assert sorted(int(w["mpi_rank"]) for w in workers.values()) == [0, 1, 2, 3]
    placed = sorted(w["host"] for w in workers.values())
    assert placed == sorted([net.ns("h2")] * 2 + [net.ns("h3")] * 2), placed  # the slots

    assert out["add"] == [3.0, 3.0, 3.0]
    assert out["rref"] == {"owner": "worker4", "via_worker1": float(sum(range(1000)))}
    assert out["grad_match"]

    after = out["after"]
    new = after["worker3"]
    assert new["pid"] != workers["worker3"]["pid"] and new["mpi_size"] == "1", new
    assert new["host"] == workers["worker3"]["host"], (new, workers["worker3"])  # its place
    for name in ("worker1", "worker2", "worker4"):  # the rest of its mpiexec untouched
        assert after[name]["pid"] == workers[name]["pid"], (name, after[name], workers[name])
    # worker2 killed: its mpiexec's other ranks live on; restart puts it back on its host
    for name, w in out["survivors"].items():
        assert w["pid"] == workers[name]["pid"], (name, w, workers[name])
    assert out["back"]["pid"] != after["worker2"]["pid"], out["back"]
    assert out["back"]["host"] == workers["worker2"]["host"], out["back"]
    assert "4 workers ready" in out["status"], out["status"]

    deadline = time.monotonic() + 10
    while any(net.pids().values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {pid: _cmdline(pid) for pids in net.pids().values() for pid in pids}
    assert not left, f"left running in the hosts after stop() ({out['stop_s']} s): {left}"
    with capsys.disabled():  # the figures, in make test's output too
        print(f"\nmpi: start of 4 workers {out['start_s']} s, restart {out['restart_s']} s, "
              f"a killed rank noticed in {out['kill_noticed_s']} s, stop {out['stop_s']} s")
