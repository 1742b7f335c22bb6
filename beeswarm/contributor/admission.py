"""Who a full stage admits first: entries whose payer holds credit, then newcomers within their free allowance,
then those past it (`tier`).

A stage is stateless about who waits: a refused entry backs off and asks again (at least every 2 s). So
the stage remembers, for WAIT_MEMORY_S, the payers it refused for lack of room and their tier; when room
frees, a session of a lower tier is refused while one of a higher tier is still waiting for it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from beeswarm.coordinator.credit_ledger import FREE_ALLOWANCE

WAIT_MEMORY_S = 4.0  # longer than an entry's longest backoff between two asks (client.swarm.BUSY_BACKOFF_S)
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
        self._refused: dict[str, tuple[int, float]] = {}  # payer -> (tier, when it was last refused for room)

    def refused(self, payer: str, rank: int) -> None:
        with self._lock:
            self._prune()
            self._refused[payer] = (rank, self.clock())
            if len(self._refused) > MAX_WAITING:
                del self._refused[min(self._refused, key=lambda p: self._refused[p])]

    def ahead(self, payer: str, rank: int) -> int:
        """How many payers of a higher tier than `rank` wait for room now."""
        with self._lock:
            self._prune()
            return sum(t > rank for p, (t, _) in self._refused.items() if p != payer)

    def _prune(self) -> None:
        cutoff = self.clock() - WAIT_MEMORY_S
        self._refused = {p: (t, at) for p, (t, at) in self._refused.items() if at >= cutoff}

    def admitted(self, payer: str) -> None:
        with self._lock:
            self._refused.pop(payer, None)
