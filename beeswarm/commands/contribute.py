"""`beeswarm contribute`: join (or start) a swarm and serve the layers the coordinator assigns."""
from __future__ import annotations

import argparse
import logging

from beeswarm.commands import options
from beeswarm.commands.common import UserError, interactive, swarm_secret
from beeswarm.protocol.membership import Quant


def add_parser(sub) -> argparse.ArgumentParser:
    contrib = sub.add_parser("contribute", help="serve layers of the swarm's model with this machine")
    contrib.add_argument("--headless", action="store_true",
                         help="log to stderr, no dashboard (chosen by itself without a terminal)")
    contrib.add_argument("--json-events", action="store_true",
                         help="headless: print events (peer, addr, serving, ...) as one JSON object a line")
    contrib.add_argument("--model", default=None, help="built-in name, folder or hub id (default: the swarm's)")
    options.add_join(contrib, "a peer's multiaddr or a swarm descriptor URL (none: start a new swarm)")
    options.add_contributor_addrs(contrib)
    options.add_device(contrib)
    options.add_quant(contrib, default=None)
    contrib.add_argument("--max-memory", type=int, default=None, metavar="BYTES", help="memory to offer the swarm")
    options.add_secret(contrib, "read the private-swarm secret from this environment variable")
    options.add_heartbeat(contrib)
    contrib.set_defaults(func=run)
    return contrib


def run(args) -> int:
    """Join (or start) a swarm and serve the layers the coordinator assigns."""
    import signal

    from beeswarm.contributor.contributor import Contributor, ContributorOptions
    from beeswarm.p2p import identity
    from beeswarm.p2p.descriptor import DescriptorError, resolve_join

    try:
        bootstrap, descriptor = resolve_join(args.join)
    except DescriptorError as e:
        raise UserError(str(e)) from None
    model = args.model or (descriptor.model if descriptor else "tinycode")
    quant: Quant = args.quant or (descriptor.quant if descriptor else "none")
    contributor_options = ContributorOptions(model=model, join=bootstrap, listen=args.listen or ["/ip4/0.0.0.0/tcp/0"],
                                             announce=args.announce, relays=args.relay,
                                             relay_service=not args.no_relay_service, device=args.device,
                                             dtype=args.dtype, quant=quant, max_memory=args.max_memory,
                                             secret=swarm_secret(args.swarm_secret_env), interval=args.heartbeat)
    dashboard = not args.headless and interactive()
    if dashboard:  # a model that cannot be found is one line of error, not a screen opened and closed
        from beeswarm.shard import checkpoint

        checkpoint.resolve_config(model)
    if dashboard:
        say = lambda event: logging.getLogger("beeswarm").info("%s", event.text)  # noqa: E731
    else:
        say = lambda event: print(event.json() if args.json_events else event.text, flush=True)  # noqa: E731
    contributor = Contributor.create(identity.load_or_create(), contributor_options, say=say)
    signal.signal(signal.SIGTERM, lambda *_: contributor.stop())  # leave gracefully, as Ctrl-C or `q` does
    if dashboard:
        return _dashboard(contributor)
    signal.signal(signal.SIGINT, lambda *_: contributor.stop())
    contributor.run()
    return 0


def _dashboard(contributor) -> int:
    """The Textual dashboard; the log goes to its panel instead of stderr while it runs."""
    from beeswarm.p2p.errors import NodeFailed
    from beeswarm.shard.errors import ShardError
    from beeswarm.tui.dashboard_app import DashboardApp

    root = logging.getLogger()
    streams = [h for h in root.handlers if isinstance(h, logging.StreamHandler)]
    level = root.level
    for h in streams:
        root.removeHandler(h)
    root.setLevel(min(level, logging.INFO))
    try:
        app = DashboardApp(contributor)
        app.run()
    finally:
        root.setLevel(level)
        for h in streams:
            root.addHandler(h)
    if isinstance(app.failure, ShardError | NodeFailed):
        raise app.failure
    if app.failure is not None:
        raise UserError(f"the contributor stopped: {app.failure}")
    return 0
