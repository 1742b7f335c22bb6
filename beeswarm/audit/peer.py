"""Peer auditors: a contributor audits a stage for an entry that cannot, or would rather not, hold the span.

The entry commissions an auditor it draws among the contributors of the coordinator's plan (`Commission`,
signed by the entry: the stage reveals the entry's session to the auditor it names and to nobody else),
hands it the stage's commitments it holds (`AuditAsk`), and gets back the auditor's signed verdict
(`AuditVerdict`) with, when the stage failed or refused, evidence the auditor signed. The reveal goes from
the stage to the auditor: the entry's link carries commitments only (179 bytes a step).

An auditor's pass is a signed statement about the stage's signed commitments, so a pass of commitments that
recompute wrong is evidence against the auditor (`false_pass`), found when the entry has the same step
checked again by a second auditor; an accusation that does not hold convicts its auditor as any
false accusation does.
"""
from __future__ import annotations

import logging
import os

import msgspec
import torch
from libp2p.crypto.keys import KeyPair

from beeswarm.audit import commitments
from beeswarm.audit.evidence import (
    CannotRecompute,
    RevealRefused,
    RuntimeFor,
    evidence_signed,
    examine,
    layers_for,
    sign_evidence,
    sign_verdict,
    verdict_signed,
)
from beeswarm.p2p.errors import NodeError
from beeswarm.p2p.node import Node
from beeswarm.p2p.signatures import sign_bytes, verify_bytes
from beeswarm.protocol import ErrorReply, Message, ProtocolError, RemoteError
from beeswarm.protocol.audit import (
    AuditAsk,
    Audited,
    AuditVerdict,
    Commission,
    Evidence,
    Reveal,
    Revealed,
    commission_body,
    commits_digest,
)
from beeswarm.protocol.rpcs import PEER_AUDIT, REVEAL

log = logging.getLogger(__name__)

REVEAL_TIMEOUT_S = 30.0
LAX_ENV = "BEESWARM_TEST_LAX_AUDITOR"  # tests only: this contributor passes every audit it is asked for


def sign_commission(key_pair: KeyPair, c: Commission) -> Commission:
    return msgspec.structs.replace(c, sig=sign_bytes(key_pair, commission_body(c)))


def commissioned(c: Commission, auditor: str, stage: str, session: str, step: int) -> bool:
    """Whether `c` lets `auditor` have `stage` reveal `session` up to `step`: it says so, signed by its entry."""
    return (c.auditor, c.stage, c.session, c.step) == (auditor, stage, session, step) and \
        verify_bytes(c.entry, commission_body(c), c.sig)


