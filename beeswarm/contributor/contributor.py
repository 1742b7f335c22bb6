"""`beeswarm contribute`: join a swarm, benchmark, take part in the election, load and serve a span.

Composition only: p2p (node, membership, probes), coordinator (the plan follower and the coordinator
that leads it: election, plans, judging evidence), shard (benchmark,
span runtime) and the stage server. The span comes from the coordinator's plan: when the plan's
target gives this node a new span, it is loaded in the background while the old one keeps serving
(make-before-break), then announced in the heartbeat so the coordinator can make it active. Where the node
is in its life (starting, idle, loading, serving, paused, leaving) is its `Lifecycle`, which alone writes
what it announces. A paused node keeps its membership but leaves the plans; `status()` is what the
dashboard shows.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from beeswarm.audit import evidence
from beeswarm.audit.faults import Fault
from beeswarm.audit.peer import PeerAuditService
from beeswarm.contributor.audit_layers import AuditLayers
from beeswarm.contributor.lifecycle import Lifecycle, Phase
from beeswarm.contributor.links import LinkCodecs
from beeswarm.contributor.sessions import Sessions
from beeswarm.contributor.stage import StageServer
from beeswarm.contributor.status import (
    ContributorStatus,
    Event,
    PeerRow,
    Progress,
    ServingFigures,
    ServingMeter,
    ShardFigures,
)
from beeswarm.coordinator.cluster import ModelShape, Workload
from beeswarm.coordinator.coordinator import Coordinator, Judge
from beeswarm.coordinator.credit_keeper import CreditKeeper
from beeswarm.coordinator.follower import PlanFollower
from beeswarm.credits.stage_receipts import ReceiptBox
from beeswarm.p2p.identity import Identity
from beeswarm.p2p.membership import Membership
from beeswarm.p2p.node import Node, NodeConfig
from beeswarm.p2p.probe import Prober
from beeswarm.protocol.audit import Reveal, Revealed
from beeswarm.protocol.coordinator import PlanState, stages_of
from beeswarm.protocol.credits import swarm_id
from beeswarm.protocol.membership import NodeInfo, Quant
from beeswarm.protocol.rpcs import REVEAL
from beeswarm.protocol.spans import Span
from beeswarm.shard import benchmark
from beeswarm.shard.span import SpanRuntime

log = logging.getLogger(__name__)
LEAVE_GRACE_S = 5.0
WORKER_GRACE_S = 30.0  # a benchmark or span load still running when leaving stops at its next step
TICK_S = 1.0  # how often the served tokens/s is measured and put in the heartbeat


class Leaving(Exception):
    """Raised at the next progress step of long work (benchmark, span loading) once the node leaves."""


@dataclass
class ContributorOptions:
    model: str = "tinycode"
    join: list[str] = field(default_factory=list)
    listen: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce: list[str] = field(default_factory=list)
    relays: list[str] = field(default_factory=list)
    relay_service: bool = True  # relay circuits for members behind NATs (taken up only while this node is public)
    device: str = "auto"
    dtype: str = "auto"
    quant: Quant = "none"  # the weights' format: the swarm's, every node the same
    max_memory: int | None = None
    secret: bytes | None = None
    interval: float = 3.0
    context_tokens: int = 2048


def model_shape(model: str, device: str = "auto", dtype: str = "auto", quant: Quant = "none") -> ModelShape:
    """The planner's figures of a model's layers in weight format `quant`, from its config (no weights loaded)."""
    from beeswarm.shard import checkpoint
    from beeswarm.shard.device import resolve_device, resolve_dtype
    from beeswarm.shard.families import kv_bytes_per_token_layer
    from beeswarm.shard.loader import load_config

    folder = checkpoint.resolve_config(model)
    config = load_config(folder)
    dt = resolve_dtype(dtype, resolve_device(device))
    return ModelShape(config.num_hidden_layers, config.hidden_size, benchmark.layer_bytes(config, dt, quant),
                      kv_bytes_per_token_layer(config, dt), act_bytes=2, quant=quant, ref=model,
                      fingerprint=checkpoint.fingerprint(folder))


class Contributor:
    """`run()` serves until `stop()`; `status()` (with each start-up phase's progress), `pause()`,
    `resume()` and `rebench()` may be called from any thread meanwhile (the dashboard does).

    Its parts are injected (`create` builds them); nothing starts before `run()`. `lead` makes the coordinator
    this node runs, given the judge it lends it (which recomputes spans with this contributor's layers)."""

    def __init__(self, options: ContributorOptions, node: Node, members: Membership,
                 lead: Callable[[Judge], Coordinator], prober: Prober,
                 say: Callable[[Event], None] = lambda event: print(event.text)):
        self.options, self.say = options, say
        self.node, self.members, self.prober = node, members, prober
        self.stopping = threading.Event()  # asked to leave: wakes the serving loop, ends long work at its next step
        self.lifecycle = Lifecycle(members.update)
        self.server: StageServer | None = None  # made with the first span loaded
        self.failure: BaseException | None = None  # why the p2p node stopped on its own (then `run()` raises)
        self.figures: benchmark.BenchResult | None = None  # the device benchmark's
        self._lock = threading.Lock()
        self._progress: dict[str, Progress] = {}
        self._meter = ServingMeter()
        self._benching = threading.Lock()
        self._workers: list[threading.Thread] = []  # span loads and re-benchmarks, joined when leaving
        self.audit_layers = AuditLayers(options.model, options.dtype, options.device, options.quant,
                                        options.max_memory, self._layer_bytes, self._served)
        self.coordinator = lead(functools.partial(evidence.judge, runtime_for=self.audit_layers,
                                                  max_bytes=node.config.max_tensor_bytes,
                                                  ask_reveal=self._ask_reveal))
        swarm = swarm_id(node.config.swarm, str(options.model))
        self.peer_audits = PeerAuditService(node, self.audit_layers)  # audits other stages for entries
        self.credits = CreditKeeper(self.coordinator.follower, swarm)  # records receipts while this node leads
        self.receipts = ReceiptBox(node, self.coordinator.follower.leader, swarm, local=self.credits.hand_in)

    @classmethod
    def create(cls, identity: Identity, options: ContributorOptions,
               say: Callable[[Event], None] = lambda event: print(event.text)) -> Contributor:
        o = options
        node = Node(identity, NodeConfig(listen=o.listen, announce=o.announce, bootstrap=o.join, secret=o.secret,
                                         relays=o.relays, relay_service=o.relay_service))
        members = Membership(node, NodeInfo(peer=identity.peer_id, role="contributor", quant=o.quant),
                             interval=o.interval)
        follower = PlanFollower(node, members, interval=o.interval)
        shape, workload = model_shape(o.model, o.device, o.dtype, o.quant), Workload(context_tokens=o.context_tokens)
        return cls(options, node, members,
                   lambda judge: Coordinator(follower, shape, workload, judge=judge), Prober(node), say)

    def _credit(self, payer: str) -> int | None:
        """`payer`'s balance in the newest ledger this node followed (None: it has no account there)."""
        return next((b.balance for b in self.coordinator.follower.ledger_state.balances if b.node == payer), None)

    def _layer_bytes(self) -> int:
        o = self.options
        return model_shape(o.model, o.device, o.dtype, o.quant).layer_bytes

    def _served(self) -> dict[Span, SpanRuntime]:
        with self._lock:
            return dict(self.server.runtimes) if self.server else {}

    def _ask_reveal(self, stage: str, entry: str, session: str, step: int, piece: Span | None = None) -> Revealed:
        """As the coordinator judging `entry`'s word that `stage` refused it: ask `stage` ourselves."""
        return self.node.request(stage, REVEAL, Reveal(session=session, step=step, entry=entry, piece=piece),
                                 timeout=30.0)

    @property
    def phase(self) -> Phase:
        return self.lifecycle.phase

    @property
    def ready(self) -> bool:
        """Node, membership, coordinator and prober are up: pause, resume and rebench work from now on."""
        return self.lifecycle.facts.started

    def run(self) -> None:
        """Serve until `stop()` (or a signal handler calling it); then leave gracefully. Raises NodeFailed
        if the p2p node stopped on an error (the contributor stops with it: a supervisor restarts the process)."""
        try:
            self._serve()
            self.node.raise_if_failed()
        finally:
            self.lifecycle.stopped()

    def _node_failed(self, error: BaseException) -> None:
        self.failure = error
        self.stopping.set()

    def _serve(self) -> None:
        try:
            figures = self._benchmark(refresh=False)
        except Leaving:
            return
        self.members.update(device=figures.device, memory_bytes=self.memory, bench=self._bench_info(figures))
        self.coordinator.follower.listeners.append(self._on_plan)
        self.members.start()
        self.coordinator.start()
        self.credits.start()
        self.receipts.start()
        self.peer_audits.start()
        self.prober.start()
        self.node.when_failed(self._node_failed)
        self.node.start()
        self.prober.report_links(self.members, every_s=120, bulk_bytes=1 << 20, stop=self.stopping,
                                 on_progress=self._probe_progress)
        self.lifecycle.started()
        self.say(Event("peer", f"peer {self.node.peer_id}", {"peer": self.node.peer_id}))
        for addr in self.node.addrs:
            self.say(Event("addr", f"addr {addr}", {"addr": addr}))
        while not self.stopping.wait(TICK_S):
            self._tick()
        self._leave()

    def _benchmark(self, refresh: bool) -> benchmark.BenchResult:
        o = self.options
        self._report("bench", "device benchmark")
        try:
            figures = benchmark.run(o.model, o.device, o.dtype, refresh=refresh, weights=o.quant,
                                    progress=lambda line: log.info("%s", line),
                                    on_step=lambda done, total: self._step("bench", "device benchmark", done, total))
        except Leaving:
            raise
        except Exception as e:
            self._report("bench", "device benchmark", error=str(e))
            raise
        self.figures = figures
        return figures

    @property
    def memory(self) -> int:
        """The memory this node offers: its device's within `--max-memory` (0 before its benchmark)."""
        figures, most = self.figures, self.options.max_memory
        if figures is None:
            return 0
        return min(figures.mem_bytes, most) if most else figures.mem_bytes

    @property
    def layer_bytes(self) -> int:
        """One layer's weights here (0 before the benchmark)."""
        return self.figures.layer_bytes if self.figures is not None else 0

    @staticmethod
    def _bench_info(figures: benchmark.BenchResult) -> dict[str, float | None]:
        return {"layer_ms_base": figures.layer_ms_base, "layer_ms_per_token": figures.layer_ms_per_token,
                "host_mem_bytes": figures.host_mem_bytes, "offload_gbps": figures.offload_gbps}

    # progress -------------------------------------------------------------------------------------
    def _report(self, key: str, label: str, done: float = 0.0, total: float | None = None, unit: str = "",
                error: str | None = None) -> None:
        with self._lock:
            old = self._progress.get(key)
            # a new phase (or a finished one restarting) starts its clock again
            kept = {} if old is None or old.finished or old.label != label else {"started": old.started}
            self._progress[key] = Progress(key, label, done, total, unit, error=error, **kept)

    def _step(self, key: str, label: str, done: float, total: float | None, unit: str = "") -> None:
        """Progress of long work, which stops here once the node is leaving."""
        if self.stopping.is_set():
            raise Leaving
        self._report(key, label, done, total, unit)

    def _start_worker(self, target: Callable, name: str, *args) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            self._workers = [t for t in self._workers if t.is_alive()] + [thread]
        thread.start()

    def _probe_progress(self, peer: str, done: int, total: int, error: str | None) -> None:
        self._report(f"probe {peer}", f"link probe {peer[-8:]}", done, total, error=error)

    def _download_progress(self, file: str, done: int, total: int | None) -> None:
        self._step(f"download {file}", f"download {file}", done, total, unit="B")

    def _link_rate(self, peer: str) -> float | None:
        probe = self.prober.cached(peer)
        return probe.up_mbps * 1e6 / 8 if probe and probe.up_mbps > 0 else None

    # commands (any thread) ------------------------------------------------------------------------
    def stop(self) -> None:
        self.stopping.set()

    def pause(self) -> None:
        """Stop taking part in plans: the coordinator re-plans around this node; in-flight work finishes."""
        self._set_paused(True)

    def resume(self) -> None:
        self._set_paused(False)

    def _set_paused(self, paused: bool) -> None:
        if self.stopping.is_set() or not self.lifecycle.set_paused(paused):
            return
        self.coordinator.mark_dirty()
        word = "paused" if paused else "resumed"
        self.say(Event(word, f"{word} serving"))

    def rebench(self) -> bool:
        """Measure the device again in the background and publish the new figures (False: one is running)."""
        if not self.ready or not self._benching.acquire(blocking=False):
            return False

        def run() -> None:
            try:
                figures = self._benchmark(refresh=True)
                self.members.update(bench=self._bench_info(figures), memory_bytes=self.memory)
                self.coordinator.mark_dirty()
                self.say(Event("rebenched", f"re-benchmarked: {figures.layer_ms_base:.3f} ms per layer",
                               {"layer_ms_base": figures.layer_ms_base}))
            except Leaving:
                pass
            except Exception:  # noqa: BLE001 - shown in the progress bar and the log
                log.exception("benchmark failed")
            finally:
                self._benching.release()

        self._start_worker(run, "rebench")
        return True

    # figures ---------------------------------------------------------------------------------------
    def _tick(self) -> None:
        """Measure the tokens/s served and put it and the open sessions in the heartbeat (peers show them)."""
        served = self.server.tokens if self.server is not None else 0
        self._meter.sample(served, self.server.compute_s if self.server is not None else 0.0)
        self.members.update(load=round(self._meter.load, 2), busy=round(self._meter.busy, 2),
                            sessions=len(self.server.sessions) if self.server is not None else 0)

    def status(self) -> ContributorStatus:
        """A snapshot of this node and the swarm as it sees it (cheap: the dashboard polls it)."""
        o = self.options
        with self._lock:
            progress = tuple(self._progress.values())
        snapshot = functools.partial(ContributorStatus, peer=self.node.peer_id, swarm=NodeConfig().swarm,
                                     model=o.model, private=o.secret is not None, progress=progress)
        facts = self.lifecycle.facts
        if not facts.started:
            return snapshot(state=facts.phase.value)
        me = self.members.info
        lease = self.coordinator.lease
        links = self.prober.all()
        rows = []
        for info in [me, *sorted(self.members.view().values(), key=lambda i: i.peer)]:
            link = links.get(info.peer)
            rows.append(PeerRow(info.peer, info.role, info.layers, info.device, info.load,
                                link.rtt_ms if link else None, link.up_mbps if link else None, info.state,
                                me=info is me, reach=info.reach))
        server, traffic = self.server, (self.server.traffic if self.server else None)
        sessions = server.sessions.all() if server else []
        runtime = server.runtimes.get(facts.span) if server and facts.span is not None else None
        resident = round(len(runtime.layers) * self.layer_bytes) if runtime is not None else 0
        history = tuple(self._meter.history)
        plan = self.coordinator.state  # shown: a sentence, or serving weights in another format than the swarm
        excluded = next((e.reason for e in plan.excluded
                         if e.node == me.peer and (e.until or plan.quant != self.options.quant)), "")
        serving = ServingFigures(len(sessions), traffic.steps, traffic.tokens, history[-1] if history else 0.0,
                                 history, traffic.raw_in, traffic.wire_in, traffic.raw_out, traffic.wire_out,
                                 server.reveals, server.step_log.nbytes, excluded) \
            if server and traffic else ServingFigures(history=history, excluded=excluded)
        serving = dataclasses.replace(serving, credit=self._credit(me.peer), receipts=self.receipts.counts.taken,
                                      receipts_waiting=self.receipts.pending)
        return snapshot(
            state=facts.phase.value, coordinator=lease.leader if lease else None,
            term=lease.term if lease else 0, epoch=self.coordinator.state.epoch, addrs=tuple(self.node.addrs),
            peers=tuple(rows), serving=serving,
            shard=ShardFigures(facts.span, facts.offload_fraction, self.memory,
                               resident + sum(s.kv_bytes for s in sessions)))

    # leaving ---------------------------------------------------------------------------------------
    def _leave(self) -> None:
        self.lifecycle.leave()
        self.members.leave()
        deadline = time.monotonic() + LEAVE_GRACE_S
        while self.server is not None and self.server.busy and time.monotonic() < deadline:
            time.sleep(0.05)  # finish in-flight steps
        with self._lock:
            workers = list(self._workers)
        deadline = time.monotonic() + WORKER_GRACE_S
        for thread in workers:  # torch work still running at interpreter exit can abort the process
            thread.join(max(0.0, deadline - time.monotonic()))
        if self.server is not None:
            self.server.stop()
            done = self.server.queue.batching  # how much it batched, for whoever reads its output
            self.say(Event("served", f"served {done.steps} steps in {done.passes} passes "
                                     f"({done.steps / max(1, done.passes):.2f} a pass)",
                           {"steps": done.steps, "passes": done.passes, "tokens": self.server.tokens,
                            "compute_s": round(done.compute_s, 3)}))
        self.node.stop()

    def _on_plan(self, state: PlanState) -> None:
        """Runs in the node's loop: only decide, never block."""
        target = stages_of(state.target, self.node.peer_id)
        with self._lock:  # a loader adding a span waits: the spans announced are the server's
            if self.server is not None:
                self.server.keep_only(self._planned_spans(state))
                self.lifecycle.serving_only(self.server.spans)
        mine = target[0] if target else None
        if mine is not None and not self.stopping.is_set() and self.lifecycle.begin_load(mine.span):
            self._start_worker(self._load, "span-loader", mine.span, mine.offload_fraction)

    def _planned_spans(self, state: PlanState) -> set[Span]:
        """The spans `state` has this node serve: what clients route over (active) and what comes next (target)."""
        me = self.node.peer_id
        return {s.span for s in stages_of(state.target, me) + stages_of(state.active, me)}

    def _load(self, span: Span, offload_fraction: float = 0.0) -> None:
        log.info("loading layers %s of %s (offload %.0f%%)", span, self.options.model, 100 * offload_fraction)
        label = f"loading layers {span}"
        self._report("load", label, 0, len(span))
        try:
            runtime = SpanRuntime.load(self.options.model, span, self.options.dtype, self.options.device,
                                       offload_fraction, on_bytes=self._download_progress,
                                       on_layer=lambda done, total: self._step("load", label, done, total),
                                       quant=self.options.quant)
        except Leaving:
            return
        except Exception as e:  # noqa: BLE001 - report, keep serving the old span
            log.exception("could not load layers %s", span)
            self._report("load", label, error=str(e))
            self.lifecycle.load_failed()
            return
        with self._lock:
            server = self.server
        if server is None:  # the first span: started outside the lock (start() waits on the node's loop, where
            # the plan listener takes the lock)
            weights = round(len(runtime.layers) * self.layer_bytes)  # resident layers only
            server = StageServer(self.node, runtime, Sessions(max(0, self.memory - weights), credit=self._credit),
                                 LinkCodecs(link_rate=self._link_rate),
                                 fault=Fault.from_env(runtime.folder, runtime.hidden_size),
                                 coordinator=self.coordinator.follower.leader).start()
        else:
            server.add(runtime)  # the old span keeps serving until the plan drops it
        with self._lock:
            self.server = server
            # (a plan that came meanwhile found no server to tell)
            server.keep_only(self._planned_spans(self.coordinator.state) | {span})
            self.lifecycle.loaded(span, offload_fraction, server.spans)
        self.say(Event("serving", f"serving layers {span}", {"start": span.start, "end": span.end}))
