"""Signatures with a node's key over bytes, checked against the key a peer id carries inline."""
from __future__ import annotations

import functools

from libp2p.crypto.keys import KeyPair, PublicKey
from libp2p.peer.id import ID


@functools.lru_cache(maxsize=4096)
def public_key(peer: str) -> PublicKey | None:
    try:
        return ID.from_base58(peer).extract_public_key()
    except Exception:  # noqa: BLE001 - not a peer id, or one without an inline key
        return None


def sign_bytes(key_pair: KeyPair, body: bytes) -> bytes:
    return bytes(key_pair.private_key.sign(body))


def verify_bytes(peer: str, body: bytes, sig: bytes) -> bool:
    key = public_key(peer)
    try:
        return key is not None and bool(key.verify(body, sig))
    except Exception:  # noqa: BLE001 - malformed signatures
        return False
