"""Notebook code by value, once.

cloudpickle sends a function or class defined in a notebook cell (or any
``__main__``) by value: its code, defaults, closure, the globals it reads and,
for a class, every method. Done on every call, that costs more than the call
itself (a class with 60 methods: ~400 µs to pickle, ~140 µs to rebuild). Here
such an object travels as a definition the first time a peer needs it and as
a 16-byte content hash afterwards.

Sender side (per process, no agent): :func:`entry_for` gives an object's
:class:`Entry` — its cloudpickle *blob*, the blob's blake2b *digest*, and the
digest of every by-value class inside it — or None when caching it would not
be safe. An entry is reused while the object's *snapshot* is unchanged: the
identity of every part cloudpickle reads that can change after definition
(each function's code, defaults, closure cells and ``__dict__``; each class's
bases and ``__dict__``; each global name the code reads). A global rebound in a
later cell, a method replaced, a default changed: the snapshot differs, the
object is pickled again, and its new digest takes effect on the next call.

Only code whose reach is immutable is cached: it may read modules, importable
functions and classes, other cacheable code, and immutable values (numbers,
strings, tuples of them, torch dtypes). Code that reads a list, dict, tensor or
any other mutable object, or that assigns a global, is pickled in full every
time as before, since a cached copy would keep stale contents.

Receiver side (per agent): :class:`CodeCache`, a bounded LRU from digest to
the rebuilt object. cloudpickle rebuilds one class object per class and sets
its state from whichever blob mentions it last, so the cache also records, per
class, the digest of the state it last applied; an entry whose classes are at
another state is rebuilt from its blob (or, sent by hash only, missed). A
message names its code in a *table* read before anything else of the message
(:func:`nbrpc.serialize.loads`); a digest the receiver does not hold raises
:class:`~nbrpc.errors.CodeCacheMiss` before any of the message is unpickled,
and the caller resends it with the definitions. Which digests a peer holds is
learnt only from its answer to a message that carried them (``confirm``), so
refs never overtake their definitions, whatever the order of delivery.
"""

from __future__ import annotations

import dis
import hashlib
import logging
import pickle
import threading
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_
from typing import Any

import torch
from cloudpickle import cloudpickle as _cp

from ..errors import CodeCacheMiss, SerializationError

log = logging.getLogger(__name__)

DIGEST_SIZE = 16
ENTRIES_MAX = 1024  # sender: objects whose blob is kept (per process)
CACHE_MAX = 1024  # receiver: definitions kept (per agent), and per peer, digests it holds
REACH_MAX = 5000  # objects one definition may reach before it is not cached

# Immutable values code may read and still be cached (compared by identity).
_LEAVES = frozenset({
    type(None), bool, int, float, complex, str, bytes, type(...), type(NotImplemented),
    range, torch.dtype, torch.device, torch.layout, torch.memory_format,
    types.MethodDescriptorType, types.WrapperDescriptorType,
    types.ClassMethodDescriptorType,
})
_SEQUENCES = frozenset({tuple, frozenset, torch.Size})
_SKIPPED = (types.MemberDescriptorType, types.GetSetDescriptorType)  # __dict__, slots
_WRITES = frozenset({dis.opmap["STORE_GLOBAL"], dis.opmap["DELETE_GLOBAL"]})
_MISSING = object()

_CODE = attrgetter("__code__")
_DEFAULTS = attrgetter("__defaults__")
_KWDEFAULTS = attrgetter("__kwdefaults__")
_DICT = attrgetter("__dict__")
_CELL = attrgetter("cell_contents")
_BASES = attrgetter("__bases__")


def by_value(obj: Any) -> bool:
    """Whether cloudpickle pickles this function or class by value."""
    return not _cp._should_pickle_by_reference(obj)


_writes_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _writes_globals(code: types.CodeType) -> bool:
    """The code (or a function nested in it) assigns or deletes a global."""
    hit = _writes_cache.get(code)
    if hit is None:
        hit = any(i.opcode in _WRITES for i in dis.get_instructions(code)) or any(
            _writes_globals(c) for c in code.co_consts if isinstance(c, types.CodeType))
        _writes_cache[code] = hit
    return hit


