"""Which part of a value does not pickle, named so that the user can act on it.

Used only once pickling a message has failed: the parts of the value are
pickled again one by one to find the innermost part that fails, named by its
path (``args[0]['key']``, ``kwargs['opts'].lock``, a variable a function
closes over or a global it reads) and its type. A probe treats every type
with a registered reducer (tensors, RRefs) as picklable and calls none of
those reducers, so probing sends nothing, forks no RRef and records no
autograd edge.

>>> import threading
>>> path, part, error = find_unpicklable({"ok": 1, "key": threading.Lock()}, "args[0]")
>>> path, a_type(part), str(error)
("args[0]['key']", 'a _thread.lock', "cannot pickle '_thread.lock' object")
>>> find_unpicklable([1, "two"], "args[1]") is None
True
"""

from __future__ import annotations

import io
import types
from typing import Any

import cloudpickle
from cloudpickle import cloudpickle as _cp

from .pickler import _REDUCERS, PROTOCOL

MAX_DEPTH = 12  # containers looked into, one inside the other
MAX_PARTS = 1000  # parts of one container probed; past them the container is named


def _nothing() -> None:
    return None


class _Probe(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) in _REDUCERS:  # (sent by nbrpc's own reducers: picklable)
            return _nothing, ()
        return super().reducer_override(obj)


def pickle_error(value: Any) -> Exception | None:
    """The error pickling ``value`` raises (as a message would), or None."""
    try:
        _Probe(io.BytesIO(), protocol=PROTOCOL, buffer_callback=_drop).dump(value)
    except Exception as e:  # noqa: BLE001 - what is being looked for
        return e
    return None


def _drop(_buffer: Any) -> None:
    return None


def _parts(value: Any, path: str) -> list[tuple[str, Any]]:
    """The parts of ``value`` that pickling it pickles, with their paths."""
    if isinstance(value, (tuple, list)):
        return [(f"{path}[{i}]", v) for i, v in enumerate(value[:MAX_PARTS])]
    if isinstance(value, dict):
        return [(f"{path}[{k!r}]", v) for k, v in list(value.items())[:MAX_PARTS]]
    if type(value) is types.FunctionType:  # (by value: what it closes over and reads)
        code, cells = value.__code__, value.__closure__ or ()
        out = [(f"the variable {n!r} that {path} reads", c.cell_contents)
               for n, c in zip(code.co_freevars, cells) if _filled(c)]
        g = value.__globals__
        return out + [(f"the global {n!r} that {path} reads", g[n])
                      for n in _cp._extract_code_globals(code) if n in g]
    if isinstance(value, (type, types.ModuleType, types.BuiltinFunctionType)):
        return []
    state = getattr(value, "__dict__", None)
    if isinstance(state, dict):
        return [(f"{path}.{k}", v) for k, v in list(state.items())[:MAX_PARTS]]
    return []


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - (an empty cell raises)
    except ValueError:
        return False
    return True


def find_unpicklable(value: Any, path: str) -> tuple[str, Any, Exception] | None:
    """The innermost part of ``value`` that does not pickle, as ``(path, part,
    error)``; None when ``value`` pickles. ``path`` names ``value`` itself."""
    error = pickle_error(value)
    if error is None:
        return None
    for _ in range(MAX_DEPTH):
        for sub_path, part in _parts(value, path):
            sub_error = pickle_error(part)
            if sub_error is not None:
                path, value, error = sub_path, part, sub_error
                break
        else:
            break
    return path, value, error


def a_type(obj: Any) -> str:
    """``obj``'s type with its article: ``a dict``, ``an io.TextIOWrapper``.

    >>> a_type({}), a_type(io.StringIO())
    ('a dict', 'an _io.StringIO')
    """
    t = type(obj)
    name = t.__qualname__ if t.__module__ in ("builtins", "__main__") else \
        f"{t.__module__}.{t.__qualname__}"
    return f"{'an' if name.lstrip('_')[:1].lower() in ('a', 'e', 'i', 'o', 'u') else 'a'} {name}"
