"""The coordinator on the mesh: only an eligible contributor runs one. It stands for the lease of the
`PlanFollower` it leads, and while leading it plans, publishes signed plans, re-plans, and judges evidence.

Contributors put their benchmark figures and link probes in their membership heartbeats; the leader
turns the membership view into a cluster description, plans it, and publishes the plan signed with
its node key. Re-planning keeps the current plan unless the new one is better by `replan_threshold`,
and migrations are make-before-break: a changed plan is first published as a `target` while clients
keep routing over the `active` one; it becomes active once every node of the target announces its
new span loaded.

Churn is damped (`churn.Churn`): a membership change re-plans once the view has been quiet for a beat
(or after four at the latest), so a join storm gives a few epochs, not one per arrival; a new epoch is
published only when the assignments change. Members that join get the
current signed plan again (the same epoch, at most once per settle), and it is repeated every
REPUBLISH_BEATS intervals; a follower that still missed it asks for it (`ids.PLAN`, answered here).

Evidence (`ids.EVIDENCE`) goes to the judge given to the constructor (it recomputes spans, so it is
injected: this package imports no torch); an upheld accusation keeps its node out of plans for
SENTENCE_S, and the coordinators after this one keep the sentences a plan names. Passed audits
(`ids.PASSED`) go to the probation ledger (`audit.probation`), whose standings ride in the plan.
"""
from __future__ import annotations

import logging
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import trio

from beeswarm.audit import probation
from beeswarm.coordinator import plans
from beeswarm.coordinator.checkable import unchecked_on_probation
from beeswarm.coordinator.churn import SETTLE_BEATS, Churn
from beeswarm.coordinator.cluster import Cluster, Entry, ModelShape, NodeSpec, Workload, step_ms, tokens_per_s
from beeswarm.coordinator.election import Lease
from beeswarm.coordinator.follower import PlanFollower
from beeswarm.coordinator.planner import Plan, PlanError, plan
from beeswarm.p2p.signatures import verify_bytes
from beeswarm.protocol import ErrorReply, Message, ProtocolError, ids
from beeswarm.protocol.audit import Credited, Evidence, Passed, Verdict
from beeswarm.protocol.coordinator import (
    MAX_RUNS,
    MAX_STANDINGS,
    Checked,
    Exclusion,
    LeaseBeat,
    Pipeline,
    PlanRequest,
    PlanState,
    SignedPlan,
    Standing,
    assignments,
)
from beeswarm.protocol.membership import NodeInfo
from beeswarm.protocol.rpcs import EVIDENCE, PASSED, PLAN
from beeswarm.protocol.spans import Span
from beeswarm.protocol.step import commit_body

if TYPE_CHECKING:  # the judge recomputes spans (torch): a node without one never imports it
    from beeswarm.audit.evidence import Judgement

log = logging.getLogger(__name__)

Judge = Callable[[Evidence], "Judgement"]  # checks evidence: recomputes spans (contributors inject it)
REPUBLISH_BEATS = 10.0
DEFAULT_LINK = (50.0, 100.0, 100.0)  # rtt ms, up, down Mbit/s assumed until a probe measures the pair
RELAYED_LEGS = 2  # a relayed pair's path: to the relay and on
SENTENCE_S = 24 * 3600.0  # how long upheld evidence keeps a node out of plans


