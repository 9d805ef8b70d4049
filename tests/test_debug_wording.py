"""What the debugging texts say: an RRef's creation site names the cell that
made it (through a real kernel), why_alive leaves out its own machinery and
names the containers that hold an RRef, and counts read as English."""

from __future__ import annotations

import gc
import os
import re
import threading
import weakref

import pytest
from conftest import poll_for

import nbrpc
from nbrpc import debug
from nbrpc.rref import RRef, remote

PACKAGE = os.path.dirname(nbrpc.__file__)
KEPT: list = []  # a module global that keeps RRefs, as a forgotten cache would


class Cache:
    def __init__(self) -> None:
        self.items: list = []


class Slotted:
    __slots__ = ("ref",)


class Plain:
    pass


def test_why_alive_names_the_containers_that_hold_an_rref(trio_default) -> None:
    a, _, _ = trio_default
    r = remote(a, "b", list, ("ab",), {}, -1)
    seen, inline = Cache(), Cache()
    vars(seen)  # this one's attributes live in a real __dict__; inline's do not (yet)
    seen.items += [r, r]
    inline.items.append(r)
    slotted, plain = Slotted(), Plain()
    slotted.ref = plain.ref = r
    KEPT.append(r)
    anonymous = ([r],)  # a list held only by a tuple: it has no name
    mine = [r]  # a running function's variable
    try:
        refs = debug.why_alive(r)["references"]["a"]
        mod, here = __name__, "test_debug_wording.py"
        for text in ["the list `KEPT` (1 item), a global in module test_debug_wording",
                     f"the list in attribute 'items' of a {mod}.Cache (2 items)",
                     f"the list in attribute 'items' of a {mod}.Cache (1 item)",
                     f"attribute 'ref' of a {mod}.Slotted",
                     f"attribute 'ref' of a {mod}.Plain",
                     "a list of 1 item",
                     "the list `mine` (1 item), a local in "
                     "test_why_alive_names_the_containers_that_hold_an_rref ("]:
            assert any(t.startswith(text) for t in refs), (text, refs)
        assert any(t.startswith("local 'r' in test_why_alive_names") and here in t for t in refs)
        assert not any("(s)" in t for t in refs) and "a closure" not in refs, refs
    finally:
        KEPT.clear()
    del anonymous, mine


def _no_lines(refs: list[str]) -> list[str]:
    return [re.sub(r":\d+\)$", ")", x) for x in refs]


def _hold(rref: RRef, release: threading.Event, holding: threading.Event) -> None:
    held = rref  # noqa: F841 - the reference why_alive must still report
    holding.set()
    release.wait(10)


def test_why_alive_and_show_leave_their_own_references_out(trio_default) -> None:
    """The frames of why_alive, and of the nbrpc code that called it (show, a
    widget's click handler), hold the RRef only to look at it; a user's
    function that holds it, in another thread, is still reported."""
    a, _, _ = trio_default
    r = remote(a, "b", list, ("ab",), {}, -1)
    release, holding = threading.Event(), threading.Event()
    t = threading.Thread(target=_hold, args=(r, release, holding))
    t.start()
    try:
        assert holding.wait(10)
        refs = debug.why_alive(r)["references"]["a"]
        assert any(x.startswith("local 'held' in _hold") for x in refs), refs
        assert any(x.startswith("local 'rref' in _hold") for x in refs), refs
        assert not any(PACKAGE in x for x in refs), refs  # no frame of nbrpc's own
        pytest.importorskip("anywidget")
        view = nbrpc.show(r)
        try:
            shown = view.why["references"]["a"]
            assert _no_lines(shown) == _no_lines(refs), (shown, refs)
            assert not any(" in show (" in x or PACKAGE in x for x in shown), shown
            assert any("delete these references" in h for h in view.why["hints"])
            assert not any("'obj'" in h for h in view.why["hints"]), view.why["hints"]
        finally:
            view.close()
    finally:
        release.set()
        t.join(10)


def test_counts_read_as_english(trio_default) -> None:
    a, _, _ = trio_default
    own = RRef([1, 2])
    assert f"1 owner-side RRef object on {a.name!r}" in debug.why_alive(own)["reasons"]
    del own
    gc.collect()
    pytest.importorskip("anywidget")
    from nbrpc.jupyter.rref_graph_view import RRefGraphView

    one = remote(a, "b", list, ("ab",), {}, -1)
    assert poll_for(one.confirmed_by_owner)
    view = RRefGraphView()
    try:
        assert view.status.startswith("1 user fork, "), view.status
        two = remote(a, "c", list, ("cd",), {}, -1)
        assert poll_for(two.confirmed_by_owner)
        view.refresh()
        assert view.status.startswith("2 user forks, "), view.status
    finally:
        view.close()


@pytest.mark.cluster
def test_creation_site_names_the_cell_that_ran_through_a_real_kernel(tmp_path) -> None:
    """IPython advances its execution count before a cell runs: the site comes
    from the cell's own file name instead. A function defined in one cell and
    called from a later one names the cell (and line) that defined it."""
    from test_kernel import Kernel

    kernel = Kernel(str(tmp_path))
    try:
        kernel.ok("from nbrpc import rpc\nfrom nbrpc.rpc.api import _free_port_options\n"
                  "rpc.init_rpc('k', rank=0, world_size=1, "
                  "rpc_backend_options=_free_port_options())")
        out, reply = kernel.run("def make():\n    return rpc.remote('k', list, args=('ab',))")
        defined = reply["execution_count"]
        out, reply = kernel.run("x = 1\nr = rpc.remote('k', sum, args=([1, 2],))\nm = make()")
        ran = reply["execution_count"]
        assert reply["status"] == "ok" and ran == defined + 1, (out, reply)
        assert kernel.ok("print(r._site)\nprint(m._site)").splitlines() == [
            f"cell In[{ran}], line 2", f"cell In[{defined}], line 2"]
        kernel.ok("del r, m\nrpc.shutdown()")
    finally:
        kernel.close()


def _keep_then_drop(box: list, read: threading.Event, dropped: threading.Event,
                    end: threading.Event) -> None:
    batch = [box.pop()]  # (the thread's arguments keep no RRef)
    read.wait(10)
    batch = None  # noqa: F841 - dropped while the function still runs
    dropped.set()
    end.wait(10)


def test_why_alive_keeps_nothing_alive(trio_default) -> None:
    """why_alive reads every thread's frames: it must not keep them in a cycle
    (with their variables, until a full collection), nor leave RRefs in the
    dicts that reading a frame's variables makes. With the collector off, once
    the variables that held an RRef are gone, so is the RRef, even while the
    functions that held it still run."""
    a, _, _ = trio_default
    r = remote(a, "b", list, ("ab",), {}, -1)
    release, holding, read, dropped, end = (threading.Event() for _ in range(5))
    t = threading.Thread(target=_hold, args=(r, release, holding))
    t2 = threading.Thread(target=_keep_then_drop, args=([r], read, dropped, end))
    gc.collect()
    gc.disable()
    try:
        t.start()
        t2.start()
        assert holding.wait(10)
        refs = debug.why_alive(r)["references"]["a"]
        assert any(x.startswith("local 'held' in _hold") for x in refs), refs
        assert any(x.startswith("the list `batch` (1 item), a local in _keep_then_drop")
                   for x in refs), refs
        read.set()
        assert dropped.wait(10)
        gone = weakref.ref(r)
        del r
        assert gone() is not None  # _hold still runs
        release.set()
        t.join(10)
        assert gone() is None and t2.is_alive()
    finally:
        release.set()
        end.set()
        gc.enable()
        t2.join(10)
