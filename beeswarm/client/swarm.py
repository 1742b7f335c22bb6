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
from beeswarm.client.generate import Generation, generate, new_generator
from beeswarm.client.remote import Hop, RemotePipeline, StageFailed
from beeswarm.client.sampling import SamplingParams
from beeswarm.coordinator.cluster import ModelShape
from beeswarm.coordinator.service import CoordinatorService
from beeswarm.p2p import identity
from beeswarm.p2p.membership import Membership, NodeInfo
from beeswarm.p2p.node import Node, NodeConfig
from beeswarm.shard.entry import EntryModel
from beeswarm.spec.decode import SpecReport, speculative_generate
from beeswarm.spec.draft import DraftModel
from beeswarm.spec.tuner import MAX_TREE_NODES, Tuner

log = logging.getLogger(__name__)
MAX_RECOVERIES = 5


class NoRoute(Exception):
    """No complete, loaded route through the swarm appeared in time."""


@dataclass
class SwarmGeneration:
    generation: Generation
    route: list[Hop]
    recoveries: int
    wire_bytes: int
    raw_bytes: int
    routes: list[list[Hop]] = field(default_factory=list)
    spec: SpecReport | None = None


def find_route(active: list[dict], view: dict[str, NodeInfo], banned: Callable[[str], bool]) -> list[Hop] | None:
    """The first active pipeline whose every stage is a member serving its span and not banned.

    A stage loading its next span (a migration) still serves the old one: its `spans` say so."""
    for pipeline in active:
        hops = [Hop(s["node"], s["start"], s["end"]) for s in pipeline["stages"]]
        if all(h.peer in view and view[h.peer].state != "leaving" and (h.start, h.end) in view[h.peer].spans
               and not banned(h.peer) for h in hops):
            return hops
    return None


