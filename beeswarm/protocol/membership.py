"""Membership heartbeats (`ids.MEMBERS_TOPIC`): each node's `NodeInfo`, and its leave."""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from beeswarm import __version__
from beeswarm.protocol.encoding import Message
from beeswarm.protocol.session import PeerId
from beeswarm.protocol.spans import Span

MAX_SPANS = 8
MAX_ADDRS = 16
MAX_LINKS = 512

Role = Literal["contributor", "client"]
State = Literal["joining", "idle", "loading", "serving", "paused", "leaving"]
Addr = Annotated[str, msgspec.Meta(max_length=300)]
Short = Annotated[str, msgspec.Meta(max_length=64)]
Link = tuple[float, float, float]  # (rtt ms, up Mbit/s, down Mbit/s) measured from the node to a peer


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    peer: PeerId
    addrs: Annotated[tuple[Addr, ...], msgspec.Meta(max_length=MAX_ADDRS)] = ()
    role: Role = "contributor"
    device: Short = "cpu"
    memory_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    # device benchmark figures for the planner (layer_ms_base, layer_ms_per_token, host_mem_bytes, offload_gbps)
    bench: Annotated[dict[Short, float | None], msgspec.Meta(max_length=16)] = {}
    layers: Span | None = None  # the span served
    # every span served (two while migrating)
    spans: Annotated[tuple[Span, ...], msgspec.Meta(max_length=MAX_SPANS)] = ()
    load: float = 0.0  # tokens/s served
    sessions: Annotated[int, msgspec.Meta(ge=0)] = 0  # open sessions on its spans
    beat_s: Annotated[float, msgspec.Meta(ge=0, le=600)] = 0.0  # the author's heartbeat period (0: unknown)
    state: State = "joining"
    version: Short = __version__
    links: Annotated[dict[PeerId, Link], msgspec.Meta(max_length=MAX_LINKS)] = {}


class Heartbeat(Message, frozen=True, tag="heartbeat"):
    info: NodeInfo


class Leave(Message, frozen=True, tag="leave"):
    pass
