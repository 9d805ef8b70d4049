"""Short full garbage collections while agents run.

With torch imported, a process holds hundreds of thousands of objects that
Python's cyclic garbage collector tracks, and a full (generation 2)
collection walks them all: about 70 ms on this project's machine. Each RPC
allocates Python objects, so a full collection comes every few hundred calls
and stalls the caller's or the callee's threads meanwhile. A C++ agent
(``torch.distributed.rpc``) never pays it; a Python one did: 500 no-op
``rpc_async`` calls ran at 12k calls/s, or at 4.5k when a full collection
fell among them.

So while an agent runs, the objects that existed when the first agent of the
process started (imported modules, functions, classes: objects that stay) are
moved to the collector's permanent generation with :func:`gc.freeze`, which
collections skip; when the last agent stops, :func:`gc.unfreeze` gives them
back, so garbage cycles among them are collected as before. Reference
counting frees frozen objects as usual; only a *cycle* of them that becomes
garbage waits for the unfreeze.

``AgentOptions(gc_freeze=False)`` turns it off for an agent made directly;
after ``init_rpc`` or a cluster start, :func:`thaw` ends it (until every agent
of the process has stopped), as ``nbrpc.debug.why_alive`` does: tools that
must see every object need it, since ``gc.get_referrers`` skips frozen ones.
A process that froze objects itself (a pre-fork server, nbrpc's cluster
zygote, whose engines thus start frozen) is left as it is. That is not read
from :func:`gc.get_freeze_count` alone: CPython 3.12 itself keeps hundreds of
immortal objects in the permanent generation from start-up, so the count is
never zero there; :func:`frozen_by_process` tells.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading

log = logging.getLogger(__name__)

_lock = threading.Lock()
_holders = 0  # running agents that asked for the freeze
_frozen = False  # this module froze objects and has not given them back


def hold() -> None:
    """An agent starts: the first one freezes the objects alive now.

    >>> hold(); release()
    """
    global _holders, _frozen
    with _lock:
        _holders += 1
        if _holders == 1 and not _frozen and not frozen_by_process():
            gc.freeze()
            _frozen = True
            log.debug("gc.freeze(): %d objects out of full collections", gc.get_freeze_count())


def release() -> None:
    """An agent stopped: the last one gives the frozen objects back."""
    global _holders
    with _lock:
        _holders = max(0, _holders - 1)
        if _holders == 0:
            _unfreeze()


def thaw() -> None:
    """Give the frozen objects back now (until every agent has stopped and one
    starts again), for a caller that needs the collector to see them all.

    >>> thaw(); gc.get_freeze_count() == 0 or not is_frozen()
    True
    """
    with _lock:
        _unfreeze()


def frozen_by_process() -> bool:
    """Whether the process froze objects itself (:func:`gc.freeze` called, not
    by this module), which this module then leaves as they are. While this
    module holds its own freeze: False.

    >>> frozen_by_process()
    False
    """
    return not _frozen and anything_frozen()


def anything_frozen() -> bool:
    """Whether :func:`gc.freeze` took the objects alive (by anyone's call).

    A count of zero says no. Otherwise the count alone does not tell: CPython
    3.12 moves immortal objects (hundreds, from start-up) to the permanent
    generation itself. A ``gc.freeze()`` moves every tracked object there,
    ``sys.__dict__`` among them, and :func:`gc.get_referrers` skips frozen
    objects: so objects are frozen when ``sys.__dict__`` no longer shows as a
    referrer of ``sys.modules``. That walks the unfrozen objects once (about
    14 ms with torch imported; an agent asks once, as the first starts), and
    writes to none of them (pages shared with a pre-fork parent stay shared).

    >>> anything_frozen()
    False
    """
    if gc.get_freeze_count() == 0:
        return False
    namespace = sys.__dict__
    return not any(r is namespace for r in gc.get_referrers(sys.modules))


def is_frozen() -> bool:
    """Whether this module holds objects frozen."""
    return _frozen


def _unfreeze() -> None:
    global _frozen
    if _frozen:
        gc.unfreeze()
        _frozen = False
