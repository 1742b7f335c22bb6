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
import logging
import os
from typing import Any

import trio

from beeswarm.p2p import wire
from beeswarm.p2p.channel import close_stream, quiet_reset
from beeswarm.p2p.host import Host
from beeswarm.protocol import CONTROL_LIMIT, Decoder, ErrorReply, ProtocolError, encode, ids
from beeswarm.protocol.auth import Challenge, Proof

log = logging.getLogger(__name__)

NONCE_BYTES = 32
TIMEOUT_S = 2.0
_challenges = Decoder(Challenge)
_proofs = Decoder(Proof)


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


class Gate:
    """Who may be served: not banned peers, and in a private swarm only those that passed the challenge.

    Each side challenges the other as soon as a connection opens (`connected`); requests and channels
    from a peer wait for its proof (`admit`), at most TIMEOUT_S.
    """

    def __init__(self, node: Host, secret: bytes | None):
        self.node = node
        self._key = mac_key(secret) if secret else None
        self._authed: dict[str, trio.Event] = {}

    @property
    def private(self) -> bool:
        return self._key is not None

    def connected(self, peer: str) -> None:
        """In the node's loop, when a connection to `peer` opens."""
        if self.private:
            self._authed.setdefault(peer, trio.Event())
            self.node.spawn(self._challenge, peer)

    def disconnected(self, peer: str) -> None:
        self._authed.pop(peer, None)

    async def admit(self, peer: str) -> bool:
        if self.node.bans.is_banned(peer):
            return False
        if self._key is None:
            return True
        event = self._authed.setdefault(peer, trio.Event())
        with trio.move_on_after(TIMEOUT_S):
            await event.wait()
        return event.is_set()

    async def _challenge(self, peer: str) -> None:
        """Ask `peer` to prove it knows the swarm secret; drop it if it cannot within TIMEOUT_S."""
        assert self._key is not None
        ok = False
        challenge = nonce()
        try:
            with trio.fail_after(TIMEOUT_S):
                stream = await self.node.new_stream_when_ready(peer, ids.AUTH)
                try:
                    await wire.write_frame(stream, encode(Challenge(nonce=challenge)))
                    reply = _proofs.decode(await wire.read_frame(stream, CONTROL_LIMIT))
                finally:
                    await quiet_reset(stream)
            ok = verify(self._key, peer, self.node.peer_id, challenge, reply.nonce, reply.mac)
        except Exception as e:  # noqa: BLE001 - timeouts, protocol errors, resets
            log.info("auth of %s failed: %s: %s", peer, type(e).__name__, e)
        if ok:
            self._authed.setdefault(peer, trio.Event()).set()
            return
        self.node.strike(peer, "failed the swarm-secret challenge", severe=True)
        await self.node.disconnect_async(peer)

    async def on_stream(self, stream: Any) -> None:
        """Answer a peer's challenge."""
        peer = str(stream.muxed_conn.peer_id)
        try:
            with trio.fail_after(TIMEOUT_S):
                msg = _challenges.decode(await wire.read_frame(stream, CONTROL_LIMIT))
                if self._key is None:
                    await wire.write_frame(stream, encode(ErrorReply(error="this swarm is open")))
                    return
                mine = nonce()
                mac = proof(self._key, self.node.peer_id, peer, msg.nonce, mine)
                await wire.write_frame(stream, encode(Proof(nonce=mine, mac=mac)))
        except (trio.TooSlowError, ProtocolError) as e:
            self.node.strike(peer, f"auth: {e}")
        except Exception as e:  # noqa: BLE001
            log.debug("auth stream from %s: %s", peer, e)
        finally:
            await close_stream(stream)  # a reset could overtake the proof still in flight
