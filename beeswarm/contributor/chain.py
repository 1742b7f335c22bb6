"""A stage's part in the commitment chain: it checks its predecessor's commitment before it computes a step,
signs its own, keeps the step (`StepLog`), and reveals what it kept to whoever may see it.

What it reveals (`ids.AUDIT`): a session's steps as it ran them (inputs and outputs), or its layer boundaries
(`Boundaries`: it replays the session through its span, signs a digest per boundary and keeps the replay a while)
and then the hidden states at the two boundaries of a piece of its span (`Reveal.piece`). Only the session's
entry may ask, an auditor it commissioned (for the piece the commission names), or the coordinator judging
evidence: the activations are its user's text.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from libp2p.crypto.keys import KeyPair

from beeswarm.audit import commitments, layers, replay
from beeswarm.audit.evidence import reveal
from beeswarm.audit.peer import commissioned
from beeswarm.audit.retention import LoggedStep, StepLog
from beeswarm.protocol import ErrorReply, Message, ProtocolError, Span
from beeswarm.protocol.audit import Reveal
from beeswarm.protocol.step import Commit, Step
from beeswarm.shard.errors import SessionError, ShardError
from beeswarm.shard.span import SpanRuntime

log = logging.getLogger(__name__)

TRACE_KEEP_S = 300.0  # a session's replay is kept this long after its boundaries were signed, for its pieces
TRACE_BYTES = 1 << 30  # replays kept at most (the oldest go first)


class PreviousLied(ProtocolError):
    """The previous stage's commitment is missing, forged, or not what it sent."""


@dataclass
class _Trace:
    span: Span
    steps: list[LoggedStep]
    after: list[list[torch.Tensor]]  # per step, the hidden states at each boundary inside the span
    nbytes: int
    at: float


class CommitmentChain:
    def __init__(self, key_pair: KeyPair, me: str, step_log: StepLog, runtime_for: Callable[[Span], SpanRuntime],
                 coordinator: Callable[[], str | None] = lambda: None, clock: Callable[[], float] = time.monotonic):
        """`runtime_for(span)`: the layers it serves `span` with, to replay a session on (ShardError: none);
        `coordinator()`: the peer that may ask for reveals of other entries' sessions (judging a refusal)."""
        self.key_pair, self.me, self.step_log, self.runtime_for = key_pair, me, step_log, runtime_for
        self.coordinator, self.clock = coordinator, clock
        self.reveals = 0
        self._traces: OrderedDict[tuple[str, str, int], _Trace] = OrderedDict()
        self._tracing = threading.Lock()  # one replay at a time (each a pass through the whole session)

    def check_previous(self, entry: str, session: str, prev: str, msg: Step, context: bytes, given: bytes) -> None:
        """The previous stage's commitment must be the last one carried, signed, and name what arrived (`context`,
        `given`: digests of the step's arguments and hidden states): an honest stage never computes on (or signs)
        a step its predecessor did not commit to."""
        commits = msg.commits
        if prev == entry:
            if commits:
                raise ProtocolError("the entry's step carries commitments")
            return
        last = commits[-1] if commits else None
        if last is None or last.stage != prev or last.step != msg.step or \
                not commitments.verify(last, entry, session):
            raise PreviousLied("the previous stage's commitment is missing or does not verify")
        if last.output != given or last.context != context:
            raise PreviousLied("what arrived is not what the previous stage committed to")

    def commit(self, entry: str, session: str, key: str, span: Span, msg: Step, context: bytes, given: bytes,
               hidden: torch.Tensor, out: torch.Tensor) -> Commit:
        """Sign this step's commitment and keep the step for a reveal (`hidden`, `out` on the host)."""
        signed = commitments.sign(self.key_pair, entry, session, Commit(
            stage=self.me, step=msg.step, span=span, context=context, input=given,
            output=commitments.digest(out), sig=b""))
        self.step_log.record(key, LoggedStep(msg.step, msg.start, msg.mask, msg.keep, hidden, out,
                                             (signed.context, signed.input, signed.output)), span)
        return signed

    def on_reveal(self, peer: str, msg: Reveal) -> Message:
        """A session's steps up to one (or its boundaries, or a piece's), for whoever may see them."""
        entry = msg.entry or peer
        if msg.commission is not None:
            c = msg.commission
            if not commissioned(c, peer, self.me, msg.session, msg.step) or c.piece != msg.piece:
                return ErrorReply(error="the commission does not name this auditor, this stage, this step and these "
                                        "layers, signed by the session's entry")
            entry = c.entry
        elif entry != peer and peer != self.coordinator():
            return ErrorReply(error="only a session's entry, an auditor it commissioned, or the coordinator may "
                                    "ask for its reveal")
        key = f"{entry}/{msg.session}"
        steps = self.step_log.upto(key, msg.step)
        span = self.step_log.span_of(key)
        if steps is None or span is None:
            return ErrorReply(error=f"step {msg.step} of session {msg.session!r} is not kept here")
        self.reveals += 1
        if not msg.boundaries and msg.piece is None:
            return reveal(self.key_pair, self.me, entry, msg.session, steps)
        try:
            traced = self._trace(entry, msg.session, msg.step, span, steps)
        except (ShardError, SessionError, MemoryError, RuntimeError) as e:
            return ErrorReply(error=f"cannot replay layers {span} here now: {e}", busy=True)
        if msg.boundaries:
            return layers.sign_boundaries(self.key_pair, self.me, entry, msg.session, span, steps, traced.after)
        assert msg.piece is not None
        if not (span.start <= msg.piece.start and msg.piece.end <= span.end):
            return ErrorReply(error=f"layers {msg.piece} are not within {span}, the span it served")
        return layers.reveal_piece(self.key_pair, self.me, entry, msg.session, span, msg.piece, steps, traced.after)

    def _trace(self, entry: str, session: str, step: int, span: Span, steps: list[LoggedStep]) -> _Trace:
        """The session's replay up to `step` with every layer's hidden states: kept from the boundaries' signing
        for the pieces asked after (replayed again if it was dropped: a replay on the same layers repeats itself)."""
        key = (entry, session, step)
        with self._tracing:
            self._forget_old()
            found = self._traces.get(key)
            if found is not None:
                self._traces.move_to_end(key)
                return found
            with torch.inference_mode():  # (the last layer's output is not kept: its boundary is the committed one)
                after = [per_step[:-1] for per_step in replay.trace(self.runtime_for(span), steps)]
            nbytes = sum(t.nbytes for per_step in after for t in per_step)
            found = self._traces[key] = _Trace(span, steps, after, nbytes, self.clock())
            while len(self._traces) > 1 and sum(t.nbytes for t in self._traces.values()) > TRACE_BYTES:
                self._traces.popitem(last=False)
            log.debug("replayed %d steps of %s through %s for its boundaries", len(steps), session, span)
            return found

    def _forget_old(self) -> None:
        now = self.clock()
        while self._traces and now - next(iter(self._traces.values())).at > TRACE_KEEP_S:
            self._traces.popitem(last=False)
