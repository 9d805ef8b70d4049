"""The RRef layer inside one agent: handlers, sending with retries, snapshots.

:class:`RRefContext` joins the pure protocol state (:mod:`.state`) to the
agent. It

* handles the requests of :mod:`.messages`: ``remote`` (on the worker pool:
  it runs user code), ``rref_fetch`` (inline on the I/O thread: it only looks
  up the value's future, and the answer goes out when that completes, at once
  for a ready value) and the protocol messages ``rref_fork``,
  ``rref_child_accept`` and ``rref_delete`` (inline too: pure bookkeeping,
  never queued behind user code);
* sends what the state returns, retrying each message (they are idempotent)
  after ``control_retry`` s, doubling, until answered, the peer is gone, or
  ``MAX_ATTEMPTS``; user calls are never retried;
* turns garbage-collected RRefs into work for the I/O thread (a finalizer only
  appends to a deque and, if no run is due, asks the I/O thread for one, which
  writes one byte to its non-blocking wake-up pipe if it sleeps: no lock, no
  message, nothing that can block);
* sends the Deletes of a burst of deletions together: a deletion within
  ``DELETE_WINDOW`` s of the last Deletes sent waits for the end of that window,
  and then every Delete for one owner goes as one message
  (:func:`.state.batch_deletes`). An ``rref = remote(...); rref.to_here()``
  loop thus costs each owner one Delete and one answer per window, not per
  iteration; a lone ``del rref`` still goes at once;
* drops freed values on a pool thread, so a value's ``__del__`` never runs on
  the I/O thread;
* reports its tables as plain data, and leaks at shutdown.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from typing import Any

import torch

from ..agent import Agent, Deferred, check_future, detach, is_async, on_done, outcome
from ..errors import NbrpcError, RpcTimeoutError, ShutdownError, WorkerGoneError
from .messages import CancelFetch, ChildAccept, Delete, Fetch, ForkRequest, Remote
from .state import CONFIRMED, ForkId, Owned, RRefId, RRefState, batch_deletes

log = logging.getLogger(__name__)

MAX_ATTEMPTS = 8  # 1 + 2 + 4 + ... s with the default control_retry, capped per try
MAX_RETRY_INTERVAL = 30.0
# Seconds after sending Deletes during which further releases wait, to go
# together: at most one round of Deletes per window. A value lives at most this
# much longer; a graceful shutdown waits for it.
DELETE_WINDOW = 0.005


class RRefLeakWarning(ResourceWarning):
    """RRefs still alive at a graceful shutdown with ``leak_check=True``.

    ``.rrefs`` lists them as plain data (id, role, owner, creation site)."""

    def __init__(self, message: str, rrefs: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.rrefs = rrefs


class RRefContext:
    """The RRef state of one agent, and everything that moves it."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.state = RRefState(agent.rank)
        self.live: weakref.WeakSet = weakref.WeakSet()  # RRef objects made here
        self._releases: deque = deque()  # ("user", fork) | ("owner", rref_id)
        self._release_due = False  # a run of _process_releases is asked for or timed
        self._quiet_until = 0.0  # (monotonic) releases wait until then: see DELETE_WINDOW
        self.retries = 0
        # forks received in a request whose owner has not answered yet: the
        # request's function runs once they are settled (see await_fork)
        self._fork_waits: dict[ForkId, threading.Event] = {}
        self.gave_up = 0

    def live_objects(self) -> list:
        """The RRef objects alive here (a snapshot; other threads add to the set)."""
        for _ in range(10):
            try:
                return list(self.live)
            except RuntimeError:  # the set changed size during the copy: again
                continue
        return []

    # -- sending, with retries ------------------------------------------------------
    def send(self, outbox: list[tuple[int, Any]]) -> None:
        for rank, msg in batch_deletes(outbox):
            self._send(rank, msg, 0)

    def _send(self, rank: int, msg: Any, attempt: int) -> None:
        agent = self.agent
        if agent.state not in ("ready", "stopping") or rank not in agent.members:
            self._give_up(rank, msg, agent.gone_why(rank) or f"agent is {agent.state}")
            return
        timeout = min(agent.options.control_retry * 2 ** attempt, MAX_RETRY_INTERVAL)
        try:
            agent.request(rank, msg, timeout, inline=True,
                          then=lambda _v, e: self._answered(rank, msg, attempt, e))
        except Exception as e:
            self._give_up(rank, msg, f"{type(e).__name__}: {e}")
            return
        if type(msg) is Delete:
            for rref_id, fork in msg.forks():
                self._event("delete-sent", rref_id, fork, rank)

    def _answered(self, rank: int, msg: Any, attempt: int, error: BaseException | None) -> None:
        if isinstance(error, RpcTimeoutError):
            if attempt + 1 < MAX_ATTEMPTS:
                self.retries += 1
                log.info("retrying %s to rank %d (attempt %d)", type(msg).__name__, rank,
                         attempt + 2)
                self._send(rank, msg, attempt + 1)
            else:
                self._give_up(rank, msg, f"no answer after {MAX_ATTEMPTS} attempts")
            return
        if isinstance(error, (WorkerGoneError, ShutdownError)):
            self._give_up(rank, msg, str(error))
            return
        if error is not None:  # the receiver refused it: nothing to retry
            self._give_up(rank, msg, f"{type(error).__name__}: {error}")
            return
        t = type(msg)
        if t is ForkRequest:
            self._event("confirmed", msg.rref_id, msg.fork_id, rank)
            self.send(self.state.on_confirmed(msg.fork_id))
            self._fork_settled(msg.fork_id)
        elif t is Delete:
            for _rref_id, fork in msg.forks():
                self.state.on_delete_done(fork)

    def _give_up(self, rank: int, msg: Any, why: str) -> None:
        """A protocol message that cannot be delivered: settle our side of it."""
        self.gave_up += 1
        gone = rank not in self.agent.members
        (log.debug if gone else log.warning)(
            "%s for RRef %s to rank %d not delivered: %s", type(msg).__name__,
            msg.rref_id, rank, why)
        t = type(msg)
        if t is ForkRequest:
            self.send(self.state.on_failed(msg.fork_id))
            self._fork_settled(msg.fork_id)
        forks = msg.forks() if t is Delete else ((msg.rref_id, msg.fork_id),)
        for rref_id, fork in forks:
            if t is Delete:
                self.state.on_delete_done(fork)
            self._event("errored", rref_id, fork, rank, why)

    def await_fork(self, fork: ForkId) -> threading.Event:
        """An event set once the owner has answered the registration of
        ``fork`` (or it failed). Taken before the ForkRequest goes out."""
        ev = self._fork_waits[fork] = threading.Event()
        return ev

    def _fork_settled(self, fork: ForkId) -> None:
        ev = self._fork_waits.pop(fork, None)
        if ev is not None:
            ev.set()

    # -- creation --------------------------------------------------------------------
    def creation_hook(self, rref_id: RRefId, fork: ForkId, owner: int) -> Any:
        """What to run when the owner answers (or not) the Remote creating a user RRef."""

        def settle(_value: Any, e: BaseException | None) -> None:
            if e is not None:
                why = f"{type(e).__name__}: {e}"
                self._event("errored", rref_id, fork, owner, why)
                self.send(self.state.on_failed(fork))
                if owner in self.agent.members:  # forks of it fail too, promptly
                    try:
                        self.agent.request(owner, CancelFetch(rref_id, why))
                    except Exception as err:  # the owner went meanwhile: nothing waits
                        log.debug("CancelFetch for RRef %s not sent: %s", rref_id, err)
                return
            self._event("confirmed", rref_id, fork, owner)
            self.send(self.state.on_confirmed(fork))

        return settle

    # -- handlers (requests) ---------------------------------------------------------
    def handle_remote(self, msg: Remote, sender: int) -> None:
        if msg.fork_id is None:  # the caller is the owner: its RRef made the entry
            entry = self.state.owned.get(msg.rref_id)
        else:
            entry = self.state.on_remote(msg.rref_id, msg.fork_id, sender, msg.site)
        if entry is None:  # dropped already (or retried after its Delete): run, keep nothing
            msg.fn(*msg.args, **msg.kwargs)
            return None
        self._event("created", msg.rref_id, msg.fork_id, sender)
        try:
            value = msg.fn(*msg.args, **msg.kwargs)
            if is_async(msg.fn):  # the value is what the returned future yields
                on_done(check_future(msg.fn, value),
                    lambda f: _settle(entry.value, f))
                return None
        except BaseException as e:  # stored: to_here(), proxies and forks re-raise it
            self.agent.user_error(msg.op, sender, e)
            self._event("errored", msg.rref_id, msg.fork_id, sender, f"{type(e).__name__}: {e}")
            _set(entry.value, error=detach(e))
            return None
        _set(entry.value, value)
        return None

    def handle_fetch(self, msg: Fetch, sender: int) -> Deferred:
        return Deferred(self.value_future(msg.rref_id, msg.may_overtake, msg.timeout))

    def value_future(self, rref_id: RRefId, may_overtake: bool = False,
                     timeout: float = 0.0) -> torch.futures.Future:
        """A future of an owned value. ``may_overtake``: the request may have
        overtaken the message that creates the entry (the pool runs requests in
        any order), so wait for the entry, at most ``timeout`` s."""
        if not may_overtake or self.state.owned.get(rref_id) is not None:
            return self.entry(rref_id).value
        entry = self.state.await_entry(rref_id)
        if timeout > 0 and not entry.done():
            io = self.agent.io
            gone = NbrpcError(f"RRef {rref_id} was never created on {self.agent.name!r}")
            expiry = io.call_later(timeout, self.state.expire_waiter, rref_id, entry, gone)
            entry.add_done_callback(lambda _f: io.cancel(expiry))
        value: torch.futures.Future = torch.futures.Future()
        entry.add_done_callback(lambda f: _chain(f, value))
        return value

    def handle_cancel_fetch(self, msg: CancelFetch, sender: int) -> int:
        return self.state.creation_failed(msg.rref_id, NbrpcError(
            f"RRef {msg.rref_id} was never created on {self.agent.name!r}: {msg.reason}"))

    # -- handlers (protocol, inline on the I/O thread) ---------------------------------
    def handle_fork(self, msg: ForkRequest, sender: int) -> bool:
        self.state.on_fork_request(msg.rref_id, msg.fork_id, sender)
        self._event("forked", msg.rref_id, msg.fork_id, sender, "registered")
        return True

    def handle_child_accept(self, msg: ChildAccept, sender: int) -> bool:
        child = self.state.on_child_accept(msg.fork_id)
        if child is not None:
            self._event("child-accepted", msg.rref_id, msg.fork_id, sender)
        del child  # may free the parent RRef: its finalizer only queues work
        return True

    def accepted_by_answer(self, rref_id: RRefId, fork: ForkId, peer: int,
                           pending: tuple) -> None:
        """``peer`` answered the request that carried ``fork``: it holds an
        owner-side RRef for it (it is the owner), or its copy is confirmed,
        unless the answer lists ``fork`` as ``pending`` (its ChildAccept comes
        later). The parent lets go."""
        if fork in pending:
            return
        child = self.state.on_child_accept(fork)
        if child is not None:
            self._event("child-accepted", rref_id, fork, peer, f"{fork} by the answer")
        del child  # may free the parent RRef: its finalizer only queues work

    def handle_delete(self, msg: Delete, sender: int) -> int:
        """Drop the message's forks; the answer: how many values that freed."""
        n = 0
        for rref_id, fork in msg.forks():
            freed = self.state.on_delete(rref_id, fork)
            if freed is not None:
                self._free(freed)
                n += 1
        return n

    def _free(self, entry: Owned) -> None:
        self._event("deleted", entry.rref_id, None, self.agent.rank)
        if self.agent.state in ("ready", "stopping"):
            self.agent.pool.submit(_drop, entry)  # the value's __del__ runs there

    def undo_fork(self, rref_id: RRefId, fork: ForkId) -> None:
        """The message carrying ``fork`` was never sent."""
        freed = self.state.undo_fork(rref_id, fork)
        if freed is not None:
            self._free(freed)

    # -- entries ---------------------------------------------------------------------
    def entry(self, rref_id: RRefId) -> Owned:
        entry = self.state.owned.get(rref_id)
        if entry is None:
            raise NbrpcError(
                f"RRef {rref_id} is not owned by {self.agent.name!r} any more (all its "
                "references were deleted), or was never created there.")
        return entry

    # -- garbage collection of RRef objects --------------------------------------------
    def released(self, kind: str, key: RRefId) -> None:
        """Called from a finalizer: queue only (no lock, no I/O). The I/O
        thread is asked for a run unless one is due already: appending before
        reading ``_release_due`` (which a run clears before it drains the
        queue) means no release is left without a run to take it."""
        self._releases.append((kind, key))
        if not self._release_due and self.agent.state in ("ready", "stopping"):
            self._release_due = True
            self.agent.io.call_soon(self._releases_due)

    def _releases_due(self) -> None:
        """On the I/O thread: run now, or at the end of the Delete window."""
        wait = self._quiet_until - time.monotonic()
        if wait > 0:
            self.agent.io.call_later(wait, self._process_releases)
        else:
            self._process_releases()

    def _process_releases(self) -> None:
        """Turn the queued releases into protocol work, the Deletes batched per
        owner. Safe from any thread (the I/O thread's, usually; a snapshot's)."""
        self._release_due = False
        outbox = []
        for _ in range(len(self._releases)):
            try:
                kind, key = self._releases.popleft()
            except IndexError:  # another thread took the rest
                break
            if kind == "user":
                outbox += self.state.release_user(key)
            else:
                freed = self.state.release_owner_ref(key)
                if freed is not None:
                    self._free(freed)
        if outbox:
            self._quiet_until = time.monotonic() + DELETE_WINDOW
            self.send(outbox)

    def on_member_gone(self, rank: int) -> None:
        freed, children, orphans = self.state.peer_gone(rank)
        for entry in freed:
            self._free(entry)
        for c in children:
            self._event("errored", c.rref_id, c.fork_id, rank, "child's worker is gone")
        for u in orphans:
            self._event("errored", u.rref_id, u.fork_id, rank, "owner is gone")
        del children  # their RRef objects may go now

    def busy(self) -> int:
        return self.state.outstanding() + len(self._releases)

    # -- shutdown ---------------------------------------------------------------------
    def on_shutdown(self, leak_check: bool) -> None:
        """Between the two drains of a graceful shutdown: report what is still
        alive (``leak_check``), then delete every user RRef, as PyTorch does."""
        self._process_releases()  # (what is already released is no leak)
        if leak_check:
            leaks = self.leak_report()
            if leaks:
                lines = [f"  {r['role']} RRef {r['rref_id']} (owner {r['owner']}) created at "
                         f"{r['site']}" for r in leaks]
                text = (f"{len(leaks)} RRef(s) still alive on {self.agent.name!r} at "
                        "shutdown:\n" + "\n".join(lines) +
                        "\nDelete them (del rref) before shutdown; in a notebook, IPython's "
                        "Out history may hold them (see nbrpc.debug.why_alive).")
                log.warning("%s", text)
                warnings.warn(RRefLeakWarning(text, leaks), stacklevel=4)
        self.send(self.state.release_all_users())

    def leak_report(self) -> list[dict[str, Any]]:
        """RRefs alive here: user forks still held, owned values still referenced."""
        name = self.agent.peer_name
        out = []
        for u in list(self.state.users.values()):
            if not u.released:
                out.append({"role": "user", "rref_id": str(u.rref_id),
                            "fork_id": str(u.fork_id), "owner": name(u.owner), "site": u.site})
        for e in list(self.state.owned.values()):
            holders = sorted({name(h) for h in e.forks.values()})
            out.append({"role": "owner", "rref_id": str(e.rref_id), "owner": self.agent.name,
                        "site": e.site, "held_by": holders, "owner_refs": e.owner_refs})
        return out

    # -- inspection ---------------------------------------------------------------------
    def _event(self, what: str, rref_id: RRefId, fork: ForkId | None, peer: int,
               detail: str = "") -> None:
        self.agent.events.add(f"rref-{what}", str(rref_id), self.agent.peer_name(peer), 0, 0,
                              detail=detail or (str(fork) if fork else ""))

    def snapshot(self) -> dict[str, Any]:
        self._process_releases()  # RRefs collected already are deleting, not held
        now = time.time()
        name = self.agent.peer_name
        st = self.state
        children: dict[RRefId, list] = {}
        for c in list(st.children.values()):
            children.setdefault(c.rref_id, []).append(
                {"fork_id": str(c.fork_id), "to": name(c.to), "age": now - c.since})
        owned = []
        for e in list(st.owned.values()):
            state, typ, nbytes, device = _describe_value(e.value)
            owned.append({
                "rref_id": str(e.rref_id), "state": state, "type": typ, "nbytes": nbytes,
                "device": device,
                "forks": {str(f): name(h) for f, h in sorted(e.forks.items())},
                "owner_refs": e.owner_refs,
                "pending_children": children.get(e.rref_id, []),
                "site": e.site, "created": e.created, "age": now - e.created})
        users = [{"rref_id": str(u.rref_id), "fork_id": str(u.fork_id), "owner": name(u.owner),
                  "parent": None if u.parent is None else name(u.parent),
                  "state": u.state, "confirmed": u.state == CONFIRMED, "released": u.released,
                  "pending_children": children.get(u.rref_id, []),
                  "site": u.site, "created": u.created, "age": now - u.created}
                 for u in list(st.users.values())]
        return {"owned": owned, "users": users,
                "children": [c for cs in children.values() for c in cs],
                "counters": {"owned_deleted": st.deleted, "retries": self.retries,
                             "undelivered": self.gave_up, "outstanding": self.busy()}}


