"""The Python references to an object in this process, in words: what
:func:`nbrpc.debug.why_alive` reports for each worker.

``gc.get_referrers`` gives the objects that hold an RRef. A bare container
says little ("a list"), so containers and plain dicts are named by one more
pass over the heap, for all of them at once::

    the list `kept` (3 items), a global in __main__
    the list in attribute 'cache' of a Cache (3 items)
    the list `recent` (3 items), a local in train_step (<file>:12)
    IPython output history (Out[4]: a list of 2 items)
    attribute 'r' of a Model            (an object's __dict__ holds it)

An object's attribute may live in its ``__dict__``, which then is the holder;
one pass more finds the object that owns such a dict. Each pass walks the
whole heap, so only the first :data:`NAMED` containers get a name and there
are at most three passes per object.

The debugging machinery's own frames are left out: the frames running this
package's code (``why_alive`` and what it calls) and the nbrpc frames that
called it (``nbrpc.show``, a widget's click handler). They hold the RRef only
to look at it, and deleting them is not the user's business.
"""

from __future__ import annotations

import collections
import gc
import inspect
import sys
import types
from typing import Any

from ..ipython import is_output_name, user_namespace
from ..rref import RRef
from .words import a, plural

STACK_DEPTH = 64  # frames looked at per thread, innermost first
NAMED = 16  # containers named per object; the others are only described
CONTAINERS = (list, tuple, set, frozenset, collections.deque)
MACHINERY = "nbrpc.debug"  # the package whose frames are never reported

Place = tuple[str, Any, str]  # (how: global/local/attribute/output/__dict__, name, where)


class Scope:
    """What naming references needs here: the user namespace, IPython's ``Out``
    dict, every thread's frames (the machinery's left out) and the ids of the
    machinery's frames.

    It holds no frame of the machinery: such a frame holds the scope, and the
    cycle would keep every frame it saw, and their variables, until a full
    garbage collection."""

    def __init__(self) -> None:
        self.user_ns: dict = user_namespace()
        out = self.user_ns.get("Out")
        self.out_hist: dict | None = out if isinstance(out, dict) else None
        self.frames, self.skip = _frames()

    def namespace(self, d: dict) -> bool:
        """Whether ``d`` names its values itself: a module's globals, the user
        namespace, IPython's hidden namespace or its ``Out`` dict."""
        if d is self.out_hist or d is self.user_ns or "_oh" in d:
            return True
        return isinstance(d.get("__name__"), str) and d.get("__builtins__") is not None

    def machinery(self, frame: types.FrameType) -> bool:
        return id(frame) in self.skip or _package(frame) == MACHINERY


def references(obj: Any, scope: Scope, ignore: tuple = ()) -> list[str]:
    """The references to ``obj`` (other than the objects in ``ignore``), in words."""
    # running functions' variables (the gc does not see a running function's frame
    # as a referrer); first, since reading them takes RRefs out of old snapshots.
    # (Loops, not comprehensions, wherever obj is used: a comprehension would hold
    # obj in a closure cell, a referrer of its own.)
    found: list[str] = []
    for frame in scope.frames:
        found += [f"local {k!r} in {_where(frame)}" for k in _names_of(obj, _variables(frame))]
    held: list[Any] = []  # containers and plain dicts: named together below
    for ref in gc.get_referrers(obj):
        if ref is held or any(ref is i for i in ignore):
            continue
        if isinstance(ref, CONTAINERS) or (isinstance(ref, dict) and not scope.namespace(ref)):
            held.append(ref)
        else:
            found += _direct(ref, obj, scope)
    places = _places(held[:NAMED], scope)
    for c in held:
        found += _held(c, obj, places.get(id(c), []))
    return one_output_line(sorted(set(found)))


_OUT_PREFIX = "IPython output history ("


def one_output_line(found: list[str]) -> list[str]:
    """IPython's names for one displayed output (``Out[5]``, ``_5``, ``_``,
    the display hook's ``_``) said once, not as four references.

    >>> one_output_line(["IPython output history (_)", "IPython output history (_5)",
    ...                  "Out[5]", "IPython output history (the display hook)", "global 'r'"])
    ["global 'r'", "Out[5], also as _5, _ and the display hook (IPython's output history)"]
    >>> one_output_line(["IPython output history (_)", "IPython output history (the display hook)"])
    ['IPython output history (_ and the display hook)']
    """
    outs = [t for t in found if t.startswith("Out[") and t.endswith("]") and ":" not in t]
    names = [t[len(_OUT_PREFIX):-1] for t in found
             if t.startswith(_OUT_PREFIX) and ":" not in t]  # (not a container's line)
    if len(outs) + len(names) < 2:
        return found
    rest = [t for t in found if t not in outs and not (t.startswith(_OUT_PREFIX) and ":" not in t)]
    names.sort(key=lambda n: (n == "the display hook", not n[1:].isdigit(), len(n), n))
    listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    if not outs:
        return [*rest, f"{_OUT_PREFIX}{listed})"]
    line = ", ".join(outs) + (f", also as {listed}" if names else "")
    return [*rest, f"{line} (IPython's output history)"]


