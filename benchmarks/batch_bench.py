"""Batching across sessions at a Llama-3.2-1B shape: N users at once through stages that batch their steps, against
the same stages serving one session at a time (#43).

A random checkpoint of the 1B shape (16 layers, 2048 wide, 8192 MLP, 32 heads, 8 KV heads; a byte vocabulary, so
the entry costs nothing beside the stages) is served by `--stages` stage servers on real nodes on 127.0.0.1 in this
process, each computing on `--threads` threads. `--users` sessions generate `--tokens` greedy tokens each at once
(a prompt of 16), in each mode:

- `one`: each stage runs one session's step a pass (`Batching(max_batch=1)`), as Petals' task pool does;
- `batched`: a pass takes every session's step that has arrived (the stage before the batch window);
- `window`: and a compute-bound stage waits a little for the sessions not in hand (`contributor.batching`).

Figures per mode: the aggregate (all new tokens over the wall time from the first request to the last token), per
user tokens/s (median, worst), the time to first token (median, worst), steps per pass at each stage, and each
stage's share of the time computing. In float32 every user's tokens must be equal across modes (a batch changes no
token); in bfloat16 the kernels' rounding depends on the batch's shape, and the share of users whose tokens are
equal in every mode is reported.

    python benchmarks/batch_bench.py [--users 8] [--tokens 16] [--stages 2] [--dtype bfloat16] [--threads 1]
                                     [--modes one batched window] [--json]
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers shared with the tests

from beeswarm.client.dataplane import Inbox, RemotePipeline
from beeswarm.contributor.batching import Batching
from beeswarm.contributor.stage import StageServer
from beeswarm.generation.generate import generate
from beeswarm.generation.sampling import SamplingParams
from beeswarm.p2p import identity
from beeswarm.p2p.node import Node, NodeConfig
from beeswarm.protocol.coordinator import Stage
from beeswarm.protocol.spans import even_splits
from beeswarm.shard import EntryModel, SpanRuntime
from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
MODES = {"one": lambda: Batching(max_batch=1, window=False), "batched": lambda: Batching(window=False),
         "window": Batching}


def run_mode(folder: Path, mode: str, args) -> dict:
    spans = even_splits(args.layers, args.stages)
    nodes = [Node(identity.ephemeral(), NodeConfig(listen=LOCAL)).start() for _ in range(args.stages + 1)]
    *stage_nodes, entry_node = nodes
    servers = []
    try:
        for node, span in zip(stage_nodes, spans):
            server = StageServer(node, SpanRuntime(folder, span, args.dtype, "cpu"))
            server.queue.batching = MODES[mode]()
            servers.append(server.start())
        for node in stage_nodes:
            entry_node.connect(node.addrs[0])
        for a, b in itertools.pairwise(stage_nodes):
            a.connect(b.addrs[0])
        route = tuple(Stage(node=n.peer_id, span=s) for n, s in zip(stage_nodes, spans))
        pipe = RemotePipeline(entry_node, Inbox(entry_node).start(), EntryModel(folder, "float32", "cpu"), route)
        prompts = [[1 + (u * 7 + i) % 250 for i in range(16)] for u in range(args.users)]
        session = pipe.open(64)  # warm up every stage's kernels and links first
        generate(lambda t, s: pipe.forward(session, t, s), prompts[0][:4], 2, SamplingParams())
        pipe.close_session(session)
        for server in servers:
            server.queue.batching = MODES[mode]()  # the figures start here
        tokens: dict[int, list[int]] = {}
        ended: dict[int, float] = {}
        first: dict[int, float] = {}
        t0 = time.perf_counter()

        def user(u: int) -> None:
            session = pipe.open(64)
            got = generate(lambda t, s: pipe.forward(session, t, s), prompts[u], args.tokens, SamplingParams(),
                           on_token=lambda _: first.setdefault(u, time.perf_counter()))
            ended[u] = time.perf_counter()
            tokens[u] = got.tokens
            pipe.close_session(session)

        threads = [threading.Thread(target=user, args=(u,)) for u in range(args.users)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = max(ended.values()) - t0
        per_user = sorted(len(tokens[u]) / (ended[u] - t0) for u in range(args.users))
        return {
            "mode": mode, "aggregate_tokens_per_s": round(sum(map(len, tokens.values())) / wall, 3),
            "per_user_median": round(statistics.median(per_user), 3), "per_user_worst": round(per_user[0], 3),
            "wall_s": round(wall, 2), "first_token_s_median": round(statistics.median(first.values()) - t0, 2),
            "first_token_s_worst": round(max(first.values()) - t0, 2),
            "steps_per_pass": [round(s.queue.batching.steps / max(1, s.queue.batching.passes), 2) for s in servers],
            "computing_share": [round(s.queue.batching.compute_s / wall, 3) for s in servers],
            "tokens": [tokens[u] for u in range(args.users)],
        }
    finally:
        for server in servers:
            server.stop()
        for node in nodes:
            node.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--stages", type=int, default=2)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the stages share them)")
    parser.add_argument("--dtype", default="bfloat16", help="the stages' (the entry computes in float32)")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"writing a {args.layers}-layer checkpoint of the 1B shape ...", file=sys.stderr, flush=True)
        folder = write_tiny_checkpoint(Path(tmp) / "1b", num_layers=args.layers, hidden_size=2048, heads=32,
                                       kv_heads=8, intermediate_size=8192, initializer_range=0.02)
        results = []
        for mode in args.modes:
            result = run_mode(folder, mode, args)
            print(json.dumps({k: v for k, v in result.items() if k != "tokens"}), file=sys.stderr, flush=True)
            results.append(result)
    same = all(r["tokens"] == results[0]["tokens"] for r in results)
    agree = min(sum(a == b for a, b in zip(r["tokens"], results[0]["tokens"])) for r in results) / args.users
    one = next((r for r in results if r["mode"] == "one"), None)
    summary = {"users": args.users, "tokens": args.tokens, "stages": args.stages, "layers": args.layers,
               "threads": args.threads, "dtype": args.dtype, "same_tokens_in_every_mode": same,
               "users_with_the_same_tokens_in_every_mode": agree,
               "modes": [{k: v for k, v in r.items() if k != "tokens"} for r in results]}
    if one is not None:
        summary["vs_one_at_a_time"] = {r["mode"]: round(r["aggregate_tokens_per_s"] / one["aggregate_tokens_per_s"], 2)
                                       for r in results}
    print(json.dumps(summary, indent=None if args.json else 2))
    if not same and args.dtype == "float32":  # bf16's rounding depends on the batch's shape (BENCHMARKS.md)
        sys.exit("a mode changed some user's tokens")


if __name__ == "__main__":
    main()
