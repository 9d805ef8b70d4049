"""Security tier: what a peer without the key costs an agent before the handshake.

The victim is an agent in its own process (a one-member group, ``init_rpc``
over ``env://``), so that its RSS is its own. The attacker speaks ZeroMQ's
wire protocol (ZMTP 3.0) by hand over a plain TCP socket: the 64-byte
greeting naming PLAIN (or CURVE, with ``encrypt=True``), then one command
frame whose header declares a large size, then as many bytes as it can
stream. libzmq reads a handshake command as it reads any frame, so before
nbrpc capped the frame size of its TCP sockets (``frames.CHUNK``; larger
frames travel cut into parts), that one frame made the victim hold all it
declared, up to ``max_message_size`` (4 GB by default), until the handshake
timed out.

What must hold: a 512 MB handshake frame grows the victim by less than
64 MB, plain or encrypted, and so do 1,000 connections at once, each stopped
just short of completing a frame of the largest size allowed: past
``zmqhub.PENDING_MAX`` connections mid-handshake, each new one is cut and
counted. The victim still answers its own calls afterwards.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq
from conftest import free_ports, local_user, poll_for, python_as

from nbrpc.transport import frames, zmqhub

pytestmark = pytest.mark.security

VICTIM = textwrap.dedent("""
    import os, sys, json
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
    from nbrpc import debug, rpc
    opts = rpc.TensorPipeRpcBackendOptions(encrypt=sys.argv[2] == "1", local_ipc=False)
    rpc.init_rpc("victim", rank=0, world_size=1, rpc_backend_options=opts)
    me = debug.snapshot()["members"][0]["address"]
    print(json.dumps({"address": me}), flush=True)
    for line in sys.stdin:  # one call per line; EOF ends it
        print(json.dumps({"answer": rpc.rpc_sync("victim", max, args=(1, 2)),
                          "dropped": debug.snapshot()["counters"]["dropped"]}), flush=True)
    rpc.shutdown()
""")


def _greeting(mechanism: bytes) -> bytes:
    """ZMTP 3.0's greeting: signature, version 3.0, mechanism, as-server, filler."""
    return (b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\0")
            + b"\0" + bytes(31))


def _rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) >> 10
    raise AssertionError("no VmRSS")