def _describe_value(fut: torch.futures.Future
                    ) -> tuple[str, str | None, int | None, str | None]:
    if not fut.done():
        return "pending", None, None, None
    v, exc = outcome(fut)
    if exc is not None:
        return "error", type(exc).__name__, None, None
    return "ready", f"{type(v).__module__}.{type(v).__qualname__}", nbytes_of(v), device_of(v)


def device_of(value: Any) -> str | None:
    """Where a value's memory is, when not (only) on the CPU: a tensor's device,
    or the first off-CPU device among a module's parameters and buffers; None
    for everything else.

    >>> device_of(torch.zeros(2)), device_of(torch.zeros(2, device="meta"))
    (None, 'meta')
    >>> device_of(torch.nn.Linear(2, 2).to("meta")), device_of([1])
    ('meta', None)
    """
    if isinstance(value, torch.Tensor):
        return None if value.device.type == "cpu" else str(value.device)
    if isinstance(value, torch.nn.Module):
        for t in (*value.parameters(), *value.buffers()):
            if t.device.type != "cpu":
                return str(t.device)
    return None


def nbytes_of(value: Any, _depth: int = 0) -> int:
    """Approximate size of a value: tensor bytes, modules' state, containers
    and objects' attributes summed (three levels deep), else ``sys.getsizeof``.

    >>> nbytes_of(torch.zeros(4, 4))
    64
    >>> nbytes_of({"w": torch.zeros(10), "b": torch.zeros(2)}) > 48
    True
    """
    if isinstance(value, torch.Tensor):
        return value.element_size() * value.nelement()
    if isinstance(value, torch.nn.Module):
        return sum(nbytes_of(t) for t in value.state_dict().values())
    size = sys.getsizeof(value, 0)
    if _depth < 3:
        if isinstance(value, dict):
            size += sum(nbytes_of(v, _depth + 1) for v in list(value.values())[:10_000])
        elif isinstance(value, (list, tuple, set, frozenset)):
            size += sum(nbytes_of(v, _depth + 1) for v in list(value)[:10_000])
        elif isinstance(getattr(value, "__dict__", None), dict) and not isinstance(value, type):
            size += nbytes_of(value.__dict__, _depth + 1)
    return size


def _drop(entry: Owned) -> None:
    """Runs on a pool thread; the entry (and its value) dies with the task."""


def _set(fut: torch.futures.Future, value: Any = None, error: BaseException | None = None) -> None:
    """Complete ``fut`` unless something (a cancelled creation) already did."""
    if fut.done():
        return
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)
    except RuntimeError:  # lost a race with another completion
        pass


def _chain(entry_fut: torch.futures.Future, out: torch.futures.Future) -> None:
    """When the entry exists, complete ``out`` with its value (or error)."""
    entry, error = outcome(entry_fut)
    if error is not None:
        _set(out, error=error)
        return
    entry.value.add_done_callback(lambda v: _settle(out, v))


def _settle(target: torch.futures.Future, source: torch.futures.Future) -> None:
    value, error = outcome(source)
    _set(target, value, error)
