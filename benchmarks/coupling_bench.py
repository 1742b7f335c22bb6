#!/usr/bin/env python3
"""How often the target takes a sampled draft's candidates: position-keyed noise (what beeswarm samples with)
against multi-candidate rejection sampling (what it sampled with before).

tinycode's target and its distilled draft read one sequence the target sampled itself; at every position,
over `--draws` noise draws:
- noise: the target's token is argmax(log p + G), the draft's candidates the top 1 or 2 of log q + G (the
  same G); a candidate is taken when it is the target's token;
- rejection: one candidate drawn from q, taken with probability sum(min(p, q)); a second one drawn again
  from q and tried on the residual (its chance of acceptance, computed exactly, not sampled).

    python benchmarks/coupling_bench.py [--temperatures 0.6 0.8 1.0] [--tokens 300] [--draws 50] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers shared with the tests
from beeswarm.generation.sampling import Noise, SamplingParams, probabilities
from local_pipeline import LocalPipeline  # noqa: E402

PROMPT = [5, 100, 200, 33, 7, 9]


def taken(target: LocalPipeline, draft: LocalPipeline, params: SamplingParams, tokens: int,
          draws: int) -> dict[str, float]:
    torch.manual_seed(0)
    seq = list(PROMPT)
    while len(seq) < tokens:  # a sequence the target itself samples
        s = target.open(tokens + 1)
        seq.append(int(torch.multinomial(probabilities(target.forward(s, torch.tensor(seq), 0)[-1], params), 1)))
        target.close(s)
    s, d = target.open(tokens + 1), draft.open(tokens + 1)
    p = probabilities(target.forward(s, torch.tensor(seq), 0), params).double()
    q = probabilities(draft.forward(d, torch.tensor(seq), 0), params).double()
    target.close(s)
    draft.close(d)
    first = both = 0.0
    for seed in range(draws):
        noise = Noise(seed)
        for t in range(len(seq)):
            chosen = int(noise.scores(p[t], t).argmax())
            ranked = noise.scores(q[t], t).topk(2).indices.tolist()
            first += ranked[0] == chosen
            both += chosen in ranked
    n = draws * len(seq)
    one = torch.minimum(p, q).sum(-1)
    residual = (p - q).clamp(min=0)
    residual = residual / residual.sum(-1, keepdim=True).clamp_min(1e-300)
    two = one + (1 - one) * torch.minimum(residual, q).sum(-1)
    return {"noise_first": round(first / n, 3), "noise_first_two": round(both / n, 3),
            "rejection_one": round(float(one.mean()), 3), "rejection_two": round(float(two.mean()), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.6, 0.8, 1.0])
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--draws", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    target = LocalPipeline("tinycode", stages=1, dtype="float32", device="cpu")
    draft = LocalPipeline("tinycode-draft", stages=1, dtype="float32", device="cpu")
    rows = {str(t): taken(target, draft, SamplingParams(temperature=t, top_p=args.top_p), args.tokens, args.draws)
            for t in args.temperatures}
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'temperature':>11} {'noise: 1st':>10} {'1st or 2nd':>10} {'rejection: 1':>12} {'2':>6}")
    for t, r in rows.items():
        print(f"{t:>11} {r['noise_first']:>10} {r['noise_first_two']:>10} {r['rejection_one']:>12} "
              f"{r['rejection_two']:>6}")


if __name__ == "__main__":
    main()
