"""Peers that misbehave are banned for a growing interval."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

BASE_S = 5.0
MAX_S = 3600.0
STRIKES_PER_BAN = 3  # malformed messages tolerated before a ban
MAX_RECORDS = 10_000  # past that, the records of peers not banned now go, the least recently struck first


@dataclass
class _Record:
    strikes: int = 0
    bans: int = 0
    until: float = 0.0
    reason: str = ""
    struck: float = 0.0  # when it was last struck


class BanList:
    def __init__(self, clock=time.monotonic):
        self._clock = clock
        self._records: dict[str, _Record] = {}
        self._lock = threading.Lock()

    def strike(self, peer: str, reason: str, severe: bool = False) -> bool:
        """Count a misbehaviour; returns True when the peer is now banned."""
        with self._lock:
            if peer not in self._records and len(self._records) >= MAX_RECORDS:
                self._forget_oldest()
            rec = self._records.setdefault(peer, _Record())
            rec.struck = self._clock()
            rec.strikes += STRIKES_PER_BAN if severe else 1
            if rec.strikes < STRIKES_PER_BAN:
                return False
            rec.strikes = 0
            rec.until = self._clock() + min(MAX_S, BASE_S * 2**rec.bans)
            rec.bans += 1
            rec.reason = reason
            return True

    def _forget_oldest(self) -> None:
        """Make room for a new record (hold the lock): a new identity costs nothing, so an attacker with many
        would otherwise grow this without bound. Bans in force stay."""
        now = self._clock()
        idle = sorted((rec.struck, peer) for peer, rec in self._records.items() if rec.until <= now)
        for _, peer in idle[:max(1, len(self._records) - MAX_RECORDS // 2)]:
            del self._records[peer]

    def lift(self, peer: str) -> None:
        """End `peer`'s ban and forget its strikes: it was banned on a word later found false."""
        with self._lock:
            self._records.pop(peer, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._records)

    def is_banned(self, peer: str) -> bool:
        with self._lock:
            rec = self._records.get(peer)
            return rec is not None and rec.until > self._clock()

    def remaining(self, peer: str) -> float:
        with self._lock:
            rec = self._records.get(peer)
            return max(0.0, rec.until - self._clock()) if rec else 0.0
