"""ipyparallel's controller, reached from other hosts through one port that
only key holders get through.

ipyparallel's controller speaks no authenticated handshake: whoever reaches
one of its TCP ports can make it hold a whole frame (up to the 64 MiB nbrpc
caps it at), on as many connections as they open. So a Cluster's controller
never listens on TCP. It binds Unix sockets in the cluster's private profile
(0700); engines on this host connect to them directly, and engines on other
hosts through a relay pair::

    engine host                                  driver host
    ipyparallel engine                           ipyparallel controller
      connects ipc://<private dir>/c:<port>        binds ipc://<profile>/c:<port>
    EngineRelay (a child process of the          ControllerRelay (a thread of the
      engine) listens there, and for each          guarded controller process)
      connection dials the driver's relay  ---->   listens on one TCP port: a
      and sends HELLO = token + port, then         connection is spliced to
      the bytes                                    <profile>/c:<port> only
                                                   after a valid HELLO

The token is ``HMAC(ipyparallel's session key, "nbrpc-controller-relay")``
(with ipyparallel's CurveZMQ on, which turns signing off, the controller's
CURVE key stands in for it: :func:`relay_secret`). Engines hold it already,
in their connection info, so the relay asks for nothing new. It crosses the
network in clear, as ipyparallel's messages do: someone who reads the
traffic can replay it (and read those messages); ipyparallel's own
CurveZMQ, end to end through the relay, is the answer on such a network.

Before its HELLO a connection costs the relay ``HELLO_LEN`` bytes, for at
most ``HELLO_TIMEOUT`` seconds, and at most ``MAX_WAITING`` connections
wait at once (more are closed): a peer without the key holds a few
kilobytes of the driver, however many connections it opens. After it, each
direction of a spliced connection holds at most ``BUFFER`` bytes (reading
stops until the other side drains).

Each end serves its sockets on one thread with a selector (:class:`Splicer`);
ZeroMQ's reconnects become new relayed connections. The engine's end runs
in a child process (:func:`start_engine_relay`), so that the engine's GIL,
held by a long C call, never stalls ipyparallel's heartbeats.
"""

from __future__ import annotations

import errno
import heapq
import hmac
import itertools
import json
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

TOKEN_LABEL = b"nbrpc-controller-relay"
TOKEN_LEN = 32
HELLO_LEN = TOKEN_LEN + 2  # token, then the controller port (big-endian)
HELLO_TIMEOUT = 10.0  # seconds a connection has to send its HELLO
MAX_WAITING = 64  # connections without a HELLO yet, at most
DIAL_TIMEOUT = 5.0  # seconds to reach a controller channel whose backlog is full
DIAL_RETRY = 0.01  # seconds between those tries
# Seconds for the engine's end to get through to the driver's relay (SYNs sent
# at 0, 1 and 3 s): a connection still not through is closed, and ZeroMQ dials
# again at once, rather than sit for the kernel's two minutes of SYN retries
# with an engine channel (its heart's, say) silently dead meanwhile.
CONNECT_TIMEOUT = 5.0
BUFFER = 1 << 18  # bytes held per direction of a spliced connection
STALL_S = 0.5  # seconds from a select to its timers beyond which it selects once more first
REPORT_DELAY = 0.2  # seconds between writes of the refusals' report, at least
REPORT_SUFFIX = ".refusals"  # the report's path: the relay's address file's, with this
_READ = 1 << 16  # bytes read at once
# The controller's channels in an engine's connection info (ports or lists of ports).
CHANNELS = ("registration", "control", "mux", "task", "iopub", "hb_ping", "hb_pong",
            "broadcast")


def relay_token(session_key: bytes) -> bytes:
    """What a relayed connection presents: only ipyparallel key holders know it.

    >>> len(relay_token(b"k")), relay_token(b"k") == relay_token(b"other")
    (32, False)
    """
    return hmac.new(session_key, TOKEN_LABEL, "sha256").digest()


