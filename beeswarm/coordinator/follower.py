"""Following the coordinator: the lease as the election sees it, and the signed plans it publishes.

Every node runs a `PlanFollower` (clients and `beeswarm status` too; it needs no model). It hears the
coordinator's lease beats (gossip, and the coordinator's answers to this node's membership beats),
verifies each signed plan and follows it only when its author holds the lease followed and it is newer
than the plan held, and tells its listeners. It tells membership whom to beat to (the lease's leader)
and which members to stay linked to (the stages of the plans held).

It also holds the newest credit ledger its coordinators signed (`take_ledger`): the next coordinator
continues from it, and stages rank whom to admit first by it.

Gossip may drop a plan (a loaded mesh drops messages outside a node's mesh links), so a follower whose
lease beats show a newer epoch than it holds for two beats in a row asks the coordinator for the plan
directly (`ids.PLAN`).

The election is the follower's: a node that does not stand for it (`start()`) ticks it only to notice
its own pauses; an eligible contributor's `Coordinator` ticks it with the candidates instead (and starts
this follower with `listen()`).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import trio

from beeswarm.coordinator import plans
from beeswarm.coordinator.election import Election, Lease
from beeswarm.credits import receipts
from beeswarm.p2p.errors import NodeError, PeerUnavailable
from beeswarm.p2p.membership import Membership
from beeswarm.p2p.node import Node
from beeswarm.protocol import Decoder, ProtocolError, RemoteError, ids
from beeswarm.protocol.coordinator import LeaseBeat, PlanRequest, PlanState, SignedPlan
from beeswarm.protocol.credits import LEDGER_LIMIT, LedgerState, SignedLedger
from beeswarm.protocol.membership import NodeInfo, View
from beeswarm.protocol.rpcs import PLAN

log = logging.getLogger(__name__)

_messages: Decoder[LeaseBeat | SignedPlan | SignedLedger] = Decoder(LeaseBeat, SignedPlan, SignedLedger,
                                                                   limit=LEDGER_LIMIT)


class PlanFollower:
    """Nothing starts until `start()` (or `listen()`); `clock` (monotonic seconds) is injectable for tests."""

    def __init__(self, node: Node, members: Membership, interval: float = 3.0,
                 clock: Callable[[], float] = time.monotonic):
        self.node, self.members, self.interval, self.clock = node, members, interval, clock
        # eligibility is given at each tick by whoever stands for the lease (a `Coordinator`); nobody else does
        self.election = Election(node.peer_id, interval, False, clock, founder=not node.config.bootstrap)
        self.state = PlanState()
        self.num_layers = 0  # the model's layers as the plans followed showed them (an empty plan shows none)
        self.ledger: SignedLedger | None = None  # the newest credit ledger the coordinators followed published
        self.ledger_state = LedgerState()
        self.listeners: list[Callable[[PlanState], None]] = []
        self.ignored_plans = 0
        self.pulled_plans = 0
        self._lock = threading.Lock()  # the election: fed from the node's loop and a planning thread
        self._behind: int | None = None  # the term of the last lease beat whose epoch this node lacked
        self._listening = False

    def start(self) -> None:
        """Follow the coordinator, and tick the election to notice this process's pauses (it never claims)."""
        self.listen()
        self.node.add_task(self._watch)

    def listen(self) -> None:
        """Follow the coordinator without ticking the election: for the `Coordinator` leading this follower."""
        if self._listening:
            raise RuntimeError("this plan follower is already started")
        self._listening = True
        # members beat to the coordinator once there is one, and keep links to the plan's stages
        self.members.follow(lease=self._lease, wanted=self._plan_nodes)
        self.members.on_view.append(self._on_view)
        self.node.subscribe(self.node.topic(ids.COORDINATOR_TOPIC), _messages, self.on_message)
        self.members.listeners.append(self._on_member)

    async def _watch(self) -> None:
        while True:
            self.tick(set(), eligible=False)
            await trio.sleep(min(0.25, self.interval / 4))

    # the lease ---------------------------------------------------------------------------------
    @property
    def lease(self) -> Lease | None:
        return self.election.current

    @property
    def is_leader(self) -> bool:
        return self.election.is_leader

    def leader(self) -> str | None:
        """The coordinator this node follows (itself while leading), or None."""
        lease = self.election.current
        return lease.leader if lease else None

    def tick(self, candidates: set[str], eligible: bool) -> Lease | None:
        """Tick the election (call often); returns the lease this node has just claimed, if `eligible` and it did."""
        with self._lock:
            self.election.eligible, leading = eligible, self.election.is_leader
            claimed = self.election.tick(candidates)
            if leading and not self.election.is_leader:
                log.warning("stepped down as coordinator: this node may no longer lead (other nodes cannot dial it, "
                            "or it serves another weight format)")
            return claimed

    def next_epoch(self) -> Lease | None:
        """The lease with its next plan epoch while this node leads, else None (the lease may have been lost
        while planning ran in its thread: re-checked here, under the lock)."""
        with self._lock:
            return self.election.next_epoch() if self.is_leader else None

    def _lease(self) -> tuple[str, int] | None:
        lease = self.election.current
        return (lease.leader, lease.term) if lease else None

    def _plan_nodes(self) -> set[str]:
        state = self.state
        return {s.node for p in state.active + state.target for s in p.stages}

    def _on_member(self, event: str, info: NodeInfo) -> None:
        if event == "join":
            with self._lock:
                self.election.joined()

    def _on_view(self, peer: str, view: View) -> None:
        """A member answered this node's beat. The coordinator's own answer is as good as its lease beat
        (however late gossip brings those); a newcomer told that the swarm has one waits for it."""
        with self._lock:
            if view.coordinator == peer:
                lease = self.election.current
                epoch = lease.epoch if lease is not None and (lease.term, lease.leader) == (view.term, peer) else 0
                self.election.observe(Lease(view.term, peer, epoch))
            elif view.coordinator is not None:
                self.election.told()

    # plans -------------------------------------------------------------------------------------
    def on_message(self, author: str, msg: LeaseBeat | SignedPlan | SignedLedger) -> None:
        if isinstance(msg, SignedLedger):
            self.take_ledger(author, msg)
        elif isinstance(msg, LeaseBeat):
            was_leader = self.is_leader
            with self._lock:
                self.election.observe(Lease(msg.term, author, msg.epoch))
            if was_leader and not self.is_leader:
                log.info("stepping down: %s leads term %d", author, msg.term)
            self._check_behind(author, msg)
        else:
            self._take_plan(author, msg)

    def _take_plan(self, author: str, msg: SignedPlan) -> None:
        signed = plans.verify(msg, author)  # ProtocolError (bad form or signature) strikes the author
        lease = self.election.current
        if (signed.term, signed.epoch) == (self.state.term, self.state.epoch) and \
                signed.coordinator == self.state.coordinator:
            return  # the plan this node follows, sent again for newcomers
        if lease is None or signed.coordinator != lease.leader or signed.term != lease.term or \
                not self._newer(signed.term, signed.epoch, signed.coordinator):
            self.ignored_plans += 1
            log.info("ignoring plan %d/%d from %s (following %s)", signed.term, signed.epoch, author, lease)
            return
        self.apply(signed)

    def take_ledger(self, author: str, msg: SignedLedger) -> bool:
        """Hold `msg` if its author leads the lease followed and it is newer, by (term, seq), than the ledger held
        (a new coordinator's term is higher: its ledger is the swarm's now); the next coordinator continues from
        here. ProtocolError when it is not its author's."""
        state = receipts.verify_ledger(msg)
        if state.coordinator != author:
            raise ProtocolError(f"a ledger signed by {state.coordinator} was published by {author}")
        if author != self.leader() or (state.term, state.seq) <= (self.ledger_state.term, self.ledger_state.seq):
            return False
        self.ledger, self.ledger_state = msg, state
        return True

    def _newer(self, term: int, epoch: int, coordinator: str) -> bool:
        """Is (term, epoch) of `coordinator`, the leader followed, newer than the plan held? A plan of another
        coordinator or term is older whatever its numbers: the lease decides whom to follow, even a lower
        term once the higher one's leader has gone silent."""
        held = self.state
        return (held.coordinator, held.term) != (coordinator, term) or epoch > held.epoch

    def _check_behind(self, author: str, beat: LeaseBeat) -> None:
        """Pull the plan from the coordinator when two beats in a row show an epoch this node lacks (one beat
        may just have overtaken the plan's gossip)."""
        lease = self.election.current
        if lease is None or lease.leader != author or lease.term != beat.term or self.is_leader or \
                beat.epoch == 0 or not self._newer(beat.term, beat.epoch, author):
            self._behind = None
            return
        if self._behind == beat.term:
            self.node.spawn(self._pull_plan, author)
            self._behind = None  # the next pull waits for two more beats
        else:
            self._behind = beat.term

    async def _pull_plan(self, coordinator: str) -> None:
        try:
            signed = await self.node.requests.request(coordinator, PLAN, PlanRequest(), timeout=2 * self.interval)
        except (TimeoutError, PeerUnavailable, NodeError, RemoteError) as e:
            log.info("could not fetch the current plan from %s: %s", coordinator, e)
            return
        self.pulled_plans += 1
        try:
            self._take_plan(coordinator, signed)
        except ProtocolError as e:
            self.node.strike(coordinator, f"plan: {e}")

    def apply(self, state: PlanState) -> None:
        """Follow `state` (a verified plan of the lease's leader, or this node's own as it leads) and tell the
        listeners."""
        self.state = state
        ends = [s.span.end for p in (*state.active, *state.target) for s in p.stages]
        self.num_layers = max([self.num_layers, *ends])
        self.members.refresh()
        for listener in list(self.listeners):
            try:
                listener(self.state)
            except Exception:  # noqa: BLE001
                log.exception("plan listener failed")
