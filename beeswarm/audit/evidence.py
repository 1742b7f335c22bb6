"""Examine a reveal against commitments, and judge an accusation as anyone can: from signatures and a
recomputation, trusting neither the accuser nor the accused.

The entry runs `examine` on its own audits; the coordinator runs `judge` on the evidence it is sent.
A reveal that cannot be checked (undecodable, unsigned) proves nothing against its author; the entry
treats it as a refusal, and nobody else hears of it.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import msgspec
from libp2p.crypto.keys import KeyPair

from beeswarm import codec
from beeswarm.audit import commitments, layers
from beeswarm.audit.replay import compare, tolerance
from beeswarm.audit.retention import LoggedStep
from beeswarm.p2p.signatures import sign_bytes, verify_bytes
from beeswarm.protocol import ProtocolError, Span, encode
from beeswarm.protocol.audit import (
    AuditVerdict,
    Boundaries,
    Evidence,
    EvidenceKind,
    Revealed,
    RevealedStep,
    commits_digest,
    reveal_body,
    verdict_body,
)
from beeswarm.protocol.step import Commit
from beeswarm.shard import tensors
from beeswarm.shard.errors import SessionError, ShardError
from beeswarm.shard.span import SpanRuntime

RuntimeFor = Callable[[Span], SpanRuntime]  # a span's layers, to recompute with
# (stage, entry, session, step, piece) -> the stage's reveal of the entry's session (of layers `piece` only, from
# the boundaries it signed, when set), asked by the checker itself
AskReveal = Callable[[str, str, str, int, Span | None], Revealed]


class RevealRefused(Exception):
    """The stage did not reveal, or revealed something that cannot be checked."""


class CannotRecompute(Exception):
    """The checker cannot load or hold the span (not the stage's fault)."""


@dataclass(frozen=True)
class Finding:
    kind: EvidenceKind
    detail: str


@dataclass(frozen=True)
class Examined:
    """What `examine` found wrong (None: nothing), and the largest error per token of the outputs it recomputed as a
    share of the span's tolerance (the pieces of one audit must fit the span's budget: their shares add up to 1
    at most)."""

    finding: Finding | None
    share: float = 0.0


def _digests(steps: Sequence[LoggedStep]) -> list[tuple[bytes, bytes, bytes]]:
    """Each step's (context, input, output) digests: those the stage kept from its commitment, or hashed here."""
    return [s.digests or (commitments.context(s.start, s.mask, s.keep), commitments.digest(s.input),
                          commitments.digest(s.output)) for s in steps]


def reveal(key_pair: KeyPair, stage: str, entry: str, session: str, steps: Sequence[LoggedStep]) -> Revealed:
    """A stage's signed reveal of `steps` (frames in the stateless codec, compressed where it pays)."""
    unsigned = Revealed(stage=stage, session=session, steps=tuple(
        RevealedStep(s.step, s.start, s.mask, s.keep, tensors.encode(s.input), tensors.encode(s.output), s.held)
        for s in steps))
    return msgspec.structs.replace(unsigned, sig=sign_bytes(
        key_pair, reveal_body(entry, unsigned, _digests(steps))))


def read_reveal(revealed: Revealed, entry: str, max_bytes: int) -> list[LoggedStep]:
    """The revealed steps as tensors, once their signature checks; RevealRefused otherwise."""
    try:
        steps = [LoggedStep(s.step, s.start, s.mask, s.keep, tensors.decode(s.input, max_bytes=max_bytes),
                            tensors.decode(s.output, max_bytes=max_bytes), held=s.held) for s in revealed.steps]
    except (codec.CodecError, ProtocolError, ValueError, RuntimeError) as e:
        raise RevealRefused(f"undecodable reveal: {e}") from None
    if not verify_bytes(revealed.stage, reveal_body(entry, revealed, _digests(steps)), revealed.sig):
        raise RevealRefused("the reveal's signature does not verify")
    return steps


def layers_for(runtime_for: RuntimeFor, piece: Span) -> SpanRuntime:
    """`runtime_for(piece)`, CannotRecompute where these are not layers of this model or there is no room for them
    here."""
    try:
        return runtime_for(piece)
    except (ShardError, OSError, ValueError, MemoryError) as e:
        raise CannotRecompute(f"cannot recompute layers {piece}: {e}") from None


def examine(entry: str, commits: Sequence[Commit], revealed: Revealed, runtime_for: RuntimeFor,
            max_bytes: int = codec.DEFAULT_MAX_BYTES, complete: bool = False,
            unobserved: Collection[int] = (), boundaries: Boundaries | None = None) -> Examined:
    """What is wrong with a stage's reveal, given its (verified) commitments for the session.

    `complete`: `commits` are all the stage's commitments for the session up to the last revealed step
    (the entry holds them all), so a revealed step without one was made up, unless it is one of the
    `unobserved` steps the entry sent and did not wait for (pipelined speculation's cancelled steps). A
    third party cannot know that (the accuser chooses what it hands over), so it only checks the steps it
    has commitments for.

    `boundaries`: the stage's signed boundaries, when `revealed` is a piece of its span (`audit.layers`): the
    boundaries must end in the commitments, the piece hash to the boundaries, and recompute through the piece's
    layers alone.
    """
    if not commits:
        raise ValueError("nothing to examine: no commitments")
    if len({c.span for c in commits}) != 1:
        raise ValueError("commitments of more than one span")
    span = commits[0].span
    steps = read_reveal(revealed, entry, max_bytes)
    if not steps or steps[-1].step != max(c.step for c in commits):
        raise RevealRefused("the reveal does not end at the step asked for")
    piece = revealed.piece or span
    if boundaries is None:
        if revealed.piece is not None:
            raise RevealRefused("a piece was revealed where the whole span was asked for")
        wrong = layers.contradiction(commits, list(zip((s.step for s in steps), _digests(steps), strict=True)),
                                     complete, unobserved)
    else:
        if boundaries.stage != revealed.stage or boundaries.session != revealed.session or \
                boundaries.span != span or not layers.boundaries_signed(boundaries, entry):
            raise ProtocolError("the boundaries are not the stage's own, signed for this session and span")
        if revealed.piece is None:
            raise RevealRefused("the whole span was revealed where a piece was asked for")
        wrong = layers.contradiction(commits, layers.ends_of(boundaries), complete, unobserved) or \
            layers.piece_contradiction(boundaries, piece, steps)
    if wrong is not None:
        return Examined(Finding("contradiction", wrong))
    runtime = layers_for(runtime_for, piece)
    try:
        found = compare(runtime, steps, {c.step for c in commits}, layers.piece_tolerance(runtime.dtype, piece, span))
    except (SessionError, ProtocolError, codec.CodecError, RuntimeError) as e:  # inputs the span cannot run
        return Examined(Finding("wrong", f"its revealed inputs cannot be run through layers {piece}: {e}"))
    if found.mismatch is not None:
        return Examined(Finding("wrong", f"layers {piece}: {found.mismatch}" if piece != span else
                                str(found.mismatch)))
    return Examined(None, found.error / tolerance(runtime.dtype))


def sign_evidence(key_pair: KeyPair, evidence: Evidence) -> Evidence:
    return msgspec.structs.replace(evidence, sig=sign_bytes(
        key_pair, encode(msgspec.structs.replace(evidence, sig=b""))))


def evidence_signed(ev: Evidence) -> bool:
    return verify_bytes(ev.accuser, encode(msgspec.structs.replace(ev, sig=b"")), ev.sig)


def sign_verdict(key_pair: KeyPair, v: AuditVerdict) -> AuditVerdict:
    return msgspec.structs.replace(v, sig=sign_bytes(key_pair, verdict_body(v)))


def verdict_signed(v: AuditVerdict) -> bool:
    return verify_bytes(v.auditor, verdict_body(v), v.sig)


@dataclass(frozen=True)
class Judgement:
    excluded: str  # the accused, the accuser of a false accusation, or "" (nobody)
    reason: str
    upheld: bool


def judge(ev: Evidence, runtime_for: RuntimeFor, max_bytes: int = codec.DEFAULT_MAX_BYTES,
          ask_reveal: AskReveal | None = None) -> Judgement:
    """Check an accusation from its signatures (and a recomputation for `wrong`; for `refused`, a reveal
    asked with `ask_reveal`). ProtocolError when the accuser did not sign it (then it is nobody's word)."""
    if not evidence_signed(ev):
        raise ProtocolError("the evidence is not signed by the accuser it names")
    entry = ev.session_entry

    def false(why: str) -> Judgement:
        return Judgement(ev.accuser, f"false accusation against {ev.accused}: {why}", False)

    def upheld(why: str) -> Judgement:
        return Judgement(ev.accused, f"audit ({ev.kind}): {why} (evidence from {ev.accuser})", True)

    if not ev.commits or any(not commitments.verify(c, entry, ev.session) for c in ev.commits):
        return false("a commitment in the evidence does not verify")
    if ev.kind == "false_pass":
        return _judge_pass(ev, runtime_for, max_bytes, false)
    if ev.kind == "chain":
        if len(ev.commits) != 2:
            return false("a chain accusation holds two commitments")
        prev, mine = ev.commits
        if mine.stage != ev.accused or prev.stage == ev.accused or prev.step != mine.step:
            return false("the commitments are not the accused's and its previous stage's for one step")
        if mine.input != prev.output or mine.context != prev.context:
            return upheld(f"step {mine.step}: it signed an input the previous stage did not send")
        return false("the chain is consistent")
    if ev.kind == "refused":
        return _judge_refusal(ev, runtime_for, max_bytes, ask_reveal, upheld)
    if ev.kind == "contradiction" and ev.revealed is None and ev.boundaries is not None:
        b = ev.boundaries  # boundaries that do not end in the stage's own commitments
        if (b.stage, b.session, b.span) != (ev.accused, ev.session, ev.span) or \
                not layers.boundaries_signed(b, entry) or any(c.stage != ev.accused for c in ev.commits):
            return false("the boundaries and commitments are not the accused's")
        wrong = layers.contradiction(ev.commits, layers.ends_of(b))
        return upheld(wrong) if wrong else false("its boundaries end in its commitments")
    if ev.revealed is None or ev.revealed.stage != ev.accused or ev.revealed.session != ev.session or \
            ev.revealed.piece != ev.piece or any(c.stage != ev.accused or c.span != ev.span for c in ev.commits):
        return false("the reveal and commitments are not the accused's")
    try:
        finding = examine(entry, ev.commits, ev.revealed, runtime_for, max_bytes, boundaries=_boundaries(ev)).finding
    except (RevealRefused, ProtocolError) as e:
        return false(str(e))
    except CannotRecompute as e:
        return _cannot_judge(ev, e)
    if finding is None:
        return false("its reveal matches its commitments and the recomputation")
    return upheld(finding.detail)


def _cannot_judge(ev: Evidence, e: CannotRecompute) -> Judgement:
    """Nobody's fault: nobody is excluded on evidence this judge could not recompute."""
    return Judgement("", f"the evidence against {ev.accused} could not be checked here: {e}", False)


def _boundaries(ev: Evidence) -> Boundaries | None:
    """The accused's boundaries an accusation about a piece of its span stands on (ProtocolError: it has none)."""
    if ev.piece is None:
        return None
    if ev.boundaries is None:
        raise ProtocolError("an accusation about a piece of a span holds the stage's signed boundaries")
    return ev.boundaries


def _judge_refusal(ev: Evidence, runtime_for: RuntimeFor, max_bytes: int, ask_reveal: AskReveal | None,
                   upheld: Callable[[str], Judgement]) -> Judgement:
    if any(c.stage != ev.accused or c.span != ev.span for c in ev.commits):
        return Judgement(ev.accuser, f"false accusation against {ev.accused}: the commitments are not its", False)
    if ask_reveal is None:
        raise ProtocolError("this checker cannot ask for reveals")
    step = max(c.step for c in ev.commits)
    try:
        boundaries = _boundaries(ev)
    except ProtocolError as e:
        return Judgement(ev.accuser, f"false accusation against {ev.accused}: {e}", False)
    checked = "it checks out"
    try:
        revealed = ask_reveal(ev.accused, ev.session_entry, ev.session, step, ev.piece)
        finding = examine(ev.session_entry, ev.commits, revealed, runtime_for, max_bytes,
                          boundaries=boundaries).finding
    except CannotRecompute as e:  # the charge is refusal: a reveal that matches its commitments answers it
        finding, checked = None, f"it matches its commitments (not recomputed: {e})"
    except Exception as e:  # noqa: BLE001 - no answer, a refusal, an unverifiable reveal: all a refusal
        return upheld(f"it refused a reveal of step {step} to its entry, and to the coordinator: {e}")
    if finding is not None:
        return upheld(finding.detail)
    return Judgement("", f"{ev.accused} revealed step {step} to the coordinator and {checked} "
                         f"({ev.accuser} may have lost its link)", False)


def _judge_pass(ev: Evidence, runtime_for: RuntimeFor, max_bytes: int,
                false: Callable[[str], Judgement]) -> Judgement:
    """A peer auditor (the accused) signed a pass of commitments whose reveal recomputes wrong."""
    v = ev.verdict
    if v is None or v.auditor != ev.accused or not verdict_signed(v) or \
            not v.passed or (v.entry, v.session) != (ev.session_entry, ev.session) or \
            v.commits != commits_digest(ev.commits) or v.piece != ev.piece:
        return false("the evidence holds no pass signed by the accused over these commitments")
    if ev.revealed is None or ev.revealed.stage != v.stage or ev.revealed.session != ev.session or \
            ev.revealed.piece != ev.piece or any(c.stage != v.stage or c.span != ev.span for c in ev.commits):
        return false("the reveal and commitments are not those of the stage it passed")
    try:
        finding = examine(ev.session_entry, ev.commits, ev.revealed, runtime_for, max_bytes,
                          boundaries=_boundaries(ev)).finding
    except (RevealRefused, ProtocolError) as e:
        return false(str(e))
    except CannotRecompute as e:
        return _cannot_judge(ev, e)
    if finding is None or finding.kind != "wrong":  # only a reveal that matches the commitments proves them wrong
        return false("the commitments it passed recompute as committed")
    return Judgement(ev.accused, f"audit (false_pass): it passed {v.stage}'s step {v.step}, which recomputes "
                                 f"wrong: {finding.detail} (evidence from {ev.accuser})", True)