def relay_secret(info: dict) -> bytes:
    """What the relay's token is made from: ipyparallel's session key, which
    signs its messages, or with its CurveZMQ on (which turns signing off)
    the controller's CURVE key; both reach engines only in their connection
    info.

    >>> relay_secret({"key": "abc"}), relay_secret({"key": "", "curve_serverkey": "xyz"})
    (b'abc', b'xyz')
    """
    secret = info.get("key") or info.get("curve_serverkey") or ""
    if not secret:
        raise ValueError("ipyparallel's connection info has neither a session key nor a CURVE "
                         "key: nothing for the controller's relay to check engines against")
    return secret.encode()


def hello(token: bytes, port: int) -> bytes:
    """The first bytes of a relayed connection: ``token``, then ``port``.

    >>> hello(bytes(32), 443)[32:]
    b'\\x01\\xbb'
    """
    return token + port.to_bytes(2, "big")


def channel_ports(info: dict) -> list[int]:
    """The controller ports an engine's connection info names.

    >>> channel_ports({"interface": "ipc:///p/c", "registration": 5, "mux": 7,
    ...                "broadcast": [9, 11], "key": "x"})
    [5, 7, 9, 11]
    """
    ports: list[int] = []
    for name in CHANNELS:
        value = info.get(name)
        for port in value if isinstance(value, list) else [value]:
            if isinstance(port, int) and port not in ports:
                ports.append(port)
    return ports


@dataclass(eq=False)
class _End:
    """One socket of a spliced pair: what waits to be written to it, its peer,
    and the events it is registered for (0: not registered)."""

    sock: socket.socket
    out: bytearray = field(default_factory=bytearray)
    peer: _End | None = None
    connecting: bool = False
    eof: bool = False  # it closed its side: what it sent is flushed, then both close
    events: int = 0


