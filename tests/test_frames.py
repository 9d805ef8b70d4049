"""Framing and signing, with no sockets."""

from __future__ import annotations

import pytest

from nbrpc.transport import BadMessage, new_key, pack, unpack
from nbrpc.transport.frames import SIG_LEN


def test_roundtrip_with_buffers() -> None:
    key = new_key()
    frames = pack(key, 1, 3, 42, b"payload", [b"abc", memoryview(bytearray(8))])
    assert len(frames) == 3  # one head frame, then one frame per buffer
    env = unpack(key, frames)
    assert (env.kind, env.sender, env.msg_id, bytes(env.payload)) == (1, 3, 42, b"payload")
    assert [bytes(b) for b in env.buffers] == [b"abc", bytes(8)]


def test_large_payload_roundtrip() -> None:
    key = new_key()
    payload = bytes(range(256)) * 1000
    assert bytes(unpack(key, pack(key, 2, 0, 1, payload)).payload) == payload


def _flip(data: bytes, i: int) -> bytes:
    return data[:i] + bytes([data[i] ^ 1]) + data[i + 1:]


@pytest.mark.parametrize("tamper", ["sig", "header", "payload", "wrong-key", "buffer-length"])
def test_tampered_message_is_rejected(tamper: str) -> None:
    key = new_key()
    frames = pack(key, 1, 0, 7, b"hello", [b"xyz"])
    head = frames[0]
    if tamper == "sig":
        frames[0] = bytes(SIG_LEN) + head[SIG_LEN:]
    elif tamper == "header":
        frames[0] = _flip(head, SIG_LEN + 8)  # inside the message id
    elif tamper == "payload":
        frames[0] = _flip(head, len(head) - 1)
    elif tamper == "wrong-key":
        frames = pack(new_key(), 1, 0, 7, b"hello", [b"xyz"])
    else:
        frames[1] = b"xyzw"
    with pytest.raises(BadMessage):
        unpack(key, frames)


@pytest.mark.parametrize("frames", [[], [b"x"], [b"\0" * 40]])
def test_malformed_messages_rejected(frames) -> None:
    with pytest.raises(BadMessage):
        unpack(new_key(), frames)


def test_buffer_count_mismatch_rejected() -> None:
    key = new_key()
    frames = pack(key, 1, 0, 7, b"p", [b"a", b"b"])
    with pytest.raises(BadMessage):
        unpack(key, frames[:-1])
