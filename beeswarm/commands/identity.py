"""`beeswarm identity`: show or replace this machine's node key, or set the swarm secret."""
from __future__ import annotations

import argparse
import sys

from beeswarm.commands.common import SWARM_SECRET, SWARM_SECRET_ENV, UserError


def add_parser(sub) -> argparse.ArgumentParser:
    ident = sub.add_parser("identity", help="this node's peer id and key, and the swarm secret")
    ident_sub = ident.add_subparsers(dest="action", metavar="ACTION")
    ident_sub.required = True
    ident_sub.add_parser("show", help="print the peer id and where the key and secret live")
    reset = ident_sub.add_parser("reset", help="make a new key (the peer id changes)")
    reset.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    secret = ident_sub.add_parser("secret", help="set the private-swarm secret (read from the terminal or stdin)")
    group = secret.add_mutually_exclusive_group(required=True)
    group.add_argument("--set", action="store_true", help="store a new secret")
    group.add_argument("--clear", action="store_true", help="forget the stored secret")
    ident.set_defaults(func=run)
    return ident


def run(args) -> int:
    """Show or replace this machine's node key, or set the swarm secret."""
    from beeswarm import secrets
    from beeswarm.p2p import identity

    try:
        if args.action == "show":
            me = identity.load_or_create()
            secret = secrets.load(SWARM_SECRET, SWARM_SECRET_ENV)
            print(f"peer id:      {me.peer_id}")
            print(f"key stored:   {me.location}")
            print(f"swarm secret: {secret.location if secret else 'none (open swarms only)'}")
        elif args.action == "reset":
            if not args.yes:
                if not sys.stdin.isatty():
                    raise UserError("identity reset changes this node's peer id: pass --yes to confirm")
                if input("Replace this node's key? Its peer id will change. [y/N] ").strip().lower() != "y":
                    print("kept the current key")
                    return 1
            me = identity.reset()
            print(f"new peer id: {me.peer_id} (key stored: {me.location})")
        elif args.action == "secret":
            if args.clear:
                secrets.delete(SWARM_SECRET)
                print("swarm secret removed")
                return 0
            if sys.stdin.isatty():
                import getpass

                value = getpass.getpass("swarm secret: ")
            else:
                value = sys.stdin.readline().rstrip("\n")
            if len(value) < 8:
                raise UserError("a swarm secret needs at least 8 characters")
            print(f"swarm secret stored: {secrets.store(SWARM_SECRET, value.encode())}")
    except secrets.SecretError as e:
        raise UserError(str(e)) from None
    return 0
