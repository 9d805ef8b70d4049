"""The widget base: the views registry, front-end events, reprs, live refresh."""

from __future__ import annotations

import threading

import pytest
from conftest import poll_for

import nbrpc
from nbrpc import views
from nbrpc.jupyter.view import VARIES_CLOSE, VARIES_OPEN, View, button


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
