"""Credits on the wire: receipts an entry signs to the stages that served it, and the coordinator's ledger.

A `Receipt` says that `entry` accepted `prefill` and `decode` layer-tokens from `stage` in one session
(a stage that ran L layers over T positions served L*T), paid by `payer`: the identity whose account
spends them (the entry's own, or the machine's key when `chat`/`serve` are told to use it, so that a
contributor that also chats spends what it earned). The payer signs `receipt_body`, which binds the
swarm, so a receipt cannot be spent in another swarm, and the session, so it cannot be counted twice.
Stages hand their receipts to the coordinator (`ids.CREDITS`), which publishes the balances as a signed,
sequenced `LedgerState` (`SignedLedger` on the coordinator topic) that the next coordinator continues.
"""
from __future__ import annotations

import hashlib
from pathlib import PurePath
from typing import Annotated

import msgspec

from beeswarm.protocol.encoding import CONTROL_LIMIT, Message
from beeswarm.protocol.membership import Short
from beeswarm.protocol.session import PeerId, SessionId
from beeswarm.protocol.step import DIGEST_BYTES, Digest, Signature

UNITS_MAX = 1 << 50  # layer-tokens: a ledger's sums stop here (an 80-layer model's 14 trillion tokens)
Units = Annotated[int, msgspec.Meta(ge=0, le=UNITS_MAX)]
MAX_RECEIPTS = 64  # per hand-in
# A published ledger is one gossip message (CONTROL_LIMIT), whatever its figures: 256 accounts of at most 112 bytes
# and 1024 digests of 28 (tests/test_credits.py builds the largest one)
MAX_BALANCES = 256
MAX_RECENT = 1024  # receipts the published ledger remembers against replays (older ones: `horizon`)
MAX_REASON = 300


class Receipt(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """`payer`'s signed word that `stage` served its node `entry` `prefill` and `decode` layer-tokens in `session`."""

    swarm: Short  # the swarm's name and model (`swarm_id`)
    entry: PeerId
    payer: PeerId
    stage: PeerId
    session: SessionId
    prefill: Units
    decode: Units
    issued: float  # unix seconds, by the entry's clock
    sig: Signature = b""

    @property
    def units(self) -> int:
        return self.prefill + self.decode

    @property
    def key(self) -> bytes:
        """What makes a receipt one (its units aside: one session's receipt is counted once)."""
        body = msgspec.msgpack.encode(("beeswarm/receipt-key/1", self.swarm, self.entry, self.payer, self.stage,
                                       self.session, self.issued))
        return hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest()


class Seen(msgspec.Struct, frozen=True, array_like=True):
    """A receipt counted (its `key`), and when it was issued."""

    key: Digest
    issued: float


def receipt_body(r: Receipt) -> bytes:
    """The bytes the payer's signature covers."""
    return msgspec.msgpack.encode(("beeswarm/receipt/1", r.swarm, r.entry, r.payer, r.stage, r.session, r.prefill,
                                   r.decode, r.issued))


def swarm_id(name: str, model: str) -> str:
    """Which swarm a receipt is for: its name and its model's (a path's last part: the same model lies in
    other folders on other machines; the same name serving another model is another swarm)."""
    return f"{name}/{PurePath(model).name}"[:64]


class Balance(msgspec.Struct, frozen=True, array_like=True):
    """A peer's account: layer-tokens it served (`earned`) and generated through others (`spent`), in all and
    in the last hour and day (as the coordinator that published it counted them); `forfeited`: caught lying,
    its balance gone and its receipts refused."""

    node: PeerId
    earned: Units = 0
    spent: Units = 0
    forfeited: bool = False
    hour: tuple[Units, Units] = (0, 0)  # (earned, spent)
    day: tuple[Units, Units] = (0, 0)

    @property
    def balance(self) -> int:
        return self.earned - self.spent


class LedgerState(msgspec.Struct, frozen=True, kw_only=True):
    """The balances as one coordinator published them: `seq` grows by one per change, across coordinators; `term`
    is the publisher's lease term: ledgers are ordered by (term, seq), so an old one replayed never wins."""

    swarm: Short = ""
    term: Annotated[int, msgspec.Meta(ge=0)] = 0
    seq: Annotated[int, msgspec.Meta(ge=0)] = 0
    coordinator: PeerId = ""
    horizon: float = 0.0  # receipts issued at or before this are refused: too old to be told from a replay
    balances: Annotated[tuple[Balance, ...], msgspec.Meta(max_length=MAX_BALANCES)] = ()
    recent: Annotated[tuple[Seen, ...], msgspec.Meta(max_length=MAX_RECENT)] = ()


LEDGER_LIMIT = CONTROL_LIMIT  # bytes of a SignedLedger at most


class SignedLedger(Message, frozen=True, tag="ledger"):
    body: Annotated[bytes, msgspec.Meta(max_length=LEDGER_LIMIT - 1024)]  # an encoded LedgerState
    sig: Signature


class LedgerRequest(Message, frozen=True, tag="ledger_request"):
    """Ask the coordinator for its current signed ledger (`ids.CREDITS`)."""


class Given(Message, frozen=True, tag="receipt"):
    """An entry's receipt to the stage it names (`ids.RECEIPT`), answered with `Kept`."""

    receipt: Receipt


class Kept(Message, frozen=True, tag="kept"):
    pass


class HandIn(Message, frozen=True, tag="hand_in"):
    """A stage's receipts for the coordinator to record (`ids.CREDITS`)."""

    receipts: Annotated[tuple[Receipt, ...], msgspec.Meta(min_length=1, max_length=MAX_RECEIPTS)]


class Recorded(Message, frozen=True, tag="recorded"):
    """The coordinator's answer: per receipt, "" when counted now, else why not (already counted, forged, ...);
    the sequence number of the ledger that holds them."""

    refused: Annotated[tuple[Annotated[str, msgspec.Meta(max_length=MAX_REASON)], ...],
                       msgspec.Meta(max_length=MAX_RECEIPTS)]
    seq: int