@dataclass(slots=True)
class _Reach:
    """Everything mutable a definition reads, found once; snapshots re-read it."""

    funcs: list[types.FunctionType]
    with_attrs: list[types.FunctionType]  # those with attributes (functools.wraps, ...)
    kw_only: list[types.FunctionType]  # those with keyword-only parameters
    kwdefaults: list[dict]
    cells: list[types.CellType]
    classes: list[type]
    globals: list[tuple[dict, tuple[str, ...]]]

    def snapshot(self) -> tuple[list, list]:
        """The parts that may change: a list compared with ``==`` (code, sizes,
        names: equal means the same) and a list compared by identity (values,
        where ``1 == 1.0 == True`` must still count as a change). A function's
        ``__closure__`` is read-only; its cells' contents are in the second."""
        funcs = self.funcs
        same = list(map(_CODE, funcs))
        same += map(len, map(_DICT, funcs))  # an attribute added later changes it
        ident = list(map(_DEFAULTS, funcs))
        ident += map(_KWDEFAULTS, self.kw_only)  # (without such parameters it has no effect)
        for f in self.with_attrs:
            same += f.__dict__
            ident += f.__dict__.values()
        for kw in self.kwdefaults:
            ident += kw.values()
        ident += map(_CELL, self.cells)  # ValueError if a cell was emptied
        ident += map(_BASES, self.classes)
        for c in self.classes:
            same += c.__dict__
            ident += c.__dict__.values()
        for g, names in self.globals:
            ident += map(g.get, names, repeat(_MISSING, len(names)))
        return same, ident


def _reach(root: Any) -> _Reach | None:
    """Walk what pickling ``root`` by value would include; None if any of it
    is mutable (or assigns globals), so that a cached copy could go stale."""
    r = _Reach([], [], [], [], [], [], [])
    scopes: dict[int, tuple[dict, dict[str, None]]] = {}
    seen: set[int] = set()
    todo = [root]
    while todo:
        obj = todo.pop()
        t = type(obj)
        if t in _LEAVES or id(obj) in seen:
            continue
        seen.add(id(obj))
        if len(seen) > REACH_MAX:
            return None
        if t in _SEQUENCES:
            todo.extend(obj)
        elif t is types.FunctionType:
            if not by_value(obj):
                continue
            if _writes_globals(obj.__code__):
                return None
            r.funcs.append(obj)
            if obj.__code__.co_kwonlyargcount:
                r.kw_only.append(obj)
            todo.extend(obj.__defaults__ or ())
            if obj.__kwdefaults__:
                r.kwdefaults.append(obj.__kwdefaults__)
                todo.extend(obj.__kwdefaults__.values())
            if obj.__dict__:
                r.with_attrs.append(obj)
                todo.extend(obj.__dict__.values())
            for cell in obj.__closure__ or ():
                try:
                    todo.append(cell.cell_contents)
                except ValueError:  # an empty cell
                    return None
                r.cells.append(cell)
            g = obj.__globals__
            names = _cp._extract_code_globals(obj.__code__)
            scopes.setdefault(id(g), (g, {}))[1].update(names)
            todo.extend(g[n] for n in names if n in g)
        elif isinstance(obj, type):
            if not by_value(obj):
                continue
            if t is not type and by_value(t):  # a metaclass of its own
                return None
            r.classes.append(obj)
            todo.extend(obj.__bases__)
            for k, v in obj.__dict__.items():
                tv = type(v)
                if tv is staticmethod or tv is classmethod:
                    todo.append(v.__func__)
                elif tv is property:
                    todo.extend((v.fget, v.fset, v.fdel, v.__doc__))
                elif isinstance(v, _SKIPPED):
                    continue
                elif k == "__annotations__" and tv is dict:
                    todo.extend(v.values())
                else:
                    todo.append(v)
        elif t is types.ModuleType:
            if by_value(obj):
                return None
        elif t is types.BuiltinFunctionType:
            if not (obj.__self__ is None or type(obj.__self__) is types.ModuleType):
                return None  # a bound method of some object (list.append, ...)
        else:
            return None
    r.globals = [(g, tuple(names)) for g, names in scopes.values()]
    return r


