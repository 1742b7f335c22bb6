"""How a node reaches the swarm: its bootstrap addresses, dialled and kept, and relay slots reserved.

Runs in the node's loop. `connect(info, timeout)` is the node's dial (bans checked, time bounded); it
raises PeerUnavailable when the peer cannot be reached.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import multiaddr
import trio
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as RELAY_HOP
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits

from beeswarm.p2p import addresses
from beeswarm.p2p.errors import PeerUnavailable

log = logging.getLogger(__name__)

NOT_DIALABLE = "0.0.0.0 and :: are where a node listens, not an address to dial (use the machine's IP address)"
REDIAL_S = 2.0  # how often a dropped bootstrap is dialled again

Connect = Callable[[Any, float], Awaitable[None]]


class Bootstraps:
    """The bootstrap addresses a node keeps a connection to, and why each last failed."""

    def __init__(self, addrs: list[str], me: str, connect: Connect, live: Callable[[], set[Any]],
                 failed_dials: Any = None):
        """`live()`: the peers connected now; `failed_dials`: py-libp2p's cache of peers it will not dial again
        for 60 s once every address failed (a bootstrap is retried sooner)."""
        self.addrs, self.me, self.connect, self.live, self.failed_dials = addrs, me, connect, live, failed_dials
        self._state: dict[str, str | None] = {}  # address -> last dial error (None: reached)

    def peers(self) -> set[str]:
        return {a.rsplit("/p2p/", 1)[1] for a in self.addrs if "/p2p/" in a}

    async def keep(self, addr: str) -> None:
        """Dial `addr`, and again whenever the connection drops; `errors()` has the last failure."""
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except Exception as e:  # noqa: BLE001
            log.error("bootstrap address %r is invalid: %s", addr, e)
            self._state[addr] = f"not a multiaddr ending in /p2p/<peer id> ({e})"
            return
        if str(info.peer_id) == self.me:
            self._state[addr] = None
            return
        if addresses.unspecified(addr):
            self._state[addr] = NOT_DIALABLE
            return
        while True:
            if info.peer_id not in self.live():
                if self.failed_dials is not None:
                    self.failed_dials.evict(str(info.peer_id))
                try:
                    await self.connect(info, 10.0)
                    self._state[addr] = None
                except PeerUnavailable as e:
                    log.info("bootstrap %s: %s", addr, e)
                    why = str(e).removeprefix(f"connecting to {info.peer_id}")
                    self._state[addr] = why.removeprefix(":").strip() or str(e)
            else:
                self._state[addr] = None
            await trio.sleep(REDIAL_S)

    def errors(self) -> dict[str, str]:
        """Each bootstrap address whose last dial failed, with why (an address not dialled yet is absent)."""
        return {addr: error for addr, error in dict(self._state).items() if error is not None}

    def unreachable(self, connected: bool) -> str | None:
        """Why the swarm cannot be reached, once every bootstrap address was dialled and failed and no peer is
        `connected`: each address with its error. None while a bootstrap answers or is untried, or a peer is
        connected (or when there is no bootstrap: a node that starts a swarm waits for others)."""
        state = dict(self._state)
        if not self.addrs or any(state.get(addr) is None for addr in self.addrs) or connected:
            return None  # (None: untried, or reached)
        return "; ".join(f"{addr}: {state[addr]}" for addr in sorted(set(self.addrs)))


def relay_protocol(host: Any, serve: bool) -> tuple[CircuitV2Protocol, RelayConfig]:
    """Circuit relay v2 with limits fit for hidden states; `serve`: relay for peers that cannot be dialled."""
    limits = RelayLimits(duration=24 * 3600, data=1 << 40, max_circuit_conns=64, max_reservations=64)
    roles = RelayRole.STOP | RelayRole.CLIENT | (RelayRole.HOP if serve else RelayRole(0))
    return CircuitV2Protocol(host, limits=limits, allow_hop=serve), RelayConfig(roles=roles, limits=limits)


async def reserve(host: Any, relay: Any, nursery: trio.Nursery, connect: Connect, relay_addr: str,
                  me: str) -> str | None:
    """Take a slot on a relay; returns the address peers can reach this node through (None: no slot)."""
    try:
        info = info_from_p2p_addr(multiaddr.Multiaddr(relay_addr))
        await connect(info, 10.0)
        with trio.fail_after(10.0):
            stream = await host.new_stream(info.peer_id, [RELAY_HOP])
            ok = await relay.reserve(stream, info.peer_id, nursery)
    except Exception as e:  # noqa: BLE001
        log.error("no reservation on relay %s: %s", relay_addr, e)
        return None
    if not ok:
        log.error("relay %s refused a reservation", relay_addr)
        return None
    log.info("reachable through relay %s", relay_addr)
    return f"{relay_addr}/p2p-circuit/p2p/{me}"
