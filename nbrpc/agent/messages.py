"""Every message an agent sends is one of these typed values.

The header's ``kind`` byte says how the receiver treats the payload:

=======  ==========  ==============================================================
kind     value       handled
=======  ==========  ==============================================================
REQUEST  1           unpickled and run on the worker pool; answered by a RESPONSE
                     with the same message id
RESPONSE 2           unpickled on the I/O thread; completes the caller's future
CONTROL  3           group membership, heartbeats, cut links and shutdown; handled
                     on the I/O thread, never blocks, never runs user code
INLINE   4           a REQUEST whose handler is protocol bookkeeping (RRef fork,
                     accept, delete): handled on the I/O thread, so it is never
                     queued behind user code, and answered like a REQUEST
=======  ==========  ==============================================================

A REQUEST payload is a dataclass with an ``op`` naming its handler; handlers
are registered per agent (the RRef and autograd layers add their own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar

REQUEST, RESPONSE, CONTROL, INLINE = 1, 2, 3, 4


def fast_pickle(cls: type) -> type:
    """Pickle a slots dataclass as ``(cls, field values)``.

    Python's default for slots dataclasses calls ``dataclasses.fields()`` on
    every pickle and unpickle, which shows up on the message path.
    """
    names = tuple(f.name for f in fields(cls))

    def __reduce__(self: Any) -> tuple:
        return cls, tuple(getattr(self, n) for n in names)

    cls.__reduce__ = __reduce__  # type: ignore[method-assign]
    return cls


@fast_pickle
@dataclass(frozen=True, slots=True)
class Call:
    """Run ``fn(*args, **kwargs)`` on the receiver and answer with its result."""

    op: ClassVar[str] = "call"
    fn: Callable
    args: tuple
    kwargs: dict
    ctx: Any = None  # propagated context (autograd context id, ...), opaque here


@fast_pickle
@dataclass(frozen=True, slots=True)
class Ok:
    value: Any
    pending: tuple = ()  # what the request carried that answering it did not settle


@fast_pickle
@dataclass(frozen=True, slots=True)
class Err:
    """A remote failure: the pickled exception (None if it did not pickle) and text."""

    worker: str
    type_name: str
    message: str
    traceback: str
    exc_pickle: bytes | None
    unread: bool = False  # the request itself could not be unpickled: nothing of it ran
    pending: tuple = ()  # as Ok's


# -- control: membership -------------------------------------------------------
@fast_pickle
@dataclass(frozen=True, slots=True)
class Member:
    name: str
    rank: int
    address: str
    local: str | None = None  # its Unix domain socket, for peers on its host
    devices: Any = None  # its devices.DeviceConfig (CUDA count, device maps), or None: none
    max_message: int | None = None  # the most bytes it accepts in one message; None: default
    incarnation: int = 0  # its transport's random identity: tells a restart from a replay


@fast_pickle
@dataclass(frozen=True, slots=True)
class Join:
    member: Member
    world_size: int | None


@fast_pickle
@dataclass(frozen=True, slots=True)
class JoinChallenge:
    """The coordinator's answer to a Join not signed for its run (a joiner's
    first, or one recorded in an earlier run and played back): its signed
    header carries the run, and the joiner sends its Join again, signed for
    that run, which the coordinator then takes. A recording never gets further:
    the challenge goes to the address the Join names, and names the
    incarnation that sent it."""

    to: int  # the incarnation of the joiner it answers


@fast_pickle
@dataclass(frozen=True, slots=True)
class Members:
    """The coordinator's answer to Join: the whole table, or why it refused."""

    members: tuple[Member, ...]
    error: str | None = None
    to: int = 0  # the incarnation of the member it answers (a recorded answer fits no other)


@fast_pickle
@dataclass(frozen=True, slots=True)
class MemberJoined:
    member: Member


@fast_pickle
@dataclass(frozen=True, slots=True)
class MemberLeft:
    rank: int
    dead: bool = False  # declared dead by the coordinator, not a leave
    why: str | None = None  # how it was found dead ("died (its connection closed)")


@fast_pickle
@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Member → coordinator and coordinator → members, every heartbeat interval.
    It names its sender, so that a member wrongly declared dead (or a
    coordinator its members gave up on) can be taken back when it is heard."""

    member: Member | None = None
    world_size: int | None = None


@fast_pickle
@dataclass(frozen=True, slots=True)
class LinkCut:
    """``reporter``'s connection to ``peer`` has been down since ``since``
    (the reporter's clock) for ``down_s`` seconds: sent to a third member (the
    coordinator, unless it is one of the two), which relays it to ``peer``,
    whose requests may still get through while the answers cannot come back
    (a firewall one way). ``mended``: the connection is back, sent by the
    reporter to ``peer`` itself, for the cut of the same ``since``."""

    reporter: int
    peer: int
    since: float
    down_s: float
    mended: bool = False


@fast_pickle
@dataclass(frozen=True, slots=True)
class Leave:
    rank: int


# -- control: graceful shutdown (termination detection) ------------------------
@fast_pickle
@dataclass(frozen=True, slots=True)
class DrainReport:
    """One worker's counters for round ``round`` of the shutdown check."""

    round: int
    active: int  # outgoing calls not yet answered, plus unfinished protocol work
    sent: dict[int, int]  # requests sent since start, per destination rank
    served: dict[int, int]  # requests answered since start, per caller rank


@fast_pickle
@dataclass(frozen=True, slots=True)
class DrainVerdict:
    round: int
    done: bool
