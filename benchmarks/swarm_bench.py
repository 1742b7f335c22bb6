#!/usr/bin/env python3
"""Swarm benchmark on loopback: a 3-process local swarm against the same model in one process.

Measures single-stream decode tokens/s (after the first token) and the time to first token for a
512-token prompt (in one piece, and cut into 4 micro-batches that pipeline across the stages),
through the push chain and through client hops.

    python benchmarks/swarm_bench.py --scenario loopback [--model tinycode] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

from beeswarm.client.generate import generate
from beeswarm.client.local import LocalPipeline
from beeswarm.client.sampling import SamplingParams
from beeswarm.client.swarm import SwarmClient
from beeswarm.contributor.local import LocalSwarm, threads_per_process
from beeswarm.shard import EntryModel

DECODE_TOKENS = 64
LONG_PROMPT = 512
# The planner's latency objective plans M = 1 for one stream; prefill is measured cut into 4 chunks.
MICRO_BATCHES = 4


def decode_rate(gen) -> float:
    return (len(gen.tokens) - 1) / (gen.seconds - gen.ttft_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", choices=["loopback"], default="loopback")
    ap.add_argument("--model", default="tinycode")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
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
    swarm = LocalSwarm(3, args.model, heartbeat=1.0)
    results = {}
    try:
        bootstrap = swarm.start()
        swarm.wait_ready()
        entry = EntryModel.load(args.model, "float32", "cpu")
        for mode in ("push", "hops"):
            client = SwarmClient(entry, [bootstrap], interval=1.0, mode=mode, listen=["/ip4/127.0.0.1/tcp/0"],
                                 micro_batches=1)
            try:
                client.generate(prompt, 4, greedy)  # warm up channels and codec calibration
                rate = statistics.median(decode_rate(client.generate(prompt, DECODE_TOKENS, greedy).generation)
                                         for _ in range(args.repeat))
                ttft = statistics.median(client.generate(long_prompt, 1, greedy).generation.ttft_s
                                         for _ in range(args.repeat))
                client.micro_batches = MICRO_BATCHES
                ttft_m4 = statistics.median(client.generate(long_prompt, 1, greedy).generation.ttft_s
                                            for _ in range(args.repeat)) if mode == "push" else None
            finally:
                client.close()
            results[mode] = (rate, ttft, ttft_m4)
    finally:
        swarm.stop()
    row = {"scenario": args.scenario, "model": args.model,
           "swarm_tokens_per_s": round(results["push"][0], 2),
           "client_hops_tokens_per_s": round(results["hops"][0], 2),
           "single_process_tokens_per_s": round(single, 2),
           "ttft_s_m1": round(results["push"][1], 4), "ttft_s_planned": round(results["push"][2], 4),
           "micro_batches": MICRO_BATCHES, "ttft_s_single_process": round(single_ttft, 4)}
    if args.json:
        print(json.dumps(row))
    else:
        for k, v in row.items():
            print(f"{k:30} {v}")


if __name__ == "__main__":
    main()
