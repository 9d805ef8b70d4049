"""Where the group meets: ``env://``, ``tcp://host:port`` and ``file:///path``.

The coordinator (rank 0) binds its agent's socket at the rendezvous address
(env, tcp) or at a free port that it writes, with the group key, into the
rendezvous file (file). Everyone else joins it there.

For ``file:///PATH`` that file is ``PATH.nbrpc``, beside ``PATH`` and not in
it: programs (PyTorch's tests among them) give ``init_process_group`` the
same ``file://`` URL, and c10d's ``FileStore`` owns ``PATH`` and its format.

The group key signs every message, and a message signed with it is
unpickled, so whoever can compute it can run code on every rank. It is
therefore always a secret:

==================  ==========================================================
init_method         group key
==================  ==========================================================
any, with           ``sha256(NBRPC_SECRET_KEY)`` (any string; the same on every
NBRPC_SECRET_KEY    host; a short or repetitive one is accepted with a warning)
env://, tcp://      ``HMAC-SHA256(user secret, "nbrpc-group:IP:PORT")``: the
                    user secret is the key file below, so that separate groups
                    on one host stay apart and nobody else can compute it
file://             32 random bytes that rank 0 draws per run and writes, with
                    its address, into the rendezvous file (mode 0600)
==================  ==========================================================

The user secret is 32 random bytes (64 hex digits) in a key file that is
created on first use, readable by its owner only, as Jupyter and ipyparallel
keep theirs: ``$NBRPC_KEY_FILE`` if set (it must exist), else
``~/.local/share/nbrpc/secret.key``; the ``nbrpc`` directory is 0700. Ranks
on one host share it by construction. (Not ``$XDG_RUNTIME_DIR``: it differs
between login sessions and is emptied at logout, so a rank started over ssh
and one in the desktop's notebook would hold different keys.) A rank that joins a coordinator
on another host cannot: it refuses to start until ``NBRPC_SECRET_KEY`` (the
same on every host) or ``NBRPC_KEY_FILE`` (a copy of rank 0's key file) is
set. Rank 0 cannot tell, and uses its key file.

Files that carry keys are trusted only when they are ours: each is opened
with ``O_NOFOLLOW`` and its opened descriptor must belong to our uid and give
no access to group or others; otherwise :class:`RendezvousError` says what is
wrong and how to fix it. The rendezvous file is written under an
unpredictable temporary name (``mkstemp``: ``O_EXCL``, mode 0600) and renamed
into place, never over a file that someone else owns.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import json
import logging
import os
import pwd
import secrets
import socket
import stat
import tempfile
import time
import warnings
from dataclasses import dataclass
from urllib.parse import urlparse

from ..errors import RendezvousError
from ..transport import new_key

log = logging.getLogger(__name__)

RECORD_SUFFIX = ".nbrpc"  # file:///PATH: rank 0 publishes in PATH.nbrpc
KEY_ENV = "NBRPC_SECRET_KEY"
KEY_FILE_ENV = "NBRPC_KEY_FILE"
HOST_ENV = "NBRPC_HOST"  # interface to bind on non-coordinators (multi-host)
MIN_KEY_CHARS, MIN_DISTINCT_CHARS = 16, 6  # below either: a weak NBRPC_SECRET_KEY
_NEW_KEY_ADVICE = 'python -c "import secrets; print(secrets.token_hex(32))"'


@dataclass
class Rendezvous:
    """What ``parse`` resolved: where to bind, whom to join, and the group key."""

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
    >>> parse("file:///tmp/rdv", 1).file  # beside c10d's FileStore, never in it
    '/tmp/rdv.nbrpc'
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
        return Rendezvous(None, host, 0, b"", file=path + RECORD_SUFFIX)
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
    if rank != 0 and not _is_this_host(ip) and not (
            os.environ.get(KEY_ENV) or os.environ.get(KEY_FILE_ENV)):
        raise RendezvousError(
            f"rank {rank} joins a coordinator on another host ({host} = {ip}), and the "
            "per-user key file that signs same-host groups is not shared between hosts. "
            f"Set {KEY_ENV} to the same secret on every host (make one with "
            f"{_NEW_KEY_ADVICE}), or point {KEY_FILE_ENV} at a copy of rank 0's key file "
            f"({user_key_path()} on that host, if its user and environment match this one).")
    key = group_key(ip, port)
    if rank == 0:
        return Rendezvous(None, ip, port, key)
    return Rendezvous(f"tcp://{ip}:{port}", _local_ip_towards(ip), 0, key)


def group_key(ip: str, port: int) -> bytes:
    """The key of the env:// or tcp:// group that meets at ``ip:port``:
    ``NBRPC_SECRET_KEY``'s if set, else derived from the user secret."""
    return _env_key() or hmac.digest(user_secret(), f"nbrpc-group:{ip}:{port}".encode(),
                                     "sha256")


