"""Planner: equal to an independent brute force on small swarms; the CLI's JSON and errors."""
from __future__ import annotations

import itertools
import json
import math
import random
import subprocess
import sys

import numpy as np
import pytest

from beeswarm.coordinator.cluster import ClusterError, parse_cluster, step_ms
from beeswarm.coordinator.planner import PlanError, plan


def random_cluster(rng: random.Random, n: int, L: int, objective: str) -> dict:
    W = 100 * 2**20
    ids = [f"n{i}" for i in range(n)]
    B = 1 if objective == "latency" else rng.randint(1, 6)
    nodes = []
    for i in ids:
        offload = rng.random() < 0.4
        nodes.append({
            "id": i,
            # from "cannot hold one layer" to "holds the whole model"; some only with offload
            "mem_bytes": int(rng.choice([0.5, 1, 2, 3, 5, 8, 20]) * W * rng.uniform(0.9, 1.3)),
            "host_mem_bytes": rng.choice([0, 4 * W, 30 * W]) if offload else 0,
            "offload_gbps": rng.choice([2.0, 16.0]) if offload else None,
            "layer_ms_base": rng.uniform(0.2, 6), "layer_ms_per_token": rng.uniform(0.001, 0.8),
            "up_mbps": rng.uniform(5, 2000), "down_mbps": rng.uniform(5, 2000),
            "rtt_ms": {j: rng.uniform(0.5, 120) for j in ids if j != i and rng.random() < 0.95},
        })
    return {"model": {"num_layers": L, "hidden_size": rng.choice([512, 4096, 8192]), "layer_bytes": W, "act_bytes": 2,
                      "kv_bytes_per_token_layer": rng.choice([0, 256, 4096])},
            "workload": {"objective": objective, "batch_size": B, "context_tokens": rng.choice([128, 2048]),
                         "step_tokens": rng.choice([1, 1, 4, 16]), "compression_ratio": rng.choice([1, 1.4])},
            "entry": {"rtt_ms": {i: rng.uniform(0.5, 120) for i in ids}, "up_mbps": rng.uniform(10, 1000),
                      "down_mbps": rng.uniform(10, 1000)},
            "nodes": nodes}


# An independent brute force, with the cost model re-derived from DESIGN.md ----------------------
def brute_force(c: dict) -> float:
    """Best objective: least step ms (latency) or most tokens/s of one pipeline (throughput); inf/0 if none."""
    model, w, entry = c["model"], c["workload"], c["entry"]
    nodes = {n["id"]: n for n in c["nodes"]}
    L, B = model["num_layers"], w["batch_size"]

    def rtt(a, b):
        for x, y in ((a, b), (b, a)):
            table = entry["rtt_ms"] if x == "E" else nodes[x]["rtt_ms"]
            if y in table:
                return table[y]
        return math.inf

    def updown(x):
        return (entry["up_mbps"], entry["down_mbps"]) if x == "E" else (nodes[x]["up_mbps"], nodes[x]["down_mbps"])

    def stage(n, k, m):
        W, kv = k * model["layer_bytes"], k * B * w["context_tokens"] * model["kv_bytes_per_token_layer"]
        a = max(0.0, (W + kv - n["mem_bytes"]) / W)
        if a > 1 or W * a > n["host_mem_bytes"] or (a > 0 and not n["offload_gbps"]):
            return None
        t = k * (n["layer_ms_base"] + m * w["step_tokens"] * n["layer_ms_per_token"])
        return t + (a * W / (n["offload_gbps"] * 1e9) * 1e3 if a > 0 else 0)

    def transmit(a, b, m):
        return m * w["step_tokens"] * model["hidden_size"] * model["act_bytes"] * 8 / (
            w["compression_ratio"] * min(updown(a)[0], updown(b)[1]) * 1e6) * 1e3

    Ms = [1] if w["objective"] == "latency" else range(1, B + 1)
    best = math.inf if w["objective"] == "latency" else 0.0
    for M in Ms:
        m = math.ceil(B / M)
        for size in range(1, len(nodes) + 1):
            for subset in itertools.combinations(sorted(nodes), size):
                allocs = []  # (sum of stage ms, max stage ms) for every split of L over the subset
                for cuts in itertools.combinations(range(1, L), size - 1):
                    ks = [b - a for a, b in zip((0, *cuts), (*cuts, L))]
                    costs = [stage(nodes[i], k, m) for i, k in zip(subset, ks)]
                    if None not in costs:
                        allocs.append((sum(costs), max(costs)))
                if not allocs:
                    continue
                orders = []
                for perm in itertools.permutations(subset):
                    path = ["E", *perm, "E"]
                    hops = [(rtt(a, b) / 2 + transmit(a, b, m), transmit(a, b, m)) for a, b in zip(path, path[1:])]
                    orders.append((sum(h for h, _ in hops), max(t for _, t in hops)))
                a_sum, a_max = np.array(allocs).T
                o_sum, o_max = np.array(orders).T
                steps = a_sum[:, None] + o_sum[None, :] + (M - 1) * np.maximum(a_max[:, None], o_max[None, :])
                step = float(steps.min())
                if w["objective"] == "latency":
                    best = min(best, step)
                elif math.isfinite(step):
                    best = max(best, B * w["step_tokens"] * 1000 / step)
    return best


