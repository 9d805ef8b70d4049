"""A warm process that forks engines: torch is imported once, not once per engine.

Four fresh Python processes importing torch at once take 4-8 s on two
cores; a fork of a process that already has torch, ipyparallel's engine and
nbrpc loaded is ready in milliseconds. The zygote is started by the
:class:`~nbrpc.cluster.Cluster` (``python -m nbrpc.cluster.zygote``) and speaks
JSON lines over its stdin/stdout pipes::

    kernel ──{"argv": [...], "env": {...}, "cwd": ..., "output": path}──▶ zygote
    kernel ◀──{"pid": 1234}  or  {"error": "..."}─────────────────────── zygote

Lifetime: the pipe is the leash. When the kernel closes it, or dies (even by
SIGKILL), the zygote reads EOF, kills the engines it forked and exits; each
engine also asks the Linux kernel to kill it when the zygote dies
(``PR_SET_PDEATHSIG``). So nothing outlives the kernel.

The zygote never creates a zmq context or starts a thread before forking, so
each child starts clean. It reaps its children, which lets the launcher watch
them by pid (``psutil``) although they are not its own children.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any

log = logging.getLogger(__name__)

_PRELOAD = (  # what an engine imports anyway: paid once here
    "torch", "zmq", "cloudpickle", "numpy", "IPython", "ipykernel.ipkernel",
    "ipyparallel", "ipyparallel.engine.app", "ipyparallel.serialize", "nbrpc",
    "nbrpc.rpc", "nbrpc.cluster.engine",
)


# -- the kernel's side --------------------------------------------------------
class Zygote:
    """Handle on a zygote process: :meth:`start`, :meth:`spawn`, :meth:`close`.

    >>> z = Zygote(preload=())           # (preload nothing, for the example)
    >>> z.start(); z.wait_ready(30)
    >>> pid = z.spawn([sys.executable, "-c", "pass"], env={}, cwd=".", output=os.devnull)
    >>> pid > 0
    True
    >>> z.close()
    """

    def __init__(self, preload: tuple[str, ...] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.preload = _PRELOAD if preload is None else preload
        self.env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._ready: dict[str, Any] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self) -> None:
        """Start the process (returns at once; :meth:`wait_ready` waits for its imports)."""
        env = {**os.environ, **self.env, "NBRPC_ZYGOTE_PRELOAD": ",".join(self.preload)}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nbrpc.cluster.zygote"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=None, env=env, start_new_session=True)

    def wait_ready(self, timeout: float) -> None:
        """Wait (bounded, interruptibly) until the zygote has imported what it preloads."""
        if self._ready is None:
            self._ready = self._read(timeout, "start")

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, output: str,
              timeout: float = 10.0, netns: str | None = None) -> int:
        """Fork a child that runs ``argv`` (``python -m MODULE ...`` or ``python -c``
        in the warm interpreter); returns its pid. Output goes to ``output``.
        ``netns``: a network namespace (its path, e.g. ``/run/netns/h2``) the child
        enters first (Linux, root): a host simulated on this machine."""
        with self._lock:
            self.wait_ready(timeout)
            assert self.proc is not None and self.proc.stdin is not None
            line = json.dumps({"argv": argv, "env": env, "cwd": cwd, "output": output,
                               "netns": netns})
            try:
                self.proc.stdin.write(line.encode() + b"\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError):
                raise RuntimeError(self._gone("spawn an engine")) from None
            reply = self._read(timeout, "spawn an engine")
        if "error" in reply:
            raise RuntimeError(f"the zygote could not start {argv}: {reply['error']}")
        return int(reply["pid"])

    def _read(self, timeout: float, what: str) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while True:  # short selects: Ctrl-C in the kernel gets through
            ready, _, _ = select.select([fd], [], [], 0.1)
            if ready:
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(self._gone(what))
                return json.loads(line)
            if self.proc.poll() is not None:
                raise RuntimeError(self._gone(what))
            if time.monotonic() > deadline:
                raise TimeoutError(f"the engine zygote did not {what} within {timeout:g} s")

    def _gone(self, what: str) -> str:
        code = self.proc.poll() if self.proc else None
        return (f"the engine zygote exited (code {code}) before it could {what}; "
                "its error is in the kernel's log (stderr)")

    def close(self, timeout: float = 3.0) -> None:
        """Close the leash: the zygote kills its children and exits (bounded, then SIGKILL)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            if proc.stdin:
                proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)
        if proc.stdout:
            proc.stdout.close()


