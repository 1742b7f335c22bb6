"""Coordinator election: a term-based lease (pure state machine; `service` feeds it the network).

The coordinator publishes (term, peer id, plan epoch) every interval. When those heartbeats stop
for MISSED_BEATS intervals (2.5: two whole beats lost, with half an interval left so a successor is
known within 3 intervals + 1 s even on a loaded machine), the eligible contributor with the
smallest peer id claims term + 1;
the next smallest waits two intervals more, and so on, so a dead first candidate costs little.
Higher terms win; equal terms break by the smaller peer id, so merged partitions converge.
A node that starts a swarm (no bootstrap) claims at once, before it meets anyone, so a swarm starting
at once has its coordinator in its first second; a node that joins through a bootstrap never claims
before it has met the swarm.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

MISSED_BEATS = 2.5
BACKOFF_BEATS = 2  # extra silence each later-ranked candidate waits
PAUSED_BEATS = 2.0  # ticks this far apart mean this process was paused (SIGSTOP, a debugger, swapping)


@dataclass(frozen=True)
class Lease:
    term: int
    leader: str
    epoch: int = 0

    def beats(self, other: Lease | None) -> bool:
        """Does this lease take precedence over `other`?"""
        if other is None:
            return True
        return self.term > other.term or (self.term == other.term and self.leader < other.leader)


class Election:
    def __init__(self, me: str, interval: float, eligible: bool = True,
                 clock: Callable[[], float] = time.monotonic, founder: bool = True):
        """`founder`: this node may lead before it has met anyone (False for a node that joins through a
        bootstrap: until it hears from the swarm, its silence is its own)."""
        self.me, self.interval, self.eligible, self.clock, self.founder = me, interval, eligible, clock, founder
        self.current: Lease | None = None
        self.last_heard = clock()
        self._last_tick: float | None = None
        self._met = False

    @property
    def is_leader(self) -> bool:
        return self.current is not None and self.current.leader == self.me

    def observe(self, lease: Lease) -> bool:
        """Take in a heartbeat; returns True when it is (now) the lease this node follows."""
        if self.current is not None and lease.term == self.current.term and lease.leader == self.current.leader:
            self.current = Lease(lease.term, lease.leader, max(lease.epoch, self.current.epoch))
            self.last_heard = self.clock()
            return True
        if lease.beats(self.current) or self.silent():  # a dead leader's higher term holds no one back
            self.current = lease
            self.last_heard = self.clock()
            return True
        return False

    def silent(self) -> bool:
        """The lease followed (someone else's) has not been heard for MISSED_BEATS intervals."""
        return self.current is not None and not self.is_leader and \
            self.clock() - self.last_heard > MISSED_BEATS * self.interval

    def joined(self) -> None:
        """This node has just met the swarm (its first member): give its coordinator's heartbeats time to reach
        it before counting their silence (a newcomer with a small id would otherwise claim a term it does not
        need). Later arrivals do not restart the wait: in a swarm starting at once, nobody would ever claim."""
        if self.current is None and not self._met:
            self.last_heard = self.clock()
        self._met = True

    def told(self) -> None:
        """A member says the swarm has a coordinator: wait for that one's lease instead of claiming."""
        if self.current is None:
            self.last_heard = self.clock()

    def tick(self, candidates: set[str]) -> Lease | None:
        """Call often. Returns a new lease when this node has just claimed leadership."""
        now = self.clock()
        paused = self._last_tick is not None and now - self._last_tick > PAUSED_BEATS * self.interval
        self._last_tick = now
        if paused:  # the silence was ours, not the leader's: give its beats time to reach us again
            self.last_heard = now
        if self.is_leader and not self.eligible:  # (it learnt others cannot dial it): it stops beating, and the
            self.current, self.last_heard = None, now  # silence makes an eligible candidate claim the next term
            return None
        if self.is_leader or not self.eligible or not (self._met or self.founder):
            return None
        silence = now - self.last_heard
        if self.founder and not self._met and self.current is None and not candidates - {self.me}:
            # the swarm's first node, alone: nobody to wait for
            silence = float("inf")
        dead = self.current.leader if self.current else None
        ranked = sorted((candidates | {self.me}) - {dead})
        wait = (MISSED_BEATS + BACKOFF_BEATS * ranked.index(self.me)) * self.interval
        if silence < wait:
            return None
        term = self.current.term + 1 if self.current else 1
        self.current = Lease(term, self.me, 0)
        self.last_heard = self.clock()
        return self.current

    def next_epoch(self) -> Lease:
        """The leader's lease with its next plan epoch (call only while `is_leader`)."""
        if self.current is None or self.current.leader != self.me:
            raise RuntimeError("only the leader numbers plans")
        self.current = Lease(self.current.term, self.me, self.current.epoch + 1)
        return self.current
