#!/usr/bin/env python3
"""Speculative decoding over a slow ring: tinycode on 3 local stages behind the link emulator.

Each stage's inbound links carry a one-way delay (130, 40 and 110 ms: a 280 ms ring whatever the
planner's order), the entry's none. Prompts are the starts of held-out stdlib files (the ones
tinycode's training left out). Measures decode tokens/s (after each first token, over all prompts) without
speculation, with chain drafts and with tuned trees, the measured acceptance, and the closed form
`(1 - a^(K+1)) / (1 - a) / (K*c_d + C + T_ring)` at the measured a, c_d and C.

    python benchmarks/spec_bench.py [--json] [--tokens 48] [--prompts 6]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
from train_tinycode import read, stdlib_files  # noqa: E402

from beeswarm.client.swarm import ClientOptions  # noqa: E402
from beeswarm.contributor.local import threads_per_process  # noqa: E402
from beeswarm.decoding.sampling import SamplingParams  # noqa: E402
from beeswarm.spec.draft import DraftModel  # noqa: E402
from beeswarm.spec.tuner import Tuner  # noqa: E402
from emulated import EmulatedSwarm  # noqa: E402

DELAYS_S = {"s0": 0.130, "s1": 0.040, "s2": 0.110, "entry": 0.0}  # one way, into each node
RING_S = sum(DELAYS_S.values())


def prompts(tokenizer, count: int, length: int = 48) -> list[list[int]]:
    _, held_out = stdlib_files()
    out = []
    for path in held_out:
        ids = tokenizer.encode(read(path)[:4 * length])
        if len(ids) >= length:
            out.append(ids[:length])
        if len(out) == count:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(threads_per_process(4))
    emulated = EmulatedSwarm("tinycode", 3, DELAYS_S)
    greedy = SamplingParams()
    rows = {}
    try:
        emulated.start()
        client = emulated.client(ClientOptions(micro_batches=1),
                                 draft=DraftModel("tinycode-draft", emulated.vocab_size()))
        tokenizer = AutoTokenizer.from_pretrained(str(client.entry.folder))
        try:
            texts = prompts(tokenizer, args.prompts)
            for name, speculate, tuner in (("plain", False, None), ("chain", True, Tuner(width=1)),
                                           ("tree", True, Tuner())):
                client.speculate, client.tuner = speculate, tuner or Tuner()
                decoded, seconds, reports = 0, 0.0, []
                for ids in texts:
                    out = client.generate(ids, args.tokens, greedy)
                    decoded += len(out.generation.tokens) - 1
                    seconds += out.generation.seconds - out.generation.ttft_s
                    reports.append((out.spec, len(out.generation.tokens) - 1))
                    if out.spec:
                        g = out.generation
                        print(f"  {name}: {out.spec.rounds} rounds, {len(g.tokens)} tokens, "
                              f"{(g.seconds - g.ttft_s) / out.spec.rounds * 1000:.0f} ms/round, "
                              f"recoveries {out.recoveries}", file=sys.stderr, flush=True)
                rows[name] = (decoded / seconds, client.tuner, reports)
                print(f"{name}: {rows[name][0]:.2f} tok/s", file=sys.stderr, flush=True)
        finally:
            client.close()
    finally:
        emulated.stop()
    plain = rows["plain"][0]
    chain_tuner, chain_reports = rows["chain"][1], rows["chain"][2]
    a = sum(chain_tuner.stats.accepted.values()) / max(1, sum(chain_tuner.stats.tried.values()))
    c_d = chain_tuner.costs.draft_level_s
    depth = statistics.median(r.as_json()["spec"]["depth"] for r, _ in chain_reports)
    # C: a chain round's time past the draft as the tuner measured it, less the ring's latency
    costs = chain_tuner.costs
    compute = max(0.0, costs.fixed_s + costs.per_token_s * (depth + 1) - RING_S)

    def closed_form(a: float, k: float) -> float:
        return (1 - a ** (k + 1)) / (1 - a) / (k * c_d + compute + RING_S)

    # Prompts differ a lot in acceptance, and the measured rate is tokens over time summed over them:
    # so the closed form is taken per prompt (its own a and K) and summed the same way.
    predicted_s = sum(n / closed_form(min(0.999, sum(r.accepted) / max(1, sum(r.tried))), r.as_json()["spec"]["depth"])
                      for r, n in chain_reports)
    closed = sum(n for _, n in chain_reports) / predicted_s
    row = {"plain_tokens_per_s": round(plain, 3), "chain_tokens_per_s": round(rows["chain"][0], 3),
           "tree_tokens_per_s": round(rows["tree"][0], 3), "acceptance": round(a, 4),
           "closed_form_tokens_per_s": round(closed, 3),
           "ratio_to_closed_form": round(rows["chain"][0] / closed, 3),
           "closed_form_at_pooled_a_tokens_per_s": round(closed_form(a, depth), 3),
           "chain_depth": depth, "draft_level_s": round(c_d, 4), "compute_s": round(compute, 4), "ring_s": RING_S,
           "plain_pass_s": round(1 / plain, 4),
           "tree_shape": rows["tree"][2][-1][0].as_json()["spec"], "speedup_tree": round(rows["tree"][0] / plain, 2),
           "speedup_chain": round(rows["chain"][0] / plain, 2), "unknown_dialers": emulated.emu.unknown_dialers,
           "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(row) if args.json else "\n".join(f"{k:28} {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
