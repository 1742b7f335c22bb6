"""Many distinct peers in one process, for tests: each dials ADDR; prints "connected N" once all are
connected, then waits to be killed (with -9: the peers vanish without a goodbye).

    python tests/vanishing_peers.py ADDR N
"""
from __future__ import annotations

import sys
import time

from beeswarm.p2p import identity
from beeswarm.p2p.node import Node, NodeConfig


def main() -> None:
    addr, n = sys.argv[1], int(sys.argv[2])
    nodes = [Node(identity.ephemeral(), NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=[addr])).start()
             for _ in range(n)]
    target = addr.rsplit("/p2p/", 1)[1]
    while not all(node.is_connected(target) for node in nodes):
        time.sleep(0.05)
    print(f"connected {n}", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
