"""The entry's audits, as one unit: a book of what it holds and draws (`book.AuditBook`, pure), a runner that has
each audit checked (`runner.AuditRunner`: peer auditors, pieces, this machine's layers), and a reporter to the
coordinator (`reporter.CoordinatorReporter`: evidence and passes). `Auditor` composes the three, runs the audits
on worker threads (started by `start()`), and tells its listeners who was caught, cleared, or left unverified.

After each step the book draws, with a secret random source, which stages' steps to check; when the session ends,
each stage with a step drawn is audited once, up to its last drawn step, and a stage on probation (`probation`:
its layers checked on too few steps, as the swarm and this entry know it) on every layer up to the session's last
step. A stage caught is banned at once (`AuditListener.on_caught`) and the signed evidence goes to the coordinator,
which checks it and excludes the stage swarm-wide.

Audits run off the critical path, and the stages cannot tell an audited step from any other (the draw
happens after the step, here). A caller that must not return unaudited text waits with `settle` for the
audits of its sessions. Each audit passed is reported to the coordinator's ledger.
"""
from __future__ import annotations

import logging
import queue
import random
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from beeswarm.audit import DEFAULT_RATE
from beeswarm.audit.book import AuditBook, AuditCounts, Job, Standing
from beeswarm.audit.evidence import RuntimeFor, sign_evidence
from beeswarm.audit.reporter import VOUCH_DRAIN_S, CoordinatorReporter
from beeswarm.audit.runner import AuditRunner, Candidates, Fail, Pass, Unchecked
from beeswarm.p2p.node import Node
from beeswarm.protocol import Span
from beeswarm.protocol.audit import Evidence, Verdict
from beeswarm.protocol.step import Commit

log = logging.getLogger(__name__)

SETTLE_S = 30.0  # the longest a generation waits for its audits; later verdicts still ban and report
# ... and for those of a stage on probation, whose tokens only its audit releases (past it they are taken back)
PROBATION_SETTLE_S = 120.0
WORKERS = 4  # audits run at once

__all__ = ["AuditCounts", "AuditListener", "Auditor", "Reporter", "entry_auditor"]


class AuditListener(Protocol):
    def on_caught(self, stage: str, why: str) -> None:
        """`stage` failed or refused an audit: its tokens do not stand; ban it."""

    def on_cleared(self, stage: str, why: str) -> None:
        """A verdict found a peer auditor's accusation of `stage` false: it is not caught after all."""

    def on_unverified(self, stage: str, why: str) -> None:
        """`stage`, on probation, went unchecked (nobody could): its tokens do not stand; no ban, no evidence."""


class Reporter(Protocol):
    def report(self, evidence: Evidence) -> Verdict | None: ...

    def vouch(self, session: str, commit: Commit, layers: Sequence[Span], steps: int) -> None: ...

    def drain(self, timeout: float) -> None: ...


