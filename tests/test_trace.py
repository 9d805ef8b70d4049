"""Message traces: what `debug.trace()` records between in-process agents, its
Chrome trace-event export, and the sequence-diagram widget's state."""

from __future__ import annotations

import gc
import json
from collections import Counter

import pytest
import torch
from conftest import local_group, poll_for

from nbrpc import autograd as dist_autograd
from nbrpc import debug
from nbrpc.agent import set_default_agent
from nbrpc.errors import RpcTimeoutError
from nbrpc.rref import RRef, remote


class Box:
    def __init__(self, n: int) -> None:
        self.n = n

    def grow(self, k: int) -> int:
        self.n += k
        return self.n


def read(rref: RRef) -> int:
    return rref.to_here().n


def fail() -> None:
    raise ValueError("no")


def call(agent, to, fn, args):  # noqa: ANN001,ANN201
    return agent.rpc_async(to, fn, args).wait()


def kinds(t: debug.Trace) -> Counter:
    """(kind, op, from, to) of the messages."""
    return Counter((m["kind"], m["op"], m["src"], m["dst"]) for m in t.messages)


def test_a_trace_holds_the_calls_replies_and_rref_protocol_of_its_block(trio_default) -> None:
    a, b, c = trio_default
    call(a, "b", abs, (-1,))  # before the trace: not in it
    with debug.trace() as t:
        call(a, "b", abs, (-2,))
        box = remote(a, "c", Box, (7,), {}, -1)
        assert call(a, "b", read, (box,)) == 7  # forks the RRef to b
        del box
        gc.collect()
        assert poll_for(lambda: not debug.rref_graph()["values"], timeout=5)
        # the owner frees the value inside its handler and logs serving a Delete
        # just after answering it, and the deleter logs the answer's arrival after
        # that: wait for those lines before the trace ends
        def count(agents, event):
            return sum(r["event"] == event and r["op"] == "rref_delete"
                       for ag in agents for r in ag.events.records(200))
        assert poll_for(lambda: 0 < count((a, b), "send") <= count((c,), "serve")
                        and count((a, b), "recv") >= count((a, b), "send"), timeout=5)
    seen = kinds(t)
    assert seen[("call", "call", "a", "b")] == 2
    assert seen[("reply", "call", "b", "a")] == 2
    assert seen[("rref", "remote", "a", "c")] == 1
    assert seen[("rref", "rref_fetch", "b", "c")] == 1  # b's to_here
    assert seen[("rref-protocol", "rref_fork", "b", "c")] == 1  # b registers with the owner
    assert sum(op == "rref_delete" for _, op, _, _ in seen) >= 1
    assert not t.lost
    for m in t.messages:  # same host: one clock, so nothing arrives before it left
        assert m["t0"] is not None and m["t1"] is not None, m
        assert 0 <= m["t0"] <= m["t1"] <= t.duration + 0.05, m
    calls = [m for m in t.messages if m["op"] == "call"]
    assert {m["what"] for m in calls} == {"abs", "read"}  # not debug.rref_graph()'s polls
    replies = [m for m in t.messages if m["kind"] == "reply"]
    assert all(m["latency"] > 0 and m["error"] is None for m in replies)
    assert [m["t0"] for m in t.messages] == sorted(m["t0"] for m in t.messages)
    text = str(t)
    assert text.splitlines()[0].startswith("Trace of a, b, c: ")
    assert "  rref: 1 request, 1 reply  a -> c" in text.splitlines()


def test_a_method_called_through_an_rref_is_traced_by_the_methods_name(trio_default) -> None:
    a, b, c = trio_default
    box = remote(a, "c", Box, (1,), {}, -1)
    box.to_here()  # (its value is there: remote() below looks the method up first)
    with debug.trace() as t:
        assert box.rpc_sync().grow(2) == 3
        assert box.rpc_async().grow(3).wait() == 6
        assert box.remote().grow(4).to_here() == 10
    whats = Counter(m["what"] for m in t.messages if m["kind"] == "call" and m["dst"] == "c")
    rid = box._id
    assert whats == {f"grow on RRef {rid}": 2, f"look up grow on RRef {rid}": 1}, whats
    assert sum(m["what"] == f"grow on RRef {rid}" for m in t.messages
               if m["kind"] == "rref" and m["op"] == "remote") == 1, t.messages
    assert not [m for m in t.messages if "_on_owner" in m["what"]]


