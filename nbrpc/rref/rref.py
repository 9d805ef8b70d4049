"""RRef: a reference to a value that lives on one worker (its owner).

::

    user A (caller)                       owner B
      remote(B, f) ── Remote(id, fork) ─▶ runs f, stores the value under id
      ◀──────────── ok (confirmed) ────────
      rref.to_here() ── Fetch(id) ──────▶ waits for the value
      ◀──────────── ok(value) ─────────────
      rpc(C, g, (rref,))  ── forks ─▶ C ── ForkRequest ─▶ B;  C ── ChildAccept ─▶ A
      rpc(B, g, (rref,))  ── home ──▶ B; the answer to the call accepts the child
      (an RRef in a request: its answer stands for the ChildAccept, see .state)
      del rref (GC)   ── Delete(id, fork) ─▶ drops the fork; the value is freed
                                             when no fork and no owner RRef remain

Sending an RRef inside arguments or results forks it (see :mod:`.state` for
the four cases of PyTorch's design note; :mod:`.messages` for the messages). A user's deletion only queues work
for the I/O thread; ``__del__`` does no I/O. The bookkeeping is
:class:`~nbrpc.rref.state.RRefState`; :class:`~nbrpc.rref.context.RRefContext`
moves it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import torch

from ..agent import (
    Agent,
    WorkerInfo,
    check_future,
    current_agent,
    detach,
    is_async,
    mark_async,
    on_done,
    outcome,
    register_extension,
    wait_result,
)
from ..agent.agent import MessageContext, check_timeout
from ..agent.wire import named_by
from ..errors import NbrpcError, WorkerGoneError
from ..ipython import creation_site
from ..serialize import current_context, register_reducer
from .context import RRefContext, _settle
from .messages import CancelFetch, ChildAccept, Delete, Fetch, ForkRequest, Remote
from .state import CONFIRMED, PENDING, ForkId, RRefId

T = TypeVar("T")


def _install(agent: Agent) -> None:
    ctx = RRefContext(agent)
    agent.ext["rref"] = ctx
    agent.handlers[Remote.op] = ctx.handle_remote
    agent.handlers[Fetch.op] = ctx.handle_fetch
    agent.handlers[CancelFetch.op] = ctx.handle_cancel_fetch
    agent.handlers[ForkRequest.op] = ctx.handle_fork
    agent.handlers[ChildAccept.op] = ctx.handle_child_accept
    agent.handlers[Delete.op] = ctx.handle_delete
    agent.gone_hooks.append(ctx.on_member_gone)
    agent.busy_checks.append(ctx.busy)
    agent.shutdown_hooks.append(ctx.on_shutdown)
    agent.snapshot_sections["rrefs"] = ctx.snapshot


register_extension(_install)


# -- the RRef object ---------------------------------------------------------------
class RRef(Generic[T]):
    """A remote reference (``torch.distributed.rpc.RRef``'s API).

    ``RRef(value)`` makes an owner RRef for a local value; ``remote()``
    returns user RRefs. Passing an RRef in RPC arguments or results shares
    it (a fork); the value is freed once every copy everywhere is gone.
    ``RRef[T]`` works in annotations.

    >>> from nbrpc.rpc import init_rpc, shutdown, remote, rpc_sync
    >>> from nbrpc.rpc.api import _free_port_options
    >>> init_rpc("doc", rank=0, world_size=1, rpc_backend_options=_free_port_options())
    >>> r = remote("doc", sum, args=([1, 2, 3],))
    >>> r.to_here(), r.owner_name(), r.is_owner()
    (6, 'doc', True)
    >>> def twice(ref: RRef[int]) -> int:
    ...     return 2 * ref.local_value()
    >>> rpc_sync("doc", twice, args=(r,))
    12
    >>> shutdown()
    """

    __slots__ = ("_agent", "_ctx", "_id", "_fork", "_owner", "_site", "_attrs", "_creation_id",
                 "__weakref__")

    def __init__(self, value: T, type_hint: Any = None) -> None:
        agent = current_agent("RRef(value)")
        ctx: RRefContext = agent.ext["rref"]
        entry = self._setup(agent, agent.rank, creation_site(), ctx.state.new_id())
        entry.value.set_result(value)
        ctx._event("created", self._id, None, agent.rank, "RRef(value)")

    @classmethod
    def _new(cls, agent: Agent, owner: int, site: str, rref_id: RRefId,
             fork: ForkId | None = None) -> RRef:
        self = object.__new__(cls)
        self._setup(agent, owner, site, rref_id, fork)
        return self

    def _setup(self, agent: Agent, owner: int, site: str, rref_id: RRefId,
               fork: ForkId | None = None) -> Any:
        ctx: RRefContext = agent.ext["rref"]
        self._agent, self._ctx, self._owner, self._site, self._id = agent, ctx, owner, site, rref_id
        self._attrs: set[str] = set()  # names the value is known to have (remote() proxy)
        self._creation_id: int | None = None  # remote()'s queued request, until to_here()
        ctx.live.add(self)
        if owner == agent.rank:
            self._fork = None
            entry = ctx.state.own(rref_id, site)
            weakref.finalize(self, ctx.released, "owner", rref_id)
            return entry
        self._fork = fork if fork is not None else ctx.state.new_user(rref_id, owner, site)
        weakref.finalize(self, ctx.released, "user", self._fork)
        return None

    def _state(self) -> str:
        if self.is_owner():
            return "owner"
        if self._owner not in self._agent.members:  # before the gone hook drops the fork
            return "owner-gone"
        user = self._ctx.state.users.get(self._fork)
        return "released" if user is None else user.state

    def _check_owner(self) -> None:
        """Fail at once, saying so, if the owner died or left."""
        agent = self._agent
        if self._owner not in agent.members and not self.is_owner():
            why = agent.gone_why(self._owner) or "is not in the group"
            raise WorkerGoneError(agent.peer_name(self._owner),
                                  f"{why}; it owned RRef {self._id}, whose value is lost")

    # -- identity --------------------------------------------------------------
    def owner(self) -> WorkerInfo:
        """The owner's ``WorkerInfo``."""
        return WorkerInfo(self._agent.peer_name(self._owner), self._owner)

    def owner_name(self) -> str:
        return self.owner().name

    def is_owner(self) -> bool:
        return self._owner == self._agent.rank

    def confirmed_by_owner(self) -> bool:
        """True once the owner knows of this copy (always, on the owner)."""
        return self.is_owner() or self._state() in (CONFIRMED, "deleting")

    # -- values ----------------------------------------------------------------
    def local_value(self) -> T:
        """The value itself; only on the owner."""
        if not self.is_owner():  # PyTorch's text first: code matches on it
            raise NbrpcError(
                f"For UserRRef(rref_id={self._id.as_torch()}, fork_id={self._fork.as_torch()}), "
                f"can't call localValue() on user {self._agent.info!r}. Call it on owner "
                f"{self.owner()!r}: local_value() works only on the owner of RRef {self._id}; "
                "here, call to_here() to copy the value instead.")
        return wait_result(self._ctx.entry(self._id).value)

    def to_here(self, timeout: float = -1.0) -> T:
        """The value, copied to this worker (waits for it to exist).

        ``timeout`` in seconds; the default is the agent's RPC timeout."""
        if self.is_owner():
            return self.local_value()
        self._check_owner()
        agent = self._agent
        timeout = check_timeout(timeout, agent.options.rpc_timeout)
        # Not yet confirmed: the owner's pool may run this Fetch before the
        # message that creates the value, so say so and let the owner wait.
        # If the creation failed, the owner hears it (CancelFetch) and fails
        # the Fetch at once. ``keep``: no Delete may overtake the Fetch.
        # The owner answers on its I/O thread (``inline``): its handler only
        # looks up the value's future, so a ready value costs no hand-off to a
        # worker thread there; it still carries the autograd context.
        # Right after remote() on this thread, its request may still be queued
        # (deferred): then it goes first on the same channel (``along``) and the
        # owner's channel thread creates the value and answers both, in order.
        pending = self._state() == PENDING
        along, self._creation_id = self._creation_id if pending else None, None
        return agent.request(self._owner, Fetch(self._id, pending, timeout), timeout,
                             keep=self, inline=True, tagged=True, sync=True,
                             along=along).wait()

    # -- proxies -----------------------------------------------------------------
    def rpc_sync(self, timeout: float = -1.0) -> Any:
        """``rref.rpc_sync().method(*args)`` runs ``method`` on the owner's value."""
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float = -1.0) -> Any:
        """``rref.rpc_async().method(*args)``: a future of the method's result."""
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float = -1.0) -> Any:
        """``rref.remote().method(*args)``: an RRef to the method's result, on the owner."""
        return _Proxy(self, "remote", timeout)

    def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run backward from this RRef's value (a scalar tensor), on its owner.

        With ``dist_autograd_ctx_id`` (from ``nbrpc.autograd.context()``), a
        distributed backward pass in that context starts on the owner; with -1,
        a local ``value.backward()`` runs there (gradients in ``.grad``)."""
        if dist_autograd_ctx_id == -1 and not self.is_owner():
            raise NbrpcError(
                "User RRefs require 'dist_autograd_ctx_id' to be specified: RRef "
                f"{self._id} is a user copy, and a local backward would run on its owner "
                f"{self.owner_name()!r}, away from this worker's graph. Call it inside "
                "`with nbrpc.autograd.context() as context_id:` as rref.backward(context_id).")
        if self.is_owner():
            _backward_on_owner(self._id, dist_autograd_ctx_id, retain_graph)
            return
        self._check_owner()
        # As a proxy's call: the request may overtake the one that creates the
        # value on the owner (its pool runs them in any order), so while this
        # copy is unconfirmed, the owner waits for the value, within the timeout.
        pending = self._state() == PENDING
        limit = self._agent.options.rpc_timeout
        args = (self._id, dist_autograd_ctx_id, retain_graph, pending, limit)
        self._agent.rpc_async(self._owner, _backward_on_owner, args, keep=self).wait()

    def __str__(self) -> str:
        """PyTorch's form: ``OwnerRRef(GloballyUniqueId(...))`` or
        ``UserRRef(RRefId = ..., ForkId = ...)`` (``repr`` says more)."""
        if self.is_owner():
            return f"OwnerRRef({self._id.as_torch()})"
        return f"UserRRef(RRefId = {self._id.as_torch()}, ForkId = {self._fork.as_torch()})"

    def __repr__(self) -> str:
        role = "owner" if self.is_owner() else f"user fork {self._fork}"
        return f"RRef(id={self._id}, owner={self.owner_name()!r}, {role}, {self._state()})"

    def __reduce__(self) -> tuple:
        return _reduce_rref(self)


# -- forking: how an RRef pickles ---------------------------------------------------
def _reduce_rref(rref: RRef) -> tuple:
    wire = current_context()
    if not isinstance(wire, MessageContext):  # PyTorch's text first: code matches on it
        raise NbrpcError(
            f"Can not pickle rref in python pickler, rref can only be pickled when using RPC: "
            f"{rref!r} can only be pickled inside an RPC (as an argument or a result of "
            "rpc_sync/rpc_async/remote), where the receiver registers its copy with the "
            "owner. To save the value, pickle rref.to_here() instead.")
    if wire.agent is not rref._agent:
        raise NbrpcError(
            f"{rref!r} belongs to agent {rref._agent.name!r} and cannot be sent by "
            f"{wire.agent.name!r}.")
    rref._check_owner()
    ctx, st, to, rid = rref._ctx, rref._ctx.state, wire.peer, rref._id
    fork: ForkId | None = None
    if rref.is_owner():
        if to != st.rank:  # owner → user: registered now, confirmed on arrival
            fork = st.fork_from_owner(rid, to)
    else:  # user → anyone: held as a pending child until accepted (G2)
        fork = st.fork_from_user(rid, to, rref)
    # a user's fork in a request: the answer to it accepts the child
    by_answer = fork is not None and not rref.is_owner() and wire.refs_ok
    if fork is not None:  # (the hooks must not hold the RRef: the call may be long)
        wire.on_unsent(lambda: ctx.undo_fork(rid, fork))
        if by_answer:
            wire.on_answered(lambda pending: ctx.accepted_by_answer(rid, fork, to, pending))
        ctx._event("forked", rref._id, fork, to, f"to {wire.agent.peer_name(to)}")
    return _rebuild_rref, (rref._id, rref._owner, fork, st.rank, rref.is_owner(), rref._site,
                           by_answer)


def _rebuild_rref(rref_id: RRefId, owner: int, fork: ForkId | None, parent: int,
                  from_owner: bool, site: str, by_answer: bool = False) -> RRef:
    wire = current_context()
    if not isinstance(wire, MessageContext):
        raise NbrpcError("an RRef can only be unpickled inside an RPC message")
    agent = wire.agent
    ctx: RRefContext = agent.ext["rref"]
    rref_id, fork = RRefId(*rref_id), None if fork is None else RRefId(*fork)
    if owner == agent.rank:  # it came home: an owner-side object; the parent may let go
        rref = RRef._new(agent, owner, site, rref_id)
        ctx.send(ctx.state.came_home(rref_id, fork, parent, by_answer))
        return rref
    rref = RRef._new(agent, owner, site, rref_id, fork)
    if not from_owner:  # as PyTorch: a request's function runs once the owner knows
        wire.run_after(ctx.await_fork(fork))  # of its user RRefs (confirmed_by_owner())
        if by_answer:  # the answer tells the parent, or says the fork is still pending
            wire.on_answering(lambda: ctx.state.unsettled_at_answer(fork))
    ctx.send(ctx.state.user_arrived(rref_id, owner, fork, parent, from_owner, site,
                                    by_answer))
    return rref


register_reducer(RRef, _reduce_rref)
# The ids in every protocol message: as (class, fields), which skips
# cloudpickle's Python-level checks of each object it is asked about (about
# 2 µs per id, three ids in a Remote's round trip).
register_reducer(RRefId, lambda i: (RRefId, (i.creator, i.local)))


class _Proxy:
    """``rref.rpc_sync()``: attribute access returns a callable for that method."""

    __slots__ = ("_rref", "_how", "_timeout")

    def __init__(self, rref: RRef, how: str, timeout: float) -> None:
        self._rref, self._how, self._timeout = rref, how, timeout

    def __getattr__(self, name: str) -> Any:
        rref, how, timeout = self._rref, self._how, self._timeout

        def invoke(*args: Any, **kwargs: Any) -> Any:
            agent = rref._agent
            rref._check_owner()
            limit = check_timeout(timeout, agent.options.rpc_timeout)
            pending = not rref.is_owner() and rref._state() == PENDING
            call_args = (rref._id, name, args, kwargs, pending, limit)
            if how == "remote":  # (keep: no Delete may overtake the call)
                # As PyTorch: a missing method raises here, not later in to_here().
                # It waits for the value, once per RRef and name.
                if name not in rref._attrs:
                    agent.rpc_async(rref._owner, _attribute_on_owner, call_args[:2] + call_args[4:],
                                    timeout=timeout, keep=rref).wait()
                    rref._attrs.add(name)
                return remote(agent, rref._owner, _call_method_on_owner, call_args, {},
                              timeout, keep=rref)
            if how == "rpc_sync":
                return agent.rpc_sync(rref._owner, _call_method_on_owner, call_args,
                                      timeout=timeout, keep=rref)
            return agent.rpc_async(rref._owner, _call_method_on_owner, call_args,
                                   timeout=timeout, keep=rref)

        invoke.__name__ = name
        return invoke


def _get_attribute(rref_id: RRefId, obj: Any, name: str) -> Any:
    """``getattr(obj, name)``; a missing attribute says which RRef and worker."""
    try:
        return getattr(obj, name)
    except AttributeError as e:  # Python's text first ("... has no attribute 'x'")
        raise AttributeError(
            f"{e} (the value of RRef {rref_id} on its owner {current_agent().name!r} is a "
            f"{type(obj).__qualname__}; check the method name)") from None


def _on_value(rref_id: RRefId, may_overtake: bool, timeout: float,
              body: Callable[[Any, torch.futures.Future], None]) -> torch.futures.Future:
    """Runs on the owner: ``body(value, out)`` once the RRef's value exists (on a
    pool thread if it had to wait, holding no thread meanwhile); ``body``
    completes ``out``. The value's error, or one ``body`` raises, fails ``out``."""
    agent = current_agent()
    out: torch.futures.Future = torch.futures.Future()

    def run(value_fut: torch.futures.Future) -> None:
        obj, error = outcome(value_fut)
        if error is not None:
            out.set_exception(error)
            return
        try:
            body(obj, out)
        except BaseException as e:
            out.set_exception(detach(e))

    value = agent.ext["rref"].value_future(rref_id, may_overtake, timeout)
    if value.done():
        run(value)
    else:
        value.add_done_callback(lambda f: agent.pool.submit(run, f))
    return out