def _env_key() -> bytes | None:
    text = os.environ.get(KEY_ENV)
    if not text:
        return None
    if len(text) < MIN_KEY_CHARS or len(set(text)) < MIN_DISTINCT_CHARS:
        warnings.warn(
            f"{KEY_ENV} is weak ({len(text)} characters, {len(set(text))} distinct): anyone "
            "who guesses it can run code on every rank. Use a long random one, e.g. "
            f"{_NEW_KEY_ADVICE}", UserWarning, stacklevel=2)
    return hashlib.sha256(text.encode()).digest()


def _is_this_host(ip: str) -> bool:
    """Whether ``ip`` is loopback or one of this host's own addresses (binding a
    UDP socket to it, port 0, succeeds only then; nothing is sent)."""
    if ipaddress.ip_address(ip).is_loopback:
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((ip, 0))
        except OSError:
            return False
    return True


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


# -- the per-user secret -------------------------------------------------------------
def user_key_path() -> str:
    """Where this user's secret lives (see the module docstring)."""
    if os.environ.get(KEY_FILE_ENV):
        return os.path.abspath(os.path.expanduser(os.environ[KEY_FILE_ENV]))
    return os.path.join(os.path.expanduser("~"), ".local", "share", "nbrpc", "secret.key")


def user_secret() -> bytes:
    """This user's secret, created (64 hex digits, mode 0600, in a 0700
    directory) on first use. Several ranks starting at once agree on one: each
    writes a private temporary file and hard-links it into place, and whoever
    loses the race reads the winner's."""
    path = user_key_path()
    directory = os.path.dirname(path)
    chosen = bool(os.environ.get(KEY_FILE_ENV))  # the user's own place: only the file is checked
    if not chosen:
        _private_directory(directory)
    try:
        return _read_key_file(path)
    except FileNotFoundError:
        if chosen:
            raise RendezvousError(
                f"{KEY_FILE_ENV}={os.environ[KEY_FILE_ENV]} does not exist. Copy rank 0's key "
                f"file there (mode 0600), write a key into it ({_NEW_KEY_ADVICE}), or unset "
                f"{KEY_FILE_ENV}.") from None
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".secret.key.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        try:
            os.link(tmp, path)
            log.info("nbrpc: created the per-user key file %s", path)
        except FileExistsError:
            pass  # another rank was first: use its key
        except OSError as e:
            raise RendezvousError(
                f"cannot create the key file {path}: {e}. Set {KEY_ENV} instead "
                f"(e.g. {_NEW_KEY_ADVICE}).") from e
    finally:
        os.unlink(tmp)
    return _read_key_file(path)


def _read_key_file(path: str) -> bytes:
    with _open_private(path, "key file") as f:
        text = f.read().strip()
    if len(text) < 32:
        raise RendezvousError(
            f"the key file {path} holds {len(text)} characters; it should hold a long random "
            f"key such as 64 hex digits: {_NEW_KEY_ADVICE} > {path}")
    return text.encode()


def _private_directory(directory: str) -> None:
    """Create ``directory`` 0700, or check that the existing one is ours and private."""
    try:
        os.makedirs(directory, mode=0o700)
        os.chmod(directory, 0o700)  # (in spite of the umask)
        return
    except FileExistsError:
        pass
    except OSError as e:
        raise RendezvousError(f"cannot create the directory {directory} for the nbrpc key "
                              f"file: {e}. Set {KEY_ENV} instead.") from e
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise RendezvousError(f"{directory} (where nbrpc keeps its key file) is not a "
                              "directory (a symbolic link is refused): remove it.")
    if st.st_uid != os.geteuid():
        raise RendezvousError(
            f"{directory} (where nbrpc keeps its key file) is owned by {_who(st.st_uid)}, "
            f"not you ({_who(os.geteuid())}): someone else may read or plant the key. "
            f"Remove it, or set {KEY_FILE_ENV} or {KEY_ENV}.")
    if st.st_mode & 0o077:
        raise RendezvousError(
            f"{directory} (where nbrpc keeps its key file) is open to group or others "
            f"(mode {stat.S_IMODE(st.st_mode):04o}): run chmod 700 {directory}")


# -- files that carry keys -------------------------------------------------------
def _open_private(path: str, what: str):  # noqa: ANN202 - a text file object
    """Open ``path`` for reading if it is a regular file of ours that group and
    others cannot access; checked on the opened descriptor, so that nothing
    can be swapped in between. FileNotFoundError passes through."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RendezvousError(
                f"the nbrpc {what} {path} is a symbolic link, which nbrpc refuses to follow "
                "(someone may have planted it to make you read their file). Remove the "
                "link and put the file itself there.") from None
        if isinstance(e, FileNotFoundError):
            raise
        raise RendezvousError(f"cannot open the nbrpc {what} {path}: {e}") from e
    try:
        st = os.fstat(fd)
        problem = None
        if not stat.S_ISREG(st.st_mode):
            problem = "is not a regular file. Remove it"
        elif st.st_uid != os.geteuid():
            problem = (f"is owned by {_who(st.st_uid)}, not you ({_who(os.geteuid())}): "
                       "someone else may have written it to make you join them. Remove it "
                       "(or use a path in a directory that only you can write)")
        elif st.st_mode & 0o077:
            problem = (f"is open to group or others (mode {stat.S_IMODE(st.st_mode):04o}). "
                       f"Run chmod 600 {path}")
        if problem:
            raise RendezvousError(f"nbrpc refuses the {what} {path}: it {problem}.")
        return os.fdopen(fd, "r")
    except BaseException:
        os.close(fd)
        raise


def _who(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


# -- file:// ----------------------------------------------------------------------
def publish(path: str, address: str, key: bytes) -> None:
    """Rank 0 writes its address and the group key, atomically, readable by its
    user only: into a fresh file under an unpredictable name, renamed over
    ``path`` only if nothing of someone else's is there."""
    _write_record(path, {"address": address, "key": key.hex()})


