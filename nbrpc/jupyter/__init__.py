"""The Jupyter layer: magics (``%rpc_cluster``, ``%%rpc_on``), widgets and rich displays.

The only layer that imports IPython, ipywidgets, anywidget or matplotlib.
Importing it registers its views with :mod:`nbrpc.views`, through which core
objects find them (``trace.widget()``, ``stepper.widget()``, ``nbrpc.show(x)``);
each view module is loaded only when its first view is made.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from .. import views

# kind -> (module in this package, the view's class or factory)
VIEWS = {
    "cluster": ("cluster_view", "ClusterView"),
    "rref_graph": ("rref_graph_view", "RRefGraphView"),
    "owner_map": ("owner_map_view", "OwnerMapView"),
    "trace": ("trace_view", "TraceView"),
    "stepper": ("stepper_view", "StepperView"),
    "progress": ("progress", "WidgetProgress"),
}


def _lazy(module: str, attr: str) -> Callable[..., Any]:
    def factory(obj: Any, **options: Any) -> Any:
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)(obj, **options)

    factory.__qualname__ = f"{module}.{attr}"
    return factory


for _kind, (_module, _attr) in VIEWS.items():
    views.register(_kind, _lazy(_module, _attr))


def __getattr__(name: str) -> Any:
    """``nbrpc.jupyter.ClusterMagics`` without importing IPython's magics at import."""
    if name == "ClusterMagics":
        from .magics import ClusterMagics

        return ClusterMagics
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["VIEWS", "ClusterMagics"]
