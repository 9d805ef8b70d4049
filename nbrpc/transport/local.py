"""Which peers share this host, and a private directory for socket files.

Every agent binds its ROUTER on TCP (its address in the member table) and, on
Linux, also listens on a plain Unix domain socket (:mod:`.unix`) in a fresh
private directory (``mkdtemp``: mode 0700, so no other user can even reach
the socket file). It publishes that endpoint (``unix://PATH``) with its
*host identity*: the boot id and the network and mount namespaces of its
process, and its effective uid. A peer with the same identity sees the same
file system and kernel and may open the same files, so it connects there
instead of over loopback TCP, and takes large buffers through shared memory
(:mod:`.shm`). Without a Unix socket (``local_ipc=False``, ``encrypt=True``)
the identity is published alone (``IDENTITY@``), for shared memory. What differs from TCP is
only the path: the connection is authenticated before anything is read, and
every message is signed, as over TCP. (With ``encrypt=True`` every connection
uses zmq's CURVE over TCP instead.)

The directory is removed when the loop closes; directories left by processes
that died (``nbrpc-ipc-PID-*`` of this user, PID gone) are swept when the next
one is made.

>>> local_endpoint(host_identity() + "@unix:///tmp/x/s")
'unix:///tmp/x/s'
>>> local_endpoint("elsewhere@unix:///tmp/x/s") is None
True
>>> same_identity(host_identity() + "@"), local_endpoint(host_identity() + "@")
(True, None)
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from functools import lru_cache

log = logging.getLogger(__name__)

PREFIX = "nbrpc-ipc-"
SWEEP_MAX = 20_000  # directory entries looked at per sweep (by name; few are stat-ed)


def boot_id() -> str:
    """This machine's boot (Linux's ``boot_id``): equal in every process of
    one running kernel, whatever their namespaces. Raises OSError off Linux."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


@lru_cache(maxsize=1)
def _identity(pid: int, euid: int) -> str:
    parts = []
    try:
        parts.append(boot_id())
        for ns in ("net", "mnt"):
            parts.append(str(os.stat(f"/proc/self/ns/{ns}").st_ino))
    except OSError:  # not Linux, or no /proc: never assume a shared host
        return f"unknown-{pid}-{id(parts)}"
    return ":".join([*parts, str(euid)])


def host_identity() -> str:
    """Equal in two processes when a ``unix://`` path means the same socket to
    both and both may use it, as they may use each other's shared-memory
    segments: the same boot, network and mount namespaces, and the same
    effective user (another user's 0700 directories and 0600 segments are out
    of reach, so peers of two users who share a key talk over TCP)."""
    return _identity(os.getpid(), os.geteuid())


def same_identity(published: str | None) -> bool:
    """Did a peer that published ``published`` (``IDENTITY@ENDPOINT``) run on
    this host as this user?"""
    return bool(published) and published.partition("@")[0] == host_identity()


def local_endpoint(published: str | None) -> str | None:
    """The ``unix://`` endpoint a peer published, if it is usable from here."""
    if not same_identity(published):
        return None
    endpoint = published.partition("@")[2]
    return endpoint if endpoint.startswith("unix://") else None


def make_dir() -> str:
    """A fresh private directory for this process's socket files."""
    sweep()
    return tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")


def remove_dir(path: str | None) -> None:
    if path:
        shutil.rmtree(path, ignore_errors=True)


def sweep(root: str | None = None) -> int:
    """Remove this user's socket directories whose process is gone, in ``root``
    (the temporary directory by default); how many."""
    root, uid, removed = root or tempfile.gettempdir(), os.getuid(), 0
    try:
        entries = os.scandir(root)
    except OSError:
        return 0
    with entries:
        for i, entry in enumerate(entries):
            if i >= SWEEP_MAX:
                break
            if not entry.name.startswith(PREFIX):
                continue
            pid = entry.name[len(PREFIX):].partition("-")[0]
            try:
                if not pid.isdigit() or entry.stat(follow_symlinks=False).st_uid != uid:
                    continue
                os.kill(int(pid), 0)  # (signal 0: only asks whether it exists)
            except ProcessLookupError:
                shutil.rmtree(entry.path, ignore_errors=True)
                removed += 1
            except OSError:  # alive but not ours to signal, or vanished meanwhile
                continue
    if removed:
        log.debug("removed %d socket directories of exited processes", removed)
    return removed
