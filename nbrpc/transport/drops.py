"""Counting and logging messages a loop drops unread (bad signature, replay,
too large, unreadable segment...): the first of each reason is logged at
once, the rest as one summary line per ``DROP_LOG_INTERVAL``, so a flood of
forged messages cannot flood the log too.

>>> timers = []
>>> drops = DropLog("demo", lambda delay, fn: timers.append(fn))
>>> drops.note("bad signature"); drops.note("bad signature")
>>> dict(drops.counts), len(timers)
({'bad signature': 2}, 1)
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

log = logging.getLogger(__name__)

DROP_LOG_INTERVAL = 10.0  # seconds between summary lines about dropped messages


class DropLog:
    """Counts by reason (``counts``); ``call_later(delay, fn)`` schedules the
    summary line (on the loop's thread)."""

    def __init__(self, name: str, call_later: Callable[[float, Callable[[], None]], object]
                 ) -> None:
        self.counts: Counter[str] = Counter()  # reason -> messages dropped unread
        self._name, self._call_later = name, call_later
        self._unlogged: Counter[str] = Counter()
        self._log_due = False

    def note(self, reason: str, detail: str = "") -> None:
        """Count a message dropped unread (by the loop or an upper layer) and
        log it: the first of each reason at once, then one summary line per
        ``DROP_LOG_INTERVAL`` with the counts. Safe from any thread."""
        first = reason not in self.counts
        self.counts[reason] += 1
        if first:
            log.warning("%s: dropped a message unread (%s)%s", self._name, reason,
                        f": {detail}" if detail else "")
            return
        self._unlogged[reason] += 1
        if not self._log_due:
            self._log_due = True
            self._call_later(DROP_LOG_INTERVAL, self._summary)

    def _summary(self) -> None:
        self._log_due = False
        counts, self._unlogged = self._unlogged, Counter()
        if counts:
            log.warning("%s: dropped %d more message(s) unread in the last %g s: %s",
                        self._name, sum(counts.values()), DROP_LOG_INTERVAL,
                        ", ".join(f"{r} {n}" for r, n in counts.most_common()))
