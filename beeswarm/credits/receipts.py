"""Signed credits: an entry's receipts to stages, and the coordinator's ledger (`protocol.credits`).

Both are signed with the libp2p Ed25519 key of their author and checked against the key inside its
peer id, as plans are (`coordinator.plans`).
"""
from __future__ import annotations

import msgspec
from libp2p.crypto.keys import KeyPair

from beeswarm.p2p.signatures import sign_bytes, verify_bytes
from beeswarm.protocol import Decoder, ProtocolError, encode
from beeswarm.protocol.credits import LEDGER_LIMIT, LedgerState, Receipt, SignedLedger, receipt_body

_ledgers = Decoder(LedgerState, limit=LEDGER_LIMIT)


def sign_receipt(key_pair: KeyPair, unsigned: Receipt) -> Receipt:
    return msgspec.structs.replace(unsigned, sig=sign_bytes(key_pair, receipt_body(unsigned)))


def receipt_verifies(r: Receipt) -> bool:
    return verify_bytes(r.payer, receipt_body(r), r.sig)


def sign_ledger(key_pair: KeyPair, state: LedgerState) -> SignedLedger:
    body = encode(state)
    return SignedLedger(body=body, sig=sign_bytes(key_pair, body))


def verify_ledger(msg: SignedLedger) -> LedgerState:
    """Check form and signature (by the coordinator it names); raises ProtocolError. Anyone can: a balance read
    from a verified ledger is the one that coordinator published."""
    state = _ledgers.decode(msg.body)
    if not verify_bytes(state.coordinator, msg.body, msg.sig):
        raise ProtocolError("the ledger's signature does not verify against its coordinator's key")
    return state
