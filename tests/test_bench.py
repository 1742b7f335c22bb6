"""`beeswarm bench`: figures the planner can use, cached per model shape and device."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from beeswarm.coordinator.cluster import parse_cluster
from beeswarm.coordinator.planner import plan

pytestmark = pytest.mark.slow  # starts beeswarm processes: not in `make test-fast`


def bench(cache, *args):
    env = {**os.environ, "BEESWARM_CACHE_DIR": str(cache)}
    return subprocess.run([sys.executable, "-m", "beeswarm", "bench", *args], capture_output=True, text=True,
                          timeout=120, env=env)


def test_bench_measures_caches_and_feeds_the_planner(tiny_llama, tmp_path):
    first = bench(tmp_path, "--model", str(tiny_llama), "--device", "cpu", "--json")
    assert first.returncode == 0, first.stderr
    figures = json.loads(first.stdout)
    assert figures["cached"] is False and "benchmarking" in first.stderr  # progress on stderr, JSON on stdout
    assert figures["layer_ms_base"] > 0 and figures["layer_ms_per_token"] >= 0
    assert figures["mem_bytes"] > 2**20 and figures["offload_gbps"] is None  # CPU: no host-to-device copy
    assert figures["num_layers"] == 8 and figures["layer_bytes"] > 0 and figures["kv_bytes_per_token_layer"] > 0

    again = json.loads(bench(tmp_path, "--model", str(tiny_llama), "--device", "cpu", "--json").stdout)
    assert again["cached"] is True and again["layer_ms_base"] == figures["layer_ms_base"]
    redo = json.loads(bench(tmp_path, "--model", str(tiny_llama), "--device", "cpu", "--json", "--refresh").stdout)
    assert redo["cached"] is False

    cluster = parse_cluster({
        "model": {k: figures[k] for k in ("num_layers", "hidden_size", "layer_bytes", "kv_bytes_per_token_layer")},
        "workload": {"objective": "latency", "context_tokens": 256},
        "entry": {"rtt_ms": {"me": 1}, "up_mbps": 100, "down_mbps": 100},
        "nodes": [{"id": "me", "up_mbps": 100, "down_mbps": 100, "host_mem_bytes": figures["host_mem_bytes"],
                   **{k: figures[k] for k in ("mem_bytes", "layer_ms_base", "layer_ms_per_token", "offload_gbps")}}]})
    assert plan(cluster).pipelines[0].stages[0].span.end == 8


def test_bench_errors_are_clear(tiny_llama, tmp_path):
    out = bench(tmp_path, "--model", "nowhere", "--json")
    assert out.returncode == 2 and "not a built-in name" in out.stderr and "Traceback" not in out.stderr
    out = bench(tmp_path, "--model", str(tiny_llama), "--device", "gpu7")
    assert out.returncode == 2 and "expected auto, cpu or cuda:N" in out.stderr