@dataclass(slots=True)
class Entry:
    """A cacheable definition: what the sender keeps for one object."""

    obj: Any
    reach: _Reach
    snap: tuple[list, list]
    digest: bytes
    blob: bytes
    classes: tuple[tuple[str, bytes], ...] | None  # (tracker id, digest) of its classes

    def current(self, obj: Any) -> bool:
        if self.obj is not obj:
            return False
        try:
            same, ident = self.reach.snapshot()
        except ValueError:
            return False
        was_same, was_ident = self.snap
        return (same == was_same and len(ident) == len(was_ident)
                and all(map(is_, ident, was_ident)))


_entries: dict[int, Entry] = {}
_entries_lock = threading.Lock()
# digest -> the object it was made from, while it lives: a receiver in the
# same process (an agent calling itself, the in-process tier) uses it as it is
# rather than rebuilding it, since cloudpickle would set the state of the
# sender's own class objects from the blob
_made: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


# How a definition's blob is pickled: :mod:`.pickler`'s ``dumps``, which that
# module hands over when it is imported (it imports this one, so this one does
# not import it back). The package's ``__init__`` imports both.
_dumps: Callable[[Any], tuple[bytes, list]] | None = None


def use_pickler(dumps: Callable[[Any], tuple[bytes, list]]) -> None:
    """Make ``dumps`` the pickler of cached definitions (:mod:`.pickler` calls this)."""
    global _dumps
    _dumps = dumps


def _blob(obj: Any) -> bytes:
    if _dumps is None:
        raise RuntimeError("nbrpc.serialize.pickler was not imported: import nbrpc.serialize")
    payload, buffers = _dumps(obj)
    if buffers:  # not reachable through a cacheable definition (tensors are not leaves)
        raise SerializationError("a cached definition carried out-of-band buffers")
    return payload


def _defined(obj: Any) -> Entry | None:
    """The entry of ``obj`` with its blob and digest, without ``classes``."""
    e = _entries.get(id(obj))
    if e is not None and e.current(obj):
        return e
    if not by_value(obj):
        return None
    reach = _reach(obj)
    if reach is None:
        return None
    try:
        snap = reach.snapshot()
    except ValueError:
        return None
    blob = _blob(obj)
    e = Entry(obj, reach, snap, hashlib.blake2b(blob, digest_size=DIGEST_SIZE).digest(),
              blob, None)
    log.debug("definition of %s: %d bytes, digest %s", getattr(obj, "__qualname__", obj),
              len(blob), e.digest.hex()[:12])
    with _entries_lock:
        if len(_entries) >= ENTRIES_MAX:
            del _entries[next(iter(_entries))]
        _entries[id(obj)] = e
        _made[e.digest] = obj
    return e


def entry_for(obj: Any) -> Entry | None:
    """The cached definition of a by-value function or class, or None when it
    is pickled by reference or is not safe to cache.

    >>> ns = {"__name__": "__main__"}
    >>> exec("def double(x):\\n    return 2 * x", ns)
    >>> e = entry_for(ns["double"])
    >>> len(e.digest), entry_for(ns["double"]) is e
    (16, True)
    >>> exec("K = 3\\ndef scale(x):\\n    return K * x", ns)
    >>> d1 = entry_for(ns["scale"]).digest
    >>> ns["K"] = 4  # a later cell rebinds the global
    >>> entry_for(ns["scale"]).digest != d1
    True
    >>> exec("L = []\\ndef grow(x):\\n    return L + [x]", ns)
    >>> entry_for(ns["grow"]) is None  # reads a mutable global: sent in full each time
    True
    """
    if not (type(obj) is types.FunctionType or isinstance(obj, type)):
        return None
    e = _defined(obj)
    if e is None or e.classes is not None:
        return e
    classes = []
    for c in e.reach.classes:
        ce = e if c is obj else _defined(c)
        if ce is None:  # (cannot happen: its reach is inside obj's)
            return None
        classes.append((_cp._get_or_create_tracker_id(c), ce.digest))
    e.classes = tuple(classes)
    return e


