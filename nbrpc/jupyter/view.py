"""The base of nbrpc's widgets: Python draws, the browser shows and reports clicks.

Each view turns plain data from :mod:`nbrpc.debug` into SVG/HTML on the Python
side. The same markup is the live widget's content (an anywidget whose one ES
module, ``static/view.js``, ships in the package) and its static ``text/html``
repr, which reads in a saved notebook and on GitHub. ``text/plain`` is a
deterministic summary (sorted; no addresses, pids or timings) for nbval.

A view sets traits (``title``, ``status``, ``html``, ``panel``, ``controls``,
``filters``); the front end sends back ``control`` events (buttons, toggles)
and ``select`` events (a click on a mark with ``data-key``), which reach
:meth:`View.on_control` and :meth:`View.on_select`. A failure there is shown
in the panel and logged; it never breaks the kernel.

A view belongs to the group of the agent it was made under. Once that agent
has stopped (the cluster stopped, ``shutdown()``), the view says so in its
status line (:data:`GONE`), stops refreshing, disables the controls that need
the group (:attr:`View.group_controls`: its buttons, unless a view says
otherwise) and answers them with a message in the panel. A click on a mark
runs as usual (most read the view's own data); one that needed the group fails
into the panel, saying the group has stopped. Views find out at the end of
every notebook cell (an IPython ``post_run_cell`` hook), when their live
refresh stops, and at the next click.

:meth:`View.snapshot` freezes a view as it stands (its static HTML and text):
displayed in a cell, it keeps that moment's picture while the live view moves on.

A refresh reaches the front end as one state message: every subclass's
:meth:`View.refresh` runs under ``hold_sync`` and a per-view lock, so the
browser never shows a new title over the old drawing, and a live tick and a
click never interleave their trait updates.

Markup that varies between runs of the same program (times, for example) is
wrapped in ``<!--nbrpc:varies-->`` comments, which the notebooks' nbval
sanitize file masks.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from ..agent import current_agent
from ..errors import NotInitializedError
from .svg import esc

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
VARIES_OPEN, VARIES_CLOSE = "<!--nbrpc:varies-->", "<!--/nbrpc:varies-->"
# the static repr's status line: the text colour, lighter (4.5:1 on a light or a
# dark page, with or without JupyterLab's variables)
STATUS_STYLE = "opacity:0.78"
GONE = "group stopped — this view shows its last state"

# The views of this process not closed yet, which the end of each cell checks
# for a stopped group (weak: a view nobody holds goes away as usual).
_OPEN: weakref.WeakSet[View] = weakref.WeakSet()


def varies(markup: str) -> str:
    """Mark ``markup`` as differing between runs (nbval masks it)."""
    return f"{VARIES_OPEN}{markup}{VARIES_CLOSE}"


def button(id: str, label: str, disabled: bool = False, title: str = "") -> dict[str, Any]:
    return {"kind": "button", "id": id, "label": label, "disabled": disabled, "title": title}


def toggle(id: str, label: str, value: bool, title: str = "") -> dict[str, Any]:
    return {"kind": "toggle", "id": id, "label": label, "value": value, "title": title}


class View(anywidget.AnyWidget):
    """A widget drawn in Python. Subclasses implement :meth:`refresh` (set the
    traits from fresh data) and :meth:`text`, and may handle controls and clicks."""

    _esm = STATIC / "view.js"
    _css = STATIC / "view.css"

    title = traitlets.Unicode("").tag(sync=True)
    status = traitlets.Unicode("").tag(sync=True)
    html = traitlets.Unicode("").tag(sync=True)
    panel = traitlets.Unicode("").tag(sync=True)
    controls = traitlets.List().tag(sync=True)
    filters = traitlets.Dict().tag(sync=True)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "refresh" in cls.__dict__:
            cls.refresh = _in_one_message(cls.__dict__["refresh"])  # type: ignore[method-assign]

    #: ids of the controls that need the group (None: the buttons; toggles such as
    #: "live" or "to scale" do no harm without it)
    group_controls: frozenset[str] | None = None

    def __init__(self, **kwargs: Any) -> None:
        self._sync_lock = threading.RLock()  # before traitlets may call anything
        super().__init__(**kwargs)
        self._live: Live | None = None
        self.group = _agent_now()  # the agent whose group this view shows, if any
        self.gone = False
        self.on_msg(self._on_front_end)
        _OPEN.add(self)
        _watch_cells()

    # -- what subclasses provide --------------------------------------------------
    def refresh(self) -> None:
        """Read fresh data and set the traits."""
        raise NotImplementedError

    def text(self) -> str:
        """The deterministic ``text/plain`` view."""
        raise NotImplementedError

    def on_control(self, id: str, value: Any = None) -> None:
        raise ValueError(f"{type(self).__name__} has no control {id!r}")

    def on_select(self, key: str) -> None:
        """A mark was clicked; the default does nothing."""

    # -- the front end's events ----------------------------------------------------
    def _on_front_end(self, _widget: Any, content: dict[str, Any], _buffers: Any) -> None:
        with self._sync_lock, self.hold_sync():
            self._handle(content)

    def _handle(self, content: dict[str, Any]) -> None:
        event = content.get("event")
        if self.check_group() and self._needs_group(content):
            log.info("nbrpc view %s: %s after its group stopped", type(self).__name__, content)
            self.panel = (f'<div class="nbrpc-error"><b>The group has stopped</b>: '
                          f"{esc(repr(content.get('id')))} needs it; this view shows its last "
                          "state.</div>")
            return
        try:
            if event == "control":
                self.on_control(str(content.get("id")), content.get("value"))
            elif event == "select":
                self.on_select(str(content.get("key")))
        except Exception as e:  # shown where the person clicked, and logged
            log.exception("nbrpc view %s: %s failed", type(self).__name__, content)
            gone = " (the group has stopped)" if self.check_group() else ""
            self.panel = (f'<div class="nbrpc-error"><b>{esc(type(e).__name__)}</b>{gone}: '
                          f"{esc(e)}</div>")

    def _needs_group(self, content: dict[str, Any]) -> bool:
        """Whether an event is a control that needs the group (a click on a mark
        runs: most read the view's own data, and one that needed the group fails)."""
        if content.get("event") != "control":
            return False
        control = next((c for c in self.controls if c["id"] == str(content.get("id"))), None)
        return control is not None and self._control_needs_group(control)

    def _control_needs_group(self, control: dict[str, Any]) -> bool:
        ids = self.group_controls
        return control["kind"] == "button" if ids is None else control["id"] in ids

    # -- the group going away --------------------------------------------------------
    @property
    def group_gone(self) -> bool:
        """Whether the group this view was made in has stopped."""
        return self.group is not None and getattr(self.group, "state", None) in (
            "stopping", "stopped")

    def check_group(self) -> bool:
        """Once the group is gone: say so, stop refreshing, disable what needs it.
        Returns whether it is gone."""
        if not self.gone and self.group_gone:
            self.gone = True
            self.stop_live()
            log.debug("nbrpc view %s: its group stopped", type(self).__name__)
            with self._sync_lock, self.hold_sync():
                self.on_group_gone()
                self._show_gone()
        return self.gone

    def on_group_gone(self) -> None:
        """A subclass's last redraw once the group is gone (the default: none)."""

    def _show_gone(self) -> None:
        if not self.status.endswith(GONE):
            self.status = f"{self.status} · {GONE}" if self.status else GONE
        controls = [dict(c, disabled=True) if self._control_needs_group(c) else c
                    for c in self.controls]
        if controls != self.controls:
            self.controls = controls

    # -- live refresh --------------------------------------------------------------
    def live(self, period: float = 0.5, alive: Callable[[], bool] | None = None,
             max_seconds: float = 3600.0) -> None:
        """Refresh every ``period`` seconds (at least 0.5: 2 Hz) in a background
        thread, until :meth:`stop_live`, :meth:`close`, ``alive()`` turning false,
        or ``max_seconds``."""
        self.stop_live()
        self._live = Live(self, max(0.5, period), alive or (lambda: True), max_seconds)
        self._live.start()

    def stop_live(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    @property
    def is_live(self) -> bool:
        return self._live is not None and self._live.running

    def close(self) -> None:
        self.stop_live()
        _OPEN.discard(self)
        super().close()

    def snapshot(self) -> Snapshot:
        """The view as it stands, frozen: display it to keep this moment in the notebook."""
        return Snapshot(self.text(), self.static_html())

    # -- reprs ---------------------------------------------------------------------
    def static_html(self) -> str:
        """The view as it stands, as HTML that needs no JavaScript."""
        panel = f'<div class="nbrpc-panel">{self.panel}</div>' if self.panel else ""
        # the status line is the live one (counts, rates, times): never compared
        status = (f'<div style="{STATUS_STYLE}">{varies(esc(self.status))}</div>'
                  if self.status else "")
        return (f'<div class="nbrpc-static"><div><b>{esc(self.title)}</b></div>'
                f"{self.html}{panel}{status}</div>")

    def _repr_mimebundle_(self, **kwargs: Any) -> tuple[dict, dict] | None:
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None:
            return None
        data, metadata = bundle if isinstance(bundle, tuple) else (bundle, {})
        data = {**data, "text/plain": self.text(), "text/html": self.static_html()}
        return data, metadata

    def __repr__(self) -> str:
        return self.text()


class Snapshot:
    """A view frozen at one moment: its static HTML and its text, no widget.

    >>> s = Snapshot("2 stages run", "<b>2 stages run</b>")
    >>> s, s._repr_html_()
    (2 stages run, '<b>2 stages run</b>')
    """

    def __init__(self, text: str, html: str) -> None:
        self.text, self.html = text, html

    def _repr_html_(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return self.text


def _in_one_message(refresh: Callable[[View], None]) -> Callable[[View], None]:
    """``refresh`` with its trait changes sent together, one refresh at a time; a
    view whose group is gone keeps saying so."""

    @functools.wraps(refresh)
    def wrapped(self: View) -> None:
        with self._sync_lock, self.hold_sync():
            refresh(self)
            if getattr(self, "gone", False):
                self._show_gone()

    return wrapped


def _agent_now() -> Any:
    try:
        return current_agent()
    except NotInitializedError:  # no group: a view of plain data
        return None


def check_open_views() -> None:
    """Let every open view whose group has stopped say so (run after each cell)."""
    for view in list(_OPEN):
        try:
            view.check_group()
        except Exception:  # noqa: BLE001 - one view's trouble is not the cell's
            log.warning("checking the group of %s failed", type(view).__name__,
                        exc_info=True)


def _after_cell(result: Any = None) -> None:
    check_open_views()


def _watch_cells() -> None:
    """Run :func:`check_open_views` after every cell of this kernel (registered once)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    events = getattr(shell, "events", None)
    if events is not None and _after_cell not in events.callbacks.get("post_run_cell", []):
        events.register("post_run_cell", _after_cell)


class Live:
    """The background refresher of a :class:`View`: bounded in rate and time, and
    stops by itself when the view is closed or its subject is gone."""

    def __init__(self, view: View, period: float, alive: Callable[[], bool],
                 max_seconds: float) -> None:
        self.view, self.period, self.alive = view, period, alive
        self.deadline = time.monotonic() + max_seconds
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="nbrpc-live-view", daemon=True)
        self.ticks = 0

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        failures = 0
        while not self._stop.wait(self.period):
            if self.view.comm is None or time.monotonic() > self.deadline:
                break
            try:
                if not self.alive():
                    break
                self.view.refresh()
                self.ticks += 1
                failures = 0
            except Exception:  # noqa: BLE001 - a refresh that fails three times stops
                failures += 1
                log.warning("live refresh of %s failed", type(self.view).__name__,
                            exc_info=True)
                if failures >= 3:
                    break
        if self.view.comm is not None:  # stopped by its group going away: say so
            self.view.check_group()
        log.debug("live refresh of %s stopped after %d ticks", type(self.view).__name__,
                  self.ticks)
