"""Signed plans: the coordinator signs the encoded `PlanState` with its libp2p Ed25519 key.

Followers verify the signature against the key inside the coordinator's peer id and accept a plan
only from the coordinator they follow, for its current term, with a newer epoch than they hold.
"""
from __future__ import annotations

from libp2p.crypto.keys import KeyPair

from beeswarm.p2p.signatures import sign_bytes, verify_bytes
from beeswarm.protocol import Decoder, ProtocolError, encode
from beeswarm.protocol.coordinator import PlanState, SignedPlan

_bodies = Decoder(PlanState, limit=60_000)


def sign(key_pair: KeyPair, plan: PlanState) -> SignedPlan:
    body = encode(plan)
    return SignedPlan(body=body, sig=sign_bytes(key_pair, body))


def verify(msg: SignedPlan, author: str) -> PlanState:
    """Check form and signature; raises ProtocolError. (Whether to *follow* it is the caller's call.)"""
    plan = _bodies.decode(msg.body)
    if plan.coordinator != author:
        raise ProtocolError(f"plan names {plan.coordinator} as its coordinator but was published by {author}")
    if not verify_bytes(plan.coordinator, msg.body, msg.sig):
        raise ProtocolError("plan signature does not verify against its coordinator's key")
    return plan