# -- receiver ------------------------------------------------------------------
class CodeCache:
    """One agent's definitions by digest (receiver) and, per peer, the digests
    that peer has confirmed holding (sender). Thread-safe, bounded.

    >>> ns = {"__name__": "__main__"}
    >>> exec("def inc(x):\\n    return x + 1", ns)
    >>> e = entry_for(ns["inc"])
    >>> cache = CodeCache(local=False)  # (rebuild, as another process would)
    >>> cache.resolve([(e.digest, e.blob, e.classes)])[0](1)
    2
    >>> cache.resolve([(e.digest, None, e.classes)])[0](2)  # by hash only
    3
    >>> CodeCache(local=False).resolve([(e.digest, None, e.classes)])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    nbrpc.errors.CodeCacheMiss: this worker no longer holds the definition ...
    """

    def __init__(self, max_entries: int = CACHE_MAX, local: bool = True) -> None:
        self.max_entries = max_entries
        self.local = local  # use definitions made in this process as they are
        self._objs: OrderedDict[bytes, Any] = OrderedDict()
        self._applied: OrderedDict[str, bytes] = OrderedDict()  # class tracker -> digest
        self._held: dict[int, OrderedDict[bytes, None]] = {}  # peer -> digests it holds
        self._lock = threading.Lock()
        self.loaded = self.hits = self.misses = 0  # definitions rebuilt / reused / missed
        self.sent_full = self.sent_ref = self.resent = 0

    # -- sender: what each peer holds
    def holds(self, peer: int, digest: bytes) -> bool:
        held = self._held.get(peer)
        return held is not None and digest in held

    def confirm(self, peer: int, digests: Iterable[bytes]) -> None:
        """``peer`` answered a message that carried these definitions."""
        with self._lock:
            held = self._held.setdefault(peer, OrderedDict())
            for d in digests:
                held[d] = None
                held.move_to_end(d)
            while len(held) > self.max_entries:
                held.popitem(last=False)

    def forget(self, peer: int) -> None:
        """``peer`` left, restarted or missed: send it definitions in full again."""
        with self._lock:
            self._held.pop(peer, None)

    # -- receiver
    def resolve(self, rows: list[tuple[bytes, bytes | None, tuple]]) -> list[Any]:
        """The objects of a message's code table, in order. Raises
        :class:`CodeCacheMiss` (naming every digest missing) before anything
        is rebuilt when one is sent by hash and not held."""
        with self._lock:
            held = [self._held_object(digest, classes) for digest, _, classes in rows]
            missing = [row[0] for row, obj in zip(rows, held) if obj is None and row[1] is None]
            if missing:
                self.misses += 1
                raise CodeCacheMiss(missing)
            for i, (digest, blob, classes) in enumerate(rows):
                if held[i] is None:
                    held[i] = self._load(digest, blob, classes)
                else:
                    self.hits += 1
            return held

    def _held_object(self, digest: bytes, classes: tuple) -> Any:
        """The object for ``digest`` if held here with its classes at the state
        the sender has (see the module docstring), else None."""
        obj = self._objs.get(digest)
        if obj is not None:
            applied = self._applied
            for tracker, d in classes:
                if applied.get(tracker) != d:
                    return None
            self._objs.move_to_end(digest)
            return obj
        return _made.get(digest) if self.local else None

    def _load(self, digest: bytes, blob: bytes, classes: tuple) -> Any:
        if hashlib.blake2b(blob, digest_size=DIGEST_SIZE).digest() != digest:
            raise SerializationError("a definition does not match its digest")
        obj = pickle.loads(blob)
        self.loaded += 1
        log.debug("rebuilt %s from a definition of %d bytes (digest %s)",
                  getattr(obj, "__qualname__", obj), len(blob), digest.hex()[:12])
        self._objs[digest] = obj
        self._objs.move_to_end(digest)
        for tracker, d in classes:
            self._applied[tracker] = d
            self._applied.move_to_end(tracker)
        while len(self._objs) > self.max_entries:
            self._objs.popitem(last=False)
        while len(self._applied) > 4 * self.max_entries:
            self._applied.popitem(last=False)
        return obj

    def clear(self) -> None:
        """Drop every definition held (as a restarted worker would have none)."""
        with self._lock:
            self._objs.clear()
            self._applied.clear()

    def stats(self) -> dict[str, int]:
        """Counters: definitions held, rebuilt, reused, missed; sent in full,
        by hash, and requests resent after a miss."""
        return {"held": len(self._objs), "loaded": self.loaded, "hits": self.hits,
                "misses": self.misses, "sent_full": self.sent_full,
                "sent_ref": self.sent_ref, "resent": self.resent}
