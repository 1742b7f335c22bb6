"""Who is in the swarm: heartbeats carrying each node's info, and a view with events.

What grows with the swarm is kept flat per node:
- Beats to the coordinator: once a node follows a coordinator (`lease()`, which the plan follower
  gives with `follow`) and is connected to it, it beats to it over a request (`ids.MEMBERS`) every
  interval, sending its info only when it changed, and the answer is the coordinator's view: every
  live member with the seconds since it was heard, and the info of those that changed since the view
  this node holds. A node then handles one small message pair per interval whatever the swarm's
  size; only the coordinator's inbound grows with N.
- Gossip heartbeats, until then (a young swarm, an election, a coordinator out of reach): a node
  beats every `period()` = max(interval, members / TARGET_BEATS_PER_S), so each node receives about
  TARGET_BEATS_PER_S heartbeats a second whatever the swarm's size (gossipsub forwards each one to
  its mesh peers: a few per message, not N). A change that matters (state, spans, figures, addresses:
  everything but the served tokens/s) is sent at once instead.
- Liveness: a member is gone `interval` after its connection to us dropped without coming back (a
  killed process is noticed in about a second), or after MISSED_BEATS of *its own* period without a
  heartbeat.
- A pause of this process (SIGSTOP, swapping) is not everyone else's silence: when the loop wakes
  PAUSED_BEATS intervals late, every member's silence timer starts again.
- A newcomer's first beat goes to its bootstrap, which answers with whom it follows (and where to
  dial it): the newcomer beats to the coordinator at once instead of waiting for gossip. A member
  speaks for itself and the coordinator it names, never for others: only the coordinator's answer is
  a view. Its answers also tell the election that it lives (`on_view`), whatever gossip drops.
- Connections are not a full mesh (N^2 handshakes, ~40 ms of CPU each, would swamp a swarm starting
  at once): a node keeps links to its coordinator, the members `wanted()` names (the plan's stages,
  also given by `follow`) and NEIGHBOURS others for gossip; other links are dialled on demand. Dials
  back off per unreachable member.
- Members heard lately stay in an address book after they leave the view, and one of them is dialled
  now and then (`addressbook`): a node whose bootstrap and neighbours all went, or a swarm split in two,
  finds the rest of the swarm again.
"""
from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import trio

from beeswarm.p2p import addresses
from beeswarm.p2p.addressbook import AddressBook
from beeswarm.p2p.errors import NodeError, PeerUnavailable
from beeswarm.p2p.node import Node
from beeswarm.protocol import Decoder, ErrorReply, Message, ProtocolError, RemoteError, ids
from beeswarm.protocol.membership import Beat, Heartbeat, Leave, NodeInfo, View
from beeswarm.protocol.rpcs import MEMBERS

log = logging.getLogger(__name__)

MISSED_BEATS = 3
PAUSED_BEATS = 2.0  # a sleep this much longer than asked means this process was paused (SIGSTOP, swapping)
TARGET_BEATS_PER_S = 8.0  # heartbeats a node receives per second from the whole swarm
MAX_BEAT_S = 60.0
DIAL_BACKOFF_S = (1.0, 30.0)  # first retry, cap
MAX_DIALS = 2  # neighbour dials in flight at once
LEAVE_S = 2.0  # the most a leave announcement may take
NEIGHBOURS = 4  # links kept besides the coordinator and the plan's stages (gossip needs a few)
RESEND_INFO_BEATS = 10  # a beat to the coordinator carries the full info at least this often
_messages: Decoder[Heartbeat | Leave] = Decoder(Heartbeat, Leave)


@dataclass(frozen=True)
class Member:
    info: NodeInfo
    last_seen: float  # time.monotonic()


@dataclass
class MemberCounts:
    """Messages this node's membership handled since it started (what the mesh benchmark rates)."""
    beats_sent: int = 0  # gossip heartbeats published
    beats_received: int = 0  # heartbeats and beats taken
    views_received: int = 0  # coordinator (or bootstrap) answers to this node's beats


@dataclass
class _CoordinatorBeats:
    """What this node and the member it beats to (the coordinator, or a bootstrap) know of each other."""
    held: tuple[str, int] | None = None  # (member, seq) of the last view taken from it
    acked: tuple[str, NodeInfo] | None = None  # (member, the info it last took from this node)
    sent: int = 0  # beats sent


