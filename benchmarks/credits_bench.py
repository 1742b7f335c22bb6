#!/usr/bin/env python3
"""What credits cost: a receipt's bytes per stage and session, signing and checking one, recording one in the
coordinator's ledger, and the signed ledger's size and signing time when full.

    python benchmarks/credits_bench.py [--receipts 20000] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import msgspec

from beeswarm.credits.ledger import MEMORY, CreditLedger
from beeswarm.credits.receipts import receipt_verifies, sign_ledger, sign_receipt, verify_ledger
from beeswarm.p2p import identity
from beeswarm.protocol import encode
from beeswarm.protocol.credits import MAX_BALANCES, Given, HandIn, Receipt, swarm_id


def per_call_us(fn, n: int, repeats: int = 5) -> float:
    """The median over `repeats` of the mean microseconds per call of `fn(i)` over `n` calls."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for i in range(n):
            fn(i)
        times.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--receipts", type=int, default=20_000, help="receipts recorded per repeat")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    swarm = swarm_id("beeswarm", "tinycode")
    payer, stage, coordinator = identity.ephemeral(), identity.ephemeral(), identity.ephemeral()
    now = time.time()
    unsigned = Receipt(swarm, payer.peer_id, payer.peer_id, stage.peer_id, "0123456789abcdef", 123_456, 7_890, now)
    signed = sign_receipt(payer.key_pair, unsigned)
    out: dict[str, float] = {
        "receipt_bytes": len(encode(Given(receipt=signed))),
        "hand_in_64_bytes": len(encode(HandIn(receipts=(signed,) * 64))),
        "sign_us": per_call_us(lambda i: sign_receipt(payer.key_pair, unsigned), 2000),
        "verify_us": per_call_us(lambda i: receipt_verifies(signed), 2000),
    }
    # receipts spread over many stages, as a swarm's are (one stage is credited for at most
    # RECEIPTS_PER_WINDOW sessions in the window), each stage with room enough (`capacity`)
    pairs = [(identity.ephemeral().peer_id, identity.ephemeral().peer_id) for _ in range(MAX_BALANCES // 2)]
    receipts = [msgspec.structs.replace(signed, stage=pairs[i % 128][1], session=f"{i:016x}",  # issued in turn:
                                        issued=now - 600 + i * 600 / args.receipts)  # the ledger forgets the oldest
                for i in range(args.receipts)]

    def record_all() -> float:
        book = CreditLedger(swarm)
        t = time.perf_counter()
        for r in receipts:
            if (why := book.record(r, True, now, capacity=1e9)) is not None:
                raise SystemExit(f"a benchmark receipt was refused: {why}")
        return (time.perf_counter() - t) / len(receipts) * 1e6

    out["record_us"] = statistics.median(record_all() for _ in range(5))
    full = CreditLedger(swarm)  # every account and every digest remembered (it publishes the newest MAX_RECENT)
    for i in range(MEMORY):
        payer_id, stage_id = pairs[i % len(pairs)]
        full.record(msgspec.structs.replace(signed, payer=payer_id, stage=stage_id, session=f"{i:016x}",
                                            issued=now - MEMORY + i), True, now, capacity=1e9)
    state = full.state(coordinator.peer_id, now)
    ledger = sign_ledger(coordinator.key_pair, state)
    out["ledger_accounts"], out["ledger_digests"] = len(state.balances), len(state.recent)
    out["ledger_bytes"] = len(encode(ledger))
    out["ledger_state_ms"] = per_call_us(lambda i: full.state(coordinator.peer_id, now), 20) / 1000  # what to publish
    out["ledger_sign_ms"] = per_call_us(lambda i: sign_ledger(coordinator.key_pair, state), 20) / 1000
    out["ledger_verify_ms"] = per_call_us(lambda i: verify_ledger(ledger), 20) / 1000
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>18}  {v:,.2f}" if isinstance(v, float) else f"{k:>18}  {v:,}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
