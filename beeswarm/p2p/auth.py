"""Private swarms: both sides of a connection prove they know the swarm secret.

Each side challenges the other on `/beeswarm/auth/1` with a fresh nonce; the answer carries the
responder's own fresh nonce and HMAC-SHA256(key, label | responder id | challenger id | both
nonces). Peer ids are bound to the Noise session, so a proof cannot be replayed or reflected.
Connections are also wrapped in libp2p's pnet layer keyed from the secret, so a peer without it
cannot even finish the Noise handshake, let alone read gossip.
"""
from __future__ import annotations

import hashlib
import hmac
import os

PROTOCOL = "/beeswarm/auth/1"
NONCE_BYTES = 32


def mac_key(secret: bytes) -> bytes:
    return hashlib.sha256(b"beeswarm-auth-v1" + secret).digest()


def pnet_key(secret: bytes) -> str:
    """The 32-byte pre-shared key for libp2p's private-network layer, hex as py-libp2p wants it."""
    return hashlib.sha256(b"beeswarm-pnet-v1" + secret).hexdigest()


def nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def proof(key: bytes, responder: str, challenger: str, challenge: bytes, response_nonce: bytes) -> bytes:
    body = b"|".join([b"beeswarm-proof", responder.encode(), challenger.encode(), challenge, response_nonce])
    return hmac.new(key, body, hashlib.sha256).digest()


def verify(key: bytes, responder: str, challenger: str, challenge: bytes, response_nonce: bytes, mac: bytes) -> bool:
    return hmac.compare_digest(proof(key, responder, challenger, challenge, response_nonce), mac)