# Traces name a method call on an RRef by the method, not by these helpers.
@named_by(lambda args: f"look up {args[1]} on RRef {args[0]}")
def _attribute_on_owner(rref_id: RRefId, name: str, may_overtake: bool = False,
                        timeout: float = 0.0) -> Any:
    """Runs on the owner: None once the value exists and has ``name``, else
    ``AttributeError``."""
    def check(obj: Any, out: torch.futures.Future) -> None:
        _get_attribute(rref_id, obj, name)
        out.set_result(None)

    return _on_value(rref_id, may_overtake, timeout, check)


mark_async(_attribute_on_owner)


@named_by(lambda args: f"{args[1]} on RRef {args[0]}")
def _call_method_on_owner(rref_id: RRefId, name: str, args: tuple, kwargs: dict,
                          may_overtake: bool = False, timeout: float = 0.0) -> Any:
    """Runs on the owner. Answers through a future: the value may not exist
    yet, and a method marked @async_execution defers the reply."""
    def call(obj: Any, out: torch.futures.Future) -> None:
        method = _get_attribute(rref_id, obj, name)
        result = method(*args, **kwargs)
        if is_async(method):
            on_done(check_future(method, result), lambda f: _settle(out, f))
        else:
            out.set_result(result)

    return _on_value(rref_id, may_overtake, timeout, call)


