#!/usr/bin/env python3
"""Swarm benchmarks: loopback, and the emulated internet links of scenarios E1-E5 and the ring sweep.

loopback: a 3-process local swarm against the same model in one process: single-stream decode
tokens/s (after the first token) and the time to first token for a 512-token prompt (in one
piece, and cut into 4 micro-batches that pipeline across the stages), push chain and client hops.

envs: the `wide` model (random, 2048 wide, 3 layers) on 3 stages + entry behind the link emulator,
each environment's bandwidth and delay on every link, `baseline` (client hops, raw frames, no
micro-batching: the way Petals serves) against `beeswarm` (push chain, adaptive codec, the plan's
micro-batches): batch throughput (8 sequences, 128-token prompts, 64 new tokens), single-stream
decode, TTFT of a 512-token prompt, wire and raw bytes.

ring: single-stream decode over rings of 0-280 ms against 1 / (C + T_ring).

envs and ring save JSON under benchmarks/results/ and regenerate BENCHMARKS.md's scenario section
and plots (benchmarks/report.py).

    python benchmarks/swarm_bench.py --scenario loopback|envs|ring|all [--env E4 ...] [--json]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers shared with the tests
import report  # noqa: E402

from beeswarm.client.swarm import ClientOptions, SwarmClient
from beeswarm.contributor.local_swarm import LocalSwarm, threads_per_process
from beeswarm.generation.generate import generate
from beeswarm.generation.sampling import SamplingParams
from beeswarm.shard import EntryModel
from emulated import EmulatedSwarm  # noqa: E402
from local_pipeline import LocalPipeline  # noqa: E402

RESULTS = Path(__file__).parent / "results"

DECODE_TOKENS = 64
LONG_PROMPT = 512
# The planner's latency objective plans M = 1 for one stream; prefill is measured cut into 4 chunks.
MICRO_BATCHES = 4


def decode_rate(gen) -> float:
    return (len(gen.tokens) - 1) / (gen.seconds - gen.ttft_s)


def loopback(args) -> dict:
    greedy = SamplingParams()
    prompt = list(range(1, 9))
    long_prompt = [(7 * i) % 1000 + 1 for i in range(LONG_PROMPT)]

    local = LocalPipeline(args.model, stages=1, dtype="float32", device="cpu")

    def run_local(ids, n):
        session = local.open(len(ids) + n)
        try:
            return generate(lambda t, s: local.forward(session, t, s), ids, n, greedy)
        finally:
            local.close(session)

    single = statistics.median(decode_rate(run_local(prompt, DECODE_TOKENS)) for _ in range(args.repeat))
    single_ttft = statistics.median(run_local(long_prompt, 1).ttft_s for _ in range(args.repeat))

    torch.set_num_threads(threads_per_process(4))  # one process had every core; now 4 share them
    swarm = LocalSwarm(3, args.model)
    results = {}
    try:
        bootstrap = swarm.start()
        swarm.wait_ready()
        entry = EntryModel.load(args.model, "float32", "cpu")
        for mode in ("push", "hops"):
            client = SwarmClient.create(entry, [bootstrap], interval=1.0, listen=["/ip4/127.0.0.1/tcp/0"],
                                        options=ClientOptions(mode=mode, micro_batches=1)).start()
            try:
                client.generate(prompt, 4, greedy)  # warm up channels and codec calibration
                rate = statistics.median(decode_rate(client.generate(prompt, DECODE_TOKENS, greedy).generation)
                                         for _ in range(args.repeat))
                ttft = statistics.median(client.generate(long_prompt, 1, greedy).generation.ttft_s
                                         for _ in range(args.repeat))
                client.options = ClientOptions(mode=mode, micro_batches=MICRO_BATCHES)
                ttft_m4 = statistics.median(client.generate(long_prompt, 1, greedy).generation.ttft_s
                                            for _ in range(args.repeat)) if mode == "push" else None
            finally:
                client.close()
            results[mode] = (rate, ttft, ttft_m4)
    finally:
        swarm.stop()
    return {"scenario": "loopback", "model": args.model,
            "swarm_tokens_per_s": round(results["push"][0], 2),
            "client_hops_tokens_per_s": round(results["hops"][0], 2),
            "single_process_tokens_per_s": round(single, 2),
            "ttft_s_m1": round(results["push"][1], 4), "ttft_s_planned": round(results["push"][2], 4),
            "micro_batches": MICRO_BATCHES, "ttft_s_single_process": round(single_ttft, 4)}


# --- emulated internet links -----------------------------------------------------------------------
# env: (bandwidth per link, bit/s; one-way delay per link, s)
ENVS = {"E1": (1e9, 0.0025), "E2": (500e6, 0.010), "E3": (200e6, 0.020), "E4": (100e6, 0.040), "E5": (20e6, 0.050)}
# config: (route mode, compression, micro-batches: None = the plan's)
CONFIGS = {"baseline": ("hops", False, 1), "beeswarm": ("push", True, None)}
RING_MS = [0, 2, 20, 60, 150, 280]
BATCH, BATCH_PROMPT, BATCH_NEW, SINGLE_NEW = 8, 128, 64, 32
WIDE = {"hidden_size": 2048, "num_layers": 3, "heads": 16, "kv_heads": 4, "intermediate_size": 2048,
        "vocab_size": 512, "max_positions": 1024}


def wide_model() -> str:
    """The `wide` benchmark model (random weights, 2048 wide, 3 layers), written once to the cache."""
    from beeswarm.config import cache_dir
    from tiny_checkpoints import write_tiny_checkpoint

    folder = cache_dir() / "bench-models" / "wide-2048x3"
    if not (folder / "config.json").exists():
        write_tiny_checkpoint(folder, **WIDE)
    return str(folder)


def every_link(names: list[str], delay_s: float) -> dict[str, float]:
    return {name: delay_s for name in names}


def batch_run(client, prompts: list[list[int]], new_tokens: int) -> tuple[float, int, int]:
    """Generate for every prompt at once (one thread each): (tokens/s, wire bytes, raw bytes)."""
    wire0, raw0 = client.traffic
    done: list[int] = []
    t0 = time.perf_counter()
    threads = [threading.Thread(target=lambda ids=ids: done.append(
        len(client.generate(ids, new_tokens, SamplingParams()).generation.tokens))) for ids in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    wire, raw = client.traffic
    return sum(done) / seconds, wire - wire0, raw - raw0


def envs(args) -> list[dict]:
    """Each environment on a fresh swarm, so the planner plans for its links before measuring."""
    model = wide_model()
    prompts = [[(31 * i + 7 * j) % 500 + 1 for j in range(BATCH_PROMPT)] for i in range(BATCH)]
    long_prompt = [(7 * i) % 500 + 1 for i in range(LONG_PROMPT)]
    rows = []
    for env, (rate, delay) in ENVS.items():
        if args.env and env not in args.env:
            continue
        emulated = EmulatedSwarm(model, 3)
        emulated.set_links(every_link(emulated.names, delay), rate)
        try:
            emulated.start()
            client = emulated.client()
            for config, (mode, compress, micro) in CONFIGS.items():
                client.options = dataclasses.replace(client.options, mode=mode, compress=compress,
                                                     micro_batches=micro)
                EmulatedSwarm.settle(client, tries=2)  # open channels for this mode
                batch, wire, raw = batch_run(client, prompts, BATCH_NEW)
                single = decode_rate(client.generate(prompts[0][:16], SINGLE_NEW, SamplingParams()).generation)
                ttft = client.generate(long_prompt, 1, SamplingParams()).generation.ttft_s
                row = {"env": env, "config": config, "batch_tokens_per_s": round(batch, 3),
                       "decode_tokens_per_s": round(single, 3), "ttft_s": round(ttft, 4),
                       "wire_bytes": wire, "raw_bytes": raw}
                print(json.dumps(row), file=sys.stderr, flush=True)
                rows.append(row)
            client.close()
        finally:
            emulated.stop()
    return rows


def ring(args) -> list[dict]:
    """Single-stream decode over rings of growing latency against 1 / (C + T_ring), C measured at 0 ms.

    Each ring gets a fresh swarm (the planner sees its links), its one-way latency split evenly over
    the n + 1 links entry -> s0 -> ... -> entry.
    """
    rows, compute = [], None
    prompt = list(range(1, 17))
    for ring_ms in RING_MS:
        emulated = EmulatedSwarm(wide_model(), 3)
        emulated.set_links(every_link(emulated.names, ring_ms / 1000 / (emulated.n + 1)), None)
        try:
            emulated.start()
            client = emulated.client()
            rate = statistics.median(decode_rate(client.generate(prompt, SINGLE_NEW, SamplingParams()).generation)
                                     for _ in range(args.repeat))
            client.close()
        finally:
            emulated.stop()
        if compute is None:
            compute = 1 / rate
        row = {"ring_ms": ring_ms, "decode_tokens_per_s": round(rate, 3),
               "analytical_tokens_per_s": round(1 / (compute + ring_ms / 1000), 3)}
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", choices=["loopback", "envs", "ring", "all"], default="loopback")
    ap.add_argument("--model", default="tinycode", help="loopback only (envs and ring use the wide model)")
    ap.add_argument("--env", action="append", default=[], help="only these environments (E1..E5)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-report", action="store_true", help="do not regenerate BENCHMARKS.md and the plots")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    RESULTS.mkdir(exist_ok=True)
    scenarios = ["envs", "ring"] if args.scenario == "all" else [args.scenario]
    out: dict[str, object] = {}
    for scenario in scenarios:
        if scenario == "loopback":
            out[scenario] = loopback(args)
            continue
        torch.set_num_threads(threads_per_process(4))
        out[scenario] = {"envs": envs, "ring": ring}[scenario](args)
        saved = {"date": time.strftime("%Y-%m-%d"), "machine": machine(), "rows": out[scenario]}
        if scenario == "envs":
            saved["links"] = ENVS  # the table the rows were measured on, for the report's labels
        (RESULTS / f"{scenario}.json").write_text(json.dumps(saved, indent=1))
    if not args.no_report and any(s != "loopback" for s in scenarios):
        report.render()
    for result in out.values():
        rows = result if isinstance(result, list) else [result]
        for row in rows:
            print(json.dumps(row) if args.json else "  ".join(f"{k}={v}" for k, v in row.items()))


def machine() -> str:
    return (f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, "
            f"torch {torch.__version__}")


if __name__ == "__main__":
    main()
