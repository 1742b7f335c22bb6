"""The coordinator's credits: it records the receipts stages hand in (`ids.CREDITS`) in its `CreditLedger`
and publishes the balances, signed and sequenced, on the coordinator topic; the next coordinator continues
from the newest ledger it followed (`PlanFollower.ledger_state`).

Every contributor runs a `CreditKeeper`; only the lease's leader records. Anyone may ask any node for the
ledger it holds (`LedgerRequest`): `beeswarm credits` does. A stage the plan sentences (a failed audit)
forfeits. A stage is credited no faster than its capacity, from the benchmark in its heartbeat (which the
planner routes by: overstating it buys real load).
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import trio

from beeswarm.coordinator.follower import PlanFollower
from beeswarm.credits.ledger import CreditLedger
from beeswarm.credits.receipts import receipt_verifies, sign_ledger
from beeswarm.protocol import ErrorReply, Message, ids
from beeswarm.protocol.credits import HandIn, LedgerRequest, Recorded, SignedLedger
from beeswarm.protocol.rpcs import CREDITS

log = logging.getLogger(__name__)

PUBLISH_AFTER_S = 5.0  # a change is published within this (up to 64 KiB to every member: not every second)
REPUBLISH_S = 30.0  # and the ledger again when nothing changed (for newcomers, and a successor that missed one)
CAPACITY_MARGIN = 4.0  # times a stage's benchmarked layer-tokens/s it may be credited for (batching, bursts)
STEP_TOKENS = 2048  # the longest step the capacity assumes (a long prompt's prefill: the fastest per token)


class CreditKeeper:
    def __init__(self, follower: PlanFollower, swarm: str, clock: Callable[[], float] = time.time):
        self.follower, self.node, self.clock = follower, follower.node, clock
        self.book = CreditLedger(swarm)
        self._lock = threading.Lock()
        self._signed: SignedLedger | None = None  # the book as last published
        self._published_at, self._seq_published = 0.0, -1

    def start(self) -> None:
        self.node.serve(CREDITS, self._on_request)
        self.node.add_task(self._loop)

    def _on_request(self, peer: str, msg: HandIn | LedgerRequest) -> Message:
        if isinstance(msg, LedgerRequest):
            signed = self._signed if self.follower.is_leader else self.follower.ledger
            return signed or ErrorReply(error="no credit ledger heard yet")
        return self.hand_in(peer, msg)

    def hand_in(self, peer: str, msg: HandIn) -> Message:
        """Record the receipts `peer` hands in (each must name it as the stage)."""
        if not self.follower.is_leader:
            return ErrorReply(error="this node is not the coordinator", busy=True)
        now = self.clock()
        refused = []
        with self._lock:
            self._catch_up()
            for r in msg.receipts:
                if r.stage != peer:
                    refused.append("handed in by another peer than its stage")
                    continue
                why = self.book.record(r, receipt_verifies(r), now, self._capacity(r.stage))
                if why is not None:
                    log.info("refused a receipt of %s from %s (session %s): %s", r.stage, r.entry, r.session, why)
                refused.append(why or "")
            seq = self.book.seq
        return Recorded(refused=tuple(refused), seq=seq)

    def _capacity(self, stage: str) -> float | None:
        """Layer-tokens per second `stage` can have served, from the benchmark in its heartbeat: a layer takes
        base + n * per_token ms for a step of n tokens (None: not a benchmarked contributor)."""
        info = self.follower.members.view(with_self=True).get(stage)  # (a coordinator serving layers earns too)
        if info is None or info.role != "contributor":
            return None
        base, per_token = info.bench.get("layer_ms_base"), info.bench.get("layer_ms_per_token")
        if base is None or per_token is None or not math.isfinite(base + per_token) or min(base, per_token) < 0 or \
                base + per_token <= 0:
            return None
        return CAPACITY_MARGIN * 1000.0 * STEP_TOKENS / (base + STEP_TOKENS * per_token)

    def _catch_up(self) -> None:
        """(Under the lock, leading.) Continue a newer ledger followed (a predecessor's), take this lease's term,
        and forfeit the credit of every stage the plan sentences."""
        self.book.continue_from(self.follower.ledger_state, self.clock())
        lease = self.follower.lease
        if lease is not None and lease.term > self.book.term:
            self.book.term = lease.term
        for e in self.follower.state.excluded:
            if e.until and self.book.forfeit(e.node):
                log.warning("%s forfeits its credit: %s", e.node, e.reason)

    async def _loop(self) -> None:
        while True:
            await trio.sleep(PUBLISH_AFTER_S)
            if not self.follower.is_leader:
                self._signed = None
                continue
            with self._lock:
                self._catch_up()
                changed = self._signed is None or self.book.seq != self._seq_published
                if not changed and self.clock() - self._published_at < REPUBLISH_S:
                    continue
                now = self.clock()
                self._signed = sign_ledger(self.node.identity.key_pair, self.book.state(self.node.peer_id, now))
                self._seq_published, self._published_at = self.book.seq, now
            if self.book.seq or self.book.accounts:
                await self.node.publish_async(self.node.topic(ids.COORDINATOR_TOPIC), self._signed)
