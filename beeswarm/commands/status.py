"""`beeswarm status`: the swarm at a glance (members, layer coverage, coordinator, plans)."""
from __future__ import annotations

import argparse
import json
import os
import sys

from beeswarm.commands import options
from beeswarm.commands.common import UserError, required_join, swarm_secret


def add_parser(sub) -> argparse.ArgumentParser:
    status = sub.add_parser("status", help="the swarm at a glance: members, layer coverage, coordinator, plans")
    options.add_join(status, "the swarm to look at")
    status.add_argument("--json", action="store_true", help="print one JSON object (a line each with --watch)")
    status.add_argument("--watch", action="store_true", help="report again every few seconds until Ctrl-C")
    status.add_argument("--wait", type=float, default=8.0, metavar="S",
                        help="listen at most S seconds for the coordinator's plan before the first report")
    status.add_argument("--every", type=float, default=3.0, metavar="S", help="--watch: seconds between reports")
    options.add_secret(status)
    options.add_heartbeat(status)
    status.set_defaults(func=run)
    return status


def run(args) -> int:
    """The swarm at a glance: join as a client, listen until the plan is heard (or --wait), print, leave."""
    import time

    from beeswarm.client.status import SwarmObserver, Unreachable
    from beeswarm.p2p.errors import NodeError

    bootstrap, _ = required_join(args.join, "the swarm to look at")
    if args.wait <= 0 or args.every <= 0:
        raise UserError("--wait and --every must be positive")
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    observer = SwarmObserver.create(bootstrap, secret=swarm_secret(args.swarm_secret_env), interval=args.heartbeat)
    try:
        observer.start()
        observer.wait(args.wait)
        while True:
            report = observer.report()
            if args.json:
                print(json.dumps(report.as_json()), flush=True)
            else:
                if args.watch and color:
                    print("\033[H\033[2J", end="")  # redraw in place
                print("\n".join(report.lines(color)), flush=True)
            if not args.watch:
                return 0
            if not args.json and not color:
                print(flush=True)
            time.sleep(args.every)
    except Unreachable as e:
        raise UserError(str(e)) from None
    except NodeError as e:
        raise UserError(f"cannot join the swarm: {e}") from None
    except KeyboardInterrupt:
        return 0 if args.watch else 130
    finally:
        observer.close()
