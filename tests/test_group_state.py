"""Membership and shutdown-agreement protocol state, with no network."""

from __future__ import annotations

import sys

import pytest

from nbrpc.agent import AgentOptions
from nbrpc.agent.group import Coordinator
from nbrpc.agent.messages import (
    DrainReport,
    DrainVerdict,
    Join,
    Member,
    MemberJoined,
    MemberLeft,
    Members,
)


def m(name: str, rank: int) -> Member:
    return Member(name, rank, f"tcp://127.0.0.1:{5000 + rank}")


def test_static_group_answers_everyone_once_complete() -> None:
    c = Coordinator(3)
    assert c.on_join(Join(m("a", 0), 3)) == []
    assert c.on_join(Join(m("b", 1), 3)) == []
    out = c.on_join(Join(m("c", 2), 3))
    assert sorted(r for r, _ in out) == [0, 1, 2]
    assert all(isinstance(msg, Members) and len(msg.members) == 3 for _, msg in out)


def _refusal(join: Join) -> tuple[int, str]:
    """Who the first answer goes to, and its error, once "a" (rank 0) has joined."""
    c = Coordinator(3)
    c.on_join(Join(m("a", 0), 3))
    rank, reply = c.on_join(join)[0]
    return rank, reply.error


def test_duplicate_name_and_rank_are_refused_with_a_reason() -> None:
    rank, error = _refusal(Join(m("a", 1), 3))
    assert rank == 1 and "Worker name 'a' is not unique" in error
    assert "taken by rank 0" in error
    assert "rank 0 is taken" in _refusal(Join(m("z", 0), 3))[1]
    assert "outside 0..2" in _refusal(Join(m("q", 7), 3))[1]
    assert "world_size=4" in _refusal(Join(m("w", 1), 4))[1]


def test_a_refusal_fails_the_static_group_for_every_rank() -> None:
    """As PyTorch's init_rpc, every rank fails, not only the refused one: those
    that joined hear it at once, those that join later on joining."""
    c = Coordinator(3)
    c.on_join(Join(m("a", 0), 3))
    out = c.on_join(Join(m("a", 1), 3))
    assert [r for r, _ in out] == [1, 0]
    assert c.failed and "a worker tried to join and was refused" in c.failed
    assert "is not unique" in c.failed and out[1][1] == Members((), c.failed)
    assert not c.everyone_told
    assert c.on_join(Join(m("c", 2), 3)) == [(2, Members((), c.failed))]
    assert c.everyone_told and list(c.members) == [0]


def test_dynamic_group_join_and_leave() -> None:
    c = Coordinator(None)
    c.on_join(Join(m("driver", 0), None))
    out = c.on_join(Join(m("w1", 1), None))
    assert out[0][0] == 1 and isinstance(out[0][1], Members)
    out = c.on_join(Join(m("w2", 2), None))
    assert (1, MemberJoined(m("w2", 2))) in out
    assert c.on_leave(2) == [(1, MemberLeft(2))]
    assert c.on_leave(2) == []


def test_a_process_removed_on_purpose_is_never_taken_back() -> None:
    """A restart: the old process (still alive, e.g. held in MPI_Finalize) may
    heartbeat or join again; its rank's new process joins as usual."""
    import dataclasses

    c = Coordinator(None)
    c.on_join(Join(m("driver", 0), None))
    old = dataclasses.replace(m("w1", 1), incarnation=11)
    c.on_join(Join(old, None))
    c.banish(1)
    c.on_leave(1, dead=True, why="was restarted")
    assert not c.readmits(1, old.incarnation)  # its heartbeat takes it back: no
    assert c.on_join(Join(old, None)) == [] and 1 not in c.members  # nor its join
    new = dataclasses.replace(m("w1", 1), incarnation=12, address="tcp://127.0.0.1:6001")
    assert c.readmits(1, new.incarnation)
    out = c.on_join(Join(new, None))
    assert c.members[1] == new and out[0] == (1, Members(c.table(), to=12))
    # a member dropped as dead (not removed) is still taken back when heard
    c.on_leave(1, dead=True)
    assert c.readmits(1, new.incarnation)


def _report(rnd: int, rank: int, active: int, sent: int, served: int) -> DrainReport:
    """Two-member group: everything is sent to and served for the other one."""
    other = 1 - rank
    return DrainReport(rnd, active, {other: sent}, {other: served})


def _round(c: Coordinator, rnd: int, reports: dict[int, tuple[int, int, int]]) -> bool:
    out = []
    for rank, (active, sent, served) in reports.items():
        out = c.on_drain_report(rank, _report(rnd, rank, active, sent, served))
    assert all(isinstance(v, DrainVerdict) and v.round == rnd for _, v in out)
    return out[0][1].done


def _static(n: int) -> Coordinator:
    c = Coordinator(n)
    for r in range(n):
        c.on_join(Join(m(f"w{r}", r), n))
    return c


