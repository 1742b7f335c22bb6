"""`beeswarm contribute`: join a swarm, benchmark, take part in the election, load and serve a span.

Composition only: p2p (node, membership, probes), coordinator (election, plans), shard (benchmark,
span runtime) and the stage server. The span comes from the coordinator's plan: when the plan's
target gives this node a new span, it is loaded in the background while the old one keeps serving
(make-before-break), then announced in the heartbeat so the coordinator can make it active.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from beeswarm.contributor.stage import StageServer
from beeswarm.coordinator.cluster import ModelShape, Workload
from beeswarm.coordinator.service import CoordinatorService, PlanState
from beeswarm.p2p.identity import Identity
from beeswarm.p2p.membership import Membership, NodeInfo
from beeswarm.p2p.node import Node, NodeConfig
from beeswarm.p2p.probe import Prober
from beeswarm.shard import benchmark
from beeswarm.shard.span import Span, SpanRuntime

log = logging.getLogger(__name__)
LEAVE_GRACE_S = 5.0


@dataclass
class ContributorOptions:
    model: str = "tinycode"
    join: list[str] = field(default_factory=list)
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce: list[str] = field(default_factory=list)
    relays: list[str] = field(default_factory=list)
    device: str = "auto"
    dtype: str = "auto"
    max_memory: int | None = None
    secret: bytes | None = None
    interval: float = 3.0
    context_tokens: int = 2048


class Contributor:
    def __init__(self, identity: Identity, options: ContributorOptions, say: Callable[[str], None] = print):
        self.identity, self.options, self.say = identity, options, say
        self.stopping = threading.Event()
        self.server: StageServer | None = None
        self.span: tuple[int, int] | None = None
        self._loading: tuple[int, int] | None = None
        self._lock = threading.Lock()

    def run(self) -> None:
        """Serve until `stop()` (or a signal handler calling it); then leave gracefully."""
        o = self.options
        figures = benchmark.run(o.model, o.device, o.dtype, progress=lambda line: log.info("%s", line))
        memory = min(figures.mem_bytes, o.max_memory) if o.max_memory else figures.mem_bytes
        self.memory, self.layer_bytes = memory, figures.layer_bytes
        shape = ModelShape(figures.num_layers, figures.hidden_size, figures.layer_bytes,
                           figures.kv_bytes_per_token_layer, act_bytes=2)
        self.node = Node(self.identity, NodeConfig(listen=o.listen, announce=o.announce, bootstrap=o.join,
                                                   secret=o.secret, relays=o.relays))
        info = NodeInfo(peer=self.identity.peer_id, role="contributor", device=figures.device, memory_bytes=memory,
                        state="idle", bench={"layer_ms_base": figures.layer_ms_base,
                                             "layer_ms_per_token": figures.layer_ms_per_token,
                                             "host_mem_bytes": figures.host_mem_bytes,
                                             "offload_gbps": figures.offload_gbps})
        self.members = Membership(self.node, info, interval=o.interval)
        self.coordinator = CoordinatorService(self.node, self.members, shape,
                                              Workload(context_tokens=o.context_tokens), interval=o.interval)
        self.coordinator.listeners.append(self._on_plan)
        self.members.start()
        self.coordinator.start()
        self.node.start()
        self.prober = Prober(self.node)
        self.prober.report_links(self.members, every_s=120, bulk_bytes=1 << 20, stop=self.stopping)
        self.say(f"peer {self.node.peer_id}")
        for addr in self.node.addrs:
            self.say(f"addr {addr}")
        self.stopping.wait()
        self._leave()

    def _link_rate(self, peer: str) -> float | None:
        probe = self.prober.cached(peer)
        return probe.up_mbps * 1e6 / 8 if probe and probe.up_mbps > 0 else None

    def stop(self) -> None:
        self.stopping.set()

    def _leave(self) -> None:
        self.members.update(state="leaving")
        self.members.leave()
        deadline = time.monotonic() + LEAVE_GRACE_S
        while self.server is not None and self.server.busy and time.monotonic() < deadline:
            time.sleep(0.05)  # finish in-flight steps
        if self.server is not None:
            self.server.stop()
        self.node.stop()

    def _my_spans(self, pipelines: list[dict]) -> set[tuple[int, int]]:
        return {(s["start"], s["end"]) for p in pipelines for s in p["stages"] if s["node"] == self.identity.peer_id}

    def _on_plan(self, state: PlanState) -> None:
        """Runs in the node's loop: only decide, never block."""
        target = self._my_spans(state.target)
        with self._lock:
            if self.server is not None:  # keep what clients route over (active) and what comes next (target)
                self.server.keep_only(target | self._my_spans(state.active) | ({self.span} if self.span in
                                                                                 target else set()))
            mine = next(iter(target), None)
            if mine is None or mine == self.span or mine == self._loading:
                return
            self._loading = mine
            offload = next(float(s.get("offload_fraction", 0.0)) for p in state.target for s in p["stages"]
                           if s["node"] == self.identity.peer_id)
        threading.Thread(target=self._load, args=(mine, offload), name="span-loader", daemon=True).start()

    def _load(self, span: tuple[int, int], offload_fraction: float = 0.0) -> None:
        self.members.update(state="loading")
        log.info("loading layers [%d, %d) of %s (offload %.0f%%)", *span, self.options.model, 100 * offload_fraction)
        try:
            runtime = SpanRuntime.load(self.options.model, Span(*span), self.options.dtype, self.options.device,
                                       offload_fraction)
        except Exception:  # noqa: BLE001 - report, keep serving the old span
            log.exception("could not load layers [%d, %d)", *span)
            with self._lock:
                self._loading = None
            self.members.update(state="serving" if self.span else "idle")
            return
        with self._lock:
            if self.server is None:
                weights = round(len(runtime.layers) * self.layer_bytes)  # resident layers only
                self.server = StageServer(self.node, runtime, kv_budget_bytes=max(0, self.memory - weights),
                                          link_rate=self._link_rate).start()
            else:
                self.server.add(runtime)  # the old span keeps serving until the plan drops it
            self.span, self._loading = span, None
        self.members.update(layers=span, state="serving")
        self.say(f"serving {span[0]} {span[1]}")
