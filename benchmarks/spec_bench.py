#!/usr/bin/env python3
"""Speculative decoding over a slow ring: tinycode on 3 local stages behind the link emulator.

Each stage's inbound links carry a one-way delay (`--ring 280`: 130, 40 and 110 ms, the entry's none:
a 280 ms ring whatever the planner's order; `--ring 160`: 40 ms into every node, the entry too, at
100 Mbit/s). Prompts are the starts of held-out stdlib files (the ones tinycode's training left out).
Measures decode tokens/s (after each first token, over all prompts) without speculation (pushed through
the stages, and by client hops, Petals' routing), with chain
drafts, with tuned trees in serial rounds and pipelined (the tuner choosing how many steps to keep in
flight, 1 included), the measured acceptance, and the closed form
`(1 - a^(K+1)) / (1 - a) / (K*c_d + C + T_ring)` at the measured a, c_d and C. Per mode: the stages'
compute share (`busy`, from their heartbeats), the entry's wire bytes per token, and for speculation
the steps sent, cancelled, and the share of computed positions that were in cancelled steps.
`--sweep`: serial trees against pipelined on the 280 ms ring's shape scaled to 0-280 ms (each prompt three
times on rings of 80 ms and less, where a mode takes seconds and runs are noisy).

    python benchmarks/spec_bench.py [--json] [--tokens 48] [--prompts 6] [--ring 280|160] [--sweep] [--pinned D]
                                    [--draft REF]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "scripts"))
from train_tinycode import read, stdlib_files  # noqa: E402

from beeswarm.client.swarm import ClientOptions  # noqa: E402
from beeswarm.contributor.local_swarm import threads_per_process  # noqa: E402
from beeswarm.generation.sampling import SamplingParams  # noqa: E402
from beeswarm.spec.draft import DraftModel  # noqa: E402
from beeswarm.spec.tuner import MAX_IN_FLIGHT, Tuner  # noqa: E402
from emulated import EmulatedSwarm  # noqa: E402

DELAYS_S = {"s0": 0.130, "s1": 0.040, "s2": 0.110, "entry": 0.0}  # one way, into each node
RING_S = sum(DELAYS_S.values())
RINGS = {"280": (DELAYS_S, None), "160": ({"s0": 0.04, "s1": 0.04, "s2": 0.04, "entry": 0.04}, 100e6)}
SWEEP_MS = (0, 40, 80, 160, 280)  # the 280 ms ring's shape, scaled


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


class BusySampler:
    """The stages' own compute share (`busy` in their heartbeats, a 5 s window), sampled twice a second."""

    def __init__(self, client):
        self.client, self.samples, self.stop = client, [], threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stop.wait(0.5):
            view = self.client.members.view()
            busy = [info.busy for info in view.values() if info.role == "contributor" and info.spans]
            if busy:
                self.samples.append((time.monotonic(), statistics.mean(busy)))

    def mean(self, since: float, until: float) -> float | None:
        got = [b for t, b in self.samples if since + 5 <= t <= until]  # past the first window of the mode
        return round(statistics.mean(got), 3) if got else None


def run_mode(client, texts, tokens: int, name: str, speculate: bool, tuner: Tuner | None, in_flight: int,
             sampler: BusySampler, passes: int = 1, route: str = "push") -> dict:
    """Decode each prompt `passes` times (one tuner throughout) and sum: short rings are noisy (one serial plan
    measured 78-89 tokens/s in two runs at 0 ms)."""
    client.speculate, client.drafting.tuner = speculate, tuner or Tuner()
    client.options = dataclasses.replace(client.options, max_in_flight=in_flight, mode=route)
    decoded, seconds, reports = 0, 0.0, []
    wire0, t0 = client.traffic[0], time.monotonic()
    for ids in texts * passes:
        out = client.generate(ids, tokens, SamplingParams())
        decoded += len(out.generation.tokens) - 1
        seconds += out.generation.seconds - out.generation.ttft_s
        reports.append((out.spec, len(out.generation.tokens) - 1))
        if out.spec:
            g = out.generation
            print(f"  {name}: {out.spec.rounds} rounds, {out.spec.steps} steps ({out.spec.cancelled} cancelled), "
                  f"{len(g.tokens)} tokens, recoveries {out.recoveries}", file=sys.stderr, flush=True)
    row = {"tokens_per_s": round(decoded / seconds, 3), "busy": sampler.mean(t0, time.monotonic()),
           "wire_bytes_per_token": round((client.traffic[0] - wire0) / max(1, decoded)),
           "tuner": client.drafting.tuner, "reports": reports}
    specs = [r for r, _ in reports if r is not None]
    if specs:
        sent = sum(r.rows_sent for r in specs)
        row.update(steps=sum(r.steps for r in specs), cancelled=sum(r.cancelled for r in specs),
                   rows_sent=sent, rows_cancelled_share=round(sum(r.rows_cancelled for r in specs) / max(1, sent), 3),
                   plan=specs[-1].plan.as_json() if specs[-1].plan else None)
    print(f"{name}: {row['tokens_per_s']:.2f} tok/s, busy {row['busy']}", file=sys.stderr, flush=True)
    return row


