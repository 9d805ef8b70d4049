"""Who is in the group, as one agent sees it: plain state, no sockets.

The member table maps ranks and names to :class:`~.messages.Member` records
and remembers former members with why they went, so that a call to one says
"'w2' left the group" rather than "no such worker". The agent owns one and
does the side effects (addresses, failing pending calls, hooks); the upper
layers (RRefs, autograd, the optimizer) read it through the agent's
``peer_name``, ``is_member``, ``member_ranks`` and ``rank_of``.

>>> t = MemberTable()
>>> t.add(Member("w0", 0, "tcp://127.0.0.1:1")); t.add(Member("w1", 1, "tcp://127.0.0.1:2"))
>>> t.resolve("w1").rank, t.peer_name(0), t.ranks()
(1, 'w0', [0, 1])
>>> t.remove(1, "left the group").name
'w1'
>>> t.resolve("w1")
Traceback (most recent call last):
...
nbrpc.errors.WorkerGoneError: ...'w1' left the group...
>>> t.peer_name(1), t.peer_name(7)
('w1', 'rank7')
"""

from __future__ import annotations

from typing import Any

from ..errors import UnknownWorkerError, WorkerGoneError
from .group import WorkerInfo
from .messages import Member


class MemberTable:
    """Current members by rank and by name, and former ones with the reason."""

    def __init__(self) -> None:
        self.by_rank: dict[int, Member] = {}
        self.by_name: dict[str, Member] = {}
        self.gone: dict[int, tuple[str, str]] = {}  # rank -> (name, why): died or left

    def __contains__(self, rank: object) -> bool:
        return rank in self.by_rank

    def __len__(self) -> int:
        return len(self.by_rank)

    def get(self, rank: int) -> Member | None:
        return self.by_rank.get(rank)

    def ranks(self) -> list[int]:
        """The current members' ranks, sorted (a copy: safe to iterate)."""
        return sorted(self.by_rank)

    def members(self) -> list[Member]:
        """The current members, by rank."""
        return [self.by_rank[r] for r in self.ranks()]

    def infos(self) -> list[WorkerInfo]:
        return [WorkerInfo(m.name, m.rank) for m in self.members()]

    def resolve(self, to: Any) -> Member:
        """The member a destination (name, rank or WorkerInfo) names; a former
        member raises :class:`WorkerGoneError` saying why, any other name
        :class:`UnknownWorkerError` listing the members."""
        if isinstance(to, str):
            m = self.by_name.get(to)
        elif isinstance(to, int) and not isinstance(to, bool):
            m = self.by_rank.get(to)
        elif hasattr(to, "name") and hasattr(to, "id"):
            m = self.by_name.get(to.name)
        else:
            raise TypeError(
                f"a destination is a worker name, a rank or a WorkerInfo; got {type(to).__name__}")
        if m is None:
            for rank, (name, why) in list(self.gone.items()):
                if to in (name, rank) or getattr(to, "name", None) == name:
                    raise WorkerGoneError(name, why)
            raise UnknownWorkerError(to, self.by_name)
        return m

    def rank_of(self, name: str) -> int | None:
        """The rank of the member (or former member) called ``name``."""
        m = self.by_name.get(name)
        if m is not None:
            return m.rank
        return next((r for r, (n, _) in list(self.gone.items()) if n == name), None)

    def peer_name(self, rank: int) -> str:
        """The name of ``rank``: a member's, a former member's, else ``rank<N>``."""
        m = self.by_rank.get(rank)
        if m is not None:
            return m.name
        gone = self.gone.get(rank)
        return gone[0] if gone else f"rank{rank}"

    def gone_why(self, rank: int) -> str | None:
        gone = self.gone.get(rank)
        return gone[1] if gone else None

    def add(self, m: Member) -> None:
        """``m`` joins (or rejoins, maybe renamed or restarted, under its rank)."""
        old = self.by_rank.get(m.rank)
        if old is not None and old.name != m.name:
            self.by_name.pop(old.name, None)
        self.by_rank[m.rank] = m
        self.by_name[m.name] = m
        self.gone.pop(m.rank, None)

    def remove(self, rank: int, why: str) -> Member | None:
        """``rank`` left or died (``why``); returns its record, or None if it
        was not a member."""
        m = self.by_rank.pop(rank, None)
        if m is None:
            return None
        self.gone[rank] = (m.name, why)
        if self.by_name.get(m.name) is m:
            self.by_name.pop(m.name, None)
        return m