def test_planner_equals_brute_force_on_300_random_swarms():
    rng = random.Random(2024)
    checked = excluded_some = offloaded = infeasible = 0
    while checked < 300:
        objective = rng.choice(["latency", "throughput"])
        n, L = rng.randint(1, 6), rng.randint(1, 16)
        if n == 6 and L > 10 or n == 5 and L > 13:  # keep the brute force's search space in budget
            L = rng.randint(1, 10)
        raw = random_cluster(rng, n, L, objective)
        want = brute_force(raw)
        cluster = parse_cluster(raw)
        try:
            got = plan(cluster, replicas=False)
        except PlanError:
            assert want in (math.inf, 0.0), f"planner found nothing, brute force found {want}"
            infeasible += 1
            checked += 1
            continue
        pipe = got.pipelines[0]
        # the plan's figures are the shared cost model's, and the stages tile [0, L)
        assert pipe.stages[0].span.start == 0 and pipe.stages[-1].span.end == L
        assert all(a.span.end == b.span.start for a, b in zip(pipe.stages, pipe.stages[1:]))
        assert pipe.step_ms == pytest.approx(step_ms(cluster, [(s.node, len(s.span)) for s in pipe.stages],
                                                     pipe.micro_batches))
        if objective == "latency":
            assert pipe.step_ms == pytest.approx(want, rel=1e-9), raw
        else:
            assert pipe.tokens_per_s == pytest.approx(want, rel=1e-9), raw
        excluded_some += bool(got.excluded)
        offloaded += any(s.offload_fraction > 0 for s in pipe.stages)
        checked += 1
    assert excluded_some >= 30 and offloaded >= 10 and infeasible >= 5  # the instances cover the hard cases


def test_replicas_add_throughput_when_memory_allows():
    rng = random.Random(5)
    raw = random_cluster(rng, 6, 4, "throughput")
    for node in raw["nodes"]:
        node["mem_bytes"] = 10 * raw["model"]["layer_bytes"]
        node["rtt_ms"] = {j["id"]: 5.0 for j in raw["nodes"] if j is not node}
    got = plan(parse_cluster(raw))
    assert len(got.pipelines) >= 2
    nodes = [s.node for p in got.pipelines for s in p.stages]
    assert len(nodes) == len(set(nodes))  # replicas are disjoint
    assert got.tokens_per_s == pytest.approx(sum(p.tokens_per_s for p in got.pipelines))


def run_plan(tmp_path, data, *args):
    f = tmp_path / "cluster.json"
    f.write_text(data if isinstance(data, str) else json.dumps(data))
    return subprocess.run([sys.executable, "-m", "beeswarm", "plan", "--cluster", str(f), *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_plan_cli_json_table_and_errors(tmp_path):
    raw = random_cluster(random.Random(1), 4, 8, "throughput")
    for node in raw["nodes"]:
        node["mem_bytes"] = 4 * raw["model"]["layer_bytes"]
    out = run_plan(tmp_path, raw, "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) == {"objective", "pipelines", "excluded", "solve_ms", "exact"}
    stage = result["pipelines"][0]["stages"][0]
    assert set(stage) == {"node", "start", "end", "offload_fraction"} and stage["start"] == 0
    assert set(result["pipelines"][0]) == {"stages", "micro_batches", "step_ms", "tokens_per_s"}
    table = run_plan(tmp_path, raw)
    assert table.returncode == 0 and "tokens/s" in table.stdout

    raw["nodes"][2]["mem_bytes"] = "lots"
    bad = run_plan(tmp_path, raw)
    assert bad.returncode == 2 and "nodes[2].mem_bytes" in bad.stderr and "Traceback" not in bad.stderr
    assert run_plan(tmp_path, "{not json").returncode == 2

    raw["nodes"] = [{**n, "mem_bytes": 1, "host_mem_bytes": 0} for n in raw["nodes"][:2]]
    short = run_plan(tmp_path, raw)
    assert short.returncode == 2 and "short by" in short.stderr


def test_a_swarm_that_cannot_hold_the_model_is_told_what_is_short():
    """Three nodes with 2.7 layers' worth of memory each, for 8 layers: enough bytes in all (8.1 layers), but a
    layer is never split, so they hold 6; then enough of them, but links never measured."""
    raw = random_cluster(random.Random(3), 3, 8, "latency")
    raw["model"]["kv_bytes_per_token_layer"] = 0
    per_layer = raw["model"]["layer_bytes"]
    for node in raw["nodes"]:
        node.update(mem_bytes=int(2.7 * per_layer), host_mem_bytes=0, offload_gbps=None)
    with pytest.raises(PlanError, match=r"hold 6 of its 8 layers in whole layers .*n\d: 2"):
        plan(parse_cluster(raw))
    for node in raw["nodes"]:
        node.update(mem_bytes=4 * per_layer, rtt_ms={})
    with pytest.raises(PlanError, match=r"reaches 3 of 3 nodes; 0 of 3 links between nodes are measured"):
        plan(parse_cluster(raw))
    raw["entry"]["rtt_ms"] = {}
    with pytest.raises(PlanError, match="no link from the entry to any of the 3 nodes is measured"):
        plan(parse_cluster(raw))


def test_field_paths_in_errors():
    with pytest.raises(ClusterError, match=r"^workload.objective"):
        parse_cluster({**random_cluster(random.Random(0), 2, 2, "latency"), "workload": {"objective": "speed"}})
    with pytest.raises(ClusterError, match=r"^nodes: expected a non-empty list"):
        parse_cluster({**random_cluster(random.Random(0), 2, 2, "latency"), "nodes": []})