def test_errors_timeouts_and_autograd_messages_are_traced(trio_default) -> None:
    a, b, c = trio_default
    x = torch.ones(3, requires_grad=True)
    with debug.trace() as t:
        c.faults.add("call", "drop", reply=True, times=1)  # c's next answer is lost
        with pytest.raises(ValueError):
            call(a, "b", fail, ())
        with pytest.raises(RpcTimeoutError):
            a.rpc_async("c", abs, (-1,), timeout=0.3).wait()
        with dist_autograd.context() as ctx:
            y = call(a, "b", torch.mul, (x, 2.0))
            dist_autograd.backward(ctx, [y.sum()])
    errors = Counter(m["error"] for m in t.messages if m["kind"] == "reply")
    assert errors["raised"] == 1 and errors["timed out"] == 1
    ops = {m["op"] for m in t.messages}
    assert "autograd_grads" in ops and "autograd_release" in ops
    stages = [e for e in t.events if e["event"] == "autograd-stage"]
    assert {e["worker"] for e in stages} == {"a", "b"}


def test_chrome_trace_is_valid_trace_event_json(trio_default, tmp_path) -> None:
    a, b, c = trio_default
    with debug.trace() as t:
        futs = [a.rpc_async(w, abs, (-i,)) for i, w in enumerate(["b", "c"] * 5)]
        [f.wait() for f in futs]
        box = remote(a, "c", Box, (1,), {}, -1)
        call(a, "b", read, (box,))
    path = tmp_path / "trace.json"
    doc = t.to_chrome_trace(path)
    assert json.loads(path.read_text()) == json.loads(json.dumps(doc))
    events = doc["traceEvents"]
    names = {e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {"a", "b", "c"}
    for e in events:
        assert e["ph"] in "MXsfi" and isinstance(e["pid"], int) and isinstance(e["tid"], int)
        if e["ph"] != "M":
            assert e["ts"] >= 0
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    ends = {e["id"]: e for e in events if e["ph"] == "f"}
    complete = [m for m in t.messages if m["t0"] is not None and m["t1"] is not None]
    assert starts.keys() == ends.keys() and len(starts) == len(complete) >= 24
    for i, s in starts.items():
        assert s["ts"] <= ends[i]["ts"]
    slices: dict[tuple[int, int], list] = {}
    for e in events:
        if e["ph"] == "X":
            slices.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    assert sum(len(v) for v in slices.values()) >= 2 * 12  # a call and a serve per request
    for spans in slices.values():  # slices on one thread never overlap
        spans.sort()
        assert all(prev[1] <= nxt[0] for prev, nxt in zip(spans, spans[1:])), spans


def test_an_overflowed_event_log_is_reported_as_lost() -> None:
    with local_group(["a", "b"], event_log_size=20) as (a, b):
        set_default_agent(a)
        try:
            with debug.trace() as t:
                for i in range(30):
                    call(a, "b", abs, (-i,))
        finally:
            set_default_agent(None)
    assert set(t.lost) == {"a", "b"} and "overflowed" in t.lost["a"]
    assert "lost: a: its event log overflowed" in str(t)


def test_the_widget_draws_each_message_and_filters_and_selects(trio_default) -> None:
    from nbrpc.jupyter.trace_view import TraceView, plot_latencies, trace_html

    a, b, c = trio_default
    with debug.trace() as t:
        for w in ("b", "c", "a"):
            call(a, w, abs, (-1,))
    view = t.widget()
    assert isinstance(view, TraceView)
    assert view.html.count('class="nbrpc-msg"') == len(t.messages) == 6
    assert view.filters == {"kind": ["call", "reply"], "worker": ["a", "b", "c"]}
    assert view.text() == str(t) and repr(view) == str(t)
    view._on_front_end(view, {"event": "select", "key": "1"}, None)
    assert f"<td>msg_id</td><td>{t.messages[1]['msg_id']}</td>" in view.panel
    before = view.html
    view._on_front_end(view, {"event": "control", "id": "to_scale", "value": True}, None)
    assert view.to_scale and view.html != before
    view._on_front_end(view, {"event": "control", "id": "nope"}, None)
    assert "no control &#x27;nope&#x27;" in view.panel  # shown, not raised into the kernel
    bundle, _ = view._repr_mimebundle_()
    assert bundle["text/plain"] == str(t)
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/html"].count('class="nbrpc-msg"') == 6
    assert trace_html(t).count('class="nbrpc-msg"') == 6
    fig = plot_latencies(t)
    assert [x.get_text() for x in fig.axes[0].get_legend().get_texts()] == ["call (3)"]
    view.close()


def test_the_widget_bounds_what_it_draws() -> None:
    from nbrpc.jupyter.trace_view import trace_svg

    msgs = [{"kind": "call", "op": "call", "what": "f", "src": f"w{i % 16}",
             "dst": f"w{(i + 1) % 16}", "msg_id": i, "nbytes": 10, "t0": i * 1e-5,
             "t1": i * 1e-5 + 5e-6} for i in range(5000)]
    t = debug.Trace(workers=[f"w{i}" for i in range(16)], duration=0.05, messages=msgs)
    svg = trace_svg(t, limit=1500)
    assert svg.count('class="nbrpc-msg"') == 1500
    assert "… and 3500 more messages" in svg


def test_nbrpcs_own_introspection_is_left_out_unless_asked_for(trio_default) -> None:
    a, b, c = trio_default
    for internal in (False, True):
        with debug.trace(internal=internal) as t:
            debug.rref_graph()  # a snapshot call to every member
            call(a, "b", abs, (-1,))
        whats = Counter(m["what"] for m in t.messages if m["kind"] != "reply")
        if internal:
            assert whats == {"abs": 1, "nbrpc:_snapshot_here": 3}, whats
        else:
            assert whats == {"abs": 1}, whats


def test_leaving_the_block_waits_for_the_answers_to_calls_it_did_not_wait_for(
        trio_default) -> None:
    import time

    a, b, c = trio_default
    for settle, answered in ((2.0, True), (0.0, False)):
        with debug.trace(settle=settle) as t:
            fut = a.rpc_async("b", time.sleep, (0.3,))
        replies = [m for m in t.messages if m["kind"] == "reply" and m["what"] == "sleep"]
        assert bool(replies) == answered, t.messages
        fut.wait()


def _entry(t: float, event: str, peer: str, duration: float | None = None) -> tuple:
    return (100.0 + t, event, "call", peer, 7, 10, duration, "abs")


def test_a_call_is_shown_before_its_reply_whatever_order_its_logs_were_written_in() -> None:
    # A self-call under load: the reply arrived (recv) before the calling thread
    # logged its send, and the callee logged its serve just after the caller had
    # left the block (as the nbrpc.debug.trace doctest can see on a busy machine).
    for serve in ([], [_entry(0.55, "serve", "d", 0.4)]):
        t = debug.Trace(workers=["d"], start=100.0, duration=0.5, _offsets={"d": 0.0})
        t._build({"d": [_entry(0.20, "recv", "d", 0.01), _entry(0.21, "send", "d"), *serve]})
        assert [(m["kind"], m["what"]) for m in t.messages] == [("call", "abs"),
                                                                ("reply", "abs")]
        call_, reply = t.messages
        assert call_["t0"] == pytest.approx(0.15 if serve else 0.20)  # served, arrived
        assert reply["t0"] == (pytest.approx(0.20) if serve else None)
    # a reply that left after the block and did not arrive within it is not in it
    t = debug.Trace(workers=["d"], start=100.0, duration=0.5, _offsets={"d": 0.0})
    t._build({"d": [_entry(0.10, "send", "d"), _entry(0.60, "serve", "d", 0.2),
                    _entry(0.61, "recv", "d", 0.5)]})
    assert [m["kind"] for m in t.messages] == ["call"], t.messages
    assert t.messages[0]["t1"] is None  # (its serve is logged after the block)


def test_arrow_labels_are_readable_and_never_overlap() -> None:
    import re

    from nbrpc.jupyter.svg import BACKING
    from nbrpc.jupyter.trace_view import trace_svg

    workers = ["driver", "worker1", "worker2", "worker3"]
    msgs = []
    for i in range(60):  # crowded: every arrow starts one row after the last
        src, dst = workers[i % 4], workers[(i * 3 + 1) % 4]
        msgs.append({"kind": "call", "op": "call", "what": f"a_rather_long_function_{i}",
                     "src": src, "dst": dst, "msg_id": i, "nbytes": 10,
                     "t0": i * 1e-5, "t1": i * 1e-5 + 2.5e-5})
    msgs.append({"kind": "call", "op": "call", "what": "itself", "src": "worker1",
                 "dst": "worker1", "msg_id": 99, "nbytes": 10, "t0": 7e-4, "t1": 7.1e-4})
    for i in range(10):  # ten at one instant: no room for all their labels
        msgs.append({"kind": "call", "op": "call", "what": f"a_rather_long_function_{i}",
                     "src": "driver", "dst": "worker1", "msg_id": 100 + i, "nbytes": 10,
                     "t0": 8e-4, "t1": 8.1e-4})
    t = debug.Trace(workers=workers, duration=1e-3, messages=msgs)
    svg = trace_svg(t)
    groups = re.findall(r'<g class="nbrpc-msg".*?</g>', svg)
    assert len(groups) == 71
    boxes, shown = [], 0
    for g in groups:
        assert re.search(r"<title>call a_rather_long_function_\d+|<title>call itself", g), g
        label = re.search(r'<rect class="nbrpc-label" x="([\d.]+)" y="([\d.]+)" '
                          r'width="([\d.]+)" height="([\d.]+)"'
                          rf' rx="2" {re.escape(BACKING)}/><text [^>]*font-size="(\d+)">([^<]*)'
                          "</text>", g)
        if label is None:
            continue
        x, y, w, h, size, text = label.groups()
        assert int(size) >= 11 and text.startswith("call ")
        boxes.append((float(x), float(y), float(x) + float(w), float(y) + float(h)))
        shown += 1
    assert 55 < shown < 71  # most arrows are labelled; where it is too crowded, not all
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not (a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]), (a, b)
    # text on the background is in the theme's colour, never a fixed dark grey
    assert 'font-size="11" fill="currentColor"' in svg
    assert not re.search(r'<text [^>]*fill="#', svg)
    assert 'font-size="9"' not in svg


