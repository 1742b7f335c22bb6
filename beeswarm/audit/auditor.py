"""The entry's audits: after each step it draws, with a secret random source, which stages' steps to
check; a worker thread asks each drawn stage to reveal the session up to that step, examines the reveal
against the commitments the entry holds and recomputes it. A stage caught is banned at once (`on_caught`)
and the signed evidence goes to the coordinator, which checks it and excludes the stage swarm-wide.

Audits run off the critical path: the generation goes on while they run, and the stages cannot tell an
audited step from any other (the draw happens after the step, here). A caller that must not return
unaudited text waits with `settle` for the audits of its sessions.
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

from beeswarm.audit import DEFAULT_RATE
from beeswarm.audit.evidence import Finding, RevealRefused, examine, sign_evidence
from beeswarm.p2p.errors import NodeError
from beeswarm.p2p.node import Node
from beeswarm.p2p.requests import reply_decoder
from beeswarm.protocol import RemoteError, Span, ids
from beeswarm.protocol.audit import Evidence, Reveal, Revealed, Verdict
from beeswarm.protocol.step import Commit
from beeswarm.shard.span import SpanRuntime

log = logging.getLogger(__name__)

REVEAL_TIMEOUT_S = 30.0
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
                 report: Callable[[Evidence], None] | None = None):
        """`runtime_for(span)`: the span's layers to recompute with (loaded on first use); `on_caught(peer,
        why)`: a stage failed an audit or refused one; `coordinator()`: whom to send evidence to; `report`:
        what is done with signed evidence (by default, it goes to the coordinator and its verdict is kept)."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"the audit rate is a probability, got {rate}")
        self.node, self.runtime_for, self.rate = node, runtime_for, rate
        self.on_caught, self.coordinator = on_caught, coordinator
        self._report = report or self._send_to_coordinator
        self.rng = rng or random.SystemRandom()  # the stages must not be able to predict the draw
        self.counts = AuditCounts()
        self.verdicts: list[Verdict] = []  # the coordinator's answers to this entry's evidence
        self._commits: dict[str, dict[str, list[Commit]]] = defaultdict(lambda: defaultdict(list))
        self._pending: dict[str, int] = defaultdict(int)  # session -> audits queued or running
        self._caught: dict[str, set[str]] = defaultdict(set)  # session -> stages caught in it
        self._unobserved: dict[str, set[int]] = defaultdict(set)  # session -> steps sent, results not awaited
        self._done: set[str] = set()  # sessions settled: forgotten once their audits have run
        self._cond = threading.Condition()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._replies = reply_decoder(Revealed, limit=node.config.max_tensor_bytes)
        self._verdicts = reply_decoder(Verdict)
        self._worker = threading.Thread(target=self._run, name="auditor", daemon=True)
        self._worker.start()

    def close(self) -> None:
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
        """Wait for the audits of `sessions` (up to `timeout`); the stages caught in them. The sessions are
        then forgotten (their state dropped once their last audit has run)."""
        with self._cond:
            self._cond.wait_for(lambda: not any(self._pending.get(s) for s in sessions), timeout)
            caught = set().union(*(self._caught.get(s, set()) for s in sessions))
            self._done.update(sessions)
            self._drop_done()
            return caught

    def _drop_done(self) -> None:
        """(Under the lock.) Forget the settled sessions no audit is still running for."""
        for s in [s for s in self._done if not self._pending.get(s)]:
            self._done.discard(s)
            for table in (self._commits, self._pending, self._caught, self._unobserved):
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
