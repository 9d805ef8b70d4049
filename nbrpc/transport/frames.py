"""Framing and signing of nbrpc messages: pure functions, no sockets.

A message is one *head* frame followed by one frame per buffer, as sent by a
DEALER socket (the receiving ROUTER adds the connection identity in front,
which the I/O thread strips). The head is one frame, not three, because each
frame costs a separate pyzmq call on both sides.

=====  =========  ===========================================================
frame  part       contents
=====  =========  ===========================================================
0      head       signature ‖ header ‖ payload:

                  * signature: 32 bytes of HMAC-SHA256 under the group key,
                    over header ‖ payload; with flag DIGEST (payloads above
                    ``SMALL_PAYLOAD``) over the header alone, which then
                    holds the payload's own HMAC
                  * header: ``<BBBxiiQIIQQQd`` version, kind, flags, sender
                    id, destination id, message id, n_buffers, header length,
                    the sender's incarnation (random per transport), the
                    group's run (a random number the coordinator draws when
                    the group forms; 0 before a joiner has heard it), the
                    sender's message sequence number and its send time
                    (``time.time()``); with DIGEST
                    the 32-byte payload MAC; n_buffers × ``<Q`` buffer
                    lengths; with flag SHM, per buffer a ``<B`` name length
                    (0: inline) and the name of the shared-memory segment
                  * payload: opaque bytes (the agent puts a pickle here)
1…     buffers    raw tensor bytes, one frame each, sent without copying (an
                  empty frame for a buffer that travels in shared memory)
=====  =========  ===========================================================

What a receiver checks, cheapest first, so that a peer without the key costs
it about a microsecond per message whatever the message's size:

1. the fixed header's shape: a header length within ``MAX_HEADER``, and a
   payload above ``SMALL_PAYLOAD`` only with flag DIGEST (read before the MAC,
   used only to bound the work of step 2);
2. the signature, over at most ``SMALL_PAYLOAD`` + header bytes;
3. the declared sizes against the receiver's maximum message size;
4. with DIGEST, the payload's MAC (the only step that costs in proportion to
   the message, and only for a header the key holder signed).

The signature covers everything that will be unpickled and, through the
header, the length of every buffer and the name of every shared-memory
segment. Buffer contents are raw numbers that are never unpickled; leaving
them out keeps a 64 MB tensor from paying ~40 ms of SHA-256.

Replays: :class:`ReplayGuard` accepts each (incarnation, sequence number)
once and refuses messages sent more than ``max_age`` seconds ago, so a
recorded message cannot be played back to its recipient, now or later. The
signed destination and run keep it from being played to anyone else: the
receiving loop (:mod:`.io`) refuses a message signed for another member or
for another run of the group, before any of it is interpreted.

Over ``tcp://`` no frame is larger than ``CHUNK`` (:func:`split`,
:func:`join_layout`), so that the receiving socket's maximum frame size,
which libzmq applies before the handshake too, can stay small: a peer that
has not authenticated makes an agent hold at most ``CHUNK`` bytes per
connection.
"""

from __future__ import annotations

import hmac
import itertools
import os
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

