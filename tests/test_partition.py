"""A host cut off from the network is declared dead in seconds, and comes back.

Three hosts from network namespaces (:func:`test_netns.build`): a script-mode
group over ``tcp://`` with the driver (rank 0, the coordinator) in h1, ``w1``
in h2 and ``w2`` in h3. With calls in flight to w2, an RRef w2 owns held by
the driver, a fork of w1's RRef held by w2, and w1 holding its GIL for 10 s,
the driver unplugs h3 from the bridge (``ip link set vh3 nomaster`` in the
switch: both hosts keep their links up and their connections open; nothing
they send each other arrives, as in a partition, a power loss or a frozen
VM). Then:

* w2 is declared dead within ``DEAD_BOUND_S`` of the cut: its calls in flight
  (the driver's, and w1's to it) fail with ``WorkerGoneError``, and so do the
  RRef's ``to_here()`` and new calls; w1 (owner) releases the fork w2 held;
* w1, silent for the 10 s its GIL is held, is not evicted, nor is anyone else,
  and a 32 MB call sent to it meanwhile completes (libzmq reads it, GIL or not);
* the link comes back: w2 asks to join again and is taken back under its
  name, every member sees the whole group, calls flow every way;
* w1 stopped with SIGSTOP for 5 s (its kernel still acknowledges) is not
  evicted either, and the group shuts down gracefully.

A second run cuts h2 and h3 off from each other only, one way (h3 sends its
frames for h2 to a MAC nobody has; h2's frames still reach h3, but nothing
acknowledges them): the coordinator hears both, so the members end
their calls to each other themselves ("out of reach", within
``MEMBERS_CUT_BOUND_S``), nobody is evicted, and calls between them flow again
once the link is back. Then it cuts the answers only, three times, with a
policy rule that takes away one host's route to another's RPC port: w2's to
w1 (w2 tells w1 through the driver), w1's to the driver and the driver's to w1
(told through w2). Each time the waiting call fails ("its answers cannot come
back", within ``ANSWERS_CUT_BOUND_S``), and calls flow again once the route is
back.

The figures (time to declare dead, to fail the calls, to rejoin) are printed.
Needs root and iproute2; skipped where namespaces cannot be built. Run with
``pytest -m netns tests/test_partition.py``.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest
from test_netns import REPO, Net, net  # noqa: F401  (net: the namespaces fixture)

pytestmark = pytest.mark.netns

PORT = 29743  # the rendezvous, on h1 (a fresh namespace: nothing else listens there)
DEAD_BOUND_S = 3.0  # cut -> declared dead: a heartbeat interval (0.5 s), TCP giving up
# (zmqhub.UNACKED_MS: about 1 s), link_timeout (1 s), and slack for a loaded machine
REJOIN_BOUND_S = 8.0  # link back -> taken back (a redial backs off to 2 s)
RUN_TIMEOUT = 75.0  # the driver, start to shutdown (about 21 s here; pytest allows 120 s)
MEMBER_TIMEOUT = 15.0  # a member, after the driver ended
MARK = "NBRPC-PARTITION-RESULT "

# A member serves until the driver lets it go (``finish``), then shuts down: not
# from the start, as a member in a graceful shutdown ends it when its
# coordinator is declared dead.
MEMBER = r'''
import sys, threading
from nbrpc import rpc
KEPT = []  # RRefs a test function keeps here (as ``__main__.KEPT``)
DONE = threading.Event()
rank, addr, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{addr}:{port}", rpc_timeout=60,
                                       num_worker_threads=8)
rpc.init_rpc(f"w{rank}", rank=rank, world_size=3, rpc_backend_options=opts)
DONE.wait(70)
rpc.shutdown(timeout=60)
'''

# Functions defined here (in __main__) are pickled by value: the members need no test module.
DRIVER = r'''
import json, os, signal, subprocess, sys, time
import torch
from nbrpc import rpc
from nbrpc.agent import current_agent
from nbrpc.errors import WorkerGoneError

cfg = json.loads(sys.argv[1])
out = {}


def pid():
    return os.getpid()


def add(a, b):
    return a + b


def sleep_then(seconds, value):
    time.sleep(seconds)
    return value


def hold_gil(seconds):
    """Sleep in C with the GIL held: no other thread of this process runs."""
    import ctypes
    ctypes.PyDLL(None).sleep(int(seconds))
    return os.getpid()


def make_value(n):
    return torch.arange(n)


def keep(rref):
    import __main__
    __main__.KEPT.append(rref)
    return len(__main__.KEPT)


def drop_kept():
    import __main__
    n = len(__main__.KEPT)
    __main__.KEPT.clear()
    return n


def finish():
    import __main__
    __main__.DONE.set()


def owned_forks():
    """On an owner: who holds a fork of each RRef it owns."""
    snap = current_agent().snapshot(events=0)["rrefs"]
    return [sorted(set(e["forks"].values())) for e in snap["owned"]]


def call(peer, fn, *args):
    """On a member: call ``peer``; (outcome, seconds, error text)."""
    t0 = time.monotonic()
    try:
        return ["ok", time.monotonic() - t0, rpc.rpc_sync(peer, fn, args=args, timeout=60)]
    except Exception as e:
        return [type(e).__name__, time.monotonic() - t0, str(e)]


def own_port():
    return int(current_agent().me.address.rsplit(":", 1)[1])


def link_down(rank):
    """On a member: since when its own connection to ``rank`` is down (None: up)."""
    return current_agent().io.link_down_since(rank)


def health():
    """(member ranks, times taken back, names this agent saw die)."""
    agent = current_agent()
    dead = [e["peer"] for e in agent.events.records(None) if e["event"] == "member-dead"]
    return agent.member_ranks(), agent.readmitted, dead


def outcome(fut):
    """["ok", value] or [error type, text]: of a future, or of a call to make."""
    try:
        return ["ok", fut.wait() if hasattr(fut, "wait") else fut()]
    except Exception as e:
        return [type(e).__name__, str(e)]


def switch(*args):
    subprocess.run(["ip", "-n", cfg["switch"], "link", "set", "vh3", *args], check=True,
                   timeout=10)


def poll(cond, timeout):
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://{cfg['addr']}:{cfg['port']}",
                                       rpc_timeout=60, num_worker_threads=8)
rpc.init_rpc("driver", rank=0, world_size=3, rpc_backend_options=opts)
agent = current_agent()


def host_cut():
    pids = {w: rpc.rpc_sync(w, pid) for w in ("w1", "w2")}
    out["warm"] = rpc.rpc_sync("w1", call, args=("w2", add, 1, 2))  # w1 -> w2 connected
    owned_by_lost = rpc.remote("w2", make_value, args=(100,))
    out["to_here_before"] = int(owned_by_lost.to_here().sum())
    held_by_lost = rpc.remote("w1", make_value, args=(10,))
    out["kept"] = rpc.rpc_sync("w2", keep, args=(held_by_lost,))
    out["forks_before"] = rpc.rpc_sync("w1", owned_forks)

    # in flight on w2 when it is cut off: the driver's call, and w1's
    failed_at = {}
    lost_call = rpc.rpc_async("w2", sleep_then, args=(12, "late"), timeout=60)
    lost_call.add_done_callback(lambda f: failed_at.setdefault("call", time.monotonic()))
    via_w1 = rpc.rpc_async("w1", call, args=("w2", sleep_then, 12, "late"), timeout=60)
    time.sleep(0.3)
    gil = rpc.rpc_async("w1", hold_gil, args=(10,), timeout=60)  # w1 silent for 10 s
    time.sleep(0.3)
    big = torch.randn(8 << 20)  # 32 MB to w1 meanwhile: far more than socket buffers hold
    big_call = rpc.rpc_async("w1", torch.clone, args=(big,), timeout=60)

    t_cut = time.monotonic()  # (before: the figures include the `ip` command's own time)
    switch("nomaster")  # h3 unplugged
    down = []  # since when the driver's connection to w2 is down (TCP gave up on it)
    out["declared"] = poll(lambda: down.append(agent.io.link_down_since(2))
                           or not agent.is_member(2), 20)
    out["dead_s"] = time.monotonic() - t_cut
    out["link_down_s"] = min((d for d in down if d), default=t_cut - 1) - t_cut
    out["lost_call"] = outcome(lost_call)
    out["call_failed_s"] = failed_at.get("call", time.monotonic()) - t_cut
    t0 = time.monotonic()
    out["to_here_after"] = outcome(lambda: owned_by_lost.to_here(timeout=10))
    out["to_here_after_s"] = time.monotonic() - t0
    out["new_call"] = outcome(lambda: rpc.rpc_sync("w2", add, args=(1, 2)))
    out["driver_after_cut"] = health()
    out["gil_held"] = outcome(gil) + [time.monotonic() - t_cut]  # w1 answers: not evicted
    out["via_w1"] = outcome(via_w1)
    got = outcome(big_call)
    out["big_while_gil_held"] = got[0] == "ok" and bool(torch.equal(got[1], big))
    out["w1_after_cut"] = rpc.rpc_sync("w1", health)
    out["forks_after"] = rpc.rpc_sync("w1", owned_forks)
    out["driver_after_gil"] = health()

    t_back = time.monotonic()
    switch("master", "br0")  # h3 plugged in again
    out["rejoined"] = poll(lambda: agent.member_ranks() == [0, 1, 2], 30)
    out["rejoin_s"] = time.monotonic() - t_back
    out["w2_call"] = outcome(lambda: rpc.rpc_sync("w2", add, args=(2, 3), timeout=20))
    out["w1_to_w2"] = rpc.rpc_sync("w1", call, args=("w2", add, 3, 4), timeout=30)
    out["w2_to_w1"] = rpc.rpc_sync("w2", call, args=("w1", add, 4, 5), timeout=30)
    out["w1_after_heal"] = rpc.rpc_sync("w1", health)
    out["w2_after_heal"] = rpc.rpc_sync("w2", health)

    # a stopped process keeps its connections acknowledged by its kernel: busy, not dead
    os.kill(pids["w1"], signal.SIGSTOP)
    try:
        during = rpc.rpc_async("w1", add, args=(5, 6), timeout=60)
        time.sleep(5)
    finally:
        os.kill(pids["w1"], signal.SIGCONT)
    out["stopped_call"] = outcome(during)
    time.sleep(1.0)  # a round of heartbeats
    out["driver_end"] = health()
    out["w1_end"] = rpc.rpc_sync("w1", health)
    out["w2_end"] = rpc.rpc_sync("w2", health)
    out["dropped"] = rpc.rpc_sync("w2", drop_kept)
    del owned_by_lost, held_by_lost


def cut_between_members(on):
    """h2 and h3 stop reaching each other, one way: h3 sends its frames for h2
    to a MAC nobody has, while h2's frames still reach h3 (so w1's requests get
    through, and w2's answers and acknowledgements do not). Both sides must
    notice: w2, whose own frames are lost, and w1, whose frames arrive unanswered.
    Both still reach h1, and h1 them."""
    for host, peer in (("h3", "h2"),):
        if on:
            args = ["neigh", "replace", cfg["addrs"][peer], "lladdr", "02:00:00:00:00:99",
                    "dev", "eth0", "nud", "permanent"]
        else:
            args = ["neigh", "del", cfg["addrs"][peer], "dev", "eth0"]
        subprocess.run(["ip", "-n", cfg["ns"][host], *args], check=True, timeout=10)


def members_cut():
    out["warm"] = [rpc.rpc_sync("w1", call, args=("w2", add, 1, 2)),
                   rpc.rpc_sync("w2", call, args=("w1", add, 1, 2))]
    # in flight between them when they are cut off from each other
    via_w1 = rpc.rpc_async("w1", call, args=("w2", sleep_then, 8, "late"), timeout=60)
    via_w2 = rpc.rpc_async("w2", call, args=("w1", sleep_then, 8, "late"), timeout=60)
    time.sleep(0.3)
    t_cut = time.monotonic()
    cut_between_members(True)
    out["via_w1"], out["via_w2"] = outcome(via_w1), outcome(via_w2)
    out["failed_s"] = time.monotonic() - t_cut
    out["new_call"] = rpc.rpc_sync("w1", call, args=("w2", add, 1, 1))
    out["driver_to_both"] = [rpc.rpc_sync(w, add, args=(1, 1)) for w in ("w1", "w2")]
    out["health"] = [health(), rpc.rpc_sync("w1", health), rpc.rpc_sync("w2", health)]
    t_back = time.monotonic()
    cut_between_members(False)
    for _ in range(100):  # calls fail until the link is dialled again (backing off to 2 s)
        out["w1_to_w2"] = rpc.rpc_sync("w1", call, args=("w2", add, 3, 4))
        if out["w1_to_w2"][0] == "ok" or time.monotonic() - t_back > 15:
            break
        time.sleep(0.1)
    out["healed_s"] = time.monotonic() - t_back
    out["w2_to_w1"] = rpc.rpc_sync("w2", call, args=("w1", add, 4, 5))
    out["health_end"] = [health(), rpc.rpc_sync("w1", health), rpc.rpc_sync("w2", health)]

    # A cut of the answers only: h3 has no route to w1's port (the one w2's own
    # connection, which carries its answers to w1, goes to), while w1's requests
    # reach w2 and w1's link stays up. w2 tells the driver, which tells w1.
    port = rpc.rpc_sync("w1", own_port)

    def while_cut():  # w1's own link is up; its new calls fail too
        return (rpc.rpc_sync("w1", link_down, args=(2,)),
                rpc.rpc_sync("w1", call, args=("w2", sleep_then, 0.2, "x")))

    out["answers"], out["answers_failed_s"], during = through_a_cut(
        lambda: rpc.rpc_async("w1", call, args=("w2", sleep_then, 1, "late"), timeout=60),
        port, "h3", "h2", while_cut)
    out["answers_w1_link"], out["answers_new_call"] = during
    t_back = time.monotonic()
    for _ in range(100):
        out["answers_back"] = rpc.rpc_sync("w1", call, args=("w2", add, 5, 6))
        if out["answers_back"][0] == "ok" or time.monotonic() - t_back > 15:
            break
        time.sleep(0.1)
    out["answers_healed_s"] = time.monotonic() - t_back
    out["health_after_answers"] = [health(), rpc.rpc_sync("w1", health),
                                   rpc.rpc_sync("w2", health)]

    # The same with the coordinator (the driver), told through w2: first w1 cannot
    # answer the driver, then the driver cannot answer w1.
    me = int(agent.me.address.rsplit(":", 1)[1])
    out["w1_to_driver_cut"], out["w1_to_driver_failed_s"], _ = through_a_cut(
        lambda: rpc.rpc_async("w1", sleep_then, args=(1, "late"), timeout=60), me, "h2", "h1")
    out["w1_to_driver_back"] = poll(lambda: outcome(lambda: rpc.rpc_sync("w1", add, args=(1, 2)))
                                    == ["ok", 3], 15)
    out["driver_to_w1_cut"], out["driver_to_w1_failed_s"], _ = through_a_cut(
        lambda: rpc.rpc_async("w1", call, args=("driver", sleep_then, 1, "late"), timeout=60),
        port, "h1", "h2")
    out["driver_to_w1_back"] = poll(lambda: rpc.rpc_sync("w1", call, args=("driver", add, 2, 3))
                                    [::2] == ["ok", 5], 15)
    out["health_after_driver_cuts"] = [health(), rpc.rpc_sync("w1", health),
                                       rpc.rpc_sync("w2", health)]


def through_a_cut(start, port, host, to, during=lambda: None):
    """Start a call (``start()``, its future), take ``host``'s route to ``port``
    on ``to`` away 0.3 s later, and wait for the call's outcome; ``during()``
    runs before the route is given back. (outcome, seconds after the cut, what
    ``during`` returned)."""
    fut = start()
    time.sleep(0.3)
    t_cut = time.monotonic()
    cut_answers(True, port, host, to)
    try:
        result, seconds = outcome(fut), time.monotonic() - t_cut
        return result, seconds, during()
    finally:
        cut_answers(False, port, host, to)


def cut_answers(on, port, host="h3", to="h2"):
    """``host`` gets no route to ``port`` on ``to`` (a policy rule: what it sends
    there is dropped), or gets it back."""
    rule = ["rule", "add" if on else "del", "to", cfg["addrs"][to], "ipproto", "tcp",
            "dport", str(port), "blackhole"]
    subprocess.run(["ip", "-n", cfg["ns"][host], *rule], check=True, timeout=10)



try:
    {"host": host_cut, "members": members_cut}[cfg["scenario"]]()
finally:
    for w in ("w1", "w2"):
        try:
            rpc.rpc_sync(w, finish, timeout=10)
        except Exception as e:
            out.setdefault("finish", []).append(f"{w}: {type(e).__name__}: {e}")
    print(cfg["mark"] + json.dumps(out), flush=True)  # (in case the shutdown hangs)
    t1 = time.monotonic()
    try:
        rpc.shutdown(timeout=60)
        out["shutdown"] = "ok"
    except Exception as e:
        out["shutdown"] = f"{type(e).__name__}: {e}"
    out["shutdown_s"] = time.monotonic() - t1
    print(cfg["mark"] + json.dumps(out), flush=True)
'''


def _env(tmp: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NBRPC_HOST", "NBRPC_SECRET_KEY", "NBRPC_KEY_FILE", "NBRPC_ENCRYPT",
                        "MASTER_ADDR", "MASTER_PORT")}
    env.update(NBRPC_SECRET_KEY=secrets.token_hex(32), PYTHONUNBUFFERED="1", HOME=str(tmp),
               PYTHONPATH=str(REPO))
    return env


def run_group(hosts: Net, tmp: Path, scenario: str) -> dict:
    """The members in h2 and h3, the driver in h1 playing ``scenario`` ("host":
    h3 unplugged; "members": h2 and h3 cut off from each other); its result."""
    env, addr = _env(tmp), hosts.addr("h1")
    cfg = {"addr": addr, "port": PORT, "switch": hosts.ns("sw"), "mark": MARK,
           "scenario": scenario, "ns": {h: hosts.ns(h) for h in hosts.hosts},
           "addrs": {h: hosts.addr(h) for h in hosts.hosts}}
    procs = [subprocess.Popen(["ip", "netns", "exec", hosts.ns(host), sys.executable, "-c", MEMBER,
                               str(rank), addr, str(PORT)], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank, host in ((1, "h2"), (2, "h3"))]
    procs.insert(0, subprocess.Popen(["ip", "netns", "exec", hosts.ns("h1"), sys.executable, "-c",
                                      DRIVER, json.dumps(cfg)], env=env, cwd=REPO,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    texts = []
    for p in procs:  # (the driver first: the members end when it shuts down)
        try:
            text, _ = p.communicate(timeout=RUN_TIMEOUT if p is procs[0] else MEMBER_TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate(timeout=10)
        texts.append(text)
    logs = "\n".join(f"--- {name} (exit {p.returncode}):\n{t[-5000:]}"
                     for name, p, t in zip(("driver", "w1", "w2"), procs, texts))
    lines = [ln for ln in texts[0].splitlines() if ln.startswith(MARK)]
    if not lines:
        pytest.fail(f"the driver printed no result:\n{logs}", pytrace=False)
    out = json.loads(lines[-1][len(MARK):])
    out["logs"], out["exits"] = logs, [p.returncode for p in procs]
    return out


def test_a_host_cut_off_is_declared_dead_in_seconds_and_rejoins_when_back(
        net: Net, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:  # noqa: F811
    out = run_group(net, tmp_path, "host")
    logs = out.pop("logs")
    print(json.dumps(out), logs, sep="\n")  # (shown if an assertion fails)
    assert out["warm"][0] == "ok" and out["to_here_before"] == sum(range(100)), (out, logs)
    assert out["kept"] == 1 and out["forks_before"] == [["driver", "w2"]], (out, logs)

    # w2 is declared dead within the bound, and everything that needs it fails so
    assert out["declared"] and out["dead_s"] < DEAD_BOUND_S, (out, logs)
    assert out["lost_call"][0] == "WorkerGoneError", (out, logs)
    assert "'w2' died" in out["lost_call"][1], out["lost_call"]
    assert out["call_failed_s"] < DEAD_BOUND_S, (out, logs)
    assert out["to_here_after"][0] == "WorkerGoneError" and out["to_here_after_s"] < 1.0, out
    assert out["new_call"][0] == "WorkerGoneError", out
    assert out["via_w1"][0] == "ok" and out["via_w1"][1][0] == "WorkerGoneError", out
    assert out["forks_after"] == [["driver"]], (out, logs)  # w2's fork released

    # w1, silent while its GIL was held, was never evicted; nobody else died
    assert out["gil_held"][0] == "ok" and out["gil_held"][2] > 9, out
    assert out["big_while_gil_held"], out  # (libzmq reads it, GIL or not)
    assert out["driver_after_cut"] == [[0, 1], 0, ["w2"]], out
    assert out["w1_after_cut"] == [[0, 1], 0, ["w2"]], (out, logs)
    assert out["driver_after_gil"] == [[0, 1], 0, ["w2"]], out

    # the link is back: w2 is taken back, the group is whole and consistent
    assert out["rejoined"] and out["rejoin_s"] < REJOIN_BOUND_S, (out, logs)
    assert out["w2_call"] == ["ok", 5], out
    assert out["w1_to_w2"][::2] == ["ok", 7] and out["w2_to_w1"][::2] == ["ok", 9], out
    assert out["w1_after_heal"] == [[0, 1, 2], 0, ["w2"]], (out, logs)
    ranks, readmitted, dead = out["w2_after_heal"]
    assert ranks == [0, 1, 2] and readmitted == 1 and dead == ["driver"], (out, logs)

    # a stopped (not lost) member is busy, not dead
    assert out["stopped_call"] == ["ok", 11], out
    assert out["driver_end"] == [[0, 1, 2], 0, ["w2"]], (out, logs)
    assert out["w1_end"] == [[0, 1, 2], 0, ["w2"]], (out, logs)
    assert out["w2_end"] == [[0, 1, 2], 1, ["driver"]], (out, logs)
    assert out["shutdown"] == "ok" and out["exits"] == [0, 0, 0], (out, logs)

    with capsys.disabled():
        print(f"\npartition: h3 cut off -> link down in {out['link_down_s']:.2f} s, "
              f"declared dead in {out['dead_s']:.2f} s, its call "
              f"failed in {out['call_failed_s']:.2f} s (bound {DEAD_BOUND_S} s); w1 silent "
              f"{out['gil_held'][2]:.1f} s with its GIL held, not evicted; link back -> "
              f"rejoined in {out['rejoin_s']:.2f} s; graceful shutdown {out['shutdown_s']:.2f} s")


MEMBERS_CUT_BOUND_S = 6.0  # a probe's tick (0.5 s), TCP giving up (about 1 s), 2 * link_timeout
# the answer written 0.7 s after the cut, TCP giving up, 2 * link_timeout, a tick, the relay
ANSWERS_CUT_BOUND_S = 7.0


def test_two_members_cut_off_from_each_other_fail_their_calls_to_each_other_in_seconds(
        net: Net, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:  # noqa: F811
    """h2 and h3 stop reaching each other (one way: h3's frames to h2 are
    lost, h2's arrive unacknowledged), and both still reach h1: the
    coordinator hears both, so nobody is declared dead. The calls between them
    in flight fail with ``WorkerGoneError`` ("out of reach") in seconds, as do
    new ones; both stay members, the driver reaches both; once the link is back
    and dialled again, calls flow between them."""
    out = run_group(net, tmp_path, "members")
    logs = out.pop("logs")
    print(json.dumps(out), logs, sep="\n")  # (shown if an assertion fails)
    assert [r[::2] for r in out["warm"]] == [["ok", 3], ["ok", 3]], (out, logs)
    for who, peer in (("via_w1", "w2"), ("via_w2", "w1")):
        status, (error, seconds, text) = out[who]
        assert status == "ok" and error == "WorkerGoneError", (out, logs)
        assert f"{peer!r} is out of reach from" in text, (out, logs)
        assert seconds < MEMBERS_CUT_BOUND_S, (out, logs)
    assert out["new_call"][0] == "WorkerGoneError" and out["new_call"][1] < 1.5, (out, logs)
    assert out["driver_to_both"] == [2, 2], out
    whole = [[0, 1, 2], 0, []]  # every member, none taken back, nobody seen dead
    assert out["health"] == [whole] * 3, (out, logs)
    assert out["w1_to_w2"][::2] == ["ok", 7] and out["w2_to_w1"][::2] == ["ok", 9], (out, logs)
    assert out["health_end"] == [whole] * 3, (out, logs)

    # the answers cut: w1's calls to w2 fail once w2's report reaches it, though
    # w1's own link to w2 is up; new ones too; once w2's route is back, it says so
    status, (error, seconds, text) = out["answers"]
    assert status == "ok" and error == "WorkerGoneError", (out, logs)
    assert "'w2' is out of reach from 'w1': its answers cannot come back" in text, (out, logs)
    assert out["answers_failed_s"] < ANSWERS_CUT_BOUND_S, (out, logs)
    assert out["answers_w1_link"] is None, (out, logs)
    assert out["answers_new_call"][0] == "WorkerGoneError", (out, logs)
    assert out["answers_back"][::2] == ["ok", 11], (out, logs)
    assert out["health_after_answers"] == [whole] * 3, (out, logs)
    # and with the coordinator, told through w2
    error, text = out["w1_to_driver_cut"]
    assert error == "WorkerGoneError", (out, logs)
    assert "'w1' is out of reach from 'driver': its answers cannot come back" in text, out
    assert out["w1_to_driver_failed_s"] < ANSWERS_CUT_BOUND_S, (out, logs)
    assert out["w1_to_driver_back"], (out, logs)
    status, (error, seconds, text) = out["driver_to_w1_cut"]
    assert status == "ok" and error == "WorkerGoneError", (out, logs)
    assert "'driver' is out of reach from 'w1': its answers cannot come back" in text, out
    assert out["driver_to_w1_failed_s"] < ANSWERS_CUT_BOUND_S, (out, logs)
    assert out["driver_to_w1_back"], (out, logs)
    assert out["health_after_driver_cuts"] == [whole] * 3, (out, logs)
    assert out["shutdown"] == "ok" and out["exits"] == [0, 0, 0], (out, logs)

    with capsys.disabled():
        print(f"\npartition: h2 and h3 cut off from each other -> their calls failed in "
              f"{out['via_w1'][1][1]:.2f} / {out['via_w2'][1][1]:.2f} s (bound "
              f"{MEMBERS_CUT_BOUND_S} s); nobody evicted; link back -> calls flow again in "
              f"{out['healed_s']:.2f} s; w2's answers cut -> w1's call failed in "
              f"{out['answers_failed_s']:.2f} s (bound {ANSWERS_CUT_BOUND_S} s), calls flow "
              f"again {out['answers_healed_s']:.2f} s after the route is back; with the driver: "
              f"w1's answers cut -> failed in {out['w1_to_driver_failed_s']:.2f} s, the "
              f"driver's -> in {out['driver_to_w1_failed_s']:.2f} s")