def _direct(ref: Any, obj: Any, scope: Scope) -> list[str]:
    """A holder of ``obj`` that is not a container: a frame, a namespace, an object."""
    if isinstance(ref, types.FrameType):
        if scope.machinery(ref):
            return []
        names = _names_of(obj, _variables(ref))
        return [f"local {k!r} in {_where(ref)}" for k in names] or [f"a frame of {_where(ref)}"]
    if isinstance(ref, dict):  # a namespace (Scope.namespace)
        keys = _names_of(obj, ref.items())
        if ref is scope.out_hist:
            return [f"Out[{k}]" for k in keys]
        if ref is scope.user_ns or "_oh" in ref:  # the user namespace, or IPython's hidden one
            return [f"IPython output history ({k})" if is_output_name(k)
                    else f"global {k!r} in __main__" for k in keys]
        return [f"global {k!r} in module {ref['__name__']}" for k in keys]
    if type(ref).__name__ == "Child":
        return [f"pending fork {ref.fork_id} to rank {ref.to} (until accepted)"]
    if isinstance(ref, types.CellType):
        return ["a closure"]
    if type(ref).__name__.endswith("DisplayHook"):  # IPython's, or ipykernel's
        return [f"{_OUT_PREFIX}the display hook)"]
    if type(ref).__module__.startswith("IPython."):
        return [f"IPython output history ({type(ref).__name__})"]
    names = _names_of(obj, _attributes(ref))
    return ([f"attribute {k!r} of {a(_type_name(ref))}" for k in names]
            or [f"{a(type(ref).__module__ + '.' + type(ref).__qualname__)} object"])


def _held(c: Any, obj: Any, places: list[Place]) -> list[str]:
    """A container or plain dict that holds ``obj``, with the names it goes by."""
    kind = type(c).__name__
    if isinstance(c, dict):
        keys = _names_of(obj, c.items())
        owners = [where for how, _, where in places if how == "__dict__"]
        if owners:  # an object's __dict__: the object's attributes
            return [f"attribute {k!r} of {o}" for k in keys for o in owners]
        size = ", ".join(f"key {k!r}" for k in keys) or "as a key"
        plain = f"a dict ({size})"
    else:
        size = plural(len(c), "item")
        plain = f"{a(kind)} of {size}"
    lines = []
    for how, name, where in places:
        if how in ("global", "local"):
            lines.append(f"the {kind} `{name}` ({size}), a {how} in {where}")
        elif how == "attribute":
            lines.append(f"the {kind} in attribute {name!r} of {where} ({size})")
        elif how == "output":
            lines.append(f"IPython output history ({name}: {plain})")
    return lines or [plain]


def _places(targets: list[Any], scope: Scope) -> dict[int, list[Place]]:
    """By id, the names each target (a container) goes by: one pass over the
    heap, and one more for the objects whose ``__dict__`` holds a target."""
    if not targets:
        return {}
    places: dict[int, list[Place]] = {id(t): [] for t in targets}
    dicts: list[tuple[dict, Any, int]] = []  # (a plain dict, key, target id): a __dict__?
    for frame in scope.frames:  # the running functions' (the gc does not see them)
        for k, v in _variables(frame):
            if id(v) in places:
                places[id(v)].append(("local", k, _where(frame)))
    for ref in gc.get_referrers(*targets):
        if ref is targets:
            continue
        if isinstance(ref, types.FrameType):  # a generator's, or one that has returned
            if not scope.machinery(ref):
                for k, v in _variables(ref):
                    if id(v) in places:
                        places[id(v)].append(("local", k, _where(ref)))
        elif isinstance(ref, dict):
            for k, v in list(ref.items()):
                if id(v) not in places:  # (the targets are alive: ids are theirs)
                    continue
                if ref is scope.out_hist:
                    places[id(v)].append(("output", f"Out[{k}]", ""))
                elif ref is scope.user_ns or "_oh" in ref:
                    places[id(v)].append(("output", k, "") if is_output_name(k)
                                         else ("global", k, "__main__"))
                elif scope.namespace(ref):
                    places[id(v)].append(("global", k, f"module {ref['__name__']}"))
                elif len(dicts) < NAMED:
                    dicts.append((ref, k, id(v)))
        elif not isinstance(ref, (*CONTAINERS, types.CellType)):
            for k, v in _attributes(ref):
                if id(v) in places:
                    places[id(v)].append(("attribute", k, a(_type_name(ref))))
            d = _instance_dict(ref)
            if d is not None and id(d) in places:
                places[id(d)].append(("__dict__", "", a(_type_name(ref))))
    if dicts:
        owners: dict[int, list[str]] = {id(d): [] for d, _, _ in dicts}
        for ref in gc.get_referrers(*(d for d, _, _ in dicts)):
            d = _instance_dict(ref)
            if d is not None and id(d) in owners:
                owners[id(d)].append(a(_type_name(ref)))
        for d, k, target in dicts:
            places[target] += [("attribute", k, owner) for owner in owners[id(d)]]
    return places


