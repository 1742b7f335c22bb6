"""Private-swarm challenge (`ids.AUTH`): a nonce, answered with the responder's nonce and an HMAC."""
from __future__ import annotations

from typing import Annotated

import msgspec

from beeswarm.protocol.encoding import Message

Nonce = Annotated[bytes, msgspec.Meta(max_length=64)]


class Challenge(Message, frozen=True, tag="challenge"):
    nonce: Nonce


class Proof(Message, frozen=True, tag="proof"):
    nonce: Nonce
    mac: Nonce
