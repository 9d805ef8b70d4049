"""Framing and signing of nbrpc messages: pure functions, no sockets.

A message is one *head* frame followed by one frame per buffer, as sent by a
DEALER socket (the receiving ROUTER adds the connection identity in front,
which the I/O thread strips). The head is one frame, not three, because each
frame costs a separate pyzmq call on both sides.

=====  =========  ===========================================================
frame  part       contents
=====  =========  ===========================================================
0      head       signature ‖ header ‖ payload:

                  * signature: 32 bytes, HMAC-SHA256(key, header ‖ payload)
                  * header: ``<BBBxiQII`` version, kind, flags, sender id,
                    message id, n_buffers, header length; then n_buffers ×
                    ``<Q`` buffer lengths; with flag SHM, then per buffer a
                    ``<B`` name length (0: inline) and the name of the
                    shared-memory segment holding it
                  * payload: opaque bytes (the agent puts a pickle here)
1…     buffers    raw tensor bytes, one frame each, sent without copying (an
                  empty frame for a buffer that travels in shared memory)
=====  =========  ===========================================================

The signature covers everything that will be unpickled (header and payload)
and, through the header, the length of every buffer and the name of every
shared-memory segment. Buffer contents are raw numbers that are never
unpickled; leaving them out of the MAC keeps a 64 MB tensor from paying
~40 ms of SHA-256. A message whose signature does not verify is dropped
before anything in it is parsed.
"""

from __future__ import annotations

import hmac
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass

VERSION = 2
SIG_LEN = 32
FLAG_SHM = 1
_FIXED = struct.Struct("<BBBxiQII")
_LEN = struct.Struct("<Q")

Buffer = bytes | memoryview | bytearray


@dataclass(frozen=True, slots=True)
class ShmRef:
    """A buffer that travels in a shared-memory segment rather than a frame."""

    name: str
    nbytes: int


# One keyed HMAC per key, copied for each message. ``hmac.digest()`` releases
# the GIL around OpenSSL even for a 100-byte message, and with the agent's
# other threads waiting, getting it back cost ~500 us (measured) instead of
# the 1 us the MAC takes; ``copy()/update()/digest()`` keep the GIL for
# messages under 2 KiB.
_KEYED: dict[bytes, hmac.HMAC] = {}


def _sign(key: bytes, body: Buffer) -> bytes:
    keyed = _KEYED.get(key)
    if keyed is None:
        if len(_KEYED) > 64:  # keys of past groups: bounded
            _KEYED.clear()
        keyed = _KEYED[key] = hmac.new(key, digestmod="sha256")
    h = keyed.copy()
    h.update(body)
    return h.digest()


class BadMessage(Exception):
    """A message failed its signature or framing check (internal to transport)."""


@dataclass(slots=True)
class Envelope:
    """A verified message: who sent it, what kind, and its unparsed parts."""

    kind: int
    flags: int
    sender: int
    msg_id: int
    payload: memoryview
    buffers: list  # zmq.Frame / memoryview / bytes / ShmRef


def new_key() -> bytes:
    """A fresh random 32-byte group key."""
    return secrets.token_bytes(32)


def pack(
    key: bytes,
    kind: int,
    sender: int,
    msg_id: int,
    payload: bytes,
    buffers: Sequence[Buffer | ShmRef] = (),
    flags: int = 0,
) -> list:
    """Frames for one message, signed with ``key``.

    >>> key = new_key()
    >>> env = unpack(key, pack(key, 1, 0, 7, b"payload", [b"abc"]))
    >>> env.msg_id, bytes(env.payload), bytes(env.buffers[0])
    (7, b'payload', b'abc')
    """
    tail = b""
    if buffers:
        tail = b"".join(_LEN.pack(_nbytes(b)) for b in buffers)
        if any(type(b) is ShmRef for b in buffers):
            flags |= FLAG_SHM
            names = [b.name.encode() if type(b) is ShmRef else b"" for b in buffers]
            tail += b"".join(bytes([len(n)]) + n for n in names)
            buffers = [b"" if type(b) is ShmRef else b for b in buffers]
    header = _FIXED.pack(VERSION, kind, flags, sender, msg_id, len(buffers),
                         _FIXED.size + len(tail)) + tail
    body = header + payload
    return [_sign(key, body) + body, *buffers]


def _nbytes(b: Buffer | ShmRef) -> int:
    return b.nbytes if type(b) is ShmRef else memoryview(b).nbytes


def unpack(key: bytes, frames: Sequence) -> Envelope:
    """Verify and split frames (``[head, *buffers]``).

    Raises BadMessage when the signature or the framing is wrong; nothing of
    the message has been interpreted at that point.
    """
    if not frames:
        raise BadMessage("empty message")
    head = memoryview(frames[0])
    if head.nbytes < SIG_LEN + _FIXED.size:
        raise BadMessage("short head frame")
    body = head[SIG_LEN:]
    if not hmac.compare_digest(head[:SIG_LEN], _sign(key, body)):
        raise BadMessage("bad signature")
    version, kind, flags, sender, msg_id, n, header_len = _FIXED.unpack_from(body)
    if version != VERSION:
        raise BadMessage(f"protocol version {version}, expected {VERSION}")
    buffers = list(frames[1:])
    lengths_end = _FIXED.size + n * _LEN.size
    if len(buffers) != n or header_len > body.nbytes or lengths_end > header_len or (
            header_len > lengths_end and not flags & FLAG_SHM):
        raise BadMessage("buffer count does not match the header")
    names = _shm_names(body, lengths_end, header_len, n) if flags & FLAG_SHM else None
    for i, b in enumerate(buffers):
        (want,) = _LEN.unpack_from(body, _FIXED.size + i * _LEN.size)
        if names and names[i]:
            if memoryview(b).nbytes:
                raise BadMessage("a shared-memory buffer also has frame data")
            buffers[i] = ShmRef(names[i], want)
        elif memoryview(b).nbytes != want:
            raise BadMessage("buffer length does not match the header")
    return Envelope(kind, flags, sender, msg_id, body[header_len:], buffers)


def _shm_names(body: memoryview, pos: int, end: int, n: int) -> list[str]:
    names = []
    for _ in range(n):
        if pos >= end:
            raise BadMessage("truncated shared-memory table")
        size = body[pos]
        names.append(bytes(body[pos + 1:pos + 1 + size]).decode("ascii", "replace"))
        pos += 1 + size
    if pos != end:
        raise BadMessage("trailing bytes after the shared-memory table")
    return names
