"""Security tier: a second local user plants files in /dev/shm against our segments.

The attacker is the real other user of :mod:`test_security_users` (root
only; skips otherwise). /dev/shm is world-writable and world-listable, so it
sees every name there. Each of 20 cycles starts a two-agent group in this
process, moves 4 MiB tensors (shared memory's size) both ways, and lets the
attacker act in the middle of the cycle, while both agents hold segments:

=====================  ========================================================
what it does           what must happen
=====================  ========================================================
takes the names it     it cannot: each writer's segments are in a private
can guess (each next   (0700) directory; it cannot create, list or rename
sequence number, and   anything there, and names it plants beside that
its ``.free``)         directory are never used, swept or followed
the cycle goes on      every tensor still goes through shared memory (none
                       falls back to the socket), no PermissionError anywhere
20 init/shutdown       this process ends with the fds, /dev/shm entries and
cycles                 ``nbrpc-ipc-*`` socket directories it started with
=====================  ========================================================
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

import pytest
import torch
from conftest import local_group, poll_for
from test_security_users import Attacker, attacker  # noqa: F401

from nbrpc.transport import shm

pytestmark = [pytest.mark.security,
              pytest.mark.skipif(not shm.available(), reason="no /dev/shm")]

CYCLES = 20

PLANT = r"""
import json, os, sys
root, pid, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
planted = entered = refused = 0

def plant(path):
    global planted
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError:
        return
    os.write(fd, b"the attacker's")
    os.close(fd)
    os.chmod(path, 0o666)
    planted += 1

seen = [e for e in os.listdir(root) if e.startswith(f"nbrpc-{pid}-")]
for entry in seen:
    path = os.path.join(root, entry)
    base = entry.removesuffix(".free")
    if os.path.isdir(path) and not os.path.islink(path):  # try to get in
        for name in [str(i) for i in range(n)] + [f"{i}.free" for i in range(n)]:
            try:
                os.close(os.open(os.path.join(path, name), os.O_WRONLY | os.O_CREAT, 0o666))
                entered += 1
            except PermissionError:
                refused += 1
        try:
            os.listdir(path)
            entered += 1
        except PermissionError:
            refused += 1
        for name in (base + ".free", base + "-0", base + "-1"):  # and beside it
            plant(os.path.join(root, name))
    else:  # a segment PREFIX-SEQ in /dev/shm itself: take the next names, and .free
        prefix, _, seq = base.rpartition("-")
        if seq.isdigit():
            for k in range(int(seq), int(seq) + n):
                plant(os.path.join(root, f"{prefix}-{k}"))
                plant(os.path.join(root, f"{prefix}-{k}.free"))
print(json.dumps({"seen": len(seen), "planted": planted, "entered": entered,
                  "refused": refused}))
"""


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _entries(uid: int) -> list[str]:
    """The names in /dev/shm with this process's pid, owned by ``uid``."""
    found = []
    for entry in os.listdir(shm.SHM_DIR):
        if entry.startswith(f"nbrpc-{os.getpid()}-"):
            try:
                if os.lstat(os.path.join(shm.SHM_DIR, entry)).st_uid == uid:
                    found.append(entry)
            except FileNotFoundError:
                pass
    return sorted(found)


def _ipc_dirs() -> list[str]:
    return sorted(e for e in os.listdir(tempfile.gettempdir())
                  if e.startswith(f"nbrpc-ipc-{os.getpid()}-"))


def _state() -> tuple:
    return _fds(), _entries(os.geteuid()), _ipc_dirs()


def _cycle(x: torch.Tensor, attack=None) -> tuple:
    """One group's life: a tensor each way four times; ``attack()`` while both
    agents hold a segment. Returns what it saw, (created, reused) of both
    writers and the bytes both sockets carried."""
    with local_group(["a", "b"]) as (a, b):
        y = a.rpc_sync("b", torch.clone, (x,))
        seen = attack() if attack is not None else None
        z = a.rpc_sync("b", torch.clone, (x,))  # y held: b makes a segment, under a new name
        del y, z  # both go back, to names the attacker may have taken
        for _ in range(2):
            y = a.rpc_sync("b", torch.clone, (x,))
            assert torch.equal(y, x)
            del y
        used = [(w.created, w.reused) for w in (a.io._shm, b.io._shm)]
        return seen, used, a.io.sent_bytes + b.io.sent_bytes


def test_another_users_files_in_dev_shm_neither_block_nor_leak(
        attacker: Attacker, caplog) -> None:  # noqa: F811
    x = torch.randn(1 << 20)  # 4 MiB: shared memory's
    assert x.nbytes >= shm.MIN_BYTES
    _cycle(x)  # (lazy imports and pools: counted from here)
    before = _state()
    try:
        with caplog.at_level("WARNING", logger="nbrpc"):
            for cycle in range(CYCLES):
                seen, used, sent = _cycle(
                    x, lambda: attacker.run(PLANT, shm.SHM_DIR, os.getpid(), 8))
                assert seen["seen"] >= 2 and seen["entered"] == 0, (cycle, seen)
                # every tensor went through shared memory: none by socket
                assert [c + r for c, r in used] == [4, 4] and sent < x.nbytes, (
                    cycle, seen, used, sent)
        assert seen["refused"] > 0  # (it did try to get in)
        assert poll_for(lambda: _state() == before, timeout=10), (before, _state())
        trouble = [r.getMessage() for r in caplog.records
                   if "ermission" in r.getMessage() or "could not remove" in r.getMessage()
                   or "refused" in r.getMessage()
                   or r.exc_info and isinstance(r.exc_info[1], OSError)]
        assert not trouble, trouble
    finally:
        for entry in _entries(attacker.uid):  # what it planted
            path = os.path.join(shm.SHM_DIR, entry)
            if stat.S_ISDIR(os.lstat(path).st_mode):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
    assert _entries(attacker.uid) == []
