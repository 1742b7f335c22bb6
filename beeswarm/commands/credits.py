"""`beeswarm credits`: what an identity has earned serving and spent generating, from the swarm's signed ledger."""
from __future__ import annotations

import argparse
import json

from beeswarm.commands import options
from beeswarm.commands.common import UserError, required_join, swarm_secret


def add_parser(sub) -> argparse.ArgumentParser:
    credits = sub.add_parser("credits", help="credit earned serving and spent generating, from the swarm's ledger")
    options.add_join(credits, "the swarm whose ledger to read")
    credits.add_argument("--peer", default=None, metavar="PEER_ID",
                         help="whose account (default: this machine's identity, the one `contribute` earns with)")
    credits.add_argument("--json", action="store_true", help="print one JSON object")
    credits.add_argument("--wait", type=float, default=8.0, metavar="S", help="listen at most S seconds for the swarm")
    options.add_secret(credits)
    options.add_heartbeat(credits)
    credits.set_defaults(func=run)
    return credits


def run(args) -> int:
    from beeswarm import secrets
    from beeswarm.client.status import SwarmObserver, Unreachable
    from beeswarm.credits.ledger import FREE_ALLOWANCE, rank
    from beeswarm.p2p import identity
    from beeswarm.p2p.errors import NodeError
    from beeswarm.protocol.credits import Balance

    bootstrap, _ = required_join(args.join, "the swarm whose ledger to read")
    if args.wait <= 0:
        raise UserError("--wait must be positive")
    try:
        peer = args.peer or identity.load_or_create().peer_id
    except secrets.SecretError as e:
        raise UserError(f"this machine's identity: {e}") from None
    observer = SwarmObserver.create(bootstrap, secret=swarm_secret(args.swarm_secret_env), interval=args.heartbeat,
                                    relays=args.relay)
    try:
        observer.start()
        observer.wait(args.wait)
        ledger = observer.ledger(timeout=args.wait)
    except Unreachable as e:
        raise UserError(str(e)) from None
    except NodeError as e:
        raise UserError(f"cannot join the swarm: {e}") from None
    finally:
        observer.close()
    mine = next((b for b in ledger.balances if b.node == peer), Balance(peer))
    place = rank(ledger, peer)
    left = 0 if mine.forfeited else mine.balance + FREE_ALLOWANCE
    if args.json:
        print(json.dumps({"peer": peer, "balance": mine.balance, "earned": mine.earned, "spent": mine.spent,
                          "last_hour": {"earned": mine.hour[0], "spent": mine.hour[1]},
                          "last_day": {"earned": mine.day[0], "spent": mine.day[1]},
                          "rank": place, "accounts": len(ledger.balances), "forfeited": mine.forfeited,
                          "can_spend": max(0, left), "free_allowance": FREE_ALLOWANCE,
                          "ledger": {"seq": ledger.seq, "coordinator": ledger.coordinator, "swarm": ledger.swarm}}))
        return 0
    print(f"peer:       {peer}")
    print(f"balance:    {mine.balance:,} layer-tokens" + ("  (FORFEITED: caught lying by an audit)" if mine.forfeited
                                                        else ""))
    print(f"earned:     {mine.earned:,} in all, {mine.hour[0]:,} in the last hour, {mine.day[0]:,} in the last day")
    print(f"spent:      {mine.spent:,} in all, {mine.hour[1]:,} in the last hour, {mine.day[1]:,} in the last day")
    print(f"rank:       {f'{place} of {len(ledger.balances)}' if place else 'no account yet'}")
    print(f"can spend:  {max(0, left):,} before its free allowance of {FREE_ALLOWANCE:,} is used up "
          "(past it, its sessions wait behind others on full stages)")
    print(f"ledger:     #{ledger.seq} of {ledger.swarm}, signed by the coordinator {ledger.coordinator}")
    return 0
