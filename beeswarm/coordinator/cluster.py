"""The planner's input (the JSON of `beeswarm plan --cluster FILE`) and the shared cost model.

Pure: no torch, no networking. Every formula here is the one in ../shared/DESIGN.md "Planner";
the planner, the CLI and the tests all price plans through these functions.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import EllipsisType
from typing import Any, Literal, overload

from beeswarm.protocol.membership import Quant


class ClusterError(ValueError):
    """The cluster description is malformed; the message starts with the field path."""


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    hidden_size: int
    layer_bytes: int
    kv_bytes_per_token_layer: int
    act_bytes: int = 2
    quant: Quant = "none"  # the weights' format `layer_bytes` counts; nodes serving another are not planned
    ref: str = ""  # the model as named where it is served (a built-in name, hub id or folder), for entries
    fingerprint: str = ""  # of its config (`checkpoint.fingerprint`): an entry with another model is refused


@dataclass(frozen=True)
class Workload:
    objective: str = "latency"  # latency | throughput
    batch_size: int = 1
    context_tokens: int = 2048
    step_tokens: int = 1
    compression_ratio: float = 1.0


@dataclass(frozen=True)
class Entry:
    id: str = "entry"
    rtt_ms: dict[str, float] = field(default_factory=dict)
    up_mbps: float = 100.0
    down_mbps: float = 100.0


@dataclass(frozen=True)
class NodeSpec:
    id: str
    mem_bytes: int
    layer_ms_base: float
    layer_ms_per_token: float
    up_mbps: float
    down_mbps: float
    host_mem_bytes: int = 0
    offload_gbps: float | None = None
    rtt_ms: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Cluster:
    model: ModelShape
    workload: Workload
    entry: Entry
    nodes: tuple[NodeSpec, ...]

    def rtt(self, a: str, b: str) -> float:
        """Round trip between two endpoints (node ids or the entry id); inf when unknown."""
        for src, dst in ((a, b), (b, a)):
            table = self.entry.rtt_ms if src == self.entry.id else self._node(src).rtt_ms
            if dst in table:
                return float(table[dst])
        return math.inf

    def _node(self, node_id: str) -> NodeSpec:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise KeyError(node_id)

    def up(self, endpoint: str) -> float:
        return self.entry.up_mbps if endpoint == self.entry.id else self._node(endpoint).up_mbps

    def down(self, endpoint: str) -> float:
        return self.entry.down_mbps if endpoint == self.entry.id else self._node(endpoint).down_mbps


# cost model ---------------------------------------------------------------------------------------
def offload_fraction(cluster: Cluster, node: NodeSpec, k: int) -> float | None:
    """The least share of a k-layer span's weights kept in host memory; None when it cannot fit."""
    m, w = cluster.model, cluster.workload
    weights = k * m.layer_bytes
    kv = k * w.batch_size * w.context_tokens * m.kv_bytes_per_token_layer
    if weights == 0:
        return 0.0 if kv <= node.mem_bytes else None
    a = max(0.0, (weights + kv - node.mem_bytes) / weights)
    if a > 1 or weights * a > node.host_mem_bytes:
        return None
    if a > 0 and not node.offload_gbps:
        return None  # nothing to stream the weights with
    return a


def stage_ms(cluster: Cluster, node: NodeSpec, k: int, m: int) -> float | None:
    """Compute time of a k-layer stage for m sequences of step_tokens each; None when infeasible."""
    a = offload_fraction(cluster, node, k)
    if a is None:
        return None
    w = cluster.workload
    compute = k * (node.layer_ms_base + m * w.step_tokens * node.layer_ms_per_token)
    stream = 0.0
    if a > 0:
        assert node.offload_gbps, "offload_fraction is None when there is nothing to stream the weights with"
        stream = a * k * cluster.model.layer_bytes / (node.offload_gbps * 1e9) * 1e3
    return compute + stream


def hop_transmit_ms(cluster: Cluster, src: str, dst: str, m: int) -> float:
    w, model = cluster.workload, cluster.model
    bits = m * w.step_tokens * model.hidden_size * model.act_bytes * 8
    rate = min(cluster.up(src), cluster.down(dst))
    if rate <= 0:
        return math.inf
    return bits / (w.compression_ratio * rate * 1e6) * 1e3


def hop_ms(cluster: Cluster, src: str, dst: str, m: int) -> float:
    return cluster.rtt(src, dst) / 2 + hop_transmit_ms(cluster, src, dst, m)


def step_ms(cluster: Cluster, stages: list[tuple[str, int]], micro_batches: int) -> float:
    """Time of one step of a pipeline entry -> stages -> entry with M micro-batches (inf if infeasible)."""
    w = cluster.workload
    m = math.ceil(w.batch_size / micro_batches)
    path = [cluster.entry.id] + [s for s, _ in stages] + [cluster.entry.id]
    computes = []
    for node_id, k in stages:
        c = stage_ms(cluster, cluster._node(node_id), k, m)
        if c is None:
            return math.inf
        computes.append(c)
    hops = [hop_ms(cluster, a, b, m) for a, b in zip(path, path[1:])]
    total = sum(computes) + sum(hops)
    if micro_batches > 1:
        transmits = [hop_transmit_ms(cluster, a, b, m) for a, b in zip(path, path[1:])]
        total += (micro_batches - 1) * max(max(computes), max(transmits))
    return total


