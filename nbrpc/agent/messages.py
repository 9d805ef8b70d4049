"""Every message an agent sends is one of these typed values.

The header's ``kind`` byte says how the receiver treats the payload:

=======  ==========  ==============================================================
kind     value       handled
=======  ==========  ==============================================================
REQUEST  1           unpickled and run on the worker pool; answered by a RESPONSE
                     with the same message id
RESPONSE 2           unpickled on the I/O thread; completes the caller's future
CONTROL  3           group membership and shutdown; handled on the I/O thread,
                     never blocks, never runs user code
=======  ==========  ==============================================================

A REQUEST payload is a dataclass with an ``op`` naming its handler; handlers
are registered per agent (the RRef and autograd layers add their own).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

REQUEST, RESPONSE, CONTROL = 1, 2, 3


@dataclass(frozen=True, slots=True)
class Call:
    """Run ``fn(*args, **kwargs)`` on the receiver and answer with its result."""

    op: ClassVar[str] = "call"
    fn: Callable
    args: tuple
    kwargs: dict
    ctx: Any = None  # propagated context (autograd context id, ...), opaque here


@dataclass(frozen=True, slots=True)
class Ok:
    value: Any


@dataclass(frozen=True, slots=True)
class Err:
    """A remote failure: the pickled exception (None if it did not pickle) and text."""

    worker: str
    type_name: str
    message: str
    traceback: str
    exc_pickle: bytes | None


# -- control: membership -------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Member:
    name: str
    rank: int
    address: str


@dataclass(frozen=True, slots=True)
class Join:
    member: Member
    world_size: int | None


@dataclass(frozen=True, slots=True)
class Members:
    """The coordinator's answer to Join: the whole table, or why it refused."""

    members: tuple[Member, ...]
    error: str | None = None


@dataclass(frozen=True, slots=True)
class MemberJoined:
    member: Member


@dataclass(frozen=True, slots=True)
class MemberLeft:
    rank: int


@dataclass(frozen=True, slots=True)
class Leave:
    rank: int


# -- control: graceful shutdown (termination detection) ------------------------
@dataclass(frozen=True, slots=True)
class DrainReport:
    """One worker's counters for round ``round`` of the shutdown check."""

    round: int
    active: int  # outgoing calls not yet answered
    sent: int  # requests sent since start
    served: int  # requests answered since start


@dataclass(frozen=True, slots=True)
class DrainVerdict:
    round: int
    done: bool
