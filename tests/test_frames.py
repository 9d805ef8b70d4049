"""Framing and signing, with no sockets."""

from __future__ import annotations

import pytest

from nbrpc.transport import BadMessage, new_key, pack, unpack
from nbrpc.transport.frames import SIG_LEN, SMALL_PAYLOAD, ReplayGuard


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


def test_large_payload_has_its_own_mac_and_is_checked() -> None:
    key = new_key()
    payload = bytes(SMALL_PAYLOAD + 1)
    frames = pack(key, 1, 0, 7, payload)
    assert unpack(key, frames).payload.nbytes == len(payload)
    head = bytearray(frames[0])
    head[-1] ^= 1  # the payload changed in flight: its own MAC catches it
    with pytest.raises(BadMessage, match="payload MAC"):
        unpack(key, [bytes(head)])


def test_a_large_frame_without_the_key_costs_one_small_mac(monkeypatch) -> None:
    import nbrpc.transport.frames as frames_mod

    signed: list[int] = []
    real = frames_mod._sign
    monkeypatch.setattr(frames_mod, "_sign", lambda k, b: signed.append(len(b)) or real(k, b))
    key = new_key()
    garbage = [bytes(32 << 20)]  # 32 MB of zeros: header length 0, no DIGEST flag
    with pytest.raises(BadMessage, match="framing"):
        unpack(key, garbage)
    forged = pack(new_key(), 1, 0, 7, bytes(32 << 20))  # well framed, another key
    with pytest.raises(BadMessage, match="bad signature"):
        unpack(key, forged)
    assert max(signed[1:]) < 1024, signed  # (signed[0]: the forger's own payload MAC)


def test_declared_size_above_the_limit_is_refused_before_the_payload_mac() -> None:
    key = new_key()
    frames = pack(key, 1, 0, 7, bytes(SMALL_PAYLOAD * 2))
    with pytest.raises(BadMessage, match="too large"):
        unpack(key, frames, max_size=SMALL_PAYLOAD)


def test_replay_guard_accepts_each_message_once_in_any_order() -> None:
    g = ReplayGuard(max_age=60, window=64)
    now = 1000.0
    assert [g.check(1, s, now, now) for s in (3, 1, 2, 5, 4)] == [None] * 5
    assert [g.check(1, s, now, now) for s in (1, 5, 3)] == ["replayed"] * 3
    assert g.check(1, 200, now, now) is None  # far ahead: the window moves
    assert g.check(1, 100, now, now) == "replayed"  # below the window: refused
    assert g.check(2, 1, now, now) is None  # another incarnation has its own numbers
    assert g.check(3, 1, now - 61, now) == "stale" and g.check(3, 1, now + 61, now) == "stale"
    assert g.check(1, 2**63, now, now) is None  # no huge shift


def test_replay_guard_forgets_senders_only_after_their_messages_are_stale() -> None:
    g = ReplayGuard(max_age=10, max_senders=100)
    for inc in range(100):
        assert g.check(inc, 1, 0.0, 0.0) is None
    assert g.check(500, 1, 5.0, 5.0) is None  # full: the oldest goes
    assert len(g._seen) == 100
    assert g.check(7, 1, 5.0, 5.0) == "replayed"  # not forgotten yet
    assert g.check(600, 1, 20.0, 20.0) is None  # 20 s on: everything older forgotten
    assert g.check(7, 1, 0.0, 20.0) == "stale"  # and what it sent is refused as stale
