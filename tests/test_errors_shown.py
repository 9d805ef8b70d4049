"""What a user sees when a call fails: the mistake named (which argument, of
what type), tracebacks that end at the user's own line, and remote frames of
notebook cells shown as IPython shows local ones (``Cell In[7], line 2``)."""

from __future__ import annotations

import linecache
import re
import threading
import traceback

import numpy as np
import pytest
import torch
from test_magics import shell  # noqa: F401 - the in-process IPython shell fixture

from nbrpc import rpc
from nbrpc.errors import SerializationError
from nbrpc.rref import RRef
from nbrpc.serialize import dumps, format_exception, loads, source

LOCK_TEXT = "(a _thread.lock): cannot pickle '_thread.lock' object. Pass only picklable values"


def reciprocal(x):
    return 1 / x


def returns_a_lock_inside():
    return {"ok": 1, "k": [threading.Lock()]}


def _main_function(code: str, **names):
    """The function ``code`` defines, as if in a notebook cell (pickled by value)."""
    ns = {"__name__": "__main__", **names}
    exec(code, ns)
    return ns["f"]


def frames(e: BaseException) -> list[str]:
    """The functions of ``e``'s traceback, outermost first."""
    return [f.name for f in traceback.extract_tb(e.__traceback__)]


def test_an_unpicklable_argument_is_named_with_its_type(trio_default) -> None:
    lock = threading.Lock()
    with pytest.raises(SerializationError) as info:
        rpc.rpc_sync("b", len, args=(lock,))
    e = info.value
    assert str(e).startswith(f"rpc_sync('b', len): could not pickle argument 0 {LOCK_TEXT}")
    assert (e.path, e.worker) == ("args[0]", "b")
    assert e.__cause__ is None and e.__suppress_context__  # the pickler's frames add nothing
    assert frames(e) == ["test_an_unpicklable_argument_is_named_with_its_type"]
    assert "Call(" not in str(e) and "0x" not in str(e)

    # by keyword, and inside containers, past values that pickle (tensors, RRefs)
    owned = RRef([1])
    with pytest.raises(SerializationError) as info:
        rpc.rpc_async("b", reciprocal, args=(torch.ones(2), owned),
                      kwargs={"opts": {"n": 1, "sync": [2, lock]}})
    assert str(info.value).startswith(
        "rpc_async('b', reciprocal): could not pickle kwargs['opts']['sync'][1] in keyword "
        f"argument 'opts' {LOCK_TEXT}")
    assert info.value.path == "kwargs['opts']['sync'][1]"
    with pytest.raises(SerializationError, match=re.escape(
            "remote('c', dict): could not pickle keyword argument 'x' (a _thread.lock)")):
        rpc.remote("c", dict, kwargs={"x": lock})
    with pytest.raises(SerializationError, match=re.escape(
            "rpc_sync('b', <lambda>): could not pickle the variable 'lock' that the function "
            "reads (a _thread.lock)")):
        rpc.rpc_sync("b", lambda: lock.locked())  # a closure over a lock
    with pytest.raises(SerializationError, match=re.escape(
            "could not pickle the global 'LOCK' that args[0]['callback'] reads (a _thread.lock)")):
        rpc.rpc_sync("b", len, args=({"callback": _main_function("def f():\n    LOCK.locked()\n",
                                                                  LOCK=lock)},))
    # nothing of those calls was left behind: the group goes on
    assert rpc.rpc_sync("b", len, args=([1, 2],)) == 2
    del owned


def test_an_unpicklable_result_names_the_part_that_is_not(trio_default) -> None:
    with pytest.raises(SerializationError) as info:
        rpc.rpc_sync("b", returns_a_lock_inside)
    e = info.value
    assert str(e).startswith(
        "the result of returns_a_lock_inside() on 'b' (a dict) could not be pickled to send "
        "back: result['k'][0] is a _thread.lock: cannot pickle '_thread.lock' object.")
    assert (e.path, e.worker, e.remote_worker) == ("result['k'][0]", "b", "b")
    assert e.__cause__ is None  # the callee made it, nothing raised it: no traceback to show
    assert frames(e) == ["test_an_unpicklable_result_names_the_part_that_is_not"]


