"""Peers that misbehave are banned for a growing interval."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

BASE_S = 5.0
MAX_S = 3600.0
STRIKES_PER_BAN = 3  # malformed messages tolerated before a ban


@dataclass
class _Record:
    strikes: int = 0
    bans: int = 0
    until: float = 0.0
    reason: str = ""


class BanList:
    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._records: dict[str, _Record] = {}
        self._lock = threading.Lock()

    def strike(self, peer: str, reason: str, severe: bool = False) -> bool:
        """Count a misbehaviour; returns True when the peer is now banned."""
        with self._lock:
            rec = self._records.setdefault(peer, _Record())
            rec.strikes += STRIKES_PER_BAN if severe else 1
            if rec.strikes < STRIKES_PER_BAN:
                return False
            rec.strikes = 0
            rec.until = self._clock() + min(MAX_S, BASE_S * 2**rec.bans)
            rec.bans += 1
            rec.reason = reason
            return True

    def is_banned(self, peer: str) -> bool:
        with self._lock:
            rec = self._records.get(peer)
            return rec is not None and rec.until > self._clock()

    def remaining(self, peer: str) -> float:
        with self._lock:
            rec = self._records.get(peer)
            return max(0.0, rec.until - self._clock()) if rec else 0.0
