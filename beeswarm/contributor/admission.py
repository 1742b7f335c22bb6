"""Who a full stage admits first: entries whose payer holds credit, then newcomers within their free allowance,
then those past it (`tier`); within a tier, whoever asked first.

A stage is stateless about who waits: a refused entry backs off and asks again (at least every 2 s). So
the stage remembers, for WAIT_MEMORY_S after each refusal, the payers it refused for lack of room, their tier
and when they were first refused; when room frees, a session is refused while one of a higher tier, or of its
own tier refused before it, is still waiting for it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from beeswarm.credits.ledger import FREE_ALLOWANCE

WAIT_MEMORY_S = 4.0  # longer than an entry's longest backoff between two asks (client.attempts.BUSY_BACKOFF_S)
MAX_WAITING = 1024  # payers remembered (the lowest tiers are forgotten first)


def tier(balance: int | None) -> int:
    """2: holds credit; 1: within the free allowance (or unknown to the ledger); 0: past it."""
    if balance is not None and balance > 0:
        return 2
    return 1 if balance is None or balance >= -FREE_ALLOWANCE else 0


class Waiting:
    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self._lock = threading.Lock()
        # payer -> (tier, when it was first refused, when last): its place in the queue, and whether it still asks
        self._refused: dict[str, tuple[int, float, float]] = {}

    def refused(self, payer: str, rank: int) -> None:
        with self._lock:
            self._prune()
            now = self.clock()
            first = self._refused[payer][1] if payer in self._refused else now
            self._refused[payer] = (rank, first, now)
            if len(self._refused) > MAX_WAITING:  # the lowest tier, the latest in it, is forgotten first
                del self._refused[min(self._refused, key=lambda p: (self._refused[p][0], -self._refused[p][1]))]

    def ahead(self, payer: str, rank: int) -> int:
        """How many payers wait for room before `payer` (of tier `rank`): of a higher tier, or of its own refused
        before it (all of its tier, for a payer that was never refused)."""
        with self._lock:
            self._prune()
            mine = self._refused[payer][1] if payer in self._refused else float("inf")
            return sum(t > rank or t == rank and first < mine
                       for p, (t, first, _) in self._refused.items() if p != payer)

    def __len__(self) -> int:
        """Payers remembered as waiting (MAX_WAITING at most)."""
        with self._lock:
            return len(self._refused)

    def _prune(self) -> None:
        cutoff = self.clock() - WAIT_MEMORY_S
        self._refused = {p: w for p, w in self._refused.items() if w[2] >= cutoff}

    def admitted(self, payer: str) -> None:
        with self._lock:
            self._refused.pop(payer, None)