def cluster_from_members(members: dict[str, NodeInfo], model: ModelShape, workload: Workload) -> Cluster:
    """The planner's input from membership heartbeats (contributors with benchmark figures only).

    The entry is a typical client: its RTT to a node is that node's median measured RTT.
    """
    nodes = []
    for peer, info in sorted(members.items()):
        b = info.bench
        base = b.get("layer_ms_base")  # a peer may send null: such a node is not benchmarked yet
        if info.role != "contributor" or info.state in ("paused", "leaving") or base is None or \
                info.quant != model.quant or unreachable(info):
            continue
        rtts = {other: link[0] for other, link in info.links.items()}
        up = statistics.median([v[1] for v in info.links.values()]) if info.links else DEFAULT_LINK[1]
        down = statistics.median([v[2] for v in info.links.values()]) if info.links else DEFAULT_LINK[2]
        nodes.append(NodeSpec(
            id=peer, mem_bytes=info.memory_bytes, host_mem_bytes=int(b.get("host_mem_bytes") or 0),
            layer_ms_base=float(base), layer_ms_per_token=float(b.get("layer_ms_per_token") or 0),
            offload_gbps=b.get("offload_gbps"), up_mbps=up, down_mbps=down, rtt_ms=rtts))
    ids = {n.id for n in nodes}
    # Pairs nobody probed yet get the default link, so a young swarm can still be planned; two nodes behind NATs
    # meet through a relay until a hole is punched: two legs, so the planner prefers a direct pair.
    private = {p for p in ids if members[p].reach == "private"}
    nodes = [replace(n, rtt_ms={**{o: DEFAULT_LINK[0] * (RELAYED_LEGS if {n.id, o} <= private else 1)
                                   for o in ids if o != n.id}, **n.rtt_ms}) for n in nodes]
    entry_rtt = {n.id: statistics.median(n.rtt_ms.values()) if n.rtt_ms else DEFAULT_LINK[0] for n in nodes}
    return Cluster(model, workload, Entry("entry", entry_rtt, DEFAULT_LINK[1], DEFAULT_LINK[2]), tuple(nodes))


OTHER_FORMAT_SHOWN = 32  # a plan names at most this many (it holds MAX_STAGES exclusions in all)


def unreachable(info: NodeInfo) -> bool:
    """Nobody can dial it (behind a NAT) and no relay serves it: a plan must not assume a link to it."""
    return info.reach == "private" and not any("/p2p-circuit" in addr for addr in info.addrs)


UNREACHABLE = "nobody can dial it (behind a NAT or firewall) and no relay serves it"


def left_out(members: dict[str, NodeInfo], quant: str) -> tuple[Exclusion, ...]:
    """Contributors left out of plans for a reason of their own, and told why: serving weights in another format
    than `quant`, or unreachable."""
    return tuple(Exclusion(peer, f"serves {info.quant[:16]} weights; this swarm serves {quant}"
                           if info.quant != quant else UNREACHABLE)
                 for peer, info in sorted(members.items())
                 if info.role == "contributor" and (info.quant != quant or unreachable(info)))[:OTHER_FORMAT_SHOWN]


def pipelines_tokens_per_s(cluster: Cluster, pipelines: tuple[Pipeline, ...]) -> float | None:
    """Tokens/s of `pipelines` priced on `cluster` (None if a node is gone or its span no longer fits)."""
    nodes = {n.id for n in cluster.nodes}
    total = 0.0
    for p in pipelines:
        stages = [(s.node, len(s.span)) for s in p.stages]
        if any(node not in nodes for node, _ in stages):
            return None
        step = step_ms(cluster, stages, p.micro_batches)
        if step == float("inf"):
            return None
        total += tokens_per_s(cluster, step)
    return total or None


def next_assignment(cluster: Cluster, new: tuple[Pipeline, ...], new_tokens_per_s: float, state: PlanState,
                    view: dict[str, NodeInfo], threshold: float) -> tuple[tuple[Pipeline, ...], tuple[Pipeline, ...]]:
    """(active, target) after a re-plan.

    The current target is kept unless the new plan is better by `threshold`. A changed target starts
    as a migration: clients keep the active pipelines until every target node announces its new span
    loaded and serving (make-before-break); of those, the ones that still work (a replica whose nodes all
    survived a loss), or the target when none does.
    """
    current = state.target or state.active
    kept = pipelines_tokens_per_s(cluster, current) if current else None
    target = current if kept is not None and new_tokens_per_s <= kept * (1 + threshold) else new
    loaded = all(view.get(node) is not None and view[node].layers == span and view[node].state == "serving"
                 for node, span in assignments(target).items())
    if loaded:
        return target, target
    working = tuple(p for p in state.active if pipelines_tokens_per_s(cluster, (p,)) is not None)
    return working or target, target


