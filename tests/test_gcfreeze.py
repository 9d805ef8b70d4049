"""Full collections stay short while agents run: objects alive when the first
agent starts are frozen (gc.freeze) until the last one stops. No network except
the two agent tests at the end."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
from conftest import local_group

from nbrpc.agent import gcfreeze


@pytest.fixture(autouse=True)
def no_freeze_around() -> Iterator[None]:
    assert not gcfreeze.anything_frozen() and not gcfreeze.is_frozen(), "a test before left a freeze"
    yield
    gcfreeze.thaw()
    gc.unfreeze()
    gcfreeze._holders = 0


def test_the_first_hold_freezes_and_the_last_release_gives_back() -> None:
    gcfreeze.hold()
    frozen = gc.get_freeze_count()
    assert frozen > 1000 and gcfreeze.is_frozen()  # torch alone: far more
    gcfreeze.hold()  # a second agent freezes nothing more
    assert gc.get_freeze_count() == frozen
    gcfreeze.release()
    assert gc.get_freeze_count() == frozen
    gcfreeze.release()
    assert not gcfreeze.anything_frozen() and not gcfreeze.is_frozen()


def test_thaw_ends_the_freeze_until_every_agent_has_stopped() -> None:
    gcfreeze.hold()
    gcfreeze.thaw()
    assert not gcfreeze.anything_frozen()
    gcfreeze.hold()  # another agent while one runs: stays thawed
    assert not gcfreeze.anything_frozen()
    gcfreeze.release()
    gcfreeze.release()
    gcfreeze.hold()  # all stopped, a new one starts: frozen again
    assert gcfreeze.anything_frozen()
    gcfreeze.release()
    assert not gcfreeze.anything_frozen()


def test_a_freeze_made_by_the_process_itself_is_left_alone() -> None:
    gc.freeze()  # e.g. a pre-fork server, or nbrpc's zygote before forking engines
    theirs = gc.get_freeze_count()
    gcfreeze.hold()
    assert not gcfreeze.is_frozen()
    gcfreeze.release()
    assert gc.get_freeze_count() == theirs and gcfreeze.anything_frozen()  # not unfrozen by us


def test_immortal_objects_in_the_permanent_generation_are_no_freeze(monkeypatch) -> None:
    """CPython 3.12 keeps immortal objects (hundreds, from start-up) in the
    permanent generation itself: a count above zero with nothing frozen must
    not stop agents from freezing (faked here, for the Pythons that do not)."""
    count = gc.get_freeze_count
    monkeypatch.setattr(gc, "get_freeze_count", lambda: count() + 375)
    assert not gcfreeze.frozen_by_process()
    gcfreeze.hold()
    assert gcfreeze.is_frozen() and gcfreeze.anything_frozen()
    gcfreeze.release()
    assert not gcfreeze.is_frozen() and not gcfreeze.anything_frozen()


def test_a_frozen_garbage_cycle_is_collected_once_given_back() -> None:
    class Node:
        pass

    n = Node()
    n.me = n  # a cycle: only the collector frees it
    alive = weakref.ref(n)
    gcfreeze.hold()
    del n
    gc.collect()
    assert alive() is not None  # frozen: full collections skip it
    gcfreeze.release()
    gc.collect()
    assert alive() is None


def test_agents_freeze_while_running_unless_told_not_to() -> None:
    with local_group(["a", "b"]) as (a, b):
        assert gcfreeze.is_frozen() and gcfreeze.anything_frozen()
        assert a.rpc_async("b", divmod, (7, 2)).wait() == (3, 1)
    assert not gcfreeze.anything_frozen() and not gcfreeze.is_frozen()
    with local_group(["a", "b"], gc_freeze=False):
        assert not gcfreeze.anything_frozen()
