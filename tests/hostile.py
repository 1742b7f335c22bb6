"""A hostile peer: for every protocol a beeswarm node speaks, frames that are wrong in every way at hand.

`barrage(evil, target, frames_per_protocol)` runs in the hostile node's loop (`evil.call(barrage, ...)`)
and opens a fresh stream for each attempt (the target may reset it), writing one of:
  random     bytes with no framing at all
  huge       a length prefix far above every limit (u32 for ours, varint for py-libp2p's), then a little
  truncated  a well-formed frame cut short, then the stream closed
  wrong      1-3 well-formed frames of the protocol's own message types with wrong, missing or mistyped
             fields (msgpack maps for ours, protobuf of the right message type for py-libp2p's)
  mutated    such a frame with bytes flipped, inserted or dropped
on each of PROTOCOLS: ours (session, step, result, probe, auth), gossipsub, identify and identify/push,
ping, circuit relay v2 hop and stop, and multistream-select itself (a raw muxed stream, before any
protocol is chosen). Used by tests/test_fuzz.py (a few hundred frames per protocol) and
benchmarks/fuzz_bench.py (thousands).
"""
from __future__ import annotations

import random
import struct
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import trio
from libp2p.custom_types import TProtocol
from libp2p.identity.identify.identify import ID as IDENTIFY
from libp2p.identity.identify.pb.identify_pb2 import Identify
from libp2p.identity.identify_push.identify_push import ID_PUSH as IDENTIFY_PUSH
from libp2p.peer.id import ID
from libp2p.pubsub.pb import rpc_pb2
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage, StopMessage
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as RELAY_HOP
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID as RELAY_STOP
from libp2p.utils.varint import encode_uvarint

from beeswarm.protocol import encode, ids
from beeswarm.protocol.audit import Evidence, Reveal, Revealed, RevealedStep
from beeswarm.protocol.auth import Challenge, Proof
from beeswarm.protocol.membership import Beat, NodeInfo
from beeswarm.protocol.probe import Download, Ping, Upload
from beeswarm.protocol.session import Close, Open
from beeswarm.protocol.spans import Span
from beeswarm.protocol.step import CacheState, Commit, Keep, Result, Step, StepError

GOSSIPSUB = "/meshsub/1.0.0"
PING = "/ipfs/ping/1.0.0"
MULTISTREAM = "multistream-select"  # a raw muxed stream: the negotiation itself is the target
OURS = (ids.SESSION, ids.STEP, ids.RESULT, ids.PROBE, ids.AUTH, ids.MEMBERS, ids.AUDIT, ids.EVIDENCE)
PROTOCOLS = (*OURS, GOSSIPSUB, str(IDENTIFY), str(IDENTIFY_PUSH), PING, str(RELAY_HOP), str(RELAY_STOP), MULTISTREAM)
KINDS = ("random", "huge", "truncated", "wrong", "wrong", "mutated")


@dataclass
class Context:
    """What a hostile peer knows: the target's peer id and topics, its own id and a way to sign as itself."""

    target: str
    me: str
    topics: tuple[str, ...]
    sign: Callable[[bytes], bytes]


@dataclass
class Tally:
    frames: Counter[str] = field(default_factory=Counter)  # frames written, per protocol
    attempts: Counter[str] = field(default_factory=Counter)  # streams tried
    refused: Counter[str] = field(default_factory=Counter)  # streams the target would not open
    kinds: Counter[str] = field(default_factory=Counter)  # frames written, per kind


# values of every type, for fields of another -------------------------------------------------------
def _nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


ODD_VALUES: tuple[Any, ...] = (None, True, -1, 0, 2**63 - 1, -(2**63), 2**64 - 1, 1.5, float("nan"), float("inf"),
                               "", "x", "é" * 40, "a" * 5000, b"", b"\xff" * 300, [], [1, "2", None], {}, {"t": "x"},
                               {1: 2}, _nested(200), msgspec.msgpack.Ext(1, b"ext"))


