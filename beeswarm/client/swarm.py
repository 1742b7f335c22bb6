"""A chat process's view of the swarm: follow plans, find a route, generate, fail over.

The client joins the mesh as a non-eligible member, follows the coordinator's signed plans, and
routes over an `active` pipeline whose stages all announce their span loaded. When a stage fails
(timeout, reset, error), it is banned, a new route is taken (a replica, or the re-plan), and the
committed tokens are prefilled again: nothing is lost and greedy output stays identical.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from libp2p.crypto.keys import KeyPair

from beeswarm import codec
from beeswarm.audit import DEFAULT_RATE
from beeswarm.audit.auditor import AuditCounts, Auditor
from beeswarm.client.attempts import Backoff, Busy, Caught, Done, Failed, Outcome, Progress, Request, SwarmGeneration
from beeswarm.client.audits import entry_audits
from beeswarm.client.dataplane import (
    Inbox,
    OutOfStep,
    PipelineOptions,
    RemotePipeline,
    Route,
    SessionSteps,
    StageBusy,
    StageFailed,
    StepTimedOut,
)
from beeswarm.coordinator.follower import PlanFollower
from beeswarm.credits.entry_receipts import ReceiptBook
from beeswarm.generation.generate import EndGeneration, generate
from beeswarm.generation.sampling import SamplingParams
from beeswarm.p2p import identity
from beeswarm.p2p.membership import Membership
from beeswarm.p2p.node import Node, NodeConfig
from beeswarm.p2p.probe import Prober
from beeswarm.protocol.coordinator import Pipeline, Stage
from beeswarm.protocol.credits import swarm_id
from beeswarm.protocol.membership import NodeInfo
from beeswarm.shard.entry_model import EntryModel
from beeswarm.spec.draft import DraftModel
from beeswarm.spec.speculate import speculative_generate
from beeswarm.spec.tuner import MAX_IN_FLIGHT, MAX_TREE_NODES, Tuner

log = logging.getLogger(__name__)
MAX_RECOVERIES = 5  # failures in a row without a new token before a generation gives up
ROUTE_STILL_BEATS = 6  # a route wait gives up once the swarm has been still this many heartbeat intervals,
ROUTE_STILL_S = 15.0  # and this many seconds at least (a loaded machine re-plans and loads slower)
ROUTE_MAX_S = 600.0  # ... or after this long, however it moves
LOOKAHEAD_STEPS = 4  # steps' worth of KV a speculating session reserves past its tokens
UNVERIFIED_S = 600.0  # a stage on probation that nobody could check is routed around this long (or till it passes)


class NoRoute(Exception):
    """No complete, loaded route through the swarm appeared in time, or the swarm cannot be reached."""


def find_route(active: tuple[Pipeline, ...], view: dict[str, NodeInfo],
               usable: Callable[[str], bool]) -> Pipeline | None:
    """The first active pipeline whose every stage is a member serving its span and `usable` (not
    banned, connected). A stage loading its next span (a migration) still serves the old one: its
    `spans` say so."""
    for pipeline in active:
        if all(s.node in view and view[s.node].state != "leaving" and s.span in view[s.node].spans
               and usable(s.node) for s in pipeline.stages):
            return pipeline
    return None


@dataclass
class Drafting:
    """What an entry speculates with: its draft, and the tuner keeping its acceptance figures across generations."""
    draft: DraftModel
    tuner: Tuner


@dataclass(frozen=True)
class ClientOptions:
    mode: str = "push"  # push | hops (back to the entry after every stage, the way Petals routes)
    link_bytes_per_s: float | None = None  # None: the stages' probes of their links to this node
    micro_batches: int | None = None  # chunks a prompt is cut into (None: the plan's figure)
    compress: bool = True  # False: raw frames on every hop (the baseline the benchmarks compare against)
    audit_rate: float = DEFAULT_RATE  # of each stage's steps audited (0: none)
    audit_here: bool = False  # recompute audits on this machine (loading each span audited) instead of peers
    max_in_flight: int = MAX_IN_FLIGHT  # speculative steps in flight at once (the tuner picks up to this; 1: serial)


class SwarmClient:
    """Generation through the swarm. Its parts are injected; `create` builds them; `start()` starts the node."""

    def __init__(self, entry: EntryModel, node: Node, members: Membership, coordinator: PlanFollower,
                 options: ClientOptions | None = None, drafting: Drafting | None = None,
                 payer: KeyPair | None = None, auditor: Auditor | None = None):
        """`coordinator`: the coordinator as this client follows it (its lease and plans); `drafting`: speculate
        with it (None: one token per pass); `payer`: the key whose credit its generations spend (None: its
        node's own); `auditor`: audits the stages' work (None: nobody does; it is started with the client)."""
        self.entry, self.node, self.members, self.coordinator = entry, node, members, coordinator
        self.options = options or ClientOptions()
        self.drafting = drafting
        self.speculate = drafting is not None  # speculate while it has a draft (chat turns it off and on)
        self.inbox = Inbox(node)
        self._draft_busy = threading.Lock()  # one draft, one generation at a time: others run plainly
        self._pipes: dict[Route, RemotePipeline] = {}
        self._using: collections.Counter[Route] = collections.Counter()  # generations on each pipeline now
        self._retired = (0, 0)  # (wire, raw) bytes of pipelines closed since
        self._lock = threading.Lock()
        self.auditor = auditor
        if auditor is not None:
            auditor.listen(self)
        self.caught: dict[str, str] = {}  # stages this entry caught (failed or refused an audit) -> why
        self.unverified: dict[str, float] = {}  # stages on probation nobody could check -> when (monotonic)
        self.receipts = ReceiptBook(node, swarm_id(node.config.swarm, str(entry.ref)), payer)

    @property
    def audits(self) -> AuditCounts:
        return self.auditor.counts if self.auditor else AuditCounts()

    def on_probation(self, stage: Stage) -> bool:
        """Whether the audits of every session through `stage` hold its tokens back until they pass."""
        return self.auditor is not None and self.auditor.on_probation(stage.node, stage.span)

    def _caught_now(self) -> set[str]:
        """The stages whose work earns no receipt: caught, or on probation and checked by nobody."""
        with self._lock:
            return set(self.caught) | set(self.unverified)

    # the auditor's listener --------------------------------------------------------------------------
    def on_caught(self, peer: str, why: str) -> None:
        """A stage failed or refused an audit: ban it, and fail the steps waiting on it now."""
        with self._lock:
            self.caught[peer] = why
        self.node.bans.strike(peer, why, severe=True)
        with self._lock:
            pipes = list(self._pipes.values())
        for pipe in pipes:
            pipe.lose(peer, why)

    def on_unverified(self, peer: str, why: str) -> None:
        """A stage on probation went unchecked: its tokens were taken back; routes avoid it while it is on probation
        (UNVERIFIED_S at most, then it is tried again: an auditor may have come)."""
        with self._lock:
            self.unverified[peer] = time.monotonic()

    def _avoided(self, peer: str) -> bool:
        """Whether routes avoid `peer`: on probation, and lately nobody could check it."""
        with self._lock:
            since = self.unverified.get(peer)
        if since is None:
            return False
        spans = [s.span for p in self.coordinator.state.active for s in p.stages if s.node == peer]
        if time.monotonic() - since < UNVERIFIED_S and any(self.on_probation(Stage(node=peer, span=span))
                                                          for span in spans):
            return True
        with self._lock:
            self.unverified.pop(peer, None)
        return False

    def on_cleared(self, peer: str, why: str) -> None:
        """An auditor's accusation of `peer` was found false: it is not caught, nor banned, here."""
        log.warning("stage %s cleared: %s", peer, why)
        with self._lock:
            self.caught.pop(peer, None)
            pipes = list(self._pipes.values())
        self.node.bans.lift(peer)
        for pipe in pipes:  # its steps failed when it was caught: they may route through it again
            pipe.found(peer)

    @classmethod
    def create(cls, entry: EntryModel, bootstrap: list[str], secret: bytes | None = None, interval: float = 3.0,
               listen: list[str] | None = None, announce: list[str] | None = None,
               options: ClientOptions | None = None, draft: DraftModel | None = None,
               tuner: Tuner | None = None, relays: list[str] | None = None,
               payer: KeyPair | None = None) -> SwarmClient:
        """A client with a fresh identity, joining through `bootstrap` (not started)."""
        me = identity.ephemeral()
        node = Node(me, NodeConfig(listen=listen or ["/ip4/0.0.0.0/tcp/0"], announce=announce or [],
                                   bootstrap=bootstrap, secret=secret, relays=relays or []))
        members = Membership(node, NodeInfo(peer=me.peer_id, role="client", state="serving"), interval=interval)
        coordinator = PlanFollower(node, members, interval=interval)  # a client follows plans, never makes them
        o = options or ClientOptions()
        auditor = entry_audits(node, coordinator, members, entry, o.audit_rate, o.audit_here)
        drafting = Drafting(draft, tuner or Tuner()) if draft is not None else None
        return cls(entry, node, members, coordinator, o, drafting, payer, auditor)

    def start(self) -> SwarmClient:
        self.members.listeners.append(self._on_member)
        self.coordinator.listeners.append(lambda _: self._route_around_silent_stages())
        self.inbox.start()
        if self.auditor is not None:
            self.auditor.start()
        Prober(self.node).start()  # stages measure their links to this entry (the codec sizes frames by them)
        self.members.start()
        self.coordinator.start()
        self.node.start()
        threading.Thread(target=codec.warm_up, daemon=True, name="codec-warm-up").start()
        return self

    def _on_member(self, event: str, info: NodeInfo) -> None:
        if event == "join":
            with self._lock:
                pipes = list(self._pipes.values())
            for pipe in pipes:
                pipe.found(info.peer)
        if event != "leave" or info.state != "leaving":  # one leaving gracefully finishes its steps first
            self._route_around_silent_stages()  # a stage gone silent, or a spare now serving what it held

    def _route_around_silent_stages(self) -> None:
        """Steps waiting on a stage that stopped beating (frozen, its host asleep, its link gone without a
        reset) fail now, instead of after the step timeout, once another route exists: until then a short
        freeze is better waited out than routed around. Checked again as members change (a spare announcing
        the span it loaded) and as plans come."""
        view = self.members.view()
        with self._lock:
            silent = [(pipe, s.node) for pipe in self._pipes.values() for s in pipe.route if s.node not in view]
        if not silent or self.find_route() is None:
            return
        for pipe, peer in silent:
            pipe.lose(peer, "stopped beating (gone from the swarm's view)")

    @property
    def traffic(self) -> tuple[int, int]:
        """(wire, raw) hidden-state bytes this client sent and received, over every route it took."""
        with self._lock:
            pipes, (wire, raw) = list(self._pipes.values()), self._retired
        return wire + sum(p.wire_bytes for p in pipes), raw + sum(p.raw_bytes for p in pipes)

    def close(self) -> None:
        with self._lock:
            pipes, self._pipes = list(self._pipes.values()), {}
        for pipe in pipes:
            pipe.close()
        if self.auditor is not None:
            self.auditor.close()
        self.receipts.drain()
        self.node.stop()

    def route(self, timeout: float = 0.0) -> Pipeline:
        """A loaded, unbanned route covering every layer, from the plan's active pipelines. Waits for one at least
        `timeout` s, and past that for as long as the swarm moves towards one (ROUTE_MAX_S at most): the lease,
        the plan, the members or their spans changed, or a member is loading layers, within the last
        ROUTE_STILL_BEATS heartbeat intervals (ROUTE_STILL_S at least: a stage that dies is noticed, planned
        around and its layers loaded elsewhere in that; a coordinator that dies is succeeded). Fails at once when
        no bootstrap address can be dialled."""
        start = last_move = time.monotonic()
        still_s, seen = max(ROUTE_STILL_S, ROUTE_STILL_BEATS * self.members.interval), self._motion()
        while True:
            found = self.find_route()
            if found is not None:
                return found
            why = self.node.unreachable()
            if why is not None:
                raise NoRoute(f"cannot reach the swarm: {why}")
            now, motion = time.monotonic(), self._motion()
            if motion != seen or any(state == "loading" for _, state, _, _ in motion[3]):
                seen, last_move = motion, now
            if now - start >= max(timeout, min(ROUTE_MAX_S, last_move - start + still_s)):
                break
            time.sleep(0.1)
        with self._lock:
            unverified = sorted(self.unverified)
        why = f"; routes avoid {', '.join(unverified)}: on probation, and no member could check its layers " \
            "(its tokens are not shown unchecked)" if unverified else ""
        raise NoRoute(f"no complete route through the swarm after {time.monotonic() - start:.0f} s, the last "
                      f"{min(still_s, time.monotonic() - last_move):.0f} s of them with no change in the swarm "
                      f"(members: {len(self.members.view())}, plan epoch {self.coordinator.state.epoch}){why}")

    def _motion(self) -> tuple:
        """What changes while a swarm recovers: the lease, the plan, who is a member and what each serves."""
        lease = self.coordinator.lease
        return (lease.term if lease else None, lease.leader if lease else None, self.coordinator.state.epoch,
                frozenset((p, i.state, i.layers, i.spans) for p, i in self.members.view().items()))

    def find_route(self) -> Pipeline | None:
        """A usable route now, or None (`route` waits for one)."""
        connected = set(self.node.connected_peers())  # a stage whose connection dropped is not routed into
        return find_route(self.coordinator.state.active, self.members.view(),
                          lambda peer: peer in connected and not self.node.bans.is_banned(peer)
                          and not self._avoided(peer))

    def _pipeline(self, route: Route) -> RemotePipeline:
        """The pipeline over `route`; pipelines over routes the active plan no longer has (or in another mode than
        the options now say) are closed."""
        o = self.options
        live = {p.stages for p in self.coordinator.state.active} | {route}
        with self._lock:  # (a pipeline another generation is on stays: closing it would fail its steps)
            stale = [r for r, p in self._pipes.items()
                     if (r not in live or p.options.mode != o.mode) and not self._using[r]]
            retired = [self._pipes.pop(r) for r in stale]
            self._retired = (self._retired[0] + sum(p.wire_bytes for p in retired),
                             self._retired[1] + sum(p.raw_bytes for p in retired))
            if route not in self._pipes:
                self._pipes[route] = RemotePipeline(
                    self.node, self.inbox, self.entry, route,
                    PipelineOptions(o.mode, o.link_bytes_per_s, compress=o.compress), self.auditor, self.receipts)
            pipe = self._pipes[route]
        for old in retired:
            old.close()
        if o.link_bytes_per_s is None:  # the stages' probes of their links from this node
            view = self.members.view()
            for stage in route:
                measured = view[stage.node].links.get(self.node.peer_id) if stage.node in view else None
                if measured and measured[2] > 0:
                    pipe.links[stage.node].link_bytes_per_s = measured[2] * 1e6 / 8
        return pipe

    def generate(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                 stop_ids=(), on_token: Callable[[int], None] | None = None,
                 route_timeout: float = 60.0, on_rewind: Callable[[int], None] | None = None,
                 on_settled: Callable[[int], None] | None = None) -> SwarmGeneration:
        """Generate through the swarm, re-routing on failures. Speculates when a draft is set and free
        (one generation at a time uses the draft; concurrent ones decode a token per pass). A route is waited for
        at least `route_timeout`, and longer while the swarm moves towards one (`route`). A stage with no room
        for the session (StageBusy) is waited for, up to `route_timeout` after the last progress, not banned.
        `on_token` may raise EndGeneration to end it there; any other exception ends it too (its sessions closed)
        and propagates.

        Before it returns, the generation waits for its audits. A stage caught by one computed some of the
        tokens: they are taken back (`on_rewind(n)`: only the first n tokens stand) and generated again on a
        route without it, so what is returned never rests on a stage caught lying. `on_settled(n)`: the first n
        tokens are final. Tokens computed through a stage on probation are final only once the audit of its
        whole session passed (at the end of the attempt); others at once (a per-step audit may still catch a
        stage later, rarely). A caller that shows text to someone who cannot unsee it shows only those."""
        speculate = self.speculate and self.drafting is not None and self._draft_busy.acquire(blocking=False)
        request = Request(prompt_ids, max_new_tokens, params, stop_ids, speculate, route_timeout, on_token, on_rewind,
                          on_settled)
        try:
            progress = Progress.start(request)
            try:
                result = self._generate(progress)
            except BaseException:
                if self.auditor:
                    # forget them: nobody waits for their verdicts
                    self.auditor.settle(progress.sessions, timeout=0, probation_timeout=0)
                else:  # unaudited, as every generation here: what the stages served is receipted all the same
                    self.receipts.settle(progress.sessions, self._caught_now())
                raise
            self.receipts.settle(progress.sessions, self._caught_now())  # audits settled: to those none caught
            return result
        finally:
            if speculate:
                self._draft_busy.release()

    def _generate(self, progress: Progress) -> SwarmGeneration:
        """One attempt after another, each on the route there is then, until one ends the generation with its
        audits passed. What follows an attempt is decided by its outcome: a full stage is waited for (backing
        off), a failed one banned and the committed tokens prefilled on the next route, a caught one's tokens
        taken back first; past MAX_RECOVERIES the failure is raised."""
        busy = Backoff(progress.request.route_timeout)
        while True:
            pipeline = self.route(progress.request.route_timeout)
            progress.take(pipeline.stages)
            progress.held |= any(self.on_probation(s) for s in pipeline.stages)
            with self._lock:
                self._using[pipeline.stages] += 1
            try:
                pipe = self._pipeline(pipeline.stages)
                wire0, raw0, tokens0 = pipe.wire_bytes, pipe.raw_bytes, len(progress.tokens)
                outcome = self._attempt(progress, pipe, pipeline.micro_batches, busy)
            finally:
                with self._lock:
                    self._using[pipeline.stages] -= 1
            if len(progress.tokens) > tokens0:
                busy = Backoff(progress.request.route_timeout)  # a full swarm is waited for anew after progress
            match outcome:
                case Busy(error):
                    busy.wait(error)
                case Failed(error):
                    self._fail_over(progress, error)
                    if progress.finished():  # it failed after the last token: the audits settle all the same
                        outcome = self._settled(progress)
            # this generation's bytes (a concurrent one on the same route adds its own)
            progress.wire, progress.raw = progress.wire + pipe.wire_bytes - wire0, progress.raw + pipe.raw_bytes - raw0
            if isinstance(outcome, Caught):
                progress.rewind(outcome.keep, outcome.stages)
                progress.recoveries += 1
                progress.stalls += 1
                if progress.stalls > MAX_RECOVERIES:  # given up as that stage's failure (logged, struck)
                    self._fail_over(progress, StageFailed(next(iter(outcome.stages)),
                                                          "caught by an audit, and no honest route left"))
            if isinstance(outcome, Done) or isinstance(outcome, Caught) and progress.finished():
                progress.settle()
                return progress.result()

    def _attempt(self, progress: Progress, pipe: RemotePipeline, micro_batches: int, busy: Backoff) -> Outcome:
        """One attempt on one route: a session on `pipe` (a full stage after the first is waited for with `busy`,
        holding the sessions opened before it), the prompt and the tokens that stand prefilled,
        tokens until the request is met (or the caller ends it), the session closed, then the audits of every
        session so far awaited. The route failing is an outcome; any other exception propagates."""
        in_flight, max_length, least = self._session_size(progress.request)
        try:
            session, max_length = pipe.open_within(max_length, least, busy.wait)
            progress.sessions.append(session)
            self.receipts.begin(session, len(progress.request.prompt_ids) + len(progress.tokens))
            failed = None
            try:
                self._decode(progress, pipe, session, self.options.micro_batches or micro_batches, in_flight,
                             max_length)
            except EndGeneration:
                pass  # the caller has what it wants: a normal end
            except StageFailed as e:
                failed = e.peer
                if self.auditor:  # (before closing draws the session's audits) a crash is no refusal to reveal
                    self.auditor.gone(session, e.peer)
                raise
            finally:
                pipe.close_session(session, failed=failed)
        except StageBusy as e:  # a full stage is not a broken one
            return Busy(e)
        except StageFailed as e:
            return Failed(e)
        return self._settled(progress)

    def _settled(self, progress: Progress) -> Done | Caught:
        """Wait for the audits of every session so far: Caught when one caught a stage."""
        caught = self.auditor.settle(progress.sessions) if self.auditor else set()
        return Caught(caught, progress.trusted(caught)) if caught else Done()

    def _session_size(self, request: Request) -> tuple[int, int, int]:
        """(speculative steps in flight at most, the session's length, the least it takes): the tokens asked for
        and, speculating, KV room for the nodes in flight and not judged yet (each step's keep drops the dead ones);
        at the least one step's tree (a full stage admits a speculative session with smaller trees)."""
        in_flight = self.options.max_in_flight if self.options.mode == "push" else 1
        tokens = len(request.prompt_ids) + request.max_new_tokens
        lookahead = min(in_flight, LOOKAHEAD_STEPS) * (MAX_TREE_NODES + 1) if request.speculate else 0
        least = MAX_TREE_NODES + 1 if request.speculate else 0
        limit = self.entry.config.max_position_embeddings
        return in_flight, min(limit, tokens + lookahead), min(limit, tokens + least)

    def _decode(self, progress: Progress, pipe: RemotePipeline, session: str, m: int, in_flight: int,
                max_length: int) -> None:
        """Generate on `session` after the prompt and the tokens that stand, the tokens still wanted."""
        request = progress.request
        context, left = request.prompt_ids + progress.tokens, request.max_new_tokens - len(progress.tokens)
        if not request.speculate:
            generate(lambda t, s: pipe.forward(session, t, s, micro_batches=m), context, left, request.params,
                     request.stop_ids, progress.emit, progress.noise)
            return
        assert self.drafting is not None, "`generate` speculates only when a draft is set"
        target = SessionSteps(pipe, session) if in_flight > 1 else \
            lambda t, s, mask, keep: pipe.forward(session, t, s, mask, m, keep)
        speculative_generate(target, self.drafting.draft, context, left, request.params, self.drafting.tuner,
                             request.stop_ids, progress.emit, progress.noise, progress.report, max_length, in_flight,
                             lambda ids: pipe.forward(session, ids, 0, micro_batches=m))

    def _fail_over(self, progress: Progress, e: StageFailed) -> None:
        """A stage failed: the tokens it computed are taken back if an audit caught it, it is banned, and the
        next attempt prefills the committed tokens on another route; past MAX_RECOVERIES, `e` is raised."""
        progress.recoveries += 1
        progress.stalls += 1
        if e.peer in self.caught:
            progress.rewind(progress.trusted({e.peer}), {e.peer})
        log.warning("stage failed (%s); re-routing and prefilling %d committed tokens again",
                    e, len(progress.request.prompt_ids) + len(progress.tokens))
        culprit = self._culprit(e, progress.routes[-1])
        if culprit is not None:
            self.node.bans.strike(culprit, str(e), severe=True)
        if progress.stalls > MAX_RECOVERIES:
            raise e

    def _culprit(self, e: StageFailed, route: Route) -> str | None:
        """The stage of `route` to ban for `e`: the one it names, except where the entry cannot tell who failed. A
        cache out of step is nobody's fault it can prove; a step that timed out in a push chain was held up by one
        of the route's stages: the one gone from the swarm's view if there is one, else nobody (an innocent first
        stage banned would wait out its ban like a dead one)."""
        if isinstance(e, OutOfStep):
            return None
        if isinstance(e, StepTimedOut) and self.options.mode == "push":
            view = self.members.view()
            return next((s.node for s in route if s.node not in view), None)
        return e.peer
