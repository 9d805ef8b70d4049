"""nbrpc clusters under a real Slurm: engines submitted with ``sbatch``.

The tier builds, once for the module, a Slurm cluster from Debian's
``slurm-wlm`` and ``munge`` on this machine, with hosts from Linux network
namespaces (names unique to the run):

* a switch ``sw`` (a bridge); the controller host ``ctl`` running slurmctld;
  compute hosts ``n1`` and ``n2``, each running its own slurmd (``-N``) with
  its own address; all on one 10.215.N.0/24, behind veth links (the first N
  that no route of the machine covers: a network namespace left by an earlier
  run that was killed keeps its routes, and the machine's traffic would go there);
* the machine's own namespace on that bridge too (10.215.N.1), through a veth
  of its own: the driver (the "kernel") runs there, as on a login node, and so
  do ``sbatch``, ``squeue`` and ``scancel``. No Slurm daemon listens in the
  machine's namespace: slurmctld and the slurmds listen inside theirs;
* munged, with a key of the run's, on a unix socket in the run's directory
  (``AuthInfo=socket=...``); every Slurm program reads the run's
  ``slurm.conf`` through ``$SLURM_CONF``. Nothing under /etc is touched.

The partition ``debug`` spreads jobs over the hosts (``LLN``: least loaded
node); ``closed`` is DOWN, so its jobs pend with reason ``PartitionDown``.
Each test runs a driver script in the machine's namespace (functions defined
in its ``__main__`` travel by value), which prints its findings as JSON.

Needs root, iproute2, slurm-wlm and munge (``make test`` installs the last two
with apt-get where it may); skipped, with the reason, where they are missing or
namespaces cannot be built. Run with ``pytest -m slurm tests/test_slurm.py``.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from test_netns import CLUSTER_CHECKS, REPO, Net, _ip, _Unavailable, drive

pytestmark = pytest.mark.slurm

SUBNETS = "10.215"  # the run's /24 is the first free 10.215.N.0/24 (free_subnet)
UPLINK = 1  # the machine's own namespace's octet: the driver, sbatch, squeue
HOSTS = {"ctl": 9, "n1": 2, "n2": 3}  # host -> last octet of its address
NODES = ("n1", "n2")
CPUS = 4  # per node, as configured (more than the machine has: config_overrides)
SLURMD_PORT = 6818  # in each compute host's namespace (nothing else listens there)
SLURMCTLD_PORT = 6817  # in ctl's namespace
DAEMON_START_S = 30.0  # every node idle in sinfo, after the daemons start
DRIVER_TIMEOUT = 150.0  # one driver script, start to stop
MARK = "NBRPC-SLURM-RESULT "
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sinfo")

SLURM_CONF = """\
ClusterName=nbrpc{tag}
SlurmctldHost={hostname}({ctl})
SlurmctldPort={ctl_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.socket
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool/%n
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd-%n.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd-%n.log
MailProg=/bin/true
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=2
MinJobAge=300
NodeName=n1 NodeAddr={n1} CPUs={cpus} State=UNKNOWN
NodeName=n2 NodeAddr={n2} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP LLN=YES
PartitionName=closed Nodes=n1 MaxTime=INFINITE State=DOWN
"""
# the slurmds' plugins: the cgroup v1 hierarchy that a container mounts under
# /sys/fs/cgroup (nothing is constrained: proctrack/linuxproc, task/none)
CGROUP_CONF = "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n"


def free_subnet() -> str:
    """The first ``10.215.N`` whose /24 no route of this machine's namespace
    overlaps as or more specifically (a shorter route, say 10.0.0.0/8, loses to
    ours): a namespace left behind by an earlier run that was killed before its
    teardown keeps its veth and route here, and traffic for a /24 that two
    routes cover goes to the older one (a dead controller: "connect failure")."""
    routes = json.loads(_ip("-j", "-4", "route", "show", "table", "all") or "[]")
    taken = []
    for r in routes:
        dst = r.get("dst", "default")
        if dst != "default":
            net = ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False)
            if net.prefixlen >= 24:
                taken.append(net)
    for n in range(256):
        ours = ipaddress.ip_network(f"{SUBNETS}.{n}.0/24")
        if not any(ours.overlaps(t) for t in taken):
            return f"{SUBNETS}.{n}"
    raise _Unavailable(f"every {SUBNETS}.N.0/24 is routed on this machine already")


@dataclass
class Slurm:
    """The run's Slurm cluster: its directory, namespaces and daemons."""

    dir: Path
    prefix: str
    uplink: str  # the machine-side veth's name
    subnet: str  # 10.215.N: the hosts are .9 (ctl), .2, .3 (nodes); the machine .1
    daemons: list[subprocess.Popen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.net = Net(self.prefix, [], dict(HOSTS), self.subnet)

    @property
    def env(self) -> dict[str, str]:
        """The environment of a Slurm client (and of the drivers)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "NBRPC_"))}
        env.update(SLURM_CONF=str(self.dir / "slurm.conf"), PYTHONUNBUFFERED="1")
        return env

    def ns(self, host: str) -> str:
        return self.net.ns(host)

    def addr(self, host: str) -> str:
        """A host's address (``"up"``: the machine's own namespace)."""
        return f"{self.subnet}.{UPLINK}" if host == "up" else self.net.addr(host)

    def inode(self, host: str) -> str:
        return self.net.inode(host)

    def run(self, *cmd: str, timeout: float = 15) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), capture_output=True, text=True, env=self.env,
                              timeout=timeout)

    def queue(self) -> list[list[str]]:
        """Jobs in the queue that have not finished: [id, state, nodes-or-reason]."""
        r = self.run("squeue", "-h", "-o", "%i|%T|%R")
        assert r.returncode == 0, r.stderr
        return [line.split("|") for line in r.stdout.splitlines() if line.strip()]

    def logs(self) -> str:
        parts = []
        for name in ("slurmctld.log", "slurmd-n1.log", "slurmd-n2.log"):
            path = self.dir / name
            if path.exists():
                parts.append(f"--- {name} ---\n" + path.read_text(errors="replace")[-3000:])
        return "\n".join(parts)

    def _daemon(self, name: str, *cmd: str) -> None:
        log = open(self.dir / f"{name}.out", "wb")
        self.daemons.append(subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT,
                                             env=self.env, start_new_session=True))
        log.close()

    def start(self) -> None:
        d = self.dir
        for sub in ("state", "spool/n1", "spool/n2"):
            (d / sub).mkdir(parents=True)
        (d / "munge.key").write_bytes(secrets.token_bytes(128))
        (d / "munge.key").chmod(0o600)
        addr = {h: self.addr(h) for h in HOSTS}
        (d / "slurm.conf").write_text(SLURM_CONF.format(
            tag=self.prefix.rsplit("-", 1)[-1], hostname=socket.gethostname().split(".")[0],
            ctl=addr["ctl"], ctl_port=SLURMCTLD_PORT, slurmd_port=SLURMD_PORT, dir=d,
            cpus=CPUS, n1=addr["n1"], n2=addr["n2"]))
        (d / "cgroup.conf").write_text(CGROUP_CONF)
        self._daemon("munged", "munged", "--foreground", "--force",
                     f"--socket={d}/munge.socket", f"--key-file={d}/munge.key",
                     f"--log-file={d}/munged.log", f"--pid-file={d}/munged.pid",
                     f"--seed-file={d}/munged.seed")
        deadline = time.monotonic() + 10
        while not (d / "munge.socket").exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"munged did not start: {(d / 'munged.out').read_text()}")
            time.sleep(0.05)
        self._daemon("slurmctld", "ip", "netns", "exec", self.ns("ctl"),
                     "slurmctld", "-D", "-i")
        for node in NODES:
            self._daemon(f"slurmd-{node}", "ip", "netns", "exec", self.ns(node),
                         "slurmd", "-D", "-N", node)
        deadline = time.monotonic() + DAEMON_START_S
        while True:
            r = self.run("sinfo", "-h", "-p", "debug", "-N", "-o", "%N %t")
            states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
            if states and all(states.get(n) == "idle" for n in NODES):
                return
            dead = [p.args for p in self.daemons if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"the Slurm cluster did not come up (nodes {states}, "
                                   f"exited: {dead}; {r.stderr.strip()}):\n{self.logs()}")
            time.sleep(0.2)

    def build(self) -> None:
        """The bridge, the hosts, and the machine's veth onto the bridge."""
        sw = self.ns("sw")
        _ip("netns", "add", sw, probe=True)
        self.net.created.append(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge", probe=True)
        _ip("-n", sw, "link", "set", "br0", "up")
        # the machine's end gets a name unique to the run; the other end lives in sw
        _ip("link", "add", self.uplink, "type", "veth", "peer", "name", "up0", "netns", sw,
            probe=True)
        _ip("-n", sw, "link", "set", "up0", "master", "br0", "up")
        _ip("addr", "add", f"{self.addr('up')}/24", "dev", self.uplink)
        _ip("link", "set", self.uplink, "up")
        for host in HOSTS:
            ns = self.ns(host)
            _ip("netns", "add", ns, probe=True)
            self.net.created.append(ns)
            _ip("-n", sw, "link", "add", f"v{host}", "type", "veth", "peer", "name", "eth0",
                "netns", ns)
            _ip("-n", sw, "link", "set", f"v{host}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def teardown(self) -> None:
        """Stop our daemons (by the ids we started them under), kill anything
        left in our namespaces (jobs' processes), delete the namespaces and veth."""
        for p in self.daemons:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.daemons:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(5)
        self.net.teardown()  # kills what is left in them (jobs' processes) first
        try:
            _ip("link", "del", self.uplink)
        except RuntimeError:
            pass  # went with its peer's namespace


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Slurm]:
    if sys.platform != "linux" or os.geteuid() != 0:
        pytest.skip("the Slurm tier needs Linux and root (network namespaces, Slurm daemons)")
    missing = [b for b in (*BINARIES, "ip") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"missing {missing}: apt-get install slurm-wlm munge iproute2 "
                    "(make test does, where it may)")
    tag = secrets.token_hex(2)
    try:
        subnet = free_subnet()
    except _Unavailable as e:
        pytest.skip(f"no address range for the Slurm hosts here: {e}")
    s = Slurm(tmp_path_factory.mktemp("slurm"), f"nbsl-{os.getpid()}-{tag}",
              f"nbsl{os.getpid() % 10000}{tag}"[:15], subnet)
    s.dir.chmod(0o700)  # munged refuses a key or socket others may reach
    try:
        s.build()
    except _Unavailable as e:
        s.teardown()
        pytest.skip(f"cannot build network namespaces here: {e}")
    try:
        s.start()
        yield s
    finally:
        s.teardown()


def run_driver(slurm: Slurm, script: str, cfg: dict, cwd: Path) -> dict:
    """Run a driver script in the machine's namespace; its last MARK line, as JSON."""
    cfg = {**cfg, "addr": slurm.addr("up"), "mark": MARK}
    cmd = [sys.executable, "-c", script, json.dumps(cfg)]
    env = {**slurm.env, "PYTHONPATH": str(REPO)}
    return drive(cmd, env=env, cwd=cwd, timeout=DRIVER_TIMEOUT, mark=MARK, also=slurm.logs)


def assert_queue_empty(slurm: Slurm, why: str) -> None:
    """No job of ours is left pending or running (bounded wait: cancelling is
    asynchronous, and a cancelled job shows COMPLETING for a moment)."""
    deadline = time.monotonic() + 15
    while slurm.queue() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not slurm.queue(), f"{why}: squeue still lists {slurm.queue()}"


COMMON = r'''
import json, os, subprocess, sys, time
import torch
cfg = json.loads(sys.argv[1])
out = {}


def where():
    """Where this worker runs: namespace, Slurm's view of it, agent address."""
    from nbrpc.cluster import engine
    agent = engine._agent[0] if engine._agent else None
    return {"netns": os.readlink("/proc/self/ns/net"), "job": os.environ.get("SLURM_JOB_ID"),
            "node": os.environ.get("SLURMD_NODENAME"), "worker": os.environ.get("NBRPC_WORKER"),
            "address": agent.address if agent else None}


def done():
    print(cfg["mark"] + json.dumps(out), flush=True)
'''

# Python API: four workers, RPC, RRefs, distributed autograd, a job cancelled by
# Slurm, restart, stop.
API_DRIVER = COMMON + r'''
from nbrpc import rpc, autograd
from nbrpc.cluster import Cluster
from nbrpc.errors import WorkerGoneError


''' + CLUSTER_CHECKS + r'''

def _start_error(cluster):
    try:
        cluster.start(1)
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


t0 = time.monotonic()
cluster = Cluster(launcher="slurm", host=cfg["addr"], controller_ip=cfg["addr"],
                  launcher_options={"queue": "debug"}, profile_dir=cfg["profile"],
                  threads=4, timeout=90, rpc_timeout=30, failure_timeout=2.0, progress=False)
try:
    cluster.start(4)
    out["start_s"] = round(time.monotonic() - t0, 1)
    out["workers"] = {w: rpc.rpc_sync(w, where) for w in cluster.names}
    out["jobs"] = {w.name: w.job for w in cluster.status().workers if w.rank}
    out["add"] = rpc.rpc_sync("worker3", torch.add, args=(torch.ones(3), 2)).tolist()

    rref = rpc.remote("worker4", make, args=(1000,))
    out["rref"] = {"owner": rref.owner_name(), "here": float(rref.to_here().sum()),
                   "via_worker1": rpc.rpc_sync("worker1", fetch_sum, args=(rref,))}
    del rref

    out["grad_match"] = grad_matches("worker2")

    # Slurm cancels worker2's job: the group finds it dead, calls fail by name
    job = cluster.workers["worker2"].job.job_id
    out["cancelled_job"] = job
    t1 = time.monotonic()
    subprocess.run(["scancel", job], check=True, timeout=15)
    while cluster.agent.gone_why(2) is None and time.monotonic() - t1 < 20:
        time.sleep(0.05)
    out["gone_s"] = round(time.monotonic() - t1, 2)
    out["gone_why"] = cluster.agent.gone_why(2)
    try:
        rpc.rpc_sync("worker2", torch.add, args=(torch.ones(1), 1))
        out["call_after_cancel"] = "answered"
    except WorkerGoneError as e:
        out["call_after_cancel"] = f"WorkerGoneError: {e}"
    row = cluster.status()["worker2"]
    while "CANCELLED" not in row.job and time.monotonic() - t1 < 20:  # COMPLETING at first
        time.sleep(0.2)
        row = cluster.status()["worker2"]
    out["row_after_cancel"] = {"state": row.state, "job": row.job}

    # restart resubmits it under its name
    t2 = time.monotonic()
    cluster.restart("worker2", progress=False)
    out["restart_s"] = round(time.monotonic() - t2, 1)
    out["restarted"] = rpc.rpc_sync("worker2", where)
    out["status"] = str(cluster.status())
finally:
    t3 = time.monotonic()
    cluster.stop(timeout=30)
    out["stop_s"] = round(time.monotonic() - t3, 1)

# A start whose only job cannot run: while it waits, its status (what the live
# view shows under the progress bar in a kernel) names the job and Slurm's reason.
import threading
waiting = Cluster(launcher="slurm", host=cfg["addr"], controller_ip=cfg["addr"],
                  launcher_options={"queue": "closed"}, profile_dir=cfg["profile"] + "-2",
                  threads=2, timeout=6, progress=False)
failed = []
starter = threading.Thread(target=lambda: failed.append(_start_error(waiting)))
starter.start()
out["waiting_status"] = None
while starter.is_alive():
    s = waiting.status()
    rows = [w for w in s.workers if w.rank]
    if rows and "PENDING" in rows[0].job:
        out["waiting_status"] = [s.summary(), rows[0].state, rows[0].job]
    time.sleep(0.2)
starter.join()
out["waiting_error"] = failed[0]
done()
'''


def test_cluster_under_slurm(slurm: Slurm, tmp_path: Path,
                             capsys: pytest.CaptureFixture) -> None:
    """``Cluster(launcher="slurm")``: each worker one sbatch job, spread over the
    nodes; the RPC, RRef and distributed-autograd checks; a job Slurm cancels is
    a dead worker; restart resubmits it; stop leaves the queue empty."""
    out = run_driver(slurm, API_DRIVER, {"profile": str(tmp_path / "profile")}, tmp_path)
    inodes = {slurm.inode(n): n for n in NODES}
    workers = out["workers"]
    assert sorted(workers) == ["worker1", "worker2", "worker3", "worker4"]
    for name, w in workers.items():
        assert w["worker"] == name and w["job"], w
        assert w["netns"] in inodes, f"{name} does not run on a compute host: {w}"
        assert inodes[w["netns"]] == w["node"], w  # the node Slurm says is where it is
        host = slurm.addr(w["node"])
        assert w["address"].startswith(f"tcp://{host}:"), w  # bound to its node's address
        assert out["jobs"][name] == f"Slurm job {w['job']} RUNNING on {w['node']}", out["jobs"]
    assert len({w["job"] for w in workers.values()}) == 4  # one job per worker
    assert {w["node"] for w in workers.values()} == set(NODES)  # spread over both hosts

    assert out["add"] == [3.0, 3.0, 3.0]
    assert out["rref"] == {"owner": "worker4", "here": float(sum(range(1000))),
                           "via_worker1": float(sum(range(1000)))}
    assert out["grad_match"]

    assert out["gone_why"] and out["gone_s"] < 10, out
    assert out["call_after_cancel"].startswith("WorkerGoneError"), out["call_after_cancel"]
    assert "worker2" in out["call_after_cancel"]
    assert out["row_after_cancel"]["state"] == "dead", out["row_after_cancel"]
    assert out["row_after_cancel"]["job"].startswith(
        f"Slurm job {out['cancelled_job']} CANCELLED"), out["row_after_cancel"]

    new = out["restarted"]
    assert new["worker"] == "worker2" and new["job"] not in (None, out["cancelled_job"]), new
    assert "worker2  ready" in out["status"], out["status"]
    summary, state, job = out["waiting_status"] or ("", "", "")
    assert summary == "nbrpc cluster (slurm launcher): starting, 0 of 1 workers ready", out
    assert state == "starting" and job.endswith("PENDING (PartitionDown)"), out
    assert out["waiting_error"].startswith("ClusterError") and "PartitionDown" in \
        out["waiting_error"], out["waiting_error"]
    assert_queue_empty(slurm, "after Cluster.stop()")
    with capsys.disabled():  # the figures, in make test's output too
        print(f"\nslurm: start of 4 workers {out['start_s']} s, cancelled job noticed in "
              f"{out['gone_s']} s, restart {out['restart_s']} s, stop {out['stop_s']} s")


# The magic, in an IPython shell: a start that succeeds, then one whose job can
# never run (partition DOWN) and fails with Slurm's reason.
MAGIC_DRIVER = COMMON + r'''
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.error import UsageError
from nbrpc import rpc

shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "nbrpc")
opts = f"--launcher slurm --host {cfg['addr']} --controller-ip {cfg['addr']} --threads 4"
shell.run_line_magic("rpc_cluster", f"start 2 {opts} --timeout 90 --queue=debug "
                                    f"--output_file={cfg['dir']}/engine-%j.log")
out["workers"] = {w: rpc.rpc_sync(w, where) for w in ("worker1", "worker2")}
out["status"] = str(shell.run_line_magic("rpc_cluster", "status"))
shell.run_line_magic("rpc_cluster", "stop")
t0 = time.monotonic()
while True:  # cancelled jobs show as COMPLETING (CG) for a moment
    out["queue_after_stop"] = subprocess.run(["squeue", "-h"], capture_output=True, text=True,
                                             timeout=15).stdout.strip()
    if not out["queue_after_stop"] or time.monotonic() - t0 > 15:
        break
    time.sleep(0.2)
print("\n--- pending ---", flush=True)
t0 = time.monotonic()
try:
    shell.run_line_magic("rpc_cluster", f"start 1 {opts} --timeout 6 --queue=closed")
    out["pending_error"] = None
except UsageError as e:
    out["pending_error"] = str(e)
out["pending_s"] = round(time.monotonic() - t0, 1)
done()
'''


def test_magic_under_slurm_and_a_job_left_pending(slurm: Slurm, tmp_path: Path) -> None:
    """``%rpc_cluster start N --launcher slurm``: workers run as jobs; the progress
    line names each job and its state; a job that stays pending past the
    timeout fails the start with Slurm's reason, and is cancelled."""
    assert_queue_empty(slurm, "before the test")
    out = run_driver(slurm, MAGIC_DRIVER, {"dir": str(tmp_path)}, tmp_path)
    assert {w["node"] for w in out["workers"].values()} == set(NODES), out["workers"]
    assert "2 workers ready" in out["status"], out["status"]
    assert out["queue_after_stop"] == ""
    logs = sorted(p.name for p in tmp_path.glob("engine-*.log"))
    assert len(logs) == 2, logs  # the jobs wrote where --output_file said (%j expanded)

    before, _, pending = out["stdout"].partition("--- pending ---")
    assert "RUNNING" in before or "ready" in before, before  # the progress line
    err = out["pending_error"]
    assert err is not None, "the start did not fail, with its only job never able to run"
    assert "PENDING" in err and "PartitionDown" in err and "worker1" in err, err
    assert "PENDING (PartitionDown)" in pending, pending  # said while it waited
    assert out["pending_s"] < 40, out
    assert_queue_empty(slurm, "after the failed start")


def test_the_hosts_avoid_a_subnet_a_dead_run_left_routed() -> None:
    """A killed run's namespaces keep their veth and route in the machine's
    namespace; this run's hosts take the next /24 instead of sharing it (the
    machine's traffic would go to the dead run's controller)."""
    if sys.platform != "linux" or os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs Linux, root and iproute2 (a veth in the machine's namespace)")
    first = free_subnet()
    name = f"nbst{os.getpid() % 10000}{secrets.token_hex(2)}"[:15]
    try:
        _ip("link", "add", name, "type", "veth", "peer", "name", f"{name[:13]}p", probe=True)
    except _Unavailable as e:
        pytest.skip(f"cannot make a veth here: {e}")
    try:
        _ip("addr", "add", f"{first}.1/24", "dev", name)
        _ip("link", "set", name, "up")
        second = free_subnet()
        assert second != first
        assert not ipaddress.ip_network(f"{second}.0/24").overlaps(
            ipaddress.ip_network(f"{first}.0/24"))
    finally:
        _ip("link", "del", name)  # its peer goes with it
    assert free_subnet() == first
