"""How a node reaches the swarm: its bootstrap addresses, dialled and kept, and relay slots kept while
other hosts cannot dial it.

Runs in the node's loop. `connect(info, timeout)` is the node's dial (bans checked, time bounded); it
raises PeerUnavailable when the peer cannot be reached.
"""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import multiaddr
import trio
from libp2p.host.ping import PingService
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.dcutr import MAX_HOLE_PUNCH_ATTEMPTS, DCUtRProtocol
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as RELAY_HOP
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits

from beeswarm.p2p import addresses, peers
from beeswarm.p2p.errors import NodeError, PeerUnavailable

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


# A relay carries a private node's hidden states: generous per circuit, bounded per relay. A circuit that reaches
# a limit is closed and dialled again; a reservation lasts an hour and is renewed at half-time.
RELAY_LIMITS = RelayLimits(duration=3600, data=8 << 30, max_circuit_conns=32, max_reservations=64,
                           reservation_ttl=3600)
RELAYS_WANTED = 2  # reservations a private node keeps
RENEW_AT = 0.5  # of a reservation's lifetime
RELAY_RETRY_S = 120.0  # a relay that refused or could not be reached is tried again after this
KEEP_S = 5.0  # how often the reservations are looked after
AUTO_PUNCH_S = 2.0  # how often relayed peers are looked for to punch a hole to (py-libp2p's pace)
KEEPALIVE_S = 20.0  # a relay is pinged this often: home routers forget a TCP flow idle for as little as 30 s


class HolePunching(DCUtRProtocol):
    """DCUtR (a peer reached only through a relay is offered a simultaneous dial; both sides run it), saying
    once per peer when no hole could be punched, as behind a NAT that gives each destination its own port."""

    def __init__(self, host: Any):
        super().__init__(host)
        self._told: set[Any] = set()
        self._driving: set[Any] = set()  # peers whose punch runs now

    async def _auto_drive_loop(self) -> None:
        """py-libp2p's loop punches one relayed peer after another: a doomed punch (to a chat client that is
        gone) held up the next stage's for 40 s. Here each relayed peer's punch runs in a task of its own."""
        while True:
            await trio.sleep(AUTO_PUNCH_S)
            for peer_id in self._relayed_peers():
                if self._nursery is not None and peer_id not in self._driving \
                        and peer_id not in self._direct_connections \
                        and self._hole_punch_attempts.get(peer_id, 0) < MAX_HOLE_PUNCH_ATTEMPTS:
                    self._driving.add(peer_id)
                    self._nursery.start_soon(self._drive, peer_id)

    async def _drive(self, peer_id: Any) -> None:
        try:
            await self.initiate_hole_punch(peer_id)
        except Exception as e:  # noqa: BLE001 - one peer's punch failing is that link's matter
            log.debug("hole punch to %s: %s", peer_id, e)
        finally:
            self._driving.discard(peer_id)

    def _relayed_peers(self) -> list[Any]:
        """Peers this host reaches only through a relay circuit now."""
        me, relayed = self.host.get_id(), []
        for peer_id, conns in list(self.host.get_network().connections.items()):
            conns = conns if isinstance(conns, list) else [conns]
            if peer_id != me and any("/p2p-circuit" in str(a) for c in conns for a in _transport_addrs(c)):
                relayed.append(peer_id)
        return relayed

    async def initiate_hole_punch(self, peer_id: Any) -> bool:
        ok: bool = await super().initiate_hole_punch(peer_id)
        if not ok and peer_id not in self._told:
            self._told.add(peer_id)
            log.info("no hole could be punched to %s (a NAT on the way gives each destination its own port, or "
                     "drops the simultaneous dial): the link stays relayed (DCUtR tries %d times)", peer_id,
                     MAX_HOLE_PUNCH_ATTEMPTS)
        return ok

    def on_peer_disconnected(self, peer_id: Any) -> None:  # (py-libp2p's host calls it: per-peer state goes)
        super().on_peer_disconnected(peer_id)
        self._told.discard(peer_id)


def _transport_addrs(conn: Any) -> list[Any]:
    try:
        return list(conn.get_transport_addresses())
    except Exception:  # noqa: BLE001 - a connection closing as it is read
        return []


async def dial_relayed(host: Any, peer_id: Any, connect: Callable[[str, float], Awaitable[str]],
                       timeout: float = 10.0) -> bool:
    """Connect to `peer_id` through any of the relayed addresses the peerstore has for it (py-libp2p's own dial
    skips them); False when none works."""
    try:
        known = host.get_peerstore().addrs(peer_id)
    except Exception:  # noqa: BLE001 - py-libp2p raises for a peer it has no addresses of
        return False
    for addr in (f"{a}/p2p/{peer_id}" for a in known if "/p2p-circuit" in str(a)):
        try:
            await connect(addr, timeout)
            return True
        except (PeerUnavailable, NodeError) as e:
            log.debug("dial %s: %s", addr, e)
    return False


def relay_protocol(host: Any, serve: bool) -> tuple[CircuitV2Protocol, RelayConfig]:
    """Circuit relay v2: always the stop side (a private node accepts circuits), the hop side when `serve`.
    No client role: py-libp2p's client reserves on every relay it dials through (`Relays` reserves)."""
    roles = RelayRole.STOP | (RelayRole.HOP if serve else RelayRole(0))
    return CircuitV2Protocol(host, limits=RELAY_LIMITS, allow_hop=serve), RelayConfig(roles=roles,
                                                                                      limits=RELAY_LIMITS)