def test_drain_needs_two_quiet_rounds_with_equal_sums() -> None:
    c = _static(2)
    assert c.on_drain_report(0, _report(0, 0, 0, 5, 3)) == []  # waits for everyone
    assert not c.on_drain_report(1, _report(0, 1, 0, 3, 5))[0][1].done  # first quiet round
    assert _round(c, 1, {0: (0, 5, 3), 1: (0, 3, 5)})  # unchanged: done


def test_drain_continues_while_calls_are_in_flight_or_counts_move() -> None:
    c = _static(2)
    assert not _round(c, 0, {0: (1, 5, 3), 1: (0, 3, 4)})  # active call
    assert not _round(c, 1, {0: (0, 5, 3), 1: (0, 3, 5)})  # quiet, but first quiet round
    assert not _round(c, 2, {0: (0, 6, 3), 1: (0, 3, 6)})  # a call slipped in between
    assert _round(c, 3, {0: (0, 6, 3), 1: (0, 3, 6)})


def test_a_dead_member_neither_blocks_a_round_nor_unbalances_the_sums() -> None:
    c = _static(3)
    # rank 2 sent a call to rank 0 and died before its answer was counted anywhere
    c.on_drain_report(0, DrainReport(0, 0, {1: 4}, {1: 4, 2: 1}))
    c.on_drain_report(1, DrainReport(0, 0, {0: 4}, {0: 4}))
    out = c.on_leave(2, dead=True)  # round 0 was waiting for rank 2
    assert (1, MemberLeft(2, True)) in out and (2, MemberLeft(2, True)) in out
    verdicts = [v for _, v in out if isinstance(v, DrainVerdict)]
    assert len(verdicts) == 2 and not verdicts[0].done  # quiet, first round
    assert _round3(c, 1)


def _round3(c: Coordinator, rnd: int) -> bool:
    c.on_drain_report(0, DrainReport(rnd, 0, {1: 4}, {1: 4, 2: 1}))
    return c.on_drain_report(1, DrainReport(rnd, 0, {0: 4}, {0: 4}))[0][1].done


def test_silent_members_expire_once_the_group_is_watched() -> None:
    c = _static(3)
    assert c.expired(100.0, 2.0) == []  # not watched before the group formed
    c.watch_all(10.0)
    c.heard_from(1, 11.5)
    c.heard_from(9, 11.5)  # not a member: ignored
    assert c.expired(12.5, 2.0) == [2]
    assert c.expired(14.0, 2.0) == [1, 2]


def test_a_closed_link_expires_a_member_sooner_than_silence() -> None:
    c = _static(3)
    c.watch_all(10.0)
    down = {1: 10.2, 2: None}  # rank 1's connection closed at 10.2; rank 2's is up
    assert c.expired(10.9, 30.0, 1.0, down) == []  # not yet a second
    assert c.expired(11.5, 30.0, 1.0, down) == [1]
    c.heard_from(1, 11.4)  # but it spoke meanwhile (its link came back): alive
    assert c.expired(11.5, 30.0, 1.0, down) == []
    assert c.expired(40.5, 30.0, 1.0, down) == [1, 2]  # and the long timeout still holds


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="off Linux, silence counts by default (lost hosts' links stay up)")
def test_by_default_only_a_down_link_expires_a_member_never_silence() -> None:
    c = _static(3)
    c.watch_all(10.0)
    forever = AgentOptions().failure_timeout  # the default
    up = {1: None, 2: None}
    assert c.expired(10.0 + 3600, forever, 1.0, up) == []  # busy for an hour: a member
    assert c.expired(10.0 + 3600, forever, 1.0, {1: 3600.0, 2: None}) == [1]  # link down


def test_a_member_declared_dead_is_readmitted_but_one_that_left_is_not() -> None:
    c = _static(3)
    c.watch_all(0.0)
    c.on_leave(1, dead=True)
    c.on_leave(2, dead=False)
    assert c.readmits(1) and not c.readmits(2) and not c.readmits(0)
    out = c.on_join(Join(m("w1", 1), 3))  # taken back: the static group is whole again
    assert sorted(r for r, _ in out) == [0, 1] and all(not msg.error for _, msg in out)
    assert not c.readmits(1)


def test_a_member_rejoining_is_answered_not_refused_as_a_duplicate() -> None:
    c = _static(3)
    out = c.on_join(Join(m("w1", 1), 3))  # it thought it was dropped; it was not
    assert out == [(1, Members(c.table()))]
    assert c.on_join(Join(Member("w1", 1, "tcp://127.0.0.1:9"), 3))[0][1].error  # not it


def test_the_member_table_follows_renames_restarts_and_departures() -> None:
    from nbrpc.agent.members import MemberTable
    from nbrpc.errors import UnknownWorkerError, WorkerGoneError

    t = MemberTable()
    t.add(Member("a", 0, "tcp://127.0.0.1:1"))
    t.add(Member("b", 1, "tcp://127.0.0.1:2"))
    t.add(Member("b2", 1, "tcp://127.0.0.1:3"))  # rank 1 rejoined under a new name
    assert t.ranks() == [0, 1] and t.peer_name(1) == "b2" and sorted(t.by_name) == ["a", "b2"]
    with pytest.raises(UnknownWorkerError, match="'b'"):
        t.resolve("b")
    assert t.remove(1, "died (its connection closed)").name == "b2" and 1 not in t
    assert t.remove(1, "again") is None and t.gone_why(1) == "died (its connection closed)"
    assert t.rank_of("b2") == 1 and t.rank_of("a") == 0 and t.rank_of("zz") is None
    with pytest.raises(WorkerGoneError, match="'b2' died"):
        t.resolve(1)
    t.add(Member("b2", 1, "tcp://127.0.0.1:4"))  # restarted: a member again
    assert t.gone_why(1) is None and t.resolve("b2").address.endswith(":4") and len(t) == 2
    with pytest.raises(TypeError, match="a worker name, a rank or a WorkerInfo"):
        t.resolve(1.5)


