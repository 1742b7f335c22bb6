"""The node's Ed25519 key: created on first start, reused so the peer id is stable."""
from __future__ import annotations

import base64
from dataclasses import dataclass

from libp2p.crypto.ed25519 import Ed25519PrivateKey, create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from beeswarm import secrets

KEY_NAME = "identity"
ENV = "BEESWARM_IDENTITY"


@dataclass(frozen=True)
class Identity:
    key_pair: KeyPair
    location: str

    @property
    def peer_id(self) -> str:
        return str(ID.from_pubkey(self.key_pair.public_key))


def _from_bytes(raw: bytes, where: str) -> KeyPair:
    if len(raw) not in (32, 64):
        raise secrets.SecretError(f"{where}: an Ed25519 key is 32 bytes, found {len(raw)}")
    private = Ed25519PrivateKey.from_bytes(raw[:32])
    return KeyPair(private, private.get_public_key())


def load_or_create() -> Identity:
    found = secrets.load(KEY_NAME, ENV)
    if found is not None:
        return Identity(_from_bytes(found.value, found.location), found.location)
    return reset()


def reset() -> Identity:
    """A new key, replacing the stored one (the peer id changes)."""
    key_pair = create_new_key_pair()
    location = secrets.store(KEY_NAME, key_pair.private_key.to_bytes())
    return Identity(key_pair, location)


def ephemeral() -> Identity:
    """A throwaway key (tests, one-shot clients that need no stable id)."""
    key_pair = create_new_key_pair()
    return Identity(key_pair, "memory")


def encoded(identity: Identity) -> str:
    """The key as BEESWARM_IDENTITY takes it: a process started with it in its environment has `identity`."""
    return base64.b64encode(identity.key_pair.private_key.to_bytes()).decode()
