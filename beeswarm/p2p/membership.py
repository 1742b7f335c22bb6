"""Who is in the swarm: gossipsub heartbeats carrying each node's info, and a view with events.

Every node publishes its `NodeInfo` every `interval` seconds (far below gossipsub's per-peer rate
cap, a few hundred bytes against its 1 MiB limit). A member not heard from for 3 intervals is
declared gone. New members are dialled directly so the mesh becomes complete: stages and probes
need direct links.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

import trio

import beeswarm
from beeswarm.p2p import wire
from beeswarm.p2p.node import Node, NodeError, PeerUnavailable

log = logging.getLogger(__name__)

TOPIC = "members"
MISSED_BEATS = 3
MAX_SPANS = 8


@dataclass(frozen=True)
class NodeInfo:
    peer: str
    addrs: tuple[str, ...] = ()
    role: str = "contributor"  # contributor | client
    device: str = "cpu"
    memory_bytes: int = 0
    bench: dict[str, float] = field(default_factory=dict)  # device benchmark figures for the planner
    layers: tuple[int, int] | None = None  # the span served, [start, end)
    spans: tuple[tuple[int, int], ...] = ()  # every span loaded and served (two while migrating)
    load: float = 0.0
    state: str = "joining"  # joining | loading | serving | paused | leaving
    version: str = beeswarm.__version__
    links: dict[str, tuple[float, float, float]] = field(default_factory=dict)  # peer -> (rtt ms, up, down Mbit/s)

    def to_wire(self) -> dict:
        d = asdict(self)
        d["addrs"], d["layers"] = list(self.addrs), list(self.layers) if self.layers else None
        d["spans"] = [list(span) for span in self.spans]
        d["links"] = {peer: list(v) for peer, v in self.links.items()}
        return d

    @classmethod
    def from_wire(cls, d: object, author: str) -> NodeInfo:
        if not isinstance(d, dict):
            raise wire.ProtocolError("info is not a map")
        wire.expect({"t": "info", **d}, "info", peer=str, addrs=list, role=str, device=str, memory_bytes=int,
                    bench=dict, load=(int, float), state=str, version=str)
        if d["peer"] != author:
            raise wire.ProtocolError(f"info claims to be {d['peer']} but was published by {author}")
        if len(d["addrs"]) > 16 or not all(isinstance(a, str) and len(a) < 300 for a in d["addrs"]):
            raise wire.ProtocolError("addrs must be at most 16 short strings")
        if not all(isinstance(k, str) and isinstance(v, (int, float, type(None))) for k, v in d["bench"].items()):
            raise wire.ProtocolError("bench must map names to numbers")
        links = d.get("links", {})
        if not isinstance(links, dict) or len(links) > 512 or not all(
                isinstance(k, str) and isinstance(v, list) and len(v) == 3 and
                all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in v) for k, v in links.items()):
            raise wire.ProtocolError("links must map peer ids to [rtt_ms, up_mbps, down_mbps]")
        layers = d.get("layers")
        if layers is not None and not (isinstance(layers, list) and len(layers) == 2 and
                                       all(isinstance(x, int) and not isinstance(x, bool) for x in layers)):
            raise wire.ProtocolError("layers must be null or [start, end]")
        spans = d.get("spans", [])
        if not isinstance(spans, list) or len(spans) > MAX_SPANS or not all(
                isinstance(s, list) and len(s) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in s)
                for s in spans):
            raise wire.ProtocolError(f"spans must be a list of at most {MAX_SPANS} [start, end] pairs")
        return cls(peer=d["peer"], addrs=tuple(d["addrs"]), role=d["role"], device=d["device"],
                   memory_bytes=d["memory_bytes"], bench=dict(d["bench"]), layers=tuple(layers) if layers else None,
                   spans=tuple(tuple(s) for s in spans),
                   load=float(d["load"]), state=d["state"], version=d["version"],
                   links={k: (float(v[0]), float(v[1]), float(v[2])) for k, v in links.items()})


@dataclass(frozen=True)
class Member:
    info: NodeInfo
    last_seen: float  # time.monotonic()


Listener = Callable[[str, NodeInfo], None]  # (event: join | update | leave, info)


class Membership:
    def __init__(self, node: Node, info: NodeInfo, interval: float = 3.0):
        self.node, self.interval = node, interval
        self._info = info
        self._members: dict[str, Member] = {}
        self._lock = threading.Lock()
        self.listeners: list[Listener] = []
        self._dialing: set[str] = set()

    @property
    def info(self) -> NodeInfo:
        return self._info

    def update(self, **changes) -> None:
        self._info = replace(self._info, **changes)

    def start(self) -> None:
        """Subscribe and start beating; call before or after `node.start()`."""
        self.node.subscribe(self.node.topic(TOPIC), self._on_message)
        self.node.add_task(self._beat)

    def view(self) -> dict[str, NodeInfo]:
        with self._lock:
            return {peer: m.info for peer, m in self._members.items()}

    def leave(self) -> None:
        """Tell the swarm this node is leaving (best effort)."""
        try:
            self.node.publish(self.node.topic(TOPIC), wire.message("leave"))
        except Exception as e:  # noqa: BLE001
            log.debug("leave announcement failed: %s", e)

    def _emit(self, event: str, info: NodeInfo) -> None:
        for listener in list(self.listeners):
            try:
                listener(event, info)
            except Exception:  # noqa: BLE001
                log.exception("membership listener failed")

    def _on_message(self, author: str, msg: dict) -> None:
        if msg["t"] == "leave":
            with self._lock:
                gone = self._members.pop(author, None)
            if gone:
                self._emit("leave", gone.info)
            return
        info = NodeInfo.from_wire(wire.expect(msg, "heartbeat", info=dict)["info"], author)
        known = self._members.get(author)
        if known is None or known.info.addrs != info.addrs:
            self.node.remember_addrs(author, info.addrs)
        with self._lock:
            old = self._members.get(author)
            self._members[author] = Member(info, time.monotonic())
        if old is None:
            self._emit("join", info)
        elif old.info != info:
            self._emit("update", info)

    def _complete_mesh(self) -> None:
        connected = set(self.node.connected_peers())
        for info in self.view().values():
            if info.peer not in connected and info.peer not in self._dialing:
                self._dialing.add(info.peer)
                self.node._nursery.start_soon(self._dial, info)

    async def _dial(self, info: NodeInfo) -> None:
        try:
            for addr in sorted(info.addrs, key=lambda a: "/p2p-circuit" in a):  # direct addresses first
                try:
                    await self.node._connect_addr(addr, 5.0)
                    return
                except (PeerUnavailable, NodeError) as e:
                    log.debug("dial %s at %s: %s", info.peer, addr, e)
        finally:
            self._dialing.discard(info.peer)

    async def _beat(self) -> None:
        next_beat = 0.0
        while True:
            now = time.monotonic()
            if now >= next_beat:
                self._info = replace(self._info, addrs=tuple(self.node.addrs))
                body = wire.pack(wire.message("heartbeat", info=self._info.to_wire()))
                try:
                    await self.node._pubsub.publish(self.node.topic(TOPIC), body)
                except Exception as e:  # noqa: BLE001 - no peers yet, and the like
                    log.debug("heartbeat not sent: %s", e)
                next_beat = now + self.interval
            cutoff = now - MISSED_BEATS * self.interval
            with self._lock:
                gone = [m.info for m in self._members.values() if m.last_seen < cutoff]
                for info in gone:
                    del self._members[info.peer]
            for info in gone:
                log.info("member %s missed %d heartbeats: gone", info.peer, MISSED_BEATS)
                self._emit("leave", info)
            self._complete_mesh()
            await trio.sleep(min(0.25, self.interval / 4))