def _odd(rng: random.Random) -> Any:
    return rng.choice(ODD_VALUES)


def _wrong_map(rng: random.Random, valid: msgspec.Struct, tags: tuple[str, ...]) -> bytes:
    """A msgpack map of `valid`'s message with 1-3 fields mistyped, dropped or added, or its tag or version wrong."""
    msg: dict[Any, Any] = msgspec.msgpack.decode(encode(valid))
    for _ in range(rng.randint(1, 3)):
        what = rng.random()
        keys = list(msg)
        if what < 0.55 and keys:
            msg[rng.choice(keys)] = _odd(rng)
        elif what < 0.7 and keys:
            msg.pop(rng.choice(keys))
        elif what < 0.8:
            msg["t"] = rng.choice([*tags, "error", "mystery", 7, None])
        elif what < 0.9:
            msg["v"] = rng.choice([0, 2, -1, "1", None])
        else:
            msg[rng.choice(["extra", 1, b"k", None])] = _odd(rng)
    try:
        return msgspec.msgpack.encode(msg)
    except (TypeError, ValueError, OverflowError):  # a value msgpack cannot carry: whatever it started as
        return encode(valid)


def _peer_id(rng: random.Random, ctx: Context) -> str:
    return rng.choice([ctx.target, ctx.me, "12D3KooWNotAPeer", "x" * 128, str(ID(b"\x00\x24\x08\x01\x12\x20"
                                                                               + rng.randbytes(32)))])


def _frame_bytes(rng: random.Random) -> bytes:
    return rng.choice([b"", b"junk", rng.randbytes(rng.randint(1, 64)), b"BSWF" + rng.randbytes(40)])


# bodies of the right message type, wrong inside ---------------------------------------------------------
def _session(rng: random.Random, ctx: Context) -> bytes:
    valid = rng.choice([Open(session=f"s{rng.randint(0, 9)}", max_length=rng.choice([1, 8, 10**6]),
                             prev=_peer_id(rng, ctx), span=Span(*sorted(rng.sample(range(0, 12), 2))),
                             next=rng.choice([None, _peer_id(rng, ctx)])),
                        Close(session=rng.choice(["s1", "", "nope"]))])
    return _wrong_map(rng, valid, ("open", "close")) if rng.random() < 0.8 else encode(valid)


def _step(rng: random.Random, ctx: Context) -> bytes:
    valid = Step(entry=_peer_id(rng, ctx), session=f"s{rng.randint(0, 9)}", step=rng.randint(0, 10**6),
                 start=rng.randint(0, 64), frame=_frame_bytes(rng), mask=rng.choice([None, b"m"]),
                 expect=CacheState(rng.randint(0, 64), rng.randint(0, 3)), held=rng.choice([0, 0, 1, 70000]),
                 keep=rng.choice([None, Keep(0, (1, 2)), Keep(5, ())]))
    return _wrong_map(rng, valid, ("step",)) if rng.random() < 0.8 else encode(valid)


def _result(rng: random.Random, ctx: Context) -> bytes:
    valid = rng.choice([Result(session="s1", step=rng.randint(-5, 5), frame=_frame_bytes(rng)),
                        StepError(session="s1", step=1, error="e" * rng.randint(0, 900), culprit=_peer_id(rng, ctx))])
    return _wrong_map(rng, valid, ("result", "step_error")) if rng.random() < 0.8 else encode(valid)


def _probe(rng: random.Random, ctx: Context) -> bytes:
    # well-formed downloads stay small: the target answers them (a 64 MB one would only measure our link)
    valid = rng.choice([Ping(), Upload(bytes=rng.choice([0, 1, 64 * 1024 * 1024])),
                        Download(bytes=rng.randint(0, 4096))])
    return _wrong_map(rng, valid, ("ping", "upload", "download", "pong")) if rng.random() < 0.8 else encode(valid)


