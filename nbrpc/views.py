"""Where core objects find their widgets, without importing any display library.

The core layers (``debug``, ``autograd``, ``cluster``) hold plain data; only
:mod:`nbrpc.jupyter` imports IPython, ipywidgets, anywidget or matplotlib. It
registers one view per kind here when it is imported (``%load_ext nbrpc``
imports it), and a core method such as ``Trace.widget()`` asks for the view
of its kind::

    nbrpc.jupyter (on import)  ── register("trace", TraceView) ──▶  this registry
    Trace.widget()             ── make("trace", trace) ─────────▶  TraceView(trace)

A view asked for before the Jupyter layer is loaded loads it:
:func:`load_display_layer` is the one place where the core imports
:mod:`nbrpc.jupyter`, inside a function, so that ``trace.widget()`` works
without ``%load_ext nbrpc`` while importing any core module still loads no
display library.

>>> from nbrpc import views
>>> views.register("demo", lambda obj, **kw: f"a view of {obj!r}")
>>> views.make("demo", 3)
'a view of 3'
>>> views.make("nothing-like-it", 3)
Traceback (most recent call last):
...
LookupError: no view of kind 'nothing-like-it'; known: ...
>>> views.unregister("demo")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_factories: dict[str, Callable[..., Any]] = {}


def register(kind: str, factory: Callable[..., Any]) -> None:
    """Make ``factory(obj, **options)`` the view of ``kind`` (the Jupyter layer calls this)."""
    _factories[kind] = factory


def unregister(kind: str) -> None:
    _factories.pop(kind, None)


def load_display_layer() -> None:
    """Import :mod:`nbrpc.jupyter`, which registers its views (see its ``VIEWS``)."""
    from . import jupyter  # noqa: F401 - importing it registers every view


def make(kind: str, obj: Any, **options: Any) -> Any:
    """The view of ``obj`` as ``kind`` (``"trace"``, ``"rref_graph"``, ...).

    Loads the Jupyter layer on first use; a missing display library raises an
    ImportError that names the package to install.
    """
    if kind not in _factories:
        try:
            load_display_layer()
        except ImportError as e:
            raise ImportError(
                f"nbrpc's {kind} view needs the notebook packages ({e.name or e}); "
                "install them with: pip install 'nbrpc[lab]' (or anywidget matplotlib "
                "ipywidgets)") from e
    try:
        factory = _factories[kind]
    except KeyError:
        raise LookupError(f"no view of kind {kind!r}; known: "
                          f"{', '.join(sorted(_factories))}") from None
    return factory(obj, **options)


def known() -> list[str]:
    """The kinds registered so far."""
    return sorted(_factories)
