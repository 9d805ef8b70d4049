"""Shared-memory buffers: framing, recycling and cleanup, with no sockets."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import poll_for
from fault_util import GilTicker

from nbrpc.transport import BadMessage, ShmRef, new_key, pack, shm, unpack

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm")


def _files(w: shm.ShmWriter) -> list[str]:
    """The files in ``w``'s directory (none before its first write or after close)."""
    try:
        return sorted(os.listdir(w.directory)) if w.directory else []
    except FileNotFoundError:
        return []


def _closed_clean(w: shm.ShmWriter) -> bool:
    return w.directory is None or not os.path.lexists(w.directory)


def _resident_kib(path: str) -> int:
    """How much of this process's mapping of the file at ``path`` is in memory
    (its ``Rss`` in ``/proc/self/smaps``, KiB); fails if there is no such mapping."""
    with open("/proc/self/smaps") as f:
        lines = f.read().splitlines()
    at = next((i for i, line in enumerate(lines) if line.endswith(" " + path)), None)
    assert at is not None, f"no mapping of {path} in /proc/self/smaps"
    return next(int(x.split()[1]) for x in lines[at + 1:] if x.startswith("Rss:"))


def _read(name: str, nbytes: int) -> torch.Tensor:
    return torch.frombuffer(shm.read(name, nbytes), dtype=torch.uint8)


def test_segment_roundtrip_is_recycled_after_the_tensor_dies() -> None:
    w = shm.ShmWriter()
    x = torch.randn(100_000)
    src = memoryview(x.numpy()).cast("B")
    try:
        name = w.write(src)
        y = torch.frombuffer(shm.read(name, src.nbytes), dtype=torch.float32)
        assert torch.equal(y, x)
        assert w.write(src) != name  # still held by y: a second segment
        del y  # handed back at once, on this thread: no collection, no I/O loop
        assert w.write(src) == name and w.reused == 1
    finally:
        w.close()
    assert _closed_clean(w)


def test_segments_live_in_a_private_directory_under_unguessable_names() -> None:
    w, v = shm.ShmWriter(), shm.ShmWriter()
    try:
        name = w.write(memoryview(bytes(300_000)))
        other = v.write(memoryview(bytes(300_000)))
        folder, _, file = name.partition("/")
        assert re.fullmatch(rf"nbrpc-{os.getpid()}-[0-9a-f]{{16}}", folder) and file == "0"
        assert other.partition("/")[0] != folder  # one directory per writer
        assert len(name.encode()) < 256  # the header stores a name's length in one byte
        st = os.lstat(w.directory)
        assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
        assert st.st_uid == os.geteuid() and w.directory == os.path.join(shm.SHM_DIR, folder)
        assert stat.S_IMODE(os.stat(shm._path(name)).st_mode) == 0o600
    finally:
        w.close()
        v.close()
    assert _closed_clean(w) and _closed_clean(v)


def test_writer_close_unlinks_segments_never_opened() -> None:
    w = shm.ShmWriter()
    w.write(memoryview(bytes(300_000)))
    assert _files(w) == ["0"]
    w.close()
    assert _closed_clean(w)
    with pytest.raises(OSError):  # closed: the caller sends by socket
        w.write(memoryview(bytes(300_000)))
    assert _closed_clean(w)


@pytest.mark.parametrize("name", [
    "../etc/passwd", "nbrpc-1-0123456789abcdef/../../etc/passwd", "nbrpc-1-0123456789abcdef",
    "nbrpc-1-0123456789abcdef/0.free", "nbrpc-1-0123456789abcdef/0\n",
    "nbrpc-1-0123456789ABCDEF/0", "nbrpc-1-0123456789abcde/0", "/dev/shm/nbrpc-1-0123456789abcdef/0",
    "nbrpc-1-0123456789abcdef//0", "nbrpc-1-aa-0"])
def test_reader_refuses_foreign_names(name: str) -> None:
    with pytest.raises(ValueError, match="not an nbrpc segment"):
        shm.read(name, 10)


