"""Distributed autograd's messages: every one the layer sends, as a typed value.

Each but :class:`Back` is a request (:mod:`nbrpc.agent.messages`): kind
REQUEST runs its handler on the receiver's worker pool, INLINE on its I/O
thread (it never blocks). The answer is the handler's return value in an
``Ok``, or an ``Err`` if it raised. A pass is named by ``pass_id``
(initiator's rank, counter); its normal-mode termination is by credit (1 in
all, see :mod:`.backward`).

==========  ================  =======  ===============================  =========================
message     op                kind     sent by → to, when               answered by
==========  ================  =======  ===============================  =========================
Grads       autograd_grads    REQUEST  normal mode: a stage's worker →  normal mode: a
                                       the worker of send function      :class:`Back` for the
                                       ``msg_id``, where they enter     sender, or None; step
                                       its graph (unless they go back   mode: the stage's record
                                       in an answer, as a Back); step   and what it would send,
                                       mode (``step``): the stepper's   ``[(rank, msg_id,
                                       worker → the stage's worker      grads)]``
                                       (``origin``: whose stage
                                       produced them)
Flush       autograd_flush    REQUEST  the initiator → a worker left    as Grads (step mode: None
                                       with blocked nodes, once the     if nothing is blocked
                                       credit is back (step mode: the   there)
                                       stepper, once nothing else is
                                       pending)
Credit      autograd_credit   INLINE   a worker → the initiator: a      ``Ok(None)`` (unread)
                                       part of the pass is over (its
                                       stage sent nothing, or left
                                       nodes blocked) and no answer
                                       carries it; ``error``: the part
                                       failed
Back        (an answer)       —        the answer to a normal-mode      —
                                       Grads or Flush: gradients for
                                       the sender's sends, each with
                                       its credit; and the part of the
                                       pass returned, when the sender
                                       began it
Abort       autograd_abort    REQUEST  a worker whose pass failed →     None (unread)
                                       the context's workers it knows;
                                       they tell theirs (``told``:
                                       told already)
GraphQuery  autograd_graph    REQUEST  the stepper's worker → each      that worker's part of the
                                       worker of the context, breadth   graph, as plain data
                                       first
Release     autograd_release  REQUEST  a worker leaving the context     None; if that worker is
                                       (or told to) → the workers it    gone, the sender tells
                                       knows; all of them if one of     every member
                                       those is gone (``told``: told
                                       already)
==========  ================  =======  ===============================  =========================
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from ..agent.messages import Err


# -- the backward pass -------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Grads:
    """Gradients for send function ``msg_id`` of context ``ctx_id``, pass ``pass_id``."""

    op = "autograd_grads"
    ctx_id: int
    pass_id: tuple[int, int]
    msg_id: int
    grads: list
    retain_graph: bool
    credit: Fraction = Fraction(0)  # normal mode: this part's share of the pass
    step: bool = False  # step mode: run the stage, return what it would send
    origin: int | None = None  # step mode: the worker whose stage produced them


@dataclass(frozen=True, slots=True)
class Flush:
    op = "autograd_flush"
    ctx_id: int
    pass_id: tuple[int, int]
    retain_graph: bool
    credit: Fraction = Fraction(0)
    step: bool = False


@dataclass(frozen=True, slots=True)
class Credit:
    """To the initiator: a part of the pass is over (``error``: it failed)."""

    op = "autograd_credit"
    ctx_id: int
    pass_id: tuple[int, int]
    credit: Fraction
    blocked: bool
    error: Err | None = None


@dataclass(frozen=True, slots=True)
class Back:
    """The answer to a normal-mode ``Grads`` or ``Flush``: what its stage has for
    the sender. ``grads``: (send id, gradients, credit share) per send of the
    sender's; ``credit`` and ``blocked``: the part of the pass returned, when the
    sender is the initiator (otherwise that goes as :class:`Credit`)."""

    grads: tuple[tuple[int, list, Fraction], ...] = ()
    credit: Fraction = Fraction(0)
    blocked: bool = False


@dataclass(frozen=True, slots=True)
class Abort:
    op = "autograd_abort"
    ctx_id: int
    pass_id: tuple[int, int]
    reason: str
    told: frozenset[int]


# -- the step mode's view of the graph -------------------------------------------------
@dataclass(frozen=True, slots=True)
class GraphQuery:
    op = "autograd_graph"
    ctx_id: int


# -- contexts ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Release:
    """Forget context ``ctx_id``; ``told``: ranks that were told already."""

    op = "autograd_release"
    ctx_id: int
    told: frozenset[int]
