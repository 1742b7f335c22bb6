"""Signed plans: the coordinator signs (term, epoch, coordinator, plan) with its libp2p Ed25519 key.

Followers verify the signature against the key inside the coordinator's peer id and accept a plan
only from the coordinator they follow, for its current term, with a newer epoch than they hold.
"""
from __future__ import annotations

from dataclasses import dataclass

import msgpack
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from beeswarm.p2p import wire


@dataclass(frozen=True)
class SignedPlan:
    term: int
    epoch: int
    coordinator: str
    plan: dict  # Plan.to_json()


def sign(key_pair: KeyPair, plan: SignedPlan) -> dict:
    body = msgpack.packb([plan.term, plan.epoch, plan.coordinator, plan.plan], use_bin_type=True)
    return wire.message("plan", body=body, sig=key_pair.private_key.sign(body))


def verify(msg: dict, author: str) -> SignedPlan:
    """Check form and signature; raises wire.ProtocolError. (Whether to *follow* it is the caller's call.)"""
    wire.expect(msg, "plan", body=bytes, sig=bytes)
    try:
        term, epoch, coordinator, plan = msgpack.unpackb(msg["body"], raw=False, strict_map_key=True)
    except Exception:  # noqa: BLE001
        raise wire.ProtocolError("plan body is not [term, epoch, coordinator, plan]") from None
    if not (isinstance(term, int) and isinstance(epoch, int) and isinstance(coordinator, str) and
            isinstance(plan, dict)):
        raise wire.ProtocolError("plan body has wrong field types")
    if coordinator != author:
        raise wire.ProtocolError(f"plan names {coordinator} as its coordinator but was published by {author}")
    try:
        key = ID.from_base58(coordinator).extract_public_key()
        ok = key is not None and key.verify(msg["body"], msg["sig"])
    except Exception:  # noqa: BLE001 - unparseable ids, non-Ed25519 keys
        ok = False
    if not ok:
        raise wire.ProtocolError("plan signature does not verify against its coordinator's key")
    return SignedPlan(term, epoch, coordinator, plan)
