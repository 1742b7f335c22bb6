"""The entry's audits: after each step it draws, with a secret random source, which stages' steps to
check; a worker thread asks each drawn stage to reveal the session up to that step, examines the reveal
against the commitments the entry holds and recomputes it. A stage caught is banned at once (`on_caught`)
and the signed evidence goes to the coordinator, which checks it and excludes the stage swarm-wide.

Audits run off the critical path: the generation goes on while they run, and the stages cannot tell an
audited step from any other (the draw happens after the step, here). A caller that must not return
unaudited text waits with `settle` for the audits of its sessions; there, a stage on probation
(`probation`: few audits passed, as the swarm and this entry know it) has the whole session audited too.
Each audit passed is reported to the coordinator's ledger (`vouch`).
"""
from __future__ import annotations

import logging
import queue
import random
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from beeswarm.audit import DEFAULT_RATE, probation
from beeswarm.audit.evidence import Finding, RevealRefused, examine, sign_evidence
from beeswarm.p2p.errors import NodeError
from beeswarm.p2p.node import Node
from beeswarm.p2p.requests import reply_decoder
from beeswarm.protocol import RemoteError, Span, encode, ids
from beeswarm.protocol.audit import Credited, Evidence, Passed, Reveal, Revealed, Verdict
from beeswarm.protocol.step import Commit
from beeswarm.shard.span import SpanRuntime

log = logging.getLogger(__name__)

REVEAL_TIMEOUT_S = 30.0
MAX_KNOWN = 4096  # stages whose passed audits this entry counts
VOUCH_DRAIN_S = 3.0
SETTLE_S = 10.0  # the longest a generation waits for its audits; later verdicts still ban and report


