"""Dial-backs (`ids.DIALBACK`, request/response): whether peers can dial a node, and its address as they see it."""
from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from beeswarm.protocol.encoding import Message

Reach = Literal["public", "private", "unknown"]  # whether other hosts can open a connection to a node
MAX_PORTS = 4
Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]


class DialBack(Message, frozen=True, tag="dial_back"):
    """Open a fresh connection to each of these TCP ports at the address this request came from."""
    ports: Annotated[tuple[Port, ...], msgspec.Meta(max_length=MAX_PORTS)]


class DialedBack(Message, frozen=True, tag="dialed_back"):
    observed_ip: Annotated[str, msgspec.Meta(max_length=45)]  # where the request came from ("": over a relay)
    dialable: Annotated[tuple[Port, ...], msgspec.Meta(max_length=MAX_PORTS)]  # the ports a libp2p node answered on
