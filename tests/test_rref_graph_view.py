"""The RRef graph view's model state (no browser): values, forks, pending forks,
deletes, flags, why_alive on click, Forget outputs, bounds and determinism."""

from __future__ import annotations

import gc
import random
import sys
import time

import pytest
from conftest import poll_for, small_rref_graph

pytest.importorskip("anywidget")

from nbrpc import debug  # noqa: E402
from nbrpc.jupyter.rref_graph_view import (  # noqa: E402
    LANE_LIMIT,
    LEAK_BOX,
    LIMIT,
    RRefGraphView,
    graph_model,
    graph_svg,
    graph_text,
    rref_graph_html,
)
from nbrpc.rref import RRef, remote  # noqa: E402


class Box:
    def __init__(self, n: int) -> None:
        self.n = n


def hold(rref: RRef, seconds: float) -> int:
    time.sleep(seconds)  # deliberate: holds the fork of ``rref`` for ``seconds``
    return 1


def fresh(view: RRefGraphView) -> dict:
    """The view's model after a refresh (for polling)."""
    view.refresh()
    return view.model


def holders(view: RRefGraphView, rid: str, refresh: bool = False) -> dict[str, str]:
    model = fresh(view) if refresh else view.model
    return {h: s for (h, _), s in model["nodes"][rid]["holders"].items()}


def test_remote_fork_and_delete_as_the_view_sees_them(trio_default) -> None:
    a, b, c = trio_default
    r = remote(a, "b", Box, (1,), {}, -1)
    rid = str(r._id)
    assert poll_for(r.confirmed_by_owner)
    view = RRefGraphView()
    node = view.model["nodes"][rid]
    assert node["owner"] == "b" and node["type"].endswith("Box") and node["flags"] == []
    assert holders(view, rid) == {"a": "confirmed"}
    assert "test_rref_graph_view.py" in node["site"]
    assert view.model["lanes"] == ["a", "b", "c"]  # every member, by rank
    assert f'data-key="{rid}"' in view.html and view.title == "RRef graph: 1 value on 1 owner"
    assert f"  {rid} on b: test_rref_graph_view.Box" in view.text()

    busy = a.rpc_async("c", hold, (r, 0.6))  # c holds a fork while the call runs
    assert poll_for(lambda: set(holders(view, rid, refresh=True)) == {"a", "c"})
    # (c's fork may show as pending until c hears the owner's answer)
    assert poll_for(lambda: fresh(view) and "held by a, c; ready" in view.text()), view.text()
    assert view.html.count("fork ") >= 2  # one line per fork, with a hover title
    assert busy.wait() == 1
    del r, busy
    gc.collect()
    assert poll_for(lambda: fresh(view)["nodes"] == {})
    assert view.text().startswith("RRef graph: 0 values on 0 owners, 0 user forks")
    view.close()


def test_a_pending_fork_is_drawn_as_pending(trio_default) -> None:
    a, b, c = trio_default
    r = remote(a, "b", Box, (2,), {}, -1)
    rid = str(r._id)
    assert poll_for(r.confirmed_by_owner)
    c.faults.add("rref_fork", "delay", delay=1.5)  # c's registration with b is late
    done = a.rpc_async("c", hold, (r, 0.0))
    view = RRefGraphView()
    assert poll_for(lambda: fresh(view)["nodes"][rid]["pending"], timeout=3)
    node = view.model["nodes"][rid]
    assert [(src, dst) for src, dst, _ in node["pending"]] == [("a", "c")]
    assert holders(view, rid)["c"] == "pending"
    assert "not accepted yet" in view.html and 'stroke-dasharray="5,3"' in view.html
    assert "1 pending fork" in view.text() and "c (pending)" in view.text()
    assert "flagged" not in view.model["nodes"][rid]["flags"]
    assert done.wait() == 1
    assert poll_for(lambda: not fresh(view)["nodes"][rid]["pending"],
                    timeout=5)
    assert "0 pending forks" in view.text()
    del r, done
    gc.collect()
    assert poll_for(lambda: debug.rref_graph()["values"] == {})
    view.close()