class DialBackoff:
    """Dials in flight to members (a few at once), and when an unreachable member may be dialled again: its wait
    doubles with each failed dial, up to DIAL_BACKOFF_S[1], and is forgotten once it connects."""

    def __init__(self, clock: Callable[[], float]):
        self.clock = clock
        self.dialing: set[str] = set()
        self._after: dict[str, tuple[float, float]] = {}  # member -> (next try, backoff)

    def may_dial(self, peer: str, now: float) -> bool:
        return peer not in self.dialing and now >= self._after.get(peer, (0.0, 0.0))[0]

    def failed(self, peer: str) -> None:
        _, backoff = self._after.get(peer, (0.0, DIAL_BACKOFF_S[0] / 2))
        backoff = min(DIAL_BACKOFF_S[1], backoff * 2)
        self._after[peer] = (self.clock() + backoff, backoff)

    def forget(self, peer: str) -> None:
        self._after.pop(peer, None)


def _material(info: NodeInfo) -> NodeInfo:
    """What peers act on: everything but the figures that change every beat."""
    return msgspec.structs.replace(info, load=0.0, sessions=0, beat_s=0.0)


Listener = Callable[[str, NodeInfo], None]  # (event: join | update | leave, info)


class Membership:
    """Nothing starts until `start()`; `clock` (monotonic seconds) is injectable for tests."""

    def __init__(self, node: Node, info: NodeInfo, interval: float = 3.0,
                 clock: Callable[[], float] = time.monotonic):
        self.node, self.interval, self.clock = node, interval, clock
        self._info = info
        self._members: dict[str, Member] = {}
        self._lock = threading.Lock()
        self.listeners: list[Listener] = []
        self.counts = MemberCounts()
        self._published: NodeInfo | None = None
        self._lost: dict[str, float] = {}  # member -> when its connection dropped
        self.book = AddressBook()  # members heard lately, dialled again once out of view
        self._dials = DialBackoff(clock)
        self._lease: Callable[[], tuple[str, int] | None] = lambda: None  # (coordinator followed, term): `follow`
        self._wanted: Callable[[], Iterable[str]] = lambda: ()  # members to stay connected to: `follow`
        self.on_view: list[Callable[[str, View], None]] = []  # (the member that answered a beat, its answer)
        self._hint: str | None = None  # the coordinator a member's answer named, until the election names one
        self._seq = 0  # bumped by every change of a member's info (numbers the views this node serves)
        self._changed_at: dict[str, int] = {}  # member -> the seq of its last change (this node's own: "")
        self._beats = _CoordinatorBeats()
        self._refresh = False  # beat (and take the coordinator's view) at the next turn, not the next period

    @property
    def info(self) -> NodeInfo:
        return self._info

    def update(self, **changes: Any) -> None:
        with self._lock:
            info = msgspec.structs.replace(self._info, **changes)
            if info != self._info:
                self._seq += 1
                self._changed_at[""] = self._seq
            self._info = info

    def start(self) -> None:
        """Subscribe and start beating; call before or after `node.start()`."""
        self.node.watch_peers(self._on_connected, self._on_disconnected)
        self.node.keep_dialable(self.view)  # members stay dialable while not connected
        self.node.take_relays_from(self._relays)
        self.node.subscribe(self.node.topic(ids.MEMBERS_TOPIC), _messages, self._on_message)
        self.node.serve(MEMBERS, self._on_beat)
        self.node.add_task(self._beat)

    def follow(self, lease: Callable[[], tuple[str, int] | None], wanted: Callable[[], Iterable[str]]) -> None:
        """Beat to the coordinator `lease()` names ((leader, term), or None: none yet) and stay linked to the
        members `wanted()` names (the plan's stages): what the node's plan follower knows. Until then, neither."""
        self._lease, self._wanted = lease, wanted

    def refresh(self) -> None:
        """Take the coordinator's view now: a new plan names stages whose new spans this view may not hold
        yet (routes wait on them), and the next beat would be up to an interval away."""
        self._refresh = True

    def _leader(self) -> str | None:
        lease = self._lease()
        return lease[0] if lease else None

    def view(self, with_self: bool = False) -> dict[str, NodeInfo]:
        """Each member's info (the others); `with_self`: this node's own too."""
        with self._lock:
            view = {peer: m.info for peer, m in self._members.items()}
            if with_self:
                view[self._info.peer] = self._info
            return view

    def members(self) -> dict[str, Member]:
        """Each member's info with when it was last heard from (`clock()` time)."""
        with self._lock:
            return dict(self._members)

    def period(self) -> float:
        """This node's heartbeat period: slower as the swarm grows, so what each node receives stays flat."""
        with self._lock:
            n = len(self._members)
        return min(MAX_BEAT_S, max(self.interval, (n + 1) / TARGET_BEATS_PER_S))

    def _on_connected(self, peer: str) -> None:
        with self._lock:
            self._lost.pop(peer, None)
            self._dials.forget(peer)

    def _on_disconnected(self, peer: str) -> None:
        with self._lock:
            if peer in self._members:
                self._lost[peer] = self.clock()

    def leave(self) -> None:
        """Tell the swarm this node is leaving (best effort, within LEAVE_S: a peer slow to take it must not
        hold up the process's exit)."""
        try:
            self.node.call(self._leave)
        except Exception as e:  # noqa: BLE001
            log.debug("leave announcement failed: %s", e)

    async def _leave(self) -> None:
        with trio.move_on_after(LEAVE_S):
            await self.node.publish_async(self.node.topic(ids.MEMBERS_TOPIC), Leave())

    def _emit(self, event: str, info: NodeInfo) -> None:
        for listener in list(self.listeners):
            try:
                listener(event, info)
            except Exception:  # noqa: BLE001
                log.exception("membership listener failed")

    def _on_message(self, author: str, msg: Heartbeat | Leave) -> None:
        if isinstance(msg, Leave):
            with self._lock:
                gone = self._drop(author)
            if gone:
                self._emit("leave", gone.info)
            return
        if msg.info.peer != author:
            raise ProtocolError(f"info claims to be {msg.info.peer} but was published by {author}")
        self.counts.beats_received += 1
        self._heard(msg.info, self.clock())

    def _heard(self, info: NodeInfo, seen: float) -> None:
        """`info` of a member, as it was `seen` (a heartbeat, a beat, or the coordinator's view)."""
        author = info.peer
        if author == self.node.peer_id:
            return
        known = self._members.get(author)
        if known is None or known.info.addrs != info.addrs:
            self.node.remember_addrs(author, info.addrs)
        with self._lock:
            self.book.saw(author, _dialable(info))
            old = self._members.get(author)
            self._members[author] = Member(info, max(seen, old.last_seen) if old else seen)
            if old is None or old.info != info:
                self._seq += 1
                self._changed_at[author] = self._seq
        if old is None:
            self._emit("join", info)
        elif _material(old.info) != _material(info):
            self._emit("update", info)

    # beats to the coordinator -----------------------------------------------------------------------
    async def _on_beat(self, peer: str, beat: Beat) -> Message:
        """Take a member's beat. The coordinator answers with what changed in its view since the member's
        last; another node (a newcomer's bootstrap) with whom it follows and that one's info."""
        now = self.clock()
        if beat.info is not None:
            if beat.info.peer != peer:
                raise ProtocolError(f"info claims to be {beat.info.peer} but was sent by {peer}")
            self.counts.beats_received += 1
            self._heard(beat.info, now)
        else:
            with self._lock:
                m = self._members.get(peer)
                if m is None:
                    return ErrorReply(error="unknown member: send your info", busy=True)
                self._members[peer] = Member(m.info, now)
        lease = self._lease()
        coordinator, term = lease if lease else (None, 0)
        with self._lock:
            if coordinator != self.node.peer_id:  # not the swarm's view: only whom to ask for it (and where)
                known = self._members.get(coordinator or "")
                return View(seq=0, live=((self.node.peer_id, 0.0),), coordinator=coordinator, term=term,
                            changed=(self._info, known.info) if known else (self._info,))
            since = beat.since if beat.since <= self._seq else 0  # a number from another coordinator
            live = [(p, max(0.0, now - m.last_seen)) for p, m in self._members.items()]
            changed = [m.info for p, m in self._members.items() if self._changed_at.get(p, 1) > since]
            if since == 0 or self._changed_at.get("", 1) > since:
                changed.append(self._info)
            return View(seq=self._seq, live=(*live, (self.node.peer_id, 0.0)), changed=tuple(changed),
                        coordinator=coordinator, term=term)

    def _bootstrap_peer(self) -> str | None:
        """A bootstrap node this node is connected to: whom a newcomer asks (a swarm's first node asks no one)."""
        connected = set(self.node.connected_peers())
        return next((p for a in self.node.config.bootstrap if (p := a.rsplit("/p2p/", 1)[-1]) in connected), None)

    async def _beat_to(self, peer: str) -> bool:
        """Beat to `peer` and take its view; True if it is the coordinator (else gossip beats on)."""
        beats = self._beats
        held = beats.held[1] if beats.held and beats.held[0] == peer else 0
        beats.sent += 1
        info = self._info
        fresh = beats.acked != (peer, info) or beats.sent % RESEND_INFO_BEATS == 0
        send = info if fresh else None
        try:
            view = await self.node.requests.request(peer, MEMBERS, Beat(info=send, since=held),
                                                    timeout=MISSED_BEATS * self.interval)
        except RemoteError:  # it lost this node's info: send it all
            beats.acked = None
            return False
        except (TimeoutError, PeerUnavailable, NodeError) as e:
            log.debug("beat to %s failed: %s", peer, e)
            return False
        if send is not None:
            beats.acked = (peer, send)
        self.counts.views_received += 1
        self._take_view(peer, view)
        return view.coordinator == peer

    def _take_view(self, peer: str, view: View) -> None:
        now = self.clock()
        ages = dict(view.live)
        swarm = view.coordinator == peer  # the coordinator's view; another member's only says whom to ask
        for info in view.changed:  # (a member speaks for itself and the coordinator it names, for no one else)
            if swarm or info.peer in (peer, view.coordinator):
                self._heard(info, now - ages.get(info.peer, 0.0))
        gone = []
        if swarm:
            with self._lock:
                for member, age in view.live:
                    m = self._members.get(member)
                    if m is not None:
                        self._members[member] = Member(m.info, max(m.last_seen, now - age))
                connected = set(self.node.connected_peers())  # a member the coordinator no longer lists is gone
                gone = [m.info for p, m in self._members.items()
                        if p not in ages and p not in connected and now - m.last_seen > self.interval]
                for info in gone:
                    self._drop(info.peer)
                complete = all(p in self._members or p == self.node.peer_id for p in ages)
            self._beats.held = (peer, view.seq if complete else 0)  # a member whose info is missing: ask for all
        elif view.coordinator != self.node.peer_id:
            self._hint = view.coordinator
        for info in gone:
            log.info("member %s is gone: the coordinator no longer lists it", info.peer)
            self._emit("leave", info)
        for callback in list(self.on_view):
            try:  # a failing listener must not stop the beats
                callback(peer, view)
            except Exception:  # noqa: BLE001
                log.exception("view listener failed")

    def _coordinator(self) -> str | None:
        """Whom to beat to and stay linked with: the coordinator the election follows, else the one a member's
        answer named, once it is a known member."""
        return self._leader() or (self._hint if self._hint in self._members else None)

    def _keep_linked(self, now: float) -> None:
        """Dial the coordinator, the wanted members and NEIGHBOURS others, a few at a time; now and then a
        member out of view (`addressbook`)."""
        connected = set(self.node.connected_peers())
        view = self.view()
        wanted = [p for p in (self._coordinator(), *self._wanted()) if p in view]
        others = [p for p in view if p not in connected and p not in wanted]
        spare = NEIGHBOURS - len(connected - {*wanted})
        for peer in wanted + random.sample(others, max(0, min(spare, len(others)))):
            if len(self._dials.dialing) >= MAX_DIALS:
                return
            if peer not in connected and self._dials.may_dial(peer, now):
                self._dials.dialing.add(peer)
                self.node.spawn(self._dial, view[peer])
        with self._lock:
            lost = self.book.due(now, {*self._members, *connected, *self._dials.dialing, self.node.peer_id},
                                 alone=not self._members)
        if lost is not None:
            self._dials.dialing.add(lost[0])
            self.node.spawn(self._redial, *lost)

    async def _redial(self, peer: str, addrs: tuple[str, ...]) -> None:
        """Dial a member this node lost sight of (`addressbook`): connected, gossip and beats bring its view."""
        try:
            if await self._connect_any(peer, addrs):
                log.info("reached %s again, a member this node had lost sight of", peer)
                return
            with self._lock:
                self.book.failed(peer)
        finally:
            self._dials.dialing.discard(peer)

    def _relays(self) -> list[str]:
        """Direct addresses of public members that relay (where a private node takes its relay slots)."""
        return [addr for info in self.view().values() if info.relay and info.reach == "public"
                for addr in info.addrs if "/p2p-circuit" not in addr and addresses.worth_dialling(addr)]

    async def _dial(self, info: NodeInfo) -> None:
        try:
            if await self._connect_any(info.peer, _dialable(info)):
                return
            with self._lock:  # unreachable: try again later, less often each time
                self._dials.failed(info.peer)
        finally:
            self._dials.dialing.discard(info.peer)

    async def _connect_any(self, peer: str, addrs: tuple[str, ...]) -> bool:
        """Dial `peer` at each of `addrs` in turn until one connects; False when none does."""
        for addr in addrs:
            try:
                await self.node.connect_async(addr, 5.0)
                return True
            except (PeerUnavailable, NodeError) as e:
                log.debug("dial %s at %s: %s", peer, addr, e)
        return False

    def _expired(self, now: float) -> list[tuple[NodeInfo, str]]:
        """Members to drop now, with why: silent for MISSED_BEATS of their period, or disconnected."""
        connected = set(self.node.connected_peers())
        gone = []
        with self._lock:
            for peer, m in self._members.items():
                period = min(MAX_BEAT_S, max(self.interval, m.info.beat_s))
                lost = self._lost.get(peer)
                if now - m.last_seen > MISSED_BEATS * period:
                    gone.append((m.info, f"missed {MISSED_BEATS} heartbeats"))
                elif lost is not None and now - lost > self.interval and peer not in connected:
                    gone.append((m.info, "its connection dropped"))
            for info, _ in gone:
                self._drop(info.peer)
        return gone

    def _drop(self, peer: str) -> Member | None:
        """Forget a member and everything kept about it (hold the lock)."""
        self._changed_at.pop(peer, None)
        self._lost.pop(peer, None)
        self._dials.forget(peer)
        return self._members.pop(peer, None)

    def _resumed(self, now: float, paused_s: float) -> None:
        log.warning("this process was paused for %.1f s: members get a fresh grace before they count as gone",
                    paused_s)
        with self._lock:
            self._members = {peer: Member(m.info, now) for peer, m in self._members.items()}
            self._lost = {peer: now for peer in self._lost}

    async def _gossip_beat(self) -> None:
        try:
            await self.node.publish_async(self.node.topic(ids.MEMBERS_TOPIC), Heartbeat(info=self._info))
            self.counts.beats_sent += 1
        except Exception as e:  # noqa: BLE001 - no peers yet, and the like
            log.debug("heartbeat not sent: %s", e)

    async def _beat(self) -> None:
        last_sent = -float("inf")
        while True:
            now = self.clock()
            leader = self._coordinator()
            to_leader = leader is not None and leader != self.node.peer_id and self.node.is_connected(leader)
            period = self.interval if to_leader else self.period()  # (due at once when the coordinator is reached)
            due = now - last_sent >= period or self._refresh
            if due:  # addresses rarely change, and reading them costs a system call each
                self.update(addrs=tuple(self.node.addrs), beat_s=period, reach=self.node.reachability.reach,
                            relay=self.node.config.relay_service)
            changed = self._published is None or _material(self._published) != _material(self._info)
            linking = not to_leader and leader in self._dials.dialing  # beat to it once linked: gossip costs all a copy
            if (due or changed and now - last_sent >= self.interval / 4) and not linking:
                greet = None if to_leader or self.counts.views_received else self._bootstrap_peer()
                target = leader if to_leader else greet
                self._refresh = False
                if target is not None and await self._beat_to(target):
                    last_sent = now
                elif target is not None and target == greet and self._hint not in (None, greet):
                    # told whom to beat to: dial it first (once: a node that has a view greets no more)
                    self._keep_linked(self.clock())
                else:
                    await self._gossip_beat()
                    last_sent = now
                self._published = self._info
            for info, why in self._expired(now):
                log.info("member %s is gone: %s", info.peer, why)
                self._emit("leave", info)
            self._keep_linked(now)
            nap, asleep = min(0.25, self.interval / 4), self.clock()
            await trio.sleep(nap)
            late = self.clock() - asleep - nap  # (the sleep alone: a beat awaiting a slow coordinator is no pause)
            if late > PAUSED_BEATS * self.interval:
                self._resumed(self.clock(), late)


def _dialable(info: NodeInfo) -> tuple[str, ...]:
    """Where `info`'s node can be dialled from here, direct addresses first."""
    return tuple(sorted((a for a in info.addrs if addresses.worth_dialling(a)), key=lambda a: "/p2p-circuit" in a))