def _auth(rng: random.Random, ctx: Context) -> bytes:
    valid = rng.choice([Challenge(nonce=rng.randbytes(32)), Proof(nonce=rng.randbytes(32), mac=rng.randbytes(32))])
    return _wrong_map(rng, valid, ("challenge", "proof")) if rng.random() < 0.8 else encode(valid)


def _beat(rng: random.Random, ctx: Context) -> bytes:
    info = NodeInfo(peer=rng.choice([ctx.me, ctx.me, _peer_id(rng, ctx)]), addrs=("/ip4/127.0.0.1/tcp/1",),
                    state=rng.choice(["idle", "serving"]))
    valid = Beat(info=rng.choice([None, info]), since=rng.choice([0, 1, 2**40]))
    return _wrong_map(rng, valid, ("beat",)) if rng.random() < 0.8 else encode(valid)


def _reveal(rng: random.Random, ctx: Context) -> bytes:
    valid = Reveal(session=rng.choice(["s1", "", "x" * 64]), step=rng.choice([0, 1, 2**40]))
    return _wrong_map(rng, valid, ("reveal",)) if rng.random() < 0.8 else encode(valid)


def _commit(rng: random.Random, ctx: Context) -> Commit:
    unsigned = Commit(stage=_peer_id(rng, ctx), step=rng.randint(0, 9), span=Span(*sorted(rng.sample(range(0, 12), 2))),
                      context=rng.randbytes(16), input=rng.randbytes(16), output=rng.randbytes(16), sig=b"")
    if rng.random() < 0.5:  # signed by us, as a stage would (the checker gets past the signatures)
        unsigned = msgspec.structs.replace(unsigned, stage=ctx.me)
        body = msgspec.msgpack.encode(("beeswarm/commit/1", ctx.me, "s1", unsigned.step, unsigned.span.start,
                                       unsigned.span.end, unsigned.context, unsigned.input, unsigned.output))
        return msgspec.structs.replace(unsigned, sig=ctx.sign(body))
    return msgspec.structs.replace(unsigned, sig=rng.randbytes(64))


def _evidence(rng: random.Random, ctx: Context) -> bytes:
    commits = tuple(_commit(rng, ctx) for _ in range(rng.choice([0, 1, 2, 5])))
    revealed = rng.choice([None, Revealed(stage=ctx.me, session="s1", sig=rng.randbytes(64), steps=tuple(
        RevealedStep(c.step, rng.randint(0, 9), rng.choice([None, b"m"]), None, _frame_bytes(rng), _frame_bytes(rng))
        for c in commits))])
    valid = Evidence(kind=rng.choice(["wrong", "contradiction", "chain"]), accused=rng.choice([ctx.me, ctx.target]),
                     accuser=rng.choice([ctx.me, ctx.me, ctx.target]), session="s1",
                     span=commits[0].span if commits else Span(0, 1), commits=commits, revealed=revealed)
    if rng.random() < 0.5:
        valid = msgspec.structs.replace(valid, sig=ctx.sign(encode(valid)))
    return _wrong_map(rng, valid, ("evidence",)) if rng.random() < 0.6 else encode(valid)


def _text(rng: random.Random, ctx: Context) -> str:
    if rng.random() < 0.03:
        return "t" * 3000
    return rng.choice([*ctx.topics, "", "beeswarm/other/members", "\u0000\ud7ff", "é", f"/p/{rng.randrange(99)}"])


