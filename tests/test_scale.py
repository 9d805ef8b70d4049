"""32 workers on 4 hosts: start, idle cost, fan-out, memory and stop, measured.

Five hosts from network namespaces (:func:`test_netns.build`): the driver (and
the controller and the engine zygote) in h1, and 32 workers, 8 on each of h2..h5,
forked from the zygote into their host's namespace (the fork launcher's
``netns`` option). A driver script in h1 measures, and prints as JSON:

* the time to start the 32 workers, and to stop them;
* idle traffic and CPU per worker over a few seconds (each worker's message
  counter through the status probes, less the probes' own messages; each
  engine's CPU time): heartbeats go to and from the coordinator only, so a
  worker's rate does not grow with the group (all-pairs heartbeats would be
  about 31 times as many);
* ``rpc_async`` to all 32 and back (the mean of several rounds), against one call;
* each idle worker's memory: its RSS, against a fresh ``python -c "import
  torch"`` (the budget: under 30 MiB over it), and its unique set (pages no
  other process shares: what one more worker costs beyond the zygote's warm
  torch, which the forks share).

The test checks what must hold (every worker on its host, the per-worker idle
rate bounded independently of the group size, the RSS budget) and prints the
figures. Needs root and iproute2; skipped where namespaces cannot be
built. Run with ``pytest -s -m netns tests/test_scale.py``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_netns import REPO, Net, _cmdline, drive, hosts

pytestmark = pytest.mark.netns

WORKERS = 32
HOSTS = {"h1": 1, "h2": 2, "h3": 3, "h4": 4, "h5": 5}
WORKER_HOSTS = ("h2", "h3", "h4", "h5")
DRIVER_TIMEOUT = 240.0
MARK = "NBRPC-SCALE-RESULT "
IDLE_RATE_BOUND = 10.0  # messages/s per idle worker: a heartbeat each way every 0.5 s is 4
RSS_OVER_TORCH_MIB = 30.0  # an idle worker's RSS over a fresh `import torch`


@pytest.fixture
def net() -> Iterator[Net]:
    with hosts("nbsc", HOSTS) as n:
        yield n


DRIVER = r'''
import json, os, statistics, subprocess, sys, time
import psutil
import torch
from nbrpc import rpc
from nbrpc.cluster import Cluster

cfg = json.loads(sys.argv[1])
out = {}
MiB = 1 << 20


def where():
    return os.readlink("/proc/self/ns/net")


def noop():
    return None


def rates(cluster, seconds):
    """Per worker: messages/s (less the probes' own) and CPU ms/s, while idle."""
    pids = {w.name: w.pid for w in cluster.workers.values()}
    procs = {n: psutil.Process(p) for n, p in pids.items()}
    s0 = {w.name: w.messages for w in cluster.status().workers if w.rank}
    c0 = {n: sum(p.cpu_times()[:2]) for n, p in procs.items()}
    time.sleep(seconds)
    s1 = {w.name: w.messages for w in cluster.status().workers if w.rank}
    c1 = {n: sum(p.cpu_times()[:2]) for n, p in procs.items()}
    msgs = {n: (s1[n] - s0[n] - 2) / seconds for n in s0}  # one probe: request + reply
    cpu = {n: 1000 * (c1[n] - c0[n]) / seconds for n in c0}
    return msgs, cpu


netns = {f"worker{r}": cfg["ns"][(r - 1) // 8] for r in range(1, cfg["n"] + 1)}
cluster = Cluster(launcher="fork", host=cfg["addr"], controller_ip=cfg["addr"], threads=4,
                  timeout=180, rpc_timeout=60, progress=False,
                  launcher_options={"netns": netns})
try:
    t0 = time.monotonic()
    cluster.start(cfg["n"])
    out["start_s"] = round(time.monotonic() - t0, 1)
    names = cluster.names
    futs = {n: rpc.rpc_async(n, where) for n in names}
    out["where"] = {n: f.wait() for n, f in futs.items()}
    out["driver_ns"] = where()
    time.sleep(2)  # settle: the last joiners' start-up is not idle cost
    msgs, cpu = rates(cluster, 4.0)
    out["idle_msgs_per_s"] = msgs
    out["idle_cpu_ms_per_s"] = cpu

    for _ in range(3):  # warm
        [f.wait() for f in [rpc.rpc_async(n, noop) for n in names]]
    rounds = []
    for _ in range(10):
        t = time.perf_counter()
        [f.wait() for f in [rpc.rpc_async(n, noop) for n in names]]
        rounds.append(time.perf_counter() - t)
    out["fanout_ms"] = round(1000 * statistics.median(rounds), 1)
    one = []
    for _ in range(30):
        t = time.perf_counter()
        rpc.rpc_sync(names[0], noop)
        one.append(time.perf_counter() - t)
    out["one_call_ms"] = round(1000 * statistics.median(one), 2)

    mem = [psutil.Process(w.pid).memory_full_info() for w in cluster.workers.values()]
    out["worker_uss_mib"] = sorted(round(m.uss / MiB, 1) for m in mem)
    out["worker_rss_mib"] = sorted(round(m.rss / MiB, 1) for m in mem)
    fresh = subprocess.run([sys.executable, "-c", "import torch, psutil; "
                            "print(psutil.Process().memory_info().rss)"],
                           capture_output=True, text=True, timeout=120)
    out["torch_rss_mib"] = round(int(fresh.stdout) / MiB, 1)
    out["driver_rss_mib"] = round(psutil.Process().memory_info().rss / MiB, 1)
finally:
    t1 = time.monotonic()
    cluster.stop(timeout=60)
    out["stop_s"] = round(time.monotonic() - t1, 1)
print(cfg["mark"] + json.dumps(out), flush=True)
'''


def test_32_workers_on_4_hosts(net: Net, tmp_path: Path,
                               capsys: pytest.CaptureFixture) -> None:
    cfg = {"addr": net.addr("h1"), "n": WORKERS, "mark": MARK,
           "ns": [net.ns(h) for h in WORKER_HOSTS]}
    env = {k: v for k, v in os.environ.items() if not k.startswith("NBRPC_")}
    env.update(PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path), PYTHONPATH=str(REPO))
    cmd = ["ip", "netns", "exec", net.ns("h1"), sys.executable, "-c", DRIVER, json.dumps(cfg)]
    out = drive(cmd, env=env, cwd=tmp_path, timeout=DRIVER_TIMEOUT, mark=MARK)

    # every worker on its host: 8 per host
    inodes = {net.inode(h): h for h in WORKER_HOSTS}
    placed = {n: inodes.get(ns) for n, ns in out["where"].items()}
    assert len(placed) == WORKERS and None not in placed.values(), placed
    for i, host in enumerate(WORKER_HOSTS):
        assert sorted(n for n, h in placed.items() if h == host) == sorted(
            f"worker{r}" for r in range(8 * i + 1, 8 * i + 9)), placed
    assert out["driver_ns"] == net.inode("h1")

    msgs = out["idle_msgs_per_s"]
    assert max(msgs.values()) <= IDLE_RATE_BOUND, msgs  # not all-pairs: ~124/s would be
    over = max(out["worker_rss_mib"]) - out["torch_rss_mib"]
    assert over < RSS_OVER_TORCH_MIB, (out["worker_rss_mib"], out["torch_rss_mib"])

    deadline = time.monotonic() + 10
    while any(net.pids().values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {pid: _cmdline(pid) for pids in net.pids().values() for pid in pids}
    assert not left, f"left running after stop() ({out['stop_s']} s): {left}"

    mean = lambda d: sum(d.values()) / len(d)  # noqa: E731
    uss, rss = out["worker_uss_mib"], out["worker_rss_mib"]
    with capsys.disabled():  # the figures, in make test's output too
        print(f"\n32 workers on 4 hosts: start {out['start_s']} s, stop {out['stop_s']} s; "
              f"idle per worker {mean(msgs):.1f} msg/s (max {max(msgs.values()):.1f}), "
              f"{mean(out['idle_cpu_ms_per_s']):.1f} ms CPU/s; rpc_async to all 32 and back "
              f"{out['fanout_ms']} ms (one call {out['one_call_ms']} ms); idle worker unique "
              f"memory {uss[len(uss) // 2]} MiB median (max {uss[-1]}), RSS {rss[len(rss) // 2]} "
              f"MiB median against {out['torch_rss_mib']} MiB for a fresh `import torch`; "
              f"driver RSS {out['driver_rss_mib']} MiB")
