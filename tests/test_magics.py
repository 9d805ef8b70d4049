"""``%rpc_cluster`` and ``%%rpc_on`` through an in-process IPython shell.

Usage errors need no cluster; the last tests start a real one (marked ``cluster``).
"""

from __future__ import annotations

import re
import sys
import threading
from collections.abc import Iterator
from importlib import import_module

import pytest
from conftest import local_group
from IPython.core.error import UsageError

from nbrpc.agent import set_default_agent
from nbrpc.cluster import ClusterStatus, WorkerStatus
from nbrpc.debug import owner_map, rref_graph
from nbrpc.debug.trace import Trace
from nbrpc.errors import CellError
from nbrpc.jupyter.magics import _cluster_parser, _launcher_options
from nbrpc.rref import RRef, remote


@pytest.fixture
def shell() -> Iterator:
    from IPython.core.interactiveshell import InteractiveShell

    saved_main = sys.modules["__main__"]
    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "nbrpc")
    try:
        yield ip
    finally:
        magics = ip.magics_manager.registry.get("ClusterMagics")
        if magics is not None and magics.cluster is not None:
            magics.cluster.stop()
        InteractiveShell.clear_instance()
        sys.modules["__main__"] = saved_main


@pytest.mark.parametrize("line, message", [
    ("start", "the following arguments are required: n"),
    ("start x", "expected a whole number, got 'x'"),
    ("start 0", "expected a number >= 1, got 0"),
    ("start 2 --timeout -1", "expected seconds > 0"),
    ("start 2 --bogus", "launcher options are written --trait=value"),
    ("launch 2", "invalid choice: 'launch'"),
    ("stop now", "unrecognized arguments"),
    ("remove", "the following arguments are required: name"),
    ("add two", "expected a whole number"),
    ("start 2 --torch-threads many", "expected auto, none or a number >= 1, got 'many'"),
    ("start 2 --torch-threads 0", "expected auto, none or a number >= 1, got '0'"),
])
def test_wrong_usage_raises_usage_error_with_the_fix(shell, line: str, message: str) -> None:
    with pytest.raises(UsageError) as e:
        shell.run_line_magic("rpc_cluster", line)
    text = str(e.value)
    assert message in text
    assert "usage: %rpc_cluster" in text or "--trait=value" in text or "see: %rpc_cluster" in text


def test_gpus_on_a_host_without_one_says_so_before_starting_anything(shell) -> None:
    import torch

    if torch.cuda.device_count():
        pytest.skip("this host has a GPU")
    with pytest.raises(UsageError, match=r"--gpus\) gives each worker a GPU, but this host"):
        shell.run_line_magic("rpc_cluster", "start 2 --gpus")
    magics = shell.magics_manager.registry["ClusterMagics"]
    assert magics.cluster is None or magics.cluster.state == "stopped"


@pytest.mark.parametrize("line", ["restart worker1", "add 1", "remove worker1"])
def test_commands_that_need_a_cluster_say_how_to_start_one(shell, line: str) -> None:
    with pytest.raises(UsageError, match="start one with %rpc_cluster start N"):
        shell.run_line_magic("rpc_cluster", line)


def test_stop_without_a_cluster_says_so(shell) -> None:
    with pytest.raises(UsageError, match="nothing to stop"):
        shell.run_line_magic("rpc_cluster", "stop")


def test_rpc_on_without_a_cluster(shell) -> None:
    with pytest.raises(UsageError, match="nothing to run a cell on"):
        shell.run_cell_magic("rpc_on", "worker1", "print(1)")
    with pytest.raises(UsageError, match="the following arguments are required: workers"):
        shell.run_cell_magic("rpc_on", "", "print(1)")


def test_status_without_a_cluster(shell) -> None:
    status = shell.run_line_magic("rpc_cluster", "")
    assert isinstance(status, ClusterStatus) and str(status) == "nbrpc cluster (no workers): stopped"


def html_of(shell, obj: object) -> str | None:
    """What the notebook would show as ``obj``'s HTML (None: only its text)."""
    return shell.display_formatter.format(obj)[0].get("text/html")


ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colours in an engine's traceback

