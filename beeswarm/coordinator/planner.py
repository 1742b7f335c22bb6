"""Who hosts which layers: an exact dynamic-programming planner over the shared cost model.

The additive part of a pipeline's cost splits in two: the hops depend only on the order of the
chosen nodes (a shortest Hamiltonian path entry -> nodes -> entry, Held-Karp over subsets) and the
stages only on how many layers each node takes (a min-plus knapsack over subsets). So for every
node subset S: best(S) = path(S) + alloc(S)[L], and the optimum is the best subset.

The throughput objective adds (M-1) * bottleneck. For each candidate bottleneck value tau (a stage
or hop cost) the additive problem is solved with everything above tau forbidden, and
sum + (M-1) * tau is minimised; tau is scanned upwards and the scan stops once (M-1) * tau plus
the unconstrained minimum cannot win. This is exact. Above `EXACT_MAX_NODES` nodes the same
search runs on the most promising nodes only (a heuristic, flagged `exact: false`).
Pure: numpy only, no torch, no networking.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from beeswarm.coordinator.cluster import (
    Cluster,
    NodeSpec,
    hop_ms,
    hop_transmit_ms,
    offload_fraction,
    stage_ms,
    step_ms,
    tokens_per_s,
)
from beeswarm.protocol.coordinator import Exclusion, Pipeline, Stage
from beeswarm.protocol.spans import Span

# Largest swarm solved exactly, per objective (latency needs one DP; throughput one per bottleneck value),
# and the number of most promising nodes searched exactly in larger swarms.
EXACT_MAX_NODES = {"latency": 14, "throughput": 9}
HEURISTIC_SHORTLIST = {"latency": 14, "throughput": 8}
MAX_REPLICAS = 4  # one entry's uplink feeds them all; more rarely pays
INF = math.inf


class PlanError(ValueError):
    """No plan exists (the swarm cannot hold the model); the message says by how much."""


@dataclass(frozen=True)
class Plan:
    objective: str
    pipelines: tuple[Pipeline, ...]
    excluded: tuple[Exclusion, ...]
    solve_ms: float
    exact: bool

    @property
    def tokens_per_s(self) -> float:
        return sum(p.tokens_per_s for p in self.pipelines)

    def to_json(self) -> dict[str, Any]:
        return {
            "objective": self.objective,
            "pipelines": [{"stages": [{"node": s.node, "start": s.span.start, "end": s.span.end,
                                       "offload_fraction": round(s.offload_fraction, 6)} for s in p.stages],
                           "micro_batches": p.micro_batches, "step_ms": round(p.step_ms, 6),
                           "tokens_per_s": round(p.tokens_per_s, 6)} for p in self.pipelines],
            "excluded": [{"node": e.node, "reason": e.reason} for e in self.excluded],
            "solve_ms": round(self.solve_ms, 3),
            "exact": self.exact,
        }


@dataclass(frozen=True)
class _Solution:
    total: float  # the additive part: sum of stages + sum of hops
    order: tuple[int, ...]
    layers: tuple[int, ...]


class _Tables:
    """Costs of one cluster for one micro-batch size m, indexed by node position (entry = n)."""

    def __init__(self, cluster: Cluster, nodes: list[NodeSpec], m: int):
        n, L = len(nodes), cluster.model.num_layers
        self.n, self.L = n, L
        ids = [node.id for node in nodes] + [cluster.entry.id]
        self.stage = np.full((n, L + 1), INF)
        for j, node in enumerate(nodes):
            for k in range(1, L + 1):
                c = stage_ms(cluster, node, k, m)
                if c is None:
                    break  # more layers fit even less
                self.stage[j, k] = c
        self.hop = np.full((n + 1, n + 1), INF)
        self.transmit = np.full((n + 1, n + 1), INF)
        for a in range(n + 1):
            for b in range(n + 1):
                if a != b:
                    self.hop[a, b] = hop_ms(cluster, ids[a], ids[b], m)
                    self.transmit[a, b] = hop_transmit_ms(cluster, ids[a], ids[b], m)

        self._alloc_cache: dict[bytes, np.ndarray] = {}
        self._path_cache: dict[bytes, np.ndarray] = {}

    def candidates(self) -> np.ndarray:
        values = np.concatenate([self.stage[np.isfinite(self.stage)], self.transmit[np.isfinite(self.hop)]])
        return np.unique(values)

    def solve(self, tau: float = INF) -> _Solution | None:
        """The least additive cost with every stage and hop transmission <= tau, or None."""
        n, L = self.n, self.L
        stage = np.where(self.stage <= tau, self.stage, INF)
        hop = np.where(self.transmit <= tau, self.hop, INF)
        if not np.isfinite(stage).any():
            return None
        alloc = self._alloc(stage)
        path = self._path(hop)
        totals = (path + hop[:n, n]).min(axis=1) + alloc[:, L]
        totals[0] = INF
        best = int(np.argmin(totals))
        if not np.isfinite(totals[best]):
            return None
        return _Solution(float(totals[best]), self._order(path, hop, best), self._layers(alloc, stage, best))

    def _alloc(self, stage: np.ndarray) -> np.ndarray:
        """alloc[S][l]: least stage cost covering l layers with exactly the nodes of S, each >= 1 layer."""
        key = np.isfinite(stage).tobytes()
        if key not in self._alloc_cache:
            n, L = self.n, self.L
            alloc = np.full((1 << n, L + 1), INF)
            alloc[0, 0] = 0.0
            for j in range(n):
                block, out = alloc[: 1 << j], alloc[1 << j: 2 << j]
                for k in np.flatnonzero(np.isfinite(stage[j])):
                    np.minimum(out[:, k:], block[:, : L + 1 - k] + stage[j, k], out=out[:, k:])
            self._alloc_cache[key] = alloc
        return self._alloc_cache[key]

    def _path(self, hop: np.ndarray) -> np.ndarray:
        """path[S][j]: least hop cost entry -> ... -> j visiting exactly S (Held-Karp, by subset size)."""
        key = np.isfinite(hop).tobytes()
        if key not in self._path_cache:
            n = self.n
            path = np.full((1 << n, n), INF)
            for j in range(n):
                path[1 << j, j] = hop[n, j]
            for masks in _masks_by_size(n)[1:-1]:
                # extend every path over S by one node k outside S: (masks, last j, next k)
                ext = (path[masks][:, :, None] + hop[None, :n, :n]).min(axis=1)
                bits = (masks[:, None] >> np.arange(n)) & 1
                rows, ks = np.nonzero(bits == 0)
                np.minimum.at(path, (masks[rows] | (1 << ks), ks), ext[rows, ks])
            self._path_cache[key] = path
        return self._path_cache[key]

    def _order(self, path: np.ndarray, hop: np.ndarray, mask: int) -> tuple[int, ...]:
        n = self.n
        last = int(np.argmin(path[mask] + hop[:n, n]))
        order = [last]
        while mask & (mask - 1):
            prev_mask = mask & ~(1 << last)
            last = int(np.argmin(path[prev_mask] + hop[:n, last]))
            order.append(last)
            mask = prev_mask
        return tuple(reversed(order))

    def _layers(self, alloc: np.ndarray, stage: np.ndarray, mask: int) -> tuple[int, ...]:
        layers = [0] * self.n
        left = self.L
        while mask:
            j = mask.bit_length() - 1
            rest = mask & ~(1 << j)
            ks = np.arange(1, left + 1)
            costs = alloc[rest, left - ks] + stage[j, ks]
            k = int(ks[int(np.argmin(costs))])
            layers[j], left, mask = k, left - k, rest
        return tuple(layers)


_MASKS: dict[int, list[np.ndarray]] = {}


def _masks_by_size(n: int) -> list[np.ndarray]:
    """Subsets of n nodes as bit masks, grouped by their size 0..n."""
    if n not in _MASKS:
        masks = np.arange(1 << n)
        sizes = np.array([bin(m).count("1") for m in range(1 << n)])
        _MASKS[n] = [masks[sizes == c] for c in range(n + 1)]
    return _MASKS[n]


def _bottleneck(tables: _Tables, sol: _Solution) -> float:
    path = [tables.n, *sol.order, tables.n]
    stages = [tables.stage[j, sol.layers[j]] for j in sol.order]
    worst: float = max(max(stages), max(tables.transmit[a, b] for a, b in zip(path, path[1:])))
    return worst


def _best_for_m(tables: _Tables, micro_batches: int) -> tuple[float, _Solution] | None:
    """Least step time with M micro-batches: exact scan over bottleneck values."""
    free = tables.solve()
    if free is None:
        return None
    best_step, best = free.total + (micro_batches - 1) * _bottleneck(tables, free), free
    if micro_batches == 1:
        return best_step, best
    for tau in tables.candidates():
        if (micro_batches - 1) * tau + free.total >= best_step:
            break  # every larger tau costs at least this much
        if (tables.stage <= tau).sum() < tables.L:  # stage cost grows with k: the nodes cannot cover L layers
            continue
        sol = tables.solve(tau)
        if sol is None:
            continue
        step = sol.total + (micro_batches - 1) * _bottleneck(tables, sol)
        if step < best_step:
            best_step, best = step, sol
    return best_step, best


def _micro_batch_options(cluster: Cluster) -> list[int]:
    """For each distinct micro-batch size m, the fewest micro-batches M that give it."""
    b = cluster.workload.batch_size
    if cluster.workload.objective == "latency":
        return [1]
    return sorted({math.ceil(b / math.ceil(b / M)) for M in range(1, b + 1)})


def _plan_pipeline(cluster: Cluster, nodes: list[NodeSpec]) -> Pipeline | None:
    best: tuple[float, int, _Solution] | None = None
    b = cluster.workload.batch_size
    # Fewest micro-batches first; each M's unconstrained optimum bounds it from below.
    for M in _micro_batch_options(cluster):
        tables = _Tables(cluster, nodes, math.ceil(b / M))
        if best is not None:
            free = tables.solve()
            if free is None or free.total >= best[0]:
                continue  # even without its (M-1) * bottleneck term this M cannot win
        found = _best_for_m(tables, M)
        if found is not None and (best is None or found[0] < best[0] - 1e-12):
            best = (found[0], M, found[1])
    if best is None:
        return None
    _, M, sol = best
    stages, start = [], 0
    for j in sol.order:
        k = sol.layers[j]
        stages.append(Stage(node=nodes[j].id, span=Span(start, start + k),
                            offload_fraction=offload_fraction(cluster, nodes[j], k) or 0.0))
        start += k
    step = step_ms(cluster, [(s.node, len(s.span)) for s in stages], M)  # priced by the shared model
    return Pipeline(stages=tuple(stages), micro_batches=M, step_ms=step, tokens_per_s=tokens_per_s(cluster, step))


def _shortlist(cluster: Cluster, nodes: list[NodeSpec], keep: int) -> list[NodeSpec]:
    """The `keep` most promising nodes: fast per-layer compute, many layers in memory, close to the entry."""
    w, L = cluster.workload, cluster.model.num_layers

    def score(node: NodeSpec) -> float:
        fits = max((k for k in range(1, L + 1) if offload_fraction(cluster, node, k) == 0.0), default=0)
        if fits == 0:
            return INF
        per_layer = node.layer_ms_base + w.batch_size * w.step_tokens * node.layer_ms_per_token
        stages_needed = math.ceil(L / fits)
        return per_layer * L / stages_needed + cluster.rtt(cluster.entry.id, node.id)

    ranked = sorted(nodes, key=score)
    return ranked[:keep]


def memory_shortfall(cluster: Cluster) -> int:
    """Bytes missing for one copy of the model (weights + KV) across all nodes' device and host memory."""
    m, w = cluster.model, cluster.workload
    need = m.num_layers * (m.layer_bytes + w.batch_size * w.context_tokens * m.kv_bytes_per_token_layer)
    have = sum(n.mem_bytes + (n.host_mem_bytes if n.offload_gbps else 0) for n in cluster.nodes)
    return max(0, need - have)


