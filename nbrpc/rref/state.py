"""The RRef protocol as plain state: no sockets, no threads of its own, no pickling.

PyTorch's "Remote Reference Protocol", one object per worker. Methods take
events (an RRef created, sent, received, deleted; a message arrived; a peer
died) and return ``(rank, message)`` pairs for the caller to send: message
values (:mod:`.messages`, which also says how they pickle), never bytes. The
agent-side glue (:mod:`nbrpc.rref.context`) sends them through the agent,
which pickles them, and retries; here everything is deterministic and
unit-tested without a network.

Who holds what::

    owner   Owned entry per RRef id: the value (a future), its user forks
            {fork id: holder rank}, and a count of owner-side RRef objects.
            The value is dropped exactly when both are empty.
    user    UserFork per fork id: owner, parent, pending / confirmed /
            deleting. A pending fork's deletion waits for the confirmation.
    parent  Child per fork id it sent: keeps the sent RRef object alive
            until the child is confirmed by the owner (G2).

Forking (an RRef pickled into a message for ``to``)::

    owner → user     owner registers the fork {F: to} at once; the
                     receiver's copy is born confirmed. No messages.
    user → owner     parent keeps a Child F; the owner makes an owner-side
                     RRef and answers ChildAccept(F) to the parent, or, if
                     F came in a request, the parent drops F when the answer
                     to that request comes (it proves the owner read it).
    user → user      parent keeps a Child F; the receiver registers:
      A ──(rref F)──▶ C ── ForkRequest(F) ──▶ owner     adds {F: C}
                      C ◀──────── ok ──────── owner
      A ◀── ChildAccept(F) ── C                         A drops Child F
                     If F came in a request, C sends no ChildAccept: its
                     answer to that request (after F was confirmed: the
                     request's function waits for that) lets A drop F, unless
                     the answer lists F as still pending.
    delete           user ── Delete(F) ──▶ owner        drops F (G1)

Every message is idempotent: the owner remembers deleted forks (tombstones),
so a ForkRequest or Remote retried or delayed past its Delete does not
resurrect the fork.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .messages import ChildAccept, Delete, ForkRequest


class RRefId(NamedTuple):
    """Globally unique: the rank that made the id and a counter there."""

    creator: int
    local: int

    def __str__(self) -> str:
        return f"{self.creator}:{self.local}"

    def as_torch(self) -> str:
        """As PyTorch prints an RRef or fork id (nbrpc's own numbering).

        >>> RRefId(0, 3).as_torch()
        'GloballyUniqueId(created_on=0, local_id=3)'
        """
        return f"GloballyUniqueId(created_on={self.creator}, local_id={self.local})"


ForkId = RRefId  # a user copy's id has the same shape


Outbox = list[tuple[int, Any]]


# -- table rows ---------------------------------------------------------------------
@dataclass
class Owned:
    rref_id: RRefId
    value: torch.futures.Future  # remote() returns before the value exists
    site: str
    created: float = field(default_factory=time.time)
    forks: dict[ForkId, int] = field(default_factory=dict)  # fork -> holder rank
    owner_refs: int = 0  # live owner-side RRef objects

    @property
    def alive(self) -> bool:
        return bool(self.forks) or self.owner_refs > 0


PENDING, CONFIRMED, FAILED, DELETING = "pending", "confirmed", "failed", "deleting"


@dataclass
class UserFork:
    rref_id: RRefId
    fork_id: ForkId
    owner: int
    parent: int | None  # who sent it here; None: created here by remote()
    site: str
    state: str = PENDING
    released: bool = False  # the RRef object is gone; delete once confirmed
    created: float = field(default_factory=time.time)
    # it came in a request: the answer to it tells the parent (no ChildAccept),
    # unless it is still pending when answered (see unsettled_at_answer)
    by_answer: bool = False


@dataclass
class Child:
    rref_id: RRefId
    fork_id: ForkId
    to: int
    keepalive: Any  # the parent's RRef object, held until ChildAccept (G2)
    since: float = field(default_factory=time.time)


TOMBSTONES = 65_536  # deleted forks remembered by an owner (oldest forgotten first)


class RRefState:
    """One worker's RRef tables. Thread-safe; returns messages, sends none."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._ids = itertools.count(0)  # as PyTorch: the first id is local_id=0
        self._lock = threading.RLock()
        self.owned: dict[RRefId, Owned] = {}
        self.users: dict[ForkId, UserFork] = {}
        self.children: dict[ForkId, Child] = {}
        self._tombstones: OrderedDict[ForkId, None] = OrderedDict()
        self.deleted = 0  # owned values dropped so far
        # Fetches that overtook the message creating their entry (the pool may
        # run requests out of order): resolved when it comes, or expired.
        self._awaiting: dict[RRefId, list[torch.futures.Future]] = {}
        # ids whose creator gave up, for a Fetch that arrives after the cancel
        self._cancelled: OrderedDict[RRefId, Exception] = OrderedDict()

    def new_id(self) -> RRefId:
        return RRefId(self.rank, next(self._ids))

    # -- owner ------------------------------------------------------------------------
    def own(self, rref_id: RRefId, site: str) -> Owned:
        """An owner-side RRef object was made (``RRef(value)``, ``remote()`` to self,
        or an RRef that came home)."""
        with self._lock:
            entry = self._entry(rref_id, site)
            entry.owner_refs += 1
        self._wake(entry)
        return entry

    def on_remote(self, rref_id: RRefId, fork: ForkId, holder: int, site: str) -> Owned | None:
        """A user's ``remote()`` arrived: store the value under its id for its fork.
        None: that fork was deleted already (a retried or late Remote), keep nothing."""
        with self._lock:
            if fork in self._tombstones and rref_id not in self.owned:
                return None
            entry = self._entry(rref_id, site)
            if fork not in self._tombstones:
                entry.forks[fork] = holder
        self._wake(entry)
        return entry

    def on_fork_request(self, rref_id: RRefId, fork: ForkId, holder: int) -> None:
        """Register a user→user fork. It may overtake the Remote that creates the
        value: the entry is then made with a pending value for the Remote to fill."""
        with self._lock:
            if fork in self._tombstones:  # retried after its own Delete: nothing to do
                return
            entry = self._entry(rref_id, "?")
            entry.forks[fork] = holder
        self._wake(entry)

    def on_delete(self, rref_id: RRefId, fork: ForkId) -> Owned | None:
        """A user dropped ``fork``; returns the entry if its value is now freed."""
        with self._lock:
            self._tombstone(fork)
            entry = self.owned.get(rref_id)
            if entry is None:
                return None
            entry.forks.pop(fork, None)
            return self._maybe_drop(entry)

    def release_owner_ref(self, rref_id: RRefId) -> Owned | None:
        with self._lock:
            entry = self.owned.get(rref_id)
            if entry is None:
                return None
            entry.owner_refs -= 1
            return self._maybe_drop(entry)

    def fork_from_owner(self, rref_id: RRefId, to: int) -> ForkId:
        """The owner sends its RRef to user ``to``: the fork is registered now,
        so the receiver's copy is confirmed on arrival."""
        with self._lock:
            fork = self.new_id()
            self.owned[rref_id].forks[fork] = to
            return fork

    def came_home(self, rref_id: RRefId, fork: ForkId | None, parent: int,
                  by_answer: bool = False) -> Outbox:
        """An RRef arrived at its owner: the caller makes an owner-side object
        (see :meth:`own`); the sending user may stop holding its child. It is
        told so by a ChildAccept, or, for an RRef in a request, by the answer
        to that request (no message of its own)."""
        if fork is None or parent == self.rank or by_answer:
            return []
        return [(parent, ChildAccept(rref_id, fork))]

    # -- fetches that overtake creation ----------------------------------------------
    def await_entry(self, rref_id: RRefId) -> torch.futures.Future:
        """A future of the entry, completed now if it exists, else when created."""
        fut: torch.futures.Future = torch.futures.Future()
        with self._lock:
            entry = self.owned.get(rref_id)
            cancelled = self._cancelled.get(rref_id)
            if entry is None and cancelled is None:
                self._awaiting.setdefault(rref_id, []).append(fut)
                return fut
        if entry is None:
            fut.set_exception(cancelled)
        else:
            fut.set_result(entry)
        return fut

    def creation_failed(self, rref_id: RRefId, error: Exception) -> int:
        """The creator's Remote never arrived: fail fetches waiting for it (also
        ones that come later), and a placeholder made by a fork of it."""
        with self._lock:
            waiters = self._awaiting.pop(rref_id, [])
            entry = self.owned.get(rref_id)
            if entry is None:  # for fetches and forks that come later
                self._cancelled[rref_id] = error
                if len(self._cancelled) > 1024:
                    self._cancelled.popitem(last=False)
        for w in waiters:
            w.set_exception(error)
        if entry is not None and not entry.value.done():
            entry.value.set_exception(error)
        return len(waiters)

    def expire_waiter(self, rref_id: RRefId, fut: torch.futures.Future, error: Exception) -> None:
        """Give up on a waiter whose entry never came (bounds the table)."""
        with self._lock:
            waiters = self._awaiting.get(rref_id, [])
            if fut not in waiters:
                return
            waiters.remove(fut)
            if not waiters:
                del self._awaiting[rref_id]
        fut.set_exception(error)

    def _wake(self, entry: Owned) -> None:
        if not self._awaiting:
            return
        with self._lock:
            waiting = self._awaiting.pop(entry.rref_id, ())
        for w in waiting:
            w.set_result(entry)

    def _entry(self, rref_id: RRefId, site: str) -> Owned:
        entry = self.owned.get(rref_id)
        if entry is None:
            entry = self.owned[rref_id] = Owned(rref_id, torch.futures.Future(), site)
            cancelled = self._cancelled.pop(rref_id, None)
            if cancelled is not None:  # a fork of a value whose creation failed
                entry.value.set_exception(cancelled)
        elif entry.site == "?":
            entry.site = site
        return entry

    def _maybe_drop(self, entry: Owned) -> Owned | None:
        if entry.alive:
            return None
        del self.owned[entry.rref_id]
        self.deleted += 1
        return entry

    def _tombstone(self, fork: ForkId) -> None:
        self._tombstones[fork] = None
        if len(self._tombstones) > TOMBSTONES:
            self._tombstones.popitem(last=False)

    # -- users --------------------------------------------------------------------------
    def new_user(self, rref_id: RRefId, owner: int, site: str) -> ForkId:
        """``remote()`` here: a user fork, pending until the owner acknowledges."""
        with self._lock:
            fork = self.new_id()
            self.users[fork] = UserFork(rref_id, fork, owner, None, site)
            return fork

    def user_arrived(self, rref_id: RRefId, owner: int, fork: ForkId, parent: int,
                     confirmed: bool, site: str, by_answer: bool = False) -> Outbox:
        """A fork of someone else's RRef arrived from ``parent`` (``by_answer``:
        in a request, whose answer will tell the parent it may let go)."""
        with self._lock:
            user = UserFork(rref_id, fork, owner, parent, site,
                            CONFIRMED if confirmed else PENDING, by_answer=by_answer)
            self.users[fork] = user
            if confirmed:  # the owner itself sent it: already registered
                return []
            return [(owner, ForkRequest(rref_id, fork))]

    def on_confirmed(self, fork: ForkId) -> Outbox:
        """The owner acknowledged ``fork`` (the reply to Remote or ForkRequest)."""
        return self._settle(fork, CONFIRMED)

    def on_failed(self, fork: ForkId) -> Outbox:
        """The Remote or ForkRequest registering ``fork`` failed (no answer after
        every retry). The owner may still have stored it, so a release still
        sends a (harmless) Delete; a parent stops holding its child (the copy
        here is broken either way, and the parent must not leak)."""
        return self._settle(fork, FAILED)

    def _settle(self, fork: ForkId, state: str) -> Outbox:
        """A pending fork is settled either way: its parent may let go (to
        ourselves too, for a fork sent to self), and a delete held back goes out."""
        with self._lock:
            user = self.users.get(fork)
            if user is None or user.state != PENDING:
                return []
            user.state = state
            out: Outbox = []
            if user.parent is not None and not user.by_answer:
                out.append((user.parent, ChildAccept(user.rref_id, fork)))
            if user.released:
                out += self._delete(user)
            return out

    def unsettled_at_answer(self, fork: ForkId) -> list[ForkId]:
        """The request that brought ``fork`` is being answered: ``[]`` if the fork
        is settled (the answer lets the parent go), else ``[fork]`` (the answer
        says so, and the parent waits for the ChildAccept its settling sends)."""
        with self._lock:
            user = self.users.get(fork)
            if user is None or not user.by_answer or user.state != PENDING:
                return []
            user.by_answer = False
            return [fork]

    def release_user(self, fork: ForkId) -> Outbox:
        """The user RRef object was garbage-collected."""
        with self._lock:
            user = self.users.get(fork)
            if user is None or user.released:
                return []
            user.released = True
            if user.state == PENDING:  # G2 on the child side: wait for the owner
                return []
            return self._delete(user)

    def on_delete_done(self, fork: ForkId) -> None:
        with self._lock:
            user = self.users.get(fork)
            if user is not None and user.state == DELETING:
                del self.users[fork]

    def _delete(self, user: UserFork) -> Outbox:
        user.state = DELETING
        return [(user.owner, Delete(user.rref_id, user.fork_id))]

    # -- parents --------------------------------------------------------------------
    def fork_from_user(self, rref_id: RRefId, to: int, keepalive: Any) -> ForkId:
        """This user sends its RRef to ``to``: hold it until the child is accepted."""
        with self._lock:
            fork = self.new_id()
            self.children[fork] = Child(rref_id, fork, to, keepalive)
            return fork

    def on_child_accept(self, fork: ForkId) -> Child | None:
        """Returns the child record (drop it outside the lock: that may free the RRef)."""
        with self._lock:
            return self.children.pop(fork, None)

    def undo_fork(self, rref_id: RRefId, fork: ForkId) -> Owned | None:
        """The message carrying ``fork`` was never sent: forget it."""
        with self._lock:
            self.children.pop(fork, None)
            entry = self.owned.get(rref_id)
            if entry is not None and entry.forks.pop(fork, None) is not None:
                return self._maybe_drop(entry)
            return None

    # -- peers --------------------------------------------------------------------------
    def peer_gone(self, rank: int) -> tuple[list[Owned], list[Child], list[UserFork]]:
        """``rank`` died or left: its forks count as deleted, our children sent
        to it are dropped, and our forks of its values are orphaned.
        Returns (freed entries, dropped children, orphaned user forks)."""
        with self._lock:
            freed = []
            for entry in list(self.owned.values()):
                gone = [f for f, holder in entry.forks.items() if holder == rank]
                for f in gone:
                    del entry.forks[f]
                    self._tombstone(f)
                if gone and (dropped := self._maybe_drop(entry)) is not None:
                    freed.append(dropped)
            children = [c for c in self.children.values() if c.to == rank]
            for c in children:
                del self.children[c.fork_id]
            orphans = [u for u in self.users.values() if u.owner == rank]
            for u in orphans:
                del self.users[u.fork_id]
            for u in self.users.values():
                if u.parent == rank:  # nobody left to tell
                    u.parent = None
            return freed, children, orphans

    def release_all_users(self) -> Outbox:
        """At shutdown: delete every user fork still held, as PyTorch does."""
        with self._lock:
            out: Outbox = []
            for fork in list(self.users):
                out += self.release_user(fork)
            return out

    # -- inspection -----------------------------------------------------------------
    def outstanding(self) -> int:
        """Protocol work not finished here: children awaiting acceptance, forks
        awaiting confirmation or deletion. Graceful shutdown waits for zero."""
        with self._lock:
            return len(self.children) + sum(
                1 for u in self.users.values()
                if u.state == DELETING or (u.state == PENDING and u.released))


def batch_deletes(outbox: Outbox) -> Outbox:
    """``outbox`` with its Deletes to each rank merged into one, at the place of
    the first: a burst of deletions costs each owner one message and one answer.

    >>> r, (a, b, c) = RRefId(1, 7), (ForkId(0, 1), ForkId(0, 2), ForkId(0, 3))
    >>> out = batch_deletes([(1, Delete(r, a)), (2, ChildAccept(r, c)), (1, Delete(r, b))])
    >>> [(rank, type(m).__name__) for rank, m in out]
    [(1, 'Delete'), (2, 'ChildAccept')]
    >>> [str(fork) for _, fork in out[0][1].forks()]
    ['0:1', '0:2']
    """
    if len(outbox) < 2:  # (most outboxes: nothing to merge)
        return outbox
    deletes: dict[int, list] = {}
    for rank, msg in outbox:
        if type(msg) is Delete:
            deletes.setdefault(rank, []).extend(msg.forks())
    if all(len(forks) == 1 for forks in deletes.values()):
        return outbox
    out: Outbox = []
    for rank, msg in outbox:
        if type(msg) is not Delete:
            out.append((rank, msg))
        elif rank in deletes:
            (rref_id, fork_id), *more = forks = deletes.pop(rank)
            out.append((rank, msg if len(forks) == 1 else Delete(rref_id, fork_id, tuple(more))))
    return out
