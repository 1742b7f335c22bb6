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
from beeswarm.audit import commitments
from beeswarm.audit.replay import first_mismatch
from beeswarm.audit.retention import LoggedStep
from beeswarm.p2p.signatures import sign_bytes, verify_bytes
from beeswarm.protocol import ProtocolError, Span, encode
from beeswarm.protocol.audit import (
    AuditVerdict,
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
# (stage, entry, session, step) -> the stage's reveal of the entry's session, asked by the checker itself
AskReveal = Callable[[str, str, str, int], Revealed]


class RevealRefused(Exception):
    """The stage did not reveal, or revealed something that cannot be checked."""


class CannotRecompute(Exception):
    """The checker cannot load or hold the span (not the stage's fault)."""


@dataclass(frozen=True)
class Finding:
    kind: EvidenceKind
    detail: str


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


def examine(entry: str, commits: Sequence[Commit], revealed: Revealed, runtime_for: RuntimeFor,
            max_bytes: int = codec.DEFAULT_MAX_BYTES, complete: bool = False,
            unobserved: Collection[int] = ()) -> Finding | None:
    """What is wrong with a stage's reveal, given its (verified) commitments for the session, or None.

    `complete`: `commits` are all the stage's commitments for the session up to the last revealed step
    (the entry holds them all), so a revealed step without one was made up, unless it is one of the
    `unobserved` steps the entry sent and did not wait for (pipelined speculation's cancelled steps). A
    third party cannot know that (the accuser chooses what it hands over), so it only checks the steps it
    has commitments for.
    """
    if not commits:
        raise ValueError("nothing to examine: no commitments")
    steps = read_reveal(revealed, entry, max_bytes)
    if not steps or steps[-1].step != max(c.step for c in commits):
        raise RevealRefused("the reveal does not end at the step asked for")
    by_step = {c.step: c for c in commits}
    revealed_ids = {s.step for s in steps}
    for c in commits:
        if c.step not in revealed_ids:
            return Finding("contradiction", f"the reveal leaves out step {c.step}, which it signed a commitment for")
    for s, (ctx, given, sent) in zip(steps, _digests(steps), strict=True):
        found = by_step.get(s.step)
        if found is None:
            if complete and s.step not in unobserved:
                return Finding("contradiction", f"the reveal has a step {s.step} it never committed to")
            continue
        for what, ours, theirs in (("arguments", ctx, found.context), ("input", given, found.input),
                                   ("output", sent, found.output)):
            if ours != theirs:
                return Finding("contradiction", f"step {s.step}: the revealed {what} does not hash to its commitment")
    if len({c.span for c in commits}) != 1:
        raise ValueError("commitments of more than one span")
    try:
        runtime = runtime_for(commits[0].span)
    except (ShardError, OSError, ValueError, MemoryError) as e:  # not a span of this model, or no room for it here
        raise CannotRecompute(f"cannot recompute layers {commits[0].span}: {e}") from None
    try:
        mismatch = first_mismatch(runtime, steps, set(by_step))
    except (SessionError, ProtocolError, codec.CodecError, RuntimeError) as e:  # inputs the span cannot run
        return Finding("wrong", f"its revealed inputs cannot be run through its span: {e}")
    if mismatch is not None:
        return Finding("wrong", str(mismatch))
    return None


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
    if ev.revealed is None or ev.revealed.stage != ev.accused or ev.revealed.session != ev.session or \
            any(c.stage != ev.accused or c.span != ev.span for c in ev.commits):
        return false("the reveal and commitments are not the accused's")
    try:
        finding = examine(entry, ev.commits, ev.revealed, runtime_for, max_bytes)
    except RevealRefused as e:
        return false(str(e))
    if finding is None:
        return false("its reveal matches its commitments and the recomputation")
    return upheld(finding.detail)


def _judge_refusal(ev: Evidence, runtime_for: RuntimeFor, max_bytes: int, ask_reveal: AskReveal | None,
                   upheld: Callable[[str], Judgement]) -> Judgement:
    if any(c.stage != ev.accused or c.span != ev.span for c in ev.commits):
        return Judgement(ev.accuser, f"false accusation against {ev.accused}: the commitments are not its", False)
    if ask_reveal is None:
        raise ProtocolError("this checker cannot ask for reveals")
    step = max(c.step for c in ev.commits)
    try:
        revealed = ask_reveal(ev.accused, ev.session_entry, ev.session, step)
        finding = examine(ev.session_entry, ev.commits, revealed, runtime_for, max_bytes)
    except CannotRecompute:
        raise
    except Exception as e:  # noqa: BLE001 - no answer, a refusal, an unverifiable reveal: all a refusal
        return upheld(f"it refused a reveal of step {step} to its entry, and to the coordinator: {e}")
    if finding is not None:
        return upheld(finding.detail)
    return Judgement("", f"{ev.accused} revealed step {step} to the coordinator and it checks out "
                         f"({ev.accuser} may have lost its link)", False)


def _judge_pass(ev: Evidence, runtime_for: RuntimeFor, max_bytes: int,
                false: Callable[[str], Judgement]) -> Judgement:
    """A peer auditor (the accused) signed a pass of commitments whose reveal recomputes wrong."""
    v = ev.verdict
    if v is None or v.auditor != ev.accused or not verdict_signed(v) or \
            not v.passed or (v.entry, v.session) != (ev.session_entry, ev.session) or \
            v.commits != commits_digest(ev.commits):
        return false("the evidence holds no pass signed by the accused over these commitments")
    if ev.revealed is None or ev.revealed.stage != v.stage or ev.revealed.session != ev.session or \
            any(c.stage != v.stage or c.span != ev.span for c in ev.commits):
        return false("the reveal and commitments are not those of the stage it passed")
    try:
        finding = examine(ev.session_entry, ev.commits, ev.revealed, runtime_for, max_bytes)
    except RevealRefused as e:
        return false(str(e))
    if finding is None or finding.kind != "wrong":  # only a reveal that matches the commitments proves them wrong
        return false("the commitments it passed recompute as committed")
    return Judgement(ev.accused, f"audit (false_pass): it passed {v.stage}'s step {v.step}, which recomputes "
                                 f"wrong: {finding.detail} (evidence from {ev.accuser})", True)