def test_each_request_run_is_a_bar_on_its_callees_lifeline() -> None:
    import re

    from nbrpc.jupyter.trace_view import BAR_STEP, activations, trace_svg

    def msg(kind, what, src, dst, i, t0, t1):  # noqa: ANN001,ANN202
        return {"kind": kind, "op": "call", "what": what, "src": src, "dst": dst,
                "msg_id": i, "nbytes": 10, "t0": t0, "t1": t1}

    t = debug.Trace(workers=["a", "b", "c"], duration=0.01, messages=[
        msg("call", "f", "a", "b", 1, 0.000, 0.001), msg("call", "g", "a", "b", 2, 0.002, 0.003),
        msg("call", "h", "a", "c", 3, 0.002, 0.004),  # its reply left after the trace
        msg("reply", "g", "b", "a", 2, 0.005, 0.0055), msg("reply", "f", "b", "a", 1, 0.008, 0.009),
        msg("call", "k", "a", "b", 4, 0.0085, 0.0086),
        msg("reply", "k", "b", "a", 4, 0.0088, 0.0089)])
    acts = activations(t.messages)
    # f ran from 1 to 8 ms; g from 3 to 5, beside it; k after g, in g's column
    assert [(a["what"], a["start"], a["end"], a["level"]) for a in acts] == [
        ("f", 0.001, 0.008, 0), ("g", 0.003, 0.005, 1), ("k", 0.0086, 0.0088, 0)]
    svg = trace_svg(t, to_scale=True)
    bars = re.findall(r'<g class="nbrpc-act"[^>]*><rect x="([\d.]+)" y="([\d.]+)" width="\d+" '
                      r'height="([\d.]+)"[^>]*/><title>([^<]*)</title></g>', svg)
    assert len(bars) == 3
    (xf, yf, hf, tip_f), (xg, yg, hg, _), _ = bars
    assert float(xg) - float(xf) == pytest.approx(BAR_STEP)  # side by side
    assert float(hf) == pytest.approx(float(hg) * 3.5, rel=0.01)  # to scale: 7 ms and 2 ms
    assert tip_f == "b ran call f for a (msg 1): 7.000 ms, from 1.000 ms"
    # the bars hide with their kind's and their workers' checkboxes, as the arrows do
    assert re.findall(r'<g class="nbrpc-act" ([^>]*)>', svg) == [
        'data-f="kind worker" data-f-kind="call" data-f-worker="b a"'] * 3


def test_a_bar_spans_the_run_of_a_real_request(trio_default) -> None:
    import time

    from nbrpc.jupyter.trace_view import activations

    a, b, c = trio_default
    with debug.trace() as t:
        call(a, "b", time.sleep, (0.05,))
    (act,) = activations(t.messages)
    (reply,) = [m for m in t.messages if m["kind"] == "reply"]
    assert (act["worker"], act["caller"], act["what"]) == ("b", "a", "sleep")
    assert 0.05 <= act["end"] - act["start"] <= reply["latency"]