# -- the zygote's side --------------------------------------------------------
def _set_pdeathsig(sig: int) -> None:
    """Ask Linux to send ``sig`` to this process when its parent dies."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1  # noqa: N806
    libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)


def enter_netns(path: str) -> None:
    """Move this (single-threaded) process into the network namespace at ``path``."""
    import ctypes

    CLONE_NEWNET = 0x40000000  # noqa: N806
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into the network namespace {path}: {os.strerror(err)}")
    finally:
        os.close(fd)


def _child(request: dict[str, Any], parent: int) -> None:
    """In the forked child: become the program ``request["argv"]`` asks for."""
    code = 1
    try:
        _set_pdeathsig(signal.SIGKILL)
        if os.getppid() != parent:  # the zygote died between fork and prctl
            os._exit(1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        for fd in {out, null} - {0, 1, 2}:
            os.close(fd)
        os.chdir(request["cwd"])
        if request.get("netns"):
            enter_netns(request["netns"])
        os.environ.update(request["env"])
        argv = list(request["argv"])
        import runpy

        if len(argv) >= 3 and argv[1] == "-m":
            sys.argv = [argv[2], *argv[3:]]
            runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
        elif len(argv) >= 3 and argv[1] == "-c":
            sys.argv = ["-c", *argv[3:]]
            exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__"})
        else:
            raise ValueError(f"the zygote runs 'python -m MODULE' or 'python -c CODE', not {argv}")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(stdin: int = 0, stdout: int = 1, idle_check: float = 0.1) -> None:
    """The zygote's loop: fork on request, reap children, end on EOF (bounded waits)."""
    children: set[int] = set()
    buf = b""
    me = os.getpid()
    try:
        while True:
            ready, _, _ = select.select([stdin], [], [], idle_check)
            _reap(children)
            if not ready:
                continue
            chunk = os.read(stdin, 65536)
            if not chunk:  # the kernel closed the pipe, or died
                return
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                request = json.loads(line)
                try:
                    pid = os.fork()
                except OSError as e:
                    _reply(stdout, {"error": f"fork failed: {e}"})
                    continue
                if pid == 0:  # the pipes (fds 0 and 1) are replaced by dup2 there
                    _child(request, me)
                children.add(pid)
                _reply(stdout, {"pid": pid})
    finally:
        _kill_all(children)


def _reply(fd: int, msg: dict[str, Any]) -> None:
    os.write(fd, json.dumps(msg).encode() + b"\n")


def _reap(children: set[int]) -> None:
    for pid in list(children):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            children.discard(pid)


def _kill_all(children: set[int], grace: float = 1.0) -> None:
    """TERM the children, give them ``grace`` seconds, then KILL what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in children:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while children and time.monotonic() < deadline:
            _reap(children)
            time.sleep(0.02)
        if not children:
            return


def main() -> None:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle torch threads must not spin
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel's Ctrl-C is not ours
    preload = [m for m in os.environ.pop("NBRPC_ZYGOTE_PRELOAD", "").split(",") if m]
    import importlib

    for module in preload:
        importlib.import_module(module)
    # The imports go to the collector's permanent generation before any fork
    # (as Python's gc.freeze documentation advises): engines' full collections
    # skip them (short pauses, see nbrpc.agent.gcfreeze) and never write to
    # their pages, which thus stay shared with the zygote (copy-on-write).
    gc.freeze()
    _reply(1, {"ready": True, "pid": os.getpid()})
    serve()
    # Nothing is buffered (replies are os.write), so skip the interpreter's
    # teardown: with torch loaded it takes ~0.4 s of every Cluster.stop().
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
