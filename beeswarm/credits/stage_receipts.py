"""A stage's receipts: taken from the entries it served (`ids.RECEIPT`), handed in to the coordinator
(`ids.CREDITS`) until it answers.

A receipt the coordinator recorded is kept for RECHECK_S and handed in again if the lease changes hands
meanwhile: a coordinator killed before its ledger reached its successor would otherwise take the credit
with it. The successor continues the newest ledger it followed, so a receipt it already holds is refused
as counted, never counted twice. One refused because the coordinator has not heard this stage's benchmark
(a coordinator new to it, or a stage just back from a freeze) is handed in again while it is under RECHECK_S old.
"""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import trio

from beeswarm.credits.ledger import UNKNOWN_CAPACITY
from beeswarm.credits.receipts import receipt_verifies
from beeswarm.p2p.errors import NodeError, PeerUnavailable
from beeswarm.p2p.node import Node
from beeswarm.protocol import ErrorReply, ProtocolError, RemoteError
from beeswarm.protocol.credits import MAX_RECEIPTS, Given, HandIn, Kept, Receipt, Recorded
from beeswarm.protocol.rpcs import HAND_IN, RECEIPT

log = logging.getLogger(__name__)

HAND_IN_EVERY_S = 1.0
RECHECK_S = 120.0
MAX_PENDING = 4096
MAX_PENDING_PER_ENTRY = 256  # so one entry's flood cannot push others' receipts out


@dataclass
class ReceiptCounts:
    taken: int = 0  # receipts entries gave this stage
    recorded: int = 0  # counted by a coordinator
    refused: int = 0  # refused by one (already counted on a recheck aside)
    last_refusal: str = ""


class ReceiptBox:
    def __init__(self, node: Node, leader: Callable[[], str | None], swarm: str,
                 local: Callable[[str, HandIn], object] | None = None, clock: Callable[[], float] = time.monotonic):
        """`leader()`: the coordinator to hand receipts in to (None: none now); `local`: the coordinator of this
        node (`CreditKeeper.hand_in`), for when it leads."""
        self.node, self.leader, self.swarm, self.local, self.clock = node, leader, swarm, local, clock
        self.counts = ReceiptCounts()
        self._lock = threading.Lock()
        self._pending: deque[Receipt] = deque()
        self._recorded: deque[tuple[Receipt, str, float]] = deque()  # (receipt, by whom, when): rechecked
        self._again: set[bytes] = set()  # keys of receipts handed in again: counted before, whatever the answer

    def start(self) -> None:
        self.node.serve(RECEIPT, self._on_receipt)
        self.node.add_task(self._loop)

    def _on_receipt(self, peer: str, msg: Given) -> Kept | ErrorReply:
        r = msg.receipt
        if r.entry != peer or r.stage != self.node.peer_id:
            raise ProtocolError("a receipt is given by its entry to its stage")
        if r.swarm != self.swarm:
            raise ProtocolError(f"a receipt for another swarm ({r.swarm!r})")
        if not math.isfinite(r.issued) or not receipt_verifies(r):
            raise ProtocolError("a receipt whose signature does not verify")
        with self._lock:
            if any(p.key == r.key for p in self._pending):
                return Kept()  # given twice
            if sum(p.entry == peer for p in self._pending) >= MAX_PENDING_PER_ENTRY or \
                    len(self._pending) >= MAX_PENDING:
                return ErrorReply(error="too many receipts wait for a coordinator here: try later", busy=True)
            self.counts.taken += 1
            self._pending.append(r)
        log.info("receipt from %s for session %s: %d prefill + %d decode layer-tokens", r.entry, r.session, r.prefill,
                 r.decode)
        return Kept()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    async def _loop(self) -> None:
        while True:
            await trio.sleep(HAND_IN_EVERY_S)
            leader = self.leader()
            if leader is None:
                continue
            with self._lock:
                self._recheck(leader)
                batch = [self._pending.popleft() for _ in range(min(MAX_RECEIPTS, len(self._pending)))]
            if batch:
                await self._hand_in(leader, batch)

    def _recheck(self, leader: str) -> None:
        """(Under the lock.) Hand in again what a coordinator other than `leader` recorded lately."""
        cutoff = self.clock() - RECHECK_S
        while self._recorded and self._recorded[0][2] < cutoff:
            self._recorded.popleft()
        again = [r for r, by, _ in self._recorded if by != leader]
        if again:
            self._recorded = deque(item for item in self._recorded if item[1] == leader)
            self._pending.extendleft(reversed(again))
            self._again.update(r.key for r in again)

    async def _hand_in(self, leader: str, batch: list[Receipt]) -> None:
        msg = HandIn(receipts=tuple(batch))
        try:
            if leader == self.node.peer_id and self.local is not None:
                reply = await trio.to_thread.run_sync(self.local, leader, msg)
            else:
                reply = await self.node.requests.request(leader, HAND_IN, msg, timeout=10.0)
        except (TimeoutError, PeerUnavailable, NodeError, RemoteError) as e:
            reply = e
        if not isinstance(reply, Recorded) or len(reply.refused) != len(batch):
            log.info("could not hand %d receipts in to %s (%s): trying again", len(batch), leader, reply)
            with self._lock:
                self._pending.extendleft(reversed(batch))
            return
        now = self.clock()
        with self._lock:
            for r, why in zip(batch, reply.refused, strict=True):
                if why == UNKNOWN_CAPACITY and time.time() - r.issued < RECHECK_S:
                    self._pending.append(r)  # it has not heard this stage's heartbeat (yet, or since a freeze): later
                    continue
                again = r.key in self._again
                self._again.discard(r.key)
                if not why:
                    self.counts.recorded += 1
                elif why.startswith("already counted") or again and why.startswith("too old"):  # (past its horizon)
                    log.info("%s already counted the receipt for session %s (handed in again)", leader, r.session)
                else:
                    self.counts.refused += 1
                    self.counts.last_refusal = why
                    log.warning("the coordinator refused the receipt for session %s: %s", r.session, why)
                self._recorded.append((r, leader, now))