def test_segment_names_are_signed() -> None:
    key = new_key()
    name = "nbrpc-1-0123456789abcdef/0"
    frames = pack(key, 1, 0, 9, b"p", [b"abc", ShmRef(name, 1 << 20)])
    env = unpack(key, frames)
    assert env.buffers[1] == ShmRef(name, 1 << 20) and bytes(env.buffers[0]) == b"abc"
    forged = list(frames)
    forged[0] = frames[0].replace(name.encode(), name.replace("/0", "/1").encode())
    with pytest.raises(BadMessage):
        unpack(key, forged)
    stuffed = list(frames)
    stuffed[2] = b"data where none belongs"
    with pytest.raises(BadMessage):
        unpack(key, stuffed)


def test_segments_of_dead_processes_are_swept() -> None:
    # a process that creates a segment and dies without cleaning up
    code = ("import os, sys; from nbrpc.transport import shm; w = shm.ShmWriter(); "
            "print(w.write(memoryview(bytes(300_000)))); sys.stdout.flush(); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    name = out.stdout.strip()
    assert os.path.exists(shm._path(name)), out.stderr
    mine = shm.ShmWriter()  # starting a writer sweeps the orphans
    try:
        assert not os.path.lexists(shm._path(name.partition("/")[0]))
    finally:
        mine.close()


# -- robustness: the GIL, a small /dev/shm, killed processes --------------------------
GIL_GAP_S = 0.2  # the old MAP_POPULATE write held the GIL 0.6-3 s for 1 GB here


def test_a_1gb_segment_is_written_and_read_with_the_gil_free() -> None:
    from nbrpc.serialize import parallel_copy

    x = torch.ones(1 << 28)  # 1 GB of float32
    src = memoryview(x.numpy()).cast("B")
    w = shm.ShmWriter(parallel_copy)  # what the agent passes
    try:
        with GilTicker() as t:
            name = w.write(src)
        assert t.gap < GIL_GAP_S, f"a fresh 1 GB write kept the GIL for {t.gap:.2f} s"
        # the reader maps in O(1) on its I/O thread: no page is mapped in until it is
        # read (MAP_POPULATE mapped all 1 GB, in 78 ms, with the GIL held)
        with GilTicker() as t:
            took, resident = [], []
            for i in range(3):
                if i:  # handed back when dropped: take it again, to read it again
                    os.rename(shm._path(name) + shm.FREE, shm._path(name))
                t0 = time.perf_counter()
                m = shm.read(name, src.nbytes)
                took.append(time.perf_counter() - t0)
                resident.append(_resident_kib(shm._path(name)))
                y = torch.frombuffer(m, dtype=torch.float32)
                assert y[::1 << 20].eq(1).all() and y[-1] == 1
                del m, y
        print(f"\nmapping 1 GB: {min(took) * 1e3:.2f} ms; resident once mapped: {resident} KiB")
        assert max(resident) < 1024, f"mapping 1 GB faulted in {max(resident)} KiB at once"
        assert t.gap < GIL_GAP_S, f"reading 1 GB kept the GIL for {t.gap:.2f} s"
        w._copy = shm.plain_copy  # the default, sliced copy
        with GilTicker() as t:
            assert w.write(src) == name and w.reused == 1
        assert t.gap < GIL_GAP_S, f"a reused 1 GB write kept the GIL for {t.gap:.2f} s"
    finally:
        w.close()
    assert _closed_clean(w)


def test_a_reused_segment_is_reserved_again_before_a_larger_write() -> None:
    w = shm.ShmWriter()
    try:
        name = w.write(memoryview(bytes(3 << 20)))  # the 4 MB class, 3 MB reserved
        shm._give_back(name)
        assert os.stat(shm._path(name) + shm.FREE).st_size == 3 << 20
        big = torch.arange(1 << 20, dtype=torch.float32)  # 4 MB
        assert w.write(memoryview(big.numpy()).cast("B")) == name and w.reused == 1
        st = os.stat(shm._path(name))
        assert st.st_size == 4 << 20 and st.st_blocks * 512 >= 4 << 20  # pages allocated
        y = torch.frombuffer(shm.read(name, 4 << 20), dtype=torch.float32)
        assert torch.equal(y, big)
    finally:
        w.close()


SMALL_SHM = """
import os, sys
from nbrpc.transport import shm
shm.SHM_DIR = sys.argv[1]
w = shm.ShmWriter()
buf = memoryview(bytearray(32 << 20))
def left():  # every file in the tmpfs, one directory down
    top = sorted(os.listdir(shm.SHM_DIR))
    return top, sorted(f for d in top for f in os.listdir(os.path.join(shm.SHM_DIR, d)))
def attempt(what):
    try:
        w.write(buf)
        print(what, "wrote")
    except OSError as e:
        print(what, "OSError", e)
    top, files = left()
    print(what, "left", len(top), files, flush=True)
attempt("checked")
shm._room = lambda n: None  # as if another process filled it after the check
attempt("fallocate")
ok = w.write(memoryview(bytearray(4 << 20)))  # what fits still goes through it
w.close()
print("small", ok.startswith("nbrpc-"), left(), flush=True)
"""


def test_a_tmpfs_smaller_than_the_buffer_raises_oserror_and_leaves_nothing(tmp_path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    # a private mount namespace: the 16 MB tmpfs vanishes with the subprocess
    script = ('mount -t tmpfs -o size=16m tmpfs "$0" || { echo NOMOUNT; exit 77; }; '
              'exec "$1" -c "$2" "$0"')
    try:
        out = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script,
                              str(tmp_path), sys.executable, SMALL_SHM],
                             capture_output=True, text=True, timeout=60,
                             cwd=os.path.dirname(os.path.dirname(__file__)))
    except FileNotFoundError:
        pytest.skip("no unshare(1)")
    if out.returncode == 77 or "NOMOUNT" in out.stdout or "unshare failed" in out.stderr:
        pytest.skip(f"cannot mount a tmpfs in a mount namespace: {out.stderr.strip()}")
    assert out.returncode == 0, (  # -7 is SIGBUS: a sparse segment dies writing page 16 MB
        f"exit {out.returncode}\n{out.stdout}\n{out.stderr}")
    lines = out.stdout.splitlines()
    assert lines[0].startswith("checked OSError") and "--shm-size" in lines[0], lines
    assert lines[1] == "checked left 0 []", lines  # refused before anything was made
    assert lines[2].startswith("fallocate OSError") and "--shm-size" in lines[2], lines
    assert lines[3] == "fallocate left 1 []", lines  # only the writer's (empty) directory
    assert lines[4] == "small True ([], [])", lines


