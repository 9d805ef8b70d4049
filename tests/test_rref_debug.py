"""Seeing RRef lifetimes: the merged graph, owner map, table, networkx export,
"why is this alive" (IPython's Out history included) and creation sites."""

from __future__ import annotations

import gc
import sys

import pytest
from conftest import poll_for

from nbrpc import debug
from nbrpc.rref import RRef, remote


class Box:
    def __init__(self, n: int) -> None:
        self.n = n


def use(rref: RRef, seconds: float) -> int:
    import time

    time.sleep(seconds)  # deliberate: holds the fork of ``rref`` for ``seconds``
    return rref.to_here().n


def test_graph_owner_map_table_and_networkx(trio_default) -> None:
    a, b, c = trio_default
    r1 = remote(a, "b", Box, (1,), {}, -1)
    r2 = remote(a, "c", Box, (2,), {}, -1)
    busy = a.rpc_async("c", use, (r1, 0.5))  # c holds a fork of r1 meanwhile
    rid1, rid2 = str(r1._id), str(r2._id)
    assert poll_for(lambda: len(debug.rref_graph()["values"].get(rid1, {}).get("users", {})) == 2)
    graph = debug.rref_graph()
    assert graph["values"][rid1]["owner"] == "b" and graph["values"][rid2]["owner"] == "c"
    assert sorted(graph["values"][rid1]["users"].values()) == ["a", "c"]
    assert {(e[0], e[1], e[2]) for e in graph["edges"]} == {
        ("b", "a", rid1), ("b", "c", rid1), ("c", "a", rid2)}
    omap = debug.owner_map()
    assert list(omap) == ["a", "b", "c"] and omap["a"] == []
    assert omap["b"][0]["held_by"] == ["a", "c"] and omap["b"][0]["type"].endswith("Box")
    table = debug.rref_table()
    assert [(r["rref_id"], r["worker"], r["role"]) for r in table if r["rref_id"] == rid1] == [
        (rid1, "b", "owner"), (rid1, "a", "user"), (rid1, "c", "user")]
    assert all("test_rref_debug.py" in r["site"] for r in table)
    g = debug.to_networkx(graph)
    assert g.nodes[f"rref {rid1}"]["kind"] == "value"
    assert sorted(v for _, v, d in g.out_edges(f"rref {rid1}", data=True) if d["kind"] == "held") == [
        "a", "c"]
    assert busy.wait() == 1
    del r1, r2, busy
    gc.collect()
    assert poll_for(lambda: debug.rref_graph()["values"] == {})


def on_meta(n: int):
    import torch

    return torch.zeros(n, device="meta")  # stands in for a GPU: every machine has it


def test_values_off_the_cpu_are_labelled_with_their_device(trio_default) -> None:
    """The owner map and the RRef graph say where a value's memory is when it is
    not on the CPU, and the owner map adds it up per worker and device; values
    on the CPU read as before."""
    from nbrpc.jupyter.owner_map_view import owner_map_text
    from nbrpc.jupyter.rref_graph_view import graph_model, graph_text

    a, _, _ = trio_default
    on_b = remote(a, "b", on_meta, (4,), {}, -1)
    on_c = remote(a, "c", Box, (1,), {}, -1)
    rid = str(on_b._id)
    assert poll_for(lambda: rid in debug.rref_graph()["values"])
    omap = debug.owner_map()
    assert [r["device"] for r in omap["b"]] == ["meta"] and omap["c"][0]["device"] is None
    text = owner_map_text(omap)
    assert text.splitlines()[-1] == "  device memory held by RRef values: b meta 16 B"
    assert f"{rid} on b: torch.Tensor, 16 B on meta," in graph_text(
        graph_model(debug.rref_graph()))
    # the cluster view's rows: what each worker's values hold off its CPU
    from nbrpc.cluster.engine import describe

    row_b, row_c = describe(trio_default[1]), describe(trio_default[2])
    assert (row_b["device_bytes"], row_b["owned_bytes"]) == (16, 16)
    assert row_c["device_bytes"] == 0 and row_c["owned_bytes"] > 0
    del on_b, on_c
    gc.collect()
    assert poll_for(lambda: debug.rref_graph()["values"] == {})


def test_why_alive_names_users_and_variables(trio_default) -> None:
    a, b, c = trio_default
    kept = remote(a, "b", Box, (3,), {}, -1)
    assert poll_for(kept.confirmed_by_owner)
    why = debug.why_alive(kept)
    assert why["reasons"] == [f"user fork {kept._fork} held by 'a' (confirmed)"]
    assert any("'kept'" in ref for ref in why["references"]["a"]), why
    assert why["references"]["b"] == [] and why["hints"]
    rid = str(kept._id)
    del kept
    gc.collect()
    assert poll_for(lambda: "already freed" in debug.why_alive(rid)["reasons"][0])