def test_a_remote_error_shows_the_users_frames_only(trio_default) -> None:
    with pytest.raises(ZeroDivisionError) as info:
        rpc.rpc_sync("b", reciprocal, args=(0,))
    e = info.value
    assert frames(e) == ["test_a_remote_error_shows_the_users_frames_only"]
    remote = e.remote_traceback
    assert "nbrpc" not in remote  # the callee's own frames are left out
    line = reciprocal.__code__.co_firstlineno + 1
    assert f'test_errors_shown.py", line {line}, in reciprocal\n    return 1 / x' in remote
    fut = rpc.rpc_async("c", reciprocal, args=(0,))
    with pytest.raises(ZeroDivisionError) as info:
        fut.wait()
    assert frames(info.value) == ["test_a_remote_error_shows_the_users_frames_only"]


def test_format_exception_leaves_out_hidden_frames_but_the_last() -> None:
    def inner():
        __tracebackhide__ = True
        raise ValueError("bad")

    def middle():
        __tracebackhide__ = True
        inner()

    try:
        middle()
    except ValueError as e:
        text = format_exception(e)
    assert "in test_format_exception" in text and "in inner" in text  # (the last frame)
    assert "in middle" not in text and text.endswith("ValueError: bad\n")


def test_frames_are_written_with_the_options_newer_pythons_pass(monkeypatch) -> None:
    """Python 3.13's traceback module passes colorize= to format_frame_summary:
    the cell-naming stack passes it on (refusing it lost every remote error)."""
    given = []

    def newer(self, frame_summary, **kwargs):  # (as 3.13's StackSummary)
        given.append(kwargs)
        return f'  File "{frame_summary.filename}", line {frame_summary.lineno}\n'

    monkeypatch.setattr(traceback.StackSummary, "format_frame_summary", newer)
    fs = traceback.FrameSummary("/x.py", 2, "f", line="return 1 / 0")
    assert source._Stack([fs]).format_frame_summary(fs, colorize=False) == \
        '  File "/x.py", line 2\n'
    assert given == [{"colorize": False}]


def test_an_error_whose_traceback_cannot_be_written_still_reaches_the_caller(
        trio_default, monkeypatch, caplog) -> None:
    def broken(self, frame_summary, **kwargs):
        raise TypeError("a traceback module this code does not know")

    monkeypatch.setattr(source._Stack, "format_frame_summary", broken)
    with pytest.raises(ZeroDivisionError) as info:  # not a timeout: the answer came
        rpc.rpc_sync("b", reciprocal, args=(0,), timeout=10)
    assert "in reciprocal" in info.value.remote_traceback  # the standard library's text
    assert "formatting a ZeroDivisionError's traceback failed" in caplog.text


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no words")


def _raise_unprintable() -> None:
    raise _Unprintable()


def test_an_error_whose_message_cannot_be_written_still_reaches_the_caller(trio_default
                                                                           ) -> None:
    with pytest.raises(_Unprintable) as info:
        rpc.rpc_sync("b", _raise_unprintable, timeout=10)
    assert "_raise_unprintable" in info.value.remote_traceback


def _cell_function(ip, code: str):
    ip.run_cell(code, store_history=True)
    return ip.user_ns["scale"], ip.execution_count - 1


def test_a_cell_function_rebuilt_elsewhere_shows_its_cell_and_line(shell) -> None:  # noqa: F811
    fn, count = _cell_function(shell, "k = 2\n\ndef scale(x):\n    y = k * x\n    return y / 0\n")
    filename = fn.__code__.co_filename
    payload, _ = dumps(fn)
    # another process: neither the cell's source nor IPython's record of it
    del linecache.cache[filename]
    shell.compile._filename_map.pop(filename)
    try:
        rebuilt = loads(payload, [])
        with pytest.raises(ZeroDivisionError) as info:
            rebuilt(3)
        text = format_exception(info.value)
    finally:
        linecache.cache.pop(filename, None)
        source._labels.pop(filename, None)
        source._shipped.discard(filename)
    assert rebuilt.__code__.co_filename == filename  # (cloudpickle's is "<dynamic-code>")
    assert f"  Cell In[{count}], line 5, in scale\n    return y / 0\n" in text, text


