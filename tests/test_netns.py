"""Multi-host operation on one machine: hosts built from Linux network namespaces.

Four namespaces, with names unique to the run: a switch ``sw`` holding a
bridge, and three hosts ``h1``, ``h2``, ``h3``, each with one veth (``eth0``,
10.213.0.N/24) plugged into the bridge. The hosts share the machine's
filesystem, hostname and /dev/shm, but not its network: each sees only its own
``lo`` and ``eth0``, so every message between them crosses veth links and a
bridge, as on a LAN.

Each test runs a driver script in ``h1`` (``ip netns exec h1 python -c ...``)
that starts an ``nbrpc.Cluster`` with the controller's relay and the driver's
agent listening on h1's address (``controller_ip``, ``host``) and worker1's engine
placed in ``h2``, worker2's in ``h3`` by an ipyparallel launcher:

* ``launcher="local"`` whose ``engine_cmd`` (from ``launcher_options``) is a
  one-line shell wrapper: it picks the namespace from ``$NBRPC_WORKER`` (set
  per engine set by the cluster) and ``exec``s ``ip netns exec HOST python -m
  ipyparallel.engine ...``; ``environment={"NBRPC_HOST": "eth0"}`` (merged
  with the cluster's own) makes the agents bind that interface by name;
* ipyparallel's SSH engine-set launcher with ``ssh_cmd``/``scp_cmd`` pointing
  at a fake ``ssh`` (runs the command in the namespace named as the host, in a
  bare login-like environment) and a fake ``scp`` (the hosts share the
  filesystem): ``engines={h2: 1, h3: 1}``, ``remote_python``. This exercises
  ipyparallel's whole SSH path (shell probe, remote profile, connection files
  sent, engines started and stopped through "ssh"); the agents pick the
  interface that routes to the driver by themselves. nbrpc gives worker r the
  r-th slot of ``engines`` (with one engine set of one engine per worker,
  ``SSHEngineSetLauncher`` alone would put every worker on the first host):
  the test checks that worker1 runs in h2 and worker2 in h3.

The driver then records, as JSON on stdout:

* that each worker runs in its namespace (``/proc/self/ns/net``) with its
  agent bound to that namespace's 10.213.0.N address, not loopback;
* that worker1 calls worker2 directly (worker1 holds a TCP connection to
  worker2's address);
* an RRef created on worker2 fetched by the driver and by worker1;
* an 8 MB tensor driver -> worker1 -> driver, intact (by socket: the peers'
  addresses differ, so shared memory is not used);

and the test checks it, then that ``stop()`` left no process in the hosts.
The namespaces are deleted (after killing anything left in them) whatever
happens. Needs root and iproute2 (``ip netns``, veth, bridge); skipped, with
the reason, where they cannot be created. Run with
``pytest -m netns tests/test_netns.py``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.netns

SUBNET = "10.213.0"
HOSTS = {"h1": 1, "h2": 2, "h3": 3}  # host -> last octet of its address
PLACEMENT = {"worker1": "h2", "worker2": "h3"}  # where each worker's engine runs
DRIVER_TIMEOUT = 90.0  # the whole driver script, start to stop (pytest's limit is 120 s)
MARK = "NBRPC-NETNS-RESULT "
REPO = Path(__file__).resolve().parent.parent


class _Unavailable(Exception):
    """Network namespaces cannot be built here (a reason to skip, not a failure)."""


def _ip(*args: str, probe: bool = False) -> str:
    """Run ``ip ARGS`` (bounded). With ``probe``, a failure means the feature is
    unavailable here: raise :class:`_Unavailable` instead of failing."""
    try:
        r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=15)
    except FileNotFoundError as e:
        raise _Unavailable("iproute2's `ip` is not installed") from e
    if r.returncode != 0:
        msg = f"`ip {' '.join(args)}` failed ({r.returncode}): {r.stderr.strip()}"
        if probe:
            raise _Unavailable(msg)
        raise RuntimeError(msg)
    return r.stdout


@dataclass
class Net:
    prefix: str  # unique per run: nbrpc-<pid>-<hex>
    created: list[str]  # namespaces made so far (deleted in reverse)
    hosts: dict[str, int] = field(default_factory=lambda: dict(HOSTS))  # host -> octet
    subnet: str = SUBNET  # the hosts' /24, as "a.b.c"

    def ns(self, host: str) -> str:
        return f"{self.prefix}-{host}"

    def addr(self, host: str) -> str:
        return f"{self.subnet}.{self.hosts[host]}"

    def inode(self, host: str) -> str:
        """What ``readlink /proc/PID/ns/net`` shows for a process in ``host``."""
        return f"net:[{os.stat(f'/run/netns/{self.ns(host)}').st_ino}]"

    def pids(self) -> dict[str, list[int]]:
        """Processes in each of our namespaces."""
        out = {}
        for name in self.created:
            try:
                out[name] = [int(p) for p in _ip("netns", "pids", name).split()]
            except RuntimeError:
                pass
        return out

    def teardown(self) -> None:
        """Kill what still runs in our namespaces (only ours: the names are
        unique to this run), then delete them; deleting the switch's namespace
        destroys the veths."""
        for pids in self.pids().values():
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for name in reversed(self.created):
            for _ in range(5):
                try:
                    _ip("netns", "del", name)
                    break
                except RuntimeError:
                    time.sleep(0.2)
        self.created.clear()


def build(prefix: str, hosts: dict[str, int] | None = None) -> Net:
    """The switch namespace with a bridge, and one namespace per host (``hosts``:
    name -> last octet of its address; h1..h3 by default) plugged into it with a
    veth pair. Raises :class:`_Unavailable` (having cleaned up) where
    namespaces, bridges or veths cannot be made."""
    net = Net(prefix, [], dict(hosts or HOSTS))
    try:
        sw = net.ns("sw")
        _ip("netns", "add", sw, probe=True)
        net.created.append(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge", probe=True)
        _ip("-n", sw, "link", "set", "br0", "up")
        for host in net.hosts:
            ns = net.ns(host)
            _ip("netns", "add", ns, probe=True)
            net.created.append(ns)
            # both ends are made inside their namespaces: no interface name is
            # ever taken in the machine's own namespace, so runs cannot collide
            _ip("-n", sw, "link", "add", f"v{host}", "type", "veth", "peer", "name", "eth0",
                "netns", ns, probe=True)
            _ip("-n", sw, "link", "set", f"v{host}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{net.addr(host)}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except BaseException:
        net.teardown()
        raise
    return net


@contextmanager
def hosts(tag: str, hosts: dict[str, int] | None = None) -> Iterator[Net]:
    """Namespace hosts (:func:`build`) named ``<tag>-<pid>-<hex>-...``, torn down
    whatever happens; skips the test, saying why, where they cannot be built."""
    if sys.platform != "linux":
        pytest.skip("network namespaces are Linux-only")
    if shutil.which("ip") is None:
        pytest.skip("iproute2's `ip` is not installed")
    try:
        n = build(f"{tag}-{os.getpid()}-{secrets.token_hex(2)}", hosts)
    except _Unavailable as e:
        pytest.skip(f"cannot build network namespaces here (needs root, veth and bridge "
                    f"support): {e}")
    try:
        yield n
    finally:
        n.teardown()


@pytest.fixture
def net() -> Iterator[Net]:
    with hosts("nbrpc") as n:
        yield n


# What the cluster tiers (netns, slurm, mpi) check through their driver scripts:
# functions defined in the driver's __main__, so they travel by value.
CLUSTER_CHECKS = r'''
def make(n):
    return torch.arange(n, dtype=torch.float32)


def fetch_sum(rref):
    return float(rref.to_here().sum())


def forward(w, x):
    return torch.tanh(w * x).sum()


def grad_matches(worker):
    """Distributed autograd through ``worker`` against local autograd."""
    from nbrpc import autograd
    w = torch.randn(5, requires_grad=True)
    x = torch.randn(5)
    with autograd.context() as ctx:
        autograd.backward(ctx, [rpc.rpc_sync(worker, forward, args=(w, x))])
        grad = autograd.get_gradients(ctx)[w]
    wl = w.detach().clone().requires_grad_()
    forward(wl, x).backward()
    return bool(torch.allclose(grad, wl.grad))
'''


# The driver, run in h1 with its config (JSON) as argv[1]. Functions defined
# here (in __main__) are pickled by value, so the engines need no test module.
DRIVER = r'''
import json, os, sys, time
import torch
from nbrpc import rpc
from nbrpc.cluster import Cluster

cfg = json.loads(sys.argv[1])


def where():
    """This process's network namespace, IPv4 addresses and agent address."""
    import socket
    import psutil
    from nbrpc.cluster import engine
    agent = engine._agent[0] if engine._agent else None
    ips = sorted(a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                 if a.family == socket.AF_INET)
    return {"pid": os.getpid(), "netns": os.readlink("/proc/self/ns/net"), "ips": ips,
            "worker": os.environ.get("NBRPC_WORKER"), "nbrpc_host": os.environ.get("NBRPC_HOST"),
            "address": agent.address if agent else None}


