"""`beeswarm status`: join a swarm as a client, listen for a few seconds, report, leave.

No model and no torch: the observer is a client-role node with membership and a plan follower (it
follows the signed plans, it never plans), the parts `SwarmClient` uses.
"""
from __future__ import annotations

import logging
import time

from beeswarm.coordinator.follower import PlanFollower
from beeswarm.coordinator.swarm_report import StatusReport, report
from beeswarm.p2p import identity
from beeswarm.p2p.errors import NodeError
from beeswarm.p2p.membership import Membership
from beeswarm.p2p.node import Node, NodeConfig
from beeswarm.protocol import ProtocolError, RemoteError
from beeswarm.protocol.coordinator import assignments
from beeswarm.protocol.credits import LedgerRequest, LedgerState
from beeswarm.protocol.membership import NodeInfo
from beeswarm.protocol.rpcs import LEDGER

# Right after joining, gossipsub hands a newcomer the last few seconds of messages it missed (IHAVE/IWANT),
# in no particular order: a member's older heartbeat ("loading", no spans) can arrive after its newest.
# A member's info is trusted once a heartbeat of it arrived this long after the start.
REPLAY_S = 2.0
log = logging.getLogger(__name__)


class Unreachable(Exception):
    """No bootstrap address could be dialled; the message names each with its error."""


class SwarmObserver:
    """Nothing starts until `start()`; `close()` announces the leave and stops the node."""

    def __init__(self, node: Node, members: Membership, coordinator: PlanFollower):
        self.node, self.members, self.coordinator = node, members, coordinator
        self.started = members.clock()

    @classmethod
    def create(cls, bootstrap: list[str], secret: bytes | None = None, interval: float = 3.0,
               listen: list[str] | None = None, relays: list[str] | None = None) -> SwarmObserver:
        me = identity.ephemeral()
        node = Node(me, NodeConfig(listen=listen or ["/ip4/0.0.0.0/tcp/0"], bootstrap=bootstrap, secret=secret,
                                   relays=relays or []))
        members = Membership(node, NodeInfo(peer=me.peer_id, role="client", state="serving"), interval=interval)
        coordinator = PlanFollower(node, members, interval=interval)
        return cls(node, members, coordinator)

    def start(self) -> SwarmObserver:
        self.members.start()
        self.coordinator.start()
        self.node.start()
        self.started = self.members.clock()
        return self

    def close(self) -> None:
        self.members.leave()
        self.node.stop()

    def settled(self) -> bool:
        """A plan was heard, every node it names has been heard from, and every member's latest heartbeat
        is a fresh one (not one replayed to a newcomer)."""
        state = self.coordinator.state
        if not state.coordinator:
            return False
        heard = self.members.members()
        fresh = self.started + REPLAY_S
        return all(node in heard for node in {**assignments(state.active), **assignments(state.target)}) and \
            all(m.last_seen >= fresh for m in heard.values())

    def wait(self, timeout: float) -> None:
        """Listen until `settled()` or for `timeout` seconds; raises Unreachable as soon as every bootstrap
        address has failed and no peer is connected."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not self.settled():
            why = self.node.unreachable()
            if why is not None:
                raise Unreachable(f"cannot reach the swarm: {why}")
            time.sleep(0.1)

    def report(self) -> StatusReport:
        return observe(self.members, self.coordinator)

    def ledger(self, timeout: float) -> LedgerState:
        """The credit ledger the coordinator holds now (asked directly: gossip brings it only on change and every
        half minute), or the newest heard; raises Unreachable when there is neither."""
        leader = self.coordinator.leader()
        if leader is not None:
            try:
                signed = self.node.request(leader, LEDGER, LedgerRequest(), timeout=timeout)
                self.coordinator.take_ledger(leader, signed)
            except (TimeoutError, NodeError, RemoteError, ProtocolError) as e:
                log.info("could not get the ledger from the coordinator %s: %s", leader, e)
        if not self.coordinator.ledger_state.coordinator:
            raise Unreachable("no credit ledger yet: no receipt has been recorded in this swarm, or no coordinator "
                              "answered")
        return self.coordinator.ledger_state


def observe(members: Membership, coordinator: PlanFollower) -> StatusReport:
    """The swarm as this node hears it now: its membership view, the plan it follows, the lease it knows."""
    now = members.clock()
    heard = members.members()
    lease = coordinator.lease
    return report({peer: m.info for peer, m in heard.items()}, {peer: now - m.last_seen for peer, m in heard.items()},
                  coordinator.state, lease.leader if lease else None, lease.term if lease else 0,
                  lease.epoch if lease else 0, coordinator.ledger_state, num_layers=coordinator.num_layers)
