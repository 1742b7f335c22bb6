"""A py-libp2p host in its own trio thread (`loop.LoopThread`), behind a small thread-safe API.

Methods without `_async` may be called from any thread, the `_async` ones from the node's loop.
Transport: TCP + Noise (only) + Yamux, one connection per peer. Every stream's reader drains into our
own buffers so slow compute never stalls a yamux window (py-libp2p resets a writer that waits more
than 5 s for one). The parts: `transport` (the host), `auth.Gate` (who may be served),
`requests.Requests` (request/response), `channel.Channel` (framed duplex streams), `topics`
(gossipsub), `reach` (bootstraps, relays), `peers` (the connection table and peerstore), `loop`.
"""
from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import multiaddr
import trio
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.pubsub import Pubsub
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from beeswarm import logs
from beeswarm.p2p import (
    addresses,
    auth,
    channel,
    dialback,
    libp2p_hardening,
    libp2p_tuning,
    peers,
    reach,
    topics,
    transport,
)
from beeswarm.p2p.bans import BanList
from beeswarm.p2p.channel import Channel, within
from beeswarm.p2p.errors import NodeError, PeerUnavailable
from beeswarm.p2p.identity import Identity
from beeswarm.p2p.loop import STOP_TIMEOUT_S, LoopThread
from beeswarm.p2p.peers import NodeStats
from beeswarm.p2p.reach import NOT_DIALABLE
from beeswarm.p2p.requests import Handler, Requests
from beeswarm.protocol import CONTROL_LIMIT, TENSOR_LIMIT, Decoder, Message, encode, ids
from beeswarm.protocol.reach import DialBack, DialedBack
from beeswarm.protocol.rpcs import DIALBACK, Rep, Req, Rpc

log = logging.getLogger(__name__)
logs.adopt_libp2p()  # importing py-libp2p reset its logger: route it through ours again (after `logs.setup`)

REMEMBER_S = 600  # how long addresses given to `remember_addrs` stay dialable (their peerstore TTL)


@dataclass
class NodeConfig:
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce: list[str] = field(default_factory=list)
    bootstrap: list[str] = field(default_factory=list)
    swarm: str = "beeswarm"
    secret: bytes | None = None  # None: an open swarm
    max_tensor_bytes: int = TENSOR_LIMIT
    relays: list[str] = field(default_factory=list)  # always hold a slot on these, and announce the relayed address
    relay_service: bool = False  # relay circuits for peers that cannot be dialled (a public node is picked for it)
    forget_every_s: float = 60.0  # how often peers neither connected, a bootstrap nor kept leave the peerstore


