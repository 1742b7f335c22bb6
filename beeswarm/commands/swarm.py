"""`beeswarm swarm --local N`: N contributors on this machine, stopped together on Ctrl-C or SIGTERM."""
from __future__ import annotations

import argparse
import json
import logging

from beeswarm.commands import options
from beeswarm.commands.common import UserError

log = logging.getLogger("beeswarm")


def add_parser(sub) -> argparse.ArgumentParser:
    swarm = sub.add_parser("swarm", help="run a swarm of contributor processes on this machine")
    swarm.add_argument("--local", type=int, required=True, metavar="N", help="number of contributor processes")
    swarm.add_argument("--model", default="tinycode", help="built-in name, folder or hub id")
    swarm.add_argument("--base-port", type=int, default=0, metavar="P", help="listen on P, P+1, ... (default: any)")
    options.add_device(swarm, dtype=False)
    options.add_quant(swarm)
    options.add_heartbeat(swarm, default=1.0)
    swarm.add_argument("--json", action="store_true", help="print each line as a JSON object (for scripts)")
    swarm.set_defaults(func=run)
    return swarm


def run(args) -> int:
    """Start N contributors on this machine; stop them all on Ctrl-C or SIGTERM."""
    import signal
    import threading

    from beeswarm.contributor.local_swarm import ChildFlags, LocalSwarm, LocalSwarmError

    swarm = LocalSwarm(args.local, args.model, args.base_port,
                       ChildFlags(heartbeat=args.heartbeat, device=args.device, quant=args.quant))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())

    def say(text: str, event: str, **fields: object) -> None:
        print(json.dumps({"event": event, **fields}) if args.json else text, flush=True)

    try:
        bootstrap = swarm.start()
        say(f"bootstrap {bootstrap}", "bootstrap", addr=bootstrap)
        path = swarm.write_descriptor(bootstrap)
        say(f"descriptor {path}", "descriptor", path=str(path))
        swarm.wait_ready()
        for c in swarm.children:
            assert c.span is not None  # wait_ready saw every span
            say(f"contributor {c.index} pid {c.process.pid} peer {c.peer} layers {c.span}", "contributor",
                index=c.index, pid=c.process.pid, peer=c.peer, start=c.span.start, end=c.span.end)
        say("ready", "ready")
        while not stop.wait(0.5):
            if any(c.process.poll() is not None for c in swarm.children):
                log.warning("a contributor exited; the swarm re-plans around it")
    except LocalSwarmError as e:
        raise UserError(str(e)) from None
    finally:
        swarm.stop()
    return 0
