"""Audits: commitments on the data path, reveals (`ids.AUDIT`) and evidence (`ids.EVIDENCE`).

For every step a stage signs a `Commit` to what it received and what it sent (digests) and passes it
on with its output; the entry gets every stage's commitment with the result. Later, at random, the
entry asks a stage to `Reveal` a session's inputs and outputs up to a step, checks them against the
commitments and recomputes them. A stage caught is reported to the coordinator as `Evidence` that
anyone can check: the stage's own signatures over what it computed, and the revealed tensors.

Audits by layer: a span nobody else can hold is checked in pieces. The stage replays its session and signs
`Boundaries`: per step the digests it committed to (its input, its output), and per layer boundary inside its
span one digest over every step's hidden states there. Then, and only then, pieces are drawn; a checker of
piece [a, b) has the stage reveal the hidden states at boundaries a and b (`Reveal.piece`), checks them
against the signed digests, and recomputes layers [a, b) alone.
"""
from __future__ import annotations

import hashlib
from typing import Annotated, Literal

import msgspec

from beeswarm.protocol.encoding import Message
from beeswarm.protocol.session import PeerId, SessionId
from beeswarm.protocol.spans import Span
from beeswarm.protocol.step import DIGEST_BYTES, Commit, Digest, Keep, Signature

MAX_REVEAL_STEPS = 8192
MAX_LAYERS = 1024


def _span(span: Span | None) -> tuple[int, int] | None:
    return None if span is None else (span.start, span.end)


