"""The `beeswarm` command line."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import beeswarm

log = logging.getLogger("beeswarm")


SWARM_SECRET = "swarm-secret"
SWARM_SECRET_ENV = "BEESWARM_SWARM_SECRET"


class UserError(Exception):
    """A problem the user can fix; printed without a traceback, exit status 2."""


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token (default: sample)")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T")
    p.add_argument("--top-p", type=float, default=0.95, metavar="P")
    p.add_argument("--seed", type=int, default=None, metavar="S")


def _sampling(args):
    from beeswarm.client.sampling import SamplingParams

    try:
        return SamplingParams(0.0 if args.greedy else args.temperature, 1.0 if args.greedy else args.top_p, args.seed)
    except ValueError as e:
        raise UserError(str(e)) from None


def cmd_demo(args) -> int:
    """Generate with the whole model chained through three spans in this process."""
    from transformers import AutoTokenizer

    from beeswarm.client.generate import generate
    from beeswarm.client.local import LocalPipeline
    from beeswarm.client.textstream import TextStream

    if args.max_new_tokens < 1:
        raise UserError("--max-new-tokens must be at least 1")
    params = _sampling(args)
    pipeline = LocalPipeline(args.model, stages=3, dtype=args.dtype, device=args.device)
    tokenizer = AutoTokenizer.from_pretrained(str(pipeline.folder))
    log.info("demo: %s in %d spans: %s", args.model, len(pipeline.spans),
             ", ".join(f"[{s.span.start}, {s.span.end})" for s in pipeline.spans))

    def run(prompt: str) -> dict:
        ids = tokenizer.encode(prompt)
        if not ids:
            raise UserError("the prompt is empty")
        needed = len(ids) + args.max_new_tokens
        if needed > pipeline.max_length:
            raise UserError(f"prompt ({len(ids)} tokens) + --max-new-tokens exceeds the model's "
                            f"{pipeline.max_length}-token context")
        stream = TextStream(tokenizer)
        echo = (lambda t: print(stream.push(t), end="", flush=True)) if not args.json else stream.push
        session = pipeline.open(needed)
        try:
            out = generate(lambda tok, start: pipeline.forward(session, tok, start), ids, args.max_new_tokens,
                           params, stop_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [],
                           on_token=echo)
        finally:
            pipeline.close(session)
        return {"text": stream.text, "tokens": out.tokens, "new_tokens": len(out.tokens),
                "seconds": round(out.seconds, 4), "tokens_per_s": round(out.tokens_per_s, 2),
                "ttft_s": round(out.ttft_s, 4)}

    if args.prompt is not None:
        result = run(args.prompt)
        print(json.dumps(result) if args.json else "")
        return 0
    if not sys.stdin.isatty():
        raise UserError("give --prompt TEXT (reading prompts line by line needs a terminal)")
    print(f"beeswarm demo: {args.model}, {len(pipeline.spans)} spans. One prompt per line; Ctrl-D leaves.",
          file=sys.stderr)
    for line in sys.stdin:
        if line.strip():
            print(line.rstrip("\n"), end="", flush=True)
            result = run(line.rstrip("\n"))
            print(f"\n[{result['new_tokens']} tokens, {result['tokens_per_s']} tok/s]", file=sys.stderr)
    return 0


def cmd_plan(args) -> int:
    """Plan a cluster described in JSON: who hosts which layers, and how fast it will be."""
    from beeswarm.coordinator.cluster import ClusterError, parse_cluster
    from beeswarm.coordinator.planner import PlanError, plan

    try:
        text = sys.stdin.read() if args.cluster == "-" else open(args.cluster, encoding="utf-8").read()
    except OSError as e:
        raise UserError(f"cannot read {args.cluster}: {e.strerror}") from None
    try:
        data = json.loads(text)
    except ValueError as e:
        raise UserError(f"{args.cluster}: not valid JSON ({e})") from None
    try:
        result = plan(parse_cluster(data))
    except (ClusterError, PlanError) as e:
        raise UserError(f"{args.cluster}: {e}") from None
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    print(f"objective: {result.objective}   solved in {result.solve_ms:.1f} ms ({'exact' if result.exact else 'heuristic'})")
    for i, p in enumerate(result.pipelines):
        print(f"\npipeline {i + 1}: {p.micro_batches} micro-batch(es), step {p.step_ms:.2f} ms, "
              f"{p.tokens_per_s:.2f} tokens/s")
        print(f"  {'node':24} {'layers':>12} {'offload':>8}")
        for s in p.stages:
            print(f"  {s.node:24} {f'[{s.start}, {s.end})':>12} {s.offload_fraction:>7.0%}")
    if len(result.pipelines) > 1:
        print(f"\ntotal: {result.tokens_per_s:.2f} tokens/s")
    for node, reason in result.excluded:
        print(f"left out: {node}: {reason}")
    return 0


def cmd_bench(args) -> int:
    """Measure this machine for the planner: per-layer compute, memory, offload bandwidth."""
    from dataclasses import asdict

    from beeswarm.shard import benchmark

    result = benchmark.run(args.model, args.device, args.dtype, refresh=args.refresh,
                           progress=lambda line: print(line, file=sys.stderr, flush=True))
    if args.json:
        print(json.dumps(asdict(result)))
        return 0
    offload = f"{result.offload_gbps} GB/s" if result.offload_gbps else "n/a (CPU)"
    print(f"{result.model} on {result.device} ({result.dtype}){' [cached]' if result.cached else ''}\n"
          f"  per layer:  {result.layer_ms_base:.3f} ms + {result.layer_ms_per_token:.4f} ms/token\n"
          f"  memory:     {result.mem_bytes / 2**30:.1f} GiB free, {result.host_mem_bytes / 2**30:.1f} GiB host\n"
          f"  offload:    {offload}\n"
          f"  layer size: {result.layer_bytes / 2**20:.1f} MiB, KV {result.kv_bytes_per_token_layer} B/token/layer")
    return 0


def cmd_identity(args) -> int:
    """Show or replace this machine's node key, or set the swarm secret."""
    from beeswarm import secrets
    from beeswarm.p2p import identity

    try:
        if args.action == "show":
            me = identity.load_or_create()
            secret = secrets.load(SWARM_SECRET, SWARM_SECRET_ENV)
            print(f"peer id:      {me.peer_id}")
            print(f"key stored:   {me.location}")
            print(f"swarm secret: {secret.location if secret else 'none (open swarms only)'}")
        elif args.action == "reset":
            if not args.yes:
                if not sys.stdin.isatty():
                    raise UserError("identity reset changes this node's peer id: pass --yes to confirm")
                if input("Replace this node's key? Its peer id will change. [y/N] ").strip().lower() != "y":
                    print("kept the current key")
                    return 1
            me = identity.reset()
            print(f"new peer id: {me.peer_id} (key stored: {me.location})")
        elif args.action == "secret":
            if args.clear:
                secrets.delete(SWARM_SECRET)
                print("swarm secret removed")
                return 0
            if sys.stdin.isatty():
                import getpass

                value = getpass.getpass("swarm secret: ")
            else:
                value = sys.stdin.readline().rstrip("\n")
            if len(value) < 8:
                raise UserError("a swarm secret needs at least 8 characters")
            print(f"swarm secret stored: {secrets.store(SWARM_SECRET, value.encode())}")
    except secrets.SecretError as e:
        raise UserError(str(e)) from None
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="beeswarm", description="Run one large language model across volunteer machines.")
    parser.add_argument("--version", action="version", version=f"beeswarm {beeswarm.__version__}")
    parser.add_argument("--log-level", default=os.environ.get("BEESWARM_LOG_LEVEL", "WARNING"),
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log detail on stderr")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    demo = sub.add_parser("demo", help="generate text with the whole model on this machine")
    demo.add_argument("--model", default="tinycode", help="built-in name, checkpoint folder or hub id (org/name)")
    demo.add_argument("--prompt", default=None, help="generate once for TEXT (default: read prompts line by line)")
    _add_sampling(demo)
    demo.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    demo.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    demo.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    demo.set_defaults(func=cmd_demo)

    plan = sub.add_parser("plan", help="plan who hosts which layers for a cluster described in JSON")
    plan.add_argument("--cluster", required=True, metavar="FILE", help="cluster JSON (see DESIGN.md), - for stdin")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=cmd_plan)

    bench = sub.add_parser("bench", help="measure this machine's speed and memory for a model's layers")
    bench.add_argument("--model", default="tinycode", help="built-in name, checkpoint folder or hub id")
    bench.add_argument("--device", default="auto", help="auto, cpu or cuda:N")
    bench.add_argument("--dtype", default="auto", help="auto, float32, float16 or bfloat16")
    bench.add_argument("--refresh", action="store_true", help="measure again instead of using the cache")
    bench.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    bench.set_defaults(func=cmd_bench)

    ident = sub.add_parser("identity", help="this node's peer id and key, and the swarm secret")
    ident_sub = ident.add_subparsers(dest="action", metavar="ACTION")
    ident_sub.required = True
    ident_sub.add_parser("show", help="print the peer id and where the key and secret live")
    reset = ident_sub.add_parser("reset", help="make a new key (the peer id changes)")
    reset.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    secret = ident_sub.add_parser("secret", help="set the private-swarm secret (read from the terminal or stdin)")
    group = secret.add_mutually_exclusive_group(required=True)
    group.add_argument("--set", action="store_true", help="store a new secret")
    group.add_argument("--clear", action="store_true", help="forget the stored secret")
    ident.set_defaults(func=cmd_identity)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    if args.log_level != "DEBUG":  # py-libp2p logs expected network churn at WARNING/ERROR
        for noisy in ("libp2p", "root", "multiaddr"):
            logging.getLogger(noisy).setLevel(logging.CRITICAL)
    from beeswarm.shard.errors import ShardError

    try:
        return args.func(args)
    except (UserError, ShardError) as e:
        print(f"beeswarm: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
