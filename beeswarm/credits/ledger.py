"""The coordinator's book of credits: balances from entries' receipts, the reasons it refuses one.

Serving earns what a receipt says the entry accepted (layer-tokens); generating spends the same units,
from the entry's balance and then from a free allowance (FREE_ALLOWANCE), so a newcomer can try the swarm.
A receipt counts once: the ledger remembers recent ones (`recent`, MEMORY of them) and refuses any issued at
or before its `horizon` (the latest issue time it forgot; it forgets the earliest issued first), so the memory
stays bounded and a replay never counts. It publishes the newest MAX_RECENT it remembers, with a horizon
moved past the rest, so that its successor refuses their replays too.
A stage caught lying forfeits its balance and every receipt after. A stage is never credited faster than
its capacity (`capacity`: layer-tokens per second it could have served): receipts for work it could not
have done are refused, as are those of a stage whose capacity is unknown (not a benchmarked contributor), so
self-dealing earns no more than the compute a stage can really spend.

Pure: signatures are checked by the caller (`verified`), the clock is passed in.
"""
from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

from beeswarm.protocol.credits import MAX_BALANCES, MAX_RECENT, UNITS_MAX, Balance, LedgerState, Receipt, Seen

FREE_ALLOWANCE = 2_000_000  # layer-tokens an identity may spend before it earns (~25k tokens of an 80-layer model)
MAX_AGE_S = 6 * 3600.0  # receipts issued longer ago are refused (a stage hands its in within seconds)
MAX_SKEW_S = 30.0  # receipts issued further in the future (by the entry's clock) are refused
CAPACITY_WINDOW_S = 600.0  # a stage's credit is checked against its capacity over this window
MEMORY = 8 * MAX_RECENT  # receipt digests the coordinator remembers (it publishes the newest MAX_RECENT)
UNKNOWN_CAPACITY = "the stage's capacity is unknown: only a contributor whose heartbeat carries its benchmark earns"
RECEIPTS_PER_WINDOW = MEMORY // 4  # receipts one stage may be credited for in the window (sessions served), so
# that no one stage's flood forgets the others' receipts still on their way


