"""The entry's audits: after each step it draws, with a secret random source, which stages' steps to
check. When the session ends, each stage with a step drawn is audited once, up to its last drawn step (an
audit checks every step up to the one it asks for, so the later draw covers the earlier ones: a long
session costs one replay a stage, not one per draw), and a stage on probation (`probation`: few audits
passed, as the swarm and this entry know it) up to the session's last step. A worker thread commissions a
peer auditor (`audit.peer`, drawn the same way) to have the stage reveal the session to it, examine the
reveal against the commitments the entry holds and recompute it, and checks some of its passes with a
second auditor; or, told to (`runtime_for`), asks for the reveal and recomputes here. A stage caught is
banned at once (`on_caught`) and the signed evidence goes to the coordinator, which checks it and
excludes the stage swarm-wide.

Audits run off the critical path, and the stages cannot tell an audited step from any other (the draw
happens after the step, here). A caller that must not return unaudited text waits with `settle` for the
audits of its sessions. Each audit passed is reported to the coordinator's ledger (`vouch`).
"""
from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from beeswarm.audit import DEFAULT_RATE, probation
from beeswarm.audit.evidence import CannotRecompute, Finding, RevealRefused, examine, sign_evidence
from beeswarm.audit.peer import ask_peer, sign_commission
from beeswarm.p2p.errors import NodeError
from beeswarm.p2p.node import Node
from beeswarm.p2p.requests import reply_decoder
from beeswarm.protocol import ProtocolError, RemoteError, Span, encode, ids
from beeswarm.protocol.audit import (
    AuditAsk,
    Audited,
    AuditVerdict,
    Commission,
    Credited,
    Evidence,
    Passed,
    Reveal,
    Revealed,
    Verdict,
)
from beeswarm.protocol.step import Commit
from beeswarm.shard.span import SpanRuntime

log = logging.getLogger(__name__)

REVEAL_TIMEOUT_S = 30.0
MAX_KNOWN = 4096  # stages whose passed audits this entry counts
VOUCH_DRAIN_S = 3.0
SETTLE_S = 30.0  # the longest a generation waits for its audits; later verdicts still ban and report
PEER_AUDIT_S = 120.0  # a peer auditor's answer (it fetches the reveal and recomputes)
PEER_TRIES = 3  # auditors asked in a round
AGAIN_S = (1.0, 3.0)  # pauses before the rounds after the first, before an audit is given up as unchecked
WORKERS = 4  # audits run at once
SECOND_OPINION = 0.1  # of peer auditors' passes checked again (every one while the stage is on probation)


