"""Framing and signing, with no sockets."""

from __future__ import annotations

import pytest

from nbrpc.transport import BadMessage, new_key, pack, unpack


def test_roundtrip_with_buffers() -> None:
    key = new_key()
    frames = pack(key, 1, 3, 42, b"payload", [b"abc", memoryview(bytearray(8))])
    env = unpack(key, frames)
    assert (env.kind, env.sender, env.msg_id, env.payload) == (1, 3, 42, b"payload")
    assert [bytes(b) for b in env.buffers] == [b"abc", bytes(8)]


def test_large_payload_uses_incremental_mac() -> None:
    key = new_key()
    payload = bytes(range(256)) * 1000
    assert unpack(key, pack(key, 2, 0, 1, payload)).payload == payload


@pytest.mark.parametrize("tamper", ["sig", "header", "payload", "wrong-key", "buffer-length"])
def test_tampered_message_is_rejected(tamper: str) -> None:
    key = new_key()
    frames = pack(key, 1, 0, 7, b"hello", [b"xyz"])
    if tamper == "sig":
        frames[0] = bytes(32)
    elif tamper == "header":
        frames[1] = frames[1][:-1] + bytes([frames[1][-1] ^ 1])
    elif tamper == "payload":
        frames[2] = b"hellO"
    elif tamper == "wrong-key":
        frames = pack(new_key(), 1, 0, 7, b"hello", [b"xyz"])
    else:
        frames[3] = b"xyzw"
    with pytest.raises(BadMessage):
        unpack(key, frames)


def test_missing_frames_rejected() -> None:
    with pytest.raises(BadMessage):
        unpack(new_key(), [b"x", b"y"])


def test_buffer_count_mismatch_rejected() -> None:
    key = new_key()
    frames = pack(key, 1, 0, 7, b"p", [b"a", b"b"])
    with pytest.raises(BadMessage):
        unpack(key, frames[:-1])
