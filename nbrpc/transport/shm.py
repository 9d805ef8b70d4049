"""Large buffers between processes on one host, through shared memory.

The sender copies a buffer into a POSIX shared-memory segment and sends its
name in the (signed) header instead of the bytes; the receiver maps the
segment, and its tensor uses that map directly (no second copy).

Names. /dev/shm is shared by every user, who can all list it: a name there
that another user can predict, they can occupy first (our create or our
hand-back then fails) and the sticky bit keeps us from removing it. So each
writer keeps its segments in a private directory, made (mode 0700) at its
first write: ``/dev/shm/nbrpc-<pid>-<16 random hex digits>/``, with files
``0``, ``1``, ... A segment's name in the header is ``nbrpc-<pid>-<hex>/<n>``
(under 50 bytes: the header stores its length in one byte). Nobody else can
create, rename or remove anything inside, so the directory's name, which
``ls /dev/shm`` shows, is of no use to them; a name already taken is drawn
again. Where the directory cannot be made, a write raises OSError and the
caller sends that buffer by socket.

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

Recycling. Fresh memory is what costs: reserving and zeroing pages takes
longer than copying into them. So a segment goes back and forth::

    writer                                   receiver
    claim <n>.free -> <n> (or create <n>)
    copy, send the name  ---------------->   map <n>; the tensor uses the map
                                             ... tensor dropped: munmap, then
    (next write of that size class)  <-----  rename <n> -> <n>.free, at once
    claim: rename <n>.free -> <n>

The receiver renames the segment in the finalizer of its map (after the
munmap), on the thread that drops the tensor: a rename in one tmpfs
directory takes microseconds, no Python lock, and cannot block, and doing
it at once makes reuse deterministic: whatever follows the drop (an answer,
a message) finds the segment free. The writer claims a free segment of the
size class (a power of two) by renaming it back, an atomic claim, before it
makes a new one; its pages stay allocated, so reuse costs only the copy.
When a large class (``WAIT_MIN`` and up) has segments in flight but none
free, the writer first waits for one: a callee holds a request's buffers
until its answer is sent, so a caller that sends again as soon as the
answer arrives races that hand-back. The wait is bounded by about half what
a fresh segment of the class costs (``cls / WAIT_BYTES_PER_S``, at least
``WAIT_S``: 31 ms for 128 MB, 62 ms for 256 MB, 0.5 s for 2 GB, whose
fresh segment takes seconds), so it pays even on a loaded host where the
callee's hand-back comes late. A wait that ends empty-handed means the
receiver keeps what it got (a parameter server storing tensors): that
class then makes fresh segments without waiting, until a write of it finds
one free again.

Retention. Free segments are kept for reuse, within bounds: before a new
segment would take the writer's segments past ``KEEP_BYTES``, free ones go,
least recently written first (the new one is made all the same, so the last
size used stays reusable); and :meth:`ShmWriter.trim`, which the I/O loop
runs every ``TRIM_EVERY_S`` while the writer holds segments, removes those
not written for ``KEEP_IDLE_S``. A segment in flight stays (its receiver
may not have mapped it yet) until ``HELD_MAX_S`` after its write, longer
than receivers accept a message; then it is unlinked (maps stay valid, its
pages go with the last one). When its transport stops, the writer removes
its directory with everything in it.

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

The reader trusts a segment only if its name matches the pattern exactly,
its directory (opened with O_NOFOLLOW) is private (no group or other
permission bits) and the file in it is a regular file opened with
O_NOFOLLOW, at least as large as the signed header says, and both belong to
this process's effective uid or root. Peers of one group normally run as one
user; root can read and write any user's memory anyway, so trusting root's
segments exposes nothing, while a segment owned by any other uid was made
(and could be rewritten) by someone outside the group, so it is refused.

A killed process leaves its directory behind; :func:`sweep_orphans` removes
this user's directories whose creator (the pid in the name) is gone or a
zombie (a killed child not yet reaped still answers ``kill(pid, 0)``). It
looks at the names in /dev/shm (at most ``SWEEP_MAX``), and only stats those
of dead creators, so the agent calls it, on its I/O thread, whenever a
member dies. (Unlinking is what frees a segment's pages: 0.3 s for an
unmapped 2 GB one, with the GIL released.)

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
import secrets
import stat
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
MIN_BYTES = 2 << 20  # measured crossover: sockets win at 1 MB, shared memory from ~4 MB
KEEP_BYTES = 1 << 30  # a writer's segments, in bytes, beyond which free ones are removed
KEEP_IDLE_S = 30.0  # a segment not written for this long is removed once free
TRIM_EVERY_S = 5.0  # how often the I/O loop trims a writer that holds segments
HELD_MAX_S = 600.0  # in flight this long: unlinked (receivers refuse messages this old)
WAIT_MIN = 128 << 20  # from this size class on, a write waits for one in flight ...
WAIT_BYTES_PER_S = 4 << 30  # ... at most its size at this rate (half a fresh one's cost),
WAIT_S = 0.02  # ... and at least this long, before it makes a fresh segment
CLAIM_TRIES = 16  # segments in flight a write looks past for a free one
POPULATE_MAX = 64 << 20  # largest reused segment mapped with MAP_POPULATE (GIL held)
HEADROOM = 16  # a new segment must leave 1/HEADROOM of /dev/shm free for others
COPY_SLICE = 16 << 20  # plain_copy's slice: the GIL is offered between slices
SWEEP_MAX = 20_000  # /dev/shm entries looked at per sweep, and per directory removed
FIX = "mount a larger /dev/shm, e.g. docker run --shm-size=4g"
FREE = ".free"  # a segment its receiver gave back
_GONE = ".gone"  # a free segment the writer is removing (claimed: nobody reuses it)
_DIR = re.compile(r"nbrpc-([0-9]{1,10})-[0-9a-f]{16}")
_NAME = re.compile(r"(nbrpc-[0-9]{1,10}-[0-9a-f]{16})/([0-9]{1,12})")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)
_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def available() -> bool:
    """Whether this host has a writable shared-memory directory."""
    return os.path.isdir(SHM_DIR) and os.access(SHM_DIR, os.W_OK)


def _size_class(n: int) -> int:
    return 1 << (n - 1).bit_length()


def wait_bound(cls: int) -> float:
    """How long a write of size class ``cls`` waits for one in flight (seconds).

    >>> wait_bound(256 << 20), wait_bound(2 << 30)
    (0.0625, 0.5)
    """
    return max(WAIT_S, cls / WAIT_BYTES_PER_S)


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
    """Remove this user's segment directories whose creating process is dead
    or a zombie (it was killed before it could clean up). Returns the names
    of the directories removed.

    Cheap enough for an I/O thread (one ``listdir``, then per creator pid one
    ``kill(pid, 0)`` and one read of ``/proc/<pid>/stat``)."""
    removed: list[str] = []
    try:
        entries = os.scandir(SHM_DIR)
    except OSError:
        return removed
    uid = os.geteuid()
    alive: dict[int, bool] = {}
    with entries:
        for entry in itertools.islice(entries, SWEEP_MAX):
            m = _DIR.fullmatch(entry.name)
            if m is None:
                continue
            pid = int(m[1])
            if pid not in alive:
                alive[pid] = pid <= 0 or _pid_alive(pid)
            if alive[pid]:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_uid != uid or not stat.S_ISDIR(st.st_mode):
                continue  # another user's: not ours to judge
            if _remove_dir(entry.name):
                removed.append(entry.name)
    if removed:
        log.info("removed %d shared-memory director(ies) left by dead processes", len(removed))
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


def _make_dir() -> str:
    """A new private (0700) directory in /dev/shm, under a name nobody can guess."""
    for _ in range(8):
        name = f"nbrpc-{os.getpid()}-{secrets.token_hex(8)}"
        try:
            os.mkdir(_path(name), 0o700)
        except FileExistsError:
            continue  # taken (someone listed /dev/shm and raced us?): draw again
        os.chmod(_path(name), 0o700)  # (whatever the umask: ours alone, but all ours)
        return name
    raise OSError(errno.EEXIST, f"no free directory name in {SHM_DIR}")


@dataclass(slots=True)
class _Seg:
    cls: int  # size class (bytes)
    used: float  # time.monotonic() of its last write
    busy: bool = True  # being written: never claimed or removed meanwhile


class ShmWriter:
    """Creates, recycles and removes the segments of one transport.

    ``copy(dst, src)`` fills a segment; upper layers may pass a faster one
    (the agent passes torch's multi-threaded copy: 64 MB in 4.5 ms here
    instead of 9.5 ms). It should release the GIL (or let go of it often):
    it runs on the sending thread while heartbeats must keep flowing.
    ``call_later(delay, fn)``, if given, runs ``fn`` later on the
    transport's I/O thread: the writer uses it to :meth:`trim` itself every
    ``TRIM_EVERY_S`` while it holds segments.

    ``created``, ``reused`` and ``removed`` count segments; ``waited``
    counts writes that reused a segment after waiting for it (:func:`wait_bound`).
    """

    def __init__(self, copy: Callable[[memoryview, memoryview], None] = plain_copy,
                 call_later: Callable[[float, Callable[[], None]], object] | None = None
                 ) -> None:
        sweep_orphans()
        self._copy = copy
        self._call_later = call_later
        self._dir: str | None = None  # made at the first write
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._segs: dict[str, _Seg] = {}  # in flight or free; claim order (tried last, last)
        self._tracked = 0  # bytes: the size classes of _segs
        self._timer = False
        self._closed = False
        self._warned = False
        self._kept_classes: set[int] = set()  # a wait for these came back empty-handed
        self.created = self.reused = self.removed = self.waited = 0

    @property
    def directory(self) -> str | None:
        """The writer's directory (a path), once it has made one."""
        return None if self._dir is None else _path(self._dir)

    def write(self, buf: memoryview) -> str:
        """Copy ``buf`` into a segment (reused when one is free); returns its name.

        Raises OSError when shared memory cannot take it (/dev/shm too small or
        full, no directory, the writer closed): nothing is left behind, and the
        caller should use the socket."""
        n = buf.nbytes
        cls = _size_class(n)
        try:
            claimed = self._claim(cls, n)
            if claimed is None:
                name, fd = self._create(cls, n)
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
            self._done(name)
            _give_back(name)  # ours and whole: free for the next write
            raise
        finally:
            os.close(fd)
        self._done(name)
        self._arm()
        return name

    def _claim(self, cls: int, n: int) -> tuple[str, int] | None:
        """A free segment of class ``cls``, renamed back (an atomic claim),
        opened and reserved up to ``n`` bytes; None when there is none."""
        with self._lock:
            name = self._take(cls)
            wait = (name is None and cls >= WAIT_MIN and cls not in self._kept_classes
                    and any(s.cls == cls and not s.busy for s in self._segs.values()))
            if name is not None:  # one came back: the class is worth waiting for
                self._kept_classes.discard(cls)
        if wait:  # one is in flight: it may be a moment from coming back (docstring)
            bound = wait_bound(cls)
            deadline = time.monotonic() + bound
            for _ in range(int(bound / 0.001) + 1):
                time.sleep(0.001)
                with self._lock:
                    name = self._take(cls)
                if name is not None or time.monotonic() > deadline:
                    break
            self.waited += name is not None
            if name is None:  # its receiver keeps it: later writes of the class do not wait
                with self._lock:
                    self._kept_classes.add(cls)
        if name is None:
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
                self._done(name)
                _give_back(name)
                raise
        self.reused += 1
        return name, fd

    def _take(self, cls: int) -> str | None:
        """Claim a free segment of class ``cls`` (the lock held): try those
        in claim order, at most ``CLAIM_TRIES`` in flight; those found in
        flight are tried last next time (a receiver may keep one for long)."""
        if self._closed:
            return None
        found, missed = None, []
        for name, seg in self._segs.items():
            if seg.cls != cls or seg.busy:
                continue
            try:
                os.rename(_path(name) + FREE, _path(name))
            except OSError:  # still held by a receiver
                missed.append(name)
                if len(missed) >= CLAIM_TRIES:
                    break
                continue
            found = name
            break
        for name in missed + ([found] if found else []):
            self._segs[name] = self._segs.pop(name)
        if found is not None:
            seg = self._segs[found]
            seg.busy, seg.used = True, time.monotonic()
        return found

    def _create(self, cls: int, n: int) -> tuple[str, int]:
        """A new segment of ``n`` reserved bytes, opened; OSError leaves none."""
        with self._lock:
            if self._closed:
                raise OSError(errno.ESHUTDOWN, "the shared-memory writer is closed")
            gone = self._make_room(cls)
        _remove(gone)
        _room(n)
        with self._lock:
            if self._closed:
                raise OSError(errno.ESHUTDOWN, "the shared-memory writer is closed")
            if self._dir is None:
                self._dir = _make_dir()
            name = f"{self._dir}/{next(self._seq)}"
            fd = os.open(_path(name), _OPEN | os.O_CREAT | os.O_EXCL, 0o600)
            self._segs[name] = _Seg(cls, time.monotonic())
            self._tracked += cls
            self.created += 1
        try:
            _reserve(fd, 0, n)
        except BaseException:
            os.close(fd)
            self._untrack(name)
            _unlink(name)
            raise
        return name, fd

    def _make_room(self, cls: int) -> list[str]:
        """Take free segments, least recently written first, until ``cls``
        more bytes fit in ``KEEP_BYTES`` (the lock held); returns their paths
        (renamed ``.gone``: nobody can claim them) for :func:`_remove`."""
        gone: list[str] = []
        if self._tracked + cls <= KEEP_BYTES:
            return gone
        for name, seg in sorted(self._segs.items(), key=lambda item: item[1].used):
            if self._tracked + cls <= KEEP_BYTES:
                break
            if not seg.busy and _take_free(name):
                gone.append(_path(name) + _GONE)
                self._untrack_locked(name)
        return gone

    def trim(self, now: float | None = None) -> int:
        """Remove the free segments not written for ``KEEP_IDLE_S``, and those
        in flight for ``HELD_MAX_S``; returns how many were removed."""
        now = time.monotonic() if now is None else now
        gone: list[str] = []
        count = 0
        with self._lock:
            if self._closed:
                return 0
            for name, seg in list(self._segs.items()):
                if seg.busy or now - seg.used <= KEEP_IDLE_S:
                    continue
                if _take_free(name):
                    gone.append(_path(name) + _GONE)
                elif now - seg.used > HELD_MAX_S:  # (maps of it stay valid)
                    gone += [_path(name), _path(name) + FREE]  # (in this order: see _unlink)
                else:
                    continue
                self._untrack_locked(name)
                count += 1
        _remove(gone)
        return count

    def _done(self, name: str) -> None:
        """The write into ``name`` is over (sent, or given back)."""
        with self._lock:
            seg = self._segs.get(name)
            if seg is not None:
                seg.busy, seg.used = False, time.monotonic()

    def _untrack(self, name: str) -> None:
        with self._lock:
            self._untrack_locked(name)

    def _untrack_locked(self, name: str) -> None:
        seg = self._segs.pop(name, None)
        if seg is not None:
            self._tracked -= seg.cls
            self.removed += 1

    def _arm(self) -> None:
        """Have the I/O loop trim this writer in ``TRIM_EVERY_S`` (once at a time)."""
        if self._call_later is None:
            return
        with self._lock:
            if self._timer or self._closed:
                return
            self._timer = True
        self._call_later(TRIM_EVERY_S, self._tick)

    def _tick(self) -> None:
        try:
            self.trim()
        finally:
            with self._lock:
                self._timer = False
                again = bool(self._segs) and not self._closed
            if again:
                self._arm()

    def close(self) -> None:
        """Remove this writer's directory and every segment in it (maps held
        elsewhere stay valid). Never raises: what cannot be removed is logged."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._segs.clear()
            self._tracked = 0
            name = self._dir
        if name is not None:
            _remove_dir(name)


def _take_free(name: str) -> bool:
    """Claim free segment ``name`` for removal (renamed ``.gone``); False if it is
    not free (in flight: a receiver may hold it)."""
    try:
        os.rename(_path(name) + FREE, _path(name) + _GONE)
    except OSError:
        return False
    return True


def _remove(paths: list[str]) -> None:
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("nbrpc: could not remove shared-memory file %s: %s", path, e)


def _unlink(name: str) -> None:
    """Remove a segment's files; never raises, so every close path runs to its end.
    (The name first: a receiver that renames it meanwhile leaves ``.free``, removed next.)"""
    _remove([_path(name), _path(name) + FREE])


def _remove_dir(name: str) -> bool:
    """Remove directory ``name`` (in /dev/shm) and what is in it; never raises.
    A receiver may rename a file in it meanwhile (to ``.free``): then the
    directory is listed again, a few times at most."""
    path = _path(name)
    why: OSError | None = None
    for _ in range(4):
        try:
            with os.scandir(path) as entries:
                files = [e.name for e in itertools.islice(entries, SWEEP_MAX)]
        except FileNotFoundError:
            return True
        except OSError as e:
            why = e
            break
        _remove([os.path.join(path, f) for f in files])
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError as e:  # ENOTEMPTY: renamed meanwhile, or more than SWEEP_MAX
            why = e
    log.warning("nbrpc: could not remove shared-memory directory %s: %s", path, why)
    return False


def read(name: str, nbytes: int) -> memoryview:
    """Map a segment a peer wrote; the map is the buffer.

    Mapping is O(1) whatever the size (no MAP_POPULATE), so this is safe on
    an I/O thread. Refuses (ValueError) a name that is not a segment's, a
    directory that is not private, a link or non-regular file, one smaller
    than ``nbytes``, and a directory or file owned by a uid other than ours
    or root's. When the map is garbage-collected (after its munmap), the
    segment is handed back to its writer at once (a rename, see the module
    docstring), on the thread that dropped it.
    """
    m = _NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"not an nbrpc segment name: {name!r}")
    ours = (os.geteuid(), 0)
    dfd = os.open(_path(m[1]), _OPEN_DIR)
    try:
        st = os.fstat(dfd)
        if st.st_uid not in ours or stat.S_IMODE(st.st_mode) & 0o077:
            raise ValueError(f"directory {m[1]} (uid {st.st_uid}, mode "
                             f"{stat.S_IMODE(st.st_mode):o}) is not a private one of uid "
                             f"{os.geteuid()} (nor root's): refused")
        # O_NONBLOCK: a FIFO planted under a segment's name must not block the I/O thread
        fd = os.open(m[2], _OPEN | os.O_NONBLOCK, dir_fd=dfd)
    finally:
        os.close(dfd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"segment {name} is not a regular file")
        if st.st_uid not in ours:
            raise ValueError(f"segment {name} belongs to uid {st.st_uid}, not to uid "
                             f"{os.geteuid()} (nor root): refused")
        if st.st_size < nbytes:
            raise ValueError(f"segment {name} is smaller than {nbytes} bytes")
        mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)
    weakref.finalize(mm, _give_back, name)
    return memoryview(mm)


def _give_back(name: str) -> None:
    """Hand segment ``name`` back to its writer (it is free from now on);
    never raises: it runs in a finalizer."""
    try:
        os.rename(_path(name), _path(name) + FREE)
    except OSError:
        pass  # the writer has stopped, or removed it
