"""init_method parsing, the group keys and the file:// rendezvous, with no agents.

Every test runs with HOME in its own tmp_path and no XDG_RUNTIME_DIR,
NBRPC_KEY_FILE or NBRPC_SECRET_KEY, so the real per-user key is never touched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import multiprocessing
import os
import socket
import stat
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest

from nbrpc.errors import RendezvousError
from nbrpc.rpc import rendezvous

OTHER_UID = 54321  # an owner that is not us (no such user needed: root can chown to any uid)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("XDG_RUNTIME_DIR", rendezvous.KEY_FILE_ENV, rendezvous.KEY_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29555")
    return home


def _key_file(home: Path) -> Path:
    return home / ".local" / "share" / "nbrpc" / "secret.key"


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_env_needs_master_addr_and_port(monkeypatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(RendezvousError, match="MASTER_ADDR and MASTER_PORT"):
        rendezvous.parse("env://", 1)


def test_env_and_tcp_agree_and_share_a_derived_key(monkeypatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    env0, env1 = rendezvous.parse("env://", 0), rendezvous.parse("env://", 3)
    tcp1 = rendezvous.parse("tcp://127.0.0.1:29555", 1)
    assert (env0.bind_host, env0.bind_port, env0.coordinator) == ("127.0.0.1", 29555, None)
    assert env1.coordinator == tcp1.coordinator == "tcp://127.0.0.1:29555"
    assert env1.bind_host == "127.0.0.1" and env1.bind_port == 0
    assert env0.key == env1.key == tcp1.key


@pytest.mark.parametrize("bad", ["ftp://x", "tcp://nohost", "file://", "env"])
def test_bad_init_methods_say_what_is_accepted(bad: str) -> None:
    with pytest.raises(RendezvousError):
        rendezvous.parse(bad, 1)


# -- the per-user secret and the derived key --------------------------------------
def test_key_file_is_created_private_in_a_private_directory(home: Path) -> None:
    key = rendezvous.parse("env://", 0).key
    path = _key_file(home)
    assert _mode(path.parent) == 0o700 and _mode(path) == 0o600
    assert path.stat().st_uid == os.geteuid()
    secret = path.read_text().strip()
    assert len(secret) == 64 and int(secret, 16) >= 0
    assert os.listdir(path.parent) == ["secret.key"]  # no temporary file left behind
    assert key == hmac.digest(secret.encode(), b"nbrpc-group:127.0.0.1:29555", "sha256")
    assert rendezvous.parse("env://", 1).key == key  # read back, not made again
    assert path.read_text().strip() == secret


def test_runtime_dir_is_not_used(home: Path, tmp_path: Path, monkeypatch) -> None:
    run = tmp_path / "run"  # per login session: ranks in two sessions would disagree
    run.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    rendezvous.parse("env://", 0)
    assert _key_file(home).exists() and not (run / "nbrpc").exists()


def _secret_after_barrier(barrier, out) -> None:  # (run in threads and in forked processes)
    barrier.wait()
    out.put(rendezvous.user_secret())


# Forked while other tests' threads run (Python 3.12 warns): the children only
# take the key file's lock and put into a queue, as ranks starting at once would.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_ranks_starting_at_once_agree_on_one_key(home: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    out, barrier = ctx.Queue(), ctx.Barrier(4 + 8)
    procs = [ctx.Process(target=_secret_after_barrier, args=(barrier, out)) for _ in range(4)]
    threads = [threading.Thread(target=_secret_after_barrier, args=(barrier, out))
               for _ in range(8)]
    for w in procs + threads:
        w.start()
    keys = [out.get(timeout=30) for _ in range(12)]
    for w in procs + threads:
        w.join(30)
    assert len(set(keys)) == 1, "two ranks started at once made two different keys"
    assert keys[0] == _key_file(home).read_text().strip().encode()
    assert os.listdir(_key_file(home).parent) == ["secret.key"]


def test_key_file_open_to_others_is_refused(home: Path) -> None:
    rendezvous.parse("env://", 0)
    os.chmod(_key_file(home), 0o644)
    with pytest.raises(RendezvousError, match="mode 0644.*chmod 600"):
        rendezvous.parse("env://", 1)


def test_key_directory_open_to_group_is_refused(home: Path) -> None:
    rendezvous.parse("env://", 0)
    os.chmod(_key_file(home).parent, 0o770)
    with pytest.raises(RendezvousError, match="mode 0770.*chmod 700"):
        rendezvous.parse("env://", 1)


@needs_root
@pytest.mark.parametrize("which", ["file", "directory"])
def test_key_file_or_directory_of_another_user_is_refused(home: Path, which: str) -> None:
    rendezvous.parse("env://", 0)
    target = _key_file(home) if which == "file" else _key_file(home).parent
    os.chown(target, OTHER_UID, OTHER_UID)
    with pytest.raises(RendezvousError, match=f"owned by uid {OTHER_UID}"):
        rendezvous.parse("env://", 1)


def test_key_file_behind_a_symlink_is_refused(home: Path, tmp_path: Path) -> None:
    planted = tmp_path / "planted.key"
    planted.write_text("a" * 64)
    os.chmod(planted, 0o600)
    _key_file(home).parent.mkdir(parents=True, mode=0o700)
    _key_file(home).symlink_to(planted)
    with pytest.raises(RendezvousError, match="symbolic link"):
        rendezvous.parse("env://", 0)


def test_derived_key_is_secret_and_differs_per_group(home: Path, tmp_path: Path,
                                                     monkeypatch) -> None:
    key = rendezvous.parse("tcp://127.0.0.1:29555", 1).key
    assert key != hashlib.sha256(b"nbrpc-group:127.0.0.1:29555").digest()  # anyone's key
    assert rendezvous.parse("tcp://127.0.0.1:29556", 1).key != key  # another group
    other_home = tmp_path / "other-home"
    other_home.mkdir()
    monkeypatch.setenv("HOME", str(other_home))  # another user (another secret)
    assert rendezvous.parse("tcp://127.0.0.1:29555", 1).key != key


def test_secret_key_from_environment_wins_over_the_key_file(home: Path, monkeypatch) -> None:
    from_file = rendezvous.parse("env://", 1).key
    assert _key_file(home).exists()
    monkeypatch.setenv(rendezvous.KEY_ENV, "0f4c8e9b1d2a7c3e5f60718293a4b5c6")
    os.chmod(_key_file(home), 0o644)  # (not even read: this would be refused)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a strong key: no warning
        key = rendezvous.parse("env://", 1).key
    assert key == hashlib.sha256(b"0f4c8e9b1d2a7c3e5f60718293a4b5c6").digest() != from_file


@pytest.mark.parametrize("weak", ["s3cret", "abababababababababab"])
def test_weak_secret_key_is_accepted_with_a_warning(weak: str, monkeypatch) -> None:
    monkeypatch.setenv(rendezvous.KEY_ENV, weak)
    with pytest.warns(UserWarning, match="NBRPC_SECRET_KEY is weak"):
        key = rendezvous.parse("env://", 1).key
    assert key == hashlib.sha256(weak.encode()).digest()


def test_joining_another_host_without_a_shared_key_is_refused(monkeypatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")  # TEST-NET-1: not this host
    with pytest.raises(RendezvousError, match=r"another host.*NBRPC_SECRET_KEY.*NBRPC_KEY_FILE"):
        rendezvous.parse("env://", 1)
    assert rendezvous.parse("env://", 0).key  # rank 0 cannot tell: it uses its key file


def test_joining_another_host_with_a_shared_key(home: Path, tmp_path: Path,
                                                monkeypatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "192.0.2.1")
    rank0 = rendezvous.parse("env://", 0).key  # on "the other host": its key file
    copy = tmp_path / "copy-of-rank0.key"
    copy.write_bytes(_key_file(home).read_bytes())
    os.chmod(copy, 0o600)
    monkeypatch.setenv("HOME", str(tmp_path / "nowhere"))  # this host: no key file of its own
    monkeypatch.setenv(rendezvous.KEY_FILE_ENV, str(copy))
    assert rendezvous.parse("env://", 1).key == rank0
    monkeypatch.setenv(rendezvous.KEY_FILE_ENV, str(tmp_path / "missing.key"))
    with pytest.raises(RendezvousError, match="does not exist"):
        rendezvous.parse("env://", 1)
    monkeypatch.delenv(rendezvous.KEY_FILE_ENV)
    monkeypatch.setenv(rendezvous.KEY_ENV, "0f4c8e9b1d2a7c3e5f60718293a4b5c6")
    assert rendezvous.parse("env://", 1).coordinator == "tcp://192.0.2.1:29555"


def test_an_address_of_this_host_is_not_another_host(monkeypatch) -> None:
    mine = rendezvous._local_ip_towards("192.0.2.1")
    if mine in ("0.0.0.0", "127.0.0.1"):
        pytest.skip("this host has no non-loopback address with a route")
    monkeypatch.setenv("MASTER_ADDR", mine)
    assert rendezvous.parse("env://", 1).coordinator == f"tcp://{mine}:29555"


# -- file:// ------------------------------------------------------------------------
@pytest.fixture
def shared(tmp_path: Path) -> Path:
    """The directory of the rendezvous file (apart from HOME)."""
    (tmp_path / "shared").mkdir()
    return tmp_path / "shared"


def test_publish_is_private_and_lookup_waits_for_it(shared) -> None:
    path = str(shared / "rdv")
    key = b"k" * 32
    threading.Timer(0.2, rendezvous.publish, (path, "tcp://127.0.0.1:1234", key)).start()
    t0 = time.monotonic()
    assert rendezvous.lookup(path, 5) == ("tcp://127.0.0.1:1234", key)
    assert time.monotonic() - t0 >= 0.15
    assert _mode(Path(path)) == 0o600
    assert os.listdir(shared) == ["rdv"]  # no temporary file left behind


def test_file_rendezvous_lives_beside_a_c10d_filestore_on_the_same_url(shared) -> None:
    """Programs give init_process_group and init_rpc one file:// URL (PyTorch's
    tests do): c10d's FileStore owns PATH; nbrpc publishes in PATH.nbrpc, and
    neither disturbs the other, in either order."""
    from torch.distributed import FileStore

    path = str(shared / "rdv")
    store = FileStore(path, 1)
    store.set("before", "1")
    rdv = rendezvous.parse(f"file://{path}", 0)
    assert rdv.file == path + ".nbrpc"
    key = b"k" * 32
    rendezvous.publish(rdv.file, "tcp://127.0.0.1:1234", key)
    store.set("after", "2")
    assert rendezvous.lookup(rendezvous.parse(f"file://{path}", 1).file, 1) == (
        "tcp://127.0.0.1:1234", key)
    assert store.get("before") == b"1" and store.get("after") == b"2"
    assert _mode(Path(rdv.file)) == 0o600


def test_a_static_groups_record_tells_a_dynamic_joiner_and_holds_no_address(shared) -> None:
    """Once a static group has joined, its rank 0's record keeps no address (a
    re-init must not find it) but says a static group runs there: a dynamic
    joiner gets PyTorch's error at once, a static one waits for a new rank 0,
    and a record whose process is gone is waited past. Rank 0 removes only
    its own record."""
    import subprocess

    path = str(shared / "rdv")
    rendezvous.publish(path, "tcp://127.0.0.1:1234", b"k" * 32)
    rendezvous.mark_static(path)
    assert "1234" not in Path(path).read_text() and _mode(Path(path)) == 0o600
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=r"^RPC group mixes statically and dynamically "
                       r"initialized members which is not supported\. A static group "
                       rf"\(init_rpc with a world_size\) runs at {path} \(its rank 0 is "
                       rf"process {os.getpid()} on"):
        rendezvous.lookup(path, 5, dynamic=True)
    assert time.monotonic() - t0 < 1
    with pytest.raises(RendezvousError, match="did not publish"):
        rendezvous.lookup(path, 0.2)  # a static joiner: no address here

    rendezvous.withdraw(path, "tcp://127.0.0.1:1234")
    assert not os.path.exists(path)  # ours (this process's mark): removed

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, timeout=30)
    Path(path).write_text(json.dumps({"static": True, "host": socket.gethostname(),
                                      "pid": int(gone.stdout)}))
    os.chmod(path, 0o600)
    with pytest.raises(RendezvousError, match="did not publish"):  # left behind: waited past
        rendezvous.lookup(path, 0.2, dynamic=True)
    rendezvous.withdraw(path, "tcp://127.0.0.1:1234")
    assert os.path.exists(path)  # another process's mark: left alone

    rendezvous.publish(path, "tcp://127.0.0.1:5678", b"k" * 32)  # a newer rank 0's
    rendezvous.withdraw(path, "tcp://127.0.0.1:1234")
    assert rendezvous.lookup(path, 1) == ("tcp://127.0.0.1:5678", b"k" * 32)
    rendezvous.withdraw(path, "tcp://127.0.0.1:5678")
    assert not os.path.exists(path)


def test_lookup_times_out_with_advice(shared) -> None:
    with pytest.raises(RendezvousError, match="delete it"):
        rendezvous.lookup(str(shared / "never"), 0.1)


def _squat(path: Path, mode: int = 0o600, owner: int | None = None) -> None:
    path.write_text('{"address": "tcp://127.0.0.1:9", "key": "' + "ab" * 32 + '"}')
    os.chmod(path, mode)
    if owner is not None:
        os.chown(path, owner, owner)


@needs_root
def test_lookup_refuses_a_file_of_another_user_at_once(shared) -> None:
    _squat(shared / "rdv", owner=OTHER_UID)
    t0 = time.monotonic()
    with pytest.raises(RendezvousError, match=f"owned by uid {OTHER_UID}.*not you"):
        rendezvous.lookup(str(shared / "rdv"), 5)
    assert time.monotonic() - t0 < 1


def test_lookup_refuses_a_file_open_to_others(shared) -> None:
    _squat(shared / "rdv", mode=0o644)
    with pytest.raises(RendezvousError, match="mode 0644"):
        rendezvous.lookup(str(shared / "rdv"), 5)


def test_lookup_refuses_a_symlink(shared) -> None:
    _squat(shared / "theirs")
    (shared / "rdv").symlink_to(shared / "theirs")
    with pytest.raises(RendezvousError, match="symbolic link"):
        rendezvous.lookup(str(shared / "rdv"), 5)


def test_lookup_refuses_a_fifo_without_blocking(shared) -> None:
    os.mkfifo(shared / "rdv", 0o600)
    with pytest.raises(RendezvousError, match="not a regular file"):
        rendezvous.lookup(str(shared / "rdv"), 5)


@needs_root
def test_publish_refuses_to_replace_a_file_of_another_user(shared) -> None:
    _squat(shared / "rdv", owner=OTHER_UID)
    with pytest.raises(RendezvousError, match=f"owned by uid {OTHER_UID}"):
        rendezvous.publish(str(shared / "rdv"), "tcp://127.0.0.1:1234", b"k" * 32)
    assert "6b6b" not in (shared / "rdv").read_text()  # theirs, untouched
    assert os.listdir(shared) == ["rdv"]


def test_publish_says_why_when_the_rename_is_refused(shared, monkeypatch) -> None:
    def sticky_tmp(src, dst):  # what a sticky /tmp answers for someone else's file
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(rendezvous.os, "replace", sticky_tmp)
    with pytest.raises(RendezvousError, match="will not publish"):
        rendezvous.publish(str(shared / "rdv"), "tcp://127.0.0.1:1234", b"k" * 32)
    assert os.listdir(shared) == []


def test_publish_ignores_symlinks_at_predictable_temporary_names(shared) -> None:
    loot = shared / "loot"
    loot.write_text("")
    path = shared / "rdv"
    for pid in range(max(1, os.getpid() - 5), os.getpid() + 5):
        Path(f"{path}.{pid}.tmp").symlink_to(loot)
    key = b"k" * 32
    rendezvous.publish(str(path), "tcp://127.0.0.1:1234", key)
    assert loot.read_text() == "", "the key was written through a planted symlink"
    assert stat.S_ISREG(os.lstat(path).st_mode) and _mode(path) == 0o600
    assert rendezvous.lookup(str(path), 1) == ("tcp://127.0.0.1:1234", key)
