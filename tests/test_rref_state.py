"""The RRef protocol as plain state, with a simulated network: no sockets.

``Net`` plays the agents' part: it delivers the messages the states return
(in order, or held back / dropped / duplicated on request) and answers them
the way :mod:`nbrpc.rref.context` does. The four scenarios of PyTorch's
"Remote Reference Protocol" note, nested cases, retries and peer deaths.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import pytest

from nbrpc.errors import NbrpcError
from nbrpc.rref.messages import ChildAccept, Delete, ForkRequest
from nbrpc.rref.state import CONFIRMED, DELETING, FAILED, PENDING, RRefId, RRefState, batch_deletes


class Ref:
    """Stands for an RRef object on one worker: (worker, rref id, fork or None)."""

    def __init__(self, worker: int, rref_id: RRefId, owner: int, fork: Any = None) -> None:
        self.worker, self.rref_id, self.owner, self.fork = worker, rref_id, owner, fork


class Net:
    def __init__(self, n: int) -> None:
        self.s = {r: RRefState(r) for r in range(n)}
        self.wire: deque = deque()  # (src, dst, msg) in flight
        self.held: list = []  # messages a test holds back (delayed)
        self.freed: list[RRefId] = []
        self.dropped: list[Ref] = []  # let go by the program, maybe still held by a child

    # what the agents' sends and handlers do
    def post(self, src: int, out: list) -> None:
        for dst, msg in batch_deletes(out):  # (as the agent sends them)
            self.wire.append((src, dst, msg))

    def deliver_one(self) -> None:
        src, dst, msg = self.wire.popleft()
        st = self.s[dst]
        if type(msg) is ForkRequest:
            st.on_fork_request(msg.rref_id, msg.fork_id, src)
            self.post(src, self.s[src].on_confirmed(msg.fork_id))  # the reply
        elif type(msg) is ChildAccept:
            child = st.on_child_accept(msg.fork_id)
            if child is not None:
                self._collect(child.keepalive)
        elif type(msg) is Delete:
            for rref_id, fork in msg.forks():
                if (e := st.on_delete(rref_id, fork)) is not None:
                    self.freed.append(e.rref_id)
                self.s[src].on_delete_done(fork)
        else:
            raise AssertionError(msg)

    def settle(self, limit: int = 100) -> None:
        for _ in range(limit):
            if not self.wire:
                return
            self.deliver_one()
        raise AssertionError("messages kept flowing")

    # the RRef operations
    def create(self, creator: int, owner: int) -> Ref:
        """remote(owner, ...) from ``creator``, acknowledged."""
        rid = self.s[creator].new_id()
        if creator == owner:
            self.s[owner].own(rid, "site")
            return Ref(owner, rid, owner)
        fork = self.s[creator].new_user(rid, owner, "site")
        self.s[owner].on_remote(rid, fork, creator, "site")
        self.post(creator, self.s[creator].on_confirmed(fork))
        return Ref(creator, rid, owner, fork)

    def send(self, ref: Ref, to: int) -> Ref:
        """Pickle ``ref`` into a message for ``to`` and unpickle it there."""
        src = self.s[ref.worker]
        if ref.worker == ref.owner:
            fork = None if to == ref.owner else src.fork_from_owner(ref.rref_id, to)
        else:
            fork = src.fork_from_user(ref.rref_id, to, ref)
        dst = self.s[to]
        if to == ref.owner:
            dst.own(ref.rref_id, "site")
            self.post(to, dst.came_home(ref.rref_id, fork, ref.worker))
            return Ref(to, ref.rref_id, ref.owner)
        self.post(to, dst.user_arrived(ref.rref_id, ref.owner, fork, ref.worker,
                                       ref.worker == ref.owner, "site"))
        return Ref(to, ref.rref_id, ref.owner, fork)

    def drop(self, ref: Ref) -> None:
        """The program lets go of the RRef object; it is garbage-collected once
        no pending child holds it (as Python would)."""
        self.dropped.append(ref)
        self._collect(ref)

    def _collect(self, ref: Ref) -> None:
        st = self.s[ref.worker]
        if ref not in self.dropped or any(c.keepalive is ref for c in st.children.values()):
            return
        self.dropped.remove(ref)
        if ref.fork is None:
            if (e := st.release_owner_ref(ref.rref_id)) is not None:
                self.freed.append(e.rref_id)
        else:
            self.post(ref.worker, st.release_user(ref.fork))

    def owned(self, owner: int, rid: RRefId) -> bool:
        return rid in self.s[owner].owned

    def quiet(self) -> bool:
        return not self.wire and all(st.outstanding() == 0 for st in self.s.values())


OWNER, A, C = 0, 1, 2


def test_user_creates_and_owner_frees_on_delete() -> None:
    net = Net(3)
    r = net.create(A, OWNER)
    net.settle()
    assert net.s[A].users[r.fork].state == CONFIRMED
    assert net.s[OWNER].owned[r.rref_id].forks == {r.fork: A}
    net.drop(r)
    net.settle()
    assert net.freed == [r.rref_id] and not net.s[A].users and net.quiet()


def test_delete_of_an_unconfirmed_creation_waits_for_the_ack() -> None:
    net = Net(2)
    rid = net.s[A].new_id()
    fork = net.s[A].new_user(rid, OWNER, "site")
    assert net.s[A].release_user(fork) == []  # pending: nothing sent yet
    assert net.s[A].outstanding() == 1
    net.s[OWNER].on_remote(rid, fork, A, "site")
    out = net.s[A].on_confirmed(fork)
    assert out == [(OWNER, Delete(rid, fork))]
    net.post(A, out)
    net.settle()
    assert net.freed == [rid] and net.quiet()


def test_user_passes_to_owner() -> None:
    net = Net(3)
    r = net.create(A, OWNER)
    home = net.send(r, OWNER)  # an owner-side object now
    assert len(net.s[A].children) == 1
    net.drop(r)  # the parent lets go at once: G2 holds its fork until accepted
    assert not net.s[A].users[r.fork].released
    assert not any(type(m) is Delete for _, _, m in net.wire)
    net.settle()
    assert not net.s[A].children and not net.freed  # the owner-side object keeps it
    assert net.owned(OWNER, r.rref_id)
    net.drop(home)
    assert net.freed == [r.rref_id] and net.quiet()


def test_owner_passes_to_user() -> None:
    net = Net(3)
    r = net.create(OWNER, OWNER)
    u = net.send(r, A)
    assert net.s[A].users[u.fork].state == CONFIRMED and not net.wire  # no messages
    net.drop(r)
    assert not net.freed  # A's fork keeps it
    net.drop(u)
    net.settle()
    assert net.freed == [r.rref_id] and net.quiet()


def test_user_passes_to_user_and_parent_is_held_until_the_child_is_accepted() -> None:
    net = Net(3)
    r = net.create(A, OWNER)
    net.settle()
    c = net.send(r, C)
    assert net.s[C].users[c.fork].state == PENDING
    net.drop(r)  # A drops its copy immediately: it stays alive as a pending child
    assert not any(type(m) is Delete for _, _, m in net.wire)
    # ForkRequest reaches the owner, C confirms, tells A; only then A's Delete
    net.settle()
    assert net.s[C].users[c.fork].state == CONFIRMED and not net.s[A].children
    assert not net.freed and net.s[OWNER].owned[r.rref_id].forks == {c.fork: C}
    net.drop(c)
    net.settle()
    assert net.freed == [r.rref_id] and net.quiet()


def test_premature_delete_impossible_when_the_fork_request_is_slow() -> None:
    """A forks to C and lets go; C's ForkRequest is held back: the owner must
    keep the value (A's fork is still registered because A's child is pending)."""
    net = Net(3)
    r = net.create(A, OWNER)
    net.settle()
    c = net.send(r, C)
    held = net.wire.popleft()  # C's ForkRequest, delayed
    net.drop(r)
    net.settle()
    assert net.owned(OWNER, r.rref_id) and not net.freed  # no Delete went out
    net.wire.append(held)
    net.settle()
    net.drop(c)
    net.settle()
    assert net.freed == [r.rref_id] and net.quiet()


def test_fork_of_an_unacknowledged_creation_may_reach_the_owner_first() -> None:
    net = Net(3)
    rid = net.s[A].new_id()
    fork_a = net.s[A].new_user(rid, OWNER, "site")
    c = net.send(Ref(A, rid, OWNER, fork_a), C)
    net.settle()  # C's ForkRequest arrives before A's Remote: a placeholder entry
    entry = net.s[OWNER].owned[rid]
    assert not entry.value.done() and entry.forks == {c.fork: C}
    assert net.s[OWNER].on_remote(rid, fork_a, A, "real site") is entry
    assert entry.site == "real site" and entry.forks == {c.fork: C, fork_a: A}


def test_nested_fork_user_to_user_to_user_and_back_to_owner() -> None:
    net = Net(4)
    r = net.create(A, OWNER)
    net.settle()
    c = net.send(r, C)
    d = net.send(c, 3)  # C forwards before its own fork is confirmed
    home = net.send(d, OWNER)
    for ref in (r, c, d):
        net.drop(ref)
    net.settle()
    assert not net.freed and net.owned(OWNER, r.rref_id)
    net.drop(home)
    net.settle()
    assert net.freed == [r.rref_id] and net.quiet()


def test_rref_sent_to_itself() -> None:
    net = Net(2)
    r = net.create(A, OWNER)
    again = net.send(r, A)  # user → same user: registers like any fork
    net.drop(r)
    net.settle()
    assert not net.s[A].children and not net.freed
    net.drop(again)
    net.settle()
    assert net.freed == [r.rref_id] and net.quiet()


def test_duplicated_and_late_messages_are_idempotent() -> None:
    net = Net(3)
    r = net.create(A, OWNER)
    net.settle()
    c = net.send(r, C)
    fork_request = net.wire[0]
    net.settle()
    net.drop(r)
    net.settle()
    delete = (C, OWNER, Delete(r.rref_id, c.fork))
    net.drop(c)
    net.settle()
    assert net.freed == [r.rref_id]
    # a retried ForkRequest delayed past its Delete, a duplicate Delete, a stale accept
    net.wire.extend([fork_request, delete, (C, A, ChildAccept(r.rref_id, c.fork))])
    net.settle()
    assert not net.s[OWNER].owned and net.freed == [r.rref_id] and net.quiet()
    # a retried Remote after the creator's Delete does not resurrect the value
    assert net.s[OWNER].on_remote(r.rref_id, r.fork, A, "site") is None


def test_failed_creation_still_deletes_what_the_owner_may_have_stored() -> None:
    net = Net(2)
    rid = net.s[A].new_id()
    fork = net.s[A].new_user(rid, OWNER, "site")
    net.s[OWNER].on_remote(rid, fork, A, "site")  # stored, but the ack was lost
    assert net.s[A].on_failed(fork) == []
    assert net.s[A].users[fork].state == FAILED
    net.post(A, net.s[A].release_user(fork))
    net.settle()
    assert net.freed == [rid]


def test_dead_user_counts_as_its_deletions_and_dead_owner_orphans_forks() -> None:
    net = Net(3)
    r = net.create(A, OWNER)
    net.settle()
    c = net.send(r, C)
    net.settle()
    freed, children, orphans = net.s[OWNER].peer_gone(A)
    assert freed == [] and net.owned(OWNER, r.rref_id)  # C still holds it
    freed, _, _ = net.s[OWNER].peer_gone(C)
    assert [e.rref_id for e in freed] == [r.rref_id]
    # on C, the owner's death orphans its fork: no Delete will be sent
    _, _, orphans = net.s[C].peer_gone(OWNER)
    assert [u.fork_id for u in orphans] == [c.fork] and not net.s[C].users


def test_dead_receiver_releases_the_pending_child() -> None:
    net = Net(3)
    r = net.create(A, OWNER)
    net.settle()
    net.send(r, C)
    net.wire.clear()  # C died with the message
    assert net.s[A].outstanding() == 1
    _, children, _ = net.s[A].peer_gone(C)
    assert len(children) == 1 and children[0].keepalive is r and net.s[A].outstanding() == 0


def test_unsent_fork_is_undone() -> None:
    net = Net(2)
    r = net.create(OWNER, OWNER)
    fork = net.s[OWNER].fork_from_owner(r.rref_id, A)
    assert net.s[OWNER].owned[r.rref_id].forks == {fork: A}
    assert net.s[OWNER].undo_fork(r.rref_id, fork) is None  # the owner ref remains
    assert net.s[OWNER].owned[r.rref_id].forks == {}


def test_release_all_users_at_shutdown() -> None:
    net = Net(3)
    refs = [net.create(A, OWNER) for _ in range(3)]
    net.settle()
    out = net.s[A].release_all_users()
    assert sorted(type(m).__name__ for _, m in out) == ["Delete"] * 3
    assert all(u.state == DELETING for u in net.s[A].users.values())
    net.post(A, out)
    assert len(net.wire) == 1  # one Delete for the three, to their one owner
    net.settle()
    assert sorted(net.freed) == sorted(r.rref_id for r in refs) and net.quiet()


def test_batch_deletes_merges_per_owner_in_place_of_the_first() -> None:
    r1, r2, f = RRefId(0, 1), RRefId(2, 1), [RRefId(1, n) for n in range(5)]  # (fork ids)
    out = [(0, Delete(r1, f[0])), (2, Delete(r2, f[1])), (0, ChildAccept(r1, f[2])),
           (0, Delete(r1, f[3], ((r1, f[4]),)))]  # (an already merged one merges too)
    merged = batch_deletes(out)
    assert [(rank, type(m).__name__) for rank, m in merged] == [
        (0, "Delete"), (2, "Delete"), (0, "ChildAccept")]
    assert merged[0][1].forks() == ((r1, f[0]), (r1, f[3]), (r1, f[4]))
    assert merged[1][1] is out[1][1] and merged[2][1] is out[2][1]
    assert batch_deletes(out[:3]) == out[:3]  # one Delete per owner: as it was
    assert batch_deletes([]) == []


def test_a_merged_delete_is_idempotent_and_frees_each_value_once() -> None:
    net = Net(2)
    refs = [net.create(A, OWNER) for _ in range(4)]
    net.settle()
    out = [d for r in refs for d in net.s[A].release_user(r.fork)]
    (rank, msg), = batch_deletes(out)
    assert rank == OWNER and len(msg.forks()) == 4
    net.wire.extend([(A, OWNER, msg), (A, OWNER, msg)])  # retried: delivered twice
    net.settle()
    assert sorted(net.freed) == sorted(r.rref_id for r in refs) and net.quiet()


def test_fetch_that_overtakes_creation_waits_for_it() -> None:
    t = RRefState(1)
    rid = RRefId(0, 1)
    fut = t.await_entry(rid)
    assert not fut.done()
    entry = t.on_remote(rid, RRefId(0, 2), 0, "x:1")
    assert fut.done() and fut.value() is entry


def test_cancel_fails_waiting_fetches_later_fetches_and_placeholders() -> None:
    t = RRefState(1)
    waiting = t.await_entry(RRefId(0, 1))
    assert t.creation_failed(RRefId(0, 1), NbrpcError("gone")) == 1
    with pytest.raises(NbrpcError, match="gone"):
        waiting.wait()
    assert t.creation_failed(RRefId(0, 2), NbrpcError("gone too")) == 0
    with pytest.raises(NbrpcError, match="gone too"):
        t.await_entry(RRefId(0, 2)).wait()  # the cancel came first
    t.on_fork_request(RRefId(0, 3), RRefId(2, 1), 2)  # placeholder from a fork
    t.creation_failed(RRefId(0, 3), NbrpcError("never made"))
    with pytest.raises(NbrpcError, match="never made"):
        t.owned[RRefId(0, 3)].value.wait()
    t.creation_failed(RRefId(0, 4), NbrpcError("failed first"))  # then a fork arrives
    t.on_fork_request(RRefId(0, 4), RRefId(2, 2), 2)
    with pytest.raises(NbrpcError, match="failed first"):
        t.owned[RRefId(0, 4)].value.wait()


def test_expired_waiter_is_removed() -> None:
    t = RRefState(1)
    rid = RRefId(0, 3)
    fut = t.await_entry(rid)
    t.expire_waiter(rid, fut, NbrpcError("timeout"))
    with pytest.raises(NbrpcError):
        fut.wait()
    t.on_remote(rid, RRefId(0, 4), 0, "x:1")  # a late creation does not touch it again


def test_a_given_up_fork_request_releases_the_parent() -> None:
    net = Net(3)
    r = net.create(A, OWNER)
    net.settle()
    c = net.send(r, C)
    net.wire.clear()  # C's ForkRequest never got an answer, after every retry
    out = net.s[C].on_failed(c.fork)
    assert out == [(A, ChildAccept(r.rref_id, c.fork))]
    net.post(C, out)
    net.drop(r)
    net.settle()
    assert not net.s[A].children and net.freed == [r.rref_id]  # nothing leaks
    net.drop(c)
    net.settle()
    assert net.quiet()


def test_an_rref_sent_home_in_a_request_is_accepted_by_the_answer() -> None:
    """user → owner inside a request: no ChildAccept; the parent holds its copy
    until the answer (which proves the owner read the request) comes, so a
    Delete it sends meanwhile cannot free the value before the owner's copy
    exists (G2), whatever the order of the messages."""
    net = Net(3)
    r = net.create(A, OWNER)
    net.settle()
    fork = net.s[A].fork_from_user(r.rref_id, OWNER, r)  # pickled into the request
    net.drop(r)  # the program lets go at once: the child holds it
    net.settle()
    assert net.s[A].children and not net.freed and net.owned(OWNER, r.rref_id)
    # the request arrives: the owner makes its owner-side RRef, sends nothing
    net.s[OWNER].own(r.rref_id, "site")
    assert net.s[OWNER].came_home(r.rref_id, fork, A, by_answer=True) == []
    assert net.s[OWNER].came_home(r.rref_id, fork, A) == [(A, ChildAccept(r.rref_id, fork))]
    child = net.s[A].on_child_accept(fork)  # the answer came
    net._collect(child.keepalive)
    net.settle()
    assert not net.freed  # the owner's copy (the call's argument) still holds it
    assert net.s[OWNER].release_owner_ref(r.rref_id) is not None  # the call returned
    assert net.quiet()


def test_a_user_to_user_fork_in_a_request_is_accepted_by_the_answer_once_settled() -> None:
    """C settles the fork before it answers: no ChildAccept, the answer lets A go.
    Still pending when C answers: the answer says so, and settling sends the
    ChildAccept after all (never both, never neither)."""
    for settled_first in (True, False):
        net = Net(3)
        r = net.create(A, OWNER)
        net.settle()
        fork = net.s[A].fork_from_user(r.rref_id, C, r)
        out = net.s[C].user_arrived(r.rref_id, OWNER, fork, A, False, "site", by_answer=True)
        assert out == [(OWNER, ForkRequest(r.rref_id, fork))]
        net.s[OWNER].on_fork_request(r.rref_id, fork, C)
        if settled_first:
            assert net.s[C].on_confirmed(fork) == []  # no ChildAccept
            assert net.s[C].unsettled_at_answer(fork) == []  # the answer lets A go
        else:
            assert net.s[C].unsettled_at_answer(fork) == [fork]  # the answer: pending
            assert net.s[C].on_confirmed(fork) == [(A, ChildAccept(r.rref_id, fork))]
        assert net.s[A].on_child_accept(fork) is not None
