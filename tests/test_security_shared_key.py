"""Security tier: two local users who share ``NBRPC_SECRET_KEY`` (a documented set-up).

Rank 0 runs as root, rank 1 as a second local user (``nbrpc-attacker``, made
by :func:`conftest.local_user`; here it is simply the other user), both on
this host with the same key. Each user's Unix socket directory is 0700 and
each shared-memory segment 0600, so neither path works between them: the
peers must see that they run as different users (the identity each
publishes names its effective uid, see :mod:`nbrpc.transport.local`) and talk
over TCP with every byte by socket. Checked with the default options (Unix
sockets on) and with ``local_ipc=False`` (shared memory only): both ranks
exchange a 4 MB tensor each way, stay members of the group past the link
rule's timeout, and shut down cleanly, with nothing dropped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import zmq
from conftest import free_ports, local_user

import nbrpc

pytestmark = pytest.mark.security

OTHER = "nbrpc-attacker"
REPO = Path(nbrpc.__file__).resolve().parent.parent

RANK = """
import json, sys, time
import torch
from nbrpc import debug, rpc
rank, ipc = int(sys.argv[1]), sys.argv[2] == "1"
opts = rpc.TensorPipeRpcBackendOptions(local_ipc=ipc, rpc_timeout=20)
rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
t = torch.arange(1 << 20, dtype=torch.float32)  # 4 MB: shared memory, were it usable
ok = torch.equal(rpc.rpc_sync(f"w{1 - rank}", torch.add, args=(t, 1), timeout=20), t + 1)
time.sleep(2.5)  # past the link rule: a peer wrongly thought gone would be dead by now
snap = debug.snapshot()
members = sorted(m["name"] for m in snap["members"])
rpc.shutdown()
print(json.dumps({"ok": ok, "members": members, "dropped": snap["counters"]["dropped"]}))
"""


@pytest.mark.parametrize("ipc", [True, False], ids=["unix-sockets", "local_ipc=False"])
def test_two_users_sharing_a_key_talk_over_tcp(ipc: bool) -> None:
    uid, gid = local_user(OTHER)
    site = str(Path(zmq.__file__).resolve().parent.parent)  # (torch and pyzmq live there)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{site}:{REPO}", "HOME": "/nonexistent",
           "PYTHONDONTWRITEBYTECODE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_ports(1)[0]), "NBRPC_SECRET_KEY": os.urandom(24).hex()}
    python = "/usr/bin/python3"
    probe = subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                            python, "-c", "import torch, nbrpc.rpc"],
                           env=env, cwd="/", capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"{OTHER} cannot import torch and nbrpc with {python}: "
                    f"{probe.stderr.strip()[-300:]}")
    flag = "1" if ipc else "0"
    procs = [subprocess.Popen([sys.executable, "-c", RANK, "0", flag], env={**os.environ, **env},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
             subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                               python, "-c", RANK, "1", flag], env=env, cwd="/",
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, f"rank {procs.index(p)} failed:\n{err[-3000:]}"
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    for rank, out in enumerate(outs):
        assert out["ok"], f"rank {rank}'s tensor came back wrong"
        assert out["members"] == ["w0", "w1"], f"rank {rank} lost its peer: {out}"
        assert out["dropped"] == {}, f"rank {rank} dropped messages: {out['dropped']}"
