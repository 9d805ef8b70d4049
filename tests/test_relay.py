"""The controller's relay (``nbrpc.cluster.relay``), in this process: an
engine's end and the driver's end spliced through loopback TCP to a stand-in
for the controller (a Unix socket server that echoes), and what the
driver's end does with connections that do not present the key."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import poll_or_fail

from nbrpc.cluster import relay

KEY = b"the ipyparallel session key"
PORT = 4242  # a controller channel's port (only a number in a socket's name here)


class Echo:
    """The controller's channel ``<sockets>:<port>``: echoes what it gets."""

    def __init__(self, path: str) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(path)
        self.server.listen(16)
        self.server.settimeout(0.2)
        self.accepted = 0
        self.accepting = threading.Event()  # cleared: a controller too busy to accept
        self.accepting.set()
        self.paused = threading.Event()  # set once it has stopped accepting
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            if not self.accepting.is_set():
                self.paused.set()
                self.accepting.wait(0.2)
                continue
            self.paused.clear()
            try:
                conn, _ = self.server.accept()
            except OSError:
                continue
            self.accepted += 1
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    @staticmethod
    def _echo(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            try:
                while data := conn.recv(1 << 16):
                    conn.sendall(data)
            except OSError:
                pass

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.server.close()


@pytest.fixture
def ends(tmp_path: Path) -> Iterator[tuple[relay.ControllerRelay, relay.EngineRelay, Echo]]:
    (tmp_path / "driver").mkdir()
    (tmp_path / "engine").mkdir()
    echo = Echo(str(tmp_path / "driver" / f"c:{PORT}"))
    driver = relay.ControllerRelay("127.0.0.1", str(tmp_path / "driver" / "c"),
                                   lambda: KEY).start()
    engine = relay.EngineRelay(driver.address, relay.relay_token(KEY), [PORT],
                               str(tmp_path / "engine")).start()
    yield driver, engine, echo
    engine.stop()
    driver.stop()
    echo.close()


def _through(engine: relay.EngineRelay) -> socket.socket:
    """A connection to the engine's end of the channel, as ZeroMQ opens one."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(engine.interface.removeprefix("ipc://") + f":{PORT}")
    return s


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = s.recv(min(1 << 16, n - len(out)))
        assert chunk, f"closed after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


def test_bytes_cross_both_ways_whole_and_in_order(ends) -> None:
    driver, engine, echo = ends
    payload = os.urandom(3 << 20)  # far more than a direction's buffer holds
    with _through(engine) as s:
        sender = threading.Thread(target=s.sendall, args=(payload,))
        sender.start()
        assert _recv_exactly(s, len(payload)) == payload
        sender.join(10)
        assert driver.pairs == 1 and echo.accepted == 1
    poll_or_fail(lambda: driver.pairs == 0, 5, "the driver's end to close its pair")


def test_many_connections_each_get_their_own_channel(ends) -> None:
    driver, engine, echo = ends
    socks = [_through(engine) for _ in range(20)]
    try:
        for i, s in enumerate(socks):
            s.sendall(b"%d" % i)
        for i, s in enumerate(socks):
            assert _recv_exactly(s, len(b"%d" % i)) == b"%d" % i
        assert driver.pairs == 20
    finally:
        for s in socks:
            s.close()
    poll_or_fail(lambda: driver.pairs == 0, 5, "every pair to close")
    assert driver.refused == 0


def test_a_controller_with_a_full_backlog_is_dialled_again(ends, tmp_path: Path) -> None:
    """A Unix listener whose backlog is full refuses a non-blocking connect
    (EAGAIN): an engine's burst of channels while the controller is busy.
    The driver's end tries again until the controller accepts."""
    driver, engine, echo = ends
    echo.accepting.clear()
    assert echo.paused.wait(5)  # (its accept() under way, with a 0.2 s timeout, returned)
    socks = [_through(engine) for _ in range(24)]  # more than the backlog of 16
    try:
        for i, s in enumerate(socks):
            s.sendall(b"%d" % i)
        poll_or_fail(lambda: driver.redials > 0, 5, "a connect refused and tried again")
        assert echo.accepted == 0
        echo.accepting.set()
        for i, s in enumerate(socks):
            assert _recv_exactly(s, len(b"%d" % i)) == b"%d" % i
        assert echo.accepted == 24 and driver.pairs == 24 and driver.refused == 0
    finally:
        for s in socks:
            s.close()


def _raw(driver: relay.ControllerRelay) -> socket.socket:
    s = socket.create_connection(driver.address, timeout=5)
    return s


def _closed_by_peer(s: socket.socket, timeout: float = 5) -> bool:
    s.settimeout(timeout)
    try:
        while s.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_an_engines_connection_not_through_in_time_is_closed_to_be_dialled_again(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A driver's relay whose SYNs go unanswered (here: a listener whose accept
    queue is full, so its kernel drops them): the engine's end closes the
    connection after ``CONNECT_TIMEOUT``, and ZeroMQ dials again, rather than
    leave an engine channel (its heart's, say) dead for the kernel's two
    minutes of SYN retries."""
    monkeypatch.setattr(relay, "CONNECT_TIMEOUT", 0.5)
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    fillers = []
    for _ in range(3):  # the queue holds one; SYNs after it are dropped
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(full.getsockname())
        fillers.append(c)
    engine = relay.EngineRelay(full.getsockname(), relay.relay_token(KEY), [PORT],
                               str(tmp_path)).start()
    try:
        t0 = time.monotonic()
        with _through(engine) as s:
            assert s.recv(1) == b""  # closed by the engine's end
        took = time.monotonic() - t0
        assert 0.4 < took < 3, took
        assert engine._splicer.gave_up == 1
        poll_or_fail(lambda: engine._splicer.pairs == 0, 2, "the pair to be counted closed")
    finally:
        engine.stop()
        for c in (*fillers, full):
            c.close()


def test_a_connection_without_the_key_reaches_nothing(ends) -> None:
    driver, _, echo = ends
    with _raw(driver) as s:
        s.sendall(relay.hello(relay.relay_token(b"another key"), PORT) + bytes(1 << 20))
        assert _closed_by_peer(s)
    assert driver.refused == 1 and echo.accepted == 0


def test_refusals_are_reported_to_a_file_only_the_user_reads(tmp_path: Path) -> None:
    """With a report path, the relay writes its refusals there (mode 0600,
    replaced whole): the count and the last one's address and reason, which
    the cluster reads (relay.read_report) to say why an engine is kept out."""
    report = tmp_path / "relay.refusals"
    driver = relay.ControllerRelay("127.0.0.1", str(tmp_path / "c"), lambda: KEY,
                                   report=str(report)).start()
    try:
        assert relay.read_report(str(report)) is None  # nothing refused yet
        for _ in range(2):
            with _raw(driver) as s:
                s.sendall(relay.hello(relay.relay_token(b"another key"), PORT))
                assert _closed_by_peer(s)
        poll_or_fail(lambda: "refused 2 connections" in (relay.read_report(str(report)) or ""),
                     5, "the report of both refusals")
        text = relay.read_report(str(report))
        assert text.startswith("the controller's relay refused 2 connections (the last from "
                               "127.0.0.1:") and text.endswith(": not the cluster's key)"), text
        assert report.stat().st_mode & 0o777 == 0o600
        assert json.loads(report.read_text())["refused"] == 2
    finally:
        driver.stop()


def test_a_hello_naming_no_channel_is_closed(ends) -> None:
    driver, _, echo = ends
    with _raw(driver) as s:
        s.sendall(relay.hello(relay.relay_token(KEY), PORT + 1))
        assert _closed_by_peer(s)
    assert echo.accepted == 0


def test_a_connection_that_says_nothing_is_closed_after_the_hello_timeout(
        ends, monkeypatch: pytest.MonkeyPatch) -> None:
    driver, _, _ = ends
    monkeypatch.setattr(relay, "HELLO_TIMEOUT", 0.3)
    with _raw(driver) as s:
        s.sendall(b"x" * 10)  # less than a HELLO
        assert _closed_by_peer(s)
    assert driver.refused == 1


def test_a_hello_that_came_while_the_relay_was_paused_counts_before_its_deadline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The relay's process paused just after it accepted a connection (its
    timers then run before it reads again): the HELLO that arrived meanwhile
    is read first, and the engine gets through."""
    monkeypatch.setattr(relay, "HELLO_TIMEOUT", 0.2)
    accept = relay.ControllerRelay._on_accept

    def paused(self, conn: socket.socket) -> None:
        accept(self, conn)
        time.sleep(1.0)  # the pause: the engine's HELLO arrives meanwhile

    monkeypatch.setattr(relay.ControllerRelay, "_on_accept", paused)
    (tmp_path / "driver").mkdir()
    echo = Echo(str(tmp_path / "driver" / f"c:{PORT}"))
    driver = relay.ControllerRelay("127.0.0.1", str(tmp_path / "driver" / "c"),
                                   lambda: KEY).start()
    try:
        with _raw(driver) as s:
            s.sendall(relay.hello(relay.relay_token(KEY), PORT) + b"ping")
            assert _recv_exactly(s, 4) == b"ping"
        assert driver.refused == 0
    finally:
        driver.stop()
        echo.close()


def test_at_most_max_waiting_connections_wait_for_their_hello(ends) -> None:
    driver, engine, _ = ends
    waiting = [_raw(driver) for _ in range(relay.MAX_WAITING)]
    try:
        poll_or_fail(lambda: len(driver._waiting) == relay.MAX_WAITING, 5, "all to wait")
        extra = [_raw(driver) for _ in range(10)]
        for s in extra:
            assert _closed_by_peer(s)
            s.close()
        assert driver.refused == 10
    finally:
        for s in waiting:
            s.close()
    # (a connection that comes before the relay has read those closes is refused: still full)
    poll_or_fail(lambda: not driver._waiting, 5, "the relay to drop the closed connections")
    with _through(engine) as s:  # once they are gone, a key holder gets in
        s.sendall(b"ping")
        assert _recv_exactly(s, 4) == b"ping"


def test_the_engine_end_points_ipyparallel_at_its_own_sockets(
        ends, tmp_path: Path) -> None:
    driver, _, _ = ends
    info = {"interface": "ipc:///driver/profile/c", "registration": PORT, "mux": 5,
            "broadcast": [6, 7], "key": KEY.decode(), "location": "driver-host"}
    environ = {relay.RELAY_ENV: "{}:{}".format(*driver.address),
               "IPP_CONNECTION_INFO": json.dumps(info)}
    (tmp_path / "mine").mkdir()
    engine = relay.start_engine_relay(environ, str(tmp_path / "mine"), fork=False)
    try:
        seen = json.loads(environ["IPP_CONNECTION_INFO"])
        assert seen["interface"] == f"ipc://{tmp_path / 'mine'}/c"
        assert {p.name for p in (tmp_path / "mine").iterdir()} == {
            f"c:{p}" for p in (PORT, 5, 6, 7)}
        with _through(engine) as s:
            s.sendall(b"registration")
            assert _recv_exactly(s, 12) == b"registration"
    finally:
        engine.stop()
    assert relay.start_engine_relay({}, str(tmp_path)) is None  # no relay named: nothing


ENGINE = textwrap.dedent("""
    import ctypes, importlib.util, sys
    spec = importlib.util.spec_from_file_location("relay", sys.argv[1])
    relay = importlib.util.module_from_spec(spec)
    sys.modules["relay"] = relay
    spec.loader.exec_module(relay)
    environ = {relay.RELAY_ENV: sys.argv[2], "IPP_CONNECTION_INFO": sys.argv[3]}
    print(relay.start_engine_relay(environ, sys.argv[4]).pid, flush=True)
    sys.stdin.readline()
    ctypes.PyDLL(None).sleep(60)  # busy in C with the GIL held, as an engine may be
""")


def test_an_engines_relay_serves_while_the_engine_holds_its_gil_and_goes_with_it(
        ends, tmp_path: Path) -> None:
    """An engine's relay runs in a child process: ipyparallel's heartbeats
    pass while the engine is busy in C with its GIL held (as its own heart
    does), and the child goes when the engine does."""
    import psutil

    driver, _, echo = ends
    info = {"interface": "ipc:///driver/profile/c", "registration": PORT,
            "key": KEY.decode()}
    (tmp_path / "mine").mkdir()
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE, relay.__file__, "{}:{}".format(*driver.address),
         json.dumps(info), str(tmp_path / "mine")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        child = int(engine.stdout.readline())
        engine.stdin.write("hold\n")
        engine.stdin.flush()
        poll_or_fail(lambda: "nanosleep" in Path(f"/proc/{engine.pid}/wchan").read_text(), 10,
                     "the engine to be inside its C sleep, the GIL held")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(5)
            s.connect(str(tmp_path / "mine" / f"c:{PORT}"))
            s.sendall(b"heartbeat")
            assert _recv_exactly(s, 9) == b"heartbeat"
        assert engine.poll() is None  # (still holding)
    finally:
        engine.kill()
        engine.wait(10)
        engine.stdin.close()
        engine.stdout.close()
    poll_or_fail(lambda: not psutil.pid_exists(child)
                 or psutil.Process(child).status() == psutil.STATUS_ZOMBIE, 5,
                 "the relay's process to go with its engine")


@pytest.mark.parametrize(("launcher", "options", "expected"), [
    ("ssh", {"remote_python": "/opt/py/bin/python3", "engines": {"h2": 1}},
     ["/opt/py/bin/python3", "-m", "nbrpc.cluster.relay_engine"]),
    ("slurm", {}, [sys.executable, "-m", "nbrpc.cluster.relay_engine"]),
    ("local", {"engine_cmd": ["srun", "-N1", "python3", "-m", "ipyparallel.engine"]},
     ["srun", "-N1", "python3", "-m", "nbrpc.cluster.relay_engine"]),
])
def test_a_relayed_engine_runs_the_launchers_own_interpreter(launcher, options, expected) -> None:
    """A Cluster swaps the relay's engine into the launcher's own engine
    command: the SSH launcher's runs ``remote_python`` on the remote host,
    not this machine's interpreter; a given ``engine_cmd`` keeps its shape."""
    from nbrpc.cluster import Cluster
    from nbrpc.cluster.cluster import _Worker

    cluster = Cluster(launcher=launcher, launcher_options=options, host="10.0.0.1",
                      controller_ip="10.0.0.1", progress=False)
    cluster._relay = "10.0.0.1:4000"
    kwargs = cluster._engine_kwargs(_Worker("worker1", 1))
    assert kwargs["engine_cmd"] == expected
    assert kwargs["environment"][relay.RELAY_ENV] == "10.0.0.1:4000"
    other = Cluster(launcher="local", launcher_options={"engine_cmd": ["ipengine"]},
                    host="10.0.0.1", controller_ip="10.0.0.1", progress=False)
    other._relay = "10.0.0.1:4000"
    with pytest.raises(ValueError, match="engine_cmd must run ipyparallel's engine"):
        other._engine_kwargs(_Worker("worker1", 1))
