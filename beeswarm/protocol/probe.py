"""Link probes (`ids.PROBE`, a channel): pings, then bulk upload and download."""
from __future__ import annotations

from typing import Annotated

import msgspec

from beeswarm.protocol.encoding import Message

MAX_BULK = 64 * 1024 * 1024
Bulk = Annotated[int, msgspec.Meta(ge=0, le=MAX_BULK)]


class Ping(Message, frozen=True, tag="ping"):
    pass


class Pong(Message, frozen=True, tag="pong"):
    pass


class Upload(Message, frozen=True, tag="upload"):
    bytes: Bulk  # a payload frame of this size follows


class Uploaded(Message, frozen=True, tag="uploaded"):
    pass


class Download(Message, frozen=True, tag="download"):
    bytes: Bulk
