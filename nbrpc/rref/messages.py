"""The RRef layer's messages: every one the layer sends, as a typed value.

Each is a request (:mod:`nbrpc.agent.messages`): kind REQUEST runs its
handler on the receiver's worker pool, INLINE on its I/O thread (bookkeeping
only, never queued behind user code). The answer is the handler's return
value in an ``Ok``, or an ``Err`` if it raised.

===========  =================  =======  ==============================  ========================
message      op                 kind     sent by → to, when              answered by
===========  =================  =======  ==============================  ========================
Remote       remote             REQUEST  creator → owner: ``remote()``;  ``Ok(None)`` once the
                                         run ``fn`` there, store the     entry exists: the
                                         value under ``rref_id``         creator's fork is
                                         (``fork_id`` None: the creator  confirmed; an ``Err``
                                         is the owner)                   or a timeout fails it
                                                                         (then CancelFetch)
Fetch        rref_fetch         INLINE   user → owner: ``to_here()``     ``Ok(value)`` once the
                                         (``may_overtake``: its fork is  value is ready; ``Err``:
                                         pending, the Remote may come    the value's error, or
                                         after it)                       no such value
CancelFetch  rref_cancel_fetch  REQUEST  creator → owner: its Remote     the number of Fetches
                                         failed; fail the Fetches that   failed (unread)
                                         wait for the value, now and
                                         later
ForkRequest  rref_fork          INLINE   receiver of a user → user fork  ``Ok(True)``: the fork
                                         → owner: register the fork      is confirmed (then
                                                                         ChildAccept)
ChildAccept  rref_child_accept  INLINE   child → parent, once its fork   ``Ok(True)`` (unread)
                                         is confirmed; owner → parent,
                                         the RRef came home. Not for a
                                         fork that came in a request:
                                         that request's answer stands
                                         for it
Delete       rref_delete        INLINE   user → owner: the user RRef     ``Ok(freed)``: the
                                         was garbage-collected (once     sender forgets the
                                         confirmed), or at shutdown;     forks
                                         ``more``: others to the same
                                         owner, deleted in one burst
===========  =================  =======  ==============================  ========================

ForkRequest, ChildAccept and Delete are made by the protocol state
(:mod:`.state`) and retried until answered or given up (:mod:`.context`):
each is idempotent. Remote, Fetch and CancelFetch are made by RRef objects and the
agent glue, and never retried. An RRef itself travels inside other
messages, pickled as its ids (:mod:`.rref`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..agent.messages import fast_pickle

if TYPE_CHECKING:  # the ids are defined with the protocol state, which builds these
    from .state import ForkId, RRefId


# -- made by RRef objects and the agent glue (never retried) ---------------------
@fast_pickle
@dataclass(frozen=True, slots=True)
class Remote:
    """Run ``fn(*args, **kwargs)`` on the owner and store the value under ``rref_id``."""

    op = "remote"
    fn: Any
    args: tuple
    kwargs: dict
    rref_id: RRefId
    fork_id: ForkId | None  # None when the caller is the owner itself
    site: str


@fast_pickle
@dataclass(frozen=True, slots=True)
class Fetch:
    """The owner's value of ``rref_id``, as the answer (``to_here()``)."""

    op = "rref_fetch"
    rref_id: RRefId
    # The caller's fork is not confirmed yet: the owner may see this before the
    # message creating the value, and then waits (at most ``timeout`` s) for it.
    may_overtake: bool = False
    timeout: float = 0.0


@fast_pickle
@dataclass(frozen=True, slots=True)
class CancelFetch:
    """The creator learnt its Remote failed: fail what waits for the value."""

    op = "rref_cancel_fetch"
    rref_id: RRefId
    reason: str


# -- made by the protocol state (retried; the reply is the ack) ------------------
@fast_pickle
@dataclass(frozen=True, slots=True)
class ForkRequest:
    """Receiver of a user→user fork asks the owner to register it."""

    op = "rref_fork"
    rref_id: RRefId
    fork_id: ForkId


@fast_pickle
@dataclass(frozen=True, slots=True)
class ChildAccept:
    """To the parent: the child fork is known to the owner; stop holding it."""

    op = "rref_child_accept"
    rref_id: RRefId
    fork_id: ForkId


@fast_pickle
@dataclass(frozen=True, slots=True)
class Delete:
    """A user dropped its fork (G1), and the forks in ``more`` (``(rref_id,
    fork_id)`` pairs) dropped about then, of values of the same owner: one
    message for a burst of deletions (:func:`.state.batch_deletes`)."""

    op = "rref_delete"
    rref_id: RRefId
    fork_id: ForkId
    more: tuple = ()

    def forks(self) -> tuple:
        """Every ``(rref_id, fork_id)`` this message deletes, first one first."""
        return ((self.rref_id, self.fork_id), *self.more)
