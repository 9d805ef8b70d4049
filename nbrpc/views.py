"""Where core objects find their views, without importing any display library.

The core layers (``debug``, ``autograd``, ``cluster``) hold plain data; only
:mod:`nbrpc.jupyter` imports IPython, ipywidgets, anywidget or matplotlib. A
core method such as ``Trace.widget()`` asks this registry for the view of a
kind; the Jupyter layer registers its factories when it is imported, which
the first such request does (``nbrpc.jupyter`` is then loaded by name, so the
arrows between layers still point downward in the source).

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

import importlib
from collections.abc import Callable
from typing import Any

_factories: dict[str, Callable[..., Any]] = {}
DISPLAY_LAYER = "nbrpc.jupyter"


def register(kind: str, factory: Callable[..., Any]) -> None:
    """Make ``factory(obj, **options)`` the view of ``kind`` (the Jupyter layer calls this)."""
    _factories[kind] = factory


def unregister(kind: str) -> None:
    _factories.pop(kind, None)


def make(kind: str, obj: Any, **options: Any) -> Any:
    """The view of ``obj`` as ``kind`` (``"trace"``, ``"rref_graph"``, ...).

    Loads the Jupyter layer on first use; a missing display library raises an
    ImportError that names the package to install.
    """
    if kind not in _factories:
        try:
            importlib.import_module(DISPLAY_LAYER)
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
