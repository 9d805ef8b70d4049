"""Group membership and shutdown agreement, as protocol state with no I/O.

The coordinator (rank 0) keeps the member table and runs the graceful
shutdown check. :class:`Coordinator` takes events and returns
``(rank, message)`` pairs for the agent to send, so it is unit-tested without
a network.

Joining (``world_size=N``: everyone waits for all N; ``None``: dynamic)::

    worker k                 coordinator (rank 0)
       |---- Join(member) ------->|   not signed for this run: no state changes
       |<--- JoinChallenge -------|   to the address the Join names (the run is
       |---- Join(member) ------->|   in its signed header), then signed for it:
       |                          |   validate name / rank
       |<--- Members(table) ------|   static: once all N have joined, to all
       |                          |   dynamic: at once; MemberJoined to the rest

(The challenge is the agent's, :mod:`.control`: a Join recorded in an earlier
run and played back never gets past it.)

Graceful shutdown is termination detection by double counting (as PyTorch's
TensorPipe agent loops "wait for no active calls, then all-reduce the count"):
each worker, once it has no outgoing call in flight, reports ``active``,
``sent`` and ``served``; the group is quiet when, in two consecutive rounds,
nobody is active, every request sent has been served, and the sums did not
move between the rounds (so no call slipped in between the reports). Counts
are per peer, and only pairs of current members are summed, so a member that
died with calls in flight does not keep the rest from agreeing. A member
that was dropped and came back (taken back, or rejoining a coordinator it
gave up on) may have lost requests in either direction, which will never be
served: the pairs it is part of need only hold still for two rounds, not
balance.

Failure detection tells *gone* from *busy* by what the kernels say, since
they answer whatever the process does. A process that exits (or is killed)
has its connections closed by its kernel. A host that vanishes (power loss, a
network partition, a frozen VM) stops acknowledging what is sent to it, and
the transport closes a TCP connection whose data stays unacknowledged for a
second (``TCP_USER_TIMEOUT``; heartbeats keep data in flight). Either way the
link goes down: a member whose link has been down for ``link_timeout`` (1 s)
and who has been silent as long is dead. A process that is busy (a C call
holding the GIL, for minutes if need be), swapping or stopped keeps its
connections acknowledged by its kernel (a stopped one that more is sent to
than its socket takes has that connection closed, but its kernel answers the
redial at once: its link is not down long enough to count), so it stays a
member: its kernel vouches for it, off its GIL. Silence alone counts only
where ``failure_timeout`` is finite: by default where the kernel does not
close a lost host's links (not Linux: 30 s), or when a user asks for it (a
host behind a proxy that acknowledges for it). A member declared dead that is
heard from again (its heartbeat names it, or it asks to join again) is taken
back, as a re-join: wrong suspicion costs the calls that failed meanwhile,
never the membership.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .messages import DrainReport, DrainVerdict, Join, Member, MemberJoined, MemberLeft, Members

MAX_NAME_LEN = 128  # a name is shorter than this, as in PyTorch
_NAME = re.compile(r"[A-Za-z0-9_\-:]+")


def check_worker_name(name: Any) -> None:
    """Refuse a worker name PyTorch's ``WorkerInfo`` refuses (``RuntimeError``).

    >>> check_worker_name("worker-1:a_b")
    >>> check_worker_name("w.1")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    RuntimeError: Worker name must match ^[A-Za-z0-9-_:]*$, ... but got 'w.1': use only ...
    """
    if isinstance(name, str) and len(name) < MAX_NAME_LEN and _NAME.fullmatch(name):
        return
    if not isinstance(name, str):
        got, why = type(name).__name__, "a worker name is a string"
    elif not name:
        got, why = "''", "give each worker a name"
    elif len(name) >= MAX_NAME_LEN:
        got, why = f"{name[:20]!r}... ({len(name)} chars)", "use a shorter name"
    else:
        got, why = repr(name), "use only ASCII letters, digits, '_', '-' and ':'"
    raise RuntimeError(
        "Worker name must match ^[A-Za-z0-9-_:]*$, and must be non-empty and shorter than "
        f"{MAX_NAME_LEN} chars, but got {got}: {why}.")


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """A member of the group: its unique ``name`` and its ``id`` (= rank).

    The name is checked as PyTorch checks it (:func:`check_worker_name`).

    >>> WorkerInfo("worker1", 1)
    WorkerInfo(id=1, name=worker1)
    """

    name: str
    id: int

    def __post_init__(self) -> None:
        check_worker_name(self.name)

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
        self.last_seen: dict[int, float] = {}  # rank -> monotonic time last heard
        self.left: set[int] = set()  # ranks that left on purpose (not taken back by heartbeat)
        # incarnations removed on purpose (Agent.expel: a restart, a removal): never
        # taken back, whether they heartbeat or join again; their rank's next
        # process (another incarnation) joins as usual
        self.banished: set[int] = set()
        # ranks dropped (or that thought they were) and back: requests to or from
        # them may have been lost, so their pairs' counts need not balance
        self.broken: set[int] = set()
        self._reports: dict[int, dict[int, DrainReport]] = {}
        self._last_counts: tuple | None = None  # the last quiet round's counts
        self.formed = world_size is None  # a static group once all had joined
        # A static group that cannot form (a joiner was refused before it formed):
        # why, and the ranks told so. Every later joiner is told too, so that every
        # rank's init_rpc fails at once (as PyTorch's, which checks all names together).
        self.failed: str | None = None
        self.told: set[int] = set()

    @property
    def complete(self) -> bool:
        """Whether joiners are answered: the static group has formed (it may have
        lost members since), or the group is dynamic."""
        return self.formed

    def table(self) -> tuple[Member, ...]:
        return tuple(sorted(self.members.values(), key=lambda m: m.rank))

    def banish(self, rank: int) -> None:
        """``rank``'s current process is removed on purpose: it is not taken back."""
        m = self.members.get(rank)
        if m is not None:
            self.banished.add(m.incarnation)

    def on_join(self, join: Join) -> Outbox:
        m = join.member
        if m.incarnation in self.banished:
            return []  # a process its driver replaced: it stays out
        if self.failed is not None:
            self.told.add(m.rank)
            return [(m.rank, Members((), self.failed, m.incarnation))]
        self.left.discard(m.rank)
        if self.members.get(m.rank) == m:  # a member that thought it was dropped
            if not self.complete:
                return []
            self.broken.add(m.rank)  # (it failed its calls to the coordinator)
            return [(m.rank, Members(self.table(), to=m.incarnation))]
        error = self._check(m, join.world_size)
        if error:
            out: Outbox = [(m.rank, Members((), error, m.incarnation))]
            if self.world_size is not None and not self.formed:
                self.failed = f"a worker tried to join and was refused: {error}"
                self.told |= {m.rank, *self.members}
                out += [(r, Members((), self.failed, self.members[r].incarnation))
                        for r in self.members]
            return out
        rejoin = self.members.get(m.rank)
        self.members[m.rank] = m
        self.last_seen.pop(m.rank, None)  # watched once the group is formed
        self.formed = self.formed or len(self.members) == self.world_size
        if self.world_size is not None:  # static: everyone hears once all are in
            if not self.complete:
                return []
            table = self.table()
            return [(r, Members(table, to=self.members[r].incarnation)) for r in self.members]
        out = [(m.rank, Members(self.table(), to=m.incarnation))]
        if rejoin is None or rejoin != m:
            out += [(r, MemberJoined(m)) for r in self.members if r not in (m.rank, 0)]
        return out

    @property
    def everyone_told(self) -> bool:
        """The static group failed and every rank has been told so."""
        if self.failed is None or self.world_size is None:
            return False
        return len({r for r in self.told if 0 <= r < self.world_size}) == self.world_size

    def _check(self, m: Member, world_size: int | None) -> str | None:
        if world_size != self.world_size:
            return (f"{m.name!r} was started with world_size={world_size}, but the "
                    f"group has world_size={self.world_size}; use the same value everywhere.")
        if self.world_size is not None and not 0 <= m.rank < self.world_size:
            return (f"rank {m.rank} of {m.name!r} is outside 0..{self.world_size - 1}; "
                    "ranks must be unique and below world_size.")
        for other in self.members.values():
            if other.name == m.name and other.rank != m.rank:
                return (f"Worker name {m.name!r} is not unique: the name is taken by rank "
                        f"{other.rank}; every worker needs a unique name.")
            if other.rank == m.rank and other.name != m.name:
                return (f"rank {m.rank} is taken by {other.name!r}; "
                        "every worker needs a unique rank.")
            if other.rank == m.rank and self.world_size is not None:
                return f"rank {m.rank} ({m.name!r}) joined twice."
        return None

    def on_leave(self, rank: int, dead: bool = False, why: str | None = None) -> Outbox:
        if self.members.pop(rank, None) is None:
            return []
        self.last_seen.pop(rank, None)
        self.broken.add(rank)  # (if it comes back)
        if not dead:
            self.left.add(rank)
        out: Outbox = [(r, MemberLeft(rank, dead, why)) for r in self.members if r != 0]
        if dead:  # in case it is alive after all: it learns it was dropped (and rejoins)
            out.append((rank, MemberLeft(rank, dead, why)))
        for rnd in sorted(self._reports):  # rounds that waited for it can finish
            out += self._verdict(rnd)
        return out

    # -- failure detection ------------------------------------------------------
    def heard_from(self, rank: int, now: float) -> None:
        if rank in self.members:
            self.last_seen[rank] = now

    def watch_all(self, now: float) -> None:
        """Start watching every member (the group is formed)."""
        for r in self.members:
            self.last_seen[r] = now

    def expired(self, now: float, timeout: float, link_timeout: float | None = None,
                down: dict[int, float | None] | None = None) -> list[int]:
        """Members (other than the coordinator) silent for longer than ``timeout``,
        or whose link has been down (``down[rank]``: since when) and who have
        been silent for longer than ``link_timeout``. With ``timeout`` infinite
        (the default on Linux), silence with the link up never expires.

        >>> c = Coordinator(None); c.members = {1: None, 2: None}; c.watch_all(0.0)
        >>> c.expired(5.0, 30.0, 1.0, {1: 3.0, 2: None})
        [1]
        >>> c.expired(600.0, float("inf"), 1.0, {1: None, 2: None})
        []
        """
        out = []
        for r, seen in self.last_seen.items():
            if r == 0:
                continue
            silent = now - seen
            since = down.get(r) if down else None
            if silent > timeout or (since is not None and link_timeout is not None
                                    and now - since > link_timeout and silent > link_timeout):
                out.append(r)
        return sorted(out)

    def link_due(self, link_timeout: float, down: dict[int, float | None]) -> float | None:
        """When the link rule of :meth:`expired` next comes due for a member
        whose link is down (down and silent for ``link_timeout``), or None.

        >>> c = Coordinator(None); c.members = {1: None, 2: None}; c.watch_all(0.0)
        >>> c.heard_from(1, 3.5); c.link_due(1.0, {1: 3.0, 2: None})
        4.5
        """
        due = [max(since, self.last_seen[r]) + link_timeout for r, since in down.items()
               if since is not None and r in self.last_seen and r != 0]
        return min(due, default=None)

    def readmits(self, rank: int, incarnation: int | None = None) -> bool:
        """Whether a heartbeat from ``rank`` (not a member) takes it back: it was
        dropped as dead, not after leaving, nor removed, on purpose."""
        return (rank not in self.members and rank not in self.left
                and incarnation not in self.banished)

    # -- graceful shutdown ------------------------------------------------------
    def on_drain_report(self, sender: int, report: DrainReport) -> Outbox:
        self._reports.setdefault(report.round, {})[sender] = report
        return self._verdict(report.round)

    def _verdict(self, rnd: int) -> Outbox:
        got = self._reports[rnd]
        if not set(self.members) <= set(got):
            return []
        del self._reports[rnd]
        ranks, broken = set(self.members), self.broken
        got = {r: rep for r, rep in got.items() if r in ranks}
        sums = [0, 0]  # requests sent and served between members never dropped
        held = []  # the counts of pairs with a member that came back
        for r, rep in sorted(got.items()):
            for i, counts in enumerate((rep.sent, rep.served)):
                for p, n in sorted(counts.items()):
                    if p not in ranks:
                        continue
                    if r in broken or p in broken:
                        held.append((r, i, p, n))
                    else:
                        sums[i] += n
        quiet = all(rep.active == 0 for rep in got.values()) and sums[0] == sums[1]
        counts = (sums[0], sums[1], tuple(held))
        done = quiet and counts == self._last_counts
        self._last_counts = counts if quiet else None
        verdict = DrainVerdict(rnd, done)
        return [(r, verdict) for r in self.members]