def test_clicking_a_value_shows_why_it_is_alive(trio_default) -> None:
    a, _, _ = trio_default
    kept = remote(a, "b", Box, (3,), {}, -1)
    rid = str(kept._id)
    assert poll_for(kept.confirmed_by_owner)
    view = RRefGraphView()
    view._on_front_end(view, {"event": "select", "key": rid}, None)  # as the browser sends it
    assert f"Why is RRef {rid} alive?" in view.panel
    assert f"user fork {kept._fork} held by &#x27;a&#x27; (confirmed)" in view.panel
    assert "&#x27;kept&#x27;" in view.panel  # the variable that holds it, in the panel
    assert f"selected {rid}:\n  user fork {kept._fork} held by 'a' (confirmed)" in view.text()
    preselected = RRefGraphView(select=rid)
    assert preselected.selected == rid and "Why is RRef" in preselected.panel
    assert "nbrpc-selected" in preselected.html
    view._on_front_end(view, {"event": "select", "key": "9:99"}, None)
    assert "owned by no live worker" in view.panel
    view.close()
    preselected.close()
    del kept


def test_forget_outputs_drops_an_rref_kept_by_out(trio_default, monkeypatch) -> None:
    """A displayed RRef stays in Out[n]: the view flags it as kept by the output
    history, and "Forget outputs" lets go of it on every worker."""
    pytest.importorskip("IPython")
    import builtins

    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.delattr(builtins, "_", raising=False)  # as in a kernel
    saved_main = sys.modules["__main__"]
    shell = InteractiveShell.instance()
    try:
        shell.run_cell("from nbrpc.rpc import remote\nfrom test_rref_graph_view import Box",
                       store_history=True)
        shell.run_cell("r = remote('b', Box, args=(7,))", store_history=True)
        shell.run_cell("r", store_history=True)  # displayed: now in Out
        rid = str(shell.user_ns["r"]._id)
        shell.run_cell("del r", store_history=True)
        gc.collect()
        view = RRefGraphView()
        node = view.model["nodes"][rid]
        assert "output" in node["flags"] and any(o.startswith("Out[") for o in node["outputs"])
        assert "[output]" in view.text() and "1 in output history" in view.text()
        view._on_front_end(view, {"event": "control", "id": "forget"}, None)
        assert view.forgot is not None and view.forgot["a"] >= 1
        assert "forgot" in view.status
        assert poll_for(lambda: rid not in fresh(view)["nodes"], timeout=5)
        view.close()
    finally:
        InteractiveShell.clear_instance()
        sys.modules["__main__"] = saved_main


def test_live_toggle_refreshes_and_stops(trio_default) -> None:
    view = RRefGraphView(live=True)
    assert view.is_live
    assert [c["value"] for c in view.controls if c["id"] == "live"] == [True]
    view._on_front_end(view, {"event": "control", "id": "live", "value": False}, None)
    assert not view.is_live
    view.close()


# -- synthetic graphs: flags, bounds, determinism ---------------------------------------
def value(owner: str, users: dict[str, str], nbytes: int = 64, typ: str = "torch.Tensor",
          state: str = "ready", owner_refs: int = 0) -> dict:
    return {"owner": owner, "state": state, "type": typ, "nbytes": nbytes,
            "site": "cell In[3], line 2", "age": 1.0, "owner_refs": owner_refs, "users": users}


def user(rid: str, fork: str, worker: str, owner: str, state: str = "confirmed") -> dict:
    return {"rref_id": rid, "fork_id": fork, "owner": owner, "parent": None, "state": state,
            "site": "cell In[3], line 2", "worker": worker}


def test_leaked_and_orphaned_references_are_flagged() -> None:
    graph = {"workers": ["driver", "worker1"], "edges": [], "pending": [], "values": {
        "1:1": value("worker1", {"0:9": "driver"}),
        "1:2": value("worker1", {}),  # nothing keeps it, yet it is listed: unreferenced
        "1:3": value("worker1", {"0:8": "worker2"}),  # held by a worker that left
        "1:4": value("worker1", {}, owner_refs=1)},  # kept by its owner: fine
        "users": [user("1:1", "0:9", "driver", "worker1"),
                  user("2:1", "0:7", "driver", "worker2"),  # owner gone: orphan
                  user("1:5", "0:6", "driver", "worker1"),  # confirmed, no value: orphan
                  user("1:6", "0:5", "driver", "worker1", "pending")]}  # on its way: fine
    model = graph_model(graph)
    flags = {rid: n["flags"] for rid, n in model["nodes"].items()}
    assert flags == {"1:1": [], "1:2": ["unreferenced"], "1:3": ["gone-holder"], "1:4": [],
                     "2:1": ["orphan"], "1:5": ["orphan"]}
    assert model["lanes"] == ["driver", "worker1", "worker2"]
    text = graph_text(model)
    assert "4 flagged" in text and "  2:1 on worker2: ?, ?, cell In[3], line 2, held by driver" \
        "; missing [orphan]" in text
    html = rref_graph_html(graph)
    assert html.count(LEAK_BOX[0]) == 4 + 1  # four flagged nodes, and the legend
    assert "worker2 (gone)" in html