def _names_of(obj: Any, pairs: Any) -> list[Any]:
    """The names whose value is ``obj``, from (name, value) pairs."""
    names = []
    for k, v in list(pairs):
        if v is obj:
            names.append(k)
    return names


def _variables(frame: types.FrameType) -> list[tuple[str, Any]]:
    """A function's variables as (name, value) pairs; none for the body of a
    module or a class (its namespace is a dict, reported as such).

    Before Python 3.13, reading them (``f_locals``) leaves a dict on the frame
    that holds the values until the next read or the frame's end: a reference
    nobody wrote. The RRefs, and the containers that hold some, are taken out
    of it at once, so that asking why an RRef is alive does not keep one alive.
    From 3.13 (PEP 667) ``f_locals`` is a view of the frame's variables, which
    leaves nothing behind (and refuses deletions)."""
    if not frame.f_code.co_flags & inspect.CO_OPTIMIZED:
        return []
    snapshot = frame.f_locals
    pairs = list(snapshot.items())
    if type(snapshot) is dict:
        for k, v in pairs:
            if _has_rref(v):
                del snapshot[k]
    return pairs


def _has_rref(v: Any) -> bool:
    """An RRef, or a container or dict with an RRef among its first 1000 items."""
    if isinstance(v, RRef):
        return True
    items = v.values() if isinstance(v, dict) else v if isinstance(v, CONTAINERS) else ()
    try:
        for i, x in enumerate(items):
            if i == 1000:
                break
            if isinstance(x, RRef):
                return True
    except RuntimeError:  # another thread changed it meanwhile: count it as holding one
        return True
    return False


def _attributes(o: Any) -> list[tuple[str, Any]]:
    """An object's attributes, read without running its code (no properties, no
    ``__getattr__``): its ``__dict__`` and its slots."""
    d = _instance_dict(o)
    pairs = list(d.items()) if d is not None else []
    for cls in type(o).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            member = cls.__dict__.get(name)
            if isinstance(member, types.MemberDescriptorType):
                try:
                    pairs.append((name, member.__get__(o, type(o))))
                except AttributeError:  # a slot never set
                    pass
    return pairs


def _instance_dict(o: Any) -> dict | None:
    try:
        d = object.__getattribute__(o, "__dict__")
    except Exception:  # no __dict__ (slots, builtins)
        return None
    return d if type(d) is dict else None


def _type_name(o: Any) -> str:
    t = type(o)
    return t.__qualname__ if t.__module__ in ("builtins", "__main__") else \
        f"{t.__module__}.{t.__qualname__}"


def _where(frame: types.FrameType) -> str:
    return f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})"


def _package(frame: types.FrameType) -> str:
    """``nbrpc``, ``nbrpc.debug`` or another top package: the first two parts of
    the frame's module name when it is nbrpc's, else the first."""
    parts = str(frame.f_globals.get("__name__", "")).split(".")
    return ".".join(parts[:2]) if parts[0] == "nbrpc" else parts[0]


def _frames() -> tuple[list[types.FrameType], set[int]]:
    """Every thread's frames (innermost first, :data:`STACK_DEPTH` at most) less
    the machinery's, and the ids of the machinery's: in a thread that runs this
    package's code, that code, what it calls, and the nbrpc frames that called
    it. (This function's own frame is among them: no variable may hold it when
    it returns, or it would keep itself, and all it saw, alive in a cycle.)"""
    frames: list[types.FrameType] = []
    skip: set[int] = set()
    stack: list[types.FrameType] = []
    for thread in list(sys._current_frames()):
        stack.clear()
        f: types.FrameType | None = sys._current_frames().get(thread)
        while f is not None and len(stack) < STACK_DEPTH:
            stack.append(f)
            f = f.f_back
        own = [i for i, frame in enumerate(stack) if _package(frame) == MACHINERY]
        cut = own[-1] + 1 if own else 0
        while own and cut < len(stack) and _package(stack[cut]).partition(".")[0] == "nbrpc":
            cut += 1
        skip.update(id(frame) for frame in stack[:cut])
        frames += stack[cut:]
    stack.clear()
    return frames, skip