RELEASE = threading.Event()  # a module global: the in-process callee finds it by reference


def held() -> str:
    assert RELEASE.wait(10)
    return "ok"


def test_rrefs_futures_and_statuses_display_as_html_once_loaded(shell) -> None:
    with local_group(["a", "b"]) as (a, b):
        set_default_agent(a)
        try:
            user = remote(a, "b", list, ("xy",), {}, -1)
            assert user.to_here() == ["x", "y"]
            page = html_of(shell, user)
            assert "owned by <b>b</b>" in page and f"user (fork {user._fork})" in page
            assert "<code>" + str(user._id) + "</code>" in page and "confirmed" in page
            assert "test_magics.py" in page  # where it was created
            owned = RRef({"k": 1})
            page = html_of(shell, owned)
            assert "owned by <b>a</b> · owner · <code>builtins.dict</code>" in page

            RELEASE.clear()
            fut = a.rpc_async("b", held)
            page = html_of(shell, fut)
            assert ">pending</b> · call to b" in page
            RELEASE.set()
            assert fut.wait() == "ok" and ">done</b>" in html_of(shell, fut)
            failed = a.rpc_async("b", divmod, (1, 0))
            with pytest.raises(ZeroDivisionError):
                failed.wait()
            assert ">failed</b> · ZeroDivisionError" in html_of(shell, failed)
            del user, owned
        finally:
            set_default_agent(None)

    status = ClusterStatus("fork", "running", [WorkerStatus("driver", 0, "h", 7, "ready", 4)])
    assert "<td>h</td><td>7</td>" in html_of(shell, status)
    trace = Trace(workers=["driver"], messages=[])
    assert "Trace of driver: 0 messages" in html_of(shell, trace)
    graph, owners = rref_graph([]), owner_map([])  # the views' own renderers, loaded lazily
    assert html_of(shell, graph) == import_module("nbrpc.jupyter.rref_graph_view"
                                                  ).rref_graph_html(graph)
    assert html_of(shell, owners) == import_module("nbrpc.jupyter.owner_map_view"
                                                   ).owner_map_html(owners)
    shell.run_line_magic("unload_ext", "nbrpc")  # the displays go with the extension
    assert html_of(shell, status) is None and html_of(shell, trace) is None


def test_help_for_the_magic_and_each_subcommand(shell, capsys) -> None:
    assert shell.run_line_magic("rpc_cluster", "--help") is None
    out = capsys.readouterr().out
    assert "usage: %rpc_cluster" in out and "restart" in out and "remove" in out
    shell.run_line_magic("rpc_cluster", "start --help")
    out = capsys.readouterr().out
    assert "--launcher" in out and "--threads" in out and "--timeout" in out
    shell.run_cell_magic("rpc_on", "--help", "pass")
    assert "sorted by rank" in capsys.readouterr().out


@pytest.mark.parametrize("text, value", [("auto", "auto"), ("AUTO", "auto"), ("none", None),
                                         ("3", 3)])
def test_torch_threads_are_auto_none_or_a_count(text: str, value: object) -> None:
    args, _ = _cluster_parser().parse_known_args(["start", "2", "--torch-threads", text])
    assert args.torch_threads == value
    assert _cluster_parser().parse_known_args(["start", "2"])[0].torch_threads == "auto"


def test_launcher_options_are_python_literals_or_strings() -> None:
    assert _launcher_options(["--account=abc", "--engines={'h1': 2}", "--SlurmEngineSetLauncher.timelimit=1:00:00",
                              "--n=3"]) == {"account": "abc", "engines": {"h1": 2},
                                            "timelimit": "1:00:00", "n": 3}
    with pytest.raises(UsageError, match="--trait=value"):
        _launcher_options(["positional"])


