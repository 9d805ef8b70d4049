"""A bounded in-memory log of what an agent did, as plain tuples.

Appending is one ``deque.append`` of a tuple on the message path; turning
entries into dicts happens only when somebody asks (:meth:`EventLog.records`).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

MESSAGE_FIELDS = ("time", "event", "op", "peer", "msg_id", "nbytes", "duration", "detail")


class EventLog:
    """Message events (``send``/``recv`` of requests and responses, errors, drops),
    membership (``member-dead``/``member-left``; ``peer-unreachable``: a
    member whose link stayed down while calls waited on it, or that reported
    its own link here down) and RRef lifecycle events
    (``rref-created``/``-forked``/``-confirmed``/``-child-accepted``/
    ``-delete-sent``/``-deleted``/``-errored``; ``op`` holds the RRef id)."""

    def __init__(self, maxlen: int = 10_000) -> None:
        self._entries: deque[tuple] = deque(maxlen=maxlen)
        self.clock = time.time

    def add(self, event: str, op: str, peer: str, msg_id: int, nbytes: int,
            duration: float | None = None, detail: str = "") -> None:
        self._entries.append((self.clock(), event, op, peer, msg_id, nbytes, duration, detail))

    def records(self, last: int | None = None) -> list[dict[str, Any]]:
        entries = list(self._entries)
        if last is not None:
            entries = entries[-last:] if last > 0 else []
        return [dict(zip(MESSAGE_FIELDS, e)) for e in entries]

    def between(self, start: float, end: float) -> tuple[list[tuple], bool]:
        """The raw entries logged from ``start`` to ``end`` (this log's clock), and
        whether some of that window was already pushed out of the bounded log."""
        entries = list(self._entries)
        lost = len(entries) == self._entries.maxlen and entries[0][0] > start
        return [e for e in entries if start <= e[0] <= end], lost

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
