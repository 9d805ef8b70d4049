"""Large buffers between processes on one host, through shared memory.

The sender copies a buffer into a POSIX shared-memory segment and sends its
name in the (signed) header instead of the bytes; the receiver maps the
segment, and its tensor uses that map directly (no second copy).

Creating a segment (sending thread)::

    statvfs(/dev/shm)          refuse early when it would not fit, with headroom
    open(O_CREAT|O_EXCL|O_NOFOLLOW, 0600)
    posix_fallocate(fd, 0, n)  reserves every page now; GIL released;
                               ENOSPC -> unlink, OSError -> the caller sends by socket
    mmap(MAP_SHARED)           O(1): no MAP_POPULATE on a fresh segment
    copy(dst, src)             faults the reserved pages in, GIL released (torch's copy)

Why: ``mmap(MAP_POPULATE)`` allocates and zeroes the pages inside ``mmap()``
with the GIL held: 0.6-3 s for 1 GB here, 6 s for 2 GB (a ticker thread
stalled that long), long enough for a worker sending a large tensor to be
declared dead. And a segment that was only ``ftruncate``d is sparse: when /dev/shm is
smaller than the tensor (Docker's default is 64 MB) the copy touches a page
tmpfs cannot supply and the process dies of SIGBUS. ``posix_fallocate``
fixes both: it runs without the GIL (0.24 s for 1 GB) and on tmpfs it
reserves the pages up front, failing with ENOSPC instead of a later SIGBUS.
Every write goes into pages reserved this way (a recycled segment is
extended by ``posix_fallocate`` too when it is reused for a larger buffer),
so a write cannot fault for lack of space.

Fresh memory is what costs: reserving and zeroing pages takes longer than
copying into them. So segments are recycled: when the receiver's tensor is
freed, its map is closed and the receiver renames the segment to
``<name>.free``; the sender reclaims a free segment of the right size class
(rename back, an atomic claim) before it makes a new one. Pages stay
allocated in between, so a reused segment costs only the copy. The sender
owns every segment it made and unlinks them all when its transport stops;
segments it stops tracking (past ``MAX_TRACKED_BYTES``) are unlinked at
once, which leaves any map a receiver still holds valid.

MAP_POPULATE, measured (2 cores, torch copy, median of 7, ms; "fresh"
includes the fallocate)::

    size     fresh: populate / lazy    reused: populate / lazy    reader map+sum: populate / lazy
    4 MB            2.9 / 1.9                  0.6 / 1.0                  0.3+0.0 / 0.0+0.1
    64 MB          45.6 / 28.9                 9.7 / 16.6                 4.8+1.2 / 0.0+3.0
    256 MB        181  / 111                  41  / 65                   20 +5.6 / 0.0+13
    1 GB                                                                 78 +25  / 0.0+53

So only a *reused* segment up to ``POPULATE_MAX`` (64 MB: at most ~5 ms
with the GIL held) is mapped with MAP_POPULATE; a fresh one never is (its
pages are zeroed on first touch either way, and faulting them in the copy
is cheaper), and the reader never populates: mapping is then O(1) on its
I/O thread, and read faults (with fault-around) cost less in whoever
touches the tensor than populating up front.

The reader trusts a segment only if its name matches the pattern, it is a
regular file opened with O_NOFOLLOW, it is at least as large as the signed
header says, and its owner is this process's effective uid or root. Peers
of one group normally run as one user; root can read and write any user's
memory anyway, so trusting root's segments exposes nothing, while a
segment owned by any other uid was made (and could be rewritten) by
someone outside the group, so it is refused.

A killed process leaves its segments behind; :func:`sweep_orphans` unlinks
those whose creator (the pid in the name) is gone or a zombie (a killed
child not yet reaped still answers ``kill(pid, 0)``). With 200 entries in
/dev/shm it takes 0.2 ms (0.6 ms when it removes 50 of them), so the agent
calls it, on its I/O thread, whenever a member dies. (Unlinking is what
frees a segment's pages: 0.3 s for an unmapped 2 GB one, with the GIL
released.)

Measured on 2 cores (torch's copy): a 2 GB tensor sent to a worker process
and returned took 0.9 s a round once segments are recycled (4-7 s for the
first round, which touches 2 x 2 GB of fresh pages, slow in this VM), while
the longest either process's threads waited for the GIL fell from 6 s to
0.03 s.
"""

from __future__ import annotations

