#!/usr/bin/env python3
"""Fuzz every protocol a node speaks from a hostile peer, then check the node survived and still generates exactly.

A target node (membership, relay service, a stage server over the whole tiny model, a result inbox,
link probes) and a hostile node on 127.0.0.1; the hostile one sends `--frames` frames on each protocol
(tests/hostile.py: random bytes, huge declared lengths, truncated frames, well-formed messages with
wrong fields, mutated ones; a fresh stream each attempt). The target records strikes but never bans, so
one peer can send everything. Then a third node generates through the target's stage server and the
tokens are compared with transformers' greedy output.

    python benchmarks/fuzz_bench.py [--frames 2000] [--seed 0] [--workers 2] [--json]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))  # helpers.reference_greedy

import hostile  # noqa: E402

from beeswarm.client.dataplane import Inbox, RemotePipeline  # noqa: E402
from beeswarm.contributor.stage import StageServer  # noqa: E402
from beeswarm.generation.generate import generate  # noqa: E402
from beeswarm.generation.sampling import SamplingParams  # noqa: E402
from beeswarm.p2p import identity  # noqa: E402
from beeswarm.p2p.bans import BanList  # noqa: E402
from beeswarm.p2p.membership import Membership, NodeInfo  # noqa: E402
from beeswarm.p2p.node import Node, NodeConfig  # noqa: E402
from beeswarm.p2p.probe import Prober  # noqa: E402
from beeswarm.protocol import ids  # noqa: E402
from beeswarm.protocol.coordinator import Stage  # noqa: E402
from beeswarm.shard import EntryModel, Span, SpanRuntime  # noqa: E402
from helpers import reference_greedy  # noqa: E402
from tiny_checkpoints import write_tiny_checkpoint  # noqa: E402

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
LAYERS = 8


class CountingBans(BanList):
    """Counts strikes per reason and never bans."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: Counter[str] = Counter()

    def strike(self, peer: str, reason: str, severe: bool = False) -> bool:
        self.reasons[reason.split(":")[0]] += 1
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=2000, help="frames per protocol (default 2000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2, help="streams at a time per protocol")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    folder = write_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="fuzz-bench-")), "llama", num_layers=LAYERS, seed=0)
    bans = CountingBans()
    me = identity.ephemeral()
    target = Node(me, NodeConfig(listen=LOCAL, relay_service=True), bans=bans)
    members = Membership(target, NodeInfo(peer=me.peer_id), interval=1.0)
    members.start()
    target.start()
    server = StageServer(target, SpanRuntime(folder, Span(0, LAYERS), dtype="float32", device="cpu")).start()
    Inbox(target).start()
    Prober(target).start()
    evil = Node(identity.ephemeral(), NodeConfig(listen=LOCAL)).start()
    entry_node = Node(identity.ephemeral(), NodeConfig(listen=LOCAL)).start()
    try:
        evil.connect(target.addrs[0])
        topics = (target.topic(ids.MEMBERS_TOPIC), target.topic(ids.COORDINATOR_TOPIC))
        t0 = time.monotonic()
        tally = evil.call(hostile.barrage, evil, target.peer_id, args.frames, args.seed, hostile.PROTOCOLS,
                          args.workers, topics)
        seconds = time.monotonic() - t0
        survived = target.failure is None and target.running
        tokens = expected = None
        if survived:
            entry_node.connect(target.addrs[0])
            entry = EntryModel(folder, dtype="float32", device="cpu")
            route = (Stage(node=target.peer_id, span=Span(0, LAYERS)),)
            pipe = RemotePipeline(entry_node, Inbox(entry_node).start(), entry, route)
            prompt = [5, 6, 7, 100, 3]
            session = pipe.open(32)
            tokens = generate(lambda t, s: pipe.forward(session, t, s), prompt, 16, SamplingParams()).tokens
            expected = reference_greedy(folder, prompt, 16)
        exact = tokens is not None and tokens == expected
        report = {"frames_per_protocol": {p: tally.frames[p] for p in hostile.PROTOCOLS},
                  "streams_per_protocol": {p: tally.attempts[p] for p in hostile.PROTOCOLS},
                  "refused": dict(tally.refused), "frames_by_kind": dict(tally.kinds),
                  "frames": sum(tally.frames.values()), "seconds": round(seconds, 1),
                  "frames_per_s": round(sum(tally.frames.values()) / seconds), "strikes": dict(bans.reasons),
                  "survived": survived, "failure": repr(target.failure) if target.failure else None,
                  "generation_exact": exact, "seed": args.seed}
        if args.json:
            print(json.dumps(report))
        else:
            print(f"{'protocol':36} {'frames':>7} {'streams':>8} {'refused':>8}")
            for p in hostile.PROTOCOLS:
                print(f"{p:36} {tally.frames[p]:7d} {tally.attempts[p]:8d} {tally.refused[p]:8d}")
            print(f"frames by kind: {dict(tally.kinds)}")
            print(f"strikes by reason: {dict(bans.reasons.most_common())}")
            print(f"{report['frames']} frames in {seconds:.1f} s ({report['frames_per_s']} frames/s); "
                  f"node survived: {survived}; generation after the barrage exact: {exact}")
        return 0 if survived and exact else 1
    finally:
        server.stop()
        for node in (entry_node, evil, target):
            node.stop()


if __name__ == "__main__":
    sys.exit(main())