class Splicer:
    """Copies bytes both ways between pairs of non-blocking sockets, and
    accepts on listening ones, on one thread. ``stop()`` closes everything."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._sel.register(self._wake_r, selectors.EVENT_READ, ("wake", None))
        self._stopping = False
        self._deadlines: list[tuple[float, int, Callable[[], object]]] = []  # a heap
        self._count = itertools.count()
        self.pairs = 0  # spliced pairs open
        self.gave_up = 0  # connections closed for not getting through in time
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Splicer:
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- called on the loop's thread (or before it starts) -----------------------
    def listen(self, sock: socket.socket, on_accept: Callable[[socket.socket], None]) -> None:
        sock.setblocking(False)
        self._sel.register(sock, selectors.EVENT_READ, ("listen", on_accept))

    def watch(self, sock: socket.socket, on_readable: Callable[[], None]) -> None:
        self._sel.register(sock, selectors.EVENT_READ, ("watch", on_readable))

    def forget(self, sock: socket.socket) -> None:
        try:
            self._sel.unregister(sock)
        except (KeyError, ValueError):
            pass

    def later(self, seconds: float, fn: Callable[[], object]) -> None:
        heapq.heappush(self._deadlines, (time.monotonic() + seconds, next(self._count), fn))

    def splice(self, a: socket.socket, b: socket.socket, *, to_b: bytes = b"",
               b_connecting: bool = False, connect_timeout: float | None = None) -> None:
        """Copy ``a``'s bytes to ``b`` and back, ``to_b`` first; ``b`` may
        still be connecting (a non-blocking connect in progress), for at most
        ``connect_timeout`` seconds: then both are closed."""
        ea, eb = _End(a), _End(b, bytearray(to_b), connecting=b_connecting)
        ea.peer, eb.peer = eb, ea
        for end in (ea, eb):
            end.sock.setblocking(False)
            self._update(end)
        self.pairs += 1
        if b_connecting and connect_timeout is not None:
            self.later(connect_timeout, lambda: self._connect_expired(eb, connect_timeout))

    def _connect_expired(self, end: _End, seconds: float) -> None:
        if end.connecting and end.peer is not None:  # (not through, and not closed since)
            self.gave_up += 1
            log.warning("%s: a connection was not through after %g s; closed, so that its "
                        "dialler tries again (%d so far)", self.name, seconds, self.gave_up)
            self._close_pair(end)

    # -- the loop --------------------------------------------------------------
    @staticmethod
    def _interest(end: _End) -> int:
        events = 0
        if (not end.connecting and not end.eof and end.peer is not None
                and len(end.peer.out) < BUFFER):
            events |= selectors.EVENT_READ
        if end.out or end.connecting:
            events |= selectors.EVENT_WRITE
        return events

    def _update(self, end: _End) -> None:
        events = self._interest(end)
        if events == end.events:
            return
        if not end.events:
            self._sel.register(end.sock, events, ("end", end))
        elif not events:
            self._sel.unregister(end.sock)
        else:
            self._sel.modify(end.sock, events, ("end", end))
        end.events = events

    def _close_pair(self, end: _End) -> None:
        peer = end.peer
        for e in (end, peer):
            if e is not None and e.events:
                self._sel.unregister(e.sock)
                e.events = 0
            if e is not None:
                e.sock.close()
                e.peer = None
        self.pairs -= 1

    def _on_end(self, end: _End, events: int) -> None:
        peer = end.peer
        if peer is None:
            return
        try:
            if events & selectors.EVENT_WRITE:
                if end.connecting:
                    err = end.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                    if err:
                        raise OSError(err, os.strerror(err))
                    end.connecting = False
                if end.out:
                    sent = end.sock.send(end.out)
                    del end.out[:sent]
            if events & selectors.EVENT_READ and not end.connecting and not end.eof:
                data = end.sock.recv(min(_READ, BUFFER - len(peer.out)) or 1)
                if data:
                    peer.out += data
                else:
                    end.eof = True
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self._close_pair(end)
            return
        if (end.eof and not peer.out) or (peer.eof and not end.out):
            self._close_pair(end)  # one side is done, and all it sent is through
            return
        self._update(end)
        self._update(peer)

    def run(self, done: Callable[[], bool] = lambda: False) -> None:
        """Serve on this thread until ``stop()`` or ``done()`` (asked once a second)."""
        self._run(done)

    def close(self) -> None:
        """Close every socket of the splicer (its loop's last act; or, for a
        splicer that runs in another process, this process's copies)."""
        for key in list(self._sel.get_map().values()):
            key.fileobj.close()
        self._sel.close()
        self._wake_w.close()

    def _run(self, done: Callable[[], bool] = lambda: False) -> None:
        last = time.monotonic()
        stalled = False
        try:
            while not self._stopping:
                if time.monotonic() - last >= 1.0:
                    last = time.monotonic()
                    if done():
                        break
                timeout = 1.0
                if self._deadlines:
                    timeout = min(1.0, max(0.0, self._deadlines[0][0] - time.monotonic()))
                selected = self._sel.select(timeout)
                polled = time.monotonic()
                for key, events in selected:
                    kind, what = key.data
                    if kind == "end":
                        self._on_end(what, events)
                    elif kind == "listen":
                        self._accept(key.fileobj, what)
                    elif kind == "watch":
                        what()
                    else:  # "wake"
                        try:
                            self._wake_r.recv(64)
                        except OSError:
                            pass
                now = time.monotonic()
                # paused since the select (as the agents' loop, transport/io.py STALL_S):
                # select again first, so that a HELLO that came meanwhile counts
                stalled = not stalled and now - polled > STALL_S
                if stalled:
                    continue
                for _ in range(len(self._deadlines)):
                    if self._deadlines[0][0] > now:
                        break
                    heapq.heappop(self._deadlines)[2]()
        except Exception:  # a bug here must not pass silently
            log.exception("%s: the relay's loop failed", self.name)
        finally:
            self.close()

    def _accept(self, listener: socket.socket, on_accept: Callable[[socket.socket], None]
                ) -> None:
        for _ in range(64):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of fds: try again on the next wake
                log.warning("%s: cannot accept a connection: %s", self.name, e)
                return
            conn.setblocking(False)
            on_accept(conn)


def _fork_relay(relay: EngineRelay) -> int:
    """Run ``relay`` in a child process that exits when this one does (at
    once on Linux, ``PR_SET_PDEATHSIG``; within a second elsewhere); this
    process keeps none of its sockets. Returns the child's pid."""
    parent = os.getpid()
    pid = os.fork()
    if pid:
        relay.detach()
        return pid
    code = 0
    try:  # the child: nothing but the relay, until its parent is gone
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, 15)  # PR_SET_PDEATHSIG, SIGTERM
        except (OSError, AttributeError):
            pass
        if os.getppid() == parent:
            relay.run_here(parent)
    except BaseException:  # noqa: BLE001 - a child must never return into the engine
        log.exception("engine relay: failed")
        code = 1
    finally:
        os._exit(code)


