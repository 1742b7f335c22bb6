#!/usr/bin/env python3
"""Step-path cost of the typed protocol: encode + decode (with validation) of the messages every step
and heartbeat carries, against the hand-checked msgpack dicts it replaced (reproduced below).

    python benchmarks/protocol_bench.py [--rounds 20000] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable

import msgpack

from beeswarm.protocol import Decoder, Span, encode
from beeswarm.protocol.membership import Heartbeat, NodeInfo
from beeswarm.protocol.step import CacheState, Keep, Step

PEER = "12D3KooWGJ8Zz1xAfS1dw3QV2uSLkD1zK7nV7V8V3xFqQ9N7hBee"


# The previous path (beeswarm.p2p.wire before the protocol package): msgpack maps checked by hand.
def old_unpack(data: bytes) -> dict:
    msg = msgpack.unpackb(data, raw=False, strict_map_key=True)
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str) or msg.get("v") != 1:
        raise ValueError("bad message")
    return msg


def old_expect(msg: dict, kind: str, **fields: type | tuple[type, ...]) -> dict:
    if msg.get("t") != kind:
        raise ValueError("unexpected type")
    for name, typ in fields.items():
        value = msg.get(name)
        if not isinstance(value, typ) or isinstance(value, bool):
            raise ValueError(f"field {name}")
    return msg


def old_step(frame: bytes) -> Callable[[], object]:
    body = msgpack.packb({"t": "step", "v": 1, "entry": PEER, "session": "a" * 16, "step": 7, "start": 40,
                          "frame": frame, "mask": None, "keep": [40, [0, 1, 2]]}, use_bin_type=True)

    def run() -> object:
        msg = old_expect(old_unpack(body), "step", entry=str, session=str, step=int, start=int, frame=bytes)
        keep = msg["keep"]  # the stage's parse_keep
        if not (isinstance(keep, list) and len(keep) == 2 and all(isinstance(i, int) for i in keep[1])):
            raise ValueError("keep")
        return msgpack.packb({**msg, "frame": frame}, use_bin_type=True)  # forwarded to the next stage
    return run


def new_step(frame: bytes) -> Callable[[], object]:
    steps = Decoder(Step, limit=1 << 28)
    body = encode(Step(entry=PEER, session="a" * 16, step=7, start=40, frame=frame, keep=Keep(40, (0, 1, 2)),
                        expect=CacheState(43, 2)))

    def run() -> object:
        msg = steps.decode(body)
        return encode(msg)  # forwarded to the next stage
    return run


def info() -> NodeInfo:
    return NodeInfo(peer=PEER, addrs=(f"/ip4/192.0.2.7/tcp/31337/p2p/{PEER}",), memory_bytes=8 << 30,
                    bench={"layer_ms_base": 1.5, "layer_ms_per_token": 0.01, "host_mem_bytes": 1e10,
                           "offload_gbps": None}, layers=Span(0, 4), spans=(Span(0, 4),), state="serving",
                    links={f"{PEER[:-4]}{i:04d}": (12.0, 100.0, 100.0) for i in range(16)})


def new_heartbeat() -> Callable[[], object]:
    beats, body = Decoder(Heartbeat), encode(Heartbeat(info=info()))
    return lambda: beats.decode(body)


def timed(fn: Callable[[], object], rounds: int) -> float:
    """Median microseconds per call over 5 batches."""
    for _ in range(rounds // 10):
        fn()
    batches = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(rounds // 5):
            fn()
        batches.append((time.perf_counter() - t) / (rounds // 5) * 1e6)
    return statistics.median(batches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = {}
    for name, size in (("decode step (1 token x 256 fp32)", 1024), ("prefill step (40 x 2048 bf16)", 40 * 4096)):
        frame = os.urandom(size)
        rows[name] = (timed(old_step(frame), args.rounds), timed(new_step(frame), args.rounds))
    rows["heartbeat (16 links), decode only"] = (None, timed(new_heartbeat(), args.rounds))
    if args.json:
        print(json.dumps({k: {"before_us": b and round(b, 2), "after_us": round(a, 2)} for k, (b, a) in rows.items()}))
        return
    print(f"{'message':40} {'before us':>10} {'after us':>10}")
    for name, (before, after) in rows.items():
        print(f"{name:40} {'-' if before is None else f'{before:.2f}':>10} {after:10.2f}")


if __name__ == "__main__":
    main()