mark_async(_call_method_on_owner)


def _backward_on_owner(rref_id: RRefId, ctx_id: int, retain_graph: bool,
                       may_overtake: bool = False, timeout: float = 0.0) -> None:
    agent = current_agent()
    value = wait_result(agent.ext["rref"].value_future(rref_id, may_overtake, timeout))
    if not isinstance(value, torch.Tensor):  # PyTorch's text and type first
        raise NbrpcError(f"RRef should contain a tensor for .backward(): RRef {rref_id} on "
                         f"{agent.name!r} holds a {type(value).__name__}; call backward on "
                         "an RRef to a scalar tensor (the loss).")
    if ctx_id == -1:
        value.backward(retain_graph=retain_graph)
    else:  # the autograd layer (above this one) installs how to run it
        agent.ext["autograd_backward"](ctx_id, [value], retain_graph)


def remote(agent: Agent, to: Any, fn: Any, args: tuple, kwargs: dict, timeout: float,
           keep: Any = None) -> RRef:
    """Create the value ``fn(*args, **kwargs)`` on ``to``; returns an RRef at once.
    ``keep`` is held until the owner has answered."""
    owner = agent.resolve(to).rank
    ctx: RRefContext = agent.ext["rref"]
    rref = RRef._new(agent, owner, creation_site(), ctx.state.new_id())
    msg = Remote(fn, tuple(args), dict(kwargs), rref._id, rref._fork, rref._site)
    then = None if rref._fork is None else ctx.creation_hook(rref._id, rref._fork, owner)
    try:
        rref._creation_id = agent.request(owner, msg, timeout, keep=keep, then=then).msg_id
    except BaseException:
        if rref._fork is not None:  # never sent: nothing to delete on the owner
            ctx.send(ctx.state.on_failed(rref._fork))
        raise
    return rref
