"""Link probes: RTT (median of small pings) and bulk throughput both ways, cached with their age."""
from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from beeswarm.p2p.channel import Channel
from beeswarm.p2p.errors import ChannelClosed
from beeswarm.p2p.node import Node
from beeswarm.protocol import Decoder, ProtocolError, encode, ids
from beeswarm.protocol.membership import NodeInfo
from beeswarm.protocol.probe import MAX_BULK, Download, Ping, Pong, Upload, Uploaded

if TYPE_CHECKING:
    from beeswarm.p2p.membership import Membership

log = logging.getLogger(__name__)

DEFAULT_BULK = 4 * 1024 * 1024
PROBE_PARTS = 3  # pings, upload, download
_requests: Decoder[Ping | Upload | Download] = Decoder(Ping, Upload, Download)
_replies: Decoder[Pong | Uploaded] = Decoder(Pong, Uploaded)


@dataclass(frozen=True)
class LinkProbe:
    peer: str
    rtt_ms: float
    up_mbps: float  # this node -> peer
    down_mbps: float  # peer -> this node
    measured_at: float  # time.monotonic()

    @property
    def age_s(self) -> float:
        return time.monotonic() - self.measured_at


def _serve_one(channel: Channel) -> None:
    """Answer pings and bulk transfers on one probe channel until it closes."""
    try:
        while True:
            msg = _requests.decode(channel.recv(timeout=30))
            if isinstance(msg, Ping):
                channel.send(encode(Pong()))
            elif isinstance(msg, Upload):  # the payload frame follows
                if len(channel.recv(timeout=60)) != msg.bytes:
                    raise ProtocolError("upload size differs from the announced one")
                channel.send(encode(Uploaded()))
            else:
                channel.send(bytes(msg.bytes))
    except (ChannelClosed, TimeoutError):
        pass
    except ProtocolError as e:
        channel.node.strike(channel.peer, f"probe: {e}")
    finally:
        channel.close()


class Prober:
    """Serves probes and measures links; results cached per peer for `max_age_s`."""

    def __init__(self, node: Node, max_age_s: float = 300.0):
        self.node, self.max_age_s = node, max_age_s
        self._cache: dict[str, LinkProbe] = {}
        self._lock = threading.Lock()

    def start(self) -> Prober:
        """Answer other nodes' probes."""
        self.node.serve_channel(ids.PROBE, lambda ch: threading.Thread(target=_serve_one, args=(ch,), daemon=True,
                                                                      name="probe-serve").start(),
                                limit=MAX_BULK + 1024)
        return self

    def cached(self, peer: str) -> LinkProbe | None:
        with self._lock:
            probe = self._cache.get(peer)
        return probe if probe is not None and probe.age_s <= self.max_age_s else None

    def all(self) -> dict[str, LinkProbe]:
        with self._lock:
            return dict(self._cache)

    def report_links(self, members: Membership, every_s: float = 60.0, bulk_bytes: int = DEFAULT_BULK,
                     stop: threading.Event | None = None,
                     on_progress: Callable[[str, int, int, str | None], None] | None = None) -> threading.Thread:
        """Probe every member in a background thread and publish the figures in this node's heartbeat.

        Each pair is measured again after `every_s`; the planner reads them as `rtt_ms`/`up`/`down`. One probe at a
        time, the most wanted first: contributors before clients (the planner prices contributors' links only; a
        contributor joining waited behind probes of `status` clients that came and went), the never measured before
        the stale. `on_progress(peer, done, total, error)` follows each probe's parts (pings, upload, download).
        """
        report = on_progress or (lambda peer, done, total, error: None)
        stop = stop or threading.Event()

        failed: dict[str, float] = {}  # peer -> when its last probe failed: tried again only after `every_s`

        def wanted(view: dict[str, NodeInfo]) -> str | None:
            now = time.monotonic()
            due = [p for p in view if now - failed.get(p, -every_s) >= every_s and
                   ((hit := self.cached(p)) is None or hit.age_s >= every_s)]
            return min(due, key=lambda p: (view[p].role != "contributor", self.cached(p) is not None), default=None)

        def publish(view: dict[str, NodeInfo]) -> None:
            links = {p: (round(x.rtt_ms, 3), round(x.up_mbps, 1), round(x.down_mbps, 1))
                     for p, x in self.all().items() if p in view}
            members.update(links=links)

        def loop() -> None:
            while not stop.is_set():
                view = members.view()
                for peer in list(failed):
                    if peer not in view:
                        del failed[peer]
                with self._lock:  # a member that left is forgotten once its figures are stale
                    for peer in [p for p, x in self._cache.items() if p not in view and x.age_s > self.max_age_s]:
                        del self._cache[peer]
                target = wanted(view)
                if target is None:  # every member measured: publish, and look again in a while
                    publish(view)
                    stop.wait(min(every_s / 4, 5.0))
                    continue

                def part_done(done: int, p: str = target) -> None:
                    report(p, done, PROBE_PARTS, None)

                try:
                    report(target, 0, PROBE_PARTS, None)
                    self.probe(target, bulk_bytes=bulk_bytes, refresh=True, on_part=part_done)
                except Exception as e:  # noqa: BLE001 - a peer that went away, serves no probes, or our node stopping
                    log.debug("probe of %s failed: %s", target, e)
                    failed[target] = time.monotonic()
                    report(target, 0, PROBE_PARTS, str(e) or type(e).__name__)
                    continue
                if view[target].role == "contributor":
                    publish(view)  # the planner prices contributors' links: not held back behind clients' probes

        thread = threading.Thread(target=loop, name="link-probes", daemon=True)
        thread.start()
        return thread

    def probe(self, peer: str, bulk_bytes: int = DEFAULT_BULK, pings: int = 7, refresh: bool = False,
              on_part: Callable[[int], None] = lambda done: None) -> LinkProbe:
        """RTT, then upload, then download (`on_part(n)` after each of the PROBE_PARTS parts)."""
        if not refresh and (hit := self.cached(peer)) is not None:
            return hit
        channel = self.node.open_channel(peer, ids.PROBE, limit=MAX_BULK + 1024)
        try:
            rtts = []
            for _ in range(pings):
                t = time.perf_counter()
                channel.send(encode(Ping()))
                _replies.decode(channel.recv(timeout=10))
                rtts.append((time.perf_counter() - t) * 1e3)
            rtt = statistics.median(rtts)
            on_part(1)
            t = time.perf_counter()
            channel.send(encode(Upload(bytes=bulk_bytes)))
            channel.send(bytes(bulk_bytes), timeout=120)
            _replies.decode(channel.recv(timeout=120))
            up_s = time.perf_counter() - t
            on_part(2)
            t = time.perf_counter()
            channel.send(encode(Download(bytes=bulk_bytes)))
            channel.recv(timeout=120)
            down_s = time.perf_counter() - t
            on_part(3)
        finally:
            channel.close()
        # The transfer time net of one round trip of handshaking.
        mbps = lambda s: bulk_bytes * 8 / max(s - rtt / 1e3, 1e-6) / 1e6  # noqa: E731
        result = LinkProbe(peer, rtt, mbps(up_s), mbps(down_s), time.monotonic())
        with self._lock:
            self._cache[peer] = result
        return result
