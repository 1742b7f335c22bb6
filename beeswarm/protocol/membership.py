"""Membership: heartbeats carrying each node's `NodeInfo` and its leave (`ids.MEMBERS_TOPIC`), and beats
to the coordinator answered with the view (`ids.MEMBERS`, request/response)."""
from __future__ import annotations

from typing import Annotated, Literal, get_args

import msgspec

from beeswarm import __version__
from beeswarm.protocol.encoding import Message
from beeswarm.protocol.reach import Reach
from beeswarm.protocol.session import PeerId
from beeswarm.protocol.spans import Span

MAX_SPANS = 8
MAX_ADDRS = 16
MAX_LINKS = 512

Role = Literal["contributor", "client"]
State = Literal["joining", "idle", "loading", "serving", "paused", "leaving"]
Quant = Literal["none", "int8", "nf4"]  # weight formats (shard.quant): the checkpoint's, int8 weight-only, NF4
QUANT_FORMATS: tuple[str, ...] = get_args(Quant)
Addr = Annotated[str, msgspec.Meta(max_length=300)]
Short = Annotated[str, msgspec.Meta(max_length=64)]
Link = tuple[float, float, float]  # (rtt ms, up Mbit/s, down Mbit/s) measured from the node to a peer


class NodeInfo(msgspec.Struct, frozen=True, kw_only=True):
    peer: PeerId
    addrs: Annotated[tuple[Addr, ...], msgspec.Meta(max_length=MAX_ADDRS)] = ()
    role: Role = "contributor"
    device: Short = "cpu"
    quant: Short = "none"  # the Quant its weights are in (a str on the wire: a format added later is not an error)
    memory_bytes: Annotated[int, msgspec.Meta(ge=0)] = 0
    # device benchmark figures for the planner (layer_ms_base, layer_ms_per_token, host_mem_bytes, offload_gbps)
    bench: Annotated[dict[Short, float | None], msgspec.Meta(max_length=16)] = {}
    layers: Span | None = None  # the span served
    # every span served (two while migrating)
    spans: Annotated[tuple[Span, ...], msgspec.Meta(max_length=MAX_SPANS)] = ()
    load: float = 0.0  # tokens/s served
    busy: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0  # share of the last seconds its layers computed
    sessions: Annotated[int, msgspec.Meta(ge=0)] = 0  # open sessions on its spans
    beat_s: Annotated[float, msgspec.Meta(ge=0, le=600)] = 0.0  # the author's heartbeat period (0: unknown)
    state: State = "joining"
    reach: Reach = "unknown"  # whether other hosts can dial it (public), only through a relay (private)
    relay: bool = False  # it relays circuits for members others cannot dial (taken up where it is public)
    version: Short = __version__
    links: Annotated[dict[PeerId, Link], msgspec.Meta(max_length=MAX_LINKS)] = {}


class Heartbeat(Message, frozen=True, tag="heartbeat"):
    info: NodeInfo


class Leave(Message, frozen=True, tag="leave"):
    pass


MAX_MEMBERS = 4096


class Beat(Message, frozen=True, tag="beat"):
    """A member's heartbeat to the coordinator: its info when it changed (None: as last sent), and the
    sequence number of the last view it holds (0: none), so the answer carries only what changed since."""

    info: NodeInfo | None = None
    since: Annotated[int, msgspec.Meta(ge=0)] = 0


class View(Message, frozen=True, tag="view"):
    """The answer to a beat. From the coordinator (`coordinator` names the answering node): every live
    member with the seconds since it was last heard from, and the info of those that changed after
    `since`; `seq` numbers this view. From another member (a newcomer's bootstrap): whom it follows, in
    `term`, with its own info and that coordinator's, so the newcomer can dial it at once."""

    seq: Annotated[int, msgspec.Meta(ge=0)]
    live: Annotated[tuple[tuple[PeerId, Annotated[float, msgspec.Meta(ge=0)]], ...],
                    msgspec.Meta(max_length=MAX_MEMBERS)] = ()
    changed: Annotated[tuple[NodeInfo, ...], msgspec.Meta(max_length=MAX_MEMBERS)] = ()
    coordinator: PeerId | None = None
    term: Annotated[int, msgspec.Meta(ge=0)] = 0
