#!/usr/bin/env python3
"""Behind home routers: what reaching a swarm through NATs costs, on the network-namespace test bed.

Three layouts of the same swarm (tinycode; a public bootstrap that holds no layer and only relays; two
contributors holding half the model each; the user chatting greedily), every home uplink shaped to
`--uplink` Mbit/s (tbf) like a home connection:
- public: the two contributors and the user on public addresses (no NAT: the reference);
- punched: each behind its own ordinary (port-keeping) home NAT; DCUtR punches the stages' link;
- relayed: one stage behind a symmetric NAT, so its links go through the relay.
Reported per layout: seconds from the two contributors' start to both their "serving" lines (benchmarks cached,
as on any start after the first), whether the stages' link ended up direct, the chat's tokens/s and time to
first token (median of `--chats`), and for the relay: CPU milliseconds and bytes through it per token generated,
its own traffic at rest (`--idle` seconds before the chats, the bootstrap coordinates too) subtracted. Each chat is
a new process, so a user at home reaches the stages through the relay for the whole of a short chat.

    sudo python benchmarks/home_bench.py [--tokens 64] [--chats 3] [--uplink 20] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bed_swarm import MODEL, Swarm  # noqa: E402
from beeswarm.contributor.local_swarm import budgets  # noqa: E402
from helpers import read_until, wait_for  # noqa: E402
from netbed import Host, NetBed, netns_unavailable  # noqa: E402

LAYOUTS = ("public", "punched", "relayed")


def wire_bytes(host: Host) -> int:
    """Bytes in and out of `host`'s namespace, all interfaces but loopback (/proc/net/dev)."""
    out = host.run(["cat", "/proc/net/dev"]).stdout.splitlines()[2:]
    total = 0
    for line in out:
        name, fields = line.split(":", 1)
        if name.strip() != "lo":
            numbers = fields.split()
            total += int(numbers[0]) + int(numbers[8])
    return total


def run_layout(layout: str, args: argparse.Namespace, logs: Path) -> dict[str, object]:
    env = {**os.environ, "BEESWARM_CACHE_DIR": str(logs.parent / "cache"), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    env.pop("BEESWARM_IDENTITY", None)
    logs.mkdir(parents=True, exist_ok=True)
    half = budgets(MODEL, 2)[0]
    with NetBed() as bed:
        swarm = Swarm(bed, logs, env)
        boot_host = bed.public_host("boot")
        swarm.contribute(boot_host, "boot", half // 8)
        relay = psutil.Process(swarm.procs[0].pid)

        def place(name: str, symmetric: bool = False) -> Host:
            if layout == "public":
                return bed.public_host(name)
            return bed.behind(bed.home_router(f"{name}-home", symmetric=symmetric, uplink_mbit=args.uplink), name)

        started = time.monotonic()  # both at once: neither serves before the other can take the other half
        alice = swarm.contribute(place("alice"), "alice", half, verbose=True)
        bob = swarm.contribute(place("bob", symmetric=layout == "relayed"), "bob", half, verbose=True)
        to_serving = []
        for peer in (alice, bob):
            read_until(swarm.lines[peer], "serving ", 180)
            to_serving.append(time.monotonic() - started)
        user = place("user")
        swarm.chat(user, "warm-up", tokens=4)

        def direct() -> bool:
            text = (logs / "alice.log").read_text() + (logs / "bob.log").read_text()
            return f"direct connection to {bob}" in text or f"direct connection to {alice}" in text

        if layout == "punched":
            wait_for(direct, 60, "the stages' hole punch")
        # the bootstrap's own traffic (heartbeats, gossip, probes: it coordinates too) at rest, to subtract
        idle0, cpu0, bytes0 = time.monotonic(), sum(relay.cpu_times()[:2]), wire_bytes(boot_host)
        time.sleep(args.idle)
        idle_s, idle_cpu, idle_bytes = (time.monotonic() - idle0, sum(relay.cpu_times()[:2]) - cpu0,
                                        wire_bytes(boot_host) - bytes0)
        replies = []
        for i in range(args.chats):  # each chat a new process: its links are relayed until a punch, if any
            cpu0, bytes0, began = sum(relay.cpu_times()[:2]), wire_bytes(boot_host), time.monotonic()
            reply = swarm.chat(user, f"chat{i}", tokens=args.tokens)
            took = time.monotonic() - began
            reply["relay_cpu_s"] = sum(relay.cpu_times()[:2]) - cpu0 - idle_cpu / idle_s * took
            reply["relay_bytes"] = wire_bytes(boot_host) - bytes0 - idle_bytes / idle_s * took
            replies.append(reply)
        tokens = sum(r["new_tokens"] for r in replies)
        return {"layout": layout, "uplink_mbit": None if layout == "public" else args.uplink,
                "start_to_serving_s": round(max(to_serving), 1), "stages_direct": layout == "public" or direct(),
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in replies),
                "ttft_s": statistics.median(r["ttft_s"] for r in replies),
                "relay_cpu_ms_per_token": round(1000 * sum(r["relay_cpu_s"] for r in replies) / tokens, 2),
                "relay_bytes_per_token": round(sum(r["relay_bytes"] for r in replies) / tokens),
                "relay_idle_bytes_per_s": round(idle_bytes / idle_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--chats", type=int, default=3)
    ap.add_argument("--uplink", type=float, default=20.0, help="home uplink, Mbit/s")
    ap.add_argument("--idle", type=float, default=10.0, help="seconds the bootstrap's own traffic is measured")
    ap.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    ap.add_argument("--logs", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    why = netns_unavailable()
    if why:
        raise SystemExit(f"home_bench needs the network test bed: {why}")
    logs = args.logs or Path(tempfile.mkdtemp(prefix="home-bench-"))
    rows = []
    for layout in args.layouts:
        rows.append(run_layout(layout, args, logs / layout))
        print(json.dumps(rows[-1]) if args.json else
              f"{layout:>8}: serving after {rows[-1]['start_to_serving_s']} s, stages direct: "
              f"{rows[-1]['stages_direct']}, {rows[-1]['tokens_per_s']:.1f} tok/s, TTFT {rows[-1]['ttft_s']:.3f} s, "
              f"relay {rows[-1]['relay_cpu_ms_per_token']} ms CPU and {rows[-1]['relay_bytes_per_token']} B "
              f"per token", flush=True)
    if args.json:
        print(json.dumps({"tokens": args.tokens, "chats": args.chats, "rows": rows, "logs": str(logs)}))


if __name__ == "__main__":
    main()