def public(row: dict) -> dict:
    return {k: v for k, v in row.items() if k not in ("tuner", "reports")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--ring", choices=sorted(RINGS), default="280")
    ap.add_argument("--sweep", action="store_true", help="serial trees against pipelined on rings of 0-280 ms")
    ap.add_argument("--pinned", type=int, default=0, metavar="D",
                    help="also run with D steps always in flight (the tuner choosing only their shapes)")
    ap.add_argument("--draft", default="tinycode-draft", help="the draft to speculate with (a folder or a name)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(threads_per_process(4))
    delays, rate_bps = RINGS[args.ring]
    emulated = EmulatedSwarm("tinycode", 3, delays, rate_bps)
    rows = {}
    try:
        emulated.start()
        client = emulated.client(ClientOptions(micro_batches=1),
                                 draft=DraftModel(args.draft, emulated.vocab_size()))
        sampler = BusySampler(client)
        tokenizer = AutoTokenizer.from_pretrained(str(client.entry.folder))
        texts = prompts(tokenizer, args.prompts)
        try:
            if args.sweep:
                sweep = []
                for ring_ms in SWEEP_MS:
                    emulated.set_links({k: v * ring_ms / 280 for k, v in DELAYS_S.items()})
                    passes = 3 if ring_ms <= 80 else 1
                    tree = run_mode(client, texts, args.tokens, f"tree@{ring_ms}", True, None, 1, sampler, passes)
                    piped = run_mode(client, texts, args.tokens, f"pipelined@{ring_ms}", True, None, MAX_IN_FLIGHT,
                                     sampler, passes)
                    sweep.append({"ring_ms": ring_ms, "tree": public(tree), "pipelined": public(piped),
                                  "ratio": round(piped["tokens_per_s"] / tree["tokens_per_s"], 3)})
                print(json.dumps({"sweep": sweep, "date": time.strftime("%Y-%m-%d")}, indent=None if args.json else 1))
                return
            modes = [("plain", False, None, 1), ("chain", True, Tuner(width=1), 1), ("tree", True, None, 1),
                     ("pipelined", True, None, MAX_IN_FLIGHT)]
            if args.pinned:  # steps in flight whatever the tuner would choose: what pipelining gives when forced
                modes.append((f"pipelined-{args.pinned}", True, Tuner(in_flight=args.pinned), args.pinned))
            for name, speculate, tuner, in_flight in modes:
                rows[name] = run_mode(client, texts, args.tokens, name, speculate, tuner, in_flight, sampler)
            # Petals' routing (back to the entry after every stage), without speculation: what the issue's
            # "x client hops" figures divide by
            rows["hops"] = run_mode(client, texts, args.tokens, "hops", False, None, 1, sampler, route="hops")
        finally:
            sampler.stop.set()
            client.close()
    finally:
        emulated.stop()
    ring_s = sum(delays.values())
    plain = rows["plain"]["tokens_per_s"]
    chain_tuner, chain_reports = rows["chain"]["tuner"], rows["chain"]["reports"]
    a = sum(chain_tuner.stats.accepted.values()) / max(1, sum(chain_tuner.stats.tried.values()))
    c_d = chain_tuner.costs.draft_level_s
    depth = statistics.median(r.as_json()["spec"]["depth"] for r, _ in chain_reports)
    # C: a chain round's time past the draft as the tuner measured it, less the ring's latency
    costs = chain_tuner.costs
    compute = max(0.0, costs.fixed_s + costs.per_token_s * (depth + 1) - ring_s)

    def closed_form(a: float, k: float) -> float:
        return (1 - a ** (k + 1)) / (1 - a) / (k * c_d + compute + ring_s)

    # Prompts differ a lot in acceptance, and the measured rate is tokens over time summed over them:
    # so the closed form is taken per prompt (its own a and K) and summed the same way.
    predicted_s = sum(n / closed_form(min(0.999, sum(r.accepted) / max(1, sum(r.tried))), r.as_json()["spec"]["depth"])
                      for r, n in chain_reports)
    closed = sum(n for _, n in chain_reports) / predicted_s
    tree, piped = rows["tree"]["tokens_per_s"], rows["pipelined"]["tokens_per_s"]
    row = {"ring": args.ring, "plain_tokens_per_s": round(plain, 3),
           "chain_tokens_per_s": rows["chain"]["tokens_per_s"], "tree_tokens_per_s": tree,
           "pipelined_tokens_per_s": piped, "pipelined_over_tree": round(piped / tree, 3),
           "acceptance": round(a, 4), "closed_form_tokens_per_s": round(closed, 3),
           "ratio_to_closed_form": round(rows["chain"]["tokens_per_s"] / closed, 3),
           "closed_form_at_pooled_a_tokens_per_s": round(closed_form(a, depth), 3),
           "chain_depth": depth, "draft_level_s": round(c_d, 4), "compute_s": round(compute, 4), "ring_s": ring_s,
           "plain_pass_s": round(1 / plain, 4),
           "tree_shape": rows["tree"]["reports"][-1][0].as_json()["spec"], "speedup_tree": round(tree / plain, 2),
           "speedup_chain": round(rows["chain"]["tokens_per_s"] / plain, 2),
           "hops_tokens_per_s": rows["hops"]["tokens_per_s"],
           "best_over_hops": round(max(tree, piped) / rows["hops"]["tokens_per_s"], 2),
           "modes": {name: public(r) for name, r in rows.items()},
           "draft": args.draft, "unknown_dialers": emulated.emu.unknown_dialers, "date": time.strftime("%Y-%m-%d")}
    print(json.dumps(row) if args.json else "\n".join(f"{k:28} {v}" for k, v in row.items()))


if __name__ == "__main__":
    main()
