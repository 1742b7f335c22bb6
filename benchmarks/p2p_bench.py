#!/usr/bin/env python3
"""P2P benchmark on loopback: 32 KB request/response RTT and 16 MB one-way channel throughput.

Two real nodes (TCP + Noise + Yamux) in this process, each in its own trio thread.

    python benchmarks/p2p_bench.py [--rounds 200] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from beeswarm.p2p import identity
from beeswarm.p2p.node import Node, NodeConfig
from beeswarm.protocol import Message
from beeswarm.protocol.rpcs import Rpc

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


class Payload(Message, frozen=True, tag="payload"):
    data: bytes = b""


ECHO: Rpc[Payload, Payload] = Rpc("/bench/echo/1", (Payload,), (Payload,))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--transfers", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    server = Node(identity.ephemeral(), NodeConfig(listen=LOCAL)).start()
    client = Node(identity.ephemeral(), NodeConfig(listen=LOCAL)).start()
    try:
        payload = b"x" * 32 * 1024
        async def echo(peer: str, msg: Payload) -> Payload:  # async: runs in the node's loop, no thread hop
            return msg

        server.serve(ECHO, echo)
        client.connect(server.addrs[0])
        request = Payload(data=payload)
        rtts = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            client.request(server.peer_id, ECHO, request)
            rtts.append((time.perf_counter() - t) * 1e3)

        inbox = []
        server.serve_channel("/bench/bulk/1", inbox.append)
        channel = client.open_channel(server.peer_id, "/bench/bulk/1")
        channel.send(b"hello")
        while not inbox:
            time.sleep(0.01)
        inbox[0].recv(timeout=10)
        blob = bytes(16 * 1024 * 1024)
        rates = []
        for _ in range(args.transfers):
            t = time.perf_counter()
            channel.send(blob, timeout=60)
            inbox[0].recv(timeout=60)
            rates.append(len(blob) / (time.perf_counter() - t) / 1e6)
    finally:
        client.stop()
        server.stop()
    result = {"rtt_ms_median": round(statistics.median(rtts), 3), "throughput_mb_s": round(statistics.median(rates), 1)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"32 KB request/response RTT: median {result['rtt_ms_median']} ms over {args.rounds} rounds")
        print(f"16 MB one-way throughput:   median {result['throughput_mb_s']} MB/s over {args.transfers} transfers")


if __name__ == "__main__":
    main()
