"""Layers import downward only, and importing nbrpc starts nothing."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parent.parent / "nbrpc"

# Only the Jupyter layer may import display libraries. Core objects reach their
# views through nbrpc.views, where the Jupyter layer registers them when it is
# imported; views.load_display_layer() is the core's one import of nbrpc.jupyter
# (inside a function), and nbrpc/__init__.py holds IPython's extension hooks.
DISPLAY = {"IPython", "ipywidgets", "anywidget", "matplotlib", "ipykernel"}
DOORS = {PKG / "__init__.py", PKG / "views.py"}  # may import nbrpc.jupyter, in a function

# layer -> names it must never import (at any level of a module, functions included)
FORBIDDEN = {
    "transport": {"pickle", "cloudpickle", "torch", "nbrpc.serialize", "nbrpc.agent",
                  "nbrpc.rref", "nbrpc.rpc"},
    "serialize": {"zmq", "nbrpc.transport", "nbrpc.agent", "nbrpc.rref", "nbrpc.rpc"},
    "agent": {"nbrpc.rref", "nbrpc.rpc", "nbrpc.debug", "IPython", "ipywidgets"},
    "rref": {"nbrpc.rpc", "nbrpc.debug", "IPython", "ipywidgets"},
    "rpc": {"IPython", "ipywidgets"},
    "autograd": {"nbrpc.optim", "nbrpc.nn", "nbrpc.debug", "nbrpc.cluster", "nbrpc.jupyter",
                 *DISPLAY},
    "optim": {"nbrpc.debug", "nbrpc.cluster", "nbrpc.jupyter", *DISPLAY},
    "nn": {"nbrpc.debug", "nbrpc.cluster", "nbrpc.jupyter", *DISPLAY},
    "debug": {"nbrpc.cluster", "nbrpc.jupyter", *DISPLAY},
    "cluster": {"nbrpc.jupyter", *DISPLAY},
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # resolve relative imports against this module's package
                base = list(parts[: len(parts) - node.level])
                mod = ".".join(base + ([node.module] if node.module else []))
                names |= {mod} | {f"{mod}.{a.name}" for a in node.names}
            else:
                names.add(node.module or "")
    return names


def test_layers_import_downward_only() -> None:
    problems = []
    for layer, forbidden in FORBIDDEN.items():
        for path in sorted((PKG / layer).rglob("*.py")):
            for name in _imports(path):
                if any(name == f or name.startswith(f + ".") for f in forbidden):
                    problems.append(f"{path.relative_to(PKG.parent)} imports {name}")
    assert not problems, "\n".join(problems)


def test_only_the_jupyter_layer_imports_display_libraries() -> None:
    problems = []
    for path in sorted(PKG.rglob("*.py")):
        if path.is_relative_to(PKG / "jupyter"):
            continue
        banned = DISPLAY if path in DOORS else DISPLAY | {"nbrpc.jupyter"}
        for name in _imports(path):
            if any(name == f or name.startswith(f + ".") for f in banned):
                problems.append(f"{path.relative_to(PKG.parent)} imports {name}")
    assert not problems, "\n".join(problems)


def test_importing_the_core_loads_no_display_library() -> None:
    """The doors to the Jupyter layer open only when a view is asked for."""
    code = (
        "import sys\n"
        "import nbrpc, nbrpc.views, nbrpc.ipython, nbrpc.rpc, nbrpc.autograd, nbrpc.optim\n"
        "import nbrpc.nn, nbrpc.debug, nbrpc.cluster\n"
        f"banned = {sorted(DISPLAY | {'nbrpc.jupyter'})!r}\n"
        "print(sorted(m for m in sys.modules if any(m == b or m.startswith(b + '.') "
        "for b in banned)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_importing_nbrpc_starts_no_thread_and_no_socket() -> None:
    code = (
        "import threading, zmq\n"
        "import nbrpc.agent, nbrpc.rpc, nbrpc.debug\n"
        "from nbrpc.agent import Agent\n"
        "assert 'rref' in Agent('x', 0, b'k' * 32, world_size=1).ext  # layers installed\n"
        "assert threading.active_count() == 1, threading.enumerate()\n"
        "assert zmq.Context._instance is None\n"
        "print('clean')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "clean", out.stderr


def test_importing_nbrpc_under_a_torch_older_than_its_floor_says_so() -> None:
    """pip keeps torch at pyproject.toml's floor or newer; an environment built
    around pip (--no-deps, conda) may not, and nbrpc then fails at import with
    the floor and the fix, not later inside a backward pass."""
    import importlib.metadata

    from nbrpc import _floors

    floor = _floors(importlib.metadata.requires("nbrpc"))["torch"]
    assert floor, "no torch floor in nbrpc's metadata"
    code = ("import torch\n"
            "torch.__version__ = torch.torch_version.TorchVersion('2.4.1+cu121')\n"
            "import nbrpc\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: nbrpc needs torch>={floor}, and this environment "
                           "has torch 2.4.1+cu121"), last
    assert f"pip install 'torch>={floor}'" in last
    ok = subprocess.run([sys.executable, "-c", "import nbrpc"], capture_output=True,
                        text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr


def test_an_agent_never_started_and_let_go_closes_its_sockets_and_context() -> None:
    """The garbage collector may finalize a zmq context before its sockets, and
    term() then waits for them for ever (the interpreter's exit hung so): the
    hub closes its sockets, then the context, when it is let go unclosed. The
    loop's own resources go too: its Unix socket and directory, its wake pipe."""
    import gc

    from nbrpc.agent import Agent

    def open_fds() -> set[str]:
        fds = os.listdir("/proc/self/fd")
        return {t for t in (_readlink(f"/proc/self/fd/{fd}") for fd in fds) if t}

    agent = Agent("x", 0, b"k" * 32, world_size=1)
    ctx, router = agent.io._zmq.ctx, agent.io._zmq.router
    listener, ipc_dir = agent.io._unix.listener, agent.io._ipc_dir
    pipe = {_readlink(f"/proc/self/fd/{fd}") for fd in (agent.io._wake_r, agent.io._wake_w)}
    assert os.path.isdir(ipc_dir) and pipe <= open_fds()
    del agent
    gc.collect()
    assert router.closed and ctx.closed
    assert listener.fileno() == -1 and not os.path.exists(ipc_dir)
    assert not pipe & open_fds(), "the wake pipe is still open"


def test_a_script_that_never_calls_shutdown_exits_with_its_loop_stopped_by_its_own_thread() -> None:
    """A script (or a kernel shut down) that ends with its agent running: at
    exit the I/O loop is stopped, and its own thread closes its sockets and
    removes its socket directory. Nothing closes a zmq socket under that
    thread's poll (it then logged a crash, ENOTSOCK), and nothing is left for
    the next process's sweep."""
    code = ("import os, tempfile, time\n"
            "from nbrpc import rpc\n"
            "from nbrpc.agent.agent import current_agent\n"
            "rpc.init_rpc('a', rank=0, world_size=1,\n"
            "             rpc_backend_options=rpc.api._free_port_options())\n"
            "assert rpc.rpc_sync('a', max, args=(1, 2)) == 2\n"
            "tmp = tempfile.gettempdir()\n"
            "print([os.path.join(tmp, d) for d in os.listdir(tmp)\n"
            "       if d.startswith(f'nbrpc-ipc-{os.getpid()}-')])\n"
            "loop, deadline = current_agent().io, time.monotonic() + 10\n"
            "while not loop._sleeping and time.monotonic() < deadline:  # back in its poll\n"
            "    time.sleep(0.001)\n"
            "assert loop._sleeping\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "crashed" not in out.stderr, out.stderr
    dirs = ast.literal_eval(out.stdout.strip())
    assert len(dirs) == 1, out.stdout  # the socket directory existed while it ran
    assert not os.path.exists(dirs[0]), "the socket directory outlived the process"


def test_a_forked_child_that_exits_leaves_its_parents_loop_alone() -> None:
    """A child forked from a process whose loop runs, and exiting normally,
    stops no loop at its exit: the parent's socket directory stays, and the
    parent's agent goes on answering."""
    code = ("import os, sys, tempfile\n"
            "from nbrpc import rpc\n"
            "rpc.init_rpc('a', rank=0, world_size=1,\n"
            "             rpc_backend_options=rpc.api._free_port_options())\n"
            "tmp = tempfile.gettempdir()\n"
            "mine = [d for d in os.listdir(tmp) if d.startswith(f'nbrpc-ipc-{os.getpid()}-')]\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    sys.exit(0)  # (a normal exit: atexit hooks run)\n"
            "_, status = os.waitpid(pid, 0)\n"
            "assert os.waitstatus_to_exitcode(status) == 0\n"
            "assert len(mine) == 1 and os.path.isdir(os.path.join(tmp, mine[0])), mine\n"
            "assert rpc.rpc_sync('a', max, args=(1, 2), timeout=10) == 2\n"
            "rpc.shutdown()\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def _readlink(path: str) -> str | None:
    try:
        return os.readlink(path)
    except OSError:  # (closed meanwhile)
        return None