def _pubsub_message(rng: random.Random, ctx: Context) -> rpc_pb2.Message:
    me = ID.from_base58(ctx.me).to_bytes()
    msg = rpc_pb2.Message(data=rng.choice([b"", rng.randbytes(50), msgspec.msgpack.encode({"t": "heartbeat", "v": 1,
                                                                                          "info": _odd(rng)})]),
                          seqno=rng.choice([b"", rng.randbytes(8), rng.randbytes(300)]))
    msg.topicIDs.extend(rng.sample(list(ctx.topics), rng.randint(1, len(ctx.topics))))
    how = rng.random()
    if how < 0.3:  # signed by us, as us: well-formed, wrong inside (our own message types, mistyped)
        msg.from_id = me
        msg.signature = ctx.sign(b"libp2p-pubsub:" + msg.SerializeToString())
    elif how < 0.6:  # an author id that carries no key, a signature, and a key that does not parse
        msg.from_id = rng.choice([b"", b"\x12\x20" + rng.randbytes(32), rng.randbytes(10)])
        msg.signature, msg.key = rng.randbytes(64), rng.choice([b"junk key", rng.randbytes(40), b"\x08\x01"])
    else:
        msg.from_id = rng.choice([me, rng.randbytes(38), b""])
        msg.signature = rng.choice([b"", rng.randbytes(64)])
        if rng.random() < 0.5:
            msg.key = rng.randbytes(36)
    return msg


def _gossipsub(rng: random.Random, ctx: Context) -> bytes:
    rpc = rpc_pb2.RPC()
    parts = rng.sample(["subscriptions", "publish", "control", "senderRecord"], rng.randint(1, 4))
    if "subscriptions" in parts:
        for _ in range(rng.choice([1, 2, 5, 200])):
            rpc.subscriptions.add(subscribe=rng.random() < 0.7, topicid=_text(rng, ctx))
    if "publish" in parts:
        rpc.publish.extend(_pubsub_message(rng, ctx) for _ in range(rng.randint(1, 3)))
    if "control" in parts:
        control = rpc.control
        ids_ = [rng.choice([b"zz", rng.randbytes(20), rng.randbytes(20).hex().encode(), b""]) for _ in range(5)]
        control.ihave.add(topicID=_text(rng, ctx), messageIDs=ids_ * rng.choice([1, 100]))
        control.iwant.add(messageIDs=ids_)
        control.graft.add(topicID=_text(rng, ctx))
        prune = control.prune.add(topicID=_text(rng, ctx), backoff=rng.choice([0, 1, 2**63 - 1, 2**64 - 1]))
        for _ in range(rng.choice([0, 1, 20])):
            prune.peers.add(peerID=rng.choice([b"", rng.randbytes(38), ID.from_base58(ctx.me).to_bytes()]),
                            signedPeerRecord=rng.choice([b"", rng.randbytes(80)]))
        control.idontwant.add(messageIDs=ids_)
        if rng.random() < 0.3:
            control.extensions.topicObservation = True
            control.observe.add(topicID=_text(rng, ctx))
            control.unobserve.add(topicID=_text(rng, ctx))
    if "senderRecord" in parts:
        rpc.senderRecord = rng.randbytes(rng.choice([1, 100, 2000]))
    return rpc.SerializeToString()


def _identify(rng: random.Random, ctx: Context) -> bytes:
    msg = Identify(protocol_version=_text(rng, ctx), agent_version=_text(rng, ctx),
                   public_key=rng.choice([b"", rng.randbytes(36), b"\x08\x01\x12\x20" + rng.randbytes(32)]),
                   listen_addrs=[rng.choice([b"", rng.randbytes(12), b"\x04\x7f\x00\x00\x01\x06\x00\x01"])
                                 for _ in range(rng.choice([0, 1, 50]))],
                   observed_addr=rng.choice([b"", rng.randbytes(9), b"\x04\x0a\x00\x00\x01"]),
                   protocols=[_text(rng, ctx) for _ in range(rng.choice([0, 2, 300]))],
                   signedPeerRecord=rng.choice([b"", rng.randbytes(120)]))
    return msg.SerializeToString()


def _relay_peer(rng: random.Random, ctx: Context) -> bytes:
    return rng.choice([b"", rng.randbytes(38), b"\x00\x24" + rng.randbytes(36), ID.from_base58(ctx.me).to_bytes()])