@contextmanager
def victim(encrypt: bool) -> Iterator[tuple[subprocess.Popen, str, int]]:
    proc = subprocess.Popen([sys.executable, "-c", VICTIM, str(free_ports(1)[0]),
                             "1" if encrypt else "0"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # (the victim's init_rpc is bounded by its timeout)
        assert line, "the victim did not start"
        import json

        host, _, port = json.loads(line)["address"].removeprefix("tcp://").rpartition(":")
        yield proc, host, int(port)
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        proc.stdout.close()


@contextmanager
def _stream(host: str, port: int, mechanism: bytes, declared: int,
            send: int) -> Iterator[int]:
    """A connection sending a greeting and one command frame that declares
    ``declared`` bytes, then up to ``send`` bytes of it, 1 MB at a time; yields
    the bytes the victim took, with the connection still open (closed after)."""
    block = bytes(1 << 20)
    taken = 0
    with socket.create_connection((host, port), timeout=5) as s:
        s.sendall(_greeting(mechanism) + b"\x06" + declared.to_bytes(8, "big"))
        s.settimeout(2)
        try:
            for _ in range(send // len(block)):
                s.sendall(block)
                taken += len(block)
        except OSError:  # refused and closed by the victim
            pass
        yield taken


@pytest.mark.parametrize("encrypt", [False, True], ids=["plain", "curve"])
def test_a_large_handshake_frame_is_refused_unread(encrypt: bool) -> None:
    mechanism = b"CURVE" if encrypt else b"PLAIN"
    with victim(encrypt) as (proc, host, port):
        before = _rss_mib(proc.pid)
        t = time.perf_counter()
        with _stream(host, port, mechanism, declared=512 << 20, send=512 << 20) as taken:
            grew = _rss_mib(proc.pid) - before
        print(f"\n{mechanism.decode()}: one handshake frame declaring 512 MB: the victim "
              f"took {taken >> 20} MB of it in {time.perf_counter() - t:.2f} s and grew by "
              f"{grew} MiB")
        assert grew < 64, f"the victim grew by {grew} MiB before any handshake"
        proc.stdin.write("call\n")
        proc.stdin.flush()
        assert '"answer": 2' in proc.stdout.readline()


def test_many_connections_before_the_handshake_hold_little() -> None:
    """1,000 connections, each stopped just short of completing a handshake
    frame of the largest size a tcp:// socket takes (frames.CHUNK): past
    PENDING_MAX at once, the victim cuts each new one, so they make it hold
    at most PENDING_MAX frames (without the cut: 245 MiB)."""
    conns, size = 1000, frames.CHUNK
    with victim(False) as (proc, host, port):
        before = _rss_mib(proc.pid)
        socks, cut = [], 0
        try:
            for _ in range(conns):
                s = socket.create_connection((host, port), timeout=5)
                socks.append(s)
                try:
                    s.sendall(_greeting(b"PLAIN") + b"\x06" + size.to_bytes(8, "big")
                              + bytes(size - 512))
                except OSError:  # cut by the victim already
                    cut += 1
            grew = _rss_mib(proc.pid) - before
            deadline = time.monotonic() + 3  # (every connection still open; the
            while True:                      # victim's count may lag its accepts)
                proc.stdin.write("call\n")
                proc.stdin.flush()
                answer = json.loads(proc.stdout.readline())
                refused = answer["dropped"].get("refused connection", 0)
                if refused >= conns - zmqhub.PENDING_MAX or time.monotonic() > deadline:
                    break
                time.sleep(0.1)  # (a poll's pace)
        finally:
            for s in socks:
                s.close()
        print(f"\n{conns} connections, each {size >> 10} KiB into a handshake frame: the "
              f"victim grew by {grew} MiB and cut {refused} of them")
        assert grew < 64, f"the victim grew by {grew} MiB before any handshake"
        assert answer["answer"] == 2
        assert refused >= conns - zmqhub.PENDING_MAX, answer["dropped"]


def test_a_flood_of_handshakes_leaves_members_in_and_lets_them_in_after() -> None:
    """While PENDING_MAX connections hold an agent mid-handshake, a key
    holder's new connection is cut (its DEALER dials again), and a member's
    connection already in carries on; once the flood ends, the key holder
    gets in."""
    from conftest import intruder, local_group, poll_or_fail
    from zmq.utils.monitor import recv_monitor_message

    with local_group(["a", "b"], threads=2, local_ipc=False) as (a, b):
        assert a.rpc_sync("b", max, (1, 2)) == 2  # a's connection to b is in
        host, _, port = b.address.removeprefix("tcp://").rpartition(":")
        pending = b.io._zmq._pending
        flood = []
        try:
            for _ in range(zmqhub.PENDING_MAX):
                s = socket.create_connection((host, int(port)), timeout=5)
                s.sendall(_greeting(b"PLAIN"))
                flood.append(s)
            poll_or_fail(lambda: len(pending) == zmqhub.PENDING_MAX, 5, "the flood to be seen")
            with intruder(b.address, b._key) as member:  # (a key holder's DEALER)
                events = member.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
                poll_or_fail(lambda: b.io.dropped["refused connection"] >= 2, 5,
                             lambda: dict(b.io.dropped))  # cut, dialled again, cut
                assert not events.poll(0), "a connection got in past the limit"
                assert a.rpc_sync("b", max, (3, 4)) == 4
                for s in flood:
                    s.close()
                assert events.poll(5000), "the key holder did not get in after the flood"
                assert recv_monitor_message(events)["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED
                member.disable_monitor()
                events.close(linger=0)
        finally:
            for s in flood:
                s.close()


def _controller_ports(profile_dir: str) -> list[int]:
    """Every port ipyparallel's controller listens on (its connection files)."""
    ports: set[int] = set()
    for path in glob.glob(os.path.join(profile_dir, "security", "ipcontroller-*.json")):
        with open(path) as f:
            info = json.load(f)
        for name in ("registration", "control", "mux", "task", "iopub", "notification",
                     "hb_ping", "hb_pong", "broadcast"):
            value = info.get(name)
            ports.update(value if isinstance(value, list) else [value] if value else [])
    return sorted(ports)


def _tree_rss_mib(pid: int) -> int:
    import psutil

    root = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)]) >> 20


@pytest.mark.cluster
def test_a_local_clusters_controller_listens_only_where_no_other_user_reaches() -> None:
    """On one host the controller binds no TCP port: its channels are Unix
    sockets in the cluster's private profile (0700), so another local user
    cannot connect to it at all, whatever they would send."""
    import psutil

    from nbrpc import rpc
    from nbrpc.cluster import Cluster

    uid, gid = local_user("nbrpc-attacker")
    with Cluster(progress=False).start(1) as cluster:
        controller = psutil.Process(cluster._controller_proc.pid)
        tree = [controller, *controller.children(recursive=True)]
        assert not [c.laddr for p in tree for c in p.net_connections("inet")
                    if c.status == psutil.CONN_LISTEN], "the controller listens on TCP"
        with open(glob.glob(os.path.join(cluster._profile_dir, "security",
                                         "ipcontroller-*engine.json"))[0]) as f:
            interface = json.load(f)["interface"]
        assert interface.startswith(f"ipc://{cluster._profile_dir}/"), interface
        assert os.stat(cluster._profile_dir).st_mode & 0o777 == 0o700
        path = interface.removeprefix("ipc://") + f":{_controller_ports(cluster._profile_dir)[0]}"
        assert os.path.exists(path)
        probe = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
                 "try:\n    s.connect(sys.argv[1])\nexcept OSError as e:\n"
                 "    print(type(e).__name__)\nelse:\n    print('connected')")
        python, why = python_as(uid, gid)
        assert python is not None, why
        out = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                              python, "-c", probe, path],
                             capture_output=True, text=True, timeout=30)
        assert out.stdout.strip() == "PermissionError", (out.stdout, out.stderr)
        assert rpc.rpc_sync("worker1", max, args=(1, 2)) == 2
        assert cluster.view("worker1").apply_sync(max, 3, 4) == 4