class Coordinator:
    """Leads the `PlanFollower` it is given (whose election it ticks, with the candidates): nothing starts
    until `start()`, which starts the follower too.

    `model`: the shape planned for; `judge`: checks evidence sent to this node while it leads (None: it takes
    none); `planner`: injectable for tests."""

    def __init__(self, follower: PlanFollower, model: ModelShape, workload: Workload | None = None,
                 eligible: bool = True, replan_threshold: float = 0.10, planner: Callable[[Cluster], Plan] = plan,
                 judge: Judge | None = None):
        self.follower, self.model, self.planner, self._judge = follower, model, planner, judge
        self.node, self.members, self.interval, self.clock = follower.node, follower.members, follower.interval, \
            follower.clock
        self.workload = workload or Workload()
        self.replan_threshold, self.eligible = replan_threshold, eligible
        self.sentences: dict[str, Exclusion] = {}  # nodes kept out of plans by upheld evidence
        self.ledger = probation.Ledger()  # the audits each stage passed
        self._lock = threading.Lock()  # the sentences and the ledger: judged and credited in worker threads
        self.churn = Churn(self.interval)  # when to plan again
        self._last_beat = 0.0
        self._signed: SignedPlan | None = None  # the current plan as published (re-sent to newcomers)
        self._republish_at = 0.0
        # what the last planning ran on
        self._planned_input: tuple[Cluster, int, int, frozenset[str], tuple[Exclusion, ...], tuple[Standing, ...]] \
            | None = None

    def start(self) -> None:
        self.follower.listen()  # this coordinator ticks its election
        self.node.serve(PLAN, self._serve_plan)
        self.node.serve(PASSED, self._on_passed)
        if self._judge is not None:
            # judging recomputes a span: one at a time, off the shared pool
            self.node.serve(EVIDENCE, self._on_evidence, threads=1)
        self.members.listeners.append(self._on_member)
        self.node.add_task(self._loop)

    # what it leads: the follower's -----------------------------------------------------------
    @property
    def state(self) -> PlanState:
        """The plan the swarm follows as this node knows it (its own while it leads)."""
        return self.follower.state

    @property
    def lease(self) -> Lease | None:
        return self.follower.lease

    @property
    def is_leader(self) -> bool:
        return self.follower.is_leader

    def _on_member(self, event: str, info: NodeInfo) -> None:
        self.mark_dirty()
        if event == "join":  # the newcomer needs the current plan: send it again soon
            self._republish_at = min(self._republish_at, self.clock() + SETTLE_BEATS * self.interval)

    def mark_dirty(self) -> None:
        """Re-plan soon (while leading): membership changed, or this node's own figures or state did."""
        self.churn.changed(self.clock())

    @property
    def replan_pending(self) -> bool:
        """Something the plan depends on changed and no plan has taken it in yet."""
        return self.churn.pending

    # requests ---------------------------------------------------------------------------------
    async def _serve_plan(self, peer: str, request: PlanRequest) -> Message:
        if self._signed is None or not self.is_leader:
            return ErrorReply(error="this node holds no current plan")
        return self._signed

    def _on_evidence(self, peer: str, evidence: Evidence) -> Message:
        """Judge an accusation (in a worker thread: it may recompute a span) and sentence whom it names."""
        if not self.is_leader or self._judge is None:
            return ErrorReply(error="this node is not the coordinator", busy=True)
        if peer not in (evidence.accuser, evidence.session_entry):  # an entry hands in its peer auditor's evidence
            raise ProtocolError("evidence is taken from its accuser, or the entry whose session it is about")
        if peer in self.sentences:
            return ErrorReply(error="this node is excluded: it brings no evidence")
        judgement = self._judge(evidence)  # ProtocolError (unsigned) strikes the sender
        if not judgement.excluded:
            log.info("evidence against %s not upheld: %s", evidence.accused, judgement.reason)
            return Verdict(excluded="", reason=judgement.reason[:500])
        sentence = Exclusion(judgement.excluded, judgement.reason[:500], until=time.time() + SENTENCE_S)
        log.warning("excluding %s for %.0f h: %s", sentence.node, SENTENCE_S / 3600, sentence.reason)
        with self._lock:
            self.sentences[sentence.node] = sentence
        with self._lock:
            self.ledger.forget(sentence.node)
        if not judgement.upheld and peer == evidence.accuser:
            self.node.strike(peer, judgement.reason, severe=True)
        self.mark_dirty()
        return Verdict(excluded=sentence.node, reason=sentence.reason)

    def _on_passed(self, peer: str, passed: Passed) -> Message:
        """Count a stage's passed audit of `peer`'s session, shown by the stage's signed commitment to it."""
        if not self.is_leader:
            return ErrorReply(error="this node is not the coordinator", busy=True)
        stage = passed.commit.stage
        signed = verify_bytes(stage, commit_body(peer, passed.session, passed.commit), passed.commit.sig)
        if stage == peer or not signed:
            raise ProtocolError("a pass is shown by the stage's own commitment to the reporter's session")
        span = passed.commit.span
        checked = passed.layers or (span,)
        if any(c.start < span.start or c.end > span.end for c in checked):
            raise ProtocolError("a pass names layers outside the stage's span")
        layers = sorted({layer for c in checked for layer in range(c.start, c.end)})
        steps = min(passed.steps or passed.commit.step + 1, passed.commit.step + 1)  # no more than it committed
        with self._lock:
            before = self.ledger.published([stage], 1)
            self.ledger.credit(stage, peer, passed.session, layers, steps)
            now = self.ledger.least(stage, span)
            changed = self.ledger.published([stage], 1) != before
        if changed:
            self.mark_dirty()  # the plan's standings change
        return Credited(passed=now)

    def _standings(self, view: dict[str, NodeInfo], active: tuple[Pipeline, ...]) -> tuple[Standing, ...]:
        """What the plan carries of the ledger: the stages of `active` first, then the other contributors."""
        nodes = [s.node for p in active for s in p.stages] + \
            sorted(peer for peer, info in view.items() if info.role == "contributor")
        with self._lock:
            return tuple(Standing(n, tuple(Checked(span, steps) for span, steps in runs[:MAX_RUNS]))
                         for n, runs in self.ledger.published(nodes, MAX_STANDINGS).items())

    # leading ----------------------------------------------------------------------------------
    def _stand(self) -> Lease | None:
        """Tick the election as a candidate (while this node may lead); the lease claimed, if it just did."""
        contributors = {p: info for p, info in self.members.view().items() if info.role == "contributor"}
        # a node serving weights in another format than the swarm's plan never leads it (nor is deferred to), nor
        # does one that others cannot dial (every member must reach its coordinator)
        candidates = {p for p, info in contributors.items()
                      if info.quant == self.model.quant and info.reach != "private"}
        state = self.state
        # (unless nobody serves the plan's format any more: then the swarm needs a leader of another)
        same_format = not state.epoch or state.quant == self.model.quant or not any(
            info.quant == state.quant for info in contributors.values())
        return self.follower.tick(candidates, self.eligible and same_format and self.members.info.reach != "private")

    async def _loop(self) -> None:
        last_replan = 0.0
        while True:
            claim = self._stand()
            if claim is not None:
                log.info("claimed coordinator lease, term %d", claim.term)
                self.churn.lead()
                self._last_beat = 0.0
                self._signed = None  # a plan of an earlier term is no one's to re-send
                with self._lock:  # the sentences and standings of the coordinators before stand
                    self.sentences = {e.node: e for e in self.state.excluded if e.until} | self.sentences
                    self.ledger.merge({s.node: s.layers() for s in self.state.standings})
            now = self.clock()
            lease = self.lease
            if lease is not None and self.is_leader:
                if now - self._last_beat >= self.interval:
                    await self._publish(LeaseBeat(term=lease.term, epoch=lease.epoch))
                    self._last_beat = now
                if (self.churn.settled(now) or self.state.migrating()) and now - last_replan >= self.interval / 2:
                    self.churn.planned()
                    last_replan = now
                    await self._replan()
                if self._signed is not None and now >= self._republish_at:
                    await self._publish(self._signed)
                    self._republish_at = now + REPUBLISH_BEATS * self.interval
            await trio.sleep(min(0.25, self.interval / 4))

    async def _publish(self, msg: Message) -> None:
        try:
            await self.node.publish_async(self.node.topic(ids.COORDINATOR_TOPIC), msg)
        except Exception as e:  # noqa: BLE001 - no peers yet
            log.debug("coordinator publish failed: %s", e)

    async def _replan(self) -> None:
        now = time.time()
        with self._lock:
            self.sentences = {node: e for node, e in self.sentences.items() if e.until > now}
            sentenced = set(self.sentences)
        view = {peer: info for peer, info in self.members.view(with_self=True).items() if peer not in sentenced}
        cluster = cluster_from_members(view, self.model, self.workload)
        others = left_out(view, self.model.quant)  # not in the cluster, named in the plan: a change counts
        standings = self._standings(view, self.state.active)
        given = lambda: (cluster, self.state.term, self.state.epoch, frozenset(sentenced), others,  # noqa: E731
                         standings)
        if not cluster.nodes or given() == self._planned_input and not self.state.migrating():
            return  # nothing the plan depends on changed
        try:
            await self.plan_epoch(cluster, view, others)
        finally:
            self._planned_input = given()

    def _on_probation(self, node: str, span: Span) -> bool:
        with self._lock:
            return self.ledger.least(node, span) < probation.PROBATION_STEPS

    async def _without_unchecked(self, cluster: Cluster, result: Plan) -> tuple[Cluster, Plan]:
        """`result` planned again without the stages on probation that nobody could check (`checkable`), named in
        its exclusions, where a plan without them exists; else as it is."""
        left: dict[str, str] = {}
        planned = cluster
        while unchecked := unchecked_on_probation(cluster, result.pipelines, self._on_probation):
            # (their memory stays in `cluster`: off the plan, they have room to check the others)
            fewer = replace(cluster, nodes=tuple(n for n in cluster.nodes if n.id not in left | unchecked))
            try:
                replanned = await trio.to_thread.run_sync(self.planner, fewer)
            except PlanError:
                break
            if not replanned.pipelines:
                break
            left |= unchecked
            planned, result = fewer, replanned
        if left:
            log.info("planned without %d stage(s) on probation nobody could check", len(left))
        return planned, replace(result, excluded=result.excluded + tuple(Exclusion(n, why) for n, why in left.items()))

    async def plan_epoch(self, cluster: Cluster, view: dict[str, NodeInfo], others: tuple[Exclusion, ...] = ()) -> None:
        """Plan `cluster` and publish the result as the next epoch, unless it changes nothing or the lease was
        lost while the planner ran. `others`: the contributors left out for a reason of their own (`left_out`)."""
        try:
            result = await trio.to_thread.run_sync(self.planner, cluster)
        except PlanError as e:
            log.warning("cannot plan the swarm yet: %s", e)
            return
        cluster, result = await self._without_unchecked(cluster, result)
        active, target = next_assignment(cluster, result.pipelines, result.tokens_per_s, self.state, view,
                                         self.replan_threshold)
        with self._lock:
            excluded = result.excluded + others + tuple(self.sentences.values())
        standings = self._standings(view, active)
        if (active, target, excluded, standings) == (self.state.active, self.state.target, self.state.excluded,
                                                     self.state.standings) and \
                self.state.coordinator == self.node.peer_id:
            return  # the same assignments: no new epoch (newcomers get the current plan re-sent)
        lease = self.follower.next_epoch()  # the lease may have been lost while planning ran in its thread
        if lease is None:
            log.info("lost the lease while planning: the plan is not published")
            return
        state = PlanState(term=lease.term, epoch=lease.epoch, coordinator=self.node.peer_id,
                          objective=result.objective, quant=self.model.quant, model=self.model.ref,
                          fingerprint=self.model.fingerprint, active=active, target=target, excluded=excluded,
                          standings=standings)
        self._signed = plans.sign(self.node.identity.key_pair, state)
        self._republish_at = self.clock() + REPUBLISH_BEATS * self.interval
        await self._publish(self._signed)
        self.follower.apply(state)
