"""Notebook source travels with code sent by value, so remote tracebacks show it.

cloudpickle rebuilds each code object it sends by value under the file name
``<dynamic-code>``, so a traceback on the receiver would read
``File "<dynamic-code>", line 2`` and show no source. Here a code object keeps
its own file name (a notebook cell's is its kernel's, such as
``/tmp/ipykernel_81/2391.py``: unique to that kernel and cell), and carries
the source lines it spans and the label IPython gives its cell
(``Cell In[7]``). The receiver puts the lines in :mod:`linecache` under that
file name, where traceback formatting reads source lines, and keeps the
label; :func:`format_exception` then writes a frame of that code as IPython
writes a local one::

    Traceback (most recent call last):
      Cell In[7], line 2, in reciprocal
        return 1 / x
               ~~^~~
    ZeroDivisionError: division by zero

:func:`format_exception` also leaves out frames that set
``__tracebackhide__`` (IPython's convention), such as the callee's own frames
around the user's function. The lines travel inside the definition, so with
the code cache (:mod:`.code`) once per definition and peer.
"""

from __future__ import annotations

import inspect
import linecache
import logging
import sys
import traceback
import types
import weakref
from typing import Any

from cloudpickle import cloudpickle as _cp

log = logging.getLogger(__name__)

LABELS_MAX = 4096  # files whose label (and shipped lines) a process keeps
LINES_MAX = 100_000  # a longer file's lines are not kept

# id(code) -> (a weak reference to it, what travels with it); by identity, since
# code objects compare equal across files (co_filename is not compared)
_sources: dict[int, tuple[weakref.ref, tuple]] = {}
_labels: dict[str, str | None] = {}  # file name -> its cell's label, for code received
_shipped: set[str] = set()  # file names whose linecache entry came with code


def cell_label(filename: str) -> str | None:
    """The label of the notebook cell ``filename`` names (``Cell In[7]``), from
    code received with it or from this process's IPython; None for a file.
    IPython is found in ``__main__``'s namespace; nothing is imported."""
    label = _labels.get(filename)
    if label is not None:
        return label
    get_ipython = getattr(sys.modules.get("__main__"), "get_ipython", None)
    try:
        named = get_ipython().compile.format_code_name(filename)  # type: ignore[union-attr]
    except Exception:  # not a live IPython
        return None
    return " ".join(named) if named else None


def _source(code: types.CodeType) -> tuple:
    """What travels with ``code``: its file name, cell label, first line and
    the source lines it spans (none if this process cannot read them)."""
    key = id(code)
    hit = _sources.get(key)
    if hit is not None and hit[0]() is code:
        return hit[1]
    filename, first = code.co_filename, code.co_firstlineno
    last = max((line for _, _, line in code.co_lines() if line is not None), default=first)
    lines = linecache.getlines(filename)[first - 1:last]
    source = (filename, cell_label(filename), first, tuple(lines))
    _sources[key] = (weakref.ref(code, lambda _, key=key: _sources.pop(key, None)), source)
    return source


def reduce_code(code: types.CodeType) -> tuple:
    """Pickle a code object as cloudpickle does, with its source (see above)."""
    _, args = _cp._code_reduce(code)
    return _rebuild_code, (args, *_source(code))


def _rebuild_code(args: tuple, filename: str, label: str | None, first: int,
                  lines: tuple[str, ...]) -> types.CodeType:
    code = types.CodeType(*args).replace(co_filename=filename)
    if lines:
        _remember(filename, label, first, lines)
    return code


def _remember(filename: str, label: str | None, first: int, lines: tuple[str, ...]) -> None:
    """Put received source lines in linecache (never over a file or a cell
    this process has itself) and keep the cell's label."""
    entry = linecache.cache.get(filename)
    if entry is not None and filename not in _shipped:
        return  # this process's own source of that name
    if first - 1 + len(lines) > LINES_MAX:
        return
    have = list(entry[2]) if entry is not None and len(entry) == 4 else []
    if len(have) < first - 1 + len(lines):
        have += ["\n"] * (first - 1 + len(lines) - len(have))
    have[first - 1:first - 1 + len(lines)] = lines
    if filename not in _labels and len(_labels) >= LABELS_MAX:  # forget the oldest
        oldest = next(iter(_labels))
        del _labels[oldest]
        _shipped.discard(oldest)
        linecache.cache.pop(oldest, None)
    _labels[filename] = label
    _shipped.add(filename)
    # mtime None: linecache.checkcache keeps the entry (there is no file to check)
    linecache.cache[filename] = (sum(map(len, have)), None, have, filename)


class _Stack(traceback.StackSummary):
    """Frames of notebook cells written as IPython writes them: ``Cell In[7], line 2``."""

    def format_frame_summary(self, frame_summary: traceback.FrameSummary, **kwargs: Any
                             ) -> str:  # (Python 3.13 passes colorize=)
        text = super().format_frame_summary(frame_summary, **kwargs)
        label = cell_label(frame_summary.filename)
        if label:
            text = text.replace(f'File "{frame_summary.filename}"', label, 1)
        return text


def _hides(frame: types.FrameType) -> bool:
    """Whether ``frame`` sets ``__tracebackhide__``. A function's frame is asked
    its code, not its ``f_locals``: before Python 3.13 reading those leaves a
    dict of the frame's variables on it, and the frame that formats an
    exception holds that exception, whose traceback holds the frame. The
    cycle kept every frame of the traceback alive, with the arguments they
    hold (RRefs, tensors), until the next garbage collection.

    >>> def hidden():
    ...     __tracebackhide__ = True
    ...     return sys._getframe()
    >>> _hides(hidden()), _hides(sys._getframe())
    (True, False)
    """
    code = frame.f_code
    if code.co_flags & inspect.CO_OPTIMIZED:  # a function: its variables are its code's
        return "__tracebackhide__" in code.co_varnames
    return bool(frame.f_locals.get("__tracebackhide__"))  # a module's or class's namespace


def format_exception(e: BaseException) -> str:
    """``e``'s traceback as text, as :func:`traceback.format_exception` writes
    it, but with notebook cells named by their labels and without frames that
    set ``__tracebackhide__`` (the last frame of each traceback is always kept).
    Should that fail, the standard library's text: the error still reaches
    its caller.

    >>> try:
    ...     1 / 0
    ... except ZeroDivisionError as e:
    ...     print(format_exception(e).splitlines()[-1])
    ZeroDivisionError: division by zero
    """
    try:
        return _format_exception(e)
    except Exception:
        log.warning("formatting a %s's traceback failed; written plainly instead",
                    type(e).__name__, exc_info=True)
    try:
        return "".join(traceback.format_exception(type(e), e, e.__traceback__))
    except Exception:  # (e.g. a __str__ that raises)
        return f"{type(e).__qualname__} (its traceback and message could not be written)"


def _format_exception(e: BaseException) -> str:
    root = traceback.TracebackException(type(e), e, e.__traceback__)
    todo: list[tuple[Any, BaseException | None]] = [(root, e)]
    seen: set[int] = set()
    while todo:
        te, exc = todo.pop()
        if te is None or exc is None or id(te) in seen:
            continue
        seen.add(id(te))
        frames = [f for f, _ in traceback.walk_tb(exc.__traceback__)]
        stack = list(te.stack)
        if len(frames) == len(stack):  # (a traceback limit would misalign them)
            last = len(stack) - 1
            stack = [s for i, (s, f) in enumerate(zip(stack, frames))
                     if i == last or not _hides(f)]
        te.stack = _Stack(stack)
        todo += [(te.__cause__, exc.__cause__), (te.__context__, exc.__context__)]
    return "".join(root.format())