def mark_static(path: str) -> None:
    """Rank 0 of a static group (a ``world_size``), once everyone has joined:
    the record keeps no address (a re-init must not find this group) but says
    that a static group runs here, and in which process, so that a dynamic
    joiner given the same file gets PyTorch's error instead of waiting (see
    :func:`lookup`). Removed at ``shutdown()``, as a dynamic group's record."""
    _write_record(path, {"static": True, "host": socket.gethostname(), "pid": os.getpid()})


def _write_record(path: str, record: dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.",
                                   suffix=".tmp")
    except OSError as e:
        raise RendezvousError(f"cannot write the rendezvous file in {directory}: {e}") from e
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f)
        try:
            owner = os.lstat(path).st_uid
        except FileNotFoundError:
            owner = os.geteuid()
        if owner != os.geteuid():
            raise _squatted(path, owner)
        try:
            os.replace(tmp, path)
        except PermissionError as e:  # e.g. planted after our check, in a sticky /tmp
            raise _squatted(path, _owner(path)) from e
    except BaseException:
        os.unlink(tmp)
        raise


def _squatted(path: str, owner: int | None) -> RendezvousError:
    return RendezvousError(
        f"the rendezvous file {path} already exists and is owned by "
        f"{_who(owner) if owner is not None else 'someone else'}, not you "
        f"({_who(os.geteuid())}); nbrpc will not publish (or trust) a file that someone "
        "else wrote. Use a path in a directory that only you can write (e.g. under your "
        "home), or remove that file if you know who made it.")


def _owner(path: str) -> int | None:
    try:
        return os.lstat(path).st_uid
    except OSError:
        return None


def withdraw(path: str, address: str) -> None:
    """Rank 0's shutdown: remove its record (its ``address``, or its static
    group's mark), and not one that a newer rank 0 has published there since."""
    try:
        data = _read_record(path)
        ours = (data.get("address") == address if not data.get("static") else
                (data.get("host"), data.get("pid")) == (socket.gethostname(), os.getpid()))
        if ours:
            os.unlink(path)
    except (OSError, RendezvousError, json.JSONDecodeError, AttributeError):
        pass  # gone, or not ours to remove


def _holder_alive(record: dict) -> bool:
    """Whether the process a static group's record names still runs (on
    another host: assumed so, as nothing here can tell)."""
    if record.get("host") == socket.gethostname():
        try:
            os.kill(int(record["pid"]), 0)
        except ProcessLookupError:
            return False
        except (OSError, OverflowError):
            pass  # (someone else's process: it runs)
    return True


def _read_record(path: str) -> dict:
    """The record in the rendezvous file ``path`` (see :func:`_open_private`)."""
    with _open_private(path, "rendezvous file") as f:
        return json.load(f)


def file_key() -> bytes:
    """The key rank 0 of a file:// group signs with: from ``NBRPC_SECRET_KEY``
    if set, else fresh random bytes for this run."""
    return _env_key() or new_key()


def lookup(path: str, timeout: float, dynamic: bool = False) -> tuple[str, bytes]:
    """Wait (bounded) for rank 0 to publish; returns (address, key). A file that
    is not ours and private, or a symbolic link, is refused at once. A static
    group's record (:func:`mark_static`) is no address: a static joiner waits
    on for a new rank 0, a ``dynamic`` one gets PyTorch's error while that
    group's rank 0 runs (a record its process left behind is waited past)."""
    deadline = time.monotonic() + (timeout if timeout > 0 else 60.0)
    while True:
        try:
            data = _read_record(path)
            if not data.get("static"):
                return data["address"], bytes.fromhex(data["key"])
            if dynamic and _holder_alive(data):
                raise RendezvousError(
                    "RPC group mixes statically and dynamically initialized members which "
                    f"is not supported. A static group (init_rpc with a world_size) runs at "
                    f"{path} (its rank 0 is process {data.get('pid')} on {data.get('host')}): "
                    "give this worker that group's rank and world_size, or give the dynamic "
                    "group an init_method of its own.")
        except (FileNotFoundError, json.JSONDecodeError, KeyError, TypeError, ValueError,
                AttributeError):
            pass
        if time.monotonic() > deadline:
            raise RendezvousError(
                f"rank 0 did not publish its address in {path} within {timeout:g} s. "
                "Start rank 0 with the same init_method; if a previous run left the "
                "file behind, delete it.")
        time.sleep(0.02)
