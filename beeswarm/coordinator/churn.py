"""When the coordinator plans again: churn damped (pure, the caller's clock).

A change (a member joining or leaving, new figures, a standing moved) marks the plan out of date; it is planned
again once nothing has changed for SETTLE_BEATS heartbeat intervals, or MAX_WAIT_BEATS intervals after the first
change not planned for at the latest, so a join storm gives a few epochs, not one per arrival.
"""
from __future__ import annotations

from dataclasses import dataclass

SETTLE_BEATS = 1.0
MAX_WAIT_BEATS = 4.0


@dataclass
class Churn:
    interval: float  # the swarm's heartbeat, seconds
    pending: bool = True  # a change no plan has taken in yet (a new leader plans at once)
    _first: float = 0.0  # the first change not planned for
    _last: float = 0.0  # the latest change

    def changed(self, now: float) -> None:
        if not self.pending:
            self._first = now
        self.pending, self._last = True, now

    def settled(self, now: float) -> bool:
        """A change is pending, and quiet for SETTLE_BEATS (or pending for MAX_WAIT_BEATS): time to plan."""
        return self.pending and (now - self._last >= SETTLE_BEATS * self.interval or
                                 now - self._first >= MAX_WAIT_BEATS * self.interval)

    def planned(self) -> None:
        self.pending = False

    def lead(self) -> None:
        """This node just claimed the lease: plan at once."""
        self.pending, self._first, self._last = True, 0.0, 0.0
