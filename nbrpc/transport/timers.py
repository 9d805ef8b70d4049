"""The I/O loop's deadlines: a heap with O(1) cancel. Pure state, no thread.

Any thread adds and cancels; the loop asks how long it may sleep
(:meth:`Timers.sleep_ms`) and pops what is due (:meth:`Timers.pop_due`).
Cancelled entries are skipped when they reach the top, and the heap is rebuilt
once most of it is cancelled: a call's 60 s deadline is cancelled long before
it is due, and would otherwise stay for 60 s (600k entries at 10k calls/s).

>>> t = Timers()
>>> late, soon = t.add(10.0, print, ("late",)), t.add(1.0, print, ("soon",))
>>> t.cancel(late)
>>> t.sleep_ms(now=0.5, longest=1000)  # 0.5 s to go, +1 ms
501
>>> [(fn, args) for fn, args in t.pop_due(now=2.0)]
[(<built-in function print>, ('soon',))]
>>> len(t), t.sleep_ms(now=2.0, longest=500)
(0, 500)
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Callable
from typing import Any

COMPACT_AFTER = 256  # cancelled entries before a rebuild is considered


class Timers:
    """Deadlines ``[when, seq, fn, args]``; a handle is the entry itself."""

    def __init__(self) -> None:
        self._heap: list[list] = []
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._cancelled = 0

    def __len__(self) -> int:
        return len(self._heap)

    def add(self, when: float, fn: Callable, args: tuple) -> list:
        """Run ``fn(*args)`` at ``when`` (a ``time.monotonic()`` value)."""
        entry = [when, next(self._seq), fn, args]
        with self._lock:
            heapq.heappush(self._heap, entry)
        return entry

    def cancel(self, entry: list) -> None:
        """Cancel ``entry``; its arguments are let go at once (a cancelled
        entry stays in the heap until its time, and what it would have been
        called with, say an RRef value's future, must not live that long)."""
        if entry[2] is not None:
            entry[2] = None
            entry[3] = ()
            self._cancelled += 1

    def sleep_ms(self, now: float, longest: int) -> int:
        """Milliseconds until the next live deadline, at most ``longest``."""
        heap = self._heap
        with self._lock:
            if self._cancelled > COMPACT_AFTER and 2 * self._cancelled > len(heap):
                heap[:] = [e for e in heap if e[2] is not None]
                heapq.heapify(heap)
                self._cancelled = 0
            while heap and heap[0][2] is None:
                heapq.heappop(heap)
                self._cancelled -= 1
            if not heap:
                self._cancelled = 0
                return longest
            return min(longest, max(0, int((heap[0][0] - now) * 1000) + 1))

    def pop_due(self, now: float) -> list[tuple[Callable, Any]]:
        """Remove and return ``(fn, args)`` of every live entry due by ``now``."""
        heap, due = self._heap, []
        with self._lock:
            while heap and (heap[0][2] is None or heap[0][0] <= now):
                entry = heapq.heappop(heap)
                if entry[2] is None:
                    self._cancelled -= 1
                else:
                    due.append((entry[2], entry[3]))
        return due
