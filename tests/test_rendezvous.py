"""init_method parsing and the file:// rendezvous, with no agents."""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest

from nbrpc.errors import RendezvousError
from nbrpc.rpc import rendezvous


def test_env_needs_master_addr_and_port(monkeypatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RendezvousError, match="MASTER_ADDR and MASTER_PORT"):
        rendezvous.parse("env://", 1)


def test_env_and_tcp_agree_and_share_a_derived_key(monkeypatch) -> None:
    monkeypatch.delenv(rendezvous.KEY_ENV, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "29555")
    env0, env1 = rendezvous.parse("env://", 0), rendezvous.parse("env://", 3)
    tcp1 = rendezvous.parse("tcp://127.0.0.1:29555", 1)
    assert (env0.bind_host, env0.bind_port, env0.coordinator) == ("127.0.0.1", 29555, None)
    assert env1.coordinator == tcp1.coordinator == "tcp://127.0.0.1:29555"
    assert env1.bind_host == "127.0.0.1" and env1.bind_port == 0
    assert env0.key == env1.key == tcp1.key


def test_secret_key_from_environment(monkeypatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29556")
    monkeypatch.delenv(rendezvous.KEY_ENV, raising=False)
    derived = rendezvous.parse("env://", 1).key
    monkeypatch.setenv(rendezvous.KEY_ENV, "s3cret")
    assert rendezvous.parse("env://", 1).key != derived


@pytest.mark.parametrize("bad", ["ftp://x", "tcp://nohost", "file://", "env"])
def test_bad_init_methods_say_what_is_accepted(bad: str, monkeypatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29557")
    with pytest.raises(RendezvousError):
        rendezvous.parse(bad, 1)


def test_publish_is_private_and_lookup_waits_for_it(tmp_path) -> None:
    path = str(tmp_path / "rdv")
    key = b"k" * 32
    threading.Timer(0.2, rendezvous.publish, (path, "tcp://127.0.0.1:1234", key)).start()
    t0 = time.monotonic()
    assert rendezvous.lookup(path, 5) == ("tcp://127.0.0.1:1234", key)
    assert time.monotonic() - t0 >= 0.15
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_lookup_times_out_with_advice(tmp_path) -> None:
    with pytest.raises(RendezvousError, match="delete it"):
        rendezvous.lookup(str(tmp_path / "never"), 0.1)
