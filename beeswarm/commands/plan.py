"""`beeswarm plan`: plan a cluster described in JSON (who hosts which layers, and how fast it will be)."""
from __future__ import annotations

import argparse
import json
import sys

from beeswarm.commands.common import UserError


def add_parser(sub) -> argparse.ArgumentParser:
    plan = sub.add_parser("plan", help="plan who hosts which layers for a cluster described in JSON")
    plan.add_argument("--cluster", required=True, metavar="FILE", help="cluster JSON (see DESIGN.md), - for stdin")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=run)
    return plan


def run(args) -> int:
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
    how = "exact" if result.exact else "heuristic"
    print(f"objective: {result.objective}   solved in {result.solve_ms:.1f} ms ({how})")
    for i, p in enumerate(result.pipelines):
        print(f"\npipeline {i + 1}: {p.micro_batches} micro-batch(es), step {p.step_ms:.2f} ms, "
              f"{p.tokens_per_s:.2f} tokens/s")
        print(f"  {'node':24} {'layers':>12} {'offload':>8}")
        for s in p.stages:
            print(f"  {s.node:24} {str(s.span):>12} {s.offload_fraction:>7.0%}")
    if len(result.pipelines) > 1:
        print(f"\ntotal: {result.tokens_per_s:.2f} tokens/s")
    for left_out in result.excluded:
        print(f"left out: {left_out.node}: {left_out.reason}")
    return 0
