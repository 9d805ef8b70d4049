"""Progress while engines start: a widget bar in a kernel, text in a terminal,
log records in a plain script."""

from __future__ import annotations

import logging
import sys
from typing import Any

log = logging.getLogger("nbrpc.cluster")


class Progress:
    """Counts workers that are ready out of ``total``; the base class logs.

    >>> p = Progress(2, "starting"); p.update(1, "worker1 ready"); p.done
    1
    >>> p.close()
    """

    def __init__(self, total: int, title: str) -> None:
        self.total, self.title, self.done = total, title, 0

    def update(self, step: int, message: str) -> None:
        self.done = min(self.total, self.done + step)
        self.show(message)

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


class WidgetProgress(Progress):
    """An ipywidgets bar with a label; closed (removed) when the start ends."""

    def __init__(self, total: int, title: str) -> None:
        super().__init__(total, title)
        import ipywidgets as w
        from IPython.display import display

        self.bar = w.IntProgress(value=0, min=0, max=total)
        self.label = w.Label(title)
        self.box = w.HBox([self.bar, self.label])
        display(self.box)

    def show(self, message: str) -> None:
        self.bar.value = self.done
        self.label.value = f"{self.title}: {self.done}/{self.total} {message}"

    def close(self, message: str = "") -> None:
        self.box.close()


def make_progress(total: int, enabled: bool | None, title: str) -> Progress:
    """The display that suits where we run; ``enabled=False`` only logs."""
    if enabled is False:
        return Progress(total, title)
    shell = _shell()
    if shell is not None and type(shell).__name__ == "ZMQInteractiveShell":
        try:
            return WidgetProgress(total, title)
        except ImportError:
            pass
    if shell is not None or enabled:
        return TextProgress(total, title)
    return Progress(total, title)


def _shell() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()
