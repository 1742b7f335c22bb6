"""Probation: how often an entry audits a stage follows what the swarm knows of it, layer by layer.

A stage whose layers have not been checked enough (a new key, or layers it did not serve before) has every session
through it audited whole when it ends, on every layer of its span (by pieces where nobody holds the span: cover
by the members serving those layers, spot checks by any with room for one), before the generation returns: a
newcomer that lies is caught in the first generation routed through it, and its tokens are taken back before a
user keeps them. Probation counts layer checks, not audits: a layer leaves it once it has been checked on
PROBATION_STEPS steps, enough that a lie told in that layer on a fraction LIE_RATE of its steps would have been
caught with probability CONFIDENCE (below). Past probation, each PROBATION_STEPS / 3 steps more checked halve the
chance a session is audited whole again, until it falls below the entry's per-step rate, which alone then applies.

The closed form. A check of a layer compares the stage's hidden states at the layer's two boundaries on every step
of the session up to the audited one. A stage lying in one layer on a fraction f of its steps escapes a check of S
steps of that layer with probability (1 - f)^S, whatever the other layers do, so

    P(caught by its layer checks) = 1 - (1 - f)^S   and   S >= log(1 - CONFIDENCE) / log(1 - LIE_RATE)

makes it at least CONFIDENCE for every f >= LIE_RATE: 90 steps for 99% at 5% (three 32-token chats). Past
probation, a spot check draws m of a span's L layers, so a lie in one layer is found by an audited session with
probability at least m / L (`pieces.SPOT_LAYERS`), and by s audited sessions with 1 - (1 - m / L)^s.

What the swarm knows is the coordinator's `Ledger` of checks: entries report each pass with the stage's own signed
commitment to the session (`protocol.audit.Passed`, naming the layers and steps checked), the ledger counts every
(stage, session) once and at most PER_ENTRY sessions from any one entry (no single user, or a liar's accomplice,
vouches a stage out of probation), and it travels in the signed plan (`PlanState.standings`), so a new entry or a
new coordinator starts from it. An entry also counts the checks it saw itself. A liar with many keys and
accomplice entries can still forge history: identities cost nothing here.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from beeswarm.protocol.spans import Span

CONFIDENCE = 0.99  # that a layer's probation catches a lie told in it on LIE_RATE of its steps
LIE_RATE = 0.05
PROBATION_STEPS = math.ceil(math.log(1 - CONFIDENCE) / math.log(1 - LIE_RATE))  # 90
PER_ENTRY = 2  # sessions one entry can add to a stage's standing in the ledger
PUBLISHED_UP_TO = 4 * PROBATION_STEPS  # standings above this do not change the plan (no new epoch for them)
MAX_STAGES = 4096  # stages the ledger keeps (the least trusted go first)
MAX_SESSIONS = 65536  # (stage, session) pairs remembered against double counting


def session_audit_chance(checked: int, rate: float) -> float:
    """The chance an entry audits a stage's whole session when it ends, given the steps its layers were checked on
    (the least of them) and the entry's per-step rate: 1 on probation, then halved per PROBATION_STEPS / 3 steps
    more, 0 once below `rate`."""
    if checked < PROBATION_STEPS:
        return 1.0
    chance = 0.5 ** (1 + 3 * (checked - PROBATION_STEPS) / PROBATION_STEPS)
    return chance if chance > rate else 0.0


def caught_chance(steps: int, lie_rate: float) -> float:
    """The chance checks of a layer on `steps` steps catch a lie told there on `lie_rate` of them."""
    return 1.0 - (1.0 - lie_rate) ** steps


def runs(checked: Mapping[int, int], most: int) -> list[tuple[Span, int]]:
    """Per-layer counts as runs of equal ones, each capped at `most`: [(span, count)], layers in order."""
    out: list[tuple[Span, int]] = []
    for layer in sorted(checked):
        n = min(checked[layer], most)
        if out and out[-1][0].end == layer and out[-1][1] == n:
            out[-1] = (Span(out[-1][0].start, layer + 1), n)
        else:
            out.append((Span(layer, layer + 1), n))
    return out


@dataclass
class Ledger:
    """The coordinator's count of the steps each stage's layers were checked on (bounded: MAX_STAGES,
    MAX_SESSIONS)."""

    checked: dict[str, dict[int, int]] = field(default_factory=dict)  # stage -> layer -> steps
    _vouched: dict[tuple[str, str], int] = field(default_factory=dict)  # (stage, entry) -> sessions added
    _sessions: OrderedDict[tuple[str, str], None] = field(default_factory=OrderedDict)

    def credit(self, stage: str, entry: str, session: str, layers: Iterable[int], steps: int) -> bool:
        """Count a pass of `stage` in `entry`'s `session`, of `layers` on `steps` steps; False when it does not count
        (seen, or the entry's share is used)."""
        if (stage, session) in self._sessions or self._vouched.get((stage, entry), 0) >= PER_ENTRY:
            return False
        self._sessions[stage, session] = None
        if len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        self._vouched[stage, entry] = self._vouched.get((stage, entry), 0) + 1
        if len(self._vouched) > MAX_SESSIONS:  # (an entry forgotten here may vouch again: a small leak of trust)
            del self._vouched[next(iter(self._vouched))]
        mine = self.checked.setdefault(stage, {})
        for layer in layers:
            mine[layer] = mine.get(layer, 0) + steps
        self._bound()
        return True

    def least(self, stage: str, span: Span) -> int:
        """The steps every layer of `span` of `stage` was checked on."""
        mine = self.checked.get(stage, {})
        return min(mine.get(layer, 0) for layer in range(span.start, span.end))

    def forget(self, stage: str) -> None:
        """A stage caught lying starts from nothing (it is sentenced anyway)."""
        self.checked.pop(stage, None)
        self._vouched = {k: n for k, n in self._vouched.items() if k[0] != stage}

    def merge(self, standings: Mapping[str, Mapping[int, int]]) -> None:
        """Take in the standings of an earlier coordinator's plan (the larger count of each layer)."""
        for stage, layers in standings.items():
            mine = self.checked.setdefault(stage, {})
            for layer, steps in layers.items():
                mine[layer] = max(steps, mine.get(layer, 0))
        self._bound()

    def published(self, nodes: list[str], most: int) -> dict[str, list[tuple[Span, int]]]:
        """The standings a plan carries: those of `nodes` (the first `most` with any), as runs of layers with their
        steps checked, capped at PUBLISHED_UP_TO."""
        known = [n for n in dict.fromkeys(nodes) if self.checked.get(n)][:most]
        return {n: runs(self.checked[n], PUBLISHED_UP_TO) for n in known}

    def _bound(self) -> None:
        if len(self.checked) > MAX_STAGES:
            def least(stage: str) -> int:
                return min(self.checked[stage].values(), default=0)
            kept = sorted(self.checked, key=least)[-MAX_STAGES // 2:]
            self.checked = {stage: self.checked[stage] for stage in kept}
            self._vouched = {k: n for k, n in self._vouched.items() if k[0] in self.checked}
