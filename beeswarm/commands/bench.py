"""`beeswarm bench`: measure this machine for the planner (per-layer compute, memory, offload bandwidth)."""
from __future__ import annotations

import argparse
import json
import sys

from beeswarm.commands import options


def add_parser(sub) -> argparse.ArgumentParser:
    bench = sub.add_parser("bench", help="measure this machine's speed and memory for a model's layers")
    bench.add_argument("--model", default="tinycode", help="built-in name, checkpoint folder or hub id")
    options.add_device(bench)
    options.add_quant(bench)
    bench.add_argument("--refresh", action="store_true", help="measure again instead of using the cache")
    bench.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    bench.set_defaults(func=run)
    return bench


def run(args) -> int:
    """Measure this machine for the planner: per-layer compute, memory, offload bandwidth."""
    from dataclasses import asdict

    from beeswarm.shard import benchmark

    result = benchmark.run(args.model, args.device, args.dtype, refresh=args.refresh, weights=args.quant,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(asdict(result)))
        return 0
    offload = f"{result.offload_gbps} GB/s" if result.offload_gbps else "n/a (CPU)"
    print(f"{result.model} on {result.device} ({result.dtype}){' [cached]' if result.cached else ''}\n"
          f"  per layer:  {result.layer_ms_base:.3f} ms + {result.layer_ms_per_token:.4f} ms/token\n"
          f"  memory:     {result.mem_bytes / 2**30:.1f} GiB free, {result.host_mem_bytes / 2**30:.1f} GiB host\n"
          f"  offload:    {offload}\n"
          f"  layer size: {result.layer_bytes / 2**20:.1f} MiB"
          f"{f' ({result.quant} weights)' if result.quant != 'none' else ''}, "
          f"KV {result.kv_bytes_per_token_layer} B/token/layer")
    return 0
