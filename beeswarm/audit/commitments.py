"""Digests and Ed25519 signatures of data-path commitments (`protocol.step.Commit`).

A digest binds a tensor's dtype, shape and bytes: the codec is lossless, so what stage i sent and what
stage i+1 decoded hash the same. Keys come from the peer ids themselves (libp2p's Ed25519 ids inline the
public key), so anyone can check a commitment with nothing but the commitment.
"""
from __future__ import annotations

import hashlib

import msgspec
import torch
from libp2p.crypto.keys import KeyPair

from beeswarm.p2p.signatures import sign_bytes, verify_bytes
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


def sign(key_pair: KeyPair, entry: str, session: str, unsigned: Commit) -> Commit:
    return msgspec.structs.replace(unsigned, sig=sign_bytes(key_pair, commit_body(entry, session, unsigned)))


def verify(commit: Commit, entry: str, session: str) -> bool:
    return verify_bytes(commit.stage, commit_body(entry, session, commit), commit.sig)