def big_graph(workers: int, values: int, seed: int) -> dict:
    rng = random.Random(seed)
    names = ["driver"] + [f"worker{i}" for i in range(1, workers)]
    vals, users = {}, []
    for i in range(values):
        owner = names[1 + i % (workers - 1)]
        rid = f"0:{i}"
        held = {f"{k}:{i}": h for k, h in enumerate(rng.sample(names, rng.randint(1, 3)))
                if h != owner} or {f"9:{i}": "driver"}
        vals[rid] = value(owner, held, nbytes=rng.randint(1, 10**6),
                          typ=rng.choice(["torch.Tensor", "torch.nn.Linear", "__main__.Box"]))
        users += [user(rid, f, h, owner) for f, h in held.items()]
    return {"workers": names, "values": vals, "users": users, "pending": [], "edges": []}


def test_sixteen_workers_and_two_thousand_rrefs_stay_bounded() -> None:
    graph = big_graph(16, 2000, seed=1)
    t0 = time.perf_counter()
    view = RRefGraphView(graph)
    took = time.perf_counter() - t0
    drawn = sum(len(ns) for ns in view.model["drawn"].values())
    marks = view.html.count('class="nbrpc-rref')
    print(f"\n16 workers x 2,000 RRefs: {drawn} values drawn, {len(view.html):,} chars of SVG, "
          f"Python render {took * 1e3:.0f} ms")
    assert drawn == marks <= LIMIT and len(view.html) < 2_000_000
    hidden = sum(len(ns) for ns in view.model["hidden"].values())
    assert drawn + hidden == 2000 and view.html.count("… and") == 15  # one per owner lane
    assert len(view.text().splitlines()) <= 62  # summary, 60 values, "… and 1,940 more"
    view.close()
    one_lane = {"workers": ["driver", "worker1"], "users": [], "pending": [], "edges": [],
                "values": {f"0:{i}": value("worker1", {f"f{i}": "driver"})
                           for i in range(1000)}}
    model = graph_model(one_lane)
    assert len(model["drawn"]["worker1"]) == LANE_LIMIT
    assert "… and 600 more (Tensor ×600)" in rref_graph_html(one_lane)


def test_flagged_and_selected_values_are_drawn_first_when_bounded() -> None:
    graph = big_graph(4, 600, seed=2)
    graph["values"]["0:599"]["users"] = {}  # unreferenced: must be drawn
    graph["users"] = [u for u in graph["users"] if u["rref_id"] != "0:599"]
    assert graph_model(graph)["nodes"]["0:599"]["flags"] == ["unreferenced"]
    model = graph_model(graph, select="0:598", limit=30)
    drawn = {n["rid"] for ns in model["drawn"].values() for n in ns}
    assert {"0:598", "0:599"} <= drawn and len(drawn) <= 30


def test_text_and_html_do_not_depend_on_insertion_order() -> None:
    graph = big_graph(5, 80, seed=3)
    shuffled = dict(graph)
    items = list(graph["values"].items())
    random.Random(4).shuffle(items)
    shuffled["values"] = {rid: dict(v, users=dict(reversed(list(v["users"].items()))))
                          for rid, v in items}
    shuffled["users"] = list(reversed(graph["users"]))
    a, b = RRefGraphView(graph), RRefGraphView(shuffled)
    assert a.text() == b.text() and a.html == b.html
    assert rref_graph_html(graph) == rref_graph_html(shuffled)
    a.close()
    b.close()


def test_its_text_and_lines_follow_the_theme() -> None:
    import re

    from nbrpc.jupyter.svg import ERROR

    graph = small_rref_graph("builtins.list", 72)
    svg = graph_svg(graph_model(graph, lane_limit=1))
    # the drawing's text takes the page's text colour (light or dark theme, GitHub)...
    assert re.match(r'<svg [^>]*fill="currentColor"', svg)
    texts = re.findall(r"<text [^>]*>", svg)
    assert len(texts) >= 8
    # (secondary text: that colour, lighter); a gone worker's lane in the theme's
    # error colour; no fixed greys
    assert not [t for t in texts if 'fill="#' in t and ERROR not in t], texts
    assert [t for t in texts if ERROR in t] and 'fill="currentColor" fill-opacity' in svg
    assert "worker2 (gone)" in svg
    # value boxes and lanes are faint tints, never an opaque light fill that the
    # dark theme's light text would vanish on
    assert not re.search(r'fill="#(fff|ffffff|f3f6f9|fdecea|fff4e0)"', svg)
