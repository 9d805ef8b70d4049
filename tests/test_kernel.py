"""The notebook lifecycle through a real Jupyter kernel (jupyter_client), as a
person would drive it: magics, interrupt button, restart of a worker, stop and
start again, and the kernel killed outright."""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

pytestmark = pytest.mark.cluster


class Kernel:
    """A kernel and a client; :meth:`run` executes a cell and returns its stdout."""

    def __init__(self, cwd: str) -> None:
        from jupyter_client.manager import start_new_kernel

        self.km, self.kc = start_new_kernel(kernel_name="python3", cwd=cwd)

    def run(self, code: str, timeout: float = 60.0) -> tuple[str, dict[str, Any]]:
        out: list[str] = []

        self.displayed: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "display_data":
                self.displayed += list(msg["content"]["data"])
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                out.append("\n".join(msg["content"]["traceback"]))

        for _ in range(5):  # bounded
            reply = self.kc.execute_interactive(code, timeout=timeout, output_hook=hook)
            # ipykernel aborts the requests that reach it while it still clears its
            # queue after an error (stop_on_error): such a cell never ran; send it again
            if reply["content"]["status"] != "aborted":
                break
        return "".join(out), reply["content"]

    def ok(self, code: str, timeout: float = 60.0) -> str:
        out, content = self.run(code, timeout)
        assert content["status"] == "ok", f"cell failed:\n{code}\n{out}"
        return out

    def close(self) -> None:
        self.kc.stop_channels()
        if self.km.is_alive():
            self.km.shutdown_kernel(now=True)


@pytest.fixture
def kernel(tmp_path) -> Iterator[Kernel]:
    k = Kernel(str(tmp_path))
    try:
        yield k
    finally:
        k.close()


PIDS = """
import json, psutil
c = rpc_cluster
pids = [c._zygote.pid, c._controller_proc.pid] + [p.pid for w in c.workers.values() for p in w.procs]
pids += [p.pid for p in c._controller_proc.children(recursive=True)]  # its heart monitor
print(json.dumps(pids))
"""


LIVE_VIEWS_END = """
import threading, time
for _ in range(100):
    live = [t.name for t in threading.enumerate() if t.name == "nbrpc-live-view"]
    if not live: break
    time.sleep(0.05)
print(live)
"""


