"""The widget base: the views registry, front-end events, reprs, live refresh, a
view whose group has stopped, snapshots."""

from __future__ import annotations

import ast
import contextlib
import importlib
import inspect
import pkgutil
import re
import textwrap
import threading
from collections.abc import Iterator

import pytest
from conftest import local_group, poll_for

import nbrpc
from nbrpc import jupyter, views
from nbrpc.agent import Agent
from nbrpc.agent.agent import _local
from nbrpc.jupyter import view as view_module
from nbrpc.jupyter.view import (
    GONE,
    VARIES_CLOSE,
    VARIES_OPEN,
    View,
    button,
    check_open_views,
    toggle,
)
from nbrpc.rpc import rpc_sync


class Counter(View):
    """A view that counts its refreshes and the controls pressed."""

    def __init__(self, fail_after: int | None = None) -> None:
        super().__init__()
        self.refreshes, self.pressed, self.fail_after = 0, [], fail_after
        self.refresh()

    def refresh(self) -> None:
        if self.fail_after is not None and self.refreshes >= self.fail_after:
            raise RuntimeError("the data went away")
        self.refreshes += 1
        self.title = "counter"
        self.html = f'<svg><rect data-key="r{self.refreshes}"/></svg>'
        self.controls = [button("bump", "Bump")]
        self.status = f"{self.refreshes} refreshes"

    def text(self) -> str:
        return "a counter"

    def on_control(self, id: str, value: object = None) -> None:
        if id != "bump":
            super().on_control(id, value)
        self.pressed.append(id)

    def on_select(self, key: str) -> None:
        self.panel = f"selected {key}"


def live_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "nbrpc-live-view"]


def test_front_end_events_reach_the_view_and_failures_land_in_the_panel() -> None:
    v = Counter()
    v._on_front_end(v, {"event": "control", "id": "bump"}, None)
    v._on_front_end(v, {"event": "select", "key": "r1"}, None)
    assert v.pressed == ["bump"] and v.panel == "selected r1"
    v._on_front_end(v, {"event": "control", "id": "explode"}, None)
    assert "ValueError" in v.panel and "no control" in v.panel
    v.close()


def test_reprs_text_is_the_views_and_the_live_status_is_marked_as_varying() -> None:
    v = Counter()
    data, _ = v._repr_mimebundle_()
    assert data["text/plain"] == "a counter" == repr(v)
    assert "application/vnd.jupyter.widget-view+json" in data
    assert f"{VARIES_OPEN}1 refreshes{VARIES_CLOSE}" in data["text/html"]
    assert '<rect data-key="r1"/>' in data["text/html"]
    v.close()


def test_live_refresh_runs_and_stops_on_close() -> None:
    v = Counter()
    v.live(period=0.5)
    assert v.is_live and poll_for(lambda: v.refreshes >= 2, timeout=5)
    v.close()
    assert not v.is_live and not live_threads()


def test_live_refresh_stops_when_its_subject_is_gone_or_keeps_failing() -> None:
    alive = [True]
    v = Counter()
    v.live(period=0.5, alive=lambda: alive[0])
    assert poll_for(lambda: v.refreshes >= 2, timeout=5)
    alive[0] = False
    assert poll_for(lambda: not live_threads(), timeout=5)
    w = Counter(fail_after=1)
    w.live(period=0.5)
    assert poll_for(lambda: not live_threads(), timeout=5)  # three failures in a row
    v.close()
    w.close()


def test_the_registry_loads_the_jupyter_layer_and_names_what_it_knows() -> None:
    assert {"cluster", "rref_graph", "owner_map", "trace", "stepper"} <= set(views.known())
    with pytest.raises(LookupError, match="no view of kind 'x'; known: cluster"):
        views.make("x", None)


def test_show_refuses_what_it_cannot_show_and_says_what_it_can() -> None:
    with pytest.raises(TypeError, match="shows traces, RRef graphs"):
        nbrpc.show(42)


def test_a_refresh_reaches_the_front_end_as_one_state_message() -> None:
    """The title, drawing, controls and status of one refresh travel together:
    the browser never shows a new title over the old drawing."""
    v = Counter()
    sent: list[set[str]] = []
    v.send_state = lambda key=None: sent.append(set(key) if key is not None else {"*"})
    v.refresh()
    assert sent == [{"html", "status"}], sent  # title and controls did not change
    sent.clear()
    v._on_front_end(v, {"event": "select", "key": "r1"}, None)
    v._on_front_end(v, {"event": "control", "id": "explode"}, None)
    assert sent == [{"panel"}, {"panel"}], sent
    v.close()


def test_a_live_tick_and_a_click_do_not_interleave() -> None:
    """A refresh holds the view's lock: a click waits for the tick under way."""
    inside, release = threading.Event(), threading.Event()

    class Slow(Counter):
        def refresh(self) -> None:
            super().refresh()
            if self.refreshes == 2:
                inside.set()
                release.wait(10)

    v = Slow()
    t = threading.Thread(target=v.refresh, daemon=True)
    t.start()
    assert inside.wait(10)
    clicked = threading.Thread(target=v._on_front_end,
                               args=(v, {"event": "select", "key": "r2"}, None), daemon=True)
    clicked.start()
    clicked.join(0.3)
    assert clicked.is_alive() and v.panel == ""  # waiting for the refresh
    release.set()
    t.join(10)
    clicked.join(10)
    assert v.panel == "selected r2"
    v.close()


# -- a view whose group has stopped ---------------------------------------------------------
@contextlib.contextmanager
def a_group() -> Iterator[Agent]:
    """A one-agent group that this test thread calls through (as a driver does)."""
    with local_group(["a"]) as (agent,):
        _local.agent = agent
        try:
            yield agent
        finally:
            _local.agent = None