class Commission(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """An entry's signed word that `auditor` may have `stage` reveal the entry's `session` up to `step`, its
    layers `piece` only when set (`commission_body`): a peer auditor shows it to the stage, which reveals to
    nobody else."""

    entry: PeerId
    auditor: PeerId
    stage: PeerId
    session: SessionId
    step: Annotated[int, msgspec.Meta(ge=0)]
    sig: Signature = b""
    piece: Span | None = None


def commission_body(c: Commission) -> bytes:
    return msgspec.msgpack.encode(("beeswarm/commission/2", c.entry, c.auditor, c.stage, c.session, c.step,
                                   _span(c.piece)))


class Reveal(Message, frozen=True, tag="reveal"):
    """Ask a stage for a session's inputs up to and including `step`, with that step's output. Only the
    session's entry may ask (the activations are its user's text), an auditor it commissioned, or the
    coordinator judging evidence that the stage refused (`entry` names whose session).

    `boundaries`: ask for the stage's signed `Boundaries` of the session instead; `piece`: the hidden states at
    the boundaries of layers `piece` (within the stage's span) instead of its input and output, as its
    `Boundaries` signed them (asked for first)."""

    session: SessionId
    step: Annotated[int, msgspec.Meta(ge=0)]
    entry: PeerId | None = None
    commission: Commission | None = None
    boundaries: bool = False
    piece: Span | None = None


class BoundaryStep(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One step as a stage ran it, by digests: those of its commitment (arguments, input, output)."""

    step: Annotated[int, msgspec.Meta(ge=0)]
    held: Annotated[int, msgspec.Meta(ge=0)]
    context: Digest
    input: Digest
    output: Digest


class Boundaries(Message, frozen=True, tag="boundaries"):
    """A stage's signed word on its layers' work in a session up to `step` (`boundaries_body`): every step's
    digests as it committed to them, and for each boundary inside its span (after layer span.start, ...,
    before layer span.end - 1) the `boundary_digest` of every step's hidden states there, from its replay of the
    session. Its first boundary is its committed input and its last its committed output, so a lie anywhere in
    the span makes at least one layer's piece recompute wrong."""

    stage: PeerId
    session: SessionId
    span: Span
    steps: Annotated[tuple[BoundaryStep, ...], msgspec.Meta(max_length=MAX_REVEAL_STEPS)]
    inner: Annotated[tuple[Digest, ...], msgspec.Meta(max_length=MAX_LAYERS)]
    sig: Signature = b""

    def at(self, layer: int) -> Digest | None:
        """The digest of boundary `layer` inside the span (None at its ends: those are per step)."""
        return self.inner[layer - self.span.start - 1] if self.span.start < layer < self.span.end else None


def boundary_digest(steps: list[tuple[int, bytes]]) -> bytes:
    """One digest over (step, digest of its hidden states) for every step of a session at one boundary."""
    return hashlib.blake2b(msgspec.msgpack.encode(steps), digest_size=DIGEST_BYTES).digest()


def boundaries_body(entry: str, b: Boundaries) -> bytes:
    return msgspec.msgpack.encode(("beeswarm/boundaries/1", entry, b.stage, b.session, b.span.start, b.span.end,
                                   msgspec.msgpack.encode(b.steps), b.inner))


class RevealedStep(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """One step as the stage ran it: its arguments, the hidden states it received and those it sent."""

    step: Annotated[int, msgspec.Meta(ge=0)]
    start: Annotated[int, msgspec.Meta(ge=0)]
    mask: bytes | None
    keep: Keep | None
    input: bytes  # a codec frame
    output: bytes  # a codec frame
    held: Annotated[int, msgspec.Meta(ge=0)] = 0  # > 0: cancelled, not computed: keep applied, positions held


class Revealed(Message, frozen=True, tag="revealed"):
    """Every step of the session up to the one asked for, in the order the stage ran them, signed
    (`reveal_body`): a reveal that contradicts the stage's commitments is evidence on its own. With `piece`, each
    step's `input` and `output` are the hidden states at that piece's first and last boundary."""

    stage: PeerId
    session: SessionId
    steps: Annotated[tuple[RevealedStep, ...], msgspec.Meta(max_length=MAX_REVEAL_STEPS)]
    sig: Signature = b""
    piece: Span | None = None


def reveal_body(entry: str, r: Revealed, digests: list[tuple[bytes, bytes, bytes]]) -> bytes:
    """The bytes a reveal's signature covers: the session, the piece and, per step, its id and the digests of its
    context, input and output, and the positions held by a step not computed (the tensors themselves are bound by
    their digests)."""
    return msgspec.msgpack.encode(("beeswarm/reveal/3", entry, r.stage, r.session, _span(r.piece),
                                   [(s.step, s.held, *d) for s, d in zip(r.steps, digests, strict=True)]))


class AuditAsk(Message, frozen=True, tag="audit-ask"):
    """An entry asks a peer auditor (`ids.PEER_AUDIT`) to audit `commission.stage`'s work on its session up to
    `commission.step`: the stage's commitments it holds for the session (all of them up to that step), and
    the steps it sent without waiting for their results (`unobserved`). For a piece (`commission.piece`), the
    stage's signed `boundaries` too."""

    commission: Commission
    commits: Annotated[tuple[Commit, ...], msgspec.Meta(max_length=MAX_REVEAL_STEPS)]
    unobserved: Annotated[tuple[int, ...], msgspec.Meta(max_length=MAX_REVEAL_STEPS)] = ()
    boundaries: Boundaries | None = None


class AuditVerdict(msgspec.Struct, frozen=True, array_like=True, forbid_unknown_fields=True):
    """A peer auditor's signed result (`verdict_body`): `stage`'s commitments `commits` (their digest) for the
    entry's `session` up to `step` recompute as committed (`passed`), or not (then evidence comes with it). A
    pass of commitments that recompute wrong is evidence against the auditor (`false_pass`)."""

    auditor: PeerId
    entry: PeerId
    stage: PeerId
    session: SessionId
    step: Annotated[int, msgspec.Meta(ge=0)]
    passed: bool
    commits: Annotated[bytes, msgspec.Meta(max_length=64)]  # commits_digest of what it checked
    detail: Annotated[str, msgspec.Meta(max_length=500)] = ""
    sig: Signature = b""
    piece: Span | None = None  # the layers it checked (None: the stage's whole span)
    # passed: the largest relative error per token it found, as a share of the span's tolerance (`Examined.share`)
    share: Annotated[float, msgspec.Meta(ge=0)] = 0.0


def commits_digest(commits: tuple[Commit, ...]) -> bytes:
    return hashlib.blake2b(msgspec.msgpack.encode(commits), digest_size=16).digest()


def verdict_body(v: AuditVerdict) -> bytes:
    return msgspec.msgpack.encode(("beeswarm/verdict/2", v.auditor, v.entry, v.stage, v.session, v.step, v.passed,
                                   v.commits, v.detail, _span(v.piece), v.share))


EvidenceKind = Literal["wrong", "contradiction", "chain", "refused", "false_pass"]


class Evidence(Message, frozen=True, tag="evidence"):
    """An entry's accusation, checkable by anyone from the signatures inside it.

    - wrong: `revealed` hashes to the accused's `commits`, yet recomputing its inputs through `span` gives
      other outputs (the checker recomputes). With `piece`: `revealed` is that piece's, it hashes to the
      accused's signed `boundaries`, whose ends are its `commits`, and recomputing layers `piece` alone from its
      first boundary gives other hidden states than its last (the checker loads those layers only).
    - contradiction: `revealed` (signed by the accused) does not hash to its own `commits` (or, with `piece`,
      to its own `boundaries`; or those do not end in its commitments).
    - chain: `commits` holds the accused's commitment and the previous stage's for the same step, and the
      accused's input or context is not what the previous stage signed that it sent (an honest stage
      checks the previous commitment before it computes).
    - refused: the accused did not reveal what `commits` commit to; the checker asks it itself and
      judges what it gets (a stage that refuses the coordinator too is excluded; one that answers is
      judged on its answer, and the accuser, who may just have lost its link, is not blamed).
    - false_pass: the accused is a peer auditor whose signed `verdict` passed `commits`, and `revealed` (the
      stage's, matching them) recomputes wrong.
    The accuser signs the whole (`sig` over the encoded evidence with `sig` empty): an accusation that does
    not hold up is evidence against its author. The accuser is the session's entry, or a peer auditor it
    commissioned (then `entry` names the entry, whose session the commitments are signed for).
    """

    kind: EvidenceKind
    accused: PeerId
    accuser: PeerId
    session: SessionId
    span: Span
    commits: Annotated[tuple[Commit, ...], msgspec.Meta(max_length=MAX_REVEAL_STEPS)]
    revealed: Revealed | None = None
    detail: Annotated[str, msgspec.Meta(max_length=500)] = ""
    entry: PeerId | None = None
    verdict: AuditVerdict | None = None
    sig: Signature = b""
    piece: Span | None = None  # the layers (within `span`) the accusation is about; None: the whole span
    boundaries: Boundaries | None = None  # with `piece`: the accused's signed boundaries

    @property
    def session_entry(self) -> str:
        """Whose session the commitments and reveal are signed for."""
        return self.entry or self.accuser


class Audited(Message, frozen=True, tag="audited"):
    """A peer auditor's answer to `AuditAsk`: its signed verdict, and when the stage failed (or refused it)
    the evidence, signed by the auditor."""

    verdict: AuditVerdict
    evidence: Evidence | None = None


class Verdict(Message, frozen=True, tag="verdict"):
    """The coordinator's answer: who it excludes (the accused, the accuser of a false accusation, or
    nobody: "")."""

    excluded: PeerId
    reason: Annotated[str, msgspec.Meta(max_length=500)]


class Passed(Message, frozen=True, tag="passed"):
    """An entry's word that `commit.stage` passed its audit of `session` (`ids.PASSED`): the stage's own
    signed commitment to the session's last step audited shows it served that entry's session. `layers`: the
    layers of its span that were checked (empty: all of them), `steps`: the steps each was checked on."""

    session: SessionId
    commit: Commit
    layers: Annotated[tuple[Span, ...], msgspec.Meta(max_length=MAX_LAYERS)] = ()
    steps: Annotated[int, msgspec.Meta(ge=0)] = 0


class Credited(Message, frozen=True, tag="credited"):
    """The coordinator's answer to `Passed`: the audits the stage has now passed, as the swarm counts them."""

    passed: Annotated[int, msgspec.Meta(ge=0)]
