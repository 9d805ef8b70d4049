"""Owner-side RRef bookkeeping as plain state: no sockets, no threads.

An owned value lives in an :class:`OwnerEntry` keyed by its :class:`RRefId`.
It is kept while any user fork is registered or any owner-side ``RRef``
object is alive, and dropped the moment both are gone.

This is the part of PyTorch's "Remote Reference Protocol" that ``remote()``
and user deletion need; forking an RRef to a third worker (G2, pending
children) builds on these tables.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


class RRefId(NamedTuple):
    """Globally unique: the rank that created the RRef and a counter there."""

    creator: int
    local: int

    def __str__(self) -> str:
        return f"{self.creator}:{self.local}"


ForkId = RRefId  # a user copy's id has the same shape


@dataclass
class OwnerEntry:
    rref_id: RRefId
    value: torch.futures.Future  # remote() returns before the value exists
    site: str
    created: float = field(default_factory=time.time)
    forks: set[ForkId] = field(default_factory=set)
    owner_refs: int = 0  # live owner-side RRef objects

    @property
    def alive(self) -> bool:
        return bool(self.forks) or self.owner_refs > 0


class OwnerTable:
    """Values this worker owns, and who holds a reference to each."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.entries: dict[RRefId, OwnerEntry] = {}
        # Fetches that overtook the Remote creating their entry (the pool may
        # run requests out of order): resolved by create(), or expired.
        self._awaiting: dict[RRefId, list[torch.futures.Future]] = {}
        # ids whose creator gave up, for a Fetch that arrives after the cancel
        self._cancelled: dict[RRefId, Exception] = {}
        self.deleted = 0

    def new_id(self) -> RRefId:
        return RRefId(self.rank, next(self._ids))

    def create(self, rref_id: RRefId, site: str, fork: ForkId | None = None,
               owner_ref: bool = False) -> OwnerEntry:
        with self._lock:
            entry = self.entries.get(rref_id)
            if entry is None:
                entry = self.entries[rref_id] = OwnerEntry(rref_id, torch.futures.Future(), site)
            if fork is not None:
                entry.forks.add(fork)
            if owner_ref:
                entry.owner_refs += 1
            waiting = self._awaiting.pop(rref_id, ())
        for w in waiting:
            w.set_result(entry)
        return entry

    def await_entry(self, rref_id: RRefId) -> torch.futures.Future:
        """A future of the entry, completed now if it exists, else when created."""
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            entry = self.entries.get(rref_id)
            cancelled = self._cancelled.pop(rref_id, None)
            if entry is None and cancelled is None:
                self._awaiting.setdefault(rref_id, []).append(fut)
                return fut
        if entry is None:
            fut.set_exception(cancelled)
        else:
            fut.set_result(entry)
        return fut

    def expire_waiters(self, rref_id: RRefId, error: Exception) -> int:
        """Fail every fetch still waiting for ``rref_id`` (its creator gave up)."""
        with self._lock:
            waiters = self._awaiting.pop(rref_id, [])
            if not waiters and rref_id not in self.entries:  # the Fetch may come later
                if len(self._cancelled) >= 1024:
                    self._cancelled.pop(next(iter(self._cancelled)))
                self._cancelled[rref_id] = error
        for w in waiters:
            w.set_exception(error)
        return len(waiters)

    def expire_waiter(self, rref_id: RRefId, fut: torch.futures.Future, error: Exception) -> None:
        """Give up on a waiter whose entry never came (bounds the table)."""
        with self._lock:
            waiters = self._awaiting.get(rref_id, [])
            if fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del self._awaiting[rref_id]
            else:
                return
        fut.set_exception(error)

    def get(self, rref_id: RRefId) -> OwnerEntry | None:
        return self.entries.get(rref_id)

    def remove_fork(self, rref_id: RRefId, fork: ForkId) -> bool:
        """A user deleted its copy; True if the value was dropped."""
        with self._lock:
            entry = self.entries.get(rref_id)
            if entry is None:
                return False
            entry.forks.discard(fork)
            return self._maybe_drop(entry)

    def release_owner_ref(self, rref_id: RRefId) -> bool:
        with self._lock:
            entry = self.entries.get(rref_id)
            if entry is None:
                return False
            entry.owner_refs -= 1
            return self._maybe_drop(entry)

    def _maybe_drop(self, entry: OwnerEntry) -> bool:
        if entry.alive:
            return False
        del self.entries[entry.rref_id]
        self.deleted += 1
        return True

    def snapshot(self) -> list[dict[str, Any]]:
        now = time.time()
        out = []
        for e in list(self.entries.values()):
            state = "pending"
            if e.value.done():
                try:
                    v = e.value.value()
                    state, typ = "ready", f"{type(v).__module__}.{type(v).__qualname__}"
                except Exception as exc:
                    state, typ = "error", type(exc).__name__
            else:
                typ = None
            out.append({"rref_id": str(e.rref_id), "state": state, "type": typ,
                        "forks": sorted(str(f) for f in e.forks), "owner_refs": e.owner_refs,
                        "site": e.site, "age": now - e.created})
        return out
