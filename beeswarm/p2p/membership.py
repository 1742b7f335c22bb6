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
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from beeswarm.p2p.node import Node, NodeError, PeerUnavailable
from beeswarm.protocol import Decoder, ProtocolError, ids
from beeswarm.protocol.membership import Heartbeat, Leave, NodeInfo

log = logging.getLogger(__name__)

MISSED_BEATS = 3
_messages: Decoder[Heartbeat | Leave] = Decoder(Heartbeat, Leave)


@dataclass(frozen=True)
class Member:
    info: NodeInfo
    last_seen: float  # time.monotonic()


Listener = Callable[[str, NodeInfo], None]  # (event: join | update | leave, info)


class Membership:
    """Nothing starts until `start()`; `clock` (monotonic seconds) is injectable for tests."""

    def __init__(self, node: Node, info: NodeInfo, interval: float = 3.0,
                 clock: Callable[[], float] = time.monotonic):
        self.node, self.interval, self.clock = node, interval, clock
        self._info = info
        self._members: dict[str, Member] = {}
        self._lock = threading.Lock()
        self.listeners: list[Listener] = []
        self._dialing: set[str] = set()

    @property
    def info(self) -> NodeInfo:
        return self._info

    def update(self, **changes: Any) -> None:
        self._info = msgspec.structs.replace(self._info, **changes)

    def start(self) -> None:
        """Subscribe and start beating; call before or after `node.start()`."""
        self.node.subscribe(self.node.topic(ids.MEMBERS_TOPIC), _messages, self._on_message)
        self.node.add_task(self._beat)

    def view(self) -> dict[str, NodeInfo]:
        with self._lock:
            return {peer: m.info for peer, m in self._members.items()}

    def leave(self) -> None:
        """Tell the swarm this node is leaving (best effort)."""
        try:
            self.node.publish(self.node.topic(ids.MEMBERS_TOPIC), Leave())
        except Exception as e:  # noqa: BLE001
            log.debug("leave announcement failed: %s", e)

    def _emit(self, event: str, info: NodeInfo) -> None:
        for listener in list(self.listeners):
            try:
                listener(event, info)
            except Exception:  # noqa: BLE001
                log.exception("membership listener failed")

    def _on_message(self, author: str, msg: Heartbeat | Leave) -> None:
        if isinstance(msg, Leave):
            with self._lock:
                gone = self._members.pop(author, None)
            if gone:
                self._emit("leave", gone.info)
            return
        info = msg.info
        if info.peer != author:
            raise ProtocolError(f"info claims to be {info.peer} but was published by {author}")
        known = self._members.get(author)
        if known is None or known.info.addrs != info.addrs:
            self.node.remember_addrs(author, info.addrs)
        with self._lock:
            old = self._members.get(author)
            self._members[author] = Member(info, self.clock())
        if old is None:
            self._emit("join", info)
        elif old.info != info:
            self._emit("update", info)

    def _complete_mesh(self) -> None:
        connected = set(self.node.connected_peers())
        for info in self.view().values():
            if info.peer not in connected and info.peer not in self._dialing:
                self._dialing.add(info.peer)
                self.node.spawn(self._dial, info)

    async def _dial(self, info: NodeInfo) -> None:
        try:
            for addr in sorted(info.addrs, key=lambda a: "/p2p-circuit" in a):  # direct addresses first
                try:
                    await self.node.connect_async(addr, 5.0)
                    return
                except (PeerUnavailable, NodeError) as e:
                    log.debug("dial %s at %s: %s", info.peer, addr, e)
        finally:
            self._dialing.discard(info.peer)

    async def _beat(self) -> None:
        next_beat = 0.0
        while True:
            now = self.clock()
            if now >= next_beat:
                self.update(addrs=tuple(self.node.addrs))
                try:
                    await self.node.publish_async(self.node.topic(ids.MEMBERS_TOPIC), Heartbeat(info=self._info))
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
