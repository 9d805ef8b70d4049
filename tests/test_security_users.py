"""Security tier: a second local user attacks our groups on a shared host.

The attacker is a real other user (``nbrpc-attacker``, created here when we
run as root and left in place; without root these tests skip). Its code runs
under ``setpriv --reuid/--regid --clear-groups`` with the standard library,
pyzmq and nbrpc's own ``frames.pack`` (loaded without the rest of nbrpc), so
that forged messages use the current frame format. What it tries:

=================  ===========================================================
attack             what must happen
=================  ===========================================================
forged key         knowing only the rendezvous address of a real tcp:// group
                   (two processes), it signs a REQUEST whose pickle would
                   write a marker, with a key derived from that address
                   alone: both ranks drop it as a bad signature, the
                   marker never appears, the group still answers, and the
                   victim's key file cannot be read
squatted file      it writes the file:// rendezvous file first, in a sticky
                   world-writable directory: rank 1 and rank 0 both refuse,
                   naming the attacker as the file's owner
symlinks           it plants links at predictable (PID-based) temporary names and
                   at the rendezvous path itself: rank 0 publishes through an
                   unpredictable name (the attacker's file stays empty and the
                   published file is unreadable to it), and neither rank
                   follows the link at the rendezvous path
=================  ===========================================================
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import free_ports, local_user, poll_or_fail, python_as

import nbrpc
from nbrpc import rpc
from nbrpc.agent.messages import REQUEST
from nbrpc.errors import RendezvousError

pytestmark = pytest.mark.security

ATTACKER = "nbrpc-attacker"
REPO = Path(nbrpc.__file__).resolve().parent.parent


@dataclass
class Attacker:
    """The second local user, and how to run Python as it."""

    uid: int
    gid: int
    python: str
    env: dict

    def run(self, code: str, *args: object, timeout: float = 20) -> dict:
        """Run ``code`` as the attacker; it prints one JSON line, returned here."""
        proc = subprocess.run(
            ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups",
             self.python, "-c", code, *map(str, args)],
            env=self.env, cwd="/", capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, f"attacker code failed:\n{proc.stderr}"
        return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def attacker() -> Attacker:
    uid, gid = local_user(ATTACKER)
    import zmq

    site = str(Path(zmq.__file__).resolve().parent.parent)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": site, "HOME": "/nonexistent",
           "PYTHONDONTWRITEBYTECODE": "1"}
    python, why = python_as(uid, gid, "import zmq", env)
    if python is None:
        pytest.skip(f"no Python with pyzmq that {ATTACKER} may run: {why}")
    return Attacker(uid, gid, python, env)


@pytest.fixture
def arena() -> Iterator[Path]:
    """A sticky world-writable directory, as /tmp is, that the attacker shares."""
    path = Path(tempfile.mkdtemp(prefix="nbrpc-arena-", dir="/tmp"))
    os.chmod(path, 0o1777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


# -- a. the forged key ---------------------------------------------------------------
VICTIM = r"""
import json, os, sys, time
from pathlib import Path
import nbrpc.debug
from nbrpc import rpc

rank, port, work = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])

def rejected():  # connections refused for want of the key, and messages not signed with it
    dropped = nbrpc.debug.snapshot(events=0)["counters"]["dropped"]
    return dropped.get("refused connection", 0) + dropped.get("bad signature", 0)

def both():
    return [rejected(), rpc.rpc_sync("victim1", rejected, timeout=10)]

opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=20)
rpc.init_rpc(f"victim{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
if rank == 0:
    members = nbrpc.debug.snapshot(events=0)["members"]
    before = both()
    (work / "ready.tmp").write_text(json.dumps(
        {"addresses": [m["address"] for m in members], "before": before}))
    os.replace(work / "ready.tmp", work / "ready.json")
    deadline = time.monotonic() + 25
    while not (work / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    while time.monotonic() < deadline:  # the attacker's messages have arrived
        after = both()
        if all(a > b for a, b in zip(after, before)):
            break
        time.sleep(0.05)
    time.sleep(0.2)  # (had one been executed, its marker would be there by now)
    answer = rpc.rpc_sync("victim1", pow, args=(2, 5), timeout=10)
    (work / "result.json").write_text(json.dumps(
        {"before": before, "after": after, "answer": answer}))
rpc.shutdown()
"""

FORGE = r"""
import hashlib, hmac, json, os, pickle, secrets, sys, types
pkg, port, kind, marker, key_file, *addresses = sys.argv[1:]
for name, sub in (("nbrpc", ""), ("nbrpc.transport", "transport")):  # frames.py, not torch
    module = types.ModuleType(name)
    module.__path__ = [os.path.join(pkg, sub)]
    sys.modules[name] = module
from nbrpc.transport.frames import pack
import zmq

class Evil:
    def __reduce__(self):
        return exec, (f"open({marker!r}, 'w').write('a forged message was executed')",)

key = hashlib.sha256(f"nbrpc-group:127.0.0.1:{port}".encode()).digest()  # anyone can
token = hmac.new(key, b"nbrpc-connect", hashlib.sha256).hexdigest().encode()  # (the same way)
payload = pickle.dumps(Evil(), protocol=5)
ctx = zmq.Context()
for i, address in enumerate(addresses):
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.setsockopt(zmq.PLAIN_USERNAME, b"nbrpc")
    sock.setsockopt(zmq.PLAIN_PASSWORD, token)
    sock.connect(address)
    sock.send_multipart(pack(key, int(kind), 0, 10**9 + i, payload,
                             incarnation=secrets.randbits(62) + 1, seq=1))
    sock.close()
ctx.term()
try:
    open(key_file).read()
    stolen = "read"
except OSError as e:
    stolen = type(e).__name__
print(json.dumps({"sent": len(addresses), "key_file": stolen}))
"""


def test_forged_address_key_is_dropped_and_the_key_file_is_private(
        attacker: Attacker, tmp_path: Path) -> None:
    home = Path(tempfile.mkdtemp(prefix="nbrpc-home-", dir="/tmp"))
    os.chmod(home, 0o755)  # a usual home: others may look in, as the attacker will
    work = tmp_path / "work"
    work.mkdir()
    marker = work / "forged-marker"
    (port,) = free_ports(1)
    env = {k: v for k, v in os.environ.items()
           if k not in ("XDG_RUNTIME_DIR", "NBRPC_SECRET_KEY", "NBRPC_KEY_FILE")}
    env.update(HOME=str(home), PYTHONPATH=str(REPO))
    victims = [subprocess.Popen([sys.executable, "-c", VICTIM, str(rank), str(port), str(work)],
                                env=env, cwd=str(work), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
               for rank in (0, 1)]
    try:
        poll_or_fail(lambda: (work / "ready.json").exists()
                     or any(v.poll() is not None for v in victims), 30, "the group to form")
        assert (work / "ready.json").exists(), [v.communicate()[0][-2000:] for v in victims]
        ready = json.loads((work / "ready.json").read_text())
        key_file = home / ".local" / "share" / "nbrpc" / "secret.key"
        seen = attacker.run(FORGE, REPO / "nbrpc", port, REQUEST, marker, key_file,
                            *ready["addresses"])
        (work / "go").touch()
        outs = [v.communicate(timeout=30)[0] for v in victims]
    finally:
        for v in victims:
            if v.poll() is None:
                v.kill()
                v.wait(5)
    try:
        assert not marker.exists(), "the forged message was unpickled on a rank"
        assert [v.returncode for v in victims] == [0, 0], [o[-2000:] for o in outs]
        result = json.loads((work / "result.json").read_text())
        assert result["answer"] == 32  # the group still answers
        assert seen["sent"] == 2
        assert all(a > b for a, b in zip(result["after"], result["before"])), (
            "each rank should have refused the forger (its connection, or its signature)",
            result)
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        assert stat.S_IMODE(key_file.parent.stat().st_mode) == 0o700
        assert seen["key_file"] == "PermissionError", seen
    finally:
        shutil.rmtree(home, ignore_errors=True)


# -- b. the squatted rendezvous file --------------------------------------------------
SQUAT = r"""
import json, os, sys
path = sys.argv[1]
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
os.write(fd, json.dumps({"address": "tcp://127.0.0.1:9", "key": "ab" * 32}).encode())
os.close(fd)
os.chmod(path, 0o644)
print(json.dumps({"uid": os.getuid()}))
"""


def _file_options(record: Path) -> rpc.TensorPipeRpcBackendOptions:
    """file:///X for the rendezvous file ``record`` (X.nbrpc: nbrpc publishes beside
    X, which c10d's FileStore may use)."""
    assert record.name.endswith(".nbrpc")
    return rpc.TensorPipeRpcBackendOptions(init_method=f"file://{str(record)[:-6]}",
                                           rpc_timeout=5)


def test_squatted_rendezvous_file_is_refused_by_every_rank(attacker: Attacker,
                                                           arena: Path) -> None:
    path = arena / "rendezvous.nbrpc"  # the file rank 0 publishes
    assert attacker.run(SQUAT, path)["uid"] == attacker.uid
    planted = path.read_bytes()
    for rank in (1, 0):
        t0 = time.monotonic()
        with pytest.raises(RendezvousError, match=f"owned by uid {attacker.uid} "
                                                  rf"\({ATTACKER}\), not you"):
            rpc.init_rpc(f"victim{rank}", rank=rank, world_size=2,
                         rpc_backend_options=_file_options(path))
        assert time.monotonic() - t0 < 3, "refused only after waiting"
    assert path.read_bytes() == planted and path.stat().st_uid == attacker.uid


# -- c. symlinks ------------------------------------------------------------------------
PLANT = r"""
import json, os, sys
path, victim_pid, at_path = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
loot = path + ".loot"
fd = os.open(loot, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
if at_path:  # what a joiner that follows the link would read: the attacker's group
    os.write(fd, json.dumps({"address": "tcp://127.0.0.1:9", "key": "ab" * 32}).encode())
os.close(fd)
os.chmod(loot, 0o666)
if at_path:
    os.symlink(loot, path)
else:
    for pid in range(max(1, victim_pid - 30), victim_pid + 30):  # PID-based temp names
        os.symlink(loot, f"{path}.{pid}.tmp")
print(json.dumps({"loot": loot}))
"""

READ = r"""
import json, sys
try:
    open(sys.argv[1]).read()
    print(json.dumps({"read": "ok"}))
except OSError as e:
    print(json.dumps({"read": type(e).__name__}))
"""


def test_symlinks_at_temporary_names_do_not_receive_the_key(attacker: Attacker,
                                                            arena: Path) -> None:
    path = arena / "rendezvous.nbrpc"  # the file rank 0 publishes
    loot = Path(attacker.run(PLANT, path, os.getpid(), 0)["loot"])
    rpc.init_rpc("victim0", rank=0, world_size=None, rpc_backend_options=_file_options(path))
    try:
        assert loot.read_bytes() == b"", "the rendezvous (and its key) went into the link"
        st = os.lstat(path)
        assert stat.S_ISREG(st.st_mode) and st.st_uid == 0
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert attacker.run(READ, path)["read"] == "PermissionError"
    finally:
        rpc.shutdown()
    assert loot.read_bytes() == b""


def test_symlink_at_the_rendezvous_path_is_refused(attacker: Attacker, arena: Path) -> None:
    path = arena / "rendezvous.nbrpc"  # the file rank 0 publishes
    loot = Path(attacker.run(PLANT, path, os.getpid(), 1)["loot"])
    planted = loot.read_bytes()
    with pytest.raises(RendezvousError, match="symbolic link"):
        rpc.init_rpc("victim1", rank=1, world_size=2, rpc_backend_options=_file_options(path))
    with pytest.raises(RendezvousError, match=f"owned by uid {attacker.uid}"):
        rpc.init_rpc("victim0", rank=0, world_size=2, rpc_backend_options=_file_options(path))
    assert loot.read_bytes() == planted and path.is_symlink()