def call_peer(peer):
    """On worker1: call worker2, then look for a TCP connection to its address."""
    import psutil
    from nbrpc import rpc
    theirs = rpc.rpc_sync(peer, where)
    host, _, port = theirs["address"].removeprefix("tcp://").rpartition(":")
    conns = [[c.raddr.ip, c.raddr.port] for c in psutil.Process().net_connections("tcp")
             if c.raddr and c.status == psutil.CONN_ESTABLISHED]
    return {"me": where(), "peer": theirs, "direct": [host, int(port)] in conns}


def make_value(n):
    return {"made_by": where(), "tensor": torch.arange(n) * 2}


def fetch(rref):
    v = rref.to_here()
    return {"owner": rref.owner_name(), "sum": int(v["tensor"].sum()), "made_in": v["made_by"]}


def echo(t):
    return t.clone()


launcher = cfg["launcher"]  # "ssh": nbrpc gives worker r the r-th slot of `engines`
out = {}
t0 = time.monotonic()
cluster = Cluster(launcher=launcher, launcher_options=cfg["launcher_options"],
                  host=cfg["addr"], controller_ip=cfg["addr"],
                  threads=4, timeout=60, rpc_timeout=30, progress=False,
                  encrypt=cfg["encrypt"])
try:
    cluster.start(2)
    out["start_s"] = round(time.monotonic() - t0, 1)
    out["driver"] = where()
    out["driver"]["address"] = cluster.agent.address
    sec = os.path.join(cluster._profile_dir, "security")
    with open(os.path.join(sec, next(f for f in os.listdir(sec)
                                     if f.endswith("-engine.json")))) as f:
        out["controller"] = json.load(f)["interface"]
    out["relay"] = cluster._relay
    out["workers"] = {w: rpc.rpc_sync(w, where) for w in ("worker1", "worker2")}
    out["peer_call"] = rpc.rpc_sync("worker1", call_peer, args=("worker2",))
    rref = rpc.remote("worker2", make_value, args=(1000,))
    v = rref.to_here()
    out["rref"] = {"owner": rref.owner_name(), "sum": int(v["tensor"].sum()),
                   "made_in": v["made_by"], "worker1": rpc.rpc_sync("worker1", fetch, (rref,))}
    del rref, v
    big = torch.randn(2 << 20)  # 8 MB: shared memory between peers of one host; sockets here
    out["big_equal"] = bool(torch.equal(big, rpc.rpc_sync("worker1", echo, args=(big,))))
    out["status"] = str(cluster.status())