def _hop(rng: random.Random, ctx: Context) -> bytes:
    msg = HopMessage(type=rng.choice([HopMessage.RESERVE, HopMessage.CONNECT, HopMessage.STATUS]))
    if rng.random() < 0.8:
        msg.peer.id = _relay_peer(rng, ctx)
        msg.peer.addrs.extend(rng.randbytes(rng.randint(0, 12)) for _ in range(rng.randint(0, 3)))
    if rng.random() < 0.3:
        msg.status = rng.choice([0, 100, 400])
    if rng.random() < 0.3:
        msg.limit.duration, msg.limit.data = rng.randint(0, 2**32 - 1), rng.randint(0, 2**64 - 1)
    if rng.random() < 0.2:
        msg.senderRecord = rng.randbytes(100)
    body = msg.SerializeToString()
    return body if rng.random() < 0.8 else body + b"\x08\x63"  # type 99: no such type


def _stop(rng: random.Random, ctx: Context) -> bytes:
    msg = StopMessage(type=rng.choice([StopMessage.CONNECT, StopMessage.STATUS]))
    if rng.random() < 0.8:
        msg.peer.id = _relay_peer(rng, ctx)
    if rng.random() < 0.3:
        msg.status = rng.choice([0, 100, 400])
    return msg.SerializeToString()


def _multistream(rng: random.Random, ctx: Context) -> bytes:
    line = rng.choice([b"\xff\xfe", b"/multistream/1.0.0", b"ls", b"na", b"/beeswarm/\xc3\x28", b"\x00" * 3,
                       b"/x" * 3000, rng.randbytes(rng.randint(1, 40)), ids.SESSION.encode()])
    return line + (b"\n" if rng.random() < 0.85 else b"")


def _ping(rng: random.Random, ctx: Context) -> bytes:
    return rng.randbytes(rng.choice([32, 32, 1, 31, 33, 64, 4096]))


