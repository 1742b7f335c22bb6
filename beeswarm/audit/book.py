"""The entry's audit book: what it holds of each session (the stages' commitments, the steps drawn, who failed),
which audits a session's end calls for, what stands once they ran, and each stage's standing. Pure: no torch, no
network; thread-safe (one condition guards it all, and `settle` waits on it).

A session's end draws its audits (`ended`): each stage with a step drawn is audited once, up to its last drawn
step (an audit checks every step before the one it asks for, so the later draw covers the earlier ones), and a
stage on probation, with chance `probation.session_audit_chance`, up to the session's last step, on every layer.
"""
from __future__ import annotations

import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass

from beeswarm.audit import probation
from beeswarm.protocol.spans import Span
from beeswarm.protocol.step import Commit

MAX_KNOWN = 4096  # stages whose checks this entry counts (the least checked go first)

Standing = Callable[[str], Mapping[int, int]]  # stage -> per layer, the steps the swarm knows were checked


@dataclass
class AuditCounts:
    run: int = 0
    passed: int = 0
    failed: int = 0  # caught: evidence sent
    refused: int = 0  # no checkable reveal: banned here, nobody else told
    unchecked: int = 0  # no auditor could recompute it (nor this entry): the stage is not blamed (on probation, its
    # tokens are taken back all the same: what nobody checked is not released)
    auditors_caught: int = 0  # peer auditors caught lying: a pass a second opinion proved wrong, a false accusation
    layers_checked: int = 0  # layer checks passed (a whole span's audit checks each of its layers)

    def as_json(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class Job:
    """An audit of `stage`'s work in `session` up to `step`; `whole`: every layer of its span (probation), else the
    layers a spot check draws."""

    session: str
    stage: str
    step: int
    whole: bool = True
    probation: bool = False  # the stage was on probation: its tokens stand only once this audit passed


class AuditBook:
    def __init__(self, rate: float, standing: Standing = lambda stage: {}, rng: random.Random | None = None):
        """`rate`: each commitment's chance to be drawn; `standing(stage)`: what the swarm knows was checked (the
        plan's standings); `rng`: the draws' source (the OS's by default: the stages must not predict it)."""
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"the audit rate is a probability, got {rate}")
        self.rate, self.standing = rate, standing
        self.rng = rng or random.SystemRandom()
        self.counts = AuditCounts()
        self.cond = threading.Condition()
        self._checked: dict[str, dict[int, int]] = {}  # stage -> layer -> steps checked here
        self._commits: dict[str, dict[str, list[Commit]]] = defaultdict(lambda: defaultdict(list))
        self._pending: dict[str, list[Job]] = defaultdict(list)  # session -> audits queued or running
        self._caught: dict[str, set[str]] = defaultdict(set)  # session -> stages caught in it
        self._unverified: dict[str, set[str]] = defaultdict(set)  # session -> stages on probation nobody checked
        self._unobserved: dict[str, set[int]] = defaultdict(set)  # session -> steps sent, results not awaited
        self._drawn: dict[str, dict[str, int]] = defaultdict(dict)  # session -> stage -> last step drawn
        self._gone: dict[str, set[str]] = defaultdict(set)  # session -> stages that failed in it
        self._ended: set[str] = set()  # sessions whose audits are drawn
        self._done: set[str] = set()  # sessions settled: forgotten once their audits have run

    # what the data path tells it ----------------------------------------------------------------
    def observe(self, session: str, commits: Sequence[Commit]) -> None:
        """A step's verified commitments (one per stage): keep them, and draw which to audit."""
        with self.cond:
            drawn = self._drawn[session]
            for c in commits:
                self._commits[session][c.stage].append(c)
                if self.rate and self.rng.random() < self.rate:
                    drawn[c.stage] = max(c.step, drawn.get(c.stage, c.step))

    def gone(self, session: str, stage: str) -> None:
        with self.cond:
            self._gone[session].add(stage)

    def unobserved(self, session: str, step: int) -> None:
        with self.cond:
            self._unobserved[session].add(step)

    def ended(self, session: str) -> list[Job]:
        """The audits the end of `session` calls for (none the second time), counted as pending."""
        with self.cond:
            if session in self._ended:
                return []
            self._ended.add(session)
            drawn = self._drawn.get(session, {})
            caught = self._caught_anywhere()
            jobs = []
            for stage, commits in self._commits.get(session, {}).items():
                if not commits or stage in caught:
                    continue
                checks = self._checks(stage, commits[0].span)
                if self.rng.random() < probation.session_audit_chance(checks, self.rate):
                    jobs.append(Job(session, stage, max(c.step for c in commits),
                                    probation=checks < probation.PROBATION_STEPS))
                elif stage in drawn:
                    jobs.append(Job(session, stage, drawn[stage], whole=False))
            self._pending[session].extend(jobs)
            return jobs

    # what an audit needs, and what it found ----------------------------------------------------------
    def commits(self, job: Job) -> tuple[list[Commit], frozenset[int]]:
        """The stage's commitments up to the job's step, and the session's steps sent and never awaited."""
        with self.cond:
            return [c for c in self._commits[job.session][job.stage] if c.step <= job.step], \
                frozenset(self._unobserved[job.session])

    def was_gone(self, job: Job) -> bool:
        with self.cond:
            return job.stage in self._gone.get(job.session, ())

    def count(self, what: str, n: int = 1) -> None:
        with self.cond:
            setattr(self.counts, what, getattr(self.counts, what) + n)

    def caught(self, session: str, stage: str) -> None:
        with self.cond:
            self._caught[session].add(stage)

    def cleared(self, stage: str) -> None:
        """A verdict found the accusation of `stage` false: it is caught nowhere here."""
        with self.cond:
            for stages in self._caught.values():
                stages.discard(stage)

    def unverified(self, session: str, stage: str) -> None:
        with self.cond:
            self._unverified[session].add(stage)

    def is_caught(self, stage: str) -> bool:
        with self.cond:
            return stage in self._caught_anywhere()

    def credit(self, stage: str, layers: Iterable[int], steps: int) -> None:
        """`stage` passed a check of `layers` on `steps` steps."""
        with self.cond:
            checked = self._checked.setdefault(stage, {})
            for layer in layers:
                checked[layer] = checked.get(layer, 0) + steps
            if len(self._checked) > MAX_KNOWN:  # the least checked are audited as newcomers again
                del self._checked[min(self._checked, key=lambda s: min(self._checked[s].values(), default=0))]

    def finished(self, job: Job) -> None:
        """An audit of `job` has run, whatever came of it."""
        with self.cond:
            self._pending[job.session].remove(job)
            self._drop_done()
            self.cond.notify_all()

    def pending(self) -> int:
        """Audits queued or running."""
        with self.cond:
            return sum(map(len, self._pending.values()))

    # standing ------------------------------------------------------------------------------------
    def checks(self, stage: str, span: Span) -> int:
        """The steps every layer of `span` of `stage` was checked on, as the swarm or this entry counts them."""
        with self.cond:
            return self._checks(stage, span)

    def on_probation(self, stage: str, span: Span) -> bool:
        """Whether every session through `stage`'s `span` is audited whole, on every layer, when it ends (then its
        tokens wait for it)."""
        return self.checks(stage, span) < probation.PROBATION_STEPS

    def _checks(self, stage: str, span: Span) -> int:
        mine, swarm = self._checked.get(stage, {}), self.standing(stage)
        return min(max(mine.get(layer, 0), swarm.get(layer, 0)) for layer in range(span.start, span.end))

    # settling ------------------------------------------------------------------------------------
    def settle(self, sessions: Sequence[str], timeout: float, probation_timeout: float = 0.0) -> set[str]:
        """Wait up to `timeout` for the audits of `sessions` (already ended), and for those of stages on probation up
        to `probation_timeout` (at least `timeout`): their tokens are released only by their audit. The stages whose
        tokens in them do not stand: caught, on probation and checked by nobody, or on probation with their audit
        still running. The sessions are then forgotten (once their last audit has run)."""
        deadline = time.monotonic() + max(timeout, probation_timeout)
        with self.cond:
            self.cond.wait_for(lambda: not any(self._pending.get(s) for s in sessions), timeout)
            self.cond.wait_for(lambda: not any(j.probation for s in sessions for j in self._pending.get(s, ())),
                               max(0.0, deadline - time.monotonic()))
            caught = set().union(*(self._caught.get(s, set()) | self._unverified.get(s, set()) for s in sessions),
                                 (job.stage for s in sessions for job in self._pending.get(s, ()) if job.probation))
            self._done.update(sessions)
            self._drop_done()
            return caught

    def _drop_done(self) -> None:
        """(Under the lock.) Forget the settled sessions no audit is still running for."""
        for s in [s for s in self._done if not self._pending.get(s)]:
            self._done.discard(s)
            self._ended.discard(s)
            for table in (self._commits, self._pending, self._caught, self._unverified, self._unobserved, self._drawn,
                          self._gone):
                table.pop(s, None)

    def _caught_anywhere(self) -> set[str]:
        """(Under the lock.) The stages caught in any session kept here."""
        return set().union(*self._caught.values())