def _gone(pids: list[int], timeout: float) -> list[int]:
    """The pids still alive (not zombies) after waiting up to ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in pids if _alive(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_interrupt_restart_and_start_again_in_one_kernel(kernel: Kernel) -> None:
    kernel.ok("%load_ext nbrpc")
    # the interrupt button during a start: it stops cleanly, leaving nothing behind
    before = {p.pid for p in psutil.Process(kernel.km.provisioner.process.pid).children(True)}
    kernel.kc.execute("%rpc_cluster start 2")
    time.sleep(1.0)
    kernel.km.interrupt_kernel()
    reply = kernel.kc.get_shell_msg(timeout=30)
    assert reply["content"]["status"] == "error", reply["content"]
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert "stopped" in kernel.ok("s = %rpc_cluster status\nprint(s)")
    kids = psutil.Process(kernel.km.provisioner.process.pid).children(True)
    assert _gone([p.pid for p in kids if p.pid not in before], 10) == []

    out = kernel.ok("s = %rpc_cluster start 2\nprint(s)")
    assert "2 workers ready" in out
    assert "application/vnd.jupyter.widget-view+json" in kernel.displayed  # the progress bar
    # in a kernel the magic returns the live cluster view (its text is the status's)
    assert kernel.ok("print(type(s).__name__, s.is_live, s.count('ready'))").split() == \
        ["ClusterView", "True", "2"]
    kernel.ok("from nbrpc import rpc\nimport time\n"
              "def where(): return rpc.get_worker_info().name")
    assert kernel.ok("print(rpc.rpc_sync('worker2', where))").strip() == "worker2"

    # the interrupt button, while the driver waits on a 30 s remote call
    kernel.kc.execute("t0 = time.monotonic()\nrpc.rpc_sync('worker1', time.sleep, args=(30,))")
    time.sleep(1.5)
    kernel.km.interrupt_kernel()
    reply = kernel.kc.get_shell_msg(timeout=15)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    waited = float(kernel.ok("print(time.monotonic() - t0)"))
    assert waited < 15, waited  # interrupted, not waited out
    assert kernel.ok("print(rpc.rpc_sync('worker2', where))").strip() == "worker2"

    # a killed engine: detected, shown dead, restarted under its name and rank
    pid = int(kernel.ok("print(rpc_cluster.workers['worker1'].pid)"))
    os.kill(pid, 9)
    out = kernel.ok("import time\nfor _ in range(100):\n"
                    "    s = rpc_cluster.status()\n"
                    "    if s['worker1'].state == 'dead': break\n"
                    "    time.sleep(0.05)\nprint(s)")
    assert "1     worker1  dead" in out and "2     worker2  ready" in out
    out, content = kernel.run("rpc.rpc_sync('worker1', where)")
    assert content["ename"] == "WorkerGoneError" and "worker1" in out
    out = kernel.ok("s = %rpc_cluster restart worker1\nprint(s)")
    assert "2 workers ready" in out
    assert kernel.ok("print(rpc.rpc_sync('worker1', where), rpc.get_worker_info('worker1').id)"
                     ).split() == ["worker1", "1"]

    # stop and start again, twice, in the same kernel
    for _ in range(2):
        assert "stopped" in kernel.ok("s = %rpc_cluster stop\nprint(s)")
        assert "1 worker ready" in kernel.ok("s = %rpc_cluster start 1\nprint(s)")
        assert kernel.ok("print(rpc.rpc_sync('worker1', where))").strip() == "worker1"
    pids = json.loads(kernel.ok(PIDS))
    kernel.ok("%rpc_cluster stop")
    assert _gone(pids, 10) == []
    # the live view's refresh ended with the cluster
    assert kernel.ok(LIVE_VIEWS_END).strip() == "[]"


ANSI = re.compile(r"\x1b\[[0-9;]*m")  # the kernel's tracebacks are coloured


def test_errors_name_the_cell_the_argument_and_the_worker(kernel: Kernel) -> None:
    kernel.ok("%load_ext nbrpc\n%rpc_cluster start 1")
    _, content = kernel.run("from nbrpc import rpc\nimport threading\n\n"
                            "def reciprocal(x):\n    return 1 / x\n")
    defined = content["execution_count"]

    # a cell's function failing on a worker: its frame names the cell, with its line
    out, content = kernel.run("rpc.rpc_sync('worker1', reciprocal, args=(0,))")
    assert content["ename"] == "ZeroDivisionError"
    remote, local = ANSI.sub("", out).split("The above exception was the direct cause")
    assert f"Cell In[{defined}], line 5, in reciprocal\n    return 1 / x\n" in remote, remote
    assert "<dynamic-code>" not in remote and ".py" not in remote  # nbrpc's frames left out
    assert f"Cell In[{content['execution_count']}], line 1\n----> 1 rpc.rpc_sync(" in local
    assert ".py" not in local  # the user's cell is the last frame shown

    # an argument that does not pickle: named, with its type; nothing of nbrpc shown
    out, content = kernel.run("rpc.rpc_sync('worker1', len, args=(threading.Lock(),))")
    shown = ANSI.sub("", out)
    assert content["ename"] == "SerializationError"
    assert "rpc_sync('worker1', len): could not pickle argument 0 (a _thread.lock)" in shown
    assert ".py" not in shown and "Call(" not in shown

    # %%rpc_on: the worker's name and its own traceback of the cell
    out, content = kernel.run("%%rpc_on worker1\nx = 1\nx / 0")
    shown = ANSI.sub("", out)
    assert content["ename"] == "CellError"
    assert shown.startswith("[worker1]") and "----> 2 x / 0" in shown, shown
    assert "execute]" not in shown and "magics.py" not in shown and "run_cell_magic" not in shown
    assert shown.rstrip().endswith("ZeroDivisionError: division by zero")
    kernel.ok("%rpc_cluster stop")


def test_a_killed_kernel_leaves_no_orphans(kernel: Kernel) -> None:
    kernel.ok("%load_ext nbrpc\n%rpc_cluster start 2")
    pids = json.loads(kernel.ok(PIDS))
    assert len(pids) >= 5 and all(_alive(p) for p in pids)
    profile = kernel.ok("print(rpc_cluster._profile_dir)").strip()
    assert os.path.isdir(profile)
    kernel_pid = int(kernel.ok("import os\nprint(os.getpid())"))
    assert kernel_pid == kernel.km.provisioner.process.pid  # the kernel we started
    os.kill(kernel_pid, 9)  # SIGKILL: no atexit, no finally
    alive = _gone(pids, 15)
    assert alive == [], [psutil.Process(p).cmdline() for p in alive if _alive(p)]
    assert not os.path.exists(profile)  # the guarded controller removed it