def test_a_frames_variables_are_read_from_a_view_as_python_3_13_gives(trio_default) -> None:
    """From Python 3.13 f_locals is a view that refuses deletions (PEP 667);
    before, a dict left on the frame, from which RRefs are taken out."""
    import inspect
    import types

    from nbrpc.debug import referrers

    a, _, _ = trio_default
    kept = remote(a, "b", Box, (3,), {}, -1)
    code = types.SimpleNamespace(co_flags=inspect.CO_OPTIMIZED)
    view = types.MappingProxyType({"kept": kept, "n": 1})  # refuses deletions, too
    frame = types.SimpleNamespace(f_code=code, f_locals=view)
    assert referrers._variables(frame) == [("kept", kept), ("n", 1)]  # type: ignore[arg-type]
    left = {"kept": kept, "n": 1}
    frame.f_locals = left
    assert referrers._variables(frame) == [("kept", kept), ("n", 1)]  # type: ignore[arg-type]
    assert left == {"n": 1}  # the RRef taken out of the dict left on the frame


def test_ipython_output_history_keeps_an_rref_alive_and_why_alive_says_so(
        trio_default, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cell that displays an RRef stores it in Out[n] (and _): deleting the
    variable does not free the value, and why_alive points at Out."""
    pytest.importorskip("IPython")
    import builtins

    from IPython.core.interactiveshell import InteractiveShell

    # as in a kernel: with a builtins._ (left by an earlier doctest's displayhook)
    # IPython would not set _ in the user namespace
    monkeypatch.delattr(builtins, "_", raising=False)

    a, b, _ = trio_default
    saved_main = sys.modules["__main__"]
    shell = InteractiveShell.instance()
    try:
        shell.run_cell("from nbrpc.rpc import remote\nfrom test_rref_debug import Box", store_history=True)
        made = shell.run_cell("r = remote('b', Box, args=(7,))", store_history=True)
        shell.run_cell("r", store_history=True)  # displayed: now in Out
        shown = shell.run_cell("[remote('b', Box, args=(8,))]", store_history=True)
        in_list = shell.user_ns["Out"][shown.execution_count][0]
        assert f"IPython output history (Out[{shown.execution_count}]: a list of 1 item)" in \
            debug.why_alive(in_list)["references"]["a"]
        del in_list
        rref = shell.user_ns["r"]
        assert rref._site == f"cell In[{made.execution_count}], line 1"
        rid = str(rref._id)
        del rref
        shell.run_cell("del r", store_history=True)
        gc.collect()
        why = debug.why_alive(rid)
        assert any(ref.startswith("Out[") for ref in why["references"]["a"]), why
        # Out[n], _n and _ (and the display hook's _) are one reference, said once
        assert len([ref for ref in why["references"]["a"] if "output history" in ref]) == 1, why
        assert any("output history" in h and "forget_outputs()" in h for h in why["hints"])
        assert rid in debug.rref_graph()["values"]  # still alive on b
        shell.run_cell("%reset -f out", store_history=True)
        gc.collect()
        assert rid in debug.rref_graph()["values"]  # IPython's hidden namespace keeps `_`
        shell.run_cell("import nbrpc.debug; nbrpc.debug.forget_outputs()", store_history=True)
        assert poll_for(lambda: rid not in debug.rref_graph()["values"], timeout=5), \
            debug.why_alive(rid)["references"]
    finally:
        InteractiveShell.clear_instance()
        sys.modules["__main__"] = saved_main


_HOLDER: dict = {}  # made at import, before any agent: frozen while agents run


def test_why_alive_sees_containers_frozen_for_short_collections(trio_default) -> None:
    """Agents move older objects out of the collector's sight (gc.freeze), where
    gc.get_referrers cannot see them: why_alive thaws them first."""
    a, _, _ = trio_default
    from nbrpc.agent import gcfreeze

    assert gcfreeze.is_frozen() and gcfreeze.anything_frozen()
    _HOLDER["r"] = remote(a, "b", Box, (4,), {}, -1)
    try:
        why = debug.why_alive(_HOLDER["r"])
        assert "the dict `_HOLDER` (key 'r'), a global in module test_rref_debug" in \
            why["references"]["a"], why
        assert not gcfreeze.is_frozen() and not gcfreeze.anything_frozen()
    finally:
        del _HOLDER["r"]
