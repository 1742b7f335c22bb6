"""Every request/response protocol, declared once: its id, what it asks, what it answers, how big each may be.

A node serves an `Rpc` and asks one (`Node.serve(rpc, handler)`, `Node.request(peer, rpc, msg)`): both
sides decode from the same declaration, so a reply type or a size limit cannot differ between them.
An RPC that answers different requests differently names each pairing with `answering` (same id, same
server, a narrower reply type for the asker: a reply of the wrong kind is the peer's protocol error).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from beeswarm.protocol import ids
from beeswarm.protocol.audit import AuditAsk, Audited, Boundaries, Credited, Evidence, Passed, Reveal, Revealed, Verdict
from beeswarm.protocol.coordinator import PlanRequest, SignedPlan
from beeswarm.protocol.credits import LEDGER_LIMIT, Given, HandIn, Kept, LedgerRequest, Recorded, SignedLedger
from beeswarm.protocol.encoding import CONTROL_LIMIT, Decoder, ErrorReply, Message
from beeswarm.protocol.membership import Beat, View
from beeswarm.protocol.reach import DialBack, DialedBack
from beeswarm.protocol.session import Close, Closed, Open, Opened

Req = TypeVar("Req", bound=Message)
Rep = TypeVar("Rep", bound=Message)
Narrow = TypeVar("Narrow", bound=Message)

TENSORS = None  # a limit that is the node's --max-tensor-bytes: the message carries tensors


@dataclass(frozen=True)
class Rpc(Generic[Req, Rep]):
    id: str
    requests: tuple[type[Req], ...]
    replies: tuple[type[Rep], ...]
    request_limit: int | None = CONTROL_LIMIT  # bytes; TENSORS: the node's tensor limit
    reply_limit: int | None = CONTROL_LIMIT

    def request_decoder(self, tensor_limit: int) -> Decoder[Req]:
        return Decoder(*self.requests, limit=_limit(self.request_limit, tensor_limit))

    def reply_decoder(self, tensor_limit: int) -> Decoder[Rep | ErrorReply]:
        """Replies of this RPC's types, or an error reply."""
        types: tuple[type[Any], ...] = (*self.replies, ErrorReply)
        return Decoder(*types, limit=_limit(self.reply_limit, tensor_limit))

    def largest_request(self, tensor_limit: int) -> int:
        return _limit(self.request_limit, tensor_limit)

    def answering(self, reply: type[Narrow], limit: int | None = CONTROL_LIMIT) -> Rpc[Req, Narrow]:
        """The same RPC asked for one of its replies only."""
        if reply not in self.replies:
            raise ValueError(f"{self.id} never answers {reply.__name__}")
        return Rpc(self.id, self.requests, (reply,), self.request_limit, limit)


def _limit(limit: int | None, tensor_limit: int) -> int:
    return tensor_limit if limit is TENSORS else limit


# sessions on a stage: an entry opens and closes them
SESSION: Rpc[Open | Close, Opened | Closed] = Rpc(ids.SESSION, (Open, Close), (Opened, Closed))
# the coordinator's current signed plan
PLAN: Rpc[PlanRequest, SignedPlan] = Rpc(ids.PLAN, (PlanRequest,), (SignedPlan,))
# a member's beat to the coordinator, answered with the view (a swarm of thousands: large)
MEMBERS: Rpc[Beat, View] = Rpc(ids.MEMBERS, (Beat,), (View,), 256 * 1024, 64 * 1024 * 1024)
# a stage reveals what it computed for one of the asker's sessions, or only its signed boundaries
AUDIT: Rpc[Reveal, Revealed | Boundaries] = Rpc(ids.AUDIT, (Reveal,), (Revealed, Boundaries), CONTROL_LIMIT, TENSORS)
REVEAL = AUDIT.answering(Revealed, TENSORS)
BOUNDARIES = AUDIT.answering(Boundaries, TENSORS)
# an entry asks a contributor to audit a stage of its session
PEER_AUDIT: Rpc[AuditAsk, Audited] = Rpc(ids.PEER_AUDIT, (AuditAsk,), (Audited,), TENSORS, TENSORS)
# an entry hands the coordinator evidence against a stage (it carries the reveal)
EVIDENCE: Rpc[Evidence, Verdict] = Rpc(ids.EVIDENCE, (Evidence,), (Verdict,), TENSORS)
# an entry tells the coordinator a stage passed its audit of a session
PASSED: Rpc[Passed, Credited] = Rpc(ids.PASSED, (Passed,), (Credited,))
# an entry hands a stage its signed receipt for a session
RECEIPT: Rpc[Given, Kept] = Rpc(ids.RECEIPT, (Given,), (Kept,))
# stages hand receipts in to the coordinator; anyone asks it for the ledger
CREDITS: Rpc[HandIn | LedgerRequest, Recorded | SignedLedger] = Rpc(
    ids.CREDITS, (HandIn, LedgerRequest), (Recorded, SignedLedger), CONTROL_LIMIT, LEDGER_LIMIT)
HAND_IN = CREDITS.answering(Recorded)
LEDGER = CREDITS.answering(SignedLedger, LEDGER_LIMIT)
# dial the asker back on its ports, say where the dial came from
DIALBACK: Rpc[DialBack, DialedBack] = Rpc(ids.DIALBACK, (DialBack,), (DialedBack,))
