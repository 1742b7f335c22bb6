"""Run one audit: who checks a stage's work on a session, and what came of it.

By default the entry recomputes nothing: it commissions peer auditors (`audit.peer`) among the swarm's members,
drawn at random with the OS's random source, so the audited stage cannot pick them. In the order tried:
1. a member serving the stage's whole span checks it whole (its layers are loaded: nothing to load);
2. when members serving pieces of the span cover all of it, or nobody could take it whole (3: a spare, else any
   member with room, loading it), the stage signs its layer boundaries and the span is checked by pieces
   (`audit.pieces`: on probation every layer, by cover where members serve them and spot checks elsewhere; past
   it SPOT_LAYERS layers drawn after the stage signed). The pieces' errors must fit the span's budget together.
A pass is checked again by a second auditor with chance `second_opinion` (always on probation); a pass the second
proves wrong is evidence against the first. Where no peer could check a piece, the entry does with
`last_resort` (the layers loaded here, when they fit); with `here` (`--audit-here`) it checks whole spans itself.
Only the stage's own answer (an error, silence past the timeout, a reveal that does not verify) is a refusal: a
stage no link can be made to is tried again for REACH_S, then left unchecked.
"""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from beeswarm.audit import layers, pieces
from beeswarm.audit.evidence import CannotRecompute, RevealRefused, RuntimeFor, examine
from beeswarm.audit.peer import ask_peer, sign_commission
from beeswarm.p2p.errors import NodeError
from beeswarm.p2p.node import Node
from beeswarm.protocol import ProtocolError, RemoteError, Span
from beeswarm.protocol.audit import AuditAsk, Audited, Boundaries, Commission, Evidence, Reveal, Revealed
from beeswarm.protocol.rpcs import BOUNDARIES, REVEAL, Rep, Rpc
from beeswarm.protocol.step import Commit

log = logging.getLogger(__name__)

REVEAL_TIMEOUT_S = 30.0
REACH_S = 15.0  # how long the entry keeps trying to reach a stage it audits: its ban here for the failure (5 s),
# then its new relay announced (a dead stage on probation holds its text that much longer)
PEER_AUDIT_S = 120.0  # a peer auditor's answer (it fetches the reveal and recomputes)
PEER_TRIES = 3  # auditors asked in a round
AGAIN_S = (1.0, 3.0)  # pauses before the rounds after the first, before a piece is given up as unchecked
SECOND_OPINION = 0.1  # of peer auditors' passes checked again (every one while the stage is on probation)


@dataclass(frozen=True)
class Candidates:
    """Who may audit a stage, as the plan and membership show them (never the stage itself)."""

    serving: dict[str, Span] = field(default_factory=dict)  # members serving layers, and which
    spares: tuple[str, ...] = ()  # members serving none (idle: they load what they check)


@dataclass(frozen=True)
class Pass:
    layers: tuple[Span, ...]  # checked, on every step of the audit
    steps: int


@dataclass(frozen=True)
class Fail:
    """The stage failed or refused (`evidence`, signed by its accuser; None: found here and proved to nobody)."""

    evidence: Evidence | None
    by: str
    why: str
    false_pass: Evidence | None = None  # against a peer auditor whose pass a second one proved wrong


@dataclass(frozen=True)
class Unchecked:
    why: str
    passed: Pass | None = None  # the layers that were checked


Outcome = Pass | Fail | Unchecked


@dataclass(frozen=True)
class _Checked:
    share: float  # of the span's tolerance


@dataclass(frozen=True)
class _Audit:
    """One job's fixed part: the stage's commitments it covers, and the steps sent and never awaited."""

    session: str
    stage: str
    step: int
    commits: tuple[Commit, ...]
    unobserved: frozenset[int]
    probation: bool

    @property
    def span(self) -> Span:
        return self.commits[0].span


class _Unreachable(Exception):
    """No link to the audited stage could be made: no answer of its own, so no refusal either."""