@dataclass
class Reservation:
    relay: str  # the relay's address, ending in /p2p/<its id>
    expires: float  # time.time() (the relay's clock)
    taken: float  # time.time() when taken or renewed
    pinged: float = 0.0  # when the relay last answered a ping


class Relays:
    """The relay slots a node holds while other hosts cannot dial it: RELAYS_WANTED of them (and every
    `fixed` one always), renewed before they expire, and taken elsewhere when a relay goes.

    `wanted()`: whether this node needs relays now (it learnt it is private); `candidates()`: addresses
    of members that offer relaying and are public. Runs in the node's loop (`keep`)."""

    def __init__(self, host: Any, transport: Any, connect: Connect, me: str, fixed: list[str],
                 candidates: Callable[[], Iterable[str]], wanted: Callable[[], bool],
                 clock: Callable[[], float] = time.time):
        self.host, self.transport, self.connect, self.me = host, transport, connect, me
        self.fixed, self.candidates, self.wanted, self.clock = list(fixed), candidates, wanted, clock
        self.held: dict[str, Reservation] = {}  # relay peer id -> reservation
        self._failed: dict[str, float] = {}  # relay address -> when it last failed
        self.note: str | None = None  # why this node holds no relay slot though it wants one
        self._ping = PingService(host)
        self._tending = trio.Lock()

    def addrs(self) -> list[str]:
        """The addresses peers reach this node at through its relays."""
        return [f"{r.relay}/p2p-circuit/p2p/{self.me}" for r in self.held.values()]

    async def keep(self) -> None:
        while True:
            await self.tend()
            await trio.sleep(KEEP_S)

    async def tend(self) -> None:
        async with self._tending:  # (one at a time: `keep`'s, and any other caller's)
            await self._tend()

    async def _tend(self) -> None:
        now = self.clock()
        self._failed = {addr: t for addr, t in self._failed.items() if now - t < RELAY_RETRY_S}
        live = {str(p) for p in peers.live_peers(self.host)}
        for relay_id, r in list(self.held.items()):
            if relay_id not in live or now >= r.expires:  # the relay went (or the slot lapsed): take another
                log.info("relay %s lost (%s)", r.relay, "expired" if now >= r.expires else "disconnected")
                del self.held[relay_id]
            elif now >= r.taken + RENEW_AT * (r.expires - r.taken) and not await self._reserve(r.relay):
                del self.held[relay_id]
            elif now - max(r.pinged, r.taken) >= KEEPALIVE_S:
                if await self._alive(relay_id):
                    r.pinged = now
                else:
                    log.info("relay %s lost (no answer to a ping)", r.relay)
                    del self.held[relay_id]
        wanted = self.wanted()
        target = len(self.fixed) + (RELAYS_WANTED if wanted else 0)
        offered = self.fixed + (self._ordered_candidates() if wanted else [])
        for addr in offered:
            relay_id = addr.rsplit("/p2p/", 1)[-1]
            if len(self.held) >= target:
                break
            if relay_id not in self.held and relay_id != self.me and \
                    addr not in self._failed:
                await self._reserve(addr)
        note = None if self.held or not target else (
            "nobody can reach this node (it is behind a NAT or firewall) and no public member of the swarm "
            "relays: it cannot serve until one does (or its router forwards a port to it: --announce)"
            if not offered else "nobody can reach this node (it is behind a NAT or firewall) and no relay took a "
                                "reservation (see the log above)")
        if note and note != self.note:
            log.warning("%s", note)
        self.note = note

    def _ordered_candidates(self) -> list[str]:
        seen: set[str] = set()
        out = []
        for addr in self.candidates():
            relay_id = addr.rsplit("/p2p/", 1)[-1]
            if relay_id not in seen and "/p2p-circuit" not in addr:
                seen.add(relay_id)
                out.append(addr)
        random.shuffle(out)  # spread private nodes over the public ones
        return out

    async def _alive(self, relay_id: str) -> bool:
        """Ping the relay: keeps the NAT's mapping of this node's connection to it, and tells a silent relay."""
        try:
            with trio.fail_after(10.0):
                return bool(await self._ping.ping(ID.from_base58(relay_id)))
        except Exception as e:  # noqa: BLE001
            log.debug("ping %s: %s", relay_id, e)
            return False

    async def _reserve(self, relay_addr: str) -> bool:
        """Take (or renew) a slot on a relay. py-libp2p's `reserve` starts a renewal worker that spins without
        pause once a renewal fails and stops for good once a slot lapses, so the RESERVE exchange is used alone."""
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(relay_addr))
            await self.connect(info, 10.0)
            with trio.fail_after(10.0):
                stream = await self.host.new_stream(info.peer_id, [RELAY_HOP])
                try:
                    ok = await self.transport._make_reservation(stream, info.peer_id)
                finally:
                    await stream.close()
        except Exception as e:  # noqa: BLE001
            log.info("no reservation on relay %s: %s", relay_addr, e)
            ok = False
        if not ok:
            self._failed[relay_addr] = self.clock()
            return False
        now = self.clock()
        expires = float(self.transport._reservations.get(info.peer_id) or now + RELAY_LIMITS.reservation_ttl)
        renewed = str(info.peer_id) in self.held
        self.held[str(info.peer_id)] = Reservation(relay_addr, expires, now)
        if not renewed:
            log.info("reachable through relay %s (until %s)", relay_addr, time.strftime("%H:%M:%S",
                                                                                       time.localtime(expires)))
        return True