finally:
    t1 = time.monotonic()
    # ssh stops take a remote round trip or two per engine: with the default 10 s a
    # loaded machine runs out, and what Cluster.stop then SIGKILLs (the controller)
    # leaves its heart-monitor child behind
    cluster.stop(timeout=30)
    out["stop_s"] = round(time.monotonic() - t1, 1)
print(cfg["mark"] + json.dumps(out), flush=True)
'''

# `ssh [OPTIONS] HOST CMD...`: CMD, joined into one shell command as ssh does,
# run in the namespace HOST, in a bare environment as a login would be.
FAKE_SSH = r'''#!/bin/sh
while [ $# -gt 0 ]; do
  case "$1" in -[bcDEeFIiJLlmOopQRSWw]) shift 2;; -*) shift;; *) break;; esac
done
host=$1; shift
exec ip netns exec "$host" env -i HOME="$HOME" PATH=/usr/local/bin:/usr/bin:/bin \
  bash -c "$*"
'''

# `scp [OPTIONS] SRC DST` (either may be HOST:PATH): the namespaces share one filesystem.
FAKE_SCP = r'''#!/bin/sh
while [ $# -gt 2 ]; do shift; done
src=${1#*:}; dst=${2#*:}
[ "$src" -ef "$dst" ] || cp "$src" "$dst"
'''


def local_engine_cmd(net: Net) -> list[str]:
    """ipyparallel's engine command, run in the namespace of ``$NBRPC_WORKER``'s host."""
    cases = " ".join(f"{w}) ns={net.ns(h)};;" for w, h in PLACEMENT.items())
    script = (f'case "$NBRPC_WORKER" in {cases} *) echo "no host for $NBRPC_WORKER" >&2; '
              'exit 3;; esac; exec ip netns exec "$ns" "$0" -m ipyparallel.engine "$@"')
    return ["sh", "-c", script, sys.executable]


def run_driver(net: Net, launcher: str, options: dict, tmp: Path,
               encrypt: bool = False) -> dict:
    cfg = {"addr": net.addr("h1"), "launcher": launcher, "launcher_options": options,
           "mark": MARK, "encrypt": encrypt}
    env = {k: v for k, v in os.environ.items() if k != "NBRPC_HOST"}
    env.update(PYTHONUNBUFFERED="1", TMPDIR=str(tmp))  # the cluster's profile dir goes there
    cmd = ["ip", "netns", "exec", net.ns("h1"), sys.executable, "-c", DRIVER, json.dumps(cfg)]
    return drive(cmd, env=env, cwd=REPO, timeout=DRIVER_TIMEOUT, mark=MARK)


def drive(cmd: list[str], *, env: dict[str, str], cwd: Path, timeout: float, mark: str,
          also: Callable[[], str] = lambda: "") -> dict:
    """Run a driver script; return what its last ``mark`` line says (JSON), with
    its ``stdout`` and ``stderr`` tails. Fails the test with its output (and
    ``also()``: daemons' logs) if it fails, prints no result, or outlives ``timeout``."""
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd,
                           timeout=timeout)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the driver did not finish within {timeout:g} s; its output:\n"
                    f"{_text(e.stdout)[-4000:]}\n{_text(e.stderr)[-6000:]}\n{also()}",
                    pytrace=False)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(mark)]
    if r.returncode != 0 or not lines:
        pytest.fail(f"the driver failed (exit {r.returncode}):\n{r.stdout[-4000:]}\n"
                    f"{r.stderr[-6000:]}\n{also()}", pytrace=False)
    out = json.loads(lines[-1][len(mark):])
    out["stdout"], out["stderr"] = r.stdout[-6000:], r.stderr[-6000:]
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")[:300]
    except OSError:
        return "?"


def _text(b: bytes | str | None) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else (b or "")


def check(net: Net, out: dict) -> None:
    h1 = net.addr("h1")

    # the controller's relay and the driver listen on h1's routable address; the
    # controller itself on Unix sockets in its private profile, relayed to the engines
    assert out["controller"].startswith("ipc://"), out["controller"]
    assert out["relay"].startswith(f"{h1}:"), out["relay"]
    assert out["driver"]["netns"] == net.inode("h1")
    assert out["driver"]["address"].startswith(f"tcp://{h1}:"), out["driver"]

    # each worker's engine runs in its own host, its agent bound to that host's address
    for worker, host in PLACEMENT.items():
        w = out["workers"][worker]
        assert w["worker"] == worker
        assert w["netns"] == net.inode(host), f"{worker} is not in {host}: {w}"
        assert w["ips"] == sorted(["127.0.0.1", net.addr(host)]), w
        assert w["address"].startswith(f"tcp://{net.addr(host)}:"), w

    # worker1 -> worker2 directly, over the veth links
    pc = out["peer_call"]
    assert pc["me"]["netns"] == net.inode("h2") and pc["peer"]["netns"] == net.inode("h3")
    assert pc["peer"]["address"] == out["workers"]["worker2"]["address"]
    assert pc["direct"], f"worker1 has no TCP connection to {pc['peer']['address']}"

    # an RRef owned by worker2, fetched by the driver and by worker1
    rr = out["rref"]
    assert rr["owner"] == "worker2" and rr["made_in"]["netns"] == net.inode("h3")
    assert rr["sum"] == 2 * sum(range(1000))
    assert rr["worker1"] == {"owner": "worker2", "sum": rr["sum"], "made_in": rr["made_in"]}

    assert out["big_equal"]
    assert "worker1" in out["status"] and "worker2" in out["status"], out["status"]

    # stop() left nothing running in the hosts (teardown would kill it: it must not need to)
    deadline = time.monotonic() + 10
    while any(net.pids().values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {pid: _cmdline(pid) for pids in net.pids().values() for pid in pids}
    assert not left, (f"left running in the hosts after stop() ({out['stop_s']} s): {left}\n"
                      f"the driver's stderr:\n{out['stderr']}")
    print(f"start {out['start_s']} s, stop {out['stop_s']} s")


def test_local_launcher_engines_in_other_hosts(net: Net, tmp_path: Path) -> None:
    """launcher="local", engine_cmd wrapping ``ip netns exec HOST`` by $NBRPC_WORKER."""
    options = {"engine_cmd": local_engine_cmd(net),
               # merged with the cluster's own; an interface name works for zmq's bind
               "environment": {"NBRPC_HOST": "eth0"}}
    out = run_driver(net, "local", options, tmp_path)
    check(net, out)
    assert [w["nbrpc_host"] for w in out["workers"].values()] == ["eth0", "eth0"]


def test_ssh_launcher_engines_in_other_hosts(net: Net, tmp_path: Path) -> None:
    """ipyparallel's SSH engine-set launcher, over a fake ssh into the namespaces,
    with the agents' connections CURVE-encrypted (``Cluster(encrypt=True)``)."""
    for name, text in (("ssh", FAKE_SSH), ("scp", FAKE_SCP)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    options = {"engines": {net.ns(h): 1 for h in PLACEMENT.values()},
               "ssh_cmd": [str(tmp_path / "ssh")], "scp_cmd": [str(tmp_path / "scp")],
               "remote_python": sys.executable}
    out = run_driver(net, "ssh", options, tmp_path, encrypt=True)  # CURVE between hosts
    check(net, out)  # each agent bound the interface that routes to the driver
    assert [w["nbrpc_host"] for w in out["workers"].values()] == [None, None]


# Script mode across hosts: rank 0 in h1, rank 1 in h2, MASTER_ADDR = h1's address.
RANK = r'''
import sys, torch
from nbrpc import rpc
rank = int(sys.argv[1])
opts = rpc.TensorPipeRpcBackendOptions(rpc_timeout=15)
try:
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
except Exception as e:
    print("NBRPC-ERROR", type(e).__name__, e, flush=True)
    sys.exit(3)
if rank == 0:
    t = torch.arange(2 << 20, dtype=torch.float32)
    print("NBRPC-OK", bool(torch.equal(rpc.rpc_sync("w1", torch.mul, args=(t, 2)), t * 2)),
          flush=True)
rpc.shutdown()
'''


def _ranks(net: Net, env: dict, tmp: Path) -> list[subprocess.CompletedProcess | None]:
    base = {k: v for k, v in os.environ.items()
            if k not in ("NBRPC_HOST", "NBRPC_SECRET_KEY", "NBRPC_KEY_FILE", "NBRPC_ENCRYPT")}
    base.update(MASTER_ADDR=net.addr("h1"), MASTER_PORT="29731", PYTHONUNBUFFERED="1",
                HOME=str(tmp), PYTHONPATH=str(REPO), **env)
    procs = [subprocess.Popen(["ip", "netns", "exec", net.ns(h), sys.executable, "-c", RANK,
                               str(r)], env=base, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for r, h in enumerate(("h1", "h2"))]
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate(timeout=10)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, text))
    return out


def test_script_mode_across_hosts_needs_a_shared_key_and_can_encrypt(net: Net,
                                                                     tmp_path: Path) -> None:
    """Without NBRPC_SECRET_KEY, the rank on another host than rank 0 refuses at
    once and says how to fix it (a per-user key file cannot be shared across
    hosts); with it, and with CURVE encryption, the group works."""
    r0, r1 = _ranks(net, {}, tmp_path)
    assert r1.returncode == 3 and "NBRPC_SECRET_KEY" in r1.stdout, r1.stdout
    assert r0.returncode != 0  # rank 0 waited for a rank 1 that never came (bounded)
    secret = secrets.token_hex(32)
    r0, r1 = _ranks(net, {"NBRPC_SECRET_KEY": secret, "NBRPC_ENCRYPT": "1"}, tmp_path)
    assert r0.returncode == 0 and "NBRPC-OK True" in r0.stdout, r0.stdout
    assert r1.returncode == 0, r1.stdout
