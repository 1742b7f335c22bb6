"""A stage's link codecs: one per peer its sessions link to, and the bytes they moved.

What a link's codec learnt (its adaptive layout and rates) outlives a session (an entry opens one per generation),
so codecs are kept per peer, the most recently used last; beyond KEPT_CODECS, a peer no session links to loses its
codec, and its byte counts stay in the totals.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass

from beeswarm import codec

KEPT_CODECS = 64  # link codecs kept for peers no session uses now


@dataclass(frozen=True)
class LinkBytes:
    raw_in: int = 0  # hidden-state bytes received, decoded
    wire_in: int = 0  # ... as they crossed the wire
    raw_out: int = 0
    wire_out: int = 0

    def __add__(self, other: LinkBytes) -> LinkBytes:
        return LinkBytes(self.raw_in + other.raw_in, self.wire_in + other.wire_in, self.raw_out + other.raw_out,
                         self.wire_out + other.wire_out)


def _counted(link: codec.LinkCodec) -> LinkBytes:
    return LinkBytes(link.raw_in, link.wire_in, link.raw_bytes, link.wire_bytes)


class LinkCodecs:
    def __init__(self, link_bytes_per_s: float | None = None, link_rate: Callable[[str], float | None] | None = None):
        """`link_bytes_per_s`: a link's rate until measured; `link_rate(peer)`: the measured bytes/s towards a
        peer (link probes), for the codec's choice."""
        self.link_bytes_per_s, self.link_rate = link_bytes_per_s, link_rate
        self._lock = threading.Lock()
        self._codecs: OrderedDict[str, codec.LinkCodec] = OrderedDict()
        self._retired = LinkBytes()  # counted by codecs freed since

    def __call__(self, peer: str) -> codec.LinkCodec:
        """The codec of the link to `peer` (made on first use)."""
        with self._lock:
            link = self._codecs.setdefault(peer, codec.LinkCodec(self.link_bytes_per_s))
            self._codecs.move_to_end(peer)
        rate = self.link_rate(peer) if self.link_rate else None
        if rate:
            link.link_bytes_per_s = rate
        return link

    def keep(self, linked: Collection[str]) -> None:
        """Free the codecs beyond KEPT_CODECS of peers not in `linked`, the least recently used first."""
        with self._lock:
            spare = [p for p in self._codecs if p not in linked]
            for peer in spare[:max(0, len(self._codecs) - KEPT_CODECS)]:
                self._retired += _counted(self._codecs.pop(peer))

    def totals(self) -> LinkBytes:
        with self._lock:
            links, total = list(self._codecs.values()), self._retired
        for link in links:
            total += _counted(link)
        return total