def max_layers(cluster: Cluster, node: NodeSpec) -> int:
    """The most whole layers `node` can hold (0: not one)."""
    k = 0
    while k < cluster.model.num_layers and stage_ms(cluster, node, k + 1, 1) is not None:
        k += 1
    return k


def why_no_pipeline(cluster: Cluster, usable: list[NodeSpec]) -> str:
    """What is short when no pipeline exists: memory in bytes, whole layers, or the links measured."""
    short = memory_shortfall(cluster)
    if short:
        return f"short by {short} bytes of memory"
    layers = cluster.model.num_layers
    holds = sorted(((max_layers(cluster, node), node.id) for node in usable), reverse=True)
    total = sum(k for k, _ in holds)
    if total < layers:
        each = ", ".join(f"{node[:12]}: {k}" for k, node in holds[:5]) + (", ..." if len(holds) > 5 else "")
        return (f"the nodes hold {total} of its {layers} layers in whole layers (a layer cannot be split across "
                f"nodes; the most each holds: {each or 'none'})")
    ids = [node.id for node in usable]
    from_entry = sum(math.isfinite(cluster.rtt(cluster.entry.id, node)) for node in ids)
    if not from_entry:
        return f"no link from the entry to any of the {len(ids)} nodes is measured"
    pairs = [(a, b) for i, a in enumerate(ids) for b in ids[i + 1:]]
    measured = sum(math.isfinite(cluster.rtt(a, b)) for a, b in pairs)
    return (f"no order of nodes that together hold it has every link measured (the entry reaches {from_entry} of "
            f"{len(ids)} nodes; {measured} of {len(pairs)} links between nodes are measured)")