VERSION = 4
SIG_LEN = 32
FLAG_SHM = 1
FLAG_DIGEST = 2
SMALL_PAYLOAD = 64 << 10  # above this the payload has its own MAC (flag DIGEST)
MAX_HEADER = 4 << 20  # buffer lengths and segment names: ~50 bytes a buffer
DEFAULT_MAX_MESSAGE = 4 << 30  # bytes a message may declare (payload + buffers)
CHUNK = 256 << 10  # the largest frame a tcp:// connection carries (see split)
MAX_FRAMES = 1 << 16  # frames per message: one head and one per buffer
_FIXED = struct.Struct("<BBBxiiQIIQQQd")
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
    """A message failed a check (internal to transport). ``reason`` is the
    counter it is dropped under: "bad signature", "framing", "too large"."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(slots=True)
class Envelope:
    """A verified message: who sent it, what kind, and its unparsed parts."""

    kind: int
    flags: int
    sender: int
    msg_id: int
    payload: memoryview
    buffers: list  # zmq.Frame / memoryview / bytes / ShmRef
    incarnation: int = 0
    seq: int = 0
    dest: int = 0
    run: int = 0
    sent_at: float = 0.0
    channel: Any = None  # the caller's own channel it came on (answer there), if any


def new_key() -> bytes:
    """A fresh random 32-byte group key."""
    return secrets.token_bytes(32)


class Sequencer:
    """A sender's identity for replay protection: a random incarnation and
    a counter (``next()`` on ``itertools.count`` is atomic under the GIL)."""

    __slots__ = ("incarnation", "_count")

    def __init__(self) -> None:
        self.incarnation = int.from_bytes(os.urandom(8), "little") or 1
        self._count = itertools.count(1)

    def next(self) -> int:
        return next(self._count)


def pack(
    key: bytes,
    kind: int,
    sender: int,
    msg_id: int,
    payload: bytes,
    buffers: Sequence[Buffer | ShmRef] = (),
    flags: int = 0,
    *,
    incarnation: int = 0,
    seq: int = 0,
    sent_at: float | None = None,
    dest: int = 0,
    run: int = 0,
) -> list:
    """Frames for one message from ``sender`` to ``dest``, signed with ``key``.

    >>> key = new_key()
    >>> env = unpack(key, pack(key, 1, 0, 7, b"payload", [b"abc"], dest=2, run=5))
    >>> env.msg_id, bytes(env.payload), bytes(env.buffers[0]), env.dest, env.run
    (7, b'payload', b'abc', 2, 5)
    """
    tail = b""
    if buffers:
        tail = b"".join(_LEN.pack(_nbytes(b)) for b in buffers)
        if any(type(b) is ShmRef for b in buffers):
            flags |= FLAG_SHM
            names = [b.name.encode() if type(b) is ShmRef else b"" for b in buffers]
            tail += b"".join(bytes([len(n)]) + n for n in names)
            buffers = [b"" if type(b) is ShmRef else b for b in buffers]
    if len(payload) > SMALL_PAYLOAD:
        flags |= FLAG_DIGEST
        tail = _sign(key, payload) + tail
    header = _FIXED.pack(VERSION, kind, flags, sender, dest, msg_id, len(buffers),
                         _FIXED.size + len(tail), incarnation, run, seq,
                         time.time() if sent_at is None else sent_at) + tail
    if flags & FLAG_DIGEST:
        return [_sign(key, header) + header + payload, *buffers]
    body = header + payload
    return [_sign(key, body) + body, *buffers]


def _nbytes(b: Buffer | ShmRef) -> int:
    return b.nbytes if type(b) is ShmRef else memoryview(b).nbytes


def unpack(key: bytes, frames: Sequence, max_size: int = DEFAULT_MAX_MESSAGE) -> Envelope:
    """Verify and split frames (``[head, *buffers]``).

    Raises BadMessage when a check fails; nothing of the message has been
    interpreted at that point, and a message from a peer without the key has
    cost at most one MAC over ``SMALL_PAYLOAD`` bytes.
    """
    if not frames:
        raise BadMessage("framing", "empty message")
    head = memoryview(frames[0])
    if head.nbytes < SIG_LEN + _FIXED.size:
        raise BadMessage("framing", "short head frame")
    body = head[SIG_LEN:]
    # (unauthenticated until the MAC below: used only to bound the work)
    flags, header_len = body[2], _FIXED.unpack_from(body)[7]
    if not _FIXED.size <= header_len <= min(body.nbytes, MAX_HEADER):
        raise BadMessage("framing", "header length out of range")
    if flags & FLAG_DIGEST:
        signed = body[:header_len]
    elif body.nbytes - header_len > SMALL_PAYLOAD:
        raise BadMessage("framing", "a large payload without its own MAC")
    else:
        signed = body
    if not hmac.compare_digest(head[:SIG_LEN], _sign(key, signed)):
        raise BadMessage("bad signature")
    (version, kind, flags, sender, dest, msg_id, n, header_len, incarnation, run, seq,
     sent_at) = _FIXED.unpack_from(body)
    if version != VERSION:
        raise BadMessage("framing", f"protocol version {version}, expected {VERSION}")
    pos = _FIXED.size
    if flags & FLAG_DIGEST:
        digest, pos = body[pos:pos + SIG_LEN], pos + SIG_LEN
    buffers = list(frames[1:])
    lengths_end = pos + n * _LEN.size
    if len(buffers) != n or lengths_end > header_len or (
            header_len > lengths_end and not flags & FLAG_SHM):
        raise BadMessage("framing", "buffer count does not match the header")
    lengths = [_LEN.unpack_from(body, pos + i * _LEN.size)[0] for i in range(n)]
    payload = body[header_len:]
    if payload.nbytes + sum(lengths) > max_size:
        raise BadMessage("too large", f"{payload.nbytes + sum(lengths)} bytes declared, "
                                      f"at most {max_size} accepted")
    if flags & FLAG_DIGEST and not hmac.compare_digest(digest, _sign(key, payload)):
        raise BadMessage("bad signature", "payload MAC")
    names = _shm_names(body, lengths_end, header_len, n) if flags & FLAG_SHM else None
    for i, b in enumerate(buffers):
        want = lengths[i]
        if names and names[i]:
            if memoryview(b).nbytes:
                raise BadMessage("framing", "a shared-memory buffer also has frame data")
            buffers[i] = ShmRef(names[i], want)
        elif memoryview(b).nbytes != want:
            raise BadMessage("framing", "buffer length does not match the header")
    return Envelope(kind, flags, sender, msg_id, payload, buffers, incarnation, seq, dest,
                    run, sent_at)


def _shm_names(body: memoryview, pos: int, end: int, n: int) -> list[str]:
    names = []
    for _ in range(n):
        if pos >= end:
            raise BadMessage("framing", "truncated shared-memory table")
        size = body[pos]
        names.append(bytes(body[pos + 1:pos + 1 + size]).decode("ascii", "replace"))
        pos += 1 + size
    if pos != end:
        raise BadMessage("framing", "trailing bytes after the shared-memory table")
    return names


class ReplayGuard:
    """Accepts each (incarnation, sequence number) once, and nothing sent
    more than ``max_age`` seconds ago (or ahead: clocks of several hosts may
    differ by less than that).

    Per sending incarnation it keeps the highest sequence number seen and a
    bitmap of the ``window`` numbers below it: a sender's threads may put
    messages on the wire slightly out of order, never by thousands.
    Incarnations unheard of for ``max_age`` are forgotten (the age check
    refuses their messages from then on); at most ``max_senders`` are kept.

    >>> g = ReplayGuard()
    >>> now = time.time()
    >>> g.check(7, 1, now, now), g.check(7, 1, now, now), g.check(7, 2, now - 999, now)
    (None, 'replayed', 'stale')
    """

    def __init__(self, max_age: float = 300.0, window: int = 4096,
                 max_senders: int = 4096) -> None:
        self.max_age, self.window, self.max_senders = max_age, window, max_senders
        self._mask = (1 << window) - 1
        self._seen: OrderedDict[int, list] = OrderedDict()  # incarnation -> [hi, bits, last]

    def check(self, incarnation: int, seq: int, sent_at: float, now: float) -> str | None:
        """None when the message is fresh (and remember it); else the reason."""
        if not -self.max_age <= now - sent_at <= self.max_age:
            return "stale"
        seen = self._seen.get(incarnation)
        if seen is None:
            self._forget_old(now)
            self._seen[incarnation] = [seq, 1, now]
            return None
        hi, bits = seen[0], seen[1]
        if seq > hi:
            ahead = seq - hi
            seen[0], seen[1] = seq, ((bits << ahead) | 1) & self._mask if ahead < self.window else 1
        else:
            back = hi - seq
            if back >= self.window or bits >> back & 1:
                return "replayed"
            seen[1] = bits | 1 << back
        seen[2] = now
        if len(self._seen) > 1:
            self._seen.move_to_end(incarnation)
        return None

    def _forget_old(self, now: float) -> None:
        seen = self._seen
        while seen:
            oldest = next(iter(seen.values()))
            if now - oldest[2] <= self.max_age and len(seen) < self.max_senders:
                return
            seen.popitem(last=False)


def split(frames: list, chunk: int = CHUNK) -> list:
    """The frames of one message as a ``tcp://`` connection carries them: the
    same frames when none is larger than ``chunk``; else an empty frame, a
    layout frame (``<Q`` per frame: its length) and each frame cut into parts
    of at most ``chunk`` bytes (views: nothing is copied). An empty frame
    never starts a message otherwise (a head frame is never empty).

    >>> split([b"head", b"abc"], chunk=4)
    [b'head', b'abc']
    >>> [bytes(p) for p in split([b"head", b"abcdefg"], chunk=4)]
    [b'', b'\\x04\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x07\\x00\\x00\\x00\\x00\\x00\\x00\\x00', b'head', b'abcd', b'efg']
    """
    views = [memoryview(f).cast("B") for f in frames]
    if all(v.nbytes <= chunk for v in views):
        return frames
    parts: list = [b"", b"".join(_LEN.pack(v.nbytes) for v in views)]
    for v in views:
        parts.extend(v[i:i + chunk] for i in range(0, v.nbytes, chunk))
    return parts


def layout(frame: Buffer, max_size: int) -> list[int]:
    """The frame lengths a layout frame (see :func:`split`) declares; raises
    BadMessage when it is malformed or declares more than ``max_size`` bytes
    (checked before anything is allocated for them).

    >>> layout(split([b"head", b"abcdefg"], chunk=4)[1], 100)
    [4, 7]
    >>> layout(_LEN.pack(1 << 40), 100)
    Traceback (most recent call last):
    ...
    nbrpc.transport.frames.BadMessage: too large: 1099511627776 bytes declared, at most 100...
    """
    view = memoryview(frame)
    n = view.nbytes // _LEN.size
    if not 0 < n <= MAX_FRAMES or view.nbytes % _LEN.size:
        raise BadMessage("framing", "malformed layout frame")
    lengths = [_LEN.unpack_from(view, i * _LEN.size)[0] for i in range(n)]
    if sum(lengths) > max_size:
        raise BadMessage("too large", f"{sum(lengths)} bytes declared, at most "
                                      f"{max_size} accepted")
    return lengths
