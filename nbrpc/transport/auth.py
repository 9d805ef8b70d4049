"""Who may connect: the group's connection token, its CURVE keys, ZAP answers.

Pure functions of the group key; the I/O loop (:mod:`.io`) applies them. A
connection is let in only if its PLAIN password is ``HMAC(key,
"nbrpc-connect")`` (which only key holders can compute, and which reveals
nothing about the key), or, with ``encrypt=True``, only if it completes CURVE's
handshake against the server key pair derived from the group key.

>>> token = connect_token(b"k" * 32)
>>> zap_answer([b"1.0", b"7", b"nbrpc", b"1.2.3.4", b"", b"PLAIN", b"nbrpc", token], token)
([b'1.0', b'7', b'200', b'OK', b'', b''], None)
>>> zap_answer([b"1.0", b"8", b"nbrpc", b"1.2.3.4", b"", b"PLAIN", b"nbrpc", b"x"], token)[1]
'1.2.3.4'
"""

from __future__ import annotations

import hashlib
import hmac

import zmq


def connect_token(key: bytes) -> bytes:
    """The PLAIN password that opens a connection to an agent of the group
    whose key is ``key`` (reveals nothing about the key itself)."""
    return hmac.new(key, b"nbrpc-connect", hashlib.sha256).hexdigest().encode()


def curve_keys(key: bytes) -> tuple[bytes, bytes, bytes, bytes]:
    """(server public, server secret, client public, client secret), Z85-encoded.
    The server pair is the group's (derived from its key); the client pair is
    this transport's own."""
    if not zmq.has("curve"):
        raise RuntimeError("encrypt=True needs libzmq with CURVE support (pyzmq's wheels "
                           "have it); this libzmq was built without libsodium")
    from zmq.utils import z85

    seed = hmac.new(key, b"nbrpc-curve-server", hashlib.sha256).digest()
    server_secret = z85.encode(seed)
    public, secret = zmq.curve_keypair()
    return zmq.curve_public(server_secret), server_secret, public, secret


def zap_answer(request: list[bytes], token: bytes) -> tuple[list[bytes], str | None]:
    """The reply to one ZAP request (RFC 27), and the refused peer's address
    (None when it is let in)."""
    version, request_id = request[0], request[1] if len(request) > 1 else b""
    # version, request id, domain, address, routing id, mechanism, user, password
    ok = (len(request) == 8 and version == b"1.0" and request[5] == b"PLAIN"
          and hmac.compare_digest(request[6], b"nbrpc")
          and hmac.compare_digest(request[7], token))
    refused = None if ok else (
        request[3].decode("ascii", "replace") if len(request) > 3 else "?")
    return [b"1.0", request_id, b"200" if ok else b"400", b"OK" if ok else b"no key",
            b"", b""], refused