class Auditor:
    def __init__(self, node: Node, book: AuditBook, runner: AuditRunner, reporter: Reporter):
        self.node, self.book, self.runner, self.reporter = node, book, runner, reporter
        self.verdicts: list[Verdict] = []  # the coordinator's answers to this entry's evidence
        self._listeners: list[AuditListener] = []
        self._jobs: queue.Queue[Job | None] = queue.Queue()

    def listen(self, listener: AuditListener) -> None:
        self._listeners.append(listener)

    def start(self) -> Auditor:
        """Start the workers that run the audits: several at once (concurrent generations' audits do not queue
        behind one another, and a peer audit is mostly waiting on the auditor)."""
        for n in range(WORKERS):
            threading.Thread(target=self._run, name=f"auditor-{n}", daemon=True).start()
        return self

    def close(self, drain_s: float = VOUCH_DRAIN_S) -> None:
        """Stop auditing; the passes still on their way to the coordinator get up to `drain_s`."""
        self.reporter.drain(drain_s)
        for _ in range(WORKERS):
            self._jobs.put(None)

    @property
    def counts(self) -> AuditCounts:
        return self.book.counts

    # the data path ----------------------------------------------------------------------------------
    def observe(self, session: str, commits: Sequence[Commit]) -> None:
        """A step's verified commitments (one per stage): keep them, and draw which to audit."""
        self.book.observe(session, commits)

    def gone(self, session: str, stage: str) -> None:
        """`stage` failed during `session` (died, timed out: the entry went on without it). If it then cannot
        reveal the session, it is not blamed (`unchecked`): its text was shown and a crash is no lie. A stage on
        probation still is: its tokens were held back until its audit, and are taken back."""
        self.book.gone(session, stage)

    def unobserved(self, session: str, step: int) -> None:
        """The entry sent `step` and will not wait for its result (a cancelled speculative step): a stage
        that computed it reveals it without a commitment the entry holds."""
        self.book.unobserved(session, step)

    def ended(self, session: str) -> None:
        """The session ended (or its caller stopped waiting for it): queue the audits it calls for, once."""
        for job in self.book.ended(session):
            self._jobs.put(job)

    def settle(self, sessions: Sequence[str], timeout: float = SETTLE_S,
               probation_timeout: float = PROBATION_SETTLE_S) -> set[str]:
        """Wait for the audits of `sessions` (ended here if they were not), up to `timeout`, and those of stages on
        probation up to `probation_timeout`; the stages whose tokens in them do not stand: caught, or on probation
        and not (yet) checked."""
        for session in sessions:
            self.ended(session)
        return self.book.settle(sessions, timeout, probation_timeout)

    def on_probation(self, stage: str, span: Span) -> bool:
        """Whether every session through `stage`'s `span` is audited whole when it ends (its tokens wait for it)."""
        return self.book.on_probation(stage, span)

    def accuse(self, evidence: Evidence) -> None:
        """Sign and send evidence found on the data path (a broken chain of commitments)."""
        self.book.count("failed")
        signed = sign_evidence(self.node.identity.key_pair, evidence)
        threading.Thread(target=self._report_and_act, args=(signed,), name="evidence", daemon=True).start()

    # the workers -------------------------------------------------------------------------------------
    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._audit(job)
            except Exception:  # noqa: BLE001 - one audit's bug must not end the others
                log.exception("audit of %s step %d failed to run", job.stage, job.step)
            finally:
                self.book.finished(job)

    def _audit(self, job: Job) -> None:
        if self.book.is_caught(job.stage):
            return
        commits, unobserved = self.book.commits(job)
        span = commits[0].span
        probation = self.book.on_probation(job.stage, span)
        if self.book.was_gone(job) and not probation:  # it failed during the session, past probation: not blamed if
            # it cannot reveal, and a liar would not; asking waited out a stopped stage's silence while the stream held
            self.book.count("unchecked")
            log.info("%s failed during the session and cannot reveal its step %d: left unchecked", job.stage, job.step)
            return
        self.book.count("run")
        outcome = self.runner.run(job.session, job.stage, job.step, commits, unobserved, probation, job.whole)
        if isinstance(outcome, Pass):
            self._passed(job, commits, outcome)
        elif isinstance(outcome, Fail):
            self._failed(job, outcome)
        else:
            self._unchecked(job, outcome, probation, commits)

    def _passed(self, job: Job, commits: list[Commit], passed: Pass, whole: bool = True) -> None:
        """`passed`: the layers checked and found right (`whole`: all the audit asked for)."""
        layers = [layer for span in passed.layers for layer in range(span.start, span.end)]
        if whole:
            self.book.count("passed")
        self.book.count("layers_checked", len(layers))
        self.book.credit(job.stage, layers, passed.steps)
        log.debug("audit of %s step %d passed (layers %s)", job.stage, job.step, ", ".join(map(str, passed.layers)))
        self.reporter.vouch(job.session, commits[-1], passed.layers, passed.steps)

    def _unchecked(self, job: Job, outcome: Unchecked, probation: bool, commits: list[Commit]) -> None:
        """Nobody could check (some of) it. An established stage is not blamed; one on probation is not trusted
        either: the tokens it computed were held back for this audit, and are taken back (no ban, no evidence)."""
        self.book.count("unchecked")
        if outcome.passed is not None:  # the layers that were checked count all the same
            self._passed(job, commits, outcome.passed, whole=False)
        if not probation:
            log.warning("%s's step %d left unchecked: %s", job.stage, job.step, outcome.why)
            return
        log.warning("%s is on probation and its step %d went unchecked (%s): its tokens are taken back", job.stage,
                    job.step, outcome.why)
        self.book.unverified(job.session, job.stage)
        for listener in self._listeners:
            listener.on_unverified(job.stage, outcome.why)

    def _failed(self, job: Job, fail: Fail) -> None:
        """The stage failed or refused an audit: caught here, the evidence (signed here when this entry found it;
        a peer auditor's is signed by it) to the coordinator."""
        refused = fail.evidence is not None and fail.evidence.kind == "refused"
        self.book.count("refused" if refused else "failed")
        why = f"{'refused' if refused else 'failed'} an audit of step {job.step} ({fail.by}): {fail.why}"
        log.warning("stage %s %s", job.stage, why)
        self.book.caught(job.session, job.stage)
        for listener in self._listeners:
            listener.on_caught(job.stage, why)
        if fail.false_pass is not None:
            self.book.count("auditors_caught")
            self._report_and_act(sign_evidence(self.node.identity.key_pair, fail.false_pass))
        if fail.evidence is not None:
            evidence = fail.evidence
            if evidence.accuser == self.node.peer_id:
                evidence = sign_evidence(self.node.identity.key_pair, evidence)
            self._report_and_act(evidence)

    def _report_and_act(self, evidence: Evidence) -> None:
        """Report the evidence; when the verdict does not uphold a peer auditor's accusation, the stage it accused
        is cleared here (it is not banned, nor are its receipts withheld, nor its tokens taken back): the
        coordinator checked its work. The auditor is struck when the verdict finds the accusation false (a
        refusal it could not show, the stage having revealed to the coordinator, may have been a lost link)."""
        verdict = self.reporter.report(evidence)
        if verdict is None:
            return
        self.verdicts.append(verdict)
        log.info("coordinator's verdict: %s excluded (%s)", verdict.excluded or "nobody", verdict.reason)
        if evidence.accuser != self.node.peer_id and verdict.excluded != evidence.accused:
            if verdict.excluded == evidence.accuser:
                self.book.count("auditors_caught")
                self.node.bans.strike(evidence.accuser, verdict.reason, severe=True)
            self.book.cleared(evidence.accused)
            for listener in self._listeners:
                listener.on_cleared(evidence.accused, verdict.reason)


def entry_auditor(node: Node, rate: float = DEFAULT_RATE,
                  candidates: Callable[[str], Candidates] = lambda stage: Candidates(),
                  coordinator: Callable[[], str | None] = lambda: None, standing: Standing = lambda stage: {},
                  here: RuntimeFor | None = None, last_resort: RuntimeFor | None = None,
                  reporter: Reporter | None = None, rng: random.Random | None = None) -> Auditor:
    """An entry's auditor, not started: `rate` of each stage's steps drawn; `candidates(stage)`: who may audit it;
    `coordinator()`: whom to report to (or `reporter`: what is done with evidence and passes instead); `standing`:
    what the swarm knows was checked; `here`: check every audit with these layers (`--audit-here`); `last_resort`:
    the layers to check a piece nobody else could with; `rng`: the draws (the OS's random source by default)."""
    rng = rng or random.SystemRandom()
    return Auditor(node, AuditBook(rate, standing, rng),
                   AuditRunner(node, candidates, here=here, last_resort=last_resort, rng=rng),
                   reporter or CoordinatorReporter(node, coordinator))