def test_a_member_back_after_a_partition_lets_the_drain_agree_despite_lost_requests() -> None:
    """Rank 2 was cut off and declared dead, then taken back: 3 of the driver's
    requests to it were lost (never served) and 1 of its own to rank 1 too.
    Pairs with rank 2 need only hold still for two rounds; the others balance."""
    c = _static(3)
    c.on_leave(2, dead=True)
    c.on_join(Join(m("w2", 2), 3))  # taken back
    assert c.broken == {2}
    reports = {0: DrainReport(0, 0, {1: 4, 2: 7}, {1: 2}),
               1: DrainReport(0, 0, {0: 2}, {0: 4, 2: 5}),
               2: DrainReport(0, 0, {1: 6}, {0: 4})}

    def round_(rnd: int, reps: dict) -> bool:
        out = []
        for r, rep in reps.items():
            out = c.on_drain_report(r, DrainReport(rnd, rep.active, rep.sent, rep.served))
        return out[0][1].done

    assert not round_(0, reports)  # quiet: first round
    assert round_(1, reports)  # unchanged: done, although 7 != 4 and 6 != 5
    moved = {**reports, 2: DrainReport(0, 0, {1: 6}, {0: 5})}  # rank 2 served one more
    assert not round_(2, moved) and round_(3, moved)
    # the pairs without rank 2 must still balance
    unbalanced = {**reports, 1: DrainReport(0, 0, {0: 2}, {0: 3, 2: 5})}
    assert not round_(4, unbalanced) and not round_(5, unbalanced)


def test_a_member_that_gave_up_on_the_coordinator_rejoins_and_its_pairs_are_held() -> None:
    """A member that declared the coordinator dead (its calls to it failed) and
    joins again while still listed is answered, and its pairs stop balancing."""
    c = _static(3)
    assert c.broken == set()
    out = c.on_join(Join(m("w1", 1), 3))
    assert out == [(1, Members(c.table()))] and c.broken == {1}
    c.on_drain_report(0, DrainReport(0, 0, {1: 3}, {}))
    c.on_drain_report(1, DrainReport(0, 0, {}, {0: 2}))  # one request lost
    assert not c.on_drain_report(2, DrainReport(0, 0, {}, {}))[0][1].done
    c.on_drain_report(0, DrainReport(1, 0, {1: 3}, {}))
    c.on_drain_report(1, DrainReport(1, 0, {}, {0: 2}))
    assert c.on_drain_report(2, DrainReport(1, 0, {}, {}))[0][1].done


def test_a_down_link_comes_due_when_the_link_rule_would_expire_it() -> None:
    c = _static(3)
    c.watch_all(10.0)
    assert c.link_due(1.0, {1: None, 2: None}) is None  # every link up
    down = {1: 12.0, 2: None}
    c.heard_from(1, 12.4)  # heard after its link went down: due a second after that
    assert c.link_due(1.0, down) == 13.4
    assert c.expired(13.4, 30.0, 1.0, down) == [] and c.expired(13.41, 30.0, 1.0, down) == [1]
    down[2] = 11.5  # silent since 10.0, its link down since 11.5: due first
    assert c.link_due(1.0, down) == 12.5 and c.expired(12.51, 30.0, 1.0, down) == [2]


def test_every_answer_to_a_join_names_the_incarnation_it_answers() -> None:
    """A member takes the member table only from an answer that names its own
    (random) incarnation, so that an answer recorded in another run, or sent
    to another member, is refused (see Control._of_this_run)."""
    def inc(name: str, rank: int) -> Member:
        return Member(name, rank, f"tcp://127.0.0.1:{5000 + rank}", incarnation=100 + rank)

    c = Coordinator(2)
    c.on_join(Join(inc("a", 0), 2))
    out = c.on_join(Join(inc("b", 1), 2))
    assert {r: msg.to for r, msg in out} == {0: 100, 1: 101}
    assert c.on_join(Join(inc("b", 1), 2)) == [(1, Members(c.table(), to=101))]  # a rejoin
    refused = c.on_join(Join(Member("b", 1, "tcp://127.0.0.1:9", incarnation=7), 2))
    assert refused[0] == (1, Members((), refused[0][1].error, 7)) and refused[0][1].error

    d = Coordinator(None)  # dynamic
    d.on_join(Join(inc("a", 0), None))
    assert [(r, msg.to) for r, msg in d.on_join(Join(inc("b", 1), None))] == [(1, 101)]
