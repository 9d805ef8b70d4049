"""Where the group meets: ``env://``, ``tcp://host:port`` and ``file:///path``.

The coordinator (rank 0) binds its agent's socket at the rendezvous address
(env, tcp) or at a free port that it writes, with the group key, into the
rendezvous file (file). Everyone else joins it there.

The group key signs every message. It comes from ``NBRPC_SECRET_KEY`` when
set (any string; use the same on every worker); for ``file://`` rank 0
generates one and writes it into the file (mode 0600); otherwise it is
derived from the rendezvous address, which keeps separate groups apart but
is no secret: set ``NBRPC_SECRET_KEY`` on networks you do not trust.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import os
import socket
import time
from dataclasses import dataclass
from urllib.parse import urlparse

from ..errors import RendezvousError
from ..transport import new_key

KEY_ENV = "NBRPC_SECRET_KEY"
HOST_ENV = "NBRPC_HOST"  # interface to bind on non-coordinators (multi-host)


@dataclass
class Rendezvous:
    coordinator: str | None  # tcp://host:port of rank 0 (None: we are rank 0, file mode)
    bind_host: str
    bind_port: int  # 0: any free port
    key: bytes
    file: str | None = None


def parse(init_method: str, rank: int) -> Rendezvous:
    """Resolve an init_method for ``rank``.

    >>> import os; os.environ.update(MASTER_ADDR="localhost", MASTER_PORT="29512")
    >>> r = parse("env://", 0); (r.bind_host, r.bind_port)
    ('127.0.0.1', 29512)
    """
    url = urlparse(init_method)
    if url.scheme == "env":
        addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if not addr or not port:
            raise RendezvousError(
                "init_method='env://' needs MASTER_ADDR and MASTER_PORT in the environment, "
                "e.g. os.environ.update(MASTER_ADDR='localhost', MASTER_PORT='29500').")
        return _tcp(addr, _port(port), rank)
    if url.scheme == "tcp":
        if not url.hostname or not url.port:
            raise RendezvousError(f"init_method {init_method!r} needs a host and a port: tcp://HOST:PORT")
        return _tcp(url.hostname, url.port, rank)
    if url.scheme == "file":
        path = url.path
        if not path:
            raise RendezvousError(f"init_method {init_method!r} needs a path: file:///tmp/somefile")
        host = os.environ.get(HOST_ENV, "127.0.0.1")
        return Rendezvous(None, host, 0, b"", file=path)
    raise RendezvousError(
        f"unsupported init_method {init_method!r}; use env://, tcp://HOST:PORT or file:///PATH")


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise RendezvousError(f"MASTER_PORT must be a number, got {text!r}") from None
    if not 0 < port < 65536:
        raise RendezvousError(f"port {port} is outside 1..65535")
    return port


def _tcp(host: str, port: int, rank: int) -> Rendezvous:
    try:
        ip = socket.gethostbyname(host)
    except OSError as e:
        raise RendezvousError(f"cannot resolve the rendezvous host {host!r}: {e}") from e
    key = _env_key() or hashlib.sha256(f"nbrpc-group:{ip}:{port}".encode()).digest()
    if rank == 0:
        return Rendezvous(None, ip, port, key)
    return Rendezvous(f"tcp://{ip}:{port}", _local_ip_towards(ip), 0, key)


def _env_key() -> bytes | None:
    text = os.environ.get(KEY_ENV)
    return hashlib.sha256(text.encode()).digest() if text else None


def _local_ip_towards(ip: str) -> str:
    """The address of this host's interface that routes to ``ip`` (no packet sent)."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    if ipaddress.ip_address(ip).is_loopback:
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((ip, 9))
            return s.getsockname()[0]
        except OSError:
            return "0.0.0.0"


# -- file:// ----------------------------------------------------------------------
def publish(path: str, address: str, key: bytes) -> None:
    """Rank 0 writes its address and the group key, atomically, readable by its user only."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"address": address, "key": key.hex()}, f)
    os.replace(tmp, path)


def file_key() -> bytes:
    return _env_key() or new_key()


def lookup(path: str, timeout: float) -> tuple[str, bytes]:
    """Wait (bounded) for rank 0 to publish; returns (address, key)."""
    deadline = time.monotonic() + (timeout if timeout > 0 else 60.0)
    while True:
        try:
            with open(path) as f:
                data = json.load(f)
            return data["address"], bytes.fromhex(data["key"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"rank 0 did not publish its address in {path} within {timeout:g} s. "
                "Start rank 0 with the same init_method; if a previous run left the "
                "file behind, delete it.")
        time.sleep(0.02)