@dataclass
class Account:
    earned: int = 0
    spent: int = 0
    forfeited: bool = False
    window: deque[tuple[float, int]] = field(default_factory=deque)  # (when recorded, units), for the capacity check
    hours: dict[int, list[int]] = field(default_factory=dict)  # hour (unix time // 3600) -> [earned, spent]

    def add(self, now: float, earned: int, spent: int) -> None:
        """(Sums saturate at UNITS_MAX, so that a published ledger always decodes.)"""
        self.earned, self.spent = min(UNITS_MAX, self.earned + earned), min(UNITS_MAX, self.spent + spent)
        hour = int(now // 3600)
        bucket = self.hours.setdefault(hour, [0, 0])
        bucket[0], bucket[1] = min(UNITS_MAX, bucket[0] + earned), min(UNITS_MAX, bucket[1] + spent)
        for old in [h for h in self.hours if h <= hour - 24]:
            del self.hours[old]

    def last(self, now: float, hours: int) -> tuple[int, int]:
        """(earned, spent) in the last `hours` whole hours and this one."""
        hour = int(now // 3600)
        buckets = [b for h, b in self.hours.items() if h > hour - hours]
        return min(UNITS_MAX, sum(b[0] for b in buckets)), min(UNITS_MAX, sum(b[1] for b in buckets))

    def served_since(self, since: float) -> int:
        while self.window and self.window[0][0] <= since:
            self.window.popleft()
        return sum(units for _, units in self.window)

    @property
    def balance(self) -> int:
        return self.earned - self.spent


@dataclass
class CreditLedger:
    swarm: str
    term: int = 0  # the lease term of the ledger this one continues (it and `seq` order ledgers)
    seq: int = 0
    horizon: float = 0.0
    accounts: dict[str, Account] = field(default_factory=dict)
    recent: dict[bytes, float] = field(default_factory=dict)  # receipt key -> issued
    _by_issue: list[tuple[float, bytes]] = field(default_factory=list)  # a heap over `recent`: the earliest first

    def balance(self, node: str) -> int:
        account = self.accounts.get(node)
        return account.balance if account else 0

    def can_spend(self, node: str) -> int:
        """Units `node` may still generate before it is past its free allowance."""
        return self.balance(node) + FREE_ALLOWANCE

    def refusal(self, r: Receipt, verified: bool, now: float, capacity: float | None) -> str | None:
        """Why `r` cannot be counted (None: it can). `verified`: the payer's signature checks; `capacity`: the
        stage's layer-tokens per second at most (None: unknown)."""
        if r.swarm != self.swarm:
            return f"a receipt for another swarm ({r.swarm!r}; this is {self.swarm!r})"
        if not verified:
            return "forged: the payer's signature does not verify"
        if r.payer == r.stage or r.entry == r.stage:
            return "an identity cannot pay itself"
        if r.key in self.recent:
            return "already counted (a replay)"
        if not math.isfinite(r.issued) or r.issued <= self.horizon or r.issued < now - MAX_AGE_S:
            return "too old: issued before what the ledger remembers, it cannot be told from a replay"
        if r.issued > now + MAX_SKEW_S:
            return "issued in the future"
        stage = self.accounts.get(r.stage)
        if stage is not None and stage.forfeited:
            return "the stage was caught lying by an audit: it forfeited its credit"
        if capacity is None or not math.isfinite(capacity) or capacity <= 0:
            return UNKNOWN_CAPACITY
        done = stage.served_since(now - CAPACITY_WINDOW_S) if stage else 0
        if stage is not None and len(stage.window) >= RECEIPTS_PER_WINDOW:
            return f"more sessions than a stage is credited for in {CAPACITY_WINDOW_S / 60:.0f} minutes"
        if done + r.units > capacity * CAPACITY_WINDOW_S:
            return f"more work than the stage can have served ({capacity:.0f} layer-tokens/s at most)"
        return None

    def record(self, r: Receipt, verified: bool, now: float, capacity: float | None) -> str | None:
        """Count `r` (the stage earns, the payer spends) unless refused; returns the refusal, else None."""
        why = self.refusal(r, verified, now, capacity)
        if why is not None:
            return why
        stage, payer = self._account(r.stage), self._account(r.payer)
        stage.add(now, r.units, 0)
        payer.add(now, 0, r.units)
        stage.served_since(now - CAPACITY_WINDOW_S)  # (drops what fell out of the window: it stays bounded)
        stage.window.append((now, r.units))
        self._remember(r.key, r.issued)
        while len(self.recent) > MEMORY:  # the earliest issued go: a flood of late-dated ones cannot push
            issued, key = heapq.heappop(self._by_issue)  # the horizon past receipts still on their way
            del self.recent[key]
            self.horizon = max(self.horizon, issued)
        self.seq += 1
        self._bound()
        return None

    def forfeit(self, stage: str) -> bool:
        """A stage caught lying: its balance goes, and its receipts are refused from now on. False: already so."""
        account = self._account(stage)
        if account.forfeited:
            return False
        account.forfeited = True
        account.window.clear()
        account.earned = min(account.earned, account.spent)  # its balance goes; a debt stands
        self.seq += 1
        return True

    def _remember(self, key: bytes, issued: float) -> None:
        self.recent[key] = issued
        heapq.heappush(self._by_issue, (issued, key))

    def state(self, coordinator: str, now: float) -> LedgerState:
        """What is published: the balances, and the newest MAX_RECENT receipts remembered with a horizon past the
        others (one gossip message, whatever the swarm's rate)."""
        newest = heapq.nlargest(MAX_RECENT + 1, self.recent.items(), key=lambda item: item[1])
        horizon = max(self.horizon, newest[MAX_RECENT][1]) if len(newest) > MAX_RECENT else self.horizon
        return LedgerState(swarm=self.swarm, term=self.term, seq=self.seq, coordinator=coordinator, horizon=horizon,
                           balances=tuple(Balance(n, a.earned, a.spent, a.forfeited, a.last(now, 1), a.last(now, 24))
                                          for n, a in sorted(self.accounts.items())),
                           recent=tuple(Seen(key, issued) for key, issued in reversed(newest[:MAX_RECENT])))

    def continue_from(self, state: LedgerState, now: float) -> bool:
        """Take over a ledger published later than this one, by (term, seq) (a coordinator taking over continues
        its predecessor's); False when `state` is not newer or is another swarm's. The last hour's and day's
        figures go on from the published ones (the day's older part counted an hour ago)."""
        if state.swarm != self.swarm or (state.term, state.seq) <= (self.term, self.seq):
            return False
        self.term, self.seq, self.horizon = state.term, state.seq, state.horizon
        hour = int(now // 3600)
        self.accounts = {b.node: Account(b.earned, b.spent, b.forfeited, hours={
            hour: list(b.hour), hour - 1: [b.day[0] - b.hour[0], b.day[1] - b.hour[1]]}) for b in state.balances}
        self.recent, self._by_issue = {}, []
        for seen in state.recent:
            self._remember(seen.key, seen.issued)
        return True

    def _account(self, node: str) -> Account:
        if node not in self.accounts:
            self.accounts[node] = Account()
        return self.accounts[node]

    def _bound(self) -> None:
        """Past MAX_BALANCES accounts, the emptiest go (a forgotten account starts again from nothing)."""
        if len(self.accounts) > MAX_BALANCES:
            kept = sorted(self.accounts, key=lambda n: (self.accounts[n].forfeited,
                                                        self.accounts[n].earned + self.accounts[n].spent))
            self.accounts = {n: self.accounts[n] for n in kept[-(MAX_BALANCES * 3 // 4):]}


def rank(state: LedgerState, node: str) -> int | None:
    """`node`'s place by balance in the published ledger (1: the most), None when it has no account."""
    order = sorted(state.balances, key=lambda b: b.balance, reverse=True)
    return next((i + 1 for i, b in enumerate(order) if b.node == node), None)