def test_ipython_shows_a_remote_cell_error_at_the_users_line(shell, trio_default, capsys  # noqa: F811
                                                             ) -> None:
    shell.run_line_magic("colors", "nocolor")
    shell.run_cell("from nbrpc import rpc\nimport threading\n\n"
                   "def halve(x):\n    return x / 0\n", store_history=True)
    defined = shell.execution_count - 1
    capsys.readouterr()
    shell.run_cell("rpc.rpc_sync('b', halve, args=(1,))", store_history=True)
    shown = capsys.readouterr().out
    remote, local = shown.split("The above exception was the direct cause")
    assert f"  Cell In[{defined}], line 5, in halve\n    return x / 0\n" in remote, remote
    assert "nbrpc" not in remote.replace("nbrpc import", "")
    assert f"Cell In[{defined + 1}], line 1\n----> 1 rpc.rpc_sync('b', halve" in local, local
    assert ".py" not in local  # no frame of nbrpc's files: the cell is the last one

    shell.run_cell("rpc.rpc_sync('b', len, args=(threading.Lock(),))", store_history=True)
    shown = capsys.readouterr().out
    assert "----> 1 rpc.rpc_sync('b', len, args=(threading.Lock(),))" in shown
    assert ".py" not in shown and "above exception" not in shown
    assert "SerializationError: rpc_sync('b', len): could not pickle argument 0" in shown


def test_identical_functions_from_two_cells_keep_their_own_cell() -> None:
    names = ["/tmp/ipykernel_0/cell_a.py", "/tmp/ipykernel_0/cell_b.py"]
    fns = []
    for name in names:
        ns = {"__name__": "__main__"}
        exec(compile("def f(x):\n    return x\n", name, "exec"), ns)
        fns.append(ns["f"])
    assert fns[0].__code__ == fns[1].__code__  # (code objects compare without their file)
    rebuilt = [loads(dumps(f)[0], []) for f in fns]
    assert [f.__code__.co_filename for f in rebuilt] == names


# -- PyTorch's phrase first: code written for torch.distributed.rpc matches on it --------
def test_init_rpc_refusals_start_with_pytorchs_phrases(monkeypatch) -> None:
    """What PyTorch's own tests match (TensorPipeAgentRpcTest): each refusal
    before any agent starts, with its exception type, PyTorch's words, then
    nbrpc's advice."""
    import datetime

    from nbrpc import rpc

    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match=r"^rank parameter missing: .*pass rank="):
        rpc.init_rpc("x", rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method="tcp://127.0.0.1:1"))
    with pytest.raises(ValueError, match="^environment variable RANK expected, but not set"):
        rpc.init_rpc("x", rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
            init_method="env://"))
    with pytest.raises(TypeError, match="must be a `TensorPipeRpcBackendOptions`"):
        rpc.init_rpc("x", backend=rpc.BackendType.TENSORPIPE, rank=0, world_size=1,
                     rpc_backend_options=rpc.RpcBackendOptions())
    with pytest.raises(TypeError, match=r"incompatible constructor arguments.*total_seconds"):
        rpc.TensorPipeRpcBackendOptions(rpc_timeout=datetime.timedelta(seconds=3))
    assert rpc.TensorPipeRpcBackendOptions(rpc_timeout=np.int64(3)).rpc_timeout == 3.0


def test_a_call_that_times_out_says_so_in_pytorchs_words() -> None:
    from nbrpc.errors import RpcTimeoutError

    e = RpcTimeoutError("RPC 'call'", 0.3, worker="w1")
    assert isinstance(e, RuntimeError) and str(e).startswith(
        "RPC ran for more than set timeout (300 ms) and will now be marked with an error "
        "('call' on 'w1'). Pass a larger timeout=")
    assert str(RpcTimeoutError("graceful shutdown", 60)).startswith(
        "graceful shutdown ran for more than the set timeout (60 s)")
