"""Progress while engines start: a widget bar in a kernel, text in a terminal,
log records in a plain script.

The widget bar lives in the Jupyter layer (``nbrpc.jupyter.progress``), reached
through :mod:`nbrpc.views`; this module never imports IPython or ipywidgets. It
finds IPython's shell only if the process has imported IPython already.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from .. import views

log = logging.getLogger("nbrpc.cluster")


class Progress:
    """Counts workers that are ready out of ``total``; the base class logs.

    ``update(0, ...)`` reports a step of the preparation before any worker can
    join (the controller started, the engine zygote warm); ``update(1, ...)`` a
    worker that joined. :attr:`fraction` is how far the whole start has come:
    the first of ``total + 1`` equal shares is the preparation, whose steps
    each cover half of what is left of it (how many there are depends on the
    launcher), then one share per worker.

    >>> p = Progress(2, "starting"); p.fraction
    0.0
    >>> p.update(0, "controller started"); round(p.fraction, 3)
    0.167
    >>> p.update(1, "worker1 ready"); p.done, round(p.fraction, 3)
    (1, 0.667)
    >>> p.update(1, "worker2 ready"); p.fraction
    1.0
    >>> p.close()
    """

    def __init__(self, total: int, title: str) -> None:
        self.total, self.title, self.done = total, title, 0
        self.prepared = 0  # preparation steps reported

    def update(self, step: int, message: str) -> None:
        self.done = min(self.total, self.done + step)
        self.prepared += not step
        self.show(message)

    def note(self, message: str) -> None:
        """Say something while waiting (a batch job still queued) without a step."""
        self.show(message)

    @property
    def fraction(self) -> float:
        """How far the start has come, from 0 to 1."""
        prep = 1.0 if self.done else 1.0 - 0.5 ** self.prepared
        return (prep + self.done) / (self.total + 1)

    def show(self, message: str) -> None:
        log.info("%s: %d/%d %s", self.title, self.done, self.total, message)

    def close(self, message: str = "") -> None:
        if message:
            log.info("%s: %s", self.title, message)


class TextProgress(Progress):
    """One status line, rewritten in place (IPython in a terminal)."""

    def show(self, message: str) -> None:
        sys.stdout.write(f"\r{self.title}: {self.done}/{self.total} {message:<40}")
        sys.stdout.flush()

    def close(self, message: str = "") -> None:
        sys.stdout.write(f"\r{self.title}: {message or 'done':<50}\n")
        sys.stdout.flush()


def make_progress(total: int, enabled: bool | None, title: str, cluster: Any = None) -> Progress:
    """The display that suits where we run; ``enabled=False`` only logs. In a
    kernel, ``cluster`` (a cluster whose workers wait in a batch queue) is shown
    live under the bar while it starts."""
    if enabled is False:
        return Progress(total, title)
    shell = _shell()
    if shell is not None and type(shell).__name__ == "ZMQInteractiveShell":
        try:
            return views.make("progress", total, title=title, cluster=cluster)
        except (ImportError, LookupError) as e:  # no widget libraries: text will do
            log.debug("no progress widget: %s", e)
    if shell is not None or enabled:
        return TextProgress(total, title)
    return Progress(total, title)


def _shell() -> Any:
    """IPython's running shell, or None (looked up, never imported: a script
    that has not imported IPython has no shell).

    >>> import sys; sys.modules.get("IPython") is None or _shell() is None
    True
    """
    ipython = sys.modules.get("IPython")
    get_ipython = getattr(ipython, "get_ipython", None)
    if get_ipython is None:
        return None
    try:
        return get_ipython()
    except Exception:  # noqa: BLE001 - a half-imported IPython: no shell
        return None