class SwarmClient:
    def __init__(self, entry: EntryModel, bootstrap: list[str], secret: bytes | None = None,
                 interval: float = 3.0, mode: str = "push", listen: list[str] | None = None,
                 link_bytes_per_s: float | None = None, micro_batches: int | None = None,
                 draft: DraftModel | None = None, tuner: Tuner | None = None, announce: list[str] | None = None,
                 compress: bool = True):
        """`micro_batches`: chunks a prompt is cut into (None: the plan's figure). `draft`: speculate
        with it (None: one token per pass); `tuner` keeps its acceptance figures across generations.
        `compress=False`: raw frames on every hop (the baseline the benchmarks compare against)."""
        self.entry, self.mode, self.link_bytes_per_s = entry, mode, link_bytes_per_s
        self.micro_batches, self.compress = micro_batches, compress
        self.draft, self.tuner = draft, tuner or Tuner()
        self.speculate = draft is not None
        self._draft_busy = threading.Lock()  # one draft, one generation at a time: others run plainly
        me = identity.ephemeral()
        self.node = Node(me, NodeConfig(listen=listen or ["/ip4/0.0.0.0/tcp/0"], announce=announce or [],
                                        bootstrap=bootstrap, secret=secret))
        self.members = Membership(self.node, NodeInfo(peer=me.peer_id, role="client", state="serving"),
                                  interval=interval)
        config = entry.config
        shape = ModelShape(config.num_hidden_layers, config.hidden_size, 0, 0)  # a client never plans
        self.coordinator = CoordinatorService(self.node, self.members, shape, interval=interval, eligible=False)
        self.members.start()
        self.coordinator.start()
        self.node.start()
        self._pipes: dict[tuple[Hop, ...], RemotePipeline] = {}
        threading.Thread(target=codec.warm_up, daemon=True, name="codec-warm-up").start()

    def close(self) -> None:
        self.node.stop()

    def route(self, timeout: float = 60.0) -> list[Hop]:
        """A loaded, unbanned route covering every layer, from the plan's active pipelines."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self._find_route()
            if found:
                return found
            time.sleep(0.1)
        raise NoRoute(f"no complete route through the swarm within {timeout:.0f} s "
                      f"(members: {len(self.members.view())}, plan epoch {self.coordinator.state.epoch})")

    def _find_route(self) -> list[Hop] | None:
        return find_route(self.coordinator.state.active, self.members.view(), self.node.bans.is_banned)

    def _planned_micro_batches(self, route: list[Hop]) -> int:
        for pipeline in self.coordinator.state.active:
            if [(s["node"], s["start"], s["end"]) for s in pipeline["stages"]] == [(h.peer, h.start, h.end)
                                                                                  for h in route]:
                return int(pipeline.get("micro_batches", 1))
        return 1

    def _pipeline(self, route: list[Hop]) -> RemotePipeline:
        key = (tuple(route), self.mode, self.compress)
        if key not in self._pipes:
            self._pipes[key] = RemotePipeline(self.node, self.entry, route, self.mode, self.link_bytes_per_s,
                                              compress=self.compress)
        pipe = self._pipes[key]
        if self.link_bytes_per_s is None:  # the stages' probes of their links from this node
            view = self.members.view()
            for hop in route:
                measured = view[hop.peer].links.get(self.node.peer_id) if hop.peer in view else None
                if measured and measured[2] > 0:
                    pipe.links[hop.peer].link_bytes_per_s = measured[2] * 1e6 / 8
        return pipe

    def generate(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams,
                 stop_ids=(), on_token: Callable[[int], None] | None = None,
                 route_timeout: float = 60.0) -> SwarmGeneration:
        """Generate through the swarm, re-routing on failures. Speculates when a draft is set and free
        (one generation at a time uses the draft; concurrent ones decode a token per pass)."""
        speculate = self.speculate and self.draft is not None and self._draft_busy.acquire(blocking=False)
        try:
            return self._generate(prompt_ids, max_new_tokens, params, stop_ids, on_token, route_timeout, speculate)
        finally:
            if speculate:
                self._draft_busy.release()

    def _generate(self, prompt_ids, max_new_tokens, params, stop_ids, on_token, route_timeout,
                  speculate: bool) -> SwarmGeneration:
        generator = new_generator(params)
        tokens: list[int] = []
        routes: list[list[Hop]] = []
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

        report = SpecReport() if speculate else None
        limit = self.entry.config.max_position_embeddings
        while True:
            route = self.route(route_timeout)
            routes.append(route)
            pipe = self._pipeline(route)
            try:
                max_length = min(limit, len(prompt_ids) + max_new_tokens + (MAX_TREE_NODES + 1 if speculate else 0))
                session = pipe.open(max_length)
                try:
                    m = self.micro_batches or self._planned_micro_batches(route)
                    context, left = prompt_ids + tokens, max_new_tokens - len(tokens)
                    if speculate:
                        speculative_generate(
                            lambda t, s, mask, keep: pipe.forward(session, t, s, mask, m, keep), self.draft,
                            context, left, params, self.tuner, stop_ids, emit, generator, report, max_length)
                    else:
                        generate(lambda t, s: pipe.forward(session, t, s, micro_batches=m), context, left, params,
                                 stop_ids, emit, generator)
                finally:
                    pipe.close(session)
                break
            except StageFailed as e:
                recoveries += 1
                log.warning("stage failed (%s); re-routing and prefilling %d committed tokens again",
                            e, len(prompt_ids) + len(tokens))
                self.node.bans.strike(e.peer, str(e), severe=True)
                if recoveries > MAX_RECOVERIES:
                    raise
            if tokens and tokens[-1] in set(stop_ids) or len(tokens) >= max_new_tokens:
                break
        gen = Generation(tokens, len(prompt_ids), ttft or 0.0, last - t0)
        return SwarmGeneration(gen, routes[-1], recoveries, sum(p.wire_bytes for p in self._pipes.values()),
                               sum(p.raw_bytes for p in self._pipes.values()), routes, report)
