"""What nbrpc reads from a running IPython shell, and what it drops from it.

IPython is never imported here. A process that runs IPython (a kernel, an
ipyparallel engine, a terminal) has made ``__main__`` its user namespace, with
``get_ipython`` in it; a plain script has neither, and every function here
then answers "nothing". So any layer may use this module: importing it loads
no display library.

Three things nbrpc needs from the shell:

* **Cell names.** Code typed in a cell has a file name that IPython's
  compiler maps to ``Cell In[12]``; :func:`creation_site` names where an RRef
  was made that way (``cell In[12], line 3``).
* **The output history.** IPython keeps every value a cell displayed:
  ``Out[n]`` and ``_n``, and the last three also as ``_``, ``__`` and
  ``___`` (in the user namespace, in its hidden namespace and on its display
  hook) and in the last execution result. An RRef kept there keeps its value
  alive on the owner. :func:`output_history` lists what it keeps and
  :func:`forget_outputs` drops it.
* **Output names**, so that the referrers of a value can be described as
  IPython's (:func:`is_output_name`).

>>> is_output_name("_"), is_output_name("_12"), is_output_name("_x")
(True, True, False)
>>> shell() is None or type(shell()).__name__.endswith("Shell")  # None in a script
True
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from typing import Any

from .serialize import cell_label


def user_namespace() -> dict:
    """``__main__``'s namespace: in IPython, the user namespace (``Out``, ``_``, ``_n``)."""
    return getattr(sys.modules.get("__main__"), "__dict__", {})


def shell() -> Any:
    """IPython's running shell, or None (found through the user namespace's
    ``get_ipython``, never imported)."""
    get_ipython = user_namespace().get("get_ipython")
    return get_ipython() if callable(get_ipython) else None


def is_output_name(key: Any) -> bool:
    """``_``, ``__``, ``___`` or ``_12``: IPython's names for earlier outputs."""
    return isinstance(key, str) and (key in ("_", "__", "___") or (
        key[:1] == "_" and key[1:].isdigit()))


def creation_site() -> str:
    """Where user code called into nbrpc: ``file:line``, or ``cell In[12], line 3``
    for code from a notebook cell: this kernel's (IPython's compiler names each
    cell's file) or a driver's, for a function it sent by value (its label
    travels with it). The frames of nbrpc's own code are skipped.

    IPython's ``execution_count`` is no substitute: it is advanced before a cell
    runs, and code defined in an earlier cell runs under a later count."""
    f = sys._getframe(1)
    while f is not None and f.f_globals.get("__name__", "").partition(".")[0] == "nbrpc":
        f = f.f_back
    if f is None:
        return "?"
    label = cell_label(f.f_code.co_filename)  # "Cell In[12]", or None for a file
    if label:
        return f"cell {label.partition(' ')[2]}, line {f.f_lineno}"
    return f"{f.f_code.co_filename}:{f.f_lineno}"


def output_history() -> list[tuple[str, Any]]:
    """The values IPython's output history keeps, as ``(name, value)``: ``Out[n]``
    and the output names of the user namespace (``_``, ``_n``); none outside
    IPython. Cheap: only those names are read."""
    ns = user_namespace()
    if shell() is None:
        return []
    out = ns.get("Out")
    kept = [(f"Out[{k}]", v) for k, v in (list(out.items()) if isinstance(out, dict) else [])]
    return kept + [(k, v) for k, v in list(ns.items()) if is_output_name(k)]


def forget_outputs(holds: Callable[[Any], bool]) -> int:
    """Drop every output-history reference to a value for which ``holds(value)``
    is true (``Out[n]``, ``_``, ``__``, ``___``, ``_n``, the hidden namespace, the
    display hook and the last execution result); returns how many names were
    dropped. Nothing happens outside IPython.

    >>> forget_outputs(lambda value: value is forget_outputs)  # no cell displayed it
    0
    """
    ip = shell()
    if ip is None:
        return 0
    ns = user_namespace()
    dropped = 0
    for d in (ns, getattr(ip, "user_ns_hidden", {})):
        for k in [k for k, v in d.items() if is_output_name(k) and holds(v)]:
            d[k] = None
            dropped += 1
    out = ns.get("Out")
    if isinstance(out, dict):
        for k in [k for k, v in out.items() if holds(v)]:
            del out[k]
            dropped += 1
    hook = getattr(ip, "displayhook", None)
    for attr in ("_", "__", "___"):
        if holds(getattr(hook, attr, None)):
            setattr(hook, attr, None)
    last = getattr(ip, "last_execution_result", None)
    if last is not None and holds(getattr(last, "result", None)):
        last.result = None
    gc.collect()
    return dropped