def _tcp_options(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)


class ControllerRelay:
    """The driver's end: one TCP port, spliced to the controller's Unix
    sockets ``<sockets>:<port>`` after a valid HELLO. ``key_of()`` gives
    ipyparallel's session key (read once the controller has written it).

    With a ``report`` path, the refusals are written there too (JSON, mode
    0600, replaced whole, at most every ``REPORT_DELAY`` s): the cluster,
    in the kernel, reads it to say why an engine of another host is not
    getting through (:func:`read_report`)."""

    def __init__(self, host: str, sockets: str, key_of: Callable[[], bytes | None],
                 report: str | None = None) -> None:
        self.sockets, self._key_of = sockets, key_of
        self._token: bytes | None = None
        self._waiting: dict[socket.socket, bytearray] = {}
        self._dialing: set[socket.socket] = set()  # waiting for a full backlog to drain
        self._report, self._report_due = report, False
        self.last_refusal: dict[str, object] | None = None  # {"peer", "why", "at"}
        self.refused = 0
        self.redials = 0  # connects a full backlog refused, tried again
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, 0), family=family, backlog=128)
        self.address = self._listener.getsockname()[:2]
        self._splicer = Splicer("nbrpc-controller-relay")
        self._splicer.listen(self._listener, self._on_accept)

    def start(self) -> ControllerRelay:
        self._splicer.start()
        return self

    def stop(self) -> None:
        self._splicer.stop()
        for conn in list(self._dialing):  # (not the splicer's yet)
            conn.close()
        self._dialing.clear()

    @property
    def pairs(self) -> int:
        return self._splicer.pairs

    def _refuse(self, conn: socket.socket, why: str) -> None:
        """Close ``conn``, counted; logged at the 1st, 2nd, 4th, 8th... refusal."""
        self._waiting.pop(conn, None)
        self._splicer.forget(conn)
        self.refused += 1
        try:
            peer = "{}:{}".format(*conn.getpeername()[:2])
        except OSError:
            peer = "?"
        self.last_refusal = {"peer": peer, "why": why, "at": time.time()}
        if self.refused & (self.refused - 1) == 0:
            log.warning("controller relay: refused a connection from %s: %s (%d refused so "
                        "far)", peer, why, self.refused)
        conn.close()
        if self._report is not None and not self._report_due:
            self._report_due = True
            self._splicer.later(REPORT_DELAY, self._write_report)

    def _write_report(self) -> None:
        self._report_due = False
        report = {"refused": self.refused, **(self.last_refusal or {})}
        tmp = f"{self._report}.tmp"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(report, f)
            os.replace(tmp, self._report)
        except OSError as e:
            log.debug("controller relay: could not write %s: %s", self._report, e)

    def _on_accept(self, conn: socket.socket) -> None:
        if len(self._waiting) >= MAX_WAITING:
            self._refuse(conn, f"{MAX_WAITING} connections already wait for their HELLO")
            return
        _tcp_options(conn)
        self._waiting[conn] = bytearray()
        self._splicer.watch(conn, lambda: self._on_hello_bytes(conn))
        self._splicer.later(HELLO_TIMEOUT, lambda: conn in self._waiting and self._refuse(
            conn, f"no HELLO within {HELLO_TIMEOUT:g} s"))

    def _on_hello_bytes(self, conn: socket.socket) -> None:
        got = self._waiting.get(conn)
        if got is None:
            return
        try:
            data = conn.recv(HELLO_LEN - len(got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._waiting.pop(conn, None)
            self._splicer.forget(conn)
            conn.close()
            return
        got += data
        if len(got) < HELLO_LEN:
            return
        del self._waiting[conn]
        self._splicer.forget(conn)
        if self._token is None:
            key = self._key_of()
            self._token = relay_token(key) if key else None
        if self._token is None or not hmac.compare_digest(bytes(got[:TOKEN_LEN]), self._token):
            self._refuse(conn, "not the cluster's key")
            return
        port = int.from_bytes(got[TOKEN_LEN:], "big")
        self._dial(conn, f"{self.sockets}:{port}", time.monotonic() + DIAL_TIMEOUT)

    def _dial(self, conn: socket.socket, path: str, deadline: float) -> None:
        """Splice ``conn`` to the controller's channel at ``path``. A Unix
        socket whose listen backlog is full refuses a non-blocking connect
        with EAGAIN (a burst of an engine's channels, the controller busy):
        try again every ``DIAL_RETRY`` s until ``deadline``, off the loop's
        back. Until then ``conn`` is not read (its bytes wait in the kernel)."""
        target = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target.setblocking(False)
        self._dialing.discard(conn)
        try:
            target.connect(path)  # a Unix socket connects at once, or not at all
        except BlockingIOError:
            target.close()
            if time.monotonic() < deadline:
                self.redials += 1
                self._dialing.add(conn)
                self._splicer.later(DIAL_RETRY, lambda: self._dial(conn, path, deadline))
                return
            log.warning("controller relay: the controller's channel at %s accepted nothing "
                        "for %g s (its listen backlog stays full)", path, DIAL_TIMEOUT)
            conn.close()
            return
        except OSError as e:
            target.close()
            log.warning("controller relay: no controller channel at %s: %s", path, e)
            conn.close()
            return
        self._splicer.splice(conn, target)


def read_report(path: str) -> str | None:
    """What the relay's refusals report at ``path`` says, in words; None
    before any refusal (no file) or where it cannot be read.

    >>> import tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "report")
    >>> read_report(path) is None
    True
    >>> with open(path, "w") as f:
    ...     json.dump({"refused": 3, "peer": "10.0.0.2:40112", "why": "not the cluster's key",
    ...                "at": 0}, f)
    >>> read_report(path)
    "the controller's relay refused 3 connections (the last from 10.0.0.2:40112: not the cluster's key)"
    """
    try:
        with open(path) as f:
            report = json.load(f)
        n = int(report["refused"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    last = f" (the last from {report.get('peer', '?')}: {report.get('why', '?')})"
    return f"the controller's relay refused {n} connection{'' if n == 1 else 's'}{last}"


class EngineRelay:
    """The engine's end: a Unix socket per controller port in ``directory``
    (``<directory>/c:<port>``), each connection to it dialled on to the
    driver's relay at ``address`` with the HELLO first."""

    def __init__(self, address: tuple[str, int], token: bytes, ports: list[int],
                 directory: str) -> None:
        self.address, self._token = address, token
        self.interface = f"ipc://{directory}/c"
        self._splicer = Splicer("nbrpc-engine-relay")
        for port in ports:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(f"{directory}/c:{port}")
            listener.listen(64)
            self._splicer.listen(listener, lambda conn, p=port: self._on_accept(conn, p))

    pid: int | None = None  # the child process it runs in, if forked

    def start(self) -> EngineRelay:
        self._splicer.start()
        return self

    def stop(self) -> None:
        self._splicer.stop()

    def run_here(self, parent: int) -> None:
        """Run on this thread until process ``parent`` is no longer our parent."""
        self._splicer.run(lambda: os.getppid() != parent)

    def detach(self) -> None:
        """Close this process's copies of the relay's sockets (a child runs it)."""
        self._splicer.close()

    def _on_accept(self, conn: socket.socket, port: int) -> None:
        try:
            out = socket.socket(socket.AF_INET6 if ":" in self.address[0] else socket.AF_INET,
                                socket.SOCK_STREAM)
        except OSError as e:
            log.warning("engine relay: %s", e)
            conn.close()
            return
        _tcp_options(out)
        out.setblocking(False)
        err = out.connect_ex(self.address)
        if err not in (0, errno.EINPROGRESS):
            log.warning("engine relay: cannot reach the driver's relay at %s:%s: %s",
                        *self.address, os.strerror(err))
            out.close()
            conn.close()
            return
        self._splicer.splice(conn, out, to_b=hello(self._token, port),
                             b_connecting=err == errno.EINPROGRESS,
                             connect_timeout=CONNECT_TIMEOUT)


# -- the engine's side, from its environment -------------------------------------
RELAY_ENV = "NBRPC_CONTROLLER_RELAY"  # host:port of the driver's relay, for engines
ENGINE = "-m ipyparallel.engine"
RELAYED_ENGINE = "-m nbrpc.cluster.relay_engine"  # the relay, then the engine


def relayed_engine_cmd(cmd: list[str]) -> list[str]:
    """``cmd`` with ipyparallel's engine module swapped for
    :mod:`.relay_engine`, which starts the engine's relay and then runs the
    engine (as items, or inside a shell command's text).

    >>> relayed_engine_cmd(["python3", "-m", "ipyparallel.engine"])
    ['python3', '-m', 'nbrpc.cluster.relay_engine']
    >>> relayed_engine_cmd(["sh", "-c", 'exec "$0" -m ipyparallel.engine "$@"', "python3"])[2]
    'exec "$0" -m nbrpc.cluster.relay_engine "$@"'
    """
    out, swapped = list(cmd), False
    for i in range(len(out) - 1):
        if out[i:i + 2] == ENGINE.split():
            out[i + 1], swapped = RELAYED_ENGINE.split()[1], True
    for i, item in enumerate(out):
        if ENGINE in item and item != ENGINE:
            out[i], swapped = item.replace(ENGINE, RELAYED_ENGINE), True
    if not swapped:
        raise ValueError(
            f"engine_cmd must run ipyparallel's engine as '{ENGINE}' (nbrpc puts its relay "
            f"to the controller in that place): got {cmd}")
    return out


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) -> (host, port).

    >>> parse_address("10.0.0.5:4000"), parse_address("[::1]:4000")
    (('10.0.0.5', 4000), ('::1', 4000))
    """
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"${RELAY_ENV} must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def start_engine_relay(environ: dict[str, str] | os._Environ = os.environ,
                       directory: str | None = None, fork: bool = True
                       ) -> EngineRelay | None:
    """Where ``$NBRPC_CONTROLLER_RELAY`` names the driver's relay: listen for
    this engine's channels in a private directory, and point
    ``$IPP_CONNECTION_INFO`` there (before ipyparallel's engine reads it).
    None (nothing done) without it.

    With ``fork`` (what an engine does) the relay runs in a child process of
    its own, which exits with this one: an engine busy in a C call that holds
    its GIL still answers ipyparallel's heartbeats (its heart is a libzmq
    device that runs without the GIL), so its relay must not need that GIL.
    Without it, in a thread of this process (tests)."""
    where = environ.get(RELAY_ENV)
    if not where:
        return None
    info = json.loads(environ["IPP_CONNECTION_INFO"])
    if directory is None:
        from ..transport import local

        directory = local.make_dir()  # (0700; swept once this process is gone)
    relay = EngineRelay(parse_address(where), relay_token(relay_secret(info)),
                        channel_ports(info), directory)
    info["interface"] = relay.interface
    environ["IPP_CONNECTION_INFO"] = json.dumps(info)
    if fork:
        relay.pid = _fork_relay(relay)
    else:
        relay.start()
    log.info("ipyparallel's controller reached through the relay at %s", where)
    return relay

