"""A contributor's lifecycle: what its heartbeat says through loading, migrating, pausing and leaving."""
from __future__ import annotations

import threading

import pytest

from beeswarm.contributor.contributor import Contributor, ContributorOptions
from beeswarm.contributor.lifecycle import Lifecycle, Phase
from beeswarm.contributor.local_swarm import budgets
from beeswarm.contributor.stage import StageServer
from beeswarm.p2p.identity import ephemeral
from beeswarm.p2p.membership import Membership
from beeswarm.p2p.node import Node, NodeConfig
from beeswarm.protocol.membership import NodeInfo
from beeswarm.protocol.spans import Span
from helpers import LOCAL, wait_for

A, B = Span(0, 4), Span(4, 8)


class Heartbeat:
    """What peers would read: each announcement, as Membership.update gets it."""

    def __init__(self) -> None:
        self.said: list[dict] = []

    def __call__(self, **fields) -> None:
        self.said.append(fields)

    @property
    def last(self) -> dict:
        return self.said[-1]


def test_a_node_announces_loading_then_serving_and_keeps_serving_the_old_span_while_the_next_loads():
    beat = Heartbeat()
    life = Lifecycle(beat)
    assert life.phase is Phase.STARTING and not beat.said  # nothing to say before joining
    life.started()
    assert beat.last == {"state": "idle", "layers": None, "spans": ()}
    assert life.begin_load(A) and beat.last["state"] == "loading"
    assert not life.begin_load(A), "a span already loading is not loaded twice"
    life.loaded(A, 0.25, (A,))
    assert beat.last == {"state": "serving", "layers": A, "spans": (A,)}
    assert life.facts.offload_fraction == 0.25
    assert not life.begin_load(A), "the span served is not loaded again"
    assert life.begin_load(B)  # the plan moves this node: make before break
    assert beat.last == {"state": "loading", "layers": A, "spans": (A,)}
    life.loaded(B, 0.0, (A, B))
    assert beat.last == {"state": "serving", "layers": B, "spans": (A, B)}
    life.serving_only((B,))  # the plan made B active: A drains
    assert beat.last == {"state": "serving", "layers": B, "spans": (B,)}
    count = len(beat.said)
    life.serving_only((B,))
    assert len(beat.said) == count, "an unchanged state is not announced again"


def test_a_plan_that_drops_the_span_leaves_the_node_idle_and_a_failed_load_returns_to_what_it_was():
    beat = Heartbeat()
    life = Lifecycle(beat)
    life.started()
    life.begin_load(A)
    life.load_failed()
    assert life.phase is Phase.IDLE and beat.last["state"] == "idle"
    assert life.begin_load(A), "a failed span can be tried again when the plan asks"
    life.loaded(A, 0.5, (A,))
    life.serving_only(())
    assert beat.last == {"state": "idle", "layers": None, "spans": ()}
    assert life.facts.offload_fraction == 0.0


def test_a_paused_node_stays_paused_when_a_load_finishes_and_loads_nothing_new_until_resumed():
    beat = Heartbeat()
    life = Lifecycle(beat)
    assert not life.set_paused(True), "pausing before start-up is over does nothing"
    life.started()
    life.begin_load(A)
    assert life.set_paused(True) and beat.last["state"] == "paused"
    life.loaded(A, 0.0, (A,))
    assert beat.last == {"state": "paused", "layers": A, "spans": (A,)}
    assert not life.begin_load(B), "a paused node takes no new span"
    life.set_paused(False)
    assert beat.last["state"] == "serving"
    assert life.begin_load(B)


def test_leaving_is_the_last_word_and_takes_no_more_work():
    beat = Heartbeat()
    life = Lifecycle(beat)
    life.started()
    life.loaded(A, 0.0, (A,))
    life.leave()
    assert beat.last["state"] == "leaving" and life.phase is Phase.LEAVING
    assert not life.begin_load(B) and not life.set_paused(True)
    count = len(beat.said)
    life.stopped()
    assert life.phase is Phase.STOPPED and len(beat.said) == count, "stopped says nothing after leaving"


def test_the_announcements_reach_a_real_membership_heartbeat():
    members = Membership(Node(ephemeral(), NodeConfig()), NodeInfo(peer="12D3KooWtest"))
    life = Lifecycle(members.update)
    assert members.info.state == "joining"
    life.started()
    life.begin_load(A)
    assert members.info.state == "loading"
    life.loaded(A, 0.0, (A,))
    assert (members.info.state, members.info.layers, members.info.spans) == ("serving", A, (A,))


def test_concurrent_loaders_and_plan_updates_never_announce_a_span_the_facts_do_not_hold():
    beat = Heartbeat()
    life = Lifecycle(beat)
    life.started()
    spans = [Span(i, i + 1) for i in range(50)]

    def load(span: Span) -> None:
        if life.begin_load(span):
            life.loaded(span, 0.0, (span,))

    threads = [threading.Thread(target=load, args=(s,)) for s in spans]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    facts = life.facts
    assert beat.last["layers"] == facts.span and beat.last["spans"] == facts.spans
    assert beat.last["state"] == facts.phase.value


@pytest.mark.slow  # a real contributor: benchmark, node, its first span (a few seconds)
def test_a_plan_arriving_as_the_first_span_starts_serving_never_freezes_the_node(tiny_llama, monkeypatch):
    """The first span's server registers its protocols in the node's loop as it starts; a plan handled in the loop
    then (its listener takes the contributor's lock) waited for the lock, while the start, under that lock, waited
    for the loop: the node's loop froze for good and the span never served."""
    contributor = Contributor.create(ephemeral(), ContributorOptions(
        model=str(tiny_llama), listen=LOCAL, device="cpu", dtype="float32",
        max_memory=budgets(str(tiny_llama), 1)[0], interval=1.0))
    start = StageServer.start

    def start_as_a_plan_arrives(server: StageServer) -> StageServer:
        async def arrives() -> None:  # as a plan message is handled: in the node's loop
            contributor.coordinator.follower.apply(contributor.coordinator.state)
        contributor.node.call(arrives)
        return start(server)

    monkeypatch.setattr(StageServer, "start", start_as_a_plan_arrives)
    threading.Thread(target=contributor.run, daemon=True, name="contributor").start()
    try:
        wait_for(lambda: contributor.phase == Phase.SERVING, 60, "the first span to serve")
    finally:
        contributor.stop()