@dataclass
class AuditCounts:
    run: int = 0
    passed: int = 0
    failed: int = 0  # caught: evidence sent
    refused: int = 0  # no checkable reveal: banned here, nobody else told
    unchecked: int = 0  # no auditor could recompute it (nor this entry): the stage is not blamed (on probation, its
    # tokens are taken back all the same: what nobody checked is not released)
    auditors_caught: int = 0  # peer auditors caught lying: a pass a second opinion proved wrong, a false accusation

    def as_json(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class _Job:
    session: str
    stage: str
    step: int


class Auditor:
    def __init__(self, node: Node, runtime_for: Callable[[Span], SpanRuntime] | None, rate: float = DEFAULT_RATE,
                 on_caught: Callable[[str, str], None] = lambda peer, why: None,
                 coordinator: Callable[[], str | None] = lambda: None, rng: random.Random | None = None,
                 report: Callable[[Evidence], Verdict | None] | None = None,
                 on_cleared: Callable[[str, str], None] = lambda peer, why: None,
                 standing: Callable[[str], int] = lambda stage: 0,
                 vouch: Callable[[str, Commit], None] | None = None,
                 auditors: Callable[[Span, str], list[list[str]]] = lambda span, stage: [],
                 second_opinion: float = SECOND_OPINION,
                 on_unverified: Callable[[str, str], None] = lambda peer, why: None,
                 last_resort: Callable[[Span], SpanRuntime] | None = None):
        """`runtime_for(span)`: the span's layers to recompute with here (loaded on first use), or None: peer
        auditors recompute; `on_caught(peer, why)`: a stage failed an audit or refused one; `coordinator()`: whom
        to send evidence to; `report`: what is done with signed evidence (by default, it goes to the coordinator),
        returning the verdict on it, if any; `on_cleared(peer, why)`: the verdict on a peer auditor's accusation
        of `peer` found it false; `standing(stage)`: the audits the swarm knows it passed (the plan's);
        `vouch(session, commit)`: what is done with a pass (by default, it goes to the coordinator);
        `auditors(span, stage)`: the peers that may audit `stage` on `span`, in tiers (an auditor is drawn at
        random from the first tier that answers); `second_opinion`: the chance a peer auditor's pass is checked
        by another one, always for a stage on probation; `on_unverified(peer, why)`: a stage on probation that nobody
        could check (its tokens do not stand: route around it while it is on probation; no ban, no evidence);
        `last_resort(span)`: the layers to recompute with here when no peer auditor could (MemoryError or
        ShardError when they do not fit: then the audit is unchecked)."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"the audit rate is a probability, got {rate}")
        self.node, self.runtime_for, self.rate = node, runtime_for, rate
        self.auditors, self.second_opinion = auditors, second_opinion
        self.on_caught, self.on_cleared, self.coordinator = on_caught, on_cleared, coordinator
        self.on_unverified, self.last_resort = on_unverified, last_resort
        self._report = report or self._send_to_coordinator
        self.standing, self._vouch = standing, vouch or self._vouch_to_coordinator
        self.passed: dict[str, int] = {}  # stage -> audits it passed here
        self._vouching = 0  # passes on their way to the coordinator
        self._vouched: dict[tuple[str, str], int] = {}  # (coordinator, stage) -> passes it took from this entry
        self.rng = rng or random.SystemRandom()  # the stages must not be able to predict the draw
        self.counts = AuditCounts()
        self.verdicts: list[Verdict] = []  # the coordinator's answers to this entry's evidence
        self._commits: dict[str, dict[str, list[Commit]]] = defaultdict(lambda: defaultdict(list))
        self._pending: dict[str, int] = defaultdict(int)  # session -> audits queued or running
        self._caught: dict[str, set[str]] = defaultdict(set)  # session -> stages caught in it
        self._unverified: dict[str, set[str]] = defaultdict(set)  # session -> stages on probation nobody checked
        self._unobserved: dict[str, set[int]] = defaultdict(set)  # session -> steps sent, results not awaited
        self._drawn: dict[str, dict[str, int]] = defaultdict(dict)  # session -> stage -> last step drawn
        self._gone: dict[str, set[str]] = defaultdict(set)  # session -> stages that failed in it
        self._ended: set[str] = set()  # sessions whose audits are drawn
        self._done: set[str] = set()  # sessions settled: forgotten once their audits have run
        self._cond = threading.Condition()
        self._recomputing = threading.Lock()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._replies = reply_decoder(Revealed, limit=node.config.max_tensor_bytes)
        self._verdicts = reply_decoder(Verdict)
        self._credits = reply_decoder(Credited)

    def start(self) -> Auditor:
        """Start the workers that run the audits: several at once (concurrent generations' audits do not queue
        behind one another, and a peer audit is mostly waiting on the auditor)."""
        for n in range(WORKERS):
            threading.Thread(target=self._run, name=f"auditor-{n}", daemon=True).start()
        return self

    def close(self, drain_s: float = VOUCH_DRAIN_S) -> None:
        """Stop auditing; the passes still on their way to the coordinator get up to `drain_s` (a chat that
        ends with its generation would otherwise lose the last ones)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._vouching, drain_s)
        for _ in range(WORKERS):
            self._jobs.put(None)

    def observe(self, session: str, commits: Sequence[Commit]) -> None:
        """A step's verified commitments (one per stage): keep them, and draw which to audit."""
        with self._cond:
            drawn = self._drawn[session]
            for c in commits:
                self._commits[session][c.stage].append(c)
                if self.rate and self.rng.random() < self.rate:
                    drawn[c.stage] = max(c.step, drawn.get(c.stage, c.step))

    def gone(self, session: str, stage: str) -> None:
        """`stage` failed during `session` (died, timed out: the entry went on without it). If it then cannot
        reveal the session, it is not blamed (`unchecked`): its text was shown and a crash is no lie. A stage on
        probation still is: its tokens were held back until its audit, and are taken back."""
        with self._cond:
            self._gone[session].add(stage)

    def ended(self, session: str) -> None:
        """The session ended (or its caller stopped waiting for it): audit each stage once, up to its last step
        drawn, or the whole session for a stage drawn for that (`probation`). Once per session."""
        with self._cond:
            if session in self._ended:
                return
            self._ended.add(session)
            drawn = self._drawn.get(session, {})
            caught = self._caught_anywhere()
            jobs = []
            for stage, commits in self._commits.get(session, {}).items():
                if not commits or stage in caught:
                    continue
                if self.rng.random() < probation.session_audit_chance(self.passes(stage), self.rate):
                    jobs.append(_Job(session, stage, max(c.step for c in commits)))
                elif stage in drawn:
                    jobs.append(_Job(session, stage, drawn[stage]))
            self._pending[session] += len(jobs)
        for job in jobs:
            self._jobs.put(job)

    def unobserved(self, session: str, step: int) -> None:
        """The entry sent `step` and will not wait for its result (a cancelled speculative step): a stage
        that computed it reveals it without a commitment the entry holds."""
        with self._cond:
            self._unobserved[session].add(step)

    def settle(self, sessions: Sequence[str], timeout: float = SETTLE_S) -> set[str]:
        """Wait for the audits of `sessions` (ended here if they were not), up to `timeout`; the stages whose tokens
        in them do not stand: caught, or on probation and checked by nobody. The sessions are then forgotten
        (their state dropped once their last audit has run)."""
        for session in sessions:
            self.ended(session)
        with self._cond:
            self._cond.wait_for(lambda: not any(self._pending.get(s) for s in sessions), timeout)
            caught = set().union(*(self._caught.get(s, set()) | self._unverified.get(s, set()) for s in sessions))
            self._done.update(sessions)
            self._drop_done()
            return caught

    def on_probation(self, stage: str) -> bool:
        """Whether every session through `stage` is audited whole when it ends (then its tokens wait for it)."""
        return self.passes(stage) < probation.PROBATION_PASSES

    def passes(self, stage: str) -> int:
        """The audits `stage` passed, as the swarm or this entry counts them (the larger)."""
        with self._cond:
            return max(self.passed.get(stage, 0), self.standing(stage))

    def _drop_done(self) -> None:
        """(Under the lock.) Forget the settled sessions no audit is still running for."""
        for s in [s for s in self._done if not self._pending.get(s)]:
            self._done.discard(s)
            self._ended.discard(s)
            for table in (self._commits, self._pending, self._caught, self._unverified, self._unobserved, self._drawn,
                          self._gone):
                table.pop(s, None)

    def accuse(self, evidence: Evidence) -> None:
        """Sign and send evidence found on the data path (a broken chain of commitments)."""
        self._count("failed")
        signed = sign_evidence(self.node.identity.key_pair, evidence)
        threading.Thread(target=self._report_and_act, args=(signed,), name="evidence", daemon=True).start()

    # the worker ---------------------------------------------------------------------------------
    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._audit(job)
            except Exception:  # noqa: BLE001 - one audit's bug must not end the others
                log.exception("audit of %s step %d failed to run", job.stage, job.step)
            finally:
                with self._cond:
                    self._pending[job.session] -= 1
                    self._drop_done()
                    self._cond.notify_all()

    def _audit(self, job: _Job) -> None:
        with self._cond:
            commits = [c for c in self._commits[job.session][job.stage] if c.step <= job.step]
            unobserved = frozenset(self._unobserved[job.session])
            caught = job.stage in self._caught_anywhere()
        if caught:
            return  # caught already
        if self._excused(job):  # it failed during the session, past probation: not blamed if it cannot reveal, and
            return  # a liar would not; asking waited out a stopped stage's silence (30 s) while the stream held
        self._count("run")
        if self.runtime_for is not None:
            self._recompute_here(job, commits, unobserved, self.runtime_for)
            return
        ask = self._ask(job, commits, unobserved)
        tiers = [[p for p in tier if p not in (job.stage, self.node.peer_id) and not self.node.bans.is_banned(p)]
                 for tier in self.auditors(commits[0].span, job.stage)]
        first = self._peer_audit(ask, tiers)
        for pause in AGAIN_S:  # busy, or gone (a stage killed meanwhile is still drawn until it leaves the view)
            if first is not None:
                break
            time.sleep(pause)
            first = self._peer_audit(ask, tiers)
        if first is None and self.last_resort is not None:  # a swarm of one, or of spans too big for the others
            self._recompute_here(job, commits, unobserved, self.last_resort)
            return
        if first is None:
            self._unchecked(job, f"no auditor could check layers {commits[0].span}")
            return
        auditor, answer = first
        if not answer.verdict.passed:
            if answer.evidence is not None and answer.evidence.kind == "refused" and self._excused(job):
                return
            self._failed(job, answer.evidence, f"auditor {auditor}")
            return
        if self.rng.random() < (1.0 if self.on_probation(job.stage) else self.second_opinion):
            others = [[p for p in tier if p != auditor] for tier in tiers]
            second = self._peer_audit(ask, others)
            if second is not None and not second[1].verdict.passed:
                evidence = second[1].evidence
                self._failed(job, evidence, f"auditor {second[0]}, after {auditor} passed it")
                if evidence is not None and evidence.kind == "wrong":
                    self._false_pass(auditor, answer.verdict, tuple(commits), evidence)
                return
        self._passed(job, commits)

    def _ask(self, job: _Job, commits: list[Commit], unobserved: frozenset[int]) -> Callable[[str], AuditAsk]:
        """The request to an auditor: the entry's signed commission to it, and the commitments it holds."""
        def to(auditor: str) -> AuditAsk:
            commission = sign_commission(self.node.identity.key_pair, Commission(
                entry=self.node.peer_id, auditor=auditor, stage=job.stage, session=job.session, step=job.step))
            return AuditAsk(commission=commission, commits=tuple(commits), unobserved=tuple(sorted(unobserved)))
        return to

    def _peer_audit(self, ask: Callable[[str], AuditAsk], tiers: list[list[str]]) -> tuple[str, Audited] | None:
        """(auditor, its answer) from an auditor drawn at random, tier by tier, up to PEER_TRIES asked."""
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
                except (RemoteError, NodeError, TimeoutError) as e:
                    log.info("auditor %s could not audit: %s", auditor, e)
        return None

    def _recompute_here(self, job: _Job, commits: list[Commit], unobserved: frozenset[int],
                        runtime_for: Callable[[Span], SpanRuntime]) -> None:
        try:
            revealed = self.node.request(job.stage, ids.AUDIT, Reveal(session=job.session, step=job.step),
                                         self._replies, timeout=REVEAL_TIMEOUT_S)
            with self._recomputing, torch.inference_mode():  # one replay at a time on this machine's spans
                finding = examine(self.node.peer_id, commits, revealed, runtime_for,
                                  self.node.config.max_tensor_bytes, complete=True, unobserved=unobserved)
        except CannotRecompute as e:
            self._unchecked(job, f"this entry cannot check it: {e}")
            return
        except (RemoteError, NodeError, TimeoutError, RevealRefused) as e:
            if self._excused(job):
                return
            self._failed(job, Evidence(kind="refused", accused=job.stage, accuser=self.node.peer_id,
                                       session=job.session, span=commits[0].span, commits=tuple(commits),
                                       detail=str(e)[:500]), "this entry")
            return
        if finding is None:
            self._passed(job, commits)
            return
        self._failed(job, _evidence(job, self.node.peer_id, commits, revealed, finding), "this entry")

    def _excused(self, job: _Job) -> bool:
        """Whether a stage that did not reveal is excused (`gone`): then the audit is counted unchecked."""
        with self._cond:
            gone = job.stage in self._gone.get(job.session, ())
        if not gone or self.on_probation(job.stage):
            return False
        self._count("unchecked")
        log.info("%s failed during the session and cannot reveal its step %d: left unchecked", job.stage, job.step)
        return True

    def _unchecked(self, job: _Job, why: str) -> None:
        """Nobody could run the audit. An established stage is not blamed; one on probation is not trusted either:
        the tokens it computed were held back for this audit, and are taken back (no ban, no evidence)."""
        self._count("unchecked")
        if not self.on_probation(job.stage):
            log.warning("%s's step %d left unchecked: %s", job.stage, job.step, why)
            return
        log.warning("%s is on probation and its step %d went unchecked (%s): its tokens are taken back", job.stage,
                    job.step, why)
        with self._cond:
            self._unverified[job.session].add(job.stage)
        self.on_unverified(job.stage, why)

    def _passed(self, job: _Job, commits: list[Commit]) -> None:
        self._count("passed")
        log.debug("audit of %s step %d passed", job.stage, job.step)
        with self._cond:
            self.passed[job.stage] = self.passed.get(job.stage, 0) + 1
            if len(self.passed) > MAX_KNOWN:  # the least trusted are audited as newcomers again
                del self.passed[min(self.passed, key=self.passed.__getitem__)]
        self._vouch(job.session, commits[-1])

    def _failed(self, job: _Job, evidence: Evidence | None, by: str) -> None:
        """The stage failed or refused an audit (`by` whom): caught here, the evidence to the coordinator (signed
        here when this entry found it; a peer auditor's is signed by it)."""
        assert evidence is not None, "a failed verdict comes with evidence (ask_peer checks it)"
        if evidence.kind == "refused":
            self._count("refused")
        else:
            self._count("failed")
        self._caught_in(job, f"{'refused' if evidence.kind == 'refused' else 'failed'} an audit of step {job.step} "
                             f"({by}): {evidence.detail}")
        if evidence.accuser == self.node.peer_id:
            evidence = sign_evidence(self.node.identity.key_pair, evidence)
        self._report_and_act(evidence)

    def _false_pass(self, auditor: str, verdict: AuditVerdict, commits: tuple[Commit, ...], caught: Evidence) -> None:
        """`auditor` passed what a second auditor's evidence shows wrong: evidence against it, its own signed pass."""
        self._count("auditors_caught")
        why = f"passed {verdict.stage}'s step {verdict.step}, which recomputes wrong"
        log.warning("auditor %s %s", auditor, why)
        self.node.bans.strike(auditor, why, severe=True)
        self._report_and_act(sign_evidence(self.node.identity.key_pair, Evidence(
            kind="false_pass", accused=auditor, accuser=self.node.peer_id, session=caught.session, span=caught.span,
            commits=commits, revealed=caught.revealed, verdict=verdict, detail=why)))

    def _count(self, what: str) -> None:
        with self._cond:
            setattr(self.counts, what, getattr(self.counts, what) + 1)

    def _caught_anywhere(self) -> set[str]:
        """(Under the lock.) The stages caught in any session kept here."""
        return set().union(*self._caught.values())

    def _caught_in(self, job: _Job, why: str) -> None:
        log.warning("stage %s %s", job.stage, why)
        with self._cond:
            self._caught[job.session].add(job.stage)
        self.on_caught(job.stage, why)

    def _vouch_to_coordinator(self, session: str, commit: Commit) -> None:
        """Tell the coordinator, in the node's loop: the generation waiting on this audit does not wait for it."""
        coordinator = self.coordinator()
        if coordinator is None or coordinator == self.node.peer_id:
            return
        with self._cond:
            if self._vouched.get((coordinator, commit.stage), 0) >= probation.PER_ENTRY:
                return  # its ledger counts no more of this stage's passes from this entry
            self._vouching += 1
        self.node.spawn(self._vouch_async, coordinator, commit.stage, encode(Passed(session=session, commit=commit)))

    async def _vouch_async(self, coordinator: str, stage: str, body: bytes) -> None:
        try:
            await self.node.requests.request(coordinator, ids.PASSED, body, self._credits, timeout=VOUCH_DRAIN_S)
            with self._cond:
                if len(self._vouched) >= MAX_KNOWN:
                    self._vouched.clear()
                self._vouched[coordinator, stage] = self._vouched.get((coordinator, stage), 0) + 1
        except (RemoteError, NodeError, TimeoutError) as e:
            log.debug("the coordinator did not take a pass: %s", e)
        finally:
            with self._cond:
                self._vouching -= 1
                self._cond.notify_all()

    def _report_and_act(self, evidence: Evidence) -> None:
        """Report the evidence; when the verdict does not uphold a peer auditor's accusation, the stage it accused
        is cleared here (it is not banned, nor are its receipts withheld, nor its tokens taken back): the
        coordinator checked its work. The auditor is struck when the verdict finds the accusation false (a
        refusal it could not show, the stage having revealed to the coordinator, may have been a lost link)."""
        verdict = self._report(evidence)
        if verdict is None:
            return
        self.verdicts.append(verdict)
        log.info("coordinator's verdict: %s excluded (%s)", verdict.excluded or "nobody", verdict.reason)
        if evidence.accuser != self.node.peer_id and verdict.excluded != evidence.accused:
            if verdict.excluded == evidence.accuser:
                self._count("auditors_caught")
                self.node.bans.strike(evidence.accuser, verdict.reason, severe=True)
            with self._cond:
                for stages in self._caught.values():
                    stages.discard(evidence.accused)
            self.on_cleared(evidence.accused, verdict.reason)

    def _send_to_coordinator(self, evidence: Evidence) -> Verdict | None:
        coordinator = self.coordinator()
        if coordinator is None:
            log.warning("no coordinator to send the evidence against %s to", evidence.accused)
            return None
        try:
            verdict: Verdict = self.node.request(coordinator, ids.EVIDENCE, evidence, self._verdicts, timeout=120.0,
                                                 limit=self.node.config.max_tensor_bytes)  # it carries the reveal
        except (RemoteError, NodeError, TimeoutError) as e:
            log.warning("the coordinator did not take the evidence against %s: %s", evidence.accused, e)
            return None
        return verdict


def _evidence(job: _Job, me: str, commits: list[Commit], revealed: Revealed, finding: Finding) -> Evidence:
    return Evidence(kind=finding.kind, accused=job.stage, accuser=me, session=job.session, span=commits[0].span,
                    commits=tuple(commits), revealed=revealed, detail=finding.detail[:500])
