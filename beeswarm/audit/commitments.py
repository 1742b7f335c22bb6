"""Digests and Ed25519 signatures of data-path commitments (`protocol.step.Commit`).

A digest binds a tensor's dtype, shape and bytes: the codec is lossless, so what stage i sent and what
stage i+1 decoded hash the same. Keys come from the peer ids themselves (libp2p's Ed25519 ids inline the
public key), so anyone can check a commitment with nothing but the commitment.
"""
from __future__ import annotations

import functools
import hashlib

import msgspec
import torch
from libp2p.crypto.keys import KeyPair, PublicKey
from libp2p.peer.id import ID

from beeswarm.protocol.step import DIGEST_BYTES, Commit, Keep, commit_body


def digest(tensor: torch.Tensor) -> bytes:
    t = tensor.detach().to("cpu").contiguous()
    h = hashlib.blake2b(f"{t.dtype}{tuple(t.shape)}".encode(), digest_size=DIGEST_BYTES)
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.digest()


def context(start: int, mask: bytes | None, keep: Keep | None) -> bytes:
    """A step's arguments besides its hidden states: where it starts, its tree mask, what it keeps."""
    return hashlib.blake2b(msgspec.msgpack.encode((start, mask, keep)), digest_size=DIGEST_BYTES).digest()


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


def sign(key_pair: KeyPair, entry: str, session: str, unsigned: Commit) -> Commit:
    return msgspec.structs.replace(unsigned, sig=sign_bytes(key_pair, commit_body(entry, session, unsigned)))


def verify(commit: Commit, entry: str, session: str) -> bool:
    return verify_bytes(commit.stage, commit_body(entry, session, commit), commit.sig)