# framings: u32 big-endian (ours), unsigned varint (py-libp2p's), none (ping) -------------------------
def _u32(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def length_prefixed(body: bytes) -> bytes:
    return encode_uvarint(len(body)) + body


def _raw(body: bytes) -> bytes:
    return body


@dataclass(frozen=True)
class Spec:
    body: Callable[[random.Random, Context], bytes]
    frame: Callable[[bytes], bytes]
    huge: Callable[[random.Random], bytes]


def _huge_u32(rng: random.Random) -> bytes:
    return struct.pack(">I", rng.choice([2**31, 2**32 - 1, 300 * 2**20, 256 * 2**20 + 1, 65 * 1024])) + rng.randbytes(9)


def _huge_varint(rng: random.Random) -> bytes:
    if rng.random() < 0.2:
        return b"\xff" * rng.randint(10, 20)  # a varint that never ends
    return encode_uvarint(rng.choice([2**20 + 1, 2**31, 2**63 - 1, 2**64 - 1])) + rng.randbytes(9)


def _huge_raw(rng: random.Random) -> bytes:
    return rng.randbytes(64 * 1024)


SPECS: dict[str, Spec] = {
    ids.SESSION: Spec(_session, _u32, _huge_u32),
    ids.STEP: Spec(_step, _u32, _huge_u32),
    ids.RESULT: Spec(_result, _u32, _huge_u32),
    ids.PROBE: Spec(_probe, _u32, _huge_u32),
    ids.AUTH: Spec(_auth, _u32, _huge_u32),
    ids.MEMBERS: Spec(_beat, _u32, _huge_u32),
    ids.AUDIT: Spec(_reveal, _u32, _huge_u32),
    ids.EVIDENCE: Spec(_evidence, _u32, _huge_u32),
    GOSSIPSUB: Spec(_gossipsub, length_prefixed, _huge_varint),
    str(IDENTIFY): Spec(_identify, length_prefixed, _huge_varint),
    str(IDENTIFY_PUSH): Spec(_identify, length_prefixed, _huge_varint),
    PING: Spec(_ping, _raw, _huge_raw),
    str(RELAY_HOP): Spec(_hop, length_prefixed, _huge_varint),
    str(RELAY_STOP): Spec(_stop, length_prefixed, _huge_varint),
    MULTISTREAM: Spec(_multistream, length_prefixed, _huge_varint),
}


def _mutate(rng: random.Random, data: bytes) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        at = rng.randrange(len(out) + 1)
        op = rng.random()
        if op < 0.5 and out:
            out[min(at, len(out) - 1)] ^= 1 << rng.randrange(8)
        elif op < 0.75:
            out[at:at] = rng.randbytes(rng.randint(1, 4))
        elif out:
            del out[at:at + rng.randint(1, 4)]
    return bytes(out)


def attempt(protocol: str, rng: random.Random, ctx: Context) -> tuple[str, list[bytes]]:
    """(kind, frames) for one stream: written in order, then the stream is closed."""
    spec = SPECS[protocol]
    kind = rng.choice(KINDS)
    if kind == "random":
        return kind, [rng.randbytes(rng.choice([1, 2, 3, 4, 7, 31, 32, 33, 100, 300, 1500, 8000]))]
    if kind == "huge":
        return kind, [spec.huge(rng)]
    if kind == "truncated":
        whole = spec.frame(spec.body(rng, ctx))
        return kind, [whole[:rng.randrange(1, len(whole))] if len(whole) > 1 else b""]
    frames = [spec.frame(spec.body(rng, ctx)) for _ in range(rng.choice([1, 1, 2, 3]))]
    if protocol == MULTISTREAM and rng.random() < 0.5:  # a proper greeting first: the junk reaches the protocol choice
        frames.insert(0, length_prefixed(b"/multistream/1.0.0\n"))
    if kind == "mutated":
        frames = [_mutate(rng, f) for f in frames]
    return kind, frames


async def open_stream(evil: Any, target: ID, protocol: str) -> Any:
    if protocol != MULTISTREAM:
        return await evil._host.new_stream(target, [TProtocol(protocol)])
    conns = evil._host.get_network().get_connections(target)
    if not conns:
        raise ConnectionError("not connected")
    return await conns[0].muxed_conn.open_stream()


async def barrage(evil: Any, target: str, frames_per_protocol: int, seed: int = 0,
                  protocols: tuple[str, ...] = PROTOCOLS, workers_per_protocol: int = 2,
                  topics: tuple[str, ...] = ()) -> Tally:
    """From the node `evil` (in its loop), at least `frames_per_protocol` frames on each of `protocols` to
    `target`, `workers_per_protocol` streams at a time per protocol; stops early on a protocol whose
    streams keep being refused."""
    ctx = Context(target, evil.peer_id, topics or (f"beeswarm/{evil.config.swarm}/members",),
                  evil.identity.key_pair.private_key.sign)
    peer = ID.from_base58(target)
    tally = Tally()

    async def worker(protocol: str, rng: random.Random) -> None:
        while tally.frames[protocol] < frames_per_protocol and tally.refused[protocol] < 50:
            kind, frames = attempt(protocol, rng, ctx)
            tally.attempts[protocol] += 1
            try:
                with trio.fail_after(10):
                    stream = await open_stream(evil, peer, protocol)
            except Exception:  # noqa: BLE001 - refused, reset, timed out: counted
                tally.refused[protocol] += 1
                await trio.sleep(0.01)
                continue
            try:
                with trio.fail_after(10):
                    for f in frames:
                        await stream.write(f)
                        tally.frames[protocol] += 1
                        tally.kinds[kind] += 1
                    await stream.close()
            except Exception:  # noqa: BLE001 - the target reset the stream: expected
                try:
                    await stream.reset()
                except Exception:  # noqa: BLE001
                    pass

    async with trio.open_nursery() as nursery:
        for i, protocol in enumerate(protocols):
            for w in range(workers_per_protocol):
                nursery.start_soon(worker, protocol, random.Random(f"{seed}/{i}/{w}"))
    return tally