class AuditRunner:
    def __init__(self, node: Node, candidates: Callable[[str], Candidates] = lambda stage: Candidates(),
                 here: RuntimeFor | None = None, last_resort: RuntimeFor | None = None,
                 second_opinion: float = SECOND_OPINION, rng: random.Random | None = None,
                 sleep: Callable[[float], None] = time.sleep):
        """`candidates(stage)`: who may audit `stage`; `here`: check every audit here with these layers (loaded
        on first use) instead of peers; `last_resort`: the layers to check a piece here with when no peer could
        (MemoryError or ShardError when they do not fit: then it is unchecked)."""
        self.node, self.candidates, self.here, self.last_resort = node, candidates, here, last_resort
        self.second_opinion = second_opinion
        self.rng = rng or random.SystemRandom()
        self.sleep = sleep

    def run(self, session: str, stage: str, step: int, commits: Sequence[Commit], unobserved: frozenset[int],
            probation: bool, whole: bool) -> Outcome:
        """Audit `stage`'s `commits` of `session` up to `step`: `whole`, every layer of its span, else the layers a
        spot check draws (a peer holding the whole span checks it whole all the same)."""
        audit = _Audit(session, stage, step, tuple(commits), unobserved, probation)
        span = audit.span
        if self.here is not None:
            here = self._check_here(audit, None, None, self.here)
            return here if not isinstance(here, _Checked) else Pass((span,), len(commits))
        found = self.candidates(stage)
        usable = {p for p in (*found.serving, *found.spares) if p not in (stage, self.node.peer_id)
                  and not self.node.bans.is_banned(p)}
        serving = {p: s for p, s in found.serving.items() if p in usable}
        spares = [p for p in found.spares if p in usable]
        whole_span = sorted(p for p, s in serving.items() if s.start <= span.start and span.end <= s.end)
        others = sorted(p for p in serving if p not in whole_span)
        if whole_span:  # checked whole by one holding it (a second opinion may come from one loading it)
            checked = self._check_by_peers(audit, None, None, [whole_span, spares, others])
        elif not all(piece.holders for piece in pieces.cover(span, serving)):
            # nobody serves some of its layers: one who can load the span whole checks it, else it goes by pieces
            checked = self._check_by_peers(audit, None, None, [spares, others], rounds=1)
        else:
            checked = None
        if isinstance(checked, Fail):
            return checked
        if checked is not None:
            return Pass((span,), len(commits))
        return self._by_pieces(audit, serving, spares, whole)

    # by pieces ------------------------------------------------------------------------------------
    def _by_pieces(self, audit: _Audit, serving: dict[str, Span], spares: list[str], whole: bool) -> Outcome:
        span = audit.span
        try:
            boundaries = self._ask_boundaries(audit)
        except _Unreachable as e:
            return Unchecked(f"its layer boundaries: {e}")
        except (RemoteError, TimeoutError, ProtocolError) as e:
            return self._refused(audit, f"its layer boundaries: {e}")
        wrong = layers.contradiction(audit.commits, layers.ends_of(boundaries), complete=True,
                                     unobserved=audit.unobserved)
        if wrong is not None:
            return Fail(self._evidence(audit, "contradiction", wrong, boundaries=boundaries), "this entry", wrong)
        drawn = pieces.cover(span, serving) if whole else pieces.spot(span, serving, self.rng)
        passed: list[Span] = []
        unchecked: list[Span] = []
        shares = 0.0
        for piece in drawn:
            tiers = [list(piece.holders), spares, sorted(p for p in serving if p not in piece.holders)]
            checked = self._check_by_peers(audit, piece.layers, boundaries, tiers)
            if checked is None and self.last_resort is not None:
                here = self._check_here(audit, piece.layers, boundaries, self.last_resort)
                checked = None if isinstance(here, Unchecked) else here
            if isinstance(checked, Fail):
                return checked
            if checked is None:
                unchecked.append(piece.layers)
                continue
            passed.append(piece.layers)
            shares += checked.share
        if shares > 1.0:
            why = f"the pieces of layers {span} are each within tolerance but their errors add up to {shares:.2f} " \
                  "times the span's"
            return Fail(None, "this entry", why)
        checked_part = Pass(tuple(passed), len(audit.commits)) if passed else None
        if unchecked:
            return Unchecked(f"no auditor could check layers {', '.join(map(str, unchecked))}", checked_part)
        assert checked_part is not None
        return checked_part

    def _ask_boundaries(self, audit: _Audit) -> Boundaries:
        b = self._ask_stage(audit, BOUNDARIES, Reveal(session=audit.session, step=audit.step, boundaries=True))
        if (b.stage, b.session, b.span) != (audit.stage, audit.session, audit.span) or \
                not layers.boundaries_signed(b, self.node.peer_id):
            raise ProtocolError("the boundaries are not the stage's own, signed for this session and span")
        return b

    def _ask_stage(self, audit: _Audit, rpc: Rpc[Reveal, Rep], reveal: Reveal) -> Rep:
        """The stage's answer to `reveal`. A link that cannot be made (lost, being made again through another relay,
        the stage banned here a few seconds for the failure that lost it) is tried again for REACH_S: _Unreachable.
        A request that timed out is asked once more on a fresh stream (the link may have been the one made again
        when the request went): a second timeout is the stage's refusal, so a liar gains one REVEAL_TIMEOUT_S."""
        waited, pause, timed_out = 0.0, 0.5, False
        while True:
            try:
                return self.node.request(audit.stage, rpc, reveal, timeout=REVEAL_TIMEOUT_S)
            except TimeoutError as e:
                if timed_out:
                    raise
                timed_out = True  # (a timed-out request leaves no pooled stream to the stage: the next is fresh)
                log.info("%s: asking %s again on a fresh stream", e, audit.stage)
            except NodeError as e:
                if waited >= REACH_S:
                    raise _Unreachable(f"could not reach it for {waited:.0f} s: {e}") from None
                log.info("cannot reach %s to audit it (%s): trying again in %.1f s", audit.stage, e, pause)
                self.sleep(pause)
                waited += pause
                pause = min(2 * pause, 8.0)

    # one check -------------------------------------------------------------------------------------
    def _check_by_peers(self, audit: _Audit, piece: Span | None, boundaries: Boundaries | None,
                        tiers: list[list[str]], rounds: int = len(AGAIN_S) + 1) -> _Checked | Fail | None:
        """A check of `piece` (None: the whole span) by a peer auditor drawn tier by tier, and of its pass by a
        second one (`second_opinion`); None when none could, in `rounds` rounds a few seconds apart."""
        def ask(auditor: str) -> AuditAsk:
            commission = sign_commission(self.node.identity.key_pair, Commission(
                entry=self.node.peer_id, auditor=auditor, stage=audit.stage, session=audit.session, step=audit.step,
                piece=piece))
            return AuditAsk(commission=commission, commits=audit.commits, unobserved=tuple(sorted(audit.unobserved)),
                            boundaries=boundaries)

        declined: set[str] = set()  # auditors that answered they cannot (no room for the layers): not asked again
        first = None
        for pause in (0.0, *AGAIN_S[:rounds - 1]):  # busy, or gone (a member killed meanwhile is drawn until it leaves)
            tiers = [[p for p in tier if p not in declined] for tier in tiers]
            if not any(tiers):  # nobody (left) to ask, a swarm of one contributor say: no rounds to wait out
                return None
            if pause:
                self.sleep(pause)
            first = self._peer_audit(ask, tiers, declined)
            if first is not None:
                break
        if first is None:
            return None
        auditor, answer = first
        if not answer.verdict.passed:
            assert answer.evidence is not None, "a failed verdict comes with evidence (ask_peer checks it)"
            return Fail(answer.evidence, f"auditor {auditor}", answer.evidence.detail)
        if self.rng.random() < (1.0 if audit.probation else self.second_opinion):
            second = self._peer_audit(ask, [[p for p in tier if p != auditor] for tier in tiers])
            if second is not None and not second[1].verdict.passed:
                evidence = second[1].evidence
                assert evidence is not None
                against = self._false_pass(auditor, answer, audit, evidence) if evidence.kind == "wrong" else None
                return Fail(evidence, f"auditor {second[0]}, after {auditor} passed it", evidence.detail, against)
        return _Checked(answer.verdict.share)

    def _peer_audit(self, ask: Callable[[str], AuditAsk], tiers: list[list[str]],
                    declined: set[str] | None = None) -> tuple[str, Audited] | None:
        """(auditor, its answer) from an auditor drawn at random, tier by tier, up to PEER_TRIES asked; those that
        answer they cannot (an error, not busy) are added to `declined`."""
        tried = 0
        for tier in tiers:
            tier = list(tier)
            self.rng.shuffle(tier)
            for auditor in tier:
                if tried == PEER_TRIES:
                    return None
                tried += 1
                try:
                    return auditor, ask_peer(self.node, auditor, ask(auditor), PEER_AUDIT_S)
                except ProtocolError as e:
                    self.node.bans.strike(auditor, str(e), severe=True)
                    log.warning("auditor %s: %s", auditor, e)
                except RemoteError as e:
                    if not e.busy and declined is not None:
                        declined.add(auditor)
                    log.info("auditor %s could not audit: %s", auditor, e)
                except (NodeError, TimeoutError) as e:
                    log.info("auditor %s could not audit: %s", auditor, e)
        return None

    def _check_here(self, audit: _Audit, piece: Span | None, boundaries: Boundaries | None,
                    runtime_for: RuntimeFor) -> _Checked | Fail | Unchecked:
        """Check `piece` (None: the whole span) with layers loaded here: the stage reveals it to this entry."""
        try:
            revealed = self._ask_stage(audit, REVEAL, Reveal(session=audit.session, step=audit.step, piece=piece))
            with torch.inference_mode():
                examined = examine(self.node.peer_id, audit.commits, revealed, runtime_for,
                                   self.node.config.max_tensor_bytes, complete=True, unobserved=audit.unobserved,
                                   boundaries=boundaries)
        except CannotRecompute as e:
            return Unchecked(f"this entry cannot check it: {e}")
        except _Unreachable as e:
            return Unchecked(str(e))
        except (RemoteError, TimeoutError, RevealRefused) as e:
            return self._refused(audit, str(e), piece, boundaries)
        if examined.finding is None:
            return _Checked(examined.share)
        finding = examined.finding
        return Fail(self._evidence(audit, finding.kind, finding.detail, revealed, piece, boundaries), "this entry",
                    finding.detail)

    def _refused(self, audit: _Audit, why: str, piece: Span | None = None,
                 boundaries: Boundaries | None = None) -> Fail:
        return Fail(self._evidence(audit, "refused", why, piece=piece, boundaries=boundaries), "this entry", why)

    def _evidence(self, audit: _Audit, kind, detail: str, revealed: Revealed | None = None, piece: Span | None = None,
                  boundaries: Boundaries | None = None) -> Evidence:
        """Evidence this entry found (the auditor signs it before it goes anywhere)."""
        return Evidence(kind=kind, accused=audit.stage, accuser=self.node.peer_id, session=audit.session,
                        span=audit.span, commits=audit.commits, revealed=revealed, detail=detail[:500], piece=piece,
                        boundaries=boundaries)

    def _false_pass(self, auditor: str, answer: Audited, audit: _Audit, caught: Evidence) -> Evidence:
        """`auditor` passed what a second auditor's evidence shows wrong: evidence against it, its own signed pass."""
        v = answer.verdict
        why = f"passed {v.stage}'s step {v.step}, which recomputes wrong"
        log.warning("auditor %s %s", auditor, why)
        self.node.bans.strike(auditor, why, severe=True)
        return Evidence(kind="false_pass", accused=auditor, accuser=self.node.peer_id, session=caught.session,
                        span=caught.span, commits=audit.commits, revealed=caught.revealed, verdict=v, detail=why,
                        piece=caught.piece, boundaries=caught.boundaries)
