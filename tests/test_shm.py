"""Shared-memory buffers: framing, recycling and cleanup, with no sockets."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from nbrpc.transport import BadMessage, ShmRef, new_key, pack, shm, unpack

pytestmark = pytest.mark.skipif(not shm.available(), reason="no /dev/shm")


def _ours(prefix: str) -> list[str]:
    return [f for f in os.listdir(shm.SHM_DIR) if f.startswith(prefix)]


def test_segment_roundtrip_is_recycled_after_the_tensor_dies() -> None:
    w = shm.ShmWriter()
    x = torch.randn(100_000)
    src = memoryview(x.numpy()).cast("B")
    try:
        name = w.write(src)
        y = torch.frombuffer(shm.read(name, src.nbytes, lambda fn: fn()), dtype=torch.float32)
        assert torch.equal(y, x)
        assert w.write(src) != name  # still held by y: a second segment
        del y
        gc.collect()
        assert w.write(src) == name and w.reused == 1  # handed back, reclaimed
    finally:
        w.close()
    assert _ours(w._prefix) == []


def test_writer_close_unlinks_segments_never_opened() -> None:
    w = shm.ShmWriter()
    w.write(memoryview(bytes(300_000)))
    assert len(_ours(w._prefix)) == 1
    w.close()
    assert _ours(w._prefix) == []


def test_reader_refuses_foreign_names() -> None:
    with pytest.raises(ValueError, match="not an nbrpc segment"):
        shm.read("../etc/passwd", 10, lambda fn: fn())


def test_segment_names_are_signed() -> None:
    key = new_key()
    frames = pack(key, 1, 0, 9, b"p", [b"abc", ShmRef("nbrpc-1-aa-0", 1 << 20)])
    env = unpack(key, frames)
    assert env.buffers[1] == ShmRef("nbrpc-1-aa-0", 1 << 20) and bytes(env.buffers[0]) == b"abc"
    forged = list(frames)
    forged[0] = frames[0].replace(b"nbrpc-1-aa-0", b"nbrpc-1-bb-0")
    with pytest.raises(BadMessage):
        unpack(key, forged)
    stuffed = list(frames)
    stuffed[2] = b"data where none belongs"
    with pytest.raises(BadMessage):
        unpack(key, stuffed)


def test_segments_of_dead_processes_are_swept() -> None:
    import subprocess
    import sys

    # a process that creates a segment and dies without cleaning up
    code = ("import os, sys; from nbrpc.transport import shm; w = shm.ShmWriter(); "
            "print(w.write(memoryview(bytes(300_000)))); sys.stdout.flush(); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    name = out.stdout.strip()
    assert os.path.exists(os.path.join(shm.SHM_DIR, name)), out.stderr
    mine = shm.ShmWriter()  # starting a writer sweeps the orphans
    try:
        assert not os.path.exists(os.path.join(shm.SHM_DIR, name))
    finally:
        mine.close()