@pytest.mark.cluster
def test_a_session_of_magics_on_a_real_cluster(shell, capsys) -> None:
    status = shell.run_line_magic(
        "rpc_cluster", "start 2 --threads 4 --failure-timeout 45 --encrypt --torch-threads 3")
    assert str(status).splitlines() == [
        "nbrpc cluster (fork launcher): 2 workers ready",
        "  rank  name     state",
        "  0     driver   ready",
        "  1     worker1  ready",
        "  2     worker2  ready",
    ]
    page = shell.display_formatter.format(status)[0]["text/html"]  # the extension's display
    assert '<table class="nbrpc-cluster">' in page and f"<td>{status['worker1'].pid}</td>" in page
    with pytest.raises(UsageError, match="already running"):
        shell.run_line_magic("rpc_cluster", "start 1")

    # code defined in the shell's __main__ runs remotely (pickled by value)
    shell.run_cell("from nbrpc import rpc\n"
                   "class Counter:\n"
                   "    def __init__(self): self.n = 0\n"
                   "    def bump(self, k): self.n += k; return self.n\n"
                   "def square(x): return x * x\n", store_history=False)
    r = shell.run_cell("c = rpc.remote('worker1', Counter)\n"
                       "(rpc.rpc_sync('worker2', square, args=(7,)), c.rpc_sync().bump(2),"
                       " c.rpc_sync().bump(3))")
    assert r.result == (49, 2, 5)
    r = shell.run_cell("from nbrpc.agent import current_agent\n"
                       "rpc.rpc_sync('worker1', lambda: (current_agent().options.failure_timeout,"
                       " current_agent().options.encrypt))")
    assert r.result == (45.0, True)  # the options reached the engines' agents
    r = shell.run_cell("import torch\n"
                       "[rpc.rpc_sync(w, torch.get_num_threads) for w in ('worker1', 'worker2')]")
    assert r.result == [3, 3]  # --torch-threads 3
    capsys.readouterr()

    shell.run_cell_magic("rpc_on", "worker2 worker1",
                         "from nbrpc import rpc\nprint('hello from', rpc.get_worker_info().name)")
    out = capsys.readouterr().out
    assert out.index("[worker1]\nhello from worker1") < out.index("[worker2]\nhello from worker2")
    shell.run_cell_magic("rpc_on", "all", "x_on_engine = 5")
    shell.run_cell_magic("rpc_on", "worker2", "print(x_on_engine * 2)")
    assert capsys.readouterr().out == "10\n"  # one worker: no header
    with pytest.raises(CellError, match="the cell failed on worker1: ZeroDivisionError: "
                       "division by zero") as e:
        shell.run_cell_magic("rpc_on", "worker1", "1 / 0")
    assert isinstance(e.value, RuntimeError) and list(e.value.errors) == ["worker1"]
    # what the notebook shows: each worker's own traceback of the cell, headed by its
    # name; no engine id ("[1:execute]"), nothing of the magic that ran it
    shell.run_line_magic("colors", "nocolor")
    shell.run_cell("%%rpc_on worker1 worker2\nx = 1\nprint(x / (rpc.get_worker_info().id - 2))",
                   store_history=True)
    shown = ANSI.sub("", capsys.readouterr().out)
    assert shown.startswith("[worker1]\n-1.0\n[worker2]\n"), shown
    assert "ZeroDivisionError" in shown and "----> 2 print(x / (rpc.get_worker_info().id - 2))" \
        in shown and shown.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "execute]" not in shown and "magics.py" not in shown and "run_cell_magic" not in shown
    with pytest.raises(UsageError, match="no worker named 'worker9'"):
        shell.run_cell_magic("rpc_on", "worker9", "pass")

    status = shell.run_line_magic("rpc_cluster", "add 1")
    assert status["worker3"].state == "ready"
    status = shell.run_line_magic("rpc_cluster", "remove worker3")
    assert [w.name for w in status.workers] == ["driver", "worker1", "worker2"]
    status = shell.run_line_magic("rpc_cluster", "restart worker2")
    assert status["worker2"].state == "ready" and status["worker2"].rank == 2
    assert shell.run_cell("rpc.rpc_sync('worker2', square, args=(3,))").result == 9

    status = shell.run_line_magic("rpc_cluster", "stop")
    assert str(status) == "nbrpc cluster (no workers): stopped"
    status = shell.run_line_magic("rpc_cluster", "start 1")  # and again in the same shell
    assert status.count("ready") == 1
    shell.run_line_magic("rpc_cluster", "stop")
