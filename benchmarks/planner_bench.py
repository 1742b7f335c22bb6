#!/usr/bin/env python3
"""Planner benchmark: solve times, and the heuristic's gap to the exact optimum where exact is computable.

Random heterogeneous swarms (GPU-like to CPU-like nodes, home to datacenter links, 1-150 ms RTTs).

    python benchmarks/planner_bench.py [--instances 20] [--json]
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from beeswarm.coordinator.cluster import parse_cluster
from beeswarm.coordinator.planner import EXACT_MAX_NODES, PlanError, plan

GiB = 2**30


def swarm(rng: random.Random, n: int, layers: int, objective: str) -> dict:
    ids = [f"n{i}" for i in range(n)]
    layer_bytes = int(0.8 * GiB)  # a 70B-class model in bf16: 80 layers of ~0.8 GiB
    nodes = []
    for i in ids:
        gpu = rng.random() < 0.7
        nodes.append({
            "id": i,
            "mem_bytes": int(rng.choice([8, 12, 16, 24, 48, 80]) * GiB) if gpu else int(rng.uniform(4, 32) * GiB),
            "host_mem_bytes": int(rng.choice([16, 32, 64]) * GiB),
            "offload_gbps": rng.choice([12.0, 25.0]) if gpu else None,
            "layer_ms_base": rng.uniform(0.3, 3) if gpu else rng.uniform(20, 80),
            "layer_ms_per_token": rng.uniform(0.002, 0.05) if gpu else rng.uniform(1, 5),
            "up_mbps": rng.choice([20, 50, 100, 500, 1000]), "down_mbps": rng.choice([100, 300, 1000]),
            "rtt_ms": {j: rng.uniform(1, 150) for j in ids if j != i}})
    return {"model": {"num_layers": layers, "hidden_size": 8192, "layer_bytes": layer_bytes,
                      "kv_bytes_per_token_layer": 4096},
            "workload": {"objective": objective, "batch_size": 1 if objective == "latency" else 8,
                         "context_tokens": 2048},
            "entry": {"rtt_ms": {i: rng.uniform(1, 150) for i in ids}, "up_mbps": 50, "down_mbps": 300},
            "nodes": nodes}


def objective_value(p) -> float:
    return p.pipelines[0].step_ms if p.objective == "latency" else p.pipelines[0].tokens_per_s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--instances", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rng = random.Random(0)
    rows = []
    for objective in ("latency", "throughput"):
        exact_limit = EXACT_MAX_NODES[objective]
        for n, layers in ((8, 80), (200, 80)):
            times = []
            for _ in range(args.instances):
                cluster = parse_cluster(swarm(rng, n, layers, objective))
                t = time.perf_counter()
                try:
                    plan(cluster)
                except PlanError:
                    continue
                times.append(time.perf_counter() - t)
            rows.append({"kind": "speed", "objective": objective, "nodes": n, "layers": layers,
                         "exact": n <= exact_limit, "solve_s_median": round(statistics.median(times), 4),
                         "solve_s_max": round(max(times), 4)})
        for n in range(exact_limit + 1, exact_limit + 4):
            gaps = []
            for _ in range(args.instances):
                cluster = parse_cluster(swarm(rng, n, 24, objective))
                try:
                    exact = plan(cluster, exact_max_nodes=n, replicas=False)
                    heuristic = plan(cluster, replicas=False)
                except PlanError:
                    continue
                e, h = objective_value(exact), objective_value(heuristic)
                gaps.append((h - e) / e if objective == "latency" else (e - h) / e)
            rows.append({"kind": "gap", "objective": objective, "nodes": n, "layers": 24, "instances": len(gaps),
                         "gap_median": round(statistics.median(gaps), 4), "gap_max": round(max(gaps), 4)})
    if args.json:
        print(json.dumps(rows))
        return
    for r in rows:
        print(r)


if __name__ == "__main__":
    main()
