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
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from .svg import esc

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
VARIES_OPEN, VARIES_CLOSE = "<!--nbrpc:varies-->", "<!--/nbrpc:varies-->"


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

    def __init__(self, **kwargs: Any) -> None:
        self._sync_lock = threading.RLock()  # before traitlets may call anything
        super().__init__(**kwargs)
        self._live: Live | None = None
        self.on_msg(self._on_front_end)

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
        try:
            if content.get("event") == "control":
                self.on_control(str(content.get("id")), content.get("value"))
            elif content.get("event") == "select":
                self.on_select(str(content.get("key")))
        except Exception as e:  # shown where the person clicked, and logged
            log.exception("nbrpc view %s: %s failed", type(self).__name__, content)
            self.panel = (f'<div class="nbrpc-error"><b>{esc(type(e).__name__)}</b>: '
                          f"{esc(e)}</div>")

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
        super().close()

    # -- reprs ---------------------------------------------------------------------
    def static_html(self) -> str:
        """The view as it stands, as HTML that needs no JavaScript."""
        panel = f'<div class="nbrpc-panel">{self.panel}</div>' if self.panel else ""
        # the status line is the live one (counts, rates, times): never compared
        status = (f'<div style="color:#666">{varies(esc(self.status))}</div>'
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


def _in_one_message(refresh: Callable[[View], None]) -> Callable[[View], None]:
    """``refresh`` with its trait changes sent together, one refresh at a time."""

    @functools.wraps(refresh)
    def wrapped(self: View) -> None:
        with self._sync_lock, self.hold_sync():
            refresh(self)

    return wrapped


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
        log.debug("live refresh of %s stopped after %d ticks", type(self.view).__name__,
                  self.ticks)
