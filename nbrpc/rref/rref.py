"""RRef: a reference to a value that lives on one worker (its owner).

::

    user (caller)                         owner
      remote(owner, f) ── Remote(id, fork) ─▶ runs f, stores value under id
      ◀──────────────── Ok (confirmed) ──────
      rref.to_here()  ─── Fetch(id) ────────▶ waits for the value
      ◀──────────────── Ok(value) ───────────
      del rref (GC)   ─── Delete(id, fork) ─▶ drops the fork; value freed
                                              when no fork and no owner RRef

A user's deletion only queues a message for the I/O thread; ``__del__`` does
no I/O. Sending an RRef inside RPC arguments or results (forking) is not
supported yet: it needs the rest of the fork protocol (pending children,
confirmations), and raises a clear error until then.
"""

from __future__ import annotations

import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

import torch

from ..agent import (
    Agent,
    Deferred,
    RpcFuture,
    WorkerInfo,
    check_future,
    current_agent,
    is_async,
    mark_async,
    register_extension,
)
from ..agent.messages import fast_pickle
from ..errors import NbrpcError
from ..serialize import register_reducer
from .state import ForkId, OwnerTable, RRefId

T = TypeVar("T")


# -- messages ---------------------------------------------------------------
@fast_pickle
@dataclass(frozen=True, slots=True)
class Remote:
    op: ClassVar[str] = "remote"
    fn: Any
    args: tuple
    kwargs: dict
    rref_id: RRefId
    fork_id: ForkId | None  # None when the caller is the owner itself
    site: str


@fast_pickle
@dataclass(frozen=True, slots=True)
class Fetch:
    op: ClassVar[str] = "rref_fetch"
    rref_id: RRefId
    # Sent by the creator before its Remote was acknowledged: the owner may
    # see it first, and then waits (at most ``timeout`` s) for the entry.
    may_overtake: bool = False
    timeout: float = 0.0


@fast_pickle
@dataclass(frozen=True, slots=True)
class CancelFetch:
    """The creator learnt its Remote failed: drop Fetches waiting for the entry."""

    op: ClassVar[str] = "rref_cancel_fetch"
    rref_id: RRefId
    reason: str


@fast_pickle
@dataclass(frozen=True, slots=True)
class Delete:
    op: ClassVar[str] = "rref_delete"
    rref_id: RRefId
    fork_id: ForkId


