"""A p2p node as its own process, for tests: prints its peer id and address, then membership events.

    python tests/p2p_node.py [--bootstrap ADDR] [--interval S] [--secret-env NAME]
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
import time

from beeswarm.p2p import identity
from beeswarm.p2p.membership import Membership, NodeInfo
from beeswarm.p2p.node import Node, NodeConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", action="append", default=[])
    ap.add_argument("--interval", type=float, default=1.0)
    ap.add_argument("--secret-env", default=None)
    args = ap.parse_args()
    # a job started in the background (as CI runs the suite) inherits SIGINT ignored, and Python then installs
    # no KeyboardInterrupt handler: the test's SIGINT went unheard and the node never left
    signal.signal(signal.SIGINT, signal.default_int_handler)
    me = identity.load_or_create()
    secret = os.environ[args.secret_env].encode() if args.secret_env else None
    node = Node(me, NodeConfig(listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=args.bootstrap, secret=secret))
    members = Membership(node, NodeInfo(peer=me.peer_id), interval=args.interval)
    members.listeners.append(lambda event, info: print(f"{event} {info.peer}", flush=True))
    members.start()
    node.start()
    print(f"peer {node.peer_id}", flush=True)
    print(f"addr {node.addrs[0]}", flush=True)
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        faulthandler.dump_traceback_later(8)  # an exit that hangs shows where (the test prints this stderr)
        members.leave()
        node.stop()
        sys.exit(0)


if __name__ == "__main__":
    main()
