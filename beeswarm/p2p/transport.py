"""The py-libp2p host as beeswarm builds it: TCP + Noise (only) + Yamux, one connection per peer."""
from __future__ import annotations

from typing import Any

import multiaddr
from libp2p import new_host as libp2p_host
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.network.config import ConnectionConfig
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport

from beeswarm.p2p import addresses, auth
from beeswarm.p2p.identity import Identity


def new_host(identity: Identity, announce: list[str], secret: bytes | None) -> Any:
    """A host announcing `announce` (else the listening addresses, 0.0.0.0 / :: replaced by this host's
    interface addresses, never the unspecified address itself); a private swarm's `secret` keys its pnet."""
    kp = identity.key_pair
    noise = NoiseTransport(kp, noise_privkey=new_x25519_key_pair().private_key)
    host: Any = libp2p_host(
        key_pair=kp,
        sec_opt={NOISE_PROTOCOL_ID: noise},  # the default also accepts plaintext peers
        muxer_preference="YAMUX",
        connection_config=ConnectionConfig(max_connections_per_peer=1),
        # what identify and signed records tell peers: no 0.0.0.0, no loopback (unless there is nothing else)
        addrs_factory=lambda found: addresses.announced(
            addresses.concrete([multiaddr.Multiaddr(a) for a in announce] or found)),
        psk=auth.pnet_key(secret) if secret else None,
    )
    # py-libp2p's auto-connector dials every peer in the peerstore up to 150 connections: a full mesh, N^2
    # handshakes in a swarm starting at once. Membership keeps the links a node needs instead.
    connector = host.get_network().auto_connector
    connector.maybe_connect = _no_auto_connect
    # Its re-dial back-off then serves nothing, and nothing empties it: `Swarm.notify_disconnected` records
    # every peer that leaves (network/swarm.py:3206, auto_connector.py:611-625) and only `maybe_connect`
    # prunes the table (auto_connector.py:439): one entry, the peer's ID kept alive, per peer ever gone.
    connector.record_disconnect = _no_record
    return host


async def _no_auto_connect() -> None:
    pass


def _no_record(peer_id: Any) -> None:
    pass
