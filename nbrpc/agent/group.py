"""Group membership and shutdown agreement, as protocol state with no I/O.

The coordinator (rank 0) keeps the member table and runs the graceful
shutdown check. :class:`Coordinator` takes events and returns
``(rank, message)`` pairs for the agent to send, so it is unit-tested without
a network.

Joining (``world_size=N``: everyone waits for all N; ``None``: dynamic)::

    worker k                 coordinator (rank 0)
       |---- Join(member) ------->|   validate name / rank
       |<--- Members(table) ------|   static: once all N have joined, to all
       |                          |   dynamic: at once; MemberJoined to the rest

Graceful shutdown is termination detection by double counting (as PyTorch's
TensorPipe agent loops "wait for no active calls, then all-reduce the count"):
each worker, once it has no outgoing call in flight, reports ``active``,
``sent`` and ``served``; the group is quiet when, in two consecutive rounds,
nobody is active, every request sent has been served, and the sums did not
move between the rounds (so no call slipped in between the reports).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .messages import (
    DrainReport,
    DrainVerdict,
    Join,
    Member,
    MemberJoined,
    MemberLeft,
    Members,
)


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A member of the group: its unique ``name`` and its ``id`` (= rank).

    >>> WorkerInfo("worker1", 1)
    WorkerInfo(id=1, name=worker1)
    """

    name: str
    id: int

    def __repr__(self) -> str:  # same text as torch.distributed.rpc.WorkerInfo
        return f"WorkerInfo(id={self.id}, name={self.name})"


Outbox = list[tuple[int, Any]]


class Coordinator:
    """Rank 0's view of the group: who is in it, and the shutdown rounds."""

    def __init__(self, world_size: int | None) -> None:
        if world_size is not None and world_size < 1:
            raise ValueError(f"world_size must be >= 1 or None, got {world_size}")
        self.world_size = world_size
        self.members: dict[int, Member] = {}
        self._reports: dict[int, dict[int, DrainReport]] = {}
        self._last_sums: tuple[int, int] | None = None

    @property
    def complete(self) -> bool:
        return self.world_size is None or len(self.members) == self.world_size

    def table(self) -> tuple[Member, ...]:
        return tuple(sorted(self.members.values(), key=lambda m: m.rank))

    def on_join(self, join: Join) -> Outbox:
        m = join.member
        error = self._check(m, join.world_size)
        if error:
            return [(m.rank, Members((), error))]
        rejoin = self.members.get(m.rank)
        self.members[m.rank] = m
        if self.world_size is not None:  # static: everyone hears once all are in
            if not self.complete:
                return []
            table = self.table()
            return [(r, Members(table)) for r in self.members]
        out: Outbox = [(m.rank, Members(self.table()))]
        if rejoin is None or rejoin != m:
            out += [(r, MemberJoined(m)) for r in self.members if r not in (m.rank, 0)]
        return out

    def _check(self, m: Member, world_size: int | None) -> str | None:
        if world_size != self.world_size:
            return (f"{m.name!r} was started with world_size={world_size}, but the "
                    f"group has world_size={self.world_size}; use the same value everywhere.")
        if self.world_size is not None and not 0 <= m.rank < self.world_size:
            return (f"rank {m.rank} of {m.name!r} is outside 0..{self.world_size - 1}; "
                    "ranks must be unique and below world_size.")
        for other in self.members.values():
            if other.name == m.name and other.rank != m.rank:
                return (f"the name {m.name!r} is taken by rank {other.rank}; "
                        "every worker needs a unique name.")
            if other.rank == m.rank and other.name != m.name:
                return (f"rank {m.rank} is taken by {other.name!r}; "
                        "every worker needs a unique rank.")
            if other.rank == m.rank and self.world_size is not None:
                return f"rank {m.rank} ({m.name!r}) joined twice."
        return None

    def on_leave(self, rank: int) -> Outbox:
        if self.members.pop(rank, None) is None:
            return []
        return [(r, MemberLeft(rank)) for r in self.members if r != 0]

    def on_drain_report(self, sender: int, report: DrainReport) -> Outbox:
        got = self._reports.setdefault(report.round, {})
        got[sender] = report
        if set(got) != set(self.members):
            return []
        del self._reports[report.round]
        sums = (sum(r.sent for r in got.values()), sum(r.served for r in got.values()))
        quiet = all(r.active == 0 for r in got.values()) and sums[0] == sums[1]
        done = quiet and sums == self._last_sums
        self._last_sums = sums if quiet else None
        verdict = DrainVerdict(report.round, done)
        return [(r, verdict) for r in self.members]
