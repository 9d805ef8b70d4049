"""Owner-table state: entries, forks, owner references, waiting fetches; no network."""

from __future__ import annotations

import pytest

from nbrpc.errors import NbrpcError
from nbrpc.rref.state import OwnerTable, RRefId


def test_value_lives_while_a_fork_or_owner_ref_remains() -> None:
    t = OwnerTable(1)
    rid, fork = t.new_id(), RRefId(0, 9)
    t.create(rid, "here:1", fork=fork)
    t.create(rid, "here:1", owner_ref=True)
    assert not t.remove_fork(rid, fork) and rid in t.entries
    assert t.release_owner_ref(rid) and rid not in t.entries and t.deleted == 1
    assert not t.remove_fork(rid, fork)  # idempotent once gone


def test_fetch_that_overtakes_creation_waits_for_it() -> None:
    t = OwnerTable(1)
    rid = RRefId(0, 1)
    fut = t.await_entry(rid)
    assert not fut.done()
    entry = t.create(rid, "x:1", fork=RRefId(0, 2))
    assert fut.done() and fut.value() is entry


def test_cancel_fails_waiting_fetches_and_fetches_that_arrive_later() -> None:
    t = OwnerTable(1)
    waiting = t.await_entry(RRefId(0, 1))
    assert t.expire_waiters(RRefId(0, 1), NbrpcError("gone")) == 1
    with pytest.raises(NbrpcError, match="gone"):
        waiting.wait()
    assert t.expire_waiters(RRefId(0, 2), NbrpcError("gone too")) == 0
    late = t.await_entry(RRefId(0, 2))  # the cancel came first
    with pytest.raises(NbrpcError, match="gone too"):
        late.wait()


def test_expired_waiter_is_removed() -> None:
    t = OwnerTable(1)
    rid = RRefId(0, 3)
    fut = t.await_entry(rid)
    t.expire_waiter(rid, fut, NbrpcError("timeout"))
    with pytest.raises(NbrpcError):
        fut.wait()
    t.create(rid, "x:1", fork=RRefId(0, 4))  # a late creation does not touch it again
