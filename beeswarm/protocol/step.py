"""Steps through the push chain (`ids.STEP`) and what returns to the entry (`ids.RESULT`)."""
from __future__ import annotations

from typing import Annotated

import msgspec

from beeswarm.protocol.coordinator import MAX_STAGES
from beeswarm.protocol.encoding import Message
from beeswarm.protocol.session import PeerId, SessionId
from beeswarm.protocol.spans import Span

MAX_KEEP = 4096
DIGEST_BYTES = 16
Digest = Annotated[bytes, msgspec.Meta(min_length=DIGEST_BYTES, max_length=DIGEST_BYTES)]
Signature = Annotated[bytes, msgspec.Meta(max_length=128)]


class Keep(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """The previous speculative round's accepted tree nodes, kept from `start` on (rides on the next step)."""

    start: Annotated[int, msgspec.Meta(ge=0)]
    indices: Annotated[tuple[Annotated[int, msgspec.Meta(ge=0)], ...], msgspec.Meta(max_length=MAX_KEEP)]


class Commit(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """Stage `stage`'s signed word on step `step` of a session: run on `span`, given the step's arguments
    (`context`: start, tree mask, keep), it received hidden states `input` and sent `output`. The signature
    also covers the entry and the session (see `commit_body`), so it cannot be replayed elsewhere."""

    stage: PeerId
    step: Annotated[int, msgspec.Meta(ge=0)]
    span: Span
    context: Digest
    input: Digest
    output: Digest
    sig: Signature


Commits = Annotated[tuple[Commit, ...], msgspec.Meta(max_length=MAX_STAGES)]


def commit_body(entry: str, session: str, c: Commit) -> bytes:
    """The bytes a commitment's signature covers."""
    return msgspec.msgpack.encode(("beeswarm/commit/1", entry, session, c.step, c.span.start, c.span.end,
                                   c.context, c.input, c.output))


class Step(Message, frozen=True, tag="step"):
    entry: PeerId
    session: SessionId
    step: Annotated[int, msgspec.Meta(ge=0)]
    start: Annotated[int, msgspec.Meta(ge=0)]
    frame: bytes  # the hidden states, a codec frame
    mask: bytes | None = None  # a tree mask, a uint8 codec frame (q, w): cached positions before start, then its own q
    keep: Keep | None = None
    commits: Commits = ()  # the stages before this one, in order (audits)
    # the session's earlier steps not computed yet are not wanted (speculation built on an outcome that did
    # not happen): a stage drops them, and this step's keep no longer names their positions
    cancel: bool = False


class Result(Message, frozen=True, tag="result"):
    session: SessionId
    step: int
    frame: bytes
    commits: Commits = ()  # every stage's, in route order (audits)


class StepError(Message, frozen=True, tag="step_error"):
    session: SessionId
    step: int
    error: Annotated[str, msgspec.Meta(max_length=1000)]
    culprit: PeerId  # the stage the error names (itself, or a next hop it could not reach)