def tokens_per_s(cluster: Cluster, step: float) -> float:
    w = cluster.workload
    return w.batch_size * w.step_tokens * 1000 / step if step > 0 and math.isfinite(step) else 0.0


# parsing ------------------------------------------------------------------------------------------
@overload
def _num(obj: dict[str, Any], key: str, path: str, *, integer: Literal[True], minimum: float = 0,
         default: int = ..., allow_none: Literal[False] = False) -> int: ...
@overload
def _num(obj: dict[str, Any], key: str, path: str, *, integer: Literal[False] = False, minimum: float = 0,
         default: float = ..., allow_none: Literal[False] = False) -> float: ...
@overload
def _num(obj: dict[str, Any], key: str, path: str, *, integer: Literal[False] = False, minimum: float = 0,
         default: float | None = ..., allow_none: Literal[True]) -> float | None: ...
def _num(obj: dict[str, Any], key: str, path: str, *, integer: bool = False, minimum: float = 0,
         default: float | None | EllipsisType = ..., allow_none: bool = False) -> float | None:
    if key not in obj:
        if default is ...:
            raise ClusterError(f"{path}.{key}: missing")
        return default
    value = obj[key]
    if value is None and allow_none:
        return None
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or value < minimum:
        what = "an integer" if integer else "a number"
        raise ClusterError(f"{path}.{key}: expected {what} >= {minimum}, got {value!r}")
    return value


def _rtts(obj: dict[str, Any], path: str) -> dict[str, float]:
    table = obj.get("rtt_ms", {})
    if not isinstance(table, dict):
        raise ClusterError(f"{path}.rtt_ms: expected an object of id -> milliseconds")
    for k in table:
        _num(table, k, f"{path}.rtt_ms")
    return {str(k): float(v) for k, v in table.items()}


def _obj(parent: dict[str, Any], key: str, path: str) -> dict[str, Any]:
    value = parent.get(key)
    if not isinstance(value, dict):
        raise ClusterError(f"{path}{key}: expected an object")
    return value


def parse_cluster(data: Any) -> Cluster:
    """Validate a cluster description; errors name the field path (e.g. nodes[2].mem_bytes)."""
    if not isinstance(data, dict):
        raise ClusterError("(top level): expected an object with model, workload, entry, nodes")
    m = _obj(data, "model", "")
    model = ModelShape(
        num_layers=_num(m, "num_layers", "model", integer=True, minimum=1),
        hidden_size=_num(m, "hidden_size", "model", integer=True, minimum=1),
        layer_bytes=_num(m, "layer_bytes", "model", integer=True),
        kv_bytes_per_token_layer=_num(m, "kv_bytes_per_token_layer", "model", integer=True),
        act_bytes=_num(m, "act_bytes", "model", integer=True, minimum=1, default=2))
    w = data.get("workload", {})
    if not isinstance(w, dict):
        raise ClusterError("workload: expected an object")
    objective = w.get("objective", "latency")
    if objective not in ("latency", "throughput"):
        raise ClusterError(f"workload.objective: expected \"latency\" or \"throughput\", got {objective!r}")
    workload = Workload(
        objective=objective,
        batch_size=_num(w, "batch_size", "workload", integer=True, minimum=1, default=1),
        context_tokens=_num(w, "context_tokens", "workload", integer=True, minimum=1, default=2048),
        step_tokens=_num(w, "step_tokens", "workload", integer=True, minimum=1, default=1),
        compression_ratio=_num(w, "compression_ratio", "workload", minimum=1, default=1.0))
    if objective == "latency" and workload.batch_size != 1:
        raise ClusterError("workload.batch_size: the latency objective plans one sequence (batch_size 1)")
    e = _obj(data, "entry", "")
    entry = Entry(id=str(e.get("id", "entry")), rtt_ms=_rtts(e, "entry"),
                  up_mbps=_num(e, "up_mbps", "entry"), down_mbps=_num(e, "down_mbps", "entry"))
    raw_nodes = data.get("nodes")
    if not isinstance(raw_nodes, list) or not raw_nodes:
        raise ClusterError("nodes: expected a non-empty list")
    nodes, seen = [], {entry.id}
    for i, n in enumerate(raw_nodes):
        path = f"nodes[{i}]"
        if not isinstance(n, dict):
            raise ClusterError(f"{path}: expected an object")
        node_id = n.get("id")
        if not isinstance(node_id, str) or not node_id:
            raise ClusterError(f"{path}.id: expected a non-empty string")
        if node_id in seen:
            raise ClusterError(f"{path}.id: {node_id!r} is used twice")
        seen.add(node_id)
        nodes.append(NodeSpec(
            id=node_id,
            mem_bytes=_num(n, "mem_bytes", path, integer=True),
            host_mem_bytes=_num(n, "host_mem_bytes", path, integer=True, default=0),
            layer_ms_base=_num(n, "layer_ms_base", path),
            layer_ms_per_token=_num(n, "layer_ms_per_token", path),
            offload_gbps=_num(n, "offload_gbps", path, default=None, allow_none=True),
            up_mbps=_num(n, "up_mbps", path), down_mbps=_num(n, "down_mbps", path),
            rtt_ms=_rtts(n, path)))
    return Cluster(model, workload, entry, tuple(nodes))