@dataclass
class AuditCounts:
    run: int = 0
    passed: int = 0
    failed: int = 0  # caught: evidence sent
    refused: int = 0  # no checkable reveal: banned here, nobody else told

    def as_json(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class _Job:
    session: str
    stage: str
    step: int


class Auditor:
    def __init__(self, node: Node, runtime_for: Callable[[Span], SpanRuntime], rate: float = DEFAULT_RATE,
                 on_caught: Callable[[str, str], None] = lambda peer, why: None,
                 coordinator: Callable[[], str | None] = lambda: None, rng: random.Random | None = None,
                 report: Callable[[Evidence], None] | None = None,
                 standing: Callable[[str], int] = lambda stage: 0,
                 vouch: Callable[[str, Commit], None] | None = None):
        """`runtime_for(span)`: the span's layers to recompute with (loaded on first use); `on_caught(peer,
        why)`: a stage failed an audit or refused one; `coordinator()`: whom to send evidence to; `report`:
        what is done with signed evidence (by default, it goes to the coordinator and its verdict is kept);
        `standing(stage)`: the audits the swarm knows it passed (the plan's); `vouch(session, commit)`: what is
        done with a pass (by default, it goes to the coordinator)."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"the audit rate is a probability, got {rate}")
        self.node, self.runtime_for, self.rate = node, runtime_for, rate
        self.on_caught, self.coordinator = on_caught, coordinator
        self._report = report or self._send_to_coordinator
        self.standing, self._vouch = standing, vouch or self._vouch_to_coordinator
        self.passed: dict[str, int] = {}  # stage -> audits it passed here
        self._vouching = 0  # passes on their way to the coordinator
        self.rng = rng or random.SystemRandom()  # the stages must not be able to predict the draw
        self.counts = AuditCounts()
        self.verdicts: list[Verdict] = []  # the coordinator's answers to this entry's evidence
        self._commits: dict[str, dict[str, list[Commit]]] = defaultdict(lambda: defaultdict(list))
        self._pending: dict[str, int] = defaultdict(int)  # session -> audits queued or running
        self._caught: dict[str, set[str]] = defaultdict(set)  # session -> stages caught in it
        self._unobserved: dict[str, set[int]] = defaultdict(set)  # session -> steps sent, results not awaited
        self._drawn_whole: dict[str, set[str]] = defaultdict(set)  # session -> stages drawn for a whole audit
        self._done: set[str] = set()  # sessions settled: forgotten once their audits have run
        self._cond = threading.Condition()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._replies = reply_decoder(Revealed, limit=node.config.max_tensor_bytes)
        self._verdicts = reply_decoder(Verdict)
        self._credits = reply_decoder(Credited)
        self._worker = threading.Thread(target=self._run, name="auditor", daemon=True)
        self._worker.start()

    def close(self, drain_s: float = VOUCH_DRAIN_S) -> None:
        """Stop auditing; the passes still on their way to the coordinator get up to `drain_s` (a chat that
        ends with its generation would otherwise lose the last ones)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._vouching, drain_s)
        self._jobs.put(None)

    def observe(self, session: str, commits: Sequence[Commit]) -> None:
        """A step's verified commitments (one per stage): keep them, and draw which to audit."""
        drawn = []
        with self._cond:
            for c in commits:
                self._commits[session][c.stage].append(c)
                if self.rate and self.rng.random() < self.rate:
                    drawn.append(_Job(session, c.stage, c.step))
                    self._pending[session] += 1
        for job in drawn:
            self._jobs.put(job)

    def unobserved(self, session: str, step: int) -> None:
        """The entry sent `step` and will not wait for its result (a cancelled speculative step): a stage
        that computed it reveals it without a commitment the entry holds."""
        with self._cond:
            self._unobserved[session].add(step)

    def settle(self, sessions: Sequence[str], timeout: float = SETTLE_S) -> set[str]:
        """Audit the whole of `sessions` on stages on probation, wait for their audits (up to `timeout`); the
        stages caught in them. The sessions are then forgotten (their state dropped once their last audit has
        run). With `timeout` 0 nothing more is audited."""
        if timeout > 0:
            self._draw_whole(sessions)
        with self._cond:
            self._cond.wait_for(lambda: not any(self._pending.get(s) for s in sessions), timeout)
            caught = set().union(*(self._caught.get(s, set()) for s in sessions))
            self._done.update(sessions)
            self._drop_done()
            return caught

    def _draw_whole(self, sessions: Sequence[str]) -> None:
        """Draw, for each stage of each session, whether to audit the session whole (`probation`)."""
        drawn = []
        with self._cond:
            caught = set().union(*self._caught.values())
            for session in sessions:
                for stage, commits in self._commits.get(session, {}).items():
                    if not commits or stage in caught or stage in self._drawn_whole[session]:
                        continue
                    passed = max(self.passed.get(stage, 0), self.standing(stage))
                    if self.rng.random() < probation.session_audit_chance(passed, self.rate):
                        self._drawn_whole[session].add(stage)
                        drawn.append(_Job(session, stage, max(c.step for c in commits)))
                        self._pending[session] += 1
        for job in drawn:
            self._jobs.put(job)

    def _drop_done(self) -> None:
        """(Under the lock.) Forget the settled sessions no audit is still running for."""
        for s in [s for s in self._done if not self._pending.get(s)]:
            self._done.discard(s)
            for table in (self._commits, self._pending, self._caught, self._unobserved, self._drawn_whole):
                table.pop(s, None)

    def accuse(self, evidence: Evidence) -> None:
        """Sign and send evidence found on the data path (a broken chain of commitments)."""
        self.counts.failed += 1
        signed = sign_evidence(self.node.identity.key_pair, evidence)
        threading.Thread(target=self._report, args=(signed,), name="evidence", daemon=True).start()

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
        if job.stage in {p for caught in self._caught.values() for p in caught}:
            return  # caught already
        self.counts.run += 1
        try:
            revealed = self.node.request(job.stage, ids.AUDIT, Reveal(session=job.session, step=job.step),
                                         self._replies, timeout=REVEAL_TIMEOUT_S)
            with torch.inference_mode():
                finding = examine(self.node.peer_id, commits, revealed, self.runtime_for,
                                  self.node.config.max_tensor_bytes, complete=True,
                                  unobserved=unobserved)
        except (RemoteError, NodeError, TimeoutError, RevealRefused) as e:
            self.counts.refused += 1
            self._caught_in(job, f"refused an audit of step {job.step}: {e}")
            self._report(sign_evidence(self.node.identity.key_pair, Evidence(
                kind="refused", accused=job.stage, accuser=self.node.peer_id, session=job.session,
                span=commits[0].span, commits=tuple(commits), detail=str(e)[:500])))
            return
        if finding is None:
            self.counts.passed += 1
            log.debug("audit of %s step %d passed", job.stage, job.step)
            with self._cond:
                self.passed[job.stage] = self.passed.get(job.stage, 0) + 1
                if len(self.passed) > MAX_KNOWN:  # the least trusted are audited as newcomers again
                    del self.passed[min(self.passed, key=self.passed.__getitem__)]
            self._vouch(job.session, commits[-1])
            return
        self.counts.failed += 1
        self._caught_in(job, f"failed an audit: {finding.detail}")
        self._report(sign_evidence(self.node.identity.key_pair, _evidence(job, self.node.peer_id, commits, revealed,
                                                                          finding)))

    def _caught_in(self, job: _Job, why: str) -> None:
        log.warning("stage %s %s", job.stage, why)
        with self._cond:
            self._caught[job.session].add(job.stage)
        self.on_caught(job.stage, why)

    def _vouch_to_coordinator(self, session: str, commit: Commit) -> None:
        """Tell the coordinator, in the node's loop: the generation waiting on this audit does not wait for it."""
        coordinator = self.coordinator()
        if coordinator is not None and coordinator != self.node.peer_id:
            with self._cond:
                self._vouching += 1
            self.node.spawn(self._vouch_async, coordinator, encode(Passed(session=session, commit=commit)))

    async def _vouch_async(self, coordinator: str, body: bytes) -> None:
        try:
            await self.node.requests.request(coordinator, ids.PASSED, body, self._credits, timeout=VOUCH_DRAIN_S)
        except (RemoteError, NodeError, TimeoutError) as e:
            log.debug("the coordinator did not take a pass: %s", e)
        finally:
            with self._cond:
                self._vouching -= 1
                self._cond.notify_all()

    def _send_to_coordinator(self, evidence: Evidence) -> None:
        coordinator = self.coordinator()
        if coordinator is None:
            log.warning("no coordinator to send the evidence against %s to", evidence.accused)
            return
        try:
            verdict = self.node.request(coordinator, ids.EVIDENCE, evidence, self._verdicts, timeout=120.0)
        except (RemoteError, NodeError, TimeoutError) as e:
            log.warning("the coordinator did not take the evidence against %s: %s", evidence.accused, e)
            return
        self.verdicts.append(verdict)
        log.info("coordinator's verdict: %s excluded (%s)", verdict.excluded or "nobody", verdict.reason)


def _evidence(job: _Job, me: str, commits: list[Commit], revealed: Revealed, finding: Finding) -> Evidence:
    return Evidence(kind=finding.kind, accused=job.stage, accuser=me, session=job.session, span=commits[0].span,
                    commits=tuple(commits), revealed=revealed, detail=finding.detail[:500])
