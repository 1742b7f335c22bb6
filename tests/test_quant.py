"""Quantized weights: spans load int8/NF4 layer by layer, count the bytes they hold, and a swarm serves one format."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from beeswarm.client.swarm import ClientOptions, SwarmClient
from beeswarm.contributor.contributor import model_shape
from beeswarm.coordinator.cluster import Cluster, Entry, NodeSpec, Workload, stage_ms
from beeswarm.coordinator.planner import PlanError, plan
from beeswarm.generation.sampling import SamplingParams
from beeswarm.shard import EntryModel, ShardError, Span, SpanRuntime, benchmark, quant
from helpers import lines_of, read_until, start_contributors, wait_for
from tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """Matrices of 128 x 128 and up: whole NF4 blocks of blocks, as every real model's are."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("quantizable"), "llama", num_layers=6, hidden_size=128,
                                 heads=4, kv_heads=4, intermediate_size=256, seed=11, max_shard_size="200KB")


def quantized_reference(folder, weights: str):
    """transformers' model of `folder` with every decoder layer's linear weights in `weights`."""
    reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    for layer in reference.model.layers:
        quant.quantize_layer(layer, weights)
    return reference


def reference_greedy(reference, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                                 pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("weights", ["int8", "nf4"])
def test_quantized_spans_chain_like_the_model_quantized_whole_and_stay_close_to_full_precision(model, weights):
    entry = EntryModel(model, dtype="float32", device="cpu")
    spans = [SpanRuntime(model, Span(a, b), dtype="float32", device="cpu", quant=weights,
                         offload_fraction=0.5 if a else 0.0) for a, b in ((0, 2), (2, 4), (4, 6))]
    tokens = torch.tensor([5, 17, 99, 3, 200, 42, 7, 80, 81, 82])
    hidden = entry.embed(tokens)
    for span in spans:
        span.open("s", 32)
        hidden = span.step_one("s", hidden, 0)
    logits = entry.logits(hidden)
    with torch.no_grad():
        want = quantized_reference(model, weights)(tokens[None]).logits[0]
        full = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)(tokens[None]).logits[0]
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)
    drift = ((logits - full).norm() / full.norm()).item()
    assert 1e-4 < drift < (0.1 if weights == "int8" else 0.5)  # quantized, and not to noise (random weights)


@pytest.mark.parametrize("weights", ["int8", "nf4"])
def test_layer_bytes_are_what_a_loaded_quantized_layer_holds(model, weights):
    runtime = SpanRuntime(model, Span(0, 2), dtype="float32", device="cpu", quant=weights)
    held = sum(quant.tensor_bytes(p) for p in runtime.layers[0].parameters())
    counted = benchmark.layer_bytes(runtime.config, torch.float32, weights)
    assert abs(held - counted) / held < 0.02
    full = benchmark.layer_bytes(runtime.config, torch.float32)
    assert counted < full * (0.28 if weights == "int8" else 0.15)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_experts_are_quantized_with_the_rest_and_counted(family, tmp_path):
    """The fused 3-D expert tensors are split per expert and quantized like every linear map: the chain (its
    second span half offloaded) equals the model quantized whole, and holds what the planner counts."""
    folder = write_tiny_checkpoint(tmp_path / family, family, num_layers=4, hidden_size=128, heads=4, kv_heads=4,
                                   intermediate_size=256, seed=3)
    entry = EntryModel(folder, dtype="float32", device="cpu")
    spans = [SpanRuntime(folder, Span(a, b), dtype="float32", device="cpu", quant="int8",
                         offload_fraction=0.5 if a else 0.0) for a, b in ((0, 2), (2, 4))]
    tokens = torch.tensor([5, 17, 99, 3, 200, 42, 7, 80])
    hidden = entry.embed(tokens)
    for span in spans:
        span.open("s", 16)
        hidden = span.step_one("s", hidden, 0)
    with torch.no_grad():
        want = quantized_reference(folder, "int8")(tokens[None]).logits[0]
    torch.testing.assert_close(entry.logits(hidden), want, atol=1e-4, rtol=0)
    held = sum(quant.tensor_bytes(p) for p in spans[0].layers[0].parameters())
    counted = benchmark.layer_bytes(spans[0].config, torch.float32, "int8")
    assert abs(held - counted) / held < 0.02
    assert counted < 0.28 * benchmark.layer_bytes(spans[0].config, torch.float32)  # the experts shrank too


