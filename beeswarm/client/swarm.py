"""A chat process's view of the swarm: follow plans, find a route, generate, fail over.

The client joins the mesh as a non-eligible member, follows the coordinator's signed plans, and
routes over an `active` pipeline whose stages all announce their span loaded. When a stage fails
(timeout, reset, error), it is banned, a new route is taken (a replica, or the re-plan), and the
committed tokens are prefilled again: nothing is lost and greedy output stays identical.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from beeswarm import codec
from beeswarm.audit import DEFAULT_RATE
from beeswarm.audit.auditor import AuditCounts, Auditor
from beeswarm.client.remote import Inbox, RemotePipeline, Route, SessionSteps, StageBusy, StageFailed
from beeswarm.coordinator.cluster import ModelShape
from beeswarm.coordinator.service import CoordinatorService
from beeswarm.decoding.generate import EndGeneration, Generation, generate, new_generator
from beeswarm.decoding.sampling import SamplingParams
from beeswarm.p2p import identity
from beeswarm.p2p.membership import Membership
from beeswarm.p2p.node import Node, NodeConfig
from beeswarm.p2p.probe import Prober
from beeswarm.protocol.coordinator import Pipeline
from beeswarm.protocol.membership import NodeInfo
from beeswarm.protocol.spans import Span
from beeswarm.shard.entry import EntryModel
from beeswarm.shard.span import SpanRuntime
from beeswarm.spec.decode import SpecReport, speculative_generate
from beeswarm.spec.draft import DraftModel
from beeswarm.spec.tuner import MAX_IN_FLIGHT, MAX_TREE_NODES, Tuner

log = logging.getLogger(__name__)
MAX_RECOVERIES = 5
LOOKAHEAD_STEPS = 4  # steps' worth of KV a speculating session reserves past its tokens
BUSY_BACKOFF_S = (0.1, 2.0)  # first wait and cap while every route's stages are full


class NoRoute(Exception):
    """No complete, loaded route through the swarm appeared in time, or the swarm cannot be reached."""


@dataclass
class SwarmGeneration:
    generation: Generation
    route: Route
    recoveries: int
    wire_bytes: int  # this generation's, on every route it took
    raw_bytes: int
    routes: list[Route] = field(default_factory=list)
    spec: SpecReport | None = None


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


@dataclass(frozen=True)
class ClientOptions:
    mode: str = "push"  # push | hops (back to the entry after every stage, the way Petals routes)
    link_bytes_per_s: float | None = None  # None: the stages' probes of their links to this node
    micro_batches: int | None = None  # chunks a prompt is cut into (None: the plan's figure)
    compress: bool = True  # False: raw frames on every hop (the baseline the benchmarks compare against)
    audit_rate: float = DEFAULT_RATE  # of each stage's steps audited (0: none)
    max_in_flight: int = MAX_IN_FLIGHT  # speculative steps in flight at once (the tuner picks up to this; 1: serial)


class SwarmClient:
    """Generation through the swarm. Its parts are injected; `create` builds them; `start()` starts the node."""

    def __init__(self, entry: EntryModel, node: Node, members: Membership, coordinator: CoordinatorService,
                 options: ClientOptions | None = None, draft: DraftModel | None = None, tuner: Tuner | None = None):
        """`draft`: speculate with it (None: one token per pass); `tuner` keeps its acceptance figures
        across generations."""
        self.entry, self.node, self.members, self.coordinator = entry, node, members, coordinator
        self.options = options or ClientOptions()
        self.draft, self.tuner = draft, tuner or Tuner()
        self.speculate = draft is not None
        self.inbox = Inbox(node)
        self._draft_busy = threading.Lock()  # one draft, one generation at a time: others run plainly
        self._pipes: dict[Route, RemotePipeline] = {}
        self._retired = (0, 0)  # (wire, raw) bytes of pipelines closed since
        self._lock = threading.Lock()
        self._audit_runtimes: dict[tuple[Span, str], SpanRuntime] = {}
        self._audit_lock = threading.Lock()
        self.auditor = Auditor(node, self._audit_runtime, self.options.audit_rate, self._caught,
                               coordinator.leader) \
            if self.options.audit_rate > 0 else None
        self.caught: dict[str, str] = {}  # stages this entry caught (failed or refused an audit) -> why

    @property
    def audits(self) -> AuditCounts:
        return self.auditor.counts if self.auditor else AuditCounts()

    def _audit_runtime(self, span: Span) -> SpanRuntime:
        """The layers of `span`, loaded once, to recompute audited steps with (the entry's dtype and device, the
        weights' format of the plan: the swarm's)."""
        weights = self.coordinator.state.quant
        with self._audit_lock:
            if (span, weights) not in self._audit_runtimes:
                log.info("loading layers %s (%s weights) to audit with", span, weights)
                self._audit_runtimes[span, weights] = SpanRuntime.load(self.entry.ref, span, self.entry.dtype,
                                                                      self.entry.device, quant=weights)
            return self._audit_runtimes[span, weights]

    def _caught(self, peer: str, why: str) -> None:
        """A stage failed or refused an audit: ban it, and fail the steps waiting on it now."""
        self.caught[peer] = why
        self.node.bans.strike(peer, why, severe=True)
        with self._lock:
            pipes = list(self._pipes.values())
        for pipe in pipes:
            pipe.lose(peer, why)

    @classmethod
    def create(cls, entry: EntryModel, bootstrap: list[str], secret: bytes | None = None, interval: float = 3.0,
               listen: list[str] | None = None, announce: list[str] | None = None,
               options: ClientOptions | None = None, draft: DraftModel | None = None,
               tuner: Tuner | None = None) -> SwarmClient:
        """A client with a fresh identity, joining through `bootstrap` (not started)."""
        me = identity.ephemeral()
        node = Node(me, NodeConfig(listen=listen or ["/ip4/0.0.0.0/tcp/0"], announce=announce or [],
                                   bootstrap=bootstrap, secret=secret))
        members = Membership(node, NodeInfo(peer=me.peer_id, role="client", state="serving"), interval=interval)
        config = entry.config
        shape = ModelShape(config.num_hidden_layers, config.hidden_size, 0, 0)  # a client never plans
        coordinator = CoordinatorService(node, members, shape, interval=interval, eligible=False)
        return cls(entry, node, members, coordinator, options, draft, tuner)

    def start(self) -> SwarmClient:
        self.members.listeners.append(self._on_member)
        self.coordinator.listeners.append(lambda _: self._route_around_silent_stages())
        self.inbox.start()
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
        elif event == "leave" and info.state != "leaving":  # one leaving gracefully finishes its steps first
            self._route_around_silent_stages()

    def _route_around_silent_stages(self) -> None:
        """Steps waiting on a stage that stopped beating (frozen, its host asleep, its link gone without a
        reset) fail now, instead of after the 30 s step timeout, once another route exists: until then a
        short freeze is better waited out than routed around (a spare must load the span first)."""
        if self.find_route() is None:
            return
        view = self.members.view()
        with self._lock:
            pipes = list(self._pipes.values())
        for pipe in pipes:
            for stage in pipe.route:
                if stage.node not in view:
                    pipe.lose(stage.node, "stopped beating (gone from the swarm's view)")

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
        self.node.stop()

    def route(self, timeout: float = 60.0) -> Pipeline:
        """A loaded, unbanned route covering every layer, from the plan's active pipelines. Waits up to
        `timeout` for one, but fails at once when no bootstrap address can be dialled (naming each)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.find_route()
            if found is not None:
                return found
            why = self.node.unreachable()
            if why is not None:
                raise NoRoute(f"cannot reach the swarm: {why}")
            time.sleep(0.1)
        raise NoRoute(f"no complete route through the swarm within {timeout:.0f} s "
                      f"(members: {len(self.members.view())}, plan epoch {self.coordinator.state.epoch})")

    def find_route(self) -> Pipeline | None:
        """A usable route now, or None (`route` waits for one)."""
        connected = set(self.node.connected_peers())  # a stage whose connection dropped is not routed into
        return find_route(self.coordinator.state.active, self.members.view(),
                          lambda peer: peer in connected and not self.node.bans.is_banned(peer))

    def _pipeline(self, route: Route) -> RemotePipeline:
        """The pipeline over `route`; pipelines over routes the active plan no longer has are closed."""
        o = self.options
        live = {p.stages for p in self.coordinator.state.active} | {route}
        with self._lock:
            stale = [r for r in self._pipes if r not in live]
            retired = [self._pipes.pop(r) for r in stale]
            self._retired = (self._retired[0] + sum(p.wire_bytes for p in retired),
                             self._retired[1] + sum(p.raw_bytes for p in retired))
            if route not in self._pipes:
                self._pipes[route] = RemotePipeline(self.node, self.inbox, self.entry, route, o.mode,
                                                    o.link_bytes_per_s, compress=o.compress, auditor=self.auditor)
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
                 route_timeout: float = 60.0, on_rewind: Callable[[int], None] | None = None) -> SwarmGeneration:
        """Generate through the swarm, re-routing on failures. Speculates when a draft is set and free
        (one generation at a time uses the draft; concurrent ones decode a token per pass). A stage with no
        room for the session (StageBusy) is waited for, up to `route_timeout`, not banned. `on_token` may
        raise EndGeneration to end it there; any other exception ends it too (its sessions closed) and
        propagates.

        Before it returns, the generation waits for its audits. A stage caught by one computed some of the
        tokens: they are taken back (`on_rewind(n)`: only the first n tokens stand) and generated again on a
        route without it, so what is returned never rests on a stage caught lying."""
        speculate = self.speculate and self.draft is not None and self._draft_busy.acquire(blocking=False)
        sessions: list[str] = []
        try:
            return self._generate(prompt_ids, max_new_tokens, params, stop_ids, on_token, route_timeout, speculate,
                                  on_rewind, sessions)
        except BaseException:
            if self.auditor:
                self.auditor.settle(sessions, timeout=0)  # forget them: nobody waits for their verdicts
            raise
        finally:
            if speculate:
                self._draft_busy.release()

    def _generate(self, prompt_ids, max_new_tokens, params, stop_ids, on_token, route_timeout,
                  speculate: bool, on_rewind, sessions: list[str]) -> SwarmGeneration:
        generator = new_generator(params)
        tokens: list[int] = []
        routes: list[Route] = []
        starts: list[int] = []  # tokens there were when each route was taken
        wire = raw = 0
        t0, ttft, recoveries = time.perf_counter(), None, 0
        last = t0  # the time of the last token: closing the sessions after it is not generation time

        def emit(token: int) -> None:
            nonlocal ttft, last
            last = time.perf_counter()
            if ttft is None:
                ttft = last - t0
            tokens.append(token)
            if on_token:
                on_token(token)

        def rewind(caught: set[str]) -> None:
            """Take back every token from the first route through a caught stage on."""
            nonlocal generator
            keep = next((n for r, n in zip(routes, starts) if any(s.node in caught for s in r)), len(tokens))
            if keep < len(tokens):
                log.warning("taking back %d tokens computed through %s", len(tokens) - keep, ", ".join(caught))
                del tokens[keep:]
                if keep == 0:
                    generator = new_generator(params)
                if on_rewind:
                    on_rewind(keep)

        report = SpecReport() if speculate else None
        limit = self.entry.config.max_position_embeddings
        busy_until, busy_wait = None, BUSY_BACKOFF_S[0]
        while True:
            pipeline = self.route(route_timeout)
            route = pipeline.stages
            routes.append(route)
            starts.append(len(tokens))
            pipe = self._pipeline(route)
            wire0, raw0 = pipe.wire_bytes, pipe.raw_bytes
            try:
                in_flight = self.options.max_in_flight if self.options.mode == "push" else 1
                # KV room for the nodes in flight and not judged yet (each step's keep drops the dead ones)
                lookahead = min(in_flight, LOOKAHEAD_STEPS) * (MAX_TREE_NODES + 1) if speculate else 0
                max_length = min(limit, len(prompt_ids) + max_new_tokens + lookahead)
                session = pipe.open(max_length)
                sessions.append(session)
                try:
                    m = self.options.micro_batches or pipeline.micro_batches
                    context, left = prompt_ids + tokens, max_new_tokens - len(tokens)
                    if speculate:
                        assert self.draft is not None, "`generate` speculates only when a draft is set"
                        target = SessionSteps(pipe, session) if in_flight > 1 else \
                            lambda t, s, mask, keep: pipe.forward(session, t, s, mask, m, keep)
                        speculative_generate(target, self.draft, context, left, params, self.tuner, stop_ids, emit,
                                             generator, report, max_length, in_flight,
                                             lambda ids: pipe.forward(session, ids, 0, micro_batches=m))
                    else:
                        generate(lambda t, s: pipe.forward(session, t, s, micro_batches=m), context, left, params,
                                 stop_ids, emit, generator)
                except EndGeneration:
                    pass  # the caller has what it wants: a normal end
                finally:
                    pipe.close_session(session)
                caught = self.auditor.settle(sessions) if self.auditor else set()
                if not caught:
                    break
                rewind(caught)
                recoveries += 1
                if recoveries > MAX_RECOVERIES:
                    raise StageFailed(next(iter(caught)), "caught by an audit, and no honest route left")
            except StageBusy as e:  # a full stage is not a broken one: wait for room, up to route_timeout
                busy_until = busy_until or time.monotonic() + route_timeout
                if time.monotonic() + busy_wait > busy_until:
                    raise
                log.info("%s; trying again in %.1f s", e, busy_wait)
                time.sleep(busy_wait)
                busy_wait = min(2 * busy_wait, BUSY_BACKOFF_S[1])
            except StageFailed as e:
                recoveries += 1
                if e.peer in self.caught:
                    rewind({e.peer})
                log.warning("stage failed (%s); re-routing and prefilling %d committed tokens again",
                            e, len(prompt_ids) + len(tokens))
                self.node.bans.strike(e.peer, str(e), severe=True)
                if recoveries > MAX_RECOVERIES:
                    raise
            finally:  # this generation's bytes (a concurrent one on the same route adds its own)
                wire, raw = wire + pipe.wire_bytes - wire0, raw + pipe.raw_bytes - raw0
            if tokens and tokens[-1] in set(stop_ids) or len(tokens) >= max_new_tokens:
                break
        gen = Generation(tokens, len(prompt_ids), ttft or 0.0, last - t0)
        return SwarmGeneration(gen, routes[-1], recoveries, wire, raw, routes, report)