def _orphan(pid: int, files: int = 1) -> str:
    """A segment directory as process ``pid`` would leave it; its name."""
    name = f"nbrpc-{pid}-{os.urandom(8).hex()}"
    os.mkdir(shm._path(name), 0o700)
    for i in range(files):
        open(os.path.join(shm._path(name), str(i)), "w").close()
    return name


def test_segments_of_zombies_are_swept() -> None:
    # a killed child its parent has not reaped yet still answers kill(pid, 0)
    code = ("import os; from nbrpc.transport import shm; "
            "w = shm.ShmWriter(); print(w.write(memoryview(bytes(300_000))), flush=True)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             cwd=os.path.dirname(os.path.dirname(__file__)))
    folder = ""
    try:
        folder = child.stdout.readline().strip().partition("/")[0]

        def zombie() -> bool:
            with open(f"/proc/{child.pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0] == "Z"
        assert poll_for(zombie, timeout=30)
        assert os.listdir(shm._path(folder)) == ["0"]  # (exiting closed no writer)
        os.kill(child.pid, 0)  # still there as far as kill() knows
        assert folder in shm.sweep_orphans()
        assert not os.path.lexists(shm._path(folder))
    finally:
        child.stdout.close()
        child.wait(10)
        if folder:
            shm._remove_dir(folder)


def test_sweep_leaves_live_and_foreign_entries_and_is_cheap(monkeypatch) -> None:
    live = [_orphan(os.getpid(), 0) for _ in range(200)]  # ours, alive
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True, timeout=60).stdout.strip()
    look_alike = [f"nbrpc-{dead_pid}-abcd-0", f"nbrpc-{dead_pid}-{'ab' * 8}.free"]
    for n in look_alike:  # dead creator, but not a directory of ours by name
        open(shm._path(n), "w").close()
    try:
        took = []
        for _ in range(20):
            t0 = time.perf_counter()
            assert shm.sweep_orphans() == []
            took.append(time.perf_counter() - t0)
        took.sort()
        print(f"sweep_orphans over 200 live directories: median {took[10] * 1e3:.2f} ms")
        # cheap: one liveness check per creator (this process), not one per directory
        checked: list[int] = []
        pid_alive = shm._pid_alive
        monkeypatch.setattr(shm, "_pid_alive", lambda pid: checked.append(pid) or pid_alive(pid))
        assert shm.sweep_orphans() == []
        assert checked.count(os.getpid()) == 1 and len(set(checked)) == len(checked), checked
        assert all(os.path.lexists(shm._path(n)) for n in live + look_alike)
        if os.geteuid() == 0:  # another user's directory of a dead creator: not ours
            foreign = _orphan(int(dead_pid))
            os.chown(shm._path(foreign), 12345, 12345)
            dead = _orphan(int(dead_pid))
            assert shm.sweep_orphans() == [dead] and os.path.lexists(shm._path(foreign))
            shm._remove_dir(foreign)
    finally:
        for n in live:
            shm._remove_dir(n)
        for n in look_alike:
            os.unlink(shm._path(n))


def test_reader_refuses_links_open_directories_and_other_users_segments(tmp_path) -> None:
    folder = _orphan(os.getpid(), 0)
    name, path = f"{folder}/7", shm._path(f"{folder}/7")
    (tmp_path / "target").write_bytes(bytes(4096))
    try:
        os.symlink(tmp_path / "target", path)
        with pytest.raises(OSError):  # ELOOP: O_NOFOLLOW
            shm.read(name, 10)
        os.unlink(path)
        link = f"nbrpc-{os.getpid()}-{'cd' * 8}"  # the directory itself a link
        os.symlink(shm._path(folder), shm._path(link))
        with open(path, "wb") as f:
            f.write(bytes(4096))
        try:
            with pytest.raises(OSError):
                shm.read(f"{link}/7", 10)
        finally:
            os.unlink(shm._path(link))
        assert shm.read(name, 10).nbytes == 10  # (given back when dropped: 7.free)
        os.rename(path + shm.FREE, path)
        os.chmod(shm._path(folder), 0o755)  # readable to others: someone else's doing
        with pytest.raises(ValueError, match="not a private one"):
            shm.read(name, 10)
        os.chmod(shm._path(folder), 0o700)
        with pytest.raises(ValueError, match="smaller than"):
            shm.read(name, 8192)
        if os.geteuid() != 0:
            return  # chown to another uid needs root
        os.chown(path, 12345, 12345)
        with pytest.raises(ValueError, match="belongs to uid 12345"):
            shm.read(name, 10)
        os.chown(path, 0, 0)
        os.chown(shm._path(folder), 12345, 12345)
        with pytest.raises(ValueError, match="uid 12345"):
            shm.read(name, 10)
    finally:
        shm._remove_dir(folder)


def test_writer_never_reuses_a_segment_someone_else_replaced() -> None:
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    w = shm.ShmWriter()
    try:
        name = w.write(memoryview(bytes(300_000)))
        shm._give_back(name)
        os.chown(shm._path(name) + shm.FREE, 12345, 12345)
        other = w.write(memoryview(bytes(300_000)))
        assert other != name and w.reused == 0 and name not in w._segs
    finally:
        w.close()
    assert _closed_clean(w)


def test_writer_close_goes_on_past_whatever_fails(monkeypatch, caplog) -> None:
    """close() never raises: a file it may not remove, a directory it cannot list
    or remove are logged, and the rest is removed (the transport's close runs on)."""
    w = shm.ShmWriter()
    first = w.write(memoryview(bytes(300_000)))
    held = _read(first, 300_000)
    second = w.write(memoryview(bytes(300_000)))  # the first is still held: a second segment
    unlink = os.unlink

    def refuse(path, *args, **kwargs):
        if path.endswith(first):
            raise PermissionError(1, "Operation not permitted", path)
        return unlink(path, *args, **kwargs)

    monkeypatch.setattr(shm.os, "unlink", refuse)
    with caplog.at_level("WARNING", logger="nbrpc.transport.shm"):
        w.close()
    assert _files(w) == [first.partition("/")[2]] and second != first
    assert "could not remove shared-memory file" in caplog.text
    assert "could not remove shared-memory directory" in caplog.text
    monkeypatch.undo()
    del held  # its hand-back still lands in the directory
    w.close()  # (a second close does nothing)
    assert _files(w) == [first.partition("/")[2] + shm.FREE]
    shm._remove_dir(first.partition("/")[0])
    assert _closed_clean(w)

    v = shm.ShmWriter()
    v.write(memoryview(bytes(300_000)))
    for fn in ("scandir", "rmdir", "unlink"):
        monkeypatch.setattr(shm.os, fn, lambda *a, **k: (_ for _ in ()).throw(OSError(5, "EIO")))
    v.close()  # nothing works, nothing raises
    monkeypatch.undo()
    shm._remove_dir(v._dir)
    assert _closed_clean(v)


# -- recycling and retention -------------------------------------------------------------
def test_a_256mb_segment_is_reused_right_after_its_tensor_is_dropped() -> None:
    x = torch.arange(64 << 20, dtype=torch.float32)  # 256 MiB
    src = memoryview(x.numpy()).cast("B")
    w = shm.ShmWriter()
    try:
        took = []
        for i in range(3):
            t0 = time.perf_counter()
            name = w.write(src)
            took.append(time.perf_counter() - t0)
            y = torch.frombuffer(shm.read(name, src.nbytes), dtype=torch.float32)
            assert y[-1] == x[-1]
            del y  # no collection, no loop: the next write finds it free
            assert w.created == 1 and w.reused == i, (w.created, w.reused)
        print(f"256 MiB writes: fresh {took[0]:.3f} s, reused {took[1]:.3f} / {took[2]:.3f} s")
    finally:
        w.close()


def test_a_write_waits_briefly_for_a_large_segment_in_flight(monkeypatch) -> None:
    monkeypatch.setattr(shm, "WAIT_MIN", 4 << 20)
    monkeypatch.setattr(shm, "WAIT_S", 5.0)  # (how long it could wait; it waits far less)
    w = shm.ShmWriter()
    buf = memoryview(bytes(4 << 20))
    try:
        box = [_read(w.write(buf), buf.nbytes)]
        dropper = threading.Timer(0.05, box.clear)  # the receiver drops it a moment later,
        dropper.start()  # as a callee does with a request's buffers once it has answered
        t0 = time.perf_counter()
        name = w.write(buf)
        waited = time.perf_counter() - t0
        dropper.join()
        assert (w.created, w.reused, w.waited) == (1, 1, 1) and waited < 2.5, waited
        shm._give_back(name)  # (nobody read it)
        monkeypatch.setattr(shm, "WAIT_S", 0.02)
        kept = _read(w.write(buf), buf.nbytes)
        t0 = time.perf_counter()
        w.write(buf)  # the only one of its class is held for good: a fresh one after 20 ms
        waited = time.perf_counter() - t0
        assert (w.created, w.reused, w.waited) == (2, 2, 1) and waited >= 0.02, waited
        monkeypatch.setattr(shm, "WAIT_S", 5.0)
        t0 = time.perf_counter()
        also_kept = _read(w.write(buf), buf.nbytes)  # that receiver keeps what it gets:
        waited = time.perf_counter() - t0  # no second wait for it (it could be 5 s)
        assert (w.created, w.reused, w.waited) == (3, 2, 1) and waited < 2.5, waited
        del kept, also_kept  # both handed back: the class is worth waiting for again
        box = [_read(w.write(buf), buf.nbytes), _read(w.write(buf), buf.nbytes)]
        assert (w.created, w.reused) == (3, 4)
        dropper = threading.Timer(0.05, box.clear)
        dropper.start()
        t0 = time.perf_counter()
        shm._give_back(w.write(buf))
        waited = time.perf_counter() - t0
        dropper.join()
        assert (w.created, w.reused, w.waited) == (3, 5, 2) and waited < 2.5, waited
    finally:
        w.close()


def test_the_wait_is_about_half_the_cost_of_a_fresh_segment() -> None:
    assert shm.wait_bound(shm.WAIT_MIN) >= shm.WAIT_S
    assert shm.wait_bound(2 << 30) == pytest.approx(0.5)
    assert shm.wait_bound(256 << 20) == pytest.approx(0.0625)


def test_free_segments_past_the_budget_are_removed_before_a_new_one_is_made(monkeypatch) -> None:
    monkeypatch.setattr(shm, "KEEP_BYTES", 8 << 20)
    w = shm.ShmWriter()
    try:
        a = w.write(memoryview(bytes(3 << 20)))  # class 4 MB
        shm._give_back(a)  # free
        b = _read(w.write(memoryview(bytes(6 << 20))), 6 << 20)  # class 8 MB: 12 MB > 8 MB
        assert _files(w) == ["1"] and (w.created, w.removed) == (2, 1)  # a went first
        c = _read(w.write(memoryview(bytes(3 << 20))), 3 << 20)  # b is in flight: kept
        assert _files(w) == ["1", "2"] and (w.created, w.removed) == (3, 1)
        del c
        big = w.write(memoryview(bytes(12 << 20)))  # alone past the budget: made all the same
        assert _files(w) == ["1", "3"] and w._tracked == (8 << 20) + (16 << 20)
        shm._give_back(big)  # the last size used stays reusable ...
        assert w.write(memoryview(bytes(12 << 20))) == big and w.reused == 1
        del b
    finally:
        w.close()
    assert _closed_clean(w)


def test_idle_segments_are_returned_and_the_loop_is_asked_to_trim(monkeypatch) -> None:
    timers: list = []
    w = shm.ShmWriter(call_later=lambda delay, fn: timers.append((delay, fn)))
    try:
        free = w.write(memoryview(bytes(6 << 20)))
        shm._give_back(free)
        held = _read(w.write(memoryview(bytes(3 << 20))), 3 << 20)  # another class: in flight
        assert [d for d, _ in timers] == [shm.TRIM_EVERY_S]  # armed once, not per write
        now = time.monotonic()
        assert w.trim(now) == 0 and len(_files(w)) == 2  # nothing idle yet
        assert w.trim(now + shm.KEEP_IDLE_S + 1) == 1 and _files(w) == ["1"]  # the free one
        assert w.trim(now + shm.HELD_MAX_S + 1) == 1 and _files(w) == []  # in flight too long
        assert torch.all(held == 0)  # (its map is still valid)
        timers.pop()[1]()  # the loop's tick: nothing is left, so it is not armed again
        assert timers == []
        w.write(memoryview(bytes(3 << 20)))
        timers.pop()[1]()  # a segment is left: armed again
        assert len(timers) == 1
    finally:
        w.close()
    timers.pop()[1]()  # a tick after close does nothing
    assert timers == [] and _closed_clean(w)
