"""A py-libp2p host in its own trio thread, behind a small thread-safe API.

py-libp2p is trio-only while torch workers and Textual live elsewhere, so the node runs trio in a
thread of its own and every public method may be called from any thread (`a*` variants await from
asyncio). Transport: TCP + Noise (only) + Yamux, one connection per peer. Every stream's reader
drains into our own buffers so slow compute never stalls a yamux window (py-libp2p resets a
writer that waits more than 5 s for one).
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import multiaddr
import trio
from libp2p import new_host
from libp2p.abc import INotifee
from libp2p.crypto.x25519 import create_new_key_pair as new_x25519_key_pair
from libp2p.custom_types import TProtocol
from libp2p.network.config import ConnectionConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import info_from_p2p_addr
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pubsub import Pubsub
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as RELAY_HOP
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.resources import RelayLimits
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from libp2p.tools.anyio_service import background_trio_service

from beeswarm.p2p import auth, wire
from beeswarm.p2p.bans import BanList
from beeswarm.p2p.channel import (  # noqa: F401 - errors re-exported for callers of the node
    Channel, ChannelClosed, NodeError, PeerUnavailable, close_stream, quiet_reset, within)
from beeswarm.p2p.identity import Identity

log = logging.getLogger(__name__)

GOSSIPSUB = TProtocol("/meshsub/1.0.0")
AUTH_TIMEOUT_S = 2.0
REQUEST_READ_TIMEOUT_S = 30.0
IDLE_STREAM_S = 60.0  # a reused request stream idle this long is closed by the server
MAX_IDLE_STREAMS = 4  # per (peer, protocol)
STOP_TIMEOUT_S = 2.0


@dataclass
class NodeConfig:
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce: list[str] = field(default_factory=list)
    bootstrap: list[str] = field(default_factory=list)
    swarm: str = "beeswarm"
    secret: bytes | None = None  # None: an open swarm
    max_tensor_bytes: int = wire.TENSOR_LIMIT
    relays: list[str] = field(default_factory=list)  # reserve a slot on these and announce the relayed address
    relay_service: bool = False  # relay circuits for peers that cannot be dialled


Handler = Callable[[str, dict], Any]  # (peer id, message) -> reply message; sync runs in a worker thread


class _ConnectionWatcher(INotifee):
    def __init__(self, node: Node):
        self.node = node

    async def opened_stream(self, network, stream) -> None:
        pass

    async def closed_stream(self, network, stream) -> None:
        pass

    async def connected(self, network, conn) -> None:
        self.node._on_connected(str(conn.muxed_conn.peer_id))

    async def disconnected(self, network, conn) -> None:
        self.node._on_disconnected(str(conn.muxed_conn.peer_id))

    async def listen(self, network, multiaddr) -> None:
        pass

    async def listen_close(self, network, multiaddr) -> None:
        pass


class Node:
    """One beeswarm peer on the libp2p mesh."""

    def __init__(self, identity: Identity, config: NodeConfig | None = None, bans: BanList | None = None):
        self.identity = identity
        self.config = config or NodeConfig()
        self.bans = bans or BanList()
        self.peer_id = identity.peer_id
        self._handlers: dict[str, Callable] = {}
        self._subscriptions: list[tuple[str, Callable[[str, dict], None]]] = []
        self._tasks: list[Callable] = []
        self._idle_streams: dict[tuple[str, str], list[tuple[Any, wire.FrameReader]]] = {}
        self._authed: dict[str, trio.Event] = {}
        self._mac_key = auth.mac_key(self.config.secret) if self.config.secret else None
        self._token: trio.lowlevel.TrioToken | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: trio.Event | None = None
        self._nursery: trio.Nursery | None = None
        self._host = None
        self._pubsub: Pubsub | None = None
        self._relay: CircuitV2Transport | None = None
        self.relayed_addrs: list[str] = []
        self.on_peer_connected: list[Callable[[str], None]] = []
        self.on_peer_disconnected: list[Callable[[str], None]] = []

    @property
    def private(self) -> bool:
        return self._mac_key is not None

    # lifecycle --------------------------------------------------------------------------------
    def start(self, timeout: float = 20.0) -> Node:
        if self._thread is not None:
            raise NodeError("node already started")
        self._thread = threading.Thread(target=self._thread_main, name=f"p2p-{self.peer_id[-6:]}", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout):
            self.stop()
            raise NodeError(f"node did not start within {timeout} s")
        if self._error is not None:
            raise NodeError(f"node failed to start: {self._error}") from self._error
        return self

    def stop(self) -> None:
        """Close every connection and end the node's thread (within about 2 s)."""
        if self._thread is None:
            return
        if self._token is not None and self._stop is not None:
            try:
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
            except trio.RunFinishedError:
                pass
        self._thread.join(STOP_TIMEOUT_S + 1)
        if self._thread.is_alive():
            log.warning("p2p thread of %s did not end in time", self.peer_id)

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _thread_main(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as e:  # noqa: BLE001 - report, never crash the process
            if not self._ready.is_set():
                self._error = e
            else:
                log.exception("p2p node %s stopped on an error", self.peer_id)
        finally:
            if self._pubsub is not None:
                self._pubsub.seen_messages.stop()  # py-libp2p's cache sweeper thread
            self._ready.set()

    def _new_host(self):
        kp = self.identity.key_pair
        noise = NoiseTransport(kp, noise_privkey=new_x25519_key_pair().private_key)
        return new_host(
            key_pair=kp,
            sec_opt={NOISE_PROTOCOL_ID: noise},  # the default also accepts plaintext peers
            muxer_preference="YAMUX",
            connection_config=ConnectionConfig(max_connections_per_peer=1),
            announce_addrs=[multiaddr.Multiaddr(a) for a in self.config.announce] or None,
            psk=auth.pnet_key(self.config.secret) if self.config.secret else None,
        )

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        try:
            listen = [multiaddr.Multiaddr(a) for a in self.config.listen]
            host = self._new_host()
        except Exception as e:  # noqa: BLE001 - bad multiaddr strings and the like
            raise NodeError(f"bad node configuration: {e}") from e
        self._host = host
        # Rate limits well above our heartbeat rate; localhost peers share one IP, so no IP diversity rule.
        router = GossipSub(protocols=[GOSSIPSUB], degree=6, degree_low=4, degree_high=12, heartbeat_interval=1,
                           heartbeat_initial_delay=0.1, eclipse_protection_enabled=False,
                           max_messages_per_topic_per_second=50.0)
        self._pubsub = Pubsub(host, router, max_inbound_rpc_size=wire.CONTROL_LIMIT * 4)
        limits = RelayLimits(duration=24 * 3600, data=1 << 40, max_circuit_conns=64, max_reservations=64)
        circuits = CircuitV2Protocol(host, limits=limits, allow_hop=self.config.relay_service)
        roles = RelayRole.STOP | RelayRole.CLIENT | (RelayRole.HOP if self.config.relay_service else RelayRole(0))
        with trio.CancelScope() as scope:
            async with host.run(listen_addrs=listen), trio.open_nursery() as nursery:
                self._nursery = nursery
                host.get_network().register_notifee(_ConnectionWatcher(self))
                host.set_stream_handler(TProtocol(auth.PROTOCOL), self._on_auth_stream)
                for protocol, wrapped in self._handlers.items():
                    host.set_stream_handler(TProtocol(protocol), wrapped)
                async with background_trio_service(self._pubsub), background_trio_service(router), \
                        background_trio_service(circuits):
                    self._relay = CircuitV2Transport(host, circuits, RelayConfig(roles=roles, limits=limits))
                    for addr in self.config.relays:
                        await self._reserve(addr)
                    await self._pubsub.wait_until_ready()
                    for topic, callback in self._subscriptions:
                        await self._subscribe(topic, callback)
                    for addr in self.config.bootstrap:
                        nursery.start_soon(self._keep_connected, addr)
                    for task in self._tasks:
                        nursery.start_soon(task)
                    self._ready.set()
                    await self._stop.wait()
                    scope.deadline = trio.current_time() + STOP_TIMEOUT_S - 0.5
                    nursery.cancel_scope.cancel()

    def _run(self, fn: Callable, *args):
        """Run async `fn` in the node's trio loop from another thread and return its result."""
        if self._token is None or not self._ready.is_set():
            raise NodeError("node is not running")
        try:
            return trio.from_thread.run(fn, *args, trio_token=self._token)
        except trio.RunFinishedError:
            raise NodeError("node has stopped") from None
        except trio.Cancelled:  # the node's loop cancelled the call: it is stopping
            raise NodeError("node is stopping") from None
        except BaseExceptionGroup as e:
            if e.split(trio.Cancelled)[1] is None:  # nothing but cancellation: the node is stopping
                raise NodeError("node is stopping") from None
            raise

    def _run_sync(self, fn: Callable, *args):
        if self._token is None:
            return fn(*args)
        return trio.from_thread.run_sync(fn, *args, trio_token=self._token)

    # addresses and connections ----------------------------------------------------------------
    @property
    def addrs(self) -> list[str]:
        """Multiaddrs peers should dial, each ending in /p2p/<peer id>."""
        if self._host is None:
            return []
        out = []
        for a in self._host.get_addrs():
            text = str(a)
            out.append(text if "/p2p/" in text else f"{text}/p2p/{self.peer_id}")
        return out + self.relayed_addrs

    def connect(self, addr: str, timeout: float = 10.0) -> str:
        """Dial a multiaddr ending in /p2p/<peer id> (relayed: .../p2p-circuit/p2p/<id>); returns the peer id."""
        return self._run(self._connect_addr, addr, timeout)

    async def _connect_addr(self, addr: str, timeout: float) -> str:
        try:
            maddr = multiaddr.Multiaddr(addr)
            info = info_from_p2p_addr(maddr)
        except Exception as e:  # noqa: BLE001
            raise NodeError(f"{addr!r} is not a multiaddr ending in /p2p/<peer id> ({e})") from None
        if "/p2p-circuit" not in addr:
            await self._connect(info, timeout)
            return str(info.peer_id)
        relay_part = addr.split("/p2p-circuit")[0]
        await self._connect(info_from_p2p_addr(multiaddr.Multiaddr(relay_part)), timeout)
        await within(timeout, f"reaching {info.peer_id} through {relay_part}", self._relay.dial, maddr)
        return str(info.peer_id)

    async def _reserve(self, relay_addr: str) -> None:
        """Take a slot on a relay and announce the address peers can reach us through."""
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(relay_addr))
            await self._connect(info, 10.0)
            with trio.fail_after(10.0):
                stream = await self._host.new_stream(info.peer_id, [RELAY_HOP])
                ok = await self._relay.reserve(stream, info.peer_id, self._nursery)
        except Exception as e:  # noqa: BLE001
            log.error("no reservation on relay %s: %s", relay_addr, e)
            return
        if not ok:
            log.error("relay %s refused a reservation", relay_addr)
            return
        self.relayed_addrs.append(f"{relay_addr}/p2p-circuit/p2p/{self.peer_id}")
        log.info("reachable through relay %s", relay_addr)

    async def _connect(self, info, timeout: float) -> None:
        if self.bans.is_banned(str(info.peer_id)):
            raise PeerUnavailable(f"{info.peer_id} is banned")
        await within(timeout, f"connecting to {info.peer_id}", self._host.connect, info)

    async def _keep_connected(self, addr: str) -> None:
        """Dial a bootstrap address, and again whenever the connection drops."""
        try:
            info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
        except Exception as e:  # noqa: BLE001
            log.error("bootstrap address %r is invalid: %s", addr, e)
            return
        if str(info.peer_id) == self.peer_id:
            return
        while True:
            if info.peer_id not in self._host.get_connected_peers():
                try:
                    await self._connect(info, 10.0)
                except PeerUnavailable as e:
                    log.info("bootstrap %s: %s", addr, e)
            await trio.sleep(2.0)

    def remember_addrs(self, peer: str, addrs) -> None:
        """Record where `peer` can be dialled, so streams to it connect on demand (call in the loop)."""
        store = self._host.get_peerstore()
        for addr in addrs:
            try:
                info = info_from_p2p_addr(multiaddr.Multiaddr(addr))
            except Exception:  # noqa: BLE001 - a peer's bad address is its problem
                continue
            if str(info.peer_id) == peer:
                store.add_addrs(info.peer_id, info.addrs, 600)

    def connected_peers(self) -> list[str]:
        if self._host is None:
            return []
        return [str(p) for p in self._host.get_connected_peers()]

    def disconnect(self, peer: str) -> None:
        self._run(self._disconnect, peer)

    async def _disconnect(self, peer: str) -> None:
        try:
            await self._host.disconnect(ID.from_base58(peer))
        except Exception as e:  # noqa: BLE001 - already gone
            log.debug("disconnect %s: %s", peer, e)

    def _strike(self, peer: str, reason: str, severe: bool = False) -> None:
        log.info("peer %s misbehaved: %s", peer, reason)
        if self.bans.strike(peer, reason, severe):
            log.warning("banning %s for %.0f s: %s", peer, self.bans.remaining(peer), reason)
            if self._nursery is not None:
                self._nursery.start_soon(self._disconnect, peer)

    def _on_connected(self, peer: str) -> None:
        if self.bans.is_banned(peer):
            self._nursery.start_soon(self._disconnect, peer)
            return
        if self.private:
            self._authed.setdefault(peer, trio.Event())
            self._nursery.start_soon(self._challenge, peer)
        for cb in self.on_peer_connected:
            cb(peer)

    def _on_disconnected(self, peer: str) -> None:
        if self._host is not None and ID.from_base58(peer) in self._host.get_connected_peers():
            return
        self._authed.pop(peer, None)
        for key in [k for k in self._idle_streams if k[0] == peer]:
            del self._idle_streams[key]
        for cb in self.on_peer_disconnected:
            cb(peer)

    # private swarms ---------------------------------------------------------------------------
    async def _challenge(self, peer: str) -> None:
        """Ask `peer` to prove it knows the swarm secret; drop it if it cannot within 2 s."""
        ok = False
        challenge = auth.nonce()
        try:
            with trio.fail_after(AUTH_TIMEOUT_S):
                stream = await self._new_stream_when_ready(peer, auth.PROTOCOL)
                try:
                    await wire.write_frame(stream, wire.pack(wire.message("challenge", nonce=challenge)))
                    reply = wire.expect(wire.unpack(await wire.read_frame(stream, wire.CONTROL_LIMIT)), "proof",
                                        nonce=bytes, mac=bytes)
                finally:
                    await quiet_reset(stream)
            ok = auth.verify(self._mac_key, peer, self.peer_id, challenge, reply["nonce"], reply["mac"])
        except Exception as e:  # noqa: BLE001 - timeouts, protocol errors, resets
            log.info("auth of %s failed: %s: %s", peer, type(e).__name__, e)
        if ok:
            self._authed.setdefault(peer, trio.Event()).set()
            return
        self._strike(peer, "failed the swarm-secret challenge", severe=True)
        await self._disconnect(peer)

    async def _new_stream_when_ready(self, peer: str, protocol: str):
        """`connected` fires before the muxer is ready, so the first stream may fail: retry (caller bounds time)."""
        while True:
            try:
                return await self._host.new_stream(ID.from_base58(peer), [TProtocol(protocol)])
            except Exception as e:  # noqa: BLE001
                log.debug("stream %s to %s not ready: %s", protocol, peer, e)
                await trio.sleep(0.05)

    async def _on_auth_stream(self, stream) -> None:
        peer = str(stream.muxed_conn.peer_id)
        try:
            with trio.fail_after(AUTH_TIMEOUT_S):
                msg = wire.expect(wire.unpack(await wire.read_frame(stream, wire.CONTROL_LIMIT)), "challenge",
                                  nonce=bytes)
                if not self.private:
                    await wire.write_frame(stream, wire.pack(wire.error("this swarm is open")))
                    return
                mine = auth.nonce()
                mac = auth.proof(self._mac_key, self.peer_id, peer, msg["nonce"], mine)
                await wire.write_frame(stream, wire.pack(wire.message("proof", nonce=mine, mac=mac)))
        except (trio.TooSlowError, wire.ProtocolError) as e:
            self._strike(peer, f"auth: {e}")
        except Exception as e:  # noqa: BLE001
            log.debug("auth stream from %s: %s", peer, e)
        finally:
            await close_stream(stream)  # a reset could overtake the proof still in flight

    async def _admit(self, peer: str) -> bool:
        """May `peer` be served? Not when banned; in a private swarm, only once it passed the challenge."""
        if self.bans.is_banned(peer):
            return False
        if not self.private:
            return True
        event = self._authed.setdefault(peer, trio.Event())
        with trio.move_on_after(AUTH_TIMEOUT_S):
            await event.wait()
        return event.is_set()

    def is_authenticated(self, peer: str) -> bool:
        event = self._authed.get(peer)
        return not self.private or (event is not None and event.is_set())

    # request / response -----------------------------------------------------------------------
    def serve(self, protocol: str, handler: Handler, limit: int = wire.CONTROL_LIMIT) -> None:
        """Answer requests on `protocol`. A sync handler runs in a worker thread; an async one in trio.

        The handler gets (peer id, message) and returns the reply map; raising `wire.ProtocolError`
        answers with an error and counts against the peer; other exceptions answer "internal error".
        """
        wrapped = functools.partial(self._on_request_stream, protocol, handler, limit)
        self._handlers[protocol] = wrapped
        if self._host is not None:
            self._run_sync(self._host.set_stream_handler, TProtocol(protocol), wrapped)

    async def _on_request_stream(self, protocol: str, handler: Handler, limit: int, stream) -> None:
        """Serve requests on one stream until the peer closes it (clients reuse streams: ~3 ms saved each)."""
        peer = str(stream.muxed_conn.peer_id)
        try:
            if not await self._admit(peer):
                return
            first, frames = True, wire.FrameReader(stream, limit)
            while True:
                try:
                    with trio.fail_after(REQUEST_READ_TIMEOUT_S if first else IDLE_STREAM_S):
                        body = await frames.next()
                        if body is None:
                            return  # the client closed its end: done
                        msg = wire.unpack(body, limit)
                except trio.TooSlowError:
                    if first:
                        self._strike(peer, f"{protocol}: request too slow")
                    return
                except wire.ProtocolError as e:
                    self._strike(peer, f"{protocol}: {e}")
                    await wire.write_frame(stream, wire.pack(wire.error(f"bad request: {e}")))
                    return
                first = False
                await wire.write_frame(stream, wire.pack(await self._handle(protocol, handler, peer, msg)))
        except Exception as e:  # noqa: BLE001 - the peer went away mid-request
            log.debug("request stream %s from %s: %s", protocol, peer, e)
        finally:
            await close_stream(stream)

    async def _handle(self, protocol: str, handler: Handler, peer: str, msg: dict) -> dict:
        try:
            if inspect.iscoroutinefunction(handler):
                return await handler(peer, msg)
            return await trio.to_thread.run_sync(handler, peer, msg)
        except wire.ProtocolError as e:
            self._strike(peer, f"{protocol}: {e}")
            return wire.error(str(e))
        except Exception:  # noqa: BLE001 - a handler bug must not take the node down
            log.exception("handler for %s failed on a request from %s", protocol, peer)
            return wire.error("internal error")

    def request(self, peer: str, protocol: str, msg: dict, timeout: float = 10.0,
                limit: int = wire.CONTROL_LIMIT) -> dict:
        """Send `msg`, wait for the reply. Raises TimeoutError, PeerUnavailable or wire.RemoteError."""
        body = wire.pack(msg)
        if len(body) > limit:
            raise NodeError(f"request of {len(body)} bytes exceeds the {limit}-byte limit")
        reply = self._run(self._request, peer, protocol, body, timeout, limit)
        if reply["t"] == "error":
            raise wire.RemoteError(str(reply.get("error")))
        return reply

    # asyncio callers (the Textual apps) await these; each runs the blocking call in a worker thread.
    async def arequest(self, *args, **kwargs) -> dict:
        return await asyncio.to_thread(self.request, *args, **kwargs)

    async def aconnect(self, *args, **kwargs) -> str:
        return await asyncio.to_thread(self.connect, *args, **kwargs)

    async def aopen_channel(self, *args, **kwargs) -> Channel:
        return await asyncio.to_thread(self.open_channel, *args, **kwargs)

    async def apublish(self, *args, **kwargs) -> None:
        return await asyncio.to_thread(self.publish, *args, **kwargs)

    async def _request(self, peer: str, protocol: str, body: bytes, timeout: float, limit: int) -> dict:
        key = (peer, protocol)
        try:
            with trio.fail_after(timeout):
                while True:
                    pooled = self._idle_streams.get(key)
                    from_pool = bool(pooled)
                    if from_pool:
                        stream, frames = pooled.pop()
                    else:
                        stream = await self._open_stream(peer, protocol)
                        frames = wire.FrameReader(stream, limit)
                    try:
                        await wire.write_frame(stream, body)
                        reply = wire.unpack(await frames.expect(), limit)
                    except Exception:  # noqa: BLE001
                        await quiet_reset(stream)
                        if from_pool:
                            continue  # the reused stream had gone stale (idle close, peer restart): a fresh one
                        raise
                    idle = self._idle_streams.setdefault(key, [])
                    if len(idle) < MAX_IDLE_STREAMS:
                        idle.append((stream, frames))
                    else:
                        await close_stream(stream)
                    return reply
        except trio.TooSlowError:
            raise TimeoutError(f"{protocol} request to {peer} timed out after {timeout} s") from None
        except wire.ProtocolError as e:
            self._strike(peer, f"{protocol} reply: {e}")
            raise PeerUnavailable(f"bad reply from {peer}: {e}") from None
        except (PeerUnavailable, NodeError):
            raise
        except Exception as e:  # noqa: BLE001 - resets, refused protocol, closed connection
            raise PeerUnavailable(f"{protocol} to {peer}: {type(e).__name__}: {e}") from None

    async def _open_stream(self, peer: str, protocol: str):
        if self.bans.is_banned(peer):
            raise PeerUnavailable(f"{peer} is banned for {self.bans.remaining(peer):.0f} s more")
        try:
            peer_id = ID.from_base58(peer)
        except Exception:  # noqa: BLE001
            raise NodeError(f"{peer!r} is not a peer id") from None
        if self.private and not await self._admit(peer):
            raise PeerUnavailable(f"{peer} has not proven the swarm secret")
        return await self._host.new_stream(peer_id, [TProtocol(protocol)])

    # channels ---------------------------------------------------------------------------------
    def serve_channel(self, protocol: str, on_channel: Callable[[Channel], None], limit: int | None = None) -> None:
        """Accept channels on `protocol`; `on_channel` runs in a worker thread and should return quickly."""
        wrapped = functools.partial(self._on_channel_stream, protocol, on_channel,
                                    limit or self.config.max_tensor_bytes)
        self._handlers[protocol] = wrapped
        if self._host is not None:
            self._run_sync(self._host.set_stream_handler, TProtocol(protocol), wrapped)

    async def _on_channel_stream(self, protocol: str, on_channel, limit: int, stream) -> None:
        peer = str(stream.muxed_conn.peer_id)
        if not await self._admit(peer):
            await quiet_reset(stream)
            return
        channel = Channel(self, stream, peer, protocol, limit)
        try:
            await trio.to_thread.run_sync(on_channel, channel)
            self._nursery.start_soon(channel._reader)  # after the handler, so it can set on_frame first
        except Exception:  # noqa: BLE001
            log.exception("channel handler for %s failed", protocol)
            channel._mark_closed("handler failed")
            await quiet_reset(stream)

    def open_channel(self, peer: str, protocol: str, timeout: float = 10.0, limit: int | None = None) -> Channel:
        return self._run(self._open_channel, peer, protocol, timeout, limit or self.config.max_tensor_bytes)

    async def _open_channel(self, peer: str, protocol: str, timeout: float, limit: int) -> Channel:
        try:
            with trio.fail_after(timeout):
                stream = await self._open_stream(peer, protocol)
        except trio.TooSlowError:
            raise TimeoutError(f"opening {protocol} to {peer} timed out") from None
        except (PeerUnavailable, NodeError):
            raise
        except Exception as e:  # noqa: BLE001
            raise PeerUnavailable(f"{protocol} to {peer}: {type(e).__name__}: {e}") from None
        channel = Channel(self, stream, peer, protocol, limit)
        self._nursery.start_soon(channel._reader)
        return channel

    # publish / subscribe ----------------------------------------------------------------------
    def topic(self, name: str) -> str:
        return f"beeswarm/{self.config.swarm}/{name}"

    def publish(self, topic: str, msg: dict) -> None:
        body = wire.pack(msg)
        if len(body) > wire.CONTROL_LIMIT:
            raise NodeError(f"pubsub message of {len(body)} bytes exceeds {wire.CONTROL_LIMIT}")
        self._run(self._pubsub.publish, topic, body)

    def subscribe(self, topic: str, callback: Callable[[str, dict], None]) -> None:
        """Call `callback(author peer id, message)` in the node's loop for each message; keep it quick."""
        self._subscriptions.append((topic, callback))
        if self._ready.is_set() and self._token is not None:
            self._run(self._subscribe, topic, callback)

    async def _subscribe(self, topic: str, callback) -> None:
        subscription = await self._pubsub.subscribe(topic)
        self._nursery.start_soon(self._pump, topic, subscription, callback)

    async def _pump(self, topic: str, subscription, callback) -> None:
        while True:
            message = await subscription.get()
            try:
                author = str(ID(message.from_id))
            except Exception:  # noqa: BLE001
                continue
            if author == self.peer_id:
                continue
            try:
                msg = wire.unpack(message.data)
            except wire.ProtocolError as e:
                self._strike(author, f"{topic}: {e}")
                continue
            try:
                callback(author, msg)
            except wire.ProtocolError as e:
                self._strike(author, f"{topic}: {e}")
            except Exception:  # noqa: BLE001
                log.exception("subscriber of %s failed", topic)

    # components running inside the loop -------------------------------------------------------
    def add_task(self, fn: Callable) -> None:
        """Run async `fn()` in the node's loop for the node's lifetime (from start, or now if running)."""
        self._tasks.append(fn)
        if self._nursery is not None and self._ready.is_set():
            self._run_sync(self._nursery.start_soon, fn)