class PeerAuditService:
    """A contributor's side (`ids.PEER_AUDIT`): audit a stage for the entry that commissioned this node, one
    audit at a time (it recomputes on the device that serves; the others wait their turn without a thread of
    the node's shared pool), with `runtime_for`'s layers."""

    def __init__(self, node: Node, runtime_for: RuntimeFor):
        self.node, self.runtime_for = node, runtime_for
        self.lax = bool(os.environ.get(LAX_ENV))
        if self.lax:
            log.warning("TEST FAULT ON: this auditor passes every audit without checking (%s)", LAX_ENV)
        self.audits = 0

    def start(self) -> None:
        self.node.serve(PEER_AUDIT, self._on_ask, threads=1)

    def _on_ask(self, peer: str, ask: AuditAsk) -> Message:
        c, commits = ask.commission, ask.commits
        if c.entry != peer or not commissioned(c, self.node.peer_id, c.stage, c.session, c.step):
            raise ProtocolError("an audit is asked by the session's entry, with its signed commission to this node")
        if not commits or any(x.stage != c.stage or x.span != commits[0].span or x.step > c.step for x in commits) \
                or max(x.step for x in commits) != c.step:
            raise ProtocolError("the commitments are not the stage's, for the session up to the commissioned step")
        if (c.piece is None) != (ask.boundaries is None) or c.piece is not None and \
                not commits[0].span.start <= c.piece.start < c.piece.end <= commits[0].span.end:
            raise ProtocolError("a piece of the stage's span is audited with its boundaries, and only a piece")
        self.audits += 1
        return self._audit(ask)

    def _audit(self, ask: AuditAsk) -> Message:
        c, commits = ask.commission, ask.commits
        key, me = self.node.identity.key_pair, self.node.peer_id
        layers = c.piece or commits[0].span

        def verdict(passed: bool, detail: str = "", share: float = 0.0) -> AuditVerdict:
            return sign_verdict(key, AuditVerdict(auditor=me, entry=c.entry, stage=c.stage, session=c.session,
                                                  step=c.step, passed=passed, commits=commits_digest(commits),
                                                  detail=detail[:500], piece=c.piece, share=share))

        def evidence(kind, detail: str, revealed: Revealed | None = None) -> Evidence:
            # The signatures are checked only here: a pass of commitments the stage's own signed reveal matches
            # is true whoever signed them, but evidence stands on the stage's signatures.
            if not all(commitments.verify(x, c.entry, c.session) for x in commits):
                raise ProtocolError("the commitments are not all signed by the stage")
            return sign_evidence(key, Evidence(kind=kind, accused=c.stage, accuser=me, entry=c.entry,
                                               session=c.session, span=commits[0].span, commits=commits,
                                               revealed=revealed, detail=detail[:500], piece=c.piece,
                                               boundaries=ask.boundaries))

        if self.lax:
            return Audited(verdict(True))
        if not self.node.knows(c.stage):  # a newcomer whose view has not brought it the stage yet: not its refusal
            return ErrorReply(error=f"this auditor knows no address for {c.stage} yet", busy=True)
        try:
            layers_for(self.runtime_for, layers)  # first: no room here is known before the stage reveals for nothing
            revealed = self.node.request(c.stage, REVEAL, Reveal(session=c.session, step=c.step, commission=c,
                                                                 piece=c.piece), timeout=REVEAL_TIMEOUT_S)
            with torch.inference_mode():
                examined = examine(c.entry, commits, revealed, self.runtime_for, self.node.config.max_tensor_bytes,
                                   complete=True, unobserved=frozenset(ask.unobserved), boundaries=ask.boundaries)
        except CannotRecompute as e:  # not the stage's fault, nor busy: the entry asks another auditor, not this one
            return ErrorReply(error=f"this auditor cannot recompute layers {layers}: {e}")
        except NodeError as e:  # no link to it (no answer of its own, so no refusal): the entry asks another auditor
            return ErrorReply(error=f"this auditor cannot reach {c.stage}: {e}", busy=True)
        except (RemoteError, TimeoutError, RevealRefused) as e:
            why = f"refused an audit of step {c.step}: {e}"
            log.info("stage %s %s (for %s)", c.stage, why, c.entry)
            return Audited(verdict(False, why), evidence("refused", str(e)))
        finding = examined.finding
        if finding is None:
            log.debug("stage %s passed an audit of step %d for %s", c.stage, c.step, c.entry)
            return Audited(verdict(True, share=examined.share))
        log.warning("stage %s failed an audit for %s: %s", c.stage, c.entry, finding.detail)
        return Audited(verdict(False, finding.detail), evidence(finding.kind, finding.detail, revealed))


def ask_peer(node: Node, auditor: str, ask: AuditAsk, timeout: float) -> Audited:
    """Ask `auditor` (RemoteError, NodeError, TimeoutError as `Node.request`; ProtocolError when its answer is
    not its own signed verdict on this very audit, or its evidence is not about it)."""
    answer = node.request(auditor, PEER_AUDIT, ask, timeout=timeout)
    c, v, ev = ask.commission, answer.verdict, answer.evidence
    if (v.auditor, v.entry, v.stage, v.session, v.step, v.piece) != \
            (auditor, c.entry, c.stage, c.session, c.step, c.piece) or \
            v.commits != commits_digest(ask.commits) or not verdict_signed(v):
        raise ProtocolError(f"auditor {auditor} answered with a verdict that is not its own on this audit")
    if not v.passed and (ev is None or (ev.accused, ev.accuser, ev.session_entry, ev.session) !=
                         (c.stage, auditor, c.entry, c.session)):
        raise ProtocolError(f"auditor {auditor} failed the stage without evidence about it")
    if ev is not None and not evidence_signed(ev):
        raise ProtocolError(f"auditor {auditor} sent evidence it did not sign")
    return answer
