"""The floor of each transport shape nbrpc could take, measured before choosing.

``python benchmarks/bench_transport_floor.py`` runs a ping-pong of small
messages between two processes on this host for each shape below and prints
the median round trip (µs). No pickling, signing or bookkeeping: only how a
message gets from one Python thread to another, which is what separates these
shapes (``bench_breakdown.py`` shows what nbrpc adds on top).

============  =================================================================
shape         how a message travels
============  =================================================================
zmq-tcp       pyzmq DEALER → ROUTER over loopback TCP, as nbrpc did; each side
              has an I/O thread polling its ROUTER; the caller waits on a lock
              that the I/O thread releases (one hand-off), the server answers
              on its I/O thread
zmq-ipc       the same over a Unix domain socket (nbrpc's default on one host)
unix          plain Unix domain stream sockets, length-prefixed; the same
              threads (an I/O thread polling the sockets, the caller waiting
              on a lock): no libzmq I/O threads in between
tcp           the same over loopback TCP (``TCP_NODELAY``)
unix-direct   plain Unix sockets where the caller reads its own answer (it is
              the only waiter) and the server answers on the thread that read
              the request: no Python hand-off at all (the leader/follower
              shape's best case)
============  =================================================================

Shapes alternate in rounds (``--rounds``); the table shows the median over
rounds of each round's median, and the range.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

SHAPES = ("zmq-tcp", "zmq-ipc", "unix", "tcp", "unix-direct")
HEADER = struct.Struct("<I")


class _Waiter:
    """A one-shot event on a bare lock (what a future's wait comes down to)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.lock.acquire()

    def set(self) -> None:
        self.lock.release()

    def wait(self, timeout: float) -> bool:
        return self.lock.acquire(timeout=timeout)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(n - got)
        if not chunk:
            raise ConnectionError("peer closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _stream_pair(shape: str, role: int, where: str, port: int) -> tuple[socket.socket, socket.socket]:
    """(listening socket, connected outgoing socket) for the stream shapes."""
    family = socket.AF_INET if shape == "tcp" else socket.AF_UNIX
    addr = lambda r: ("127.0.0.1", port + r) if family == socket.AF_INET else f"{where}/{r}"  # noqa: E731
    lsock = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_INET:
        lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    lsock.bind(addr(role))
    lsock.listen()
    out = socket.socket(family, socket.SOCK_STREAM)
    deadline = time.monotonic() + 20
    while True:
        try:
            out.connect(addr(1 - role))
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    if family == socket.AF_INET:
        out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return lsock, out


def run_side(shape: str, role: int, where: str, port: int, calls: int) -> float | None:
    """One process of a ping-pong; role 0 measures and returns the median (µs)."""
    import zmq

    waiters: dict[bytes, _Waiter] = {}
    send_lock = threading.Lock()
    if shape.startswith("zmq"):
        ctx = zmq.Context()
        scheme = (lambda r: f"tcp://127.0.0.1:{port + r}") if shape == "zmq-tcp" else (
            lambda r: f"ipc://{where}/{r}")
        router = ctx.socket(zmq.ROUTER)
        router.bind(scheme(role))
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(scheme(1 - role))

        def send(body: bytes) -> None:
            with send_lock:
                dealer.send(body)

        def io() -> None:
            poller = zmq.Poller()
            poller.register(router, zmq.POLLIN)
            while True:
                poller.poll(500)
                while True:
                    try:
                        body = router.recv_multipart(zmq.NOBLOCK)[-1]
                    except zmq.Again:
                        break
                    send(body) if role == 1 else waiters.pop(body).set()
    else:
        lsock, out = _stream_pair(shape, role, where, port)
        if shape == "unix-direct":
            conn, _ = lsock.accept()
            if role == 1:
                while True:  # the reading thread answers
                    try:
                        n = HEADER.unpack(_recv_exact(conn, 4))[0]
                    except ConnectionError:
                        return None
                    body = _recv_exact(conn, n)
                    out.sendall(HEADER.pack(n) + body)

            def send(body: bytes) -> None:
                out.sendall(HEADER.pack(len(body)) + body)

            def call(body: bytes) -> None:  # the caller reads its own answer
                send(body)
                n = HEADER.unpack(_recv_exact(conn, 4))[0]
                _recv_exact(conn, n)

            return _measure(call, calls)

        def send(body: bytes) -> None:
            with send_lock:
                out.sendall(HEADER.pack(len(body)) + body)

        def io() -> None:
            poller = zmq.Poller()
            poller.register(lsock.fileno(), zmq.POLLIN)
            conns: dict[int, list] = {}
            while True:
                for fd, _ in poller.poll(500):
                    if fd == lsock.fileno():
                        c, _ = lsock.accept()
                        c.setblocking(False)
                        conns[c.fileno()] = [c, b""]
                        poller.register(c.fileno(), zmq.POLLIN)
                        continue
                    c, buf = conns[fd]
                    try:
                        data = c.recv(1 << 16)
                    except BlockingIOError:
                        continue
                    if not data:
                        return
                    buf += data
                    while len(buf) >= 4:
                        n = HEADER.unpack_from(buf)[0]
                        if len(buf) < 4 + n:
                            break
                        body, buf = buf[4:4 + n], buf[4 + n:]
                        send(body) if role == 1 else waiters.pop(body).set()
                    conns[fd][1] = buf

    thread = threading.Thread(target=io, daemon=True)
    thread.start()
    if role == 1:
        thread.join(300)
        return None

    def call(body: bytes) -> None:
        w = waiters[body] = _Waiter()
        send(body)
        if not w.wait(10):
            raise TimeoutError("no answer within 10 s")

    return _measure(call, calls)


def _measure(call: Callable[[bytes], None], calls: int) -> float:
    samples = []
    for i in range(calls + calls // 10):
        body = b"%d" % i
        t = time.perf_counter()
        call(body)
        if i >= calls // 10:
            samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def run_shape(shape: str, calls: int, port: int) -> float:
    """Both processes of one shape; the median round trip (µs)."""
    with tempfile.TemporaryDirectory(prefix="nbrpc-floor-") as where:
        args = [sys.executable, __file__, "--side", shape, where, str(port), str(calls)]
        server = subprocess.Popen([*args, "1"])
        try:
            done = subprocess.run([*args, "0"], capture_output=True, text=True, timeout=120)
            if done.returncode != 0:
                raise RuntimeError(f"{shape}: {done.stderr.strip()[-500:]}")
            return float(done.stdout.split()[-1])
        finally:
            server.kill()  # (started here, stopped by its own handle)
            server.wait(10)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--side":  # one process of a pair
        shape, where, port, calls, role = argv[1:]
        result = run_side(shape, int(role), where, int(port), int(calls))
        if result is not None:
            print(f"{result:.2f}")
        os._exit(0)  # (daemon I/O threads blocked in poll)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    results: dict[str, list[float]] = {s: [] for s in SHAPES}
    for r in range(args.rounds):
        for shape in SHAPES:
            with socket.socket() as s:  # two free ports in a row, for the TCP shapes
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            results[shape].append(run_shape(shape, args.calls, port))
            print(f"[{r + 1}/{args.rounds}] {shape}: {results[shape][-1]:.1f} µs",
                  file=sys.stderr, flush=True)
    print(f"small-message round trip between two processes, {args.calls} calls, median of "
          f"{args.rounds} rounds (range); load average at the end {os.getloadavg()[0]:.2f}")
    print("| shape | round trip (µs) | range |")
    print("|:---|---:|---:|")
    for shape, values in results.items():
        print(f"| {shape} | {statistics.median(values):.1f} | "
              f"{min(values):.1f}–{max(values):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
