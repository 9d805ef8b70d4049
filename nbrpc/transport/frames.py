"""Framing and signing of nbrpc messages: pure functions, no sockets.

A message is a list of frames, as sent by a DEALER socket (the receiving
ROUTER adds the connection identity in front, which the I/O thread strips):

=====  ==========  ============================================================
frame  name        contents
=====  ==========  ============================================================
0      signature   32 bytes: HMAC-SHA256(key, header ‖ payload)
1      header      ``<BBBxiQI`` version, kind, flags, sender id, message id,
                   n_buffers; then n_buffers × ``<Q`` buffer lengths; with
                   flag SHM, then per buffer a ``<B`` name length (0: inline)
                   and the name of the shared-memory segment holding it
2      payload     opaque bytes (the agent puts a pickle here)
3…     buffers     raw tensor bytes, one frame each, sent without copying
                   (an empty frame for a buffer that travels in shared memory)
=====  ==========  ============================================================

The signature covers everything that will be unpickled (header and payload)
and, through the header, the length of every buffer. Buffer contents are raw
numbers that are never unpickled; leaving them out of the MAC keeps a 64 MB
tensor from paying ~40 ms of SHA-256. A message whose signature does not
verify is dropped before anything in it is parsed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass

VERSION = 1
SIG_LEN = 32
_HEAD = struct.Struct("<BBBxiQI")
_LEN = struct.Struct("<Q")
_DIGEST = hashlib.sha256
# Below this the payload is concatenated for one-shot hmac.digest (fastest);
# above it, hashed incrementally to avoid copying a large payload.
_ONESHOT_MAX = 1 << 16

Buffer = bytes | memoryview | bytearray


FLAG_SHM = 1


@dataclass(frozen=True, slots=True)
class ShmRef:
    """A buffer that travels in a shared-memory segment rather than a frame."""

    name: str
    nbytes: int


class BadMessage(Exception):
    """A message failed its signature or framing check (internal to transport)."""


@dataclass(slots=True)
class Envelope:
    """A verified message: who sent it, what kind, and its unparsed parts."""

    kind: int
    flags: int
    sender: int
    msg_id: int
    payload: bytes
    buffers: list  # zmq.Frame / memoryview / bytes: anything with the buffer protocol


def new_key() -> bytes:
    """A fresh random 32-byte group key."""
    return secrets.token_bytes(32)


def _mac(key: bytes, header: bytes, payload: Buffer) -> bytes:
    if len(payload) <= _ONESHOT_MAX:
        return hmac.digest(key, header + bytes(payload), "sha256")
    h = hmac.new(key, header, _DIGEST)
    h.update(payload)
    return h.digest()


def pack(
    key: bytes,
    kind: int,
    sender: int,
    msg_id: int,
    payload: bytes,
    buffers: Sequence[Buffer] = (),
    flags: int = 0,
) -> list:
    """Frames for one message, signed with ``key``."""
    shm = any(type(b) is ShmRef for b in buffers)
    if shm:
        flags |= FLAG_SHM
    header = _HEAD.pack(VERSION, kind, flags, sender, msg_id, len(buffers))
    if buffers:
        header += b"".join(_LEN.pack(_nbytes(b)) for b in buffers)
    if shm:
        names = [b.name.encode() if type(b) is ShmRef else b"" for b in buffers]
        header += b"".join(bytes([len(n)]) + n for n in names)
        buffers = [b"" if type(b) is ShmRef else b for b in buffers]
    return [_mac(key, header, payload), header, payload, *buffers]


def _nbytes(b: Buffer | ShmRef) -> int:
    return b.nbytes if type(b) is ShmRef else memoryview(b).nbytes


def unpack(key: bytes, frames: Sequence) -> Envelope:
    """Verify and split frames (``[sig, header, payload, *buffers]``).

    Raises BadMessage when the signature or the framing is wrong; nothing of
    the message has been interpreted at that point.
    """
    if len(frames) < 3:
        raise BadMessage(f"expected at least 3 frames, got {len(frames)}")
    sig, header, payload = bytes(frames[0]), bytes(frames[1]), frames[2]
    if len(header) < _HEAD.size:
        raise BadMessage("short header")
    if not hmac.compare_digest(sig, _mac(key, header, payload)):
        raise BadMessage("bad signature")
    version, kind, flags, sender, msg_id, n = _HEAD.unpack_from(header)
    if version != VERSION:
        raise BadMessage(f"protocol version {version}, expected {VERSION}")
    buffers = list(frames[3:])
    end = _HEAD.size + n * _LEN.size
    if len(buffers) != n or len(header) < end or (len(header) > end and not flags & FLAG_SHM):
        raise BadMessage("buffer count does not match the header")
    names = _shm_names(header, end, n) if flags & FLAG_SHM else [""] * n
    for i, b in enumerate(buffers):
        (want,) = _LEN.unpack_from(header, _HEAD.size + i * _LEN.size)
        if names[i]:
            if memoryview(b).nbytes:
                raise BadMessage("a shared-memory buffer also has frame data")
            buffers[i] = ShmRef(names[i], want)
        elif memoryview(b).nbytes != want:
            raise BadMessage("buffer length does not match the header")
    return Envelope(kind, flags, sender, msg_id, bytes(payload), buffers)


def _shm_names(header: bytes, pos: int, n: int) -> list[str]:
    names = []
    for _ in range(n):
        if pos >= len(header):
            raise BadMessage("truncated shared-memory table")
        size = header[pos]
        names.append(header[pos + 1:pos + 1 + size].decode("ascii", "replace"))
        pos += 1 + size
    if pos != len(header):
        raise BadMessage("trailing bytes after the shared-memory table")
    return names