import errno
import itertools
import logging
import mmap
import os
import re
import stat
import threading
import weakref
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
MIN_BYTES = 2 << 20  # measured crossover: sockets win at 1 MB, shared memory from ~4 MB
MAX_TRACKED_BYTES = 1 << 30  # segments a sender keeps for reuse, in bytes
POPULATE_MAX = 64 << 20  # largest reused segment mapped with MAP_POPULATE (GIL held)
HEADROOM = 16  # a new segment must leave 1/HEADROOM of /dev/shm free for others
COPY_SLICE = 16 << 20  # plain_copy's slice: the GIL is offered between slices
FIX = "mount a larger /dev/shm, e.g. docker run --shm-size=4g"
_NAME = re.compile(r"^nbrpc-[0-9]+-[0-9a-f]+-[0-9]+$")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
FREE = ".free"


def available() -> bool:
    """Whether this host has a writable shared-memory directory."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def _size_class(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (killed, not yet reaped)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            line = f.read()
    except FileNotFoundError:
        return False  # reaped since the kill()
    except OSError:
        return True  # no /proc: trust kill()
    # "pid (comm) S ...": comm may hold spaces and parentheses, the state follows the last ")"
    fields = line.rpartition(b")")[2].split()
    return not fields or fields[0] not in (b"Z", b"X")


def sweep_orphans() -> list[str]:
    """Unlink this user's segments whose creating process is dead or a zombie
    (it was killed before it could clean up). Returns the names removed.

    Cheap enough for an I/O thread (one ``listdir``, then per creator pid one
    ``kill(pid, 0)`` and one read of ``/proc/<pid>/stat``)."""
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    uid = os.geteuid()
    alive: dict[int, bool] = {}
    for name in names:
        base = name.removesuffix(FREE)
        if not _NAME.match(base):
            continue
        pid = int(base.split("-", 2)[1])
        if pid <= 0:
            continue
        if pid not in alive:
            alive[pid] = _pid_alive(pid)
        if alive[pid]:
            continue
        try:
            if os.lstat(_path(name)).st_uid != uid:
                continue  # another user's: not ours to judge
            os.unlink(_path(name))
            removed.append(name)
        except OSError:
            pass
    if removed:
        log.info("removed %d shared-memory segment(s) left by dead processes", len(removed))
    return removed


def plain_copy(dst: memoryview, src: memoryview) -> None:
    """Copy bytes in ``COPY_SLICE`` slices, so that other threads (heartbeats)
    get the GIL between slices during a large copy."""
    for i in range(0, src.nbytes, COPY_SLICE):
        dst[i:i + COPY_SLICE] = src[i:i + COPY_SLICE]


def _room(n: int) -> None:
    """Raise ENOSPC when ``n`` more bytes would leave /dev/shm with less
    than 1/HEADROOM of it free (a cheap check before creating a segment)."""
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    if n + st.f_blocks * st.f_frsize // HEADROOM > free:
        raise OSError(errno.ENOSPC, f"{SHM_DIR} has {free >> 20} MB free, "
                                    f"{-(-n >> 20)} MB needed: {FIX}")


def _reserve(fd: int, start: int, end: int) -> None:
    """Allocate the pages of ``[start, end)`` now (the GIL is released meanwhile),
    so that writing them can never SIGBUS."""
    _room(end - start)
    try:
        os.posix_fallocate(fd, start, end - start)
    except OSError as e:
        raise OSError(e.errno, f"{SHM_DIR}: cannot reserve {-(-(end - start) >> 20)} MB "
                               f"({os.strerror(e.errno or 0)}): {FIX}") from e


class ShmWriter:
    """Creates and recycles the segments of one transport.

    ``copy(dst, src)`` fills a segment; upper layers may pass a faster one
    (the agent passes torch's multi-threaded copy: 64 MB in 4.5 ms here
    instead of 9.5 ms). It should release the GIL (or let go of it often):
    it runs on the sending thread while heartbeats must keep flowing.
    """

    def __init__(self, copy: Callable[[memoryview, memoryview], None] = plain_copy) -> None:
        sweep_orphans()
        self._copy = copy
        self._prefix = f"nbrpc-{os.getpid()}-{os.urandom(4).hex()}"
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._by_class: dict[int, deque[str]] = {}  # in flight or free, oldest first
        self._size: dict[str, int] = {}
        self._tracked = 0
        self._warned = False
        self.created = self.reused = 0

    def write(self, buf: memoryview) -> str:
        """Copy ``buf`` into a segment (reused when one is free); returns its name.

        Raises OSError when shared memory cannot take it (/dev/shm too small or
        full): nothing is left behind, and the caller should use the socket."""
        n = buf.nbytes
        try:
            claimed = self._claim(_size_class(n), n)
            if claimed is None:
                name, fd = self._create(_size_class(n), n)
                populate = False  # lazily faulted pages are cheaper here (docstring)
            else:
                name, fd = claimed
                populate = n <= POPULATE_MAX
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning("shared memory refused %d MB (%s); such buffers go by socket",
                            n >> 20, e)
            raise
        try:
            with mmap.mmap(fd, n, flags=mmap.MAP_SHARED | (_POPULATE if populate else 0)) as mm:
                dst = memoryview(mm)
                try:
                    self._copy(dst, buf.cast("B"))
                finally:
                    dst.release()
        except BaseException:
            _give_back(name)  # ours and whole: free for the next write
            raise
        finally:
            os.close(fd)
        return name

    def _claim(self, cls: int, n: int) -> tuple[str, int] | None:
        """A free segment of class ``cls``, renamed back (an atomic claim),
        opened and reserved up to ``n`` bytes; None when there is none."""
        with self._lock:
            names = self._by_class.get(cls, ())
            for name in list(names):
                try:
                    os.rename(_path(name) + FREE, _path(name))
                except FileNotFoundError:
                    continue  # still held by a receiver
                names.remove(name)
                names.append(name)  # most recently used last
                break
            else:
                return None
        try:
            fd = os.open(_path(name), _OPEN)
            st = os.fstat(fd)
        except OSError:
            st = None
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            if st is not None:
                os.close(fd)
            log.warning("shared-memory segment %s was replaced behind our back; dropped", name)
            self._untrack(name)  # never write into it
            return None
        if st.st_size < n:  # first used for a smaller buffer of this class
            try:
                _reserve(fd, st.st_size, n)
            except OSError:
                os.close(fd)
                _give_back(name)
                raise
        self.reused += 1
        return name, fd

    def _untrack(self, name: str) -> None:
        with self._lock:
            cls = self._size.pop(name, None)
            if cls is not None:
                self._by_class[cls].remove(name)
                self._tracked -= cls

    def _create(self, cls: int, n: int) -> tuple[str, int]:
        """A new segment of ``n`` reserved bytes, opened; OSError leaves none."""
        _room(n)
        name = f"{self._prefix}-{next(self._seq)}"
        fd = os.open(_path(name), _OPEN | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            _reserve(fd, 0, n)
        except BaseException:
            os.close(fd)
            _unlink(name)
            raise
        with self._lock:
            self._by_class.setdefault(cls, deque()).append(name)
            self._size[name] = cls
            self._tracked += cls
            self.created += 1
            while self._tracked > MAX_TRACKED_BYTES and len(self._size) > 1:
                self._forget_oldest(keep=name)
        return name, fd

    def _forget_oldest(self, keep: str) -> None:
        for names in self._by_class.values():
            if names and names[0] != keep:
                old = names.popleft()
                self._tracked -= self._size.pop(old)
                _unlink(old)
                return

    def close(self) -> None:
        """Unlink every segment this writer made (maps held elsewhere stay valid)."""
        with self._lock:
            for name in self._size:
                _unlink(name)
            self._by_class.clear()
            self._size.clear()
            self._tracked = 0


def _unlink(name: str) -> None:
    """Remove a segment's files; never raises, so every close path runs to its end
    (a name another user occupies cannot be removed: EPERM in the sticky /dev/shm)."""
    for path in (_path(name), _path(name) + FREE):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("nbrpc: could not remove shared-memory file %s: %s", path, e)


def read(name: str, nbytes: int, release: Callable[[Callable[[], None]], None]) -> memoryview:
    """Map a segment a peer wrote; the map is the buffer.

    Mapping is O(1) whatever the size (no MAP_POPULATE), so this is safe on
    an I/O thread. Refuses (ValueError) a name that is not a segment's, a
    link or non-regular file, one smaller than ``nbytes``, and one owned by
    a uid other than ours or root's. When the map is garbage-collected,
    ``release(fn)`` is called with the function that hands the segment back
    to its writer (a rename); the caller decides on which thread it runs.
    """
    if not _NAME.match(name):
        raise ValueError(f"not an nbrpc segment name: {name!r}")
    # O_NONBLOCK: a FIFO planted under a segment's name must not block the I/O thread
    fd = os.open(_path(name), _OPEN | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"segment {name} is not a regular file")
        if st.st_uid not in (os.geteuid(), 0):
            raise ValueError(f"segment {name} belongs to uid {st.st_uid}, not to uid "
                             f"{os.geteuid()} (nor root): refused")
        if st.st_size < nbytes:
            raise ValueError(f"segment {name} is smaller than {nbytes} bytes")
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    weakref.finalize(mm, release, lambda: _give_back(name))
    return memoryview(mm)


def _give_back(name: str) -> None:
    try:
        os.rename(_path(name), _path(name) + FREE)
    except FileNotFoundError:
        pass  # the writer has stopped, or stopped tracking it
