"""Sessions on a stage (`ids.SESSION`, request/response): open allocates KV, close frees it."""
from __future__ import annotations

from typing import Annotated

import msgspec

from beeswarm.protocol.encoding import Message
from beeswarm.protocol.spans import Span

PeerId = Annotated[str, msgspec.Meta(max_length=128)]
SessionId = Annotated[str, msgspec.Meta(max_length=64)]


class Open(Message, frozen=True, tag="open"):
    session: SessionId
    max_length: Annotated[int, msgspec.Meta(ge=1)]
    prev: PeerId  # the only peer whose steps are accepted
    span: Span  # the layers the entry routed this session to
    next: PeerId | None = None  # None: results go back to the entry
    compress: bool = True  # False: raw frames (for comparisons)
    # whose credit the session spends (None: the entry's own), and its signature of `open_body`: a full stage
    # admits entries whose payer holds credit first (`contributor.admission`)
    payer: PeerId | None = None
    payer_sig: Annotated[bytes, msgspec.Meta(max_length=128)] = b""


def open_body(entry: str, session: str) -> bytes:
    """The bytes a payer signs to vouch for a session of `entry`."""
    return msgspec.msgpack.encode(("beeswarm/open/1", entry, session))


class Opened(Message, frozen=True, tag="opened"):
    span: Span


class Close(Message, frozen=True, tag="close"):
    session: SessionId


class Closed(Message, frozen=True, tag="closed"):
    pass
