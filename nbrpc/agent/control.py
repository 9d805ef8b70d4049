"""Control messages and failure detection, on the I/O thread.

:class:`Control` is one part of an :class:`~nbrpc.agent.agent.Agent`
(``agent.control``); the agent's dispatch hands it the CONTROL messages. They
carry group membership (join, members, joined, left), heartbeats, links found
cut and the shutdown rounds; their handlers never block and never run user
code. Every heartbeat interval :meth:`Control.tick` sends heartbeats (and, from
a member waiting on another member, to that member too: a link cut between two
members fails their calls to each other, :meth:`Control._watch_peers`; an
agent whose link to a member stays down tells it through a third, as that
member's requests may still get through: :meth:`Control._report_cuts`) and, on the
coordinator, asks the :class:`~.group.Coordinator` whom to declare dead: a
member whose connection closed (its process exited, or its host stopped
acknowledging) after ``link_timeout``; one that is only silent, with its link
up, after ``failure_timeout`` (never, by default, where lost hosts close
links). A member wrongly declared dead is taken back when heard; a member that gave up on its
coordinator asks to join again at once, so that a partition that heals heals
the group too (both sides gave up on each other; nobody else would call).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from ..serialize import dumps, loads
from ..transport import Envelope
from .group import Coordinator
from .messages import (
    CONTROL,
    DrainReport,
    DrainVerdict,
    Heartbeat,
    Join,
    JoinChallenge,
    Leave,
    LinkCut,
    MemberJoined,
    MemberLeft,
    Members,
)

log = logging.getLogger(__name__)

JOIN_RETRY_MAX = 8.0  # seconds between a joiner's Joins, at most (see Control.retry_join)


class Control:
    """Membership, heartbeats and failure detection (see the module docstring).

    Owns the join's outcome (``joined``, set once the member table or a
    refusal came; ``join_error``), the coordinator's pure state on rank 0
    (``coordinator``: a :class:`~.group.Coordinator`, else None), where the
    coordinator is and when it was last heard from (``coordinator_address``,
    ``coordinator_seen``), the heartbeat clock (``last_tick``) and
    ``readmitted`` (members, or the coordinator, taken back after a wrong
    suspicion). ``agent`` is the :class:`~nbrpc.agent.agent.Agent` it is part
    of (its state and member table's side effects); ``callee`` serves the
    requests held while joining; ``leaving`` (the
    :class:`~.shutdown.Shutdown` part) takes the drain verdicts and is cut
    short when the group falls apart.
    """

    def __init__(self, agent: Any, callee: Any, leaving: Any) -> None:
        self.agent, self.callee, self.leaving = agent, callee, leaving
        self.name, self.rank, self.world_size = agent.name, agent.rank, agent.world_size
        self.io, self.members, self.options = agent.io, agent.members, agent.options
        self.me = agent.me  # this agent's own Member record (Join, Heartbeat)
        self.coordinator = Coordinator(agent.world_size) if agent.rank == 0 else None
        self.joined = threading.Event()
        self.join_error: str | None = None
        self.coordinator_seen = 0.0  # when rank 0 was last heard from
        self.coordinator_address: str | None = None
        self.last_tick = 0.0
        self._recheck_due = False  # a check of the links is set before the next tick
        self.readmitted = 0  # members (or the coordinator) taken back after a wrong suspicion
        self._unreachable: dict[int, float] = {}  # peer -> since when its cut link was reported
        # One-way cuts (see _report_cuts): peer -> since when this agent's link to it is down,
        # as told to a relay; reporter -> its relayed LinkCut (its answers cannot come
        # here); reporter -> the ``since`` of the last cut it said was mended.
        self._cuts_told: dict[int, float] = {}
        self._answers_cut: dict[int, LinkCut] = {}
        self._mended: dict[int, float] = {}
        agent.gone_hooks.append(self._forget_cuts)
        self.io.on_link_up = self._link_back

    def send(self, rank: int, msg: Any) -> None:
        payload, buffers = dumps(msg)
        self.io.send(rank, CONTROL, 0, payload, buffers)

    def on_message(self, env: Envelope) -> None:
        msg = loads(env.payload, env.buffers)
        t = type(msg)
        if not self._of_this_run(env, msg):
            return
        now = time.monotonic()
        if env.sender == 0:
            self.coordinator_seen = now
        if self.coordinator is not None:
            self.coordinator.heard_from(env.sender, now)
        if t is Heartbeat:
            if msg.member is not None and msg.member.rank == env.sender:
                self._heard_heartbeat(msg)
            return
        if t is JoinChallenge:
            if self.agent.state == "joining":  # the Join again, now signed for the run
                self.send(0, Join(self.me, self.world_size))
            return
        if t is Members:
            if msg.error:
                self.join_error = msg.error
            else:
                if (self.coordinator is None and self.agent.state == "ready"
                        and 0 not in self.members):  # the coordinator it gave up on answered
                    log.warning("nbrpc agent %r: back in the group (the coordinator answered)",
                                self.name)
                    self.readmitted += 1  # (counted before the table shows it back)
                self.agent.set_members(msg.members)
                if self.coordinator is not None:
                    self.coordinator.watch_all(now)
                if self.agent.state == "joining":  # peers may call us from now on
                    self.agent.state = "ready"
                    self.callee.serve_early()
            self.joined.set()
        elif t is MemberJoined:
            self.agent.add_member(msg.member)
        elif t is MemberLeft:
            if msg.rank == self.rank:
                self._evicted()
            else:
                self.agent.remove_member(msg.rank, msg.dead, msg.why)
        elif t is DrainVerdict:
            self.leaving.on_verdict(msg.round, msg.done)
        elif t is LinkCut:
            self._on_link_cut(env.sender, msg)
        elif self.coordinator is None:
            log.warning("rank %d sent %s to a non-coordinator", env.sender, t.__name__)
        elif t is Leave:
            self.send_all(self.coordinator.on_leave(msg.rank))
            self.agent.remove_member(msg.rank)
        elif t is Join:
            self.on_join(msg)
        elif t is DrainReport:
            self.send_all(self.coordinator.on_drain_report(env.sender, msg))

    def _of_this_run(self, env: Envelope, msg: Any) -> bool:
        """Is this control message of this run of the group? A joiner's first
        Join is of none yet (run 0): the coordinator answers it with a
        :class:`JoinChallenge` (see :meth:`_challenge`) and takes only a Join
        signed for its run. The coordinator's answers to a Join must name this
        agent's incarnation; its challenge tells a joiner the run (signed in
        its header)."""
        t = type(msg)
        if (t is Members or t is JoinChallenge) and (msg.to != self.me.incarnation
                                                     or env.sender != 0):
            why = "an answer to another member's join"
        elif t is JoinChallenge and self.io.run == 0:
            self.io.run = env.run
            return True
        elif env.run == self.io.run:
            return True
        elif t is Join and self.coordinator is not None and env.run == 0:
            self._challenge(msg)
            return False
        else:
            why = f"{t.__name__} of run {env.run:x} (this is run {self.io.run:x})"
        self.io.note_drop("wrong run", f"from rank {env.sender}: {why}")
        return False

    def _challenge(self, join: Join) -> None:
        """Coordinator: answer a Join that is not signed for this run with a
        challenge, sent to the address it names. It changes no member's
        state: a rank held by a live member keeps its address (the joiner,
        say that member restarted, asks again until the old one is found
        gone), as does a process removed on purpose (never answered)."""
        m = join.member
        if m.rank == self.rank or m.incarnation in self.coordinator.banished:
            return
        holder = self.coordinator.members.get(m.rank)
        if holder is not None and holder.incarnation != m.incarnation:
            log.debug("a Join for rank %d, held by a live member, not answered", m.rank)
            return
        self.io.set_address(m.rank, m.address, m.local)
        self.send(m.rank, JoinChallenge(m.incarnation))

    def retry_join(self, delay: float) -> None:
        """Joiner: send the Join again every ``delay`` seconds (doubling, up to
        ``JOIN_RETRY_MAX``) until the group answers it, so that a Join that
        was not answered (its rank still held by this worker's previous
        process, a lost message) does not wait for the join's timeout."""
        if self.agent.state != "joining" or self.joined.is_set():
            return
        self.send_all([(0, Join(self.me, self.world_size))])
        self.io.call_later(delay, self.retry_join, min(2 * delay, JOIN_RETRY_MAX))

    def on_join(self, join: Join) -> None:
        m = join.member
        if m.incarnation in self.coordinator.banished:
            return  # a process removed on purpose: not answered, its address not taken
        holder = self.coordinator.members.get(m.rank)
        out = self.coordinator.on_join(join)
        refusal = next((r.error for _, r in out if type(r) is Members and r.error), None)
        if refusal is not None:
            log.error("nbrpc coordinator %r refused %r (rank %d): %s", self.name, m.name,
                      m.rank, refusal)
            if holder is not None:  # its rank is a member's: the refusal cannot reach it
                out = out[1:]  # (what follows tells the group, the holder included)
        failed = self.coordinator.failed
        if failed is not None and self.world_size is not None and self.agent.state == "joining":
            # the static group cannot form: every rank's init_rpc fails, not at its
            # timeout; rank 0's once all the others have been told (they join to hear it)
            self.join_error = failed
            out = [(r, msg) for r, msg in out if r != self.rank]
        if m.rank != self.rank and (refusal is None or holder is None):
            self.io.set_address(m.rank, m.address, m.local)
        if (self.world_size is None and m.rank != self.rank
                and self.coordinator.members.get(m.rank) == m):
            # dynamic group: the coordinator is a member too (it calls the
            # joiner, and heartbeats and watches it from now on), from before
            # the joiner hears it is in
            self.agent.add_member(m)
            self.coordinator.heard_from(m.rank, time.monotonic())
        self.send_all(out)
        if self.join_error and self.coordinator.everyone_told:
            self.joined.set()  # (after the sends: init_rpc stops the agent on waking)

    def send_all(self, outbox: list) -> None:
        for rank, msg in outbox:
            try:
                self.send(rank, msg)
            except Exception as e:  # a member gone meanwhile
                log.debug("control message to rank %d not sent: %s", rank, e)

    def tick(self) -> None:
        if self.agent.state == "stopped":
            return
        opts = self.options
        self.io.call_later(opts.heartbeat_interval, self.tick)
        now = time.monotonic()
        # Late by over a second: this process was stopped or its GIL held, so
        # nobody's silence meanwhile says anything about them.
        stalled = now - self.last_tick > opts.heartbeat_interval + max(1.0, opts.heartbeat_interval)
        self.last_tick = now
        if not self.joined.is_set() or self.join_error or self.leaving.cut:
            return
        beat = Heartbeat(self.me, self.world_size)
        if self.coordinator is not None:
            if stalled:
                self.coordinator.watch_all(now)
            self._declare_dead(now)
            self.send_all([(rank, beat) for rank in self.members.ranks() if rank != 0])
            self._report_cuts(now, stalled)
            self._fail_unanswered()
            return
        self._watch_peers(now, beat, stalled)
        self._report_cuts(now, stalled)
        self._fail_unanswered()
        if 0 not in self.members:
            return  # declared dead: its heartbeat, if it comes, takes it back
        if stalled or not self.coordinator_seen:
            self.coordinator_seen = now
        silent, down_since = now - self.coordinator_seen, self.io.link_down_since(0)
        if silent > opts.failure_timeout or (
                down_since is not None and now - down_since > opts.link_timeout
                and silent > opts.link_timeout):
            self.agent.remove_member(0, dead=True, why=self._death(now, down_since))
            if self.agent.state == "ready":
                # The coordinator may be alive but cut off (a partition): then it gave
                # up on this member too, and neither would heartbeat the other again.
                # Ask to join again now (after the old connection is dropped): the
                # Join waits in a new connection that keeps dialling until it is through.
                self.io.call_soon(self.rejoin)
            return
        self.send_all([(0, beat)])

    def _watch_peers(self, now: float, beat: Heartbeat, stalled: bool) -> None:
        """A member's calls to another member (not the coordinator, which
        declares the dead): while it waits on a peer, it sends that peer a
        heartbeat each tick, so that a link cut between the two hosts has data
        in flight and the kernel closes it (``TCP_USER_TIMEOUT``), as it does
        the links to the coordinator. The coordinator still hears both members
        and declares neither dead, so nobody else would end those calls: once
        the link to the peer has been down for ``2 * link_timeout`` (the
        coordinator's verdict on a peer that died comes first), its calls fail
        with :class:`~nbrpc.errors.WorkerGoneError` and the peer stays a member.
        A link that comes due before the next tick is checked again then, as the
        coordinator's are. Not after a stall of this process: its link events
        are late too."""
        down = {r: None if stalled else self.io.link_down_since(r) for r in self._peers_waited_on()}
        reachable = [r for r, since in down.items() if not self._fail_if_cut(now, r, since)]
        self.send_all([(rank, beat) for rank in reachable])
        if not stalled:
            dues = [down[r] + 2 * self.options.link_timeout for r in reachable if down[r] is not None]
            self._recheck_at(now, min(dues, default=None))

    def _peers_waited_on(self) -> list[int]:
        """The members, other than the coordinator, that calls in flight wait on."""
        waited = self.agent.caller.peers_waited_on() - {0, self.rank}
        return sorted(r for r in waited if r in self.members)  # (gone: its calls failed)

    def _fail_if_cut(self, now: float, rank: int, since: float | None) -> bool:
        """Fails the calls to ``rank`` if its link, down ``since`` (None: up, or
        not to be judged), has been down too long; True then."""
        if since is None or now - since <= 2 * self.options.link_timeout:
            return False
        name = self.members.peer_name(rank)
        why = (f"is out of reach from {self.name!r}: the connection to it has been down for "
               f"{now - since:.1f} s, though the group still counts it a member (a network "
               "cut between the two hosts? calls go through again once it is mended)")
        if self._unreachable.get(rank) != since:  # once per cut, however many calls fail
            self._unreachable[rank] = since
            log.warning("nbrpc agent %r: worker %r (rank %d) %s", self.name, name, rank, why)
            self.agent.events.add("peer-unreachable", "", name, 0, 0)
        self.agent.caller.fail_calls_to(rank, name, why)
        return True

    def _report_cuts(self, now: float, stalled: bool) -> None:
        """A one-way cut. Answers travel on the answering worker's own
        connection, so a peer whose requests still reach this agent (its own
        link up) may never hear the answers, and would wait for them until
        their timeout. Each link to another member that has been down for ``2 *
        link_timeout`` is told, once per cut, to a third member that relays it
        to that member (:meth:`_relay_for`, :meth:`_on_link_cut`), and the
        member itself is told when the link is back (:meth:`_link_back`; here
        too, should that have been missed). A member that is gone for good is
        declared dead before this (after one ``link_timeout``), and not told."""
        limit = 2 * self.options.link_timeout
        for rank in self.members.ranks():
            if rank == self.rank:
                continue
            since = self.io.link_down_since(rank)
            if since is None:
                self._link_back(rank)
            elif since != self._cuts_told.get(rank) and not stalled and now - since > limit:
                relay = self._relay_for(rank)
                if relay is None:
                    continue  # nobody else to tell: a group of two (tried again next tick)
                self._cuts_told[rank] = since
                log.warning("nbrpc agent %r: the connection to %r (rank %d) has been down for "
                            "%.1f s; telling it through %r", self.name,
                            self.members.peer_name(rank), rank, now - since,
                            self.members.peer_name(relay))
                self.send_all([(relay, LinkCut(self.rank, rank, since, now - since))])

    def _relay_for(self, rank: int) -> int | None:
        """Who tells ``rank`` of this agent's cut link to it: the coordinator,
        which hears everyone, unless one of the two is the coordinator; then
        the first other member this agent's own link to is up; None if none."""
        if self.rank != 0 and rank != 0:
            return 0
        return next((r for r in self.members.ranks() if r not in (self.rank, rank)
                     and self.io.link_down_since(r) is None), None)

    def _link_back(self, rank: int) -> None:
        """The connection to ``rank`` is up again: a cut told to a relay is
        mended, and ``rank`` hears it at once, on that connection, after what
        was queued for it meanwhile (the next tick would be up to one late)."""
        told = self._cuts_told.pop(rank, None)
        if told is not None and rank in self.members:
            self.send_all([(rank, LinkCut(self.rank, rank, told, 0.0, mended=True))])

    def _on_link_cut(self, sender: int, cut: LinkCut) -> None:
        """A :class:`~.messages.LinkCut`. A relay passes a report from its
        reporter on to the member it names. That member fails its calls to the
        reporter, now and at each tick (:meth:`_fail_unanswered`), until the
        reporter says the link is mended; a report that comes after the mend
        it names (the relay is a hop longer) is stale."""
        if cut.peer != self.rank:
            if (sender == cut.reporter and not cut.mended and cut.peer != sender
                    and cut.peer in self.members):
                self.send_all([(cut.peer, cut)])
            return
        rank = cut.reporter
        if cut.mended:
            if sender == rank:
                self._mended[rank] = cut.since
                if self._answers_cut.pop(rank, None) is not None:
                    log.info("nbrpc agent %r: %r can answer again (its connection is back)",
                             self.name, self.members.peer_name(rank))
            return
        if sender == rank or rank not in self.members or self._mended.get(rank) == cut.since:
            return  # not relayed (its link here is down), gone, or mended already
        was = self._answers_cut.get(rank)
        self._answers_cut[rank] = cut
        name = self.members.peer_name(rank)
        if was is None or was.since != cut.since:  # once per cut, however many calls fail
            log.warning("nbrpc agent %r: worker %r (rank %d) %s", self.name, name, rank,
                        self._unanswered_why(cut))
            self.agent.events.add("peer-unreachable", "", name, 0, 0)
        self._fail_unanswered()

    def _fail_unanswered(self) -> None:
        """Fails the calls in flight to members that reported that their answers
        cannot come here (when the report comes, and at each tick those made since)."""
        if self._answers_cut:
            for rank in self.agent.caller.peers_waited_on() & self._answers_cut.keys():
                self.agent.caller.fail_calls_to(rank, self.members.peer_name(rank),
                                                self._unanswered_why(self._answers_cut[rank]))

    def _unanswered_why(self, cut: LinkCut) -> str:
        return (f"is out of reach from {self.name!r}: its answers cannot come back (it reported "
                f"its connection to {self.name!r} down for {cut.down_s:.1f} s, while requests "
                "to it get through and the group still counts it a member: a firewall or a "
                "network cut one way? calls go through again once it is mended)")

    def _forget_cuts(self, rank: int) -> None:
        """``rank`` left the group: a process that takes its rank again starts afresh."""
        self._cuts_told.pop(rank, None)
        self._answers_cut.pop(rank, None)
        self._mended.pop(rank, None)

    def _declare_dead(self, now: float) -> None:
        """Coordinator: declare dead the members the rules give up on. A down
        link that comes due before the next tick is checked again then (a lost
        host is declared dead at link_timeout, not up to a tick later)."""
        opts = self.options
        down = {r: self.io.link_down_since(r) for r in self.coordinator.last_seen}
        for rank in self.coordinator.expired(now, opts.failure_timeout, opts.link_timeout, down):
            why = self._death(now, down.get(rank))
            self.send_all(self.coordinator.on_leave(rank, dead=True, why=why))
            self.agent.remove_member(rank, dead=True, why=why)
        self._recheck_at(now, self.coordinator.link_due(opts.link_timeout, down))

    def _recheck_at(self, now: float, due: float | None) -> None:
        """Checks the links again at ``due`` if that comes before the next tick."""
        if due is not None and due < now + self.options.heartbeat_interval and not self._recheck_due:
            self._recheck_due = True
            self.io.call_later(max(0.0, due - now) + 0.01, self._recheck_links)

    def _recheck_links(self) -> None:
        """The coordinator's verdicts, or a member's calls to a peer out of
        reach, at the moment a down link comes due rather than a tick later."""
        self._recheck_due = False
        now, beat = time.monotonic(), self.options.heartbeat_interval
        if now - self.last_tick > beat + max(1.0, beat):
            return  # this process was stalled: the tick, late too, resets who it watches
        if (self.agent.state == "stopped" or not self.joined.is_set() or self.join_error
                or self.leaving.cut):
            return
        if self.coordinator is not None:
            self._declare_dead(now)
        else:
            for rank in self._peers_waited_on():
                self._fail_if_cut(now, rank, self.io.link_down_since(rank))

    def _death(self, now: float, down_since: float | None) -> str:
        if down_since is not None and now - down_since > self.options.link_timeout:
            return "died (its connection closed)"
        return f"died (no heartbeat for {self.options.failure_timeout:g} s)"

    def _heard_heartbeat(self, beat: Heartbeat) -> None:
        """A heartbeat from someone this agent no longer counts as a member:
        it was wrongly declared dead. The coordinator takes the member back
        (as a re-join); a member whose coordinator came back joins it again."""
        m = beat.member
        if self.coordinator is not None:
            if self.coordinator.readmits(m.rank, m.incarnation) and self.agent.state == "ready":
                log.warning("nbrpc coordinator %r: %r (rank %d) is alive after all; "
                            "taking it back", self.name, m.name, m.rank)
                self.readmitted += 1
                self.on_join(Join(m, beat.world_size))
        elif m.rank == 0 and 0 not in self.members and self.agent.state == "ready":
            log.warning("nbrpc agent %r: the coordinator %r is alive after all; joining "
                        "it again", self.name, m.name)
            self.rejoin(m.address)  # (counted in readmitted once it answers)

    def rejoin(self, address: str | None = None) -> None:
        self.coordinator_seen = time.monotonic()
        self.io.set_address(0, address or self.coordinator_address)
        self.send_all([(0, Join(self.me, self.world_size))])

    def _evicted(self) -> None:
        """The coordinator declared this (busy or stopped, but alive) worker dead."""
        if self.agent.state == "stopping":
            self.leaving.cut_short("the coordinator declared this worker dead")
            return
        if self.agent.state != "ready":
            return
        log.warning("nbrpc agent %r was declared dead by the coordinator (it was not heard "
                    "from in time); joining again. Calls to it meanwhile failed.", self.name)
        self.readmitted += 1
        self.rejoin()
