"""Probation: how often an entry audits a stage follows what the swarm knows of it.

A stage nobody has audited yet (a new key) has every session audited whole when it ends, before the
generation returns, so a newcomer that lies is caught in the first generation routed through it and its
tokens are taken back before a user keeps them. Each audit it passes halves that chance once it has
passed PROBATION_PASSES, until it falls below the entry's per-step rate, which alone then applies.

What the swarm knows is the coordinator's `Ledger` of passed audits: entries report each pass with the
stage's own signed commitment to the session (`protocol.audit.Passed`), the ledger counts every
(stage, session) once and at most PER_ENTRY passes from any one entry (no single user, or a liar's
accomplice, vouches a stage out of probation), and it travels in the signed plan (`PlanState.standings`),
so a new entry or a new coordinator starts from it. An entry also counts the passes it saw itself.
A liar with many keys and accomplice entries can still forge history: identities cost nothing here.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

PROBATION_PASSES = 3  # audits passed before a stage's sessions stop being audited whole every time
PER_ENTRY = 2  # passes one entry can add to a stage's standing in the ledger
PUBLISHED_UP_TO = 16  # standings above this do not change the plan (no new epoch for them)
MAX_STAGES = 4096  # stages the ledger keeps (the least trusted go first)
MAX_SESSIONS = 65536  # (stage, session) pairs remembered against double counting


def session_audit_chance(passed: int, rate: float) -> float:
    """The chance an entry audits a stage's whole session when it ends, given the audits the stage passed and
    the entry's per-step rate: 1 on probation, then halved per pass, 0 once below `rate`."""
    if passed < PROBATION_PASSES:
        return 1.0
    chance = 0.5 ** (passed - PROBATION_PASSES + 1)
    return chance if chance > rate else 0.0


@dataclass
class Ledger:
    """The coordinator's count of audits each stage passed (bounded: MAX_STAGES, MAX_SESSIONS)."""

    passed: dict[str, int] = field(default_factory=dict)
    _vouched: dict[tuple[str, str], int] = field(default_factory=dict)  # (stage, entry) -> passes added
    _sessions: OrderedDict[tuple[str, str], None] = field(default_factory=OrderedDict)

    def credit(self, stage: str, entry: str, session: str) -> bool:
        """Count a pass of `stage` in `entry`'s `session`; False when it does not count (seen, or the entry's
        share is used)."""
        if (stage, session) in self._sessions or self._vouched.get((stage, entry), 0) >= PER_ENTRY:
            return False
        self._sessions[stage, session] = None
        if len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        self._vouched[stage, entry] = self._vouched.get((stage, entry), 0) + 1
        if len(self._vouched) > MAX_SESSIONS:  # (an entry forgotten here may vouch again: a small leak of trust)
            del self._vouched[next(iter(self._vouched))]
        self.passed[stage] = self.passed.get(stage, 0) + 1
        self._bound()
        return True

    def forget(self, stage: str) -> None:
        """A stage caught lying starts from nothing (it is sentenced anyway)."""
        self.passed.pop(stage, None)
        self._vouched = {k: n for k, n in self._vouched.items() if k[0] != stage}

    def merge(self, standings: dict[str, int]) -> None:
        """Take in the standings of an earlier coordinator's plan (the larger count of each stage)."""
        for stage, passed in standings.items():
            self.passed[stage] = max(passed, self.passed.get(stage, 0))
        self._bound()

    def published(self, nodes: list[str], most: int) -> dict[str, int]:
        """The standings a plan carries: those of `nodes` (the first `most` with any), capped at PUBLISHED_UP_TO."""
        known = [n for n in dict.fromkeys(nodes) if self.passed.get(n)][:most]
        return {n: min(self.passed[n], PUBLISHED_UP_TO) for n in known}

    def _bound(self) -> None:
        if len(self.passed) > MAX_STAGES:
            kept = sorted(self.passed, key=self.passed.__getitem__)[-MAX_STAGES // 2:]
            self.passed = {stage: self.passed[stage] for stage in kept}
            self._vouched = {k: n for k, n in self._vouched.items() if k[0] in self.passed}