# -- per-agent RRef context -----------------------------------------------------
class RRefContext:
    """The RRef state of one agent: its owner table and its user forks."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.owned = OwnerTable(agent.rank)
        self.users: dict[ForkId, weakref.ref] = {}

    def handle_remote(self, msg: Remote, sender: int) -> None:
        if msg.fork_id is None:  # the caller is the owner: its RRef made the entry
            entry = self.owned.get(msg.rref_id)
            if entry is None:  # ... and is gone already: run, but keep nothing
                msg.fn(*msg.args, **msg.kwargs)
                return None
        else:
            entry = self.owned.create(msg.rref_id, msg.site, fork=msg.fork_id)
        try:
            value = msg.fn(*msg.args, **msg.kwargs)
            if is_async(msg.fn):  # the value is what the returned future yields
                check_future(msg.fn, value).add_done_callback(
                    lambda f: _settle(entry.value, f))
                return None
        except BaseException as e:  # stored: to_here() and proxies re-raise it
            entry.value.set_exception(e)
            return None
        entry.value.set_result(value)
        return None

    def handle_fetch(self, msg: Fetch, sender: int) -> Deferred:
        return Deferred(self.value_future(msg.rref_id, msg.may_overtake, msg.timeout))

    def value_future(self, rref_id: RRefId, may_overtake: bool = False,
                     timeout: float = 0.0) -> torch.futures.Future:
        """A future of an owned value. ``may_overtake``: the request may have
        overtaken the Remote that creates the entry (the pool runs requests in
        any order), so wait for the entry, at most ``timeout`` s."""
        if not may_overtake or self.owned.get(rref_id) is not None:
            return self._entry(rref_id).value
        entry = self.owned.await_entry(rref_id)
        if timeout > 0 and not entry.done():
            io = self.agent.io
            gone = NbrpcError(f"RRef {rref_id} was never created on {self.agent.name!r}")
            expiry = io.call_later(timeout, self.owned.expire_waiter, rref_id, entry, gone)
            entry.add_done_callback(lambda _f: io.cancel(expiry))
        value: torch.futures.Future = torch.futures.Future()
        entry.add_done_callback(lambda f: _chain(f, value))
        return value

    def handle_cancel_fetch(self, msg: CancelFetch, sender: int) -> int:
        return self.owned.expire_waiters(msg.rref_id, NbrpcError(
            f"RRef {msg.rref_id} was never created on {self.agent.name!r}: {msg.reason}"))

    def handle_delete(self, msg: Delete, sender: int) -> bool:
        return self.owned.remove_fork(msg.rref_id, msg.fork_id)

    def _entry(self, rref_id: RRefId):
        entry = self.owned.get(rref_id)
        if entry is None:
            raise NbrpcError(
                f"RRef {rref_id} is not owned by {self.agent.name!r} any more (all its "
                "references were deleted), or was never created there.")
        return entry

    def local_value(self, rref_id: RRefId) -> Any:
        return self._entry(rref_id).value.wait()

    def snapshot(self) -> dict[str, Any]:
        users = []
        for fork, ref in list(self.users.items()):
            r = ref()
            if r is not None:
                users.append({"rref_id": str(r._id), "fork_id": str(fork),
                              "owner": self.agent._peer_name(r._owner),
                              "confirmed": r.confirmed_by_owner(), "site": r._site})
        return {"owned": self.owned.snapshot(), "users": users,
                "owned_deleted": self.owned.deleted}


def _install(agent: Agent) -> None:
    ctx = RRefContext(agent)
    agent.ext["rref"] = ctx
    agent.handlers[Remote.op] = ctx.handle_remote
    agent.handlers[Fetch.op] = ctx.handle_fetch
    agent.handlers[Delete.op] = ctx.handle_delete
    agent.handlers[CancelFetch.op] = ctx.handle_cancel_fetch
    agent.snapshot_sections["rrefs"] = ctx.snapshot


register_extension(_install)


def _creation_site() -> str:
    """``file:line`` of the user code that created an RRef (notebook cells included)."""
    f = sys._getframe(1)
    while f is not None and f.f_globals.get("__name__", "").partition(".")[0] == "nbrpc":
        f = f.f_back
    return f"{f.f_code.co_filename}:{f.f_lineno}" if f is not None else "?"


# -- the RRef object ---------------------------------------------------------------
class RRef(Generic[T]):
    """A remote reference (``torch.distributed.rpc.RRef``'s API).

    ``RRef(value)`` makes an owner RRef for a local value; ``remote()``
    returns user RRefs.

    >>> from nbrpc.rpc import init_rpc, shutdown, remote
    >>> from nbrpc.rpc.api import _free_port_options
    >>> init_rpc("doc", rank=0, world_size=1, rpc_backend_options=_free_port_options())
    >>> r = remote("doc", sum, args=([1, 2, 3],))
    >>> r.to_here(), r.owner_name(), r.is_owner()
    (6, 'doc', True)
    >>> shutdown()
    """

    __slots__ = ("_agent", "_id", "_fork", "_owner", "_site", "_holder", "__weakref__")

    def __init__(self, value: T, type_hint: Any = None) -> None:
        agent = current_agent("RRef(value)")
        self._setup(agent, agent.rank, _creation_site())
        agent.ext["rref"].owned.get(self._id).value.set_result(value)

    @classmethod
    def _new(cls, agent: Agent, owner: int, site: str) -> RRef:
        self = object.__new__(cls)
        self._setup(agent, owner, site)
        return self

    def _setup(self, agent: Agent, owner: int, site: str) -> None:
        ctx: RRefContext = agent.ext["rref"]
        self._agent, self._owner, self._site = agent, owner, site
        self._id = ctx.owned.new_id()
        # [the future of the Remote that creates the value]: a list, so the user
        # finalizer can read it without keeping the RRef alive (a Delete must
        # not overtake the creation)
        self._holder: list = [None]
        if owner == agent.rank:
            self._fork = None
            ctx.owned.create(self._id, site, owner_ref=True)
            weakref.finalize(self, ctx.owned.release_owner_ref, self._id)
        else:
            self._fork = ctx.owned.new_id()
            ctx.users[self._fork] = weakref.ref(self)
            weakref.finalize(self, _release_user, agent, owner, self._id, self._fork,
                             self._holder)

    @property
    def _creation(self) -> Any:
        return self._holder[0]

    def _creation_failed(self) -> bool:
        creation = self._holder[0]
        if creation is None or not creation.done():
            return False
        try:
            creation.value()
            return False
        except Exception:
            return True

    # -- identity --------------------------------------------------------------
    def owner(self) -> WorkerInfo:
        m = self._agent._members.get(self._owner)
        return WorkerInfo(m.name if m else f"rank{self._owner}", self._owner)

    def owner_name(self) -> str:
        return self.owner().name

    def is_owner(self) -> bool:
        return self._owner == self._agent.rank

    def confirmed_by_owner(self) -> bool:
        if self.is_owner():
            return True
        return self._creation is not None and self._creation.done() and not self._creation_failed()

    # -- values ----------------------------------------------------------------
    def local_value(self) -> T:
        if not self.is_owner():
            raise NbrpcError(
                f"local_value() works only on the owner ({self.owner_name()!r}); this RRef "
                f"is a user copy on {self._agent.name!r}. Call to_here() instead.")
        return self._agent.ext["rref"].local_value(self._id)

    def to_here(self, timeout: float = -1.0) -> T:
        """The value, copied to this worker (waits for it to exist)."""
        if self.is_owner():
            return self.local_value()
        agent = self._agent
        if timeout is None or timeout < 0:
            timeout = agent.options.rpc_timeout
        pending = self._creation is not None and not self._creation.done()
        # Not yet acknowledged: the owner's pool may run this Fetch before the
        # Remote that creates the value, so say so and let the owner wait.
        fut = agent.request(self._owner, Fetch(self._id, pending, timeout), timeout)
        if self._creation is None:
            return fut.wait()
        return _value_or_creation_error(agent, fut, self._creation, self._owner,
                                        self._id).wait()

    # -- proxies -----------------------------------------------------------------
    def rpc_sync(self, timeout: float = -1.0) -> Any:
        """``rref.rpc_sync().method(*args)`` runs ``method`` on the owner's value."""
        return _Proxy(self, "rpc_sync", timeout)

    def rpc_async(self, timeout: float = -1.0) -> Any:
        return _Proxy(self, "rpc_async", timeout)

    def remote(self, timeout: float = -1.0) -> Any:
        return _Proxy(self, "remote", timeout)

    def __repr__(self) -> str:
        role = "owner" if self.is_owner() else f"user fork {self._fork}"
        state = "confirmed" if self.confirmed_by_owner() else (
            "failed" if self._creation_failed() else "pending")
        return f"RRef(id={self._id}, owner={self.owner_name()!r}, {role}, {state})"


def _release_user(agent: Agent, owner: int, rref_id: RRefId, fork: ForkId,
                  holder: list) -> None:
    """Finalizer of a user RRef: only queues work for the I/O thread."""
    agent.ext["rref"].users.pop(fork, None)
    if agent.state in ("ready", "stopping"):
        agent.io.call_soon(_send_delete, agent, owner, rref_id, fork, holder[0])


def _send_delete(agent: Agent, owner: int, rref_id: RRefId, fork: ForkId,
                 creation: Any) -> None:
    if agent.state not in ("ready", "stopping") or owner not in agent._members:
        return
    if creation is not None and not creation.done():  # wait for the owner's ack first
        creation.add_done_callback(
            lambda _f: agent.io.call_soon(_send_delete, agent, owner, rref_id, fork, None))
        return
    agent.request(owner, Delete(rref_id, fork))


def _refuse_pickle(rref: RRef) -> tuple:
    raise NbrpcError(
        f"{rref!r} cannot be sent in RPC arguments or results yet: sharing an RRef needs "
        "the fork protocol, which nbrpc does not implement yet. Pass the value "
        "(rref.to_here()), or call the owner through rref.rpc_sync()/rpc_async().")


register_reducer(RRef, _refuse_pickle)


class _Proxy:
    """``rref.rpc_sync()``: attribute access returns a callable for that method."""

    __slots__ = ("_rref", "_how", "_timeout")

    def __init__(self, rref: RRef, how: str, timeout: float) -> None:
        self._rref, self._how, self._timeout = rref, how, timeout

    def __getattr__(self, name: str) -> Any:
        rref, how, timeout = self._rref, self._how, self._timeout

        def invoke(*args: Any, **kwargs: Any) -> Any:
            agent = rref._agent
            limit = agent.options.rpc_timeout if timeout is None or timeout < 0 else timeout
            pending = rref._creation is not None and not rref._creation.done()
            call_args = (rref._id, name, args, kwargs, pending, limit)
            if how == "remote":
                return remote(agent, rref._owner, _call_method_on_owner, call_args, {}, timeout)
            fut = agent.rpc_async(rref._owner, _call_method_on_owner, call_args, timeout=timeout)
            if rref._creation is not None:
                fut = _value_or_creation_error(agent, fut, rref._creation, rref._owner, rref._id)
            return fut.wait() if how == "rpc_sync" else fut

        invoke.__name__ = name
        return invoke


def _call_method_on_owner(rref_id: RRefId, name: str, args: tuple, kwargs: dict,
                          may_overtake: bool = False, timeout: float = 0.0) -> Any:
    """Runs on the owner. Answers through a future: the value may not exist
    yet (then the method runs on a pool thread once it does, holding no thread
    meanwhile), and a method marked @async_execution defers the reply."""
    agent = current_agent()
    out: torch.futures.Future = torch.futures.Future()

    def run(value_fut: torch.futures.Future) -> None:
        try:
            method = getattr(value_fut.value(), name)
            result = method(*args, **kwargs)
            if is_async(method):
                check_future(method, result).add_done_callback(lambda f: _settle(out, f))
            else:
                out.set_result(result)
        except BaseException as e:
            out.set_exception(e)

    value = agent.ext["rref"].value_future(rref_id, may_overtake, timeout)
    if value.done():
        run(value)
    else:
        value.add_done_callback(lambda f: agent.pool.submit(run, f))
    return out


mark_async(_call_method_on_owner)


def _value_or_creation_error(agent: Agent, fetch: Any, creation: Any, owner: int,
                             rref_id: RRefId) -> Any:
    """A future of the fetched value that fails at once if the Remote that
    creates it failed to arrive; the owner is then told to drop the Fetch it
    holds for that value (which would otherwise wait out its timeout)."""
    out = RpcFuture(agent._io_ident)
    claimed = threading.Lock()

    def finish(f: Any, from_fetch: bool) -> None:
        if not from_fetch:
            try:
                f.value()
                return  # created fine: the fetch decides
            except BaseException as e:
                if not fetch.done():
                    agent.request(owner, CancelFetch(rref_id, f"{type(e).__name__}: {e}"))
        if claimed.acquire(blocking=False):
            _settle(out, f)

    fetch.add_done_callback(lambda f: finish(f, True))
    creation.add_done_callback(lambda f: finish(f, False))
    return out


def _chain(entry_fut: torch.futures.Future, out: torch.futures.Future) -> None:
    """When the entry exists, complete ``out`` with its value (or error)."""
    try:
        entry = entry_fut.value()
    except BaseException as e:
        out.set_exception(e)
        return
    entry.value.add_done_callback(lambda v: _settle(out, v))


def _settle(target: torch.futures.Future, source: torch.futures.Future) -> None:
    try:
        target.set_result(source.value())
    except BaseException as e:
        target.set_exception(e)


def remote(agent: Agent, to: Any, fn: Any, args: tuple, kwargs: dict, timeout: float) -> RRef:
    """Create the value ``fn(*args, **kwargs)`` on ``to``; returns an RRef at once."""
    owner = agent.resolve(to).rank
    rref = RRef._new(agent, owner, _creation_site())
    msg = Remote(fn, tuple(args), dict(kwargs), rref._id, rref._fork, rref._site)
    rref._holder[0] = agent.request(owner, msg, timeout)
    return rref
