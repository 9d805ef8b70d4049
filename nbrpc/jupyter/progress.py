"""The ipywidgets progress bar that ``%rpc_cluster start`` shows while engines start.

The cluster layer asks for it by kind (``views.make("progress", total,
title=...)``) when it runs in a kernel, and falls back to text or logging
elsewhere (see :mod:`nbrpc.cluster.progress`).
"""

from __future__ import annotations

import ipywidgets as w
from IPython.display import display

from ..cluster.progress import Progress


class WidgetProgress(Progress):
    """An ipywidgets bar with a label, shown at once; closed (removed) when the start ends.

    >>> p = WidgetProgress(2, title="starting")  # outside IPython, display() prints it
    HBox(children=(IntProgress(value=0, max=2), Label(value='starting')))
    >>> p.update(1, "worker1 ready"); p.bar.value, p.label.value
    (1, 'starting: 1/2 worker1 ready')
    >>> p.close()
    """

    def __init__(self, total: int, title: str = "starting nbrpc workers") -> None:
        super().__init__(total, title)
        self.bar = w.IntProgress(value=0, min=0, max=total)
        self.label = w.Label(title)
        self.box = w.HBox([self.bar, self.label])
        display(self.box)

    def show(self, message: str) -> None:
        self.bar.value = self.done
        self.label.value = f"{self.title}: {self.done}/{self.total} {message}"

    def close(self, message: str = "") -> None:
        self.box.close()
