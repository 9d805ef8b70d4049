"""The ipywidgets progress bar that ``%rpc_cluster start`` shows while engines start.

The cluster layer asks for it by kind (``views.make("progress", total,
title=...)``) when it runs in a kernel, and falls back to text or logging
elsewhere (see :mod:`nbrpc.cluster.progress`).
"""

from __future__ import annotations

from typing import Any

import ipywidgets as w
from IPython.display import display

from ..cluster.progress import Progress

STEPS = 16  # parts of each share of the bar (the preparation's, and each worker's)


class WidgetProgress(Progress):
    """An ipywidgets bar with a label, shown at once; closed (removed) when the start ends.
    The bar moves with every step the cluster reports (:attr:`Progress.fraction`:
    the controller, the engine zygote, each worker joining), the label says which.

    It is displayed as a bar of ``total`` workers, so that a saved notebook's
    text of it (which the tutorials compare) names the workers started; from the
    first step on it counts in :data:`STEPS` parts of a worker's share.

    >>> p = WidgetProgress(2, title="starting")  # outside IPython, display() prints it
    HBox(children=(IntProgress(value=0, max=2), Label(value='starting')))
    >>> p.update(0, "controller started"); p.bar.value, p.bar.max, p.label.value
    (8, 48, 'starting: 0/2 controller started')
    >>> p.update(1, "worker1 ready"); p.bar.value, p.bar.max, p.label.value
    (32, 48, 'starting: 1/2 worker1 ready')
    >>> p.close()
    """

    def __init__(self, total: int, title: str = "starting nbrpc workers",
                 cluster: Any = None) -> None:
        super().__init__(total, title)
        self.bar = w.IntProgress(value=0, min=0, max=total)
        self.label = w.Label(title)
        self.box = w.HBox([self.bar, self.label])
        display(self.box)
        # a cluster whose jobs wait in a batch queue: its live view, each worker's
        # job and state, while it starts (closed with the bar: the cell's result
        # is the cluster's own view)
        self.view = None
        if cluster is not None:
            from .cluster_view import ClusterView

            self.view = ClusterView(cluster)
            display(self.view)

    def show(self, message: str) -> None:
        with self.bar.hold_sync():
            self.bar.max = STEPS * (self.total + 1)
            self.bar.value = round(self.fraction * self.bar.max)
        self.label.value = f"{self.title}: {self.done}/{self.total} {message}"

    def close(self, message: str = "") -> None:
        self.box.close()
        if self.view is not None:
            self.view.close()