class Node:
    """One beeswarm peer on the libp2p mesh. Nothing starts until `start()`."""

    def __init__(self, identity: Identity, config: NodeConfig | None = None, bans: BanList | None = None):
        self.identity = identity
        self.config = config or NodeConfig()
        self.bans = bans or BanList()
        self.peer_id = identity.peer_id
        self.gate = auth.Gate(self, self.config.secret)
        self.requests = Requests(self, self.config.max_tensor_bytes)
        self._handlers: dict[str, Callable[[Any], Any]] = {}
        self._subscriptions: list[tuple[str, Decoder[Any], Callable[[str, Any], None]]] = []
        self._tasks: list[Callable[[], Any]] = []
        self.loop = LoopThread(self.peer_id)
        self._host: Any = None
        self._pubsub: Pubsub | None = None
        self._relay: CircuitV2Transport | None = None
        self.relays: reach.Relays | None = None  # (made with the host)
        # Addresses of members that relay and can be dialled: where this node takes slots once it learns it is private.
        self._relay_sources: list[Callable[[], Iterable[str]]] = []
        self._bootstraps: reach.Bootstraps | None = None  # (made with the host)
        self._peer_watchers: list[tuple[Callable[[str], None] | None, Callable[[str], None] | None]] = []
        # Peers the peerstore keeps while not connected (membership's members); every other gone peer is forgotten.
        self._keep_known: list[Callable[[], Iterable[str]]] = []
        # Whether other hosts can dial this node: peers dial it back (dialback.py), and it dials them back.
        self.reachability = dialback.Reachability()
        self.serve(DIALBACK, dialback.DialBackServer(self._direct_ip).answer)
        self.add_task(functools.partial(dialback.keep_learning, self.reachability,
                                        lambda: peers.direct_peers(self._host), self._listen_ports, self._ask_dialback))

    @property
    def private(self) -> bool:
        return self.gate.private

    @property
    def failure(self) -> BaseException | None:
        """Why the node's loop ended on its own after it had started (nothing else stops a node but `stop()`)."""
        return self.loop.failure

    # what the services on the node hear of it --------------------------------------------------
    def when_failed(self, callback: Callable[[BaseException], None]) -> None:
        """Call `callback(failure)` once, in the node's thread, if its loop ends on its own: a process should exit
        non-zero."""
        self.loop.on_failure.append(callback)

    def watch_peers(self, connected: Callable[[str], None] | None = None,
                    disconnected: Callable[[str], None] | None = None) -> Callable[[], None]:
        """Call `connected(peer)` and `disconnected(peer)` in the node's loop (keep them quick) as peers' links come
        and go; the call returned stops it."""
        watcher = (connected, disconnected)
        self._peer_watchers.append(watcher)

        def unwatch() -> None:
            if watcher in self._peer_watchers:
                self._peer_watchers.remove(watcher)
        return unwatch

    def keep_dialable(self, peers: Callable[[], Iterable[str]]) -> None:
        """The peerstore keeps the addresses of `peers()` while they are not connected (every other gone peer's
        are forgotten)."""
        self._keep_known.append(peers)

    def take_relays_from(self, addresses: Callable[[], Iterable[str]]) -> None:
        """Where this node may take relay slots once it learns it is private: `addresses()` of members that relay."""
        self._relay_sources.append(addresses)

    # lifecycle --------------------------------------------------------------------------------
    def start(self, timeout: float = 20.0) -> Node:
        libp2p_hardening.install()  # py-libp2p 0.8.1 paths where a peer's bytes would stop or wedge the host
        libp2p_tuning.install()  # and four of its per-message costs that grow with the swarm, cut
        self.loop.start(self._main, timeout, on_exit=self._stop_pubsub)
        return self

    def stop(self) -> None:
        """Close every connection and end the node's thread (within about 2 s)."""
        self.loop.stop()

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _stop_pubsub(self) -> None:
        if self._pubsub is not None:
            self._pubsub.seen_messages.stop()  # py-libp2p's cache sweeper thread

    def raise_if_failed(self) -> None:
        """Raise NodeFailed (one line: the root cause) if the node's loop ended on an error."""
        self.loop.raise_if_failed()

    async def _main(self) -> None:
        try:
            listen = [multiaddr.Multiaddr(a) for a in self.config.listen]
            host = transport.new_host(self.identity, self.config.announce, self.config.secret)
        except Exception as e:  # noqa: BLE001 - bad multiaddr strings and the like
            raise NodeError(f"bad node configuration: {e}") from e
        self._host = host
        # py-libp2p refuses to dial a peer again for 60 s once every address failed; a bootstrap is retried sooner
        self._bootstraps = bootstraps = reach.Bootstraps(
            self.config.bootstrap, self.peer_id, self._connect, self._live_peers,
            getattr(host.get_network(), "_negative_peer_cache", None))
        libp2p_hardening.watch(host, self.strike)  # a peer whose input py-libp2p failed on is struck
        self._pubsub, router = topics.new_pubsub(host)
        circuits, relay_config = reach.relay_protocol(host, self.config.relay_service)
        with trio.CancelScope() as scope:
            async with host.run(listen_addrs=listen), trio.open_nursery() as nursery:
                self.loop.use(nursery)
                host.get_network().register_notifee(peers.ConnectionWatcher(self._connected, self._disconnected))
                host.set_stream_handler(TProtocol(ids.AUTH), self.gate.on_stream)
                for protocol, wrapped in self._handlers.items():
                    host.set_stream_handler(TProtocol(protocol), wrapped)
                async with background_trio_service(self._pubsub), background_trio_service(router), \
                        background_trio_service(circuits), background_trio_service(reach.HolePunching(host)):
                    self._relay = CircuitV2Transport(host, circuits, relay_config)
                    self.relays = reach.Relays(host, self._relay, self._connect, self.peer_id, self.config.relays,
                                               self._relay_candidates, self._needs_relays)
                    if self.config.relays:  # the relays named are in the first addresses announced
                        with trio.move_on_after(10.0):
                            await self.relays.tend()
                    await self._pubsub.wait_until_ready()
                    for topic, decoder, callback in self._subscriptions:
                        await self._subscribe(topic, decoder, callback)
                    for addr in self.config.bootstrap:
                        self.loop.spawn(bootstraps.keep, (addr,), restart=True)
                    for task in self._tasks:
                        self.loop.spawn(task, (), restart=True)
                    self.loop.spawn(peers.forget_gone, (host, self._kept, self.config.forget_every_s), restart=True)
                    self.loop.spawn(self.relays.keep, (), restart=True)
                    await self.loop.serve()
                    scope.deadline = trio.current_time() + STOP_TIMEOUT_S - 0.5
                    nursery.cancel_scope.cancel()  # our tasks end (no re-dial meanwhile), then the connections close
                    with trio.CancelScope(shield=True):
                        await peers.close_all(host, STOP_TIMEOUT_S / 2)

    @property
    def running(self) -> bool:
        """The node's loop runs: started, and neither stopped nor failed."""
        return self.loop.running

    # the node's loop, from any thread ---------------------------------------------------------
    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run async `fn` in the node's loop from another thread and return its result."""
        return self.loop.call(fn, *args)

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Start async `fn(*args)` in the node's loop (from the loop or any other thread). It runs once: if it
        raises, that is logged and it ends; the node carries on."""
        self.loop.spawn(fn, args, restart=False)

    def add_task(self, fn: Callable[[], Any]) -> None:
        """Run async `fn()` in the node's loop for the node's lifetime (from start, or now if running); if it
        raises, that is logged and it runs again after a backoff (`supervisor.supervised`)."""
        self._tasks.append(fn)
        if self.loop.ready:
            self.loop.spawn(fn, (), restart=True)

    # addresses and connections ----------------------------------------------------------------
    @property
    def addrs(self) -> list[str]:
        """Multiaddrs peers should dial, each ending in /p2p/<peer id>: the public address peers saw it at when
        they could dial it there, its interfaces' (loopback only when it has nothing else), then relayed ones."""
        if self._host is None:
            return []
        out = []
        for a in self._host.get_addrs():
            text = str(a)
            if not addresses.unspecified(text) and "/p2p-circuit" not in text:  # nobody can dial 0.0.0.0
                out.append(text if "/p2p/" in text else f"{text}/p2p/{self.peer_id}")
        observed = self.reachability.public_addrs(self.peer_id)
        out = observed + [a for a in out if a not in observed]
        return addresses.announced(out) + (self.relays.addrs() if self.relays else [])

    def _needs_relays(self) -> bool:
        return self.reachability.reach == "private"

    def _relay_candidates(self) -> list[str]:
        return [addr for candidates in self._relay_sources for addr in candidates()]

    def _listen_ports(self) -> tuple[int, ...]:
        return addresses.tcp_ports(str(a) for a in self._host.get_addrs()) if self._host is not None else ()

    def _direct_ip(self, peer: str) -> str | None:
        endpoint = peers.direct_endpoint(self._host, _peer_id(peer)) if self._host is not None else None
        return endpoint[0] if endpoint else None

    async def _ask_dialback(self, peer: str, request: DialBack) -> DialedBack:
        return await self.requests.request(peer, DIALBACK, request, timeout=dialback.PROBE_TIMEOUT_S + 5.0)

    def connect(self, addr: str, timeout: float = 10.0) -> str:
        """Dial a multiaddr ending in /p2p/<peer id> (relayed: .../p2p-circuit/p2p/<id>); returns the peer id."""
        return str(self.call(self.connect_async, addr, timeout))

    async def connect_async(self, addr: str, timeout: float) -> str:
        try:
            maddr = multiaddr.Multiaddr(addr)
            info = info_from_p2p_addr(maddr)
        except Exception as e:  # noqa: BLE001
            raise NodeError(f"{addr!r} is not a multiaddr ending in /p2p/<peer id> ({e})") from None
        if addresses.unspecified(addr):
            raise NodeError(f"{addr}: {NOT_DIALABLE}")
        if "/p2p-circuit" not in addr:
            await self._connect(info, timeout)
            return str(info.peer_id)
        relay_part = addr.split("/p2p-circuit")[0]
        await self._connect(info_from_p2p_addr(multiaddr.Multiaddr(relay_part)), timeout)
        assert self._relay is not None
        await within(timeout, f"reaching {info.peer_id} through {relay_part}", self._relay.dial, maddr)
        return str(info.peer_id)

    async def _connect(self, info: Any, timeout: float) -> None:
        if self.bans.is_banned(str(info.peer_id)):
            raise PeerUnavailable(f"{info.peer_id} is banned")
        await within(timeout, f"connecting to {info.peer_id}", self._host.connect, info)

    def bootstrap_errors(self) -> dict[str, str]:
        """Each bootstrap address whose last dial failed, with why (an address not dialled yet is absent)."""
        return self._bootstraps.errors() if self._bootstraps else {}

    def unreachable(self) -> str | None:
        """Why the swarm cannot be reached (`reach.Bootstraps.unreachable`); None while it may be."""
        return self._bootstraps.unreachable(bool(self.connected_peers())) if self._bootstraps else None

    def remember_addrs(self, peer: str, addrs: tuple[str, ...]) -> None:
        """Record where `peer` can be dialled for REMEMBER_S, so streams to it connect on demand (call in the loop)."""
        store = self._host.get_peerstore()
        for addr in addrs:
            try:
                info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
            except Exception:  # noqa: BLE001 - a peer's bad address is its problem
                continue
            if info.peer_id.to_bytes() == _peer_bytes(peer) and not addresses.unspecified(addr) and \
                    addresses.worth_dialling(addr):
                store.add_addrs(info.peer_id, info.addrs, REMEMBER_S)

    def connected_peers(self) -> list[str]:
        if self._host is None:
            return []
        return [str(p) for p in self._live_peers()]

    def is_connected(self, peer: str) -> bool:
        if self._host is None:
            return False
        try:
            conns = self._host.get_network().connections.get(_peer_id(peer), [])
        except Exception:  # noqa: BLE001 - not a peer id
            return False
        return any(not getattr(c, "is_closed", False) for c in conns)

    def knows(self, peer: str) -> bool:
        """Whether this node is connected to `peer` or holds an address to dial it (a newcomer does not yet for
        the members its view has not brought it)."""
        if self.is_connected(peer):
            return True
        try:
            return bool(self._host.get_peerstore().addrs(_peer_id(peer))) if self._host is not None else False
        except Exception:  # noqa: BLE001 - not a peer id, or no record of it
            return False

    def _live_peers(self) -> set[Any]:
        return peers.live_peers(self._host)

    def _kept(self) -> set[str]:
        """Peers the peerstore keeps while not connected: this node, its bootstraps, `keep_dialable`'s (members)."""
        kept = {self.peer_id, *(self._bootstraps.peers() if self._bootstraps else ())}
        for more in list(self._keep_known):
            kept.update(more())
        return kept

    def stats(self) -> NodeStats:
        """Counts of what the node holds per peer (any thread)."""
        stats: NodeStats = self.call(peers.stats, self._host)
        return stats

    async def disconnect_async(self, peer: str) -> None:
        try:
            await self._host.disconnect(_peer_id(peer))
        except Exception as e:  # noqa: BLE001 - already gone
            log.debug("disconnect %s: %s", peer, e)

    def strike(self, peer: str, reason: str, severe: bool = False) -> None:
        """Count a misbehaviour of `peer` (any thread); a peer that is now banned is disconnected."""
        log.info("peer %s misbehaved: %s", peer, reason)
        if self.bans.strike(peer, reason, severe):
            log.warning("banning %s for %.0f s: %s", peer, self.bans.remaining(peer), reason)
            self.spawn(self.disconnect_async, peer)

    def _connected(self, peer: str) -> None:
        if self.bans.is_banned(peer):
            self.spawn(self.disconnect_async, peer)
            return
        self.gate.connected(peer)
        for connected, _ in list(self._peer_watchers):
            if connected is not None:
                connected(peer)

    def _disconnected(self, peer: str) -> None:
        if self._host is not None and _peer_id(peer) in self._live_peers():
            return
        self.gate.disconnected(peer)
        self.requests.forget(peer)
        for _, disconnected in list(self._peer_watchers):
            if disconnected is not None:
                disconnected(peer)

    # streams ----------------------------------------------------------------------------------
    async def new_stream_when_ready(self, peer: str, protocol: str) -> Any:
        """`connected` fires before the muxer is ready, so the first stream may fail: retry (caller bounds time)."""
        while True:
            try:
                return await self._host.new_stream(_peer_id(peer), [TProtocol(protocol)])
            except Exception as e:  # noqa: BLE001
                log.debug("stream %s to %s not ready: %s", protocol, peer, e)
                await trio.sleep(0.05)

    async def open_stream(self, peer: str, protocol: str) -> Any:
        if self.bans.is_banned(peer):
            raise PeerUnavailable(f"{peer} is banned for {self.bans.remaining(peer):.0f} s more")
        try:
            peer_id = _peer_id(peer)
        except Exception:  # noqa: BLE001
            raise NodeError(f"{peer!r} is not a peer id") from None
        if self.private and not await self.gate.admit(peer):
            raise PeerUnavailable(f"{peer} has not proven the swarm secret")
        try:
            return await self._host.new_stream(peer_id, [TProtocol(protocol)])
        except Exception:
            # py-libp2p dials only direct addresses on its own: a peer behind a NAT is reached through its relays
            if self.is_connected(peer) or not await reach.dial_relayed(self._host, peer_id, self.connect_async):
                raise
        return await self._host.new_stream(peer_id, [TProtocol(protocol)])

    def _set_handler(self, protocol: str, wrapped: Callable[[Any], Any]) -> None:
        self._handlers[protocol] = wrapped
        if self._host is not None:
            with contextlib.suppress(trio.RunFinishedError):  # the node stopped (a span loaded as it failed)
                self.loop.run_sync(self._host.set_stream_handler, TProtocol(protocol), wrapped)

    # request / response -----------------------------------------------------------------------
    def serve(self, rpc: Rpc[Any, Any], handler: Handler, threads: int | None = None) -> None:
        """Answer requests of `rpc`. A sync handler runs in a worker thread; an async one in the loop. It gets
        (peer id, request) and returns the reply; raising `ProtocolError` answers with an error and counts
        against the peer; other exceptions answer "internal error". `threads`: work that may take seconds
        (audits, reveals, judging) gets that many threads of its own, the requests past them waiting their turn
        without a thread; None: trio's shared pool, which serves session opens, beats and every quick handler
        and must never run out."""
        limiter = trio.CapacityLimiter(threads) if threads is not None else None
        self._set_handler(rpc.id, functools.partial(self.requests.serve_stream, rpc.id, handler,
                                                    rpc.request_decoder(self.config.max_tensor_bytes), limiter))

    def request(self, peer: str, rpc: Rpc[Req, Rep], msg: Req, timeout: float = 10.0) -> Rep:
        """Send `msg`, wait for the reply. Raises TimeoutError, PeerUnavailable or RemoteError."""
        reply: Rep = self.call(self.requests.send, peer, rpc, self.requests.encoded(rpc, msg), timeout)
        return reply

    # channels ---------------------------------------------------------------------------------
    def serve_channel(self, protocol: str, on_channel: Callable[[Channel], None], limit: int | None = None) -> None:
        """Accept channels on `protocol`; `on_channel` runs in a worker thread and should return quickly."""
        self._set_handler(protocol, functools.partial(channel.accept, self, protocol, on_channel,
                                                      limit or self.config.max_tensor_bytes))

    def open_channel(self, peer: str, protocol: str, timeout: float = 10.0, limit: int | None = None) -> Channel:
        opened: Channel = self.call(channel.open_channel, self, peer, protocol, timeout,
                                    limit or self.config.max_tensor_bytes)
        return opened

    # publish / subscribe ----------------------------------------------------------------------
    def topic(self, name: str) -> str:
        return ids.topic(self.config.swarm, name)

    def publish(self, topic: str, msg: Message) -> None:
        self.call(self.publish_async, topic, msg)

    async def publish_async(self, topic: str, msg: Message) -> None:
        await self.publish_encoded(topic, encode(msg))

    async def publish_encoded(self, topic: str, body: bytes) -> None:
        """Publish bytes as they are (what a peer can send anyone: tests of hostile gossip publish garbage)."""
        if len(body) > CONTROL_LIMIT:
            raise NodeError(f"pubsub message of {len(body)} bytes exceeds {CONTROL_LIMIT}")
        assert self._pubsub is not None
        await self._pubsub.publish(topic, body)

    def subscribe(self, topic: str, messages: Decoder[Any], callback: Callable[[str, Any], None]) -> None:
        """Call `callback(author peer id, message)` in the node's loop for each message; keep it quick."""
        self._subscriptions.append((topic, messages, callback))
        if self.loop.ready:
            self.call(self._subscribe, topic, messages, callback)

    async def _subscribe(self, topic: str, messages: Decoder[Any], callback: Callable[[str, Any], None]) -> None:
        assert self._pubsub is not None
        subscription = await self._pubsub.subscribe(topic)
        self.loop.spawn(topics.pump, (subscription, topic, messages, callback, self.peer_id, self.strike), restart=True)


@functools.lru_cache(maxsize=8192)
def _peer_id(peer: str) -> ID:
    return ID.from_base58(peer)


def _peer_bytes(peer: str) -> bytes:
    return bytes(_peer_id(peer).to_bytes())
