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


class CacheState(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """A session's KV cache on a stage as the entry assumes it when a step arrives, before the step's keep: the
    positions it holds and the keeps applied to it so far. A stage whose cache is in any other state refuses the
    step (`StepError.stale`) and the entry starts the session again: a step never runs on a cache the entry did
    not assume, whatever was lost, dropped or reordered on the way."""

    length: Annotated[int, msgspec.Meta(ge=0)]
    keeps: Annotated[int, msgspec.Meta(ge=0)]

    def after(self, start: int, positions: int, keep: Keep | None) -> CacheState:
        """The state once a step of `positions` at `start` (and its keep) has run, or been held."""
        return CacheState(start + positions, self.keeps + (keep is not None))


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
    frame: bytes  # the hidden states, a codec frame (empty when `held`)
    expect: CacheState  # the session's cache as the entry assumes it when this step arrives
    mask: bytes | None = None  # a tree mask, a uint8 codec frame (q, w): cached positions before start, then its own q
    keep: Keep | None = None
    commits: Commits = ()  # the stages before this one, in order (audits)
    # the session's earlier steps not computed yet are not wanted (speculation built on an outcome that did
    # not happen): a stage computes none of them, but applies their keeps and holds their positions (`held`)
    cancel: bool = False
    # > 0: a cancelled step passed on by the stage that dropped it, for the stages after it: no hidden states;
    # each applies its keep and holds its `held` positions (their KV never read: the cancelling step's keep
    # drops them), computes nothing and passes it on, so every stage's cache stays in the state the entry assumes
    held: Annotated[int, msgspec.Meta(ge=0)] = 0


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
    stale: bool = False  # the step named a cache state the stage's is not in (`Step.expect`): start over, blame none
