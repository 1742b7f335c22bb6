"""Gossipsub for membership and election: the router as beeswarm tunes it, and each subscription's pump.

Never for tensors or RPC (DESIGN.md): messages are small, few per second, and may be dropped.
"""
from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pubsub import Pubsub

from beeswarm.protocol import CONTROL_LIMIT, Decoder, ProtocolError

log = logging.getLogger(__name__)

GOSSIPSUB = TProtocol("/meshsub/1.0.0")


def new_pubsub(host: Any) -> tuple[Pubsub, GossipSub]:
    """Pubsub over gossipsub: rate limits well above our heartbeat rate; no IP diversity rule (localhost peers
    share one IP). No "adaptive gossip": py-libp2p 0.8.1 rates a mesh below its target degree as poor health
    and then sets the heartbeat to 30-60 s whatever was configured (a 3-node swarm went from 1 s to 60 s
    after 30 s), so a peer's message cache spanned minutes and a newcomer's first gossip replayed them in
    one burst, over the 50-a-second limit ("Rate limit exceeded" at contributors that joined under churn)."""
    router = GossipSub(protocols=[GOSSIPSUB], degree=6, degree_low=4, degree_high=12, heartbeat_interval=1,
                       heartbeat_initial_delay=0.1, eclipse_protection_enabled=False,
                       max_messages_per_topic_per_second=50.0, adaptive_gossip_enabled=False)
    return Pubsub(host, router, max_inbound_rpc_size=CONTROL_LIMIT * 4), router


async def pump(subscription: Any, topic: str, messages: Decoder[Any], callback: Callable[[str, Any], None],
               me: str, strike: Callable[[str, str], None]) -> None:
    """Hand each message of `subscription` to `callback(author, message)`, decoded by `messages`; a message
    that does not decode strikes its author; our own are skipped."""
    while True:
        message = await subscription.get()
        try:
            author = _author(message.from_id)
        except Exception:  # noqa: BLE001
            continue
        if author == me:
            continue
        try:
            callback(author, messages.decode(message.data))
        except ProtocolError as e:
            strike(author, f"{topic}: {e}")
        except Exception:  # noqa: BLE001
            log.exception("subscriber of %s failed", topic)


# py-libp2p encodes base58 in pure Python on every str(ID): one encoding per peer, not per message
@functools.lru_cache(maxsize=8192)
def _author(from_id: bytes) -> str:
    return str(ID(from_id))