def test_a_contributor_with_half_the_memory_takes_about_as_many_layers_at_int8():
    """bfloat16 weights (the CUDA default) to int8: half the bytes, so twice the layers in the same memory."""
    def layers_held(weights: str, mem: int) -> int:
        shape = replace(model_shape("tinycode", "cpu", "bfloat16", weights), num_layers=64)  # room to count
        node = NodeSpec("n", mem, 1.0, 0.01, 100.0, 100.0)
        cluster = Cluster(shape, Workload(context_tokens=8), Entry(), (node,))
        return max((k for k in range(1, 65) if stage_ms(cluster, node, k, 1) is not None), default=0)

    bf16 = model_shape("tinycode", "cpu", "bfloat16")
    mem = 8 * (bf16.layer_bytes + 8 * bf16.kv_bytes_per_token_layer)  # eight full-precision layers
    assert layers_held("none", mem) == 8
    assert layers_held("int8", mem // 2) in (7, 8)  # half the memory
    assert layers_held("int8", mem) in (15, 16)  # the same memory: about twice the layers


def test_the_planner_fits_at_int8_a_model_it_cannot_hold_in_full_precision():
    def cluster(weights: str) -> Cluster:
        shape = model_shape("tinycode", "cpu", "bfloat16", weights)
        full = model_shape("tinycode", "cpu", "bfloat16")
        mem = int(1.5 * full.layer_bytes)  # two nodes holding one of tinycode's 4 layers each in full precision
        nodes = tuple(NodeSpec(f"n{i}", mem, 1.0, 0.01, 100.0, 100.0, rtt_ms={f"n{1 - i}": 5.0}) for i in (0, 1))
        return Cluster(shape, Workload(context_tokens=8), Entry(rtt_ms={"n0": 5.0, "n1": 5.0}), nodes)

    with pytest.raises(PlanError, match="short by"):
        plan(cluster("none"))
    spans = [s.span for s in plan(cluster("int8")).pipelines[0].stages]
    assert sum(len(s) for s in spans) == model_shape("tinycode").num_layers


@pytest.mark.slow
def test_unknown_formats_are_named():
    with pytest.raises(ShardError, match="expected one of none, int8, nf4"):
        quant.check("int4")
    out = subprocess.run([sys.executable, "-m", "beeswarm", "bench", "--quant", "fp8"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and "invalid choice: 'fp8'" in out.stderr


@pytest.mark.slow
def test_an_int8_swarm_serves_greedy_tokens_of_the_int8_model_audits_in_int8_and_leaves_out_other_formats(
        model, tmp_path):
    """`swarm --local 3 --quant int8`, then a contributor started with full-precision weights: the plan is
    int8 and leaves it out, saying why; a generation auditing every step gets the int8 model's greedy tokens."""
    env = {**{k: v for k, v in os.environ.items() if k != "BEESWARM_IDENTITY"},
           "BEESWARM_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    swarm = subprocess.Popen([sys.executable, "-m", "beeswarm", "swarm", "--local", "3", "--model", str(model),
                              "--quant", "int8"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                             env=env)
    procs: list[subprocess.Popen] = []
    try:
        _, seen = read_until(lines_of(swarm), "ready", 120)
        boot = next(line.split()[1] for line in seen if line.startswith("bootstrap "))
        descriptor = next(line.split()[1] for line in seen if line.startswith("descriptor "))
        assert json.loads(Path(descriptor).read_text())["quant"] == "int8"
        client = SwarmClient.create(EntryModel(model, dtype="float32", device="cpu"), [boot], interval=1.0,
                                    listen=["/ip4/127.0.0.1/tcp/0"], options=ClientOptions(audit_rate=1.0)).start()
        try:
            peers, _ = start_contributors(procs, model, 1, 1 << 30, env, tmp_path, join=boot)  # no --quant: none
            stranger = next(iter(peers))
            left_out = wait_for(lambda: [e.reason for e in client.coordinator.state.excluded if e.node == stranger],
                                60, "the full-precision contributor left out")
            assert left_out[0] == "serves none weights; this swarm serves int8"
            assert client.coordinator.state.quant == "int8"
            prompt = [3, 14, 15, 92, 65]
            out = client.generate(prompt, 10, SamplingParams(), route_timeout=90)
            assert out.generation.tokens == reference_greedy(quantized_reference(model, "int8"), prompt, 10)
            assert client.audits.run >= 3 and client.audits.failed == 0, client.audits
            assert stranger not in {s.node for s in out.route}
        finally:
            client.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
        swarm.terminate()
        swarm.wait(30)