@pytest.mark.cluster
def test_engines_elsewhere_reach_the_controller_only_through_its_relay() -> None:
    """With engines on other hosts (here ``launcher="local"`` with
    ``controller_ip``, run through their relay as remote engines are), the
    controller still binds no TCP port: its one TCP port is the relay's, which
    reads a HELLO of 34 bytes before anything reaches the controller. A 512 MB
    stream to it and 1,000 connections that never say HELLO grow the
    controller's process tree by less than 64 MiB, and the cluster carries on."""
    import psutil

    from nbrpc import rpc
    from nbrpc.cluster import Cluster
    from nbrpc.cluster.relay import MAX_WAITING

    with Cluster(progress=False, launcher="local", controller_ip="127.0.0.1").start(1) as cluster:
        pid = cluster._controller_proc.pid
        root = psutil.Process(pid)
        listening = {c.laddr.port for p in [root, *root.children(recursive=True)]
                     for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        host, port = cluster._relay.rsplit(":", 1)
        assert listening == {int(port)}, (listening, cluster._relay)
        before = _tree_rss_mib(pid)
        t = time.perf_counter()
        with _stream(host, int(port), b"NULL", declared=512 << 20, send=512 << 20) as took:
            pass
        socks, cut = [], 0
        try:
            for _ in range(1000):
                s = socket.create_connection((host, int(port)), timeout=5)
                socks.append(s)
                try:
                    s.sendall(bytes(20))  # (short of a HELLO)
                except OSError:
                    cut += 1
            grew = _tree_rss_mib(pid) - before
            open_ = lambda: sum(1 for s in socks if not _closed_within(s, 0.0))  # noqa: E731
            poll_for(lambda: open_() <= MAX_WAITING, 5)  # (the relay closes them as it reads)
            waiting = open_()
        finally:
            for s in socks:
                s.close()
        print(f"\nthe controller's relay: a 512 MB stream (it took {took >> 20} MB) and 1,000 "
              f"connections without a HELLO ({waiting} left open) in "
              f"{time.perf_counter() - t:.2f} s grew the controller by {grew} MiB")
        assert grew < 64, f"the controller grew by {grew} MiB"
        assert waiting <= MAX_WAITING
        assert rpc.rpc_sync("worker1", max, args=(1, 2)) == 2
        assert cluster.view("worker1").apply_sync(max, 3, 4) == 4  # ipyparallel still works


def _closed_within(s: socket.socket, timeout: float) -> bool:
    """Whether the other end has closed ``s`` (EOF or reset) within ``timeout`` s."""
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except (BlockingIOError, TimeoutError):
        return False
    except OSError:
        return True


@pytest.mark.cluster
def test_a_tcp_controller_refuses_a_large_frame_unread(tmp_path) -> None:
    """ipyparallel's controller speaks no authenticated handshake: whatever a
    frame declares, it would hold. Where it listens on TCP (a profile
    directory of the user's own, whose safety nbrpc cannot vouch for), a
    Cluster caps its frames (64 MiB, ``controller_max_message``), so a 512 MB
    frame streamed to each of its ports is refused before it is allocated,
    and the cluster carries on."""
    from nbrpc import rpc
    from nbrpc.cluster import Cluster

    with Cluster(progress=False, controller_ip="127.0.0.1",
                 profile_dir=str(tmp_path)).start(1) as cluster:
        ports = _controller_ports(cluster._profile_dir)
        assert len(ports) >= 8, ports
        pid = cluster._controller_proc.pid
        before = _tree_rss_mib(pid)
        t, took = time.perf_counter(), 0
        for port in ports:
            with _stream("127.0.0.1", port, b"NULL", declared=512 << 20, send=512 << 20) as n:
                took += n
        grew = _tree_rss_mib(pid) - before
        print(f"\na 512 MB frame to each of the controller's {len(ports)} ports: it took "
              f"{took >> 20} MB in all in {time.perf_counter() - t:.2f} s and grew by {grew} MiB")
        assert grew < 64, f"the controller grew by {grew} MiB"
        assert rpc.rpc_sync("worker1", max, args=(1, 2)) == 2
        assert cluster.view("worker1").apply_sync(max, 3, 4) == 4  # ipyparallel still works
