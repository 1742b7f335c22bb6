"""Whether other hosts can dial this node, learnt by asking peers to dial it back (as AutoNAT does).

py-libp2p 0.8.1's AutoNAT cannot tell: its dial-back calls `host.connect`, which returns at once on the
connection the request itself came on, so every node it asks about is "public". Here the asked peer opens
a fresh TCP connection to the address the request came from, at each port the asker listens on, and
checks that a libp2p node answers there (multistream-select's greeting); it also says which address it
saw the request come from, which is the asker's public address behind a NAT. Only that address is
dialled, at no more than MAX_PORTS ports, so nobody can aim a node's dials at a third host.

A node asks up to ASK peers it is directly connected to. Answers from peers that saw it at a public
address count over those that saw a private one (a peer on the same home network reaches it where the
internet cannot): one dial-back that worked makes it public; as many failed ones as peers asked (two at
least, unless it knows only one peer), and none that worked, make it private. So does one peer failing twice
(ANSWER_EVERY_S apart) with none that worked: the others a node knows may be clients that come and go before
they answer (a `status`, a chat), and their count alone must not keep a node behind a NAT "unknown".
"""
from __future__ import annotations

import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import trio

from beeswarm.p2p.addresses import is_public
from beeswarm.protocol.reach import MAX_PORTS, DialBack, DialedBack, Reach

log = logging.getLogger(__name__)

ASK = 3  # peers asked each round
PROBE_TIMEOUT_S = 3.0
ANSWER_EVERY_S = 10.0  # a peer is dialled back at most this often
RECHECK_S = 120.0  # how often a node that knows its reach asks again (addresses and routers change)
UNKNOWN_RETRY_S = 5.0  # and one that does not yet
MULTISTREAM = b"\x13/multistream/1.0.0\n"  # multistream-select's greeting, which a libp2p listener sends too


async def answers_on(ip: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a libp2p node accepts a new TCP connection at ip:port and greets with multistream-select."""
    with trio.move_on_after(timeout):
        try:
            stream = await trio.open_tcp_stream(ip, port)
        except OSError:
            return False
        async with stream:
            try:
                await stream.send_all(MULTISTREAM)
                got = b""
                while len(got) < len(MULTISTREAM):
                    chunk = await stream.receive_some(64)
                    if not chunk:
                        break
                    got += chunk
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                return False
            return got.startswith(MULTISTREAM)
    return False


class DialBackServer:
    """Answers peers' `DialBack` requests (serve `answer` on `ids.DIALBACK`, in the node's loop)."""

    def __init__(self, remote_ip: Callable[[str], str | None], clock: Callable[[], float] = time.monotonic):
        """`remote_ip(peer)`: the address `peer`'s direct connection comes from (None: none, or relayed)."""
        self.remote_ip, self.clock = remote_ip, clock
        self._answered: dict[str, float] = {}  # peer -> when it was last dialled back
        self._dials = trio.Semaphore(8)

    async def answer(self, peer: str, request: DialBack) -> DialedBack:
        ip = self.remote_ip(peer)
        now = self.clock()
        self._answered = {p: t for p, t in self._answered.items() if now - t < ANSWER_EVERY_S}
        if ip is None or peer in self._answered:  # no answer at all: not a failed dial-back
            return DialedBack(observed_ip="", dialable=())
        self._answered[peer] = now
        dialable: list[int] = []

        async def dial(port: int) -> None:
            async with self._dials:
                if await answers_on(ip, port):
                    dialable.append(port)

        async with trio.open_nursery() as nursery:
            for port in dict.fromkeys(request.ports[:MAX_PORTS]):
                nursery.start_soon(dial, port)
        return DialedBack(observed_ip=ip, dialable=tuple(sorted(dialable)))


@dataclass(frozen=True)
class Answer:
    observed_ip: str
    dialable: tuple[int, ...]


def verdict(answers: Iterable[Answer], asked_at_least: int) -> Reach:
    """Public, private or unknown from peers' answers (`asked_at_least`: how many failures make it private)."""
    answers = list(answers)
    public = [a for a in answers if is_public(a.observed_ip)]
    counted = public or answers
    if any(a.dialable for a in counted):
        return "public"
    if counted and len(counted) >= asked_at_least:
        return "private"
    return "unknown"


class Reachability:
    """What this node learnt of its reach; `observed_ip` is the address the last public-facing answer saw."""

    def __init__(self) -> None:
        self.reach: Reach = "unknown"
        self.observed_ip: str | None = None
        self.answers: dict[str, Answer] = {}  # peer -> its last answer
        self.failed: dict[str, int] = {}  # peer -> its failed dial-backs in a row

    def heard(self, peer: str, reply: DialedBack, peers_known: int) -> Reach:
        if reply.observed_ip:
            self.answers[peer] = Answer(reply.observed_ip, tuple(reply.dialable))
            self.failed[peer] = 0 if reply.dialable else self.failed.get(peer, 0) + 1
            if is_public(reply.observed_ip) or self.observed_ip is None:
                self.observed_ip = reply.observed_ip
        needed = 1 if max(self.failed.values(), default=0) >= 2 else min(2, max(1, peers_known))
        before, self.reach = self.reach, verdict(self.answers.values(), needed)
        if self.reach != before:
            log.info("reachability: %s (dialled back by %d of %d peers asked; seen from %s)", self.reach,
                     sum(bool(a.dialable) for a in self.answers.values()), len(self.answers), self.observed_ip)
        return self.reach

    def public_addrs(self, peer_id: str) -> list[str]:
        """Where peers dialled this node at its public address: behind a port forward the host knows only its
        private address, so these are announced first."""
        seen = self.observed_ip
        if self.reach != "public" or not seen or not is_public(seen):
            return []
        ports = sorted({port for a in self.answers.values() if a.observed_ip == seen for port in a.dialable})
        return [f"/ip4/{seen}/tcp/{port}/p2p/{peer_id}" for port in ports]

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the answers of peers no longer connected (their word is about addresses that may have changed)."""
        kept = set(keep)
        self.answers = {p: a for p, a in self.answers.items() if p in kept}
        self.failed = {p: n for p, n in self.failed.items() if p in kept}


async def keep_learning(reachability: Reachability, direct_peers: Callable[[], list[str]],
                        ports: Callable[[], tuple[int, ...]],
                        ask: Callable[[str, DialBack], Awaitable[DialedBack]]) -> None:
    """Ask peers to dial this node back, now and then for the node's lifetime (a task in the node's loop).
    `direct_peers()`: the peers connected without a relay; `ports()`: the TCP ports this node listens on."""
    while True:
        peers, listening = direct_peers(), ports()
        reachability.forget(peers)
        if peers and listening:
            async def one(peer: str) -> None:
                try:
                    reply = await ask(peer, DialBack(ports=listening[:MAX_PORTS]))
                except Exception as e:  # noqa: BLE001 - a peer that cannot answer just does not count
                    log.debug("dial-back by %s: %s", peer, e)
                    return
                reachability.heard(peer, reply, len(peers))

            async with trio.open_nursery() as nursery:
                for peer in random.sample(peers, min(ASK, len(peers))):
                    nursery.start_soon(one, peer)
        await trio.sleep(UNKNOWN_RETRY_S if reachability.reach == "unknown" else RECHECK_S)
