"""Steps through the push chain (`ids.STEP`) and what returns to the entry (`ids.RESULT`)."""
from __future__ import annotations

from typing import Annotated

import msgspec

from beeswarm.protocol.encoding import Message
from beeswarm.protocol.session import PeerId, SessionId

MAX_KEEP = 4096


class Keep(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """The previous speculative round's accepted tree nodes, kept from `start` on (rides on the next step)."""

    start: Annotated[int, msgspec.Meta(ge=0)]
    indices: Annotated[tuple[Annotated[int, msgspec.Meta(ge=0)], ...], msgspec.Meta(max_length=MAX_KEEP)]


class Step(Message, frozen=True, tag="step"):
    entry: PeerId
    session: SessionId
    step: int
    start: Annotated[int, msgspec.Meta(ge=0)]
    frame: bytes  # the hidden states, a codec frame
    mask: bytes | None = None  # a tree mask, a uint8 codec frame (q, q)
    keep: Keep | None = None


class Result(Message, frozen=True, tag="result"):
    session: SessionId
    step: int
    frame: bytes


class StepError(Message, frozen=True, tag="step_error"):
    session: SessionId
    step: int
    error: Annotated[str, msgspec.Meta(max_length=1000)]
    culprit: PeerId  # the stage the error names (itself, or a next hop it could not reach)
