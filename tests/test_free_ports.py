"""The test harness's free ports (``conftest.free_ports``)."""

from __future__ import annotations

import socket

from conftest import _ephemeral_low, free_ports


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range() -> None:
    ports = free_ports(8)
    assert len(set(ports)) == 8
    assert all(1024 < p < _ephemeral_low() for p in ports), ports
    socks = []
    try:
        for p in ports:  # each free now (none held by the helper any more)
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", p))
    finally:
        for s in socks:
            s.close()