def plan(cluster: Cluster, exact_max_nodes: int | None = None, replicas: bool = True) -> Plan:
    """The best plan for the cluster; raises PlanError when no pipeline can hold the model."""
    t0 = time.perf_counter()
    objective = cluster.workload.objective
    if exact_max_nodes is None:
        exact_max_nodes = EXACT_MAX_NODES[objective]
    usable: list[NodeSpec] = []
    excluded: list[Exclusion] = []
    for node in cluster.nodes:
        if stage_ms(cluster, node, 1, 1) is None:
            excluded.append(Exclusion(node.id, "cannot hold one layer: not enough memory"))
        else:
            usable.append(node)
    exact = len(usable) <= exact_max_nodes
    pipelines: list[Pipeline] = []
    pool = usable
    while pool:
        candidates = pool if len(pool) <= exact_max_nodes else \
            _shortlist(cluster, pool, min(exact_max_nodes, HEURISTIC_SHORTLIST[objective]))
        pipeline = _plan_pipeline(cluster, candidates)
        if pipeline is None:
            break
        pipelines.append(pipeline)
        if cluster.workload.objective == "latency" or not replicas or len(pipelines) == MAX_REPLICAS:
            break
        used = {s.node for s in pipeline.stages}
        pool = [n for n in pool if n.id not in used]
    if not pipelines:
        raise PlanError(f"the swarm cannot hold the model: {why_no_pipeline(cluster, usable)}")
    used = {s.node for p in pipelines for s in p.stages}
    for node in usable:
        if node.id not in used:
            reachable = math.isfinite(cluster.rtt(cluster.entry.id, node.id)) or any(
                math.isfinite(cluster.rtt(node.id, other.id)) for other in cluster.nodes if other is not node)
            why = "no RTT measurement to any peer" if not reachable else \
                "leaving it out is faster" if exact else "not among the most promising nodes"
            excluded.append(Exclusion(node.id, why))
    return Plan(cluster.workload.objective, tuple(pipelines), tuple(excluded), (time.perf_counter() - t0) * 1e3,
                exact)
