"""The Jupyter layer: magics (``%rpc_cluster``, ``%%rpc_on``), widgets and rich displays.

The only layer that imports IPython, ipywidgets, anywidget or matplotlib.
Importing it registers each view in :data:`VIEWS` with :mod:`nbrpc.views`,
through which core objects find theirs (``trace.widget()``,
``stepper.widget()``, ``cluster.widget()``, ``nbrpc.show(x)``). ``%load_ext
nbrpc`` imports it, and so does the first ``.widget()`` of a process that has
not (:func:`nbrpc.views.load_display_layer`). The magics and the rich
displays are registered with IPython's shell by ``%load_ext nbrpc``
(:func:`.magics.load`).
"""

from __future__ import annotations

from typing import Any

from .. import views
from .cluster_view import ClusterView
from .owner_map_view import OwnerMapView
from .progress import WidgetProgress
from .rref_graph_view import RRefGraphView
from .stepper_view import StepperView
from .trace_view import TraceView

# kind (as the core asks for it) -> the view: Cluster.widget(), debug.RRefGraph.widget(),
# debug.OwnerMap.widget(), debug.Trace.widget(), BackwardStepper.widget(), and the
# progress bar of a cluster starting in a kernel (cluster.progress.make_progress)
VIEWS = {
    "cluster": ClusterView,
    "rref_graph": RRefGraphView,
    "owner_map": OwnerMapView,
    "trace": TraceView,
    "stepper": StepperView,
    "progress": WidgetProgress,
}

for _kind, _view in VIEWS.items():
    views.register(_kind, _view)


def __getattr__(name: str) -> Any:
    """``nbrpc.jupyter.ClusterMagics`` without importing IPython's magics at import."""
    if name == "ClusterMagics":
        from .magics import ClusterMagics

        return ClusterMagics
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["VIEWS", "ClusterMagics", "ClusterView", "OwnerMapView", "RRefGraphView",
           "StepperView", "TraceView", "WidgetProgress"]
