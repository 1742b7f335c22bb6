"""The entry's receipts: the work each stage served its sessions, counted from the commitments it checked,
signed per session once the session's audits settled, and given to the stage (`ids.RECEIPT`), which hands
it in to the coordinator (`credits.stage_receipts`). A stage an audit caught gets none.

Work is layer-tokens: a step of q positions through a span of L layers is L*q; positions before the
session's prefill end (the prompt and the tokens that stand, prefilled again after a failover) count as
prefill, the rest as decode.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass

from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from beeswarm.credits.receipts import sign_receipt
from beeswarm.p2p.errors import NodeError, PeerUnavailable
from beeswarm.p2p.node import Node
from beeswarm.p2p.signatures import sign_bytes
from beeswarm.protocol import RemoteError
from beeswarm.protocol.credits import Given, Receipt
from beeswarm.protocol.rpcs import RECEIPT
from beeswarm.protocol.session import open_body
from beeswarm.protocol.step import Commit

log = logging.getLogger(__name__)
GIVE_TIMEOUT_S = 10.0


@dataclass
class Work:
    prefill: int = 0
    decode: int = 0


class ReceiptBook:
    def __init__(self, node: Node, swarm: str, payer: KeyPair | None = None, clock: Callable[[], float] = time.time):
        """`payer`: the key whose account spends (None: this node's own)."""
        self.node, self.swarm, self.clock = node, swarm, clock
        self.payer = payer or node.identity.key_pair
        self.payer_id = str(ID.from_pubkey(self.payer.public_key))
        self._lock = threading.Lock()
        self._giving = threading.Condition(self._lock)
        self._in_flight = 0  # receipts being given
        self._work: dict[str, dict[str, Work]] = {}  # session -> stage -> work accepted
        self._prefill_end: dict[str, int] = {}
        self.given: list[Receipt] = []  # the last receipts signed (bounded), for status and tests

    def vouch(self, session: str) -> tuple[str | None, bytes]:
        """(payer, its signature over the session) for a session's Open; (None, b""): the entry pays itself."""
        if self.payer is self.node.identity.key_pair:
            return None, b""
        return self.payer_id, sign_bytes(self.payer, open_body(self.node.peer_id, session))

    def begin(self, session: str, prefill_end: int) -> None:
        """A session starts: its first `prefill_end` positions are prefill."""
        with self._lock:
            self._prefill_end[session] = prefill_end
            self._work[session] = {}

    def count(self, session: str, commits: Iterable[Commit], start: int, positions: int) -> None:
        """A step of `positions` positions from `start` came back with these (checked) commitments."""
        with self._lock:
            work = self._work.get(session)
            if work is None:
                return
            prefill = max(0, min(start + positions, self._prefill_end[session]) - start)
            for c in commits:
                w = work.setdefault(c.stage, Work())
                w.prefill += len(c.span) * prefill
                w.decode += len(c.span) * (positions - prefill)

    def settle(self, sessions: Iterable[str], caught: Set[str]) -> list[Receipt]:
        """Sign the receipts of `sessions` (their audits settled) to every stage but those `caught`, and give
        each to its stage in the background."""
        receipts = []
        with self._lock:
            for session in sessions:
                self._prefill_end.pop(session, None)
                for stage, w in self._work.pop(session, {}).items():
                    if stage in caught or not w.prefill + w.decode:
                        continue
                    unsigned = Receipt(self.swarm, self.node.peer_id, self.payer_id, stage, session, w.prefill,
                                       w.decode, self.clock())
                    receipts.append(sign_receipt(self.payer, unsigned))
            self.given = (self.given + receipts)[-256:]
            self._in_flight += len(receipts)  # counted before they start: a client closing at once waits for them
        for r in receipts:
            self.node.spawn(self._give, r)
        return receipts

    async def _give(self, r: Receipt) -> None:
        try:
            await self.node.requests.request(r.stage, RECEIPT, Given(receipt=r), timeout=GIVE_TIMEOUT_S)
        except (TimeoutError, PeerUnavailable, NodeError, RemoteError) as e:
            log.info("could not give stage %s its receipt for session %s: %s", r.stage, r.session, e)
        finally:
            with self._giving:
                self._in_flight -= 1
                self._giving.notify_all()

    def drain(self, timeout: float = GIVE_TIMEOUT_S) -> bool:
        """Wait until the receipts signed have been given (a client leaving right after its last generation);
        False if some were still on their way after `timeout`."""
        with self._giving:
            return self._giving.wait_for(lambda: self._in_flight <= 0, timeout)