class Asking(Counter):
    """A view whose click asks its group (as the RRef graph's why_alive does)."""

    def on_select(self, key: str) -> None:
        self.panel = f"answer: {rpc_sync('a', len, args=(key,))}"


def test_a_view_whose_group_stopped_says_so_and_disables_its_buttons() -> None:
    with a_group() as agent:
        v = Counter()
        v.controls = [button("bump", "Bump"), toggle("live", "live", True)]
        v.live(period=0.5)
        assert v.group is agent and not v.gone
        check_open_views()  # (the end of a cell) a running group: nothing changes
        assert not v.gone and v.is_live
    check_open_views()
    assert v.gone and not v.is_live and not live_threads()
    assert re.fullmatch(rf"\d+ refreshes · {GONE}", v.status)  # the last state, said so
    assert {c["id"]: c.get("disabled", False) for c in v.controls} == {
        "bump": True, "live": False}  # a toggle does no harm
    v._on_front_end(v, {"event": "control", "id": "bump"}, None)  # a stale button
    assert v.pressed == [] and "The group has stopped" in v.panel and "bump" in v.panel
    v.refresh()  # a redraw keeps saying it
    assert v.status.endswith(GONE) and v.controls[0]["disabled"]
    assert GONE in v._repr_mimebundle_()[0]["text/html"]
    v.close()


def test_a_click_that_needs_a_stopped_group_fails_into_the_panel(
        caplog: pytest.LogCaptureFixture) -> None:
    with a_group():
        v = Asking()
        v._on_front_end(v, {"event": "select", "key": "abc"}, None)
        assert v.panel == "answer: 3"
    v._on_front_end(v, {"event": "select", "key": "abc"}, None)  # no exception escapes
    assert v.panel.startswith('<div class="nbrpc-error"><b>')
    assert "(the group has stopped)" in v.panel and v.status.endswith(GONE)
    assert any(r.levelname == "ERROR" and "Asking" in r.getMessage() for r in caplog.records)
    v.close()


def test_a_live_view_says_its_group_stopped_when_its_refresh_ends() -> None:
    with a_group() as agent:
        v = Counter()
        v.live(period=0.5, alive=lambda: agent.state == "ready")
        assert poll_for(lambda: v.refreshes >= 2, timeout=5)
    assert poll_for(lambda: v.status.endswith(GONE), timeout=5)
    v.close()


def test_the_end_of_a_cell_checks_the_open_views(monkeypatch: pytest.MonkeyPatch) -> None:
    import IPython
    from IPython.core.events import EventManager, available_events

    class Shell:
        events = EventManager(None, available_events)

    monkeypatch.setattr(IPython, "get_ipython", lambda: Shell)
    with a_group():
        v, w = Counter(), Counter()
    assert Shell.events.callbacks["post_run_cell"].count(view_module._after_cell) == 1
    assert not v.gone
    Shell.events.trigger("post_run_cell", None)
    assert v.gone and w.gone and v.status.endswith(GONE)
    v.close()
    w.close()


def test_a_view_of_plain_data_has_no_group_to_lose() -> None:
    v = Counter()
    assert v.group is None and not v.check_group()
    v._on_front_end(v, {"event": "control", "id": "bump"}, None)
    assert v.pressed == ["bump"]
    v.close()


def test_a_snapshot_keeps_the_moment_it_was_taken() -> None:
    v = Counter()
    snap = v.snapshot()
    v.refresh()
    assert repr(snap) == "a counter" and snap._repr_html_() != v.static_html()
    assert '<rect data-key="r1"/>' in snap._repr_html_()
    assert '<rect data-key="r2"/>' in v.static_html()
    assert "application/vnd.jupyter.widget-view+json" not in str(snap._repr_html_())
    v.close()


def test_no_view_hides_a_method_of_view_under_an_attribute() -> None:
    """``self.snapshot = ...`` in a subclass once made every ``snapshot()`` of
    the cluster view raise "'ClusterStatus' object is not callable"."""
    for info in pkgutil.iter_modules(jupyter.__path__):  # every view class defined
        importlib.import_module(f"{jupyter.__name__}.{info.name}")
    methods = {name for name in dir(View)
               if inspect.isfunction(inspect.getattr_static(View, name))}
    assert {"snapshot", "refresh", "text", "static_html"} <= methods
    views, todo = [], list(View.__subclasses__())
    while todo:
        views.append(todo.pop())
        todo += views[-1].__subclasses__()
    assert {"ClusterView", "StepperView", "TraceView"} <= {v.__name__ for v in views}
    for cls in views:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        assigned = {t.attr for node in ast.walk(tree) if isinstance(node, ast.Assign)
                    for t in node.targets if isinstance(t, ast.Attribute)
                    and isinstance(t.value, ast.Name) and t.value.id == "self"}
        assert not assigned & methods, (cls.__qualname__, assigned & methods)


def test_the_tutorials_saved_widgets_carry_the_packages_stylesheet() -> None:
    """JupyterLab restores a notebook's saved widget models, each with its copy of
    view.css, and the stylesheet added last wins: a stale copy would override the
    package's. Re-run a tutorial (or refresh its widget state) when view.css changes."""
    import json
    from pathlib import Path

    css = (view_module.STATIC / "view.css").read_text()
    stale = []
    for path in sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb")):
        widgets = json.loads(path.read_text()).get("metadata", {}).get("widgets", {})
        state = widgets.get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
        stale += [path.name for m in state.values() if m.get("state", {}).get("_css", css) != css]
    assert not stale, f"saved widgets with an older view.css: {sorted(set(stale))}"
