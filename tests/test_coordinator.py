"""Election and signed plans among real nodes on 127.0.0.1."""
from __future__ import annotations

import threading
import time

import pytest

from beeswarm.coordinator import plans
from beeswarm.coordinator.cluster import ModelShape, Workload
from beeswarm.coordinator.election import Election, Lease
from beeswarm.coordinator.service import (
    CoordinatorService, PlanState, cluster_from_members, next_assignment, pipelines_tokens_per_s)
from beeswarm.p2p import identity, wire
from beeswarm.p2p.membership import NodeInfo
from beeswarm.p2p.probe import Prober
from helpers import INTERVAL, wait_for

MODEL = ModelShape(num_layers=8, hidden_size=256, layer_bytes=10_000_000, kv_bytes_per_token_layer=1024)


@pytest.fixture
def contributors(mesh):
    def info(peer):
        return NodeInfo(peer=peer, memory_bytes=40_000_000, state="serving",
                        bench={"layer_ms_base": 1.0, "layer_ms_per_token": 0.1})

    def setup(node):
        node.coord = CoordinatorService(node, node.members, MODEL, interval=INTERVAL)
        node.coord.start()

    def make(n: int, bootstrap: str | None = None):
        return mesh(n, bootstrap=[bootstrap] if bootstrap else None, info=info, setup=setup)

    return make


def leaders(nodes):
    return {n.coord.lease.leader if n.coord.lease else None for n in nodes}


def agreed(nodes) -> bool:
    ls = leaders(nodes)
    return len(ls) == 1 and None not in ls and sum(n.coord.is_leader for n in nodes) == 1


def test_election_failover_and_plans(contributors):
    nodes = contributors(5)
    t0 = time.monotonic()
    wait_for(lambda: agreed(nodes), 5, "one coordinator")
    assert time.monotonic() - t0 <= 5
    leader = next(n for n in nodes if n.coord.is_leader)
    assert leader.peer_id == min(n.peer_id for n in nodes)  # the smallest id claims first
    wait_for(lambda: all(n.coord.state.epoch >= 1 and n.coord.state.active for n in nodes), 5, "a plan everywhere")
    spans = sorted((s["start"], s["end"]) for p in nodes[1].coord.state.active for s in p["stages"])
    assert spans[0][0] == 0 and spans[-1][1] == MODEL.num_layers

    # A membership change brings a plan with a new epoch.
    epoch = nodes[1].coord.state.epoch
    (late,) = contributors(1, bootstrap=nodes[0].addrs[0])
    wait_for(lambda: nodes[1].coord.state.epoch > epoch, 8, "a new epoch after a join")

    # A plan signed by someone other than the coordinator is ignored, however valid its signature.
    follower = next(n for n in nodes if not n.coord.is_leader)
    forged = plans.SignedPlan(leader.coord.lease.term, 10_000, follower.peer_id, {"active": [], "target": []})
    follower.publish(follower.topic("coordinator"), plans.sign(follower.identity.key_pair, forged))
    others = [n for n in nodes if n is not follower and not n.coord.is_leader]
    wait_for(lambda: all(n.coord.ignored_plans > 0 for n in others), 5, "the forged plan to be ignored")
    assert all(n.coord.state.epoch < 10_000 for n in nodes)

    # Kill the coordinator: a new one within 3 intervals + 1 s, with a higher term.
    term = leader.coord.lease.term
    rest = [n for n in nodes + [late] if n is not leader]
    t0 = time.monotonic()
    leader.stop()
    wait_for(lambda: agreed(rest) and next(iter(leaders(rest))) != leader.peer_id, 3 * INTERVAL + 1, "a new coordinator")
    assert time.monotonic() - t0 <= 3 * INTERVAL + 1
    assert all(n.coord.lease.term > term for n in rest)


def test_link_probes_reach_the_coordinators_cluster(contributors):
    nodes = contributors(3)
    stop = threading.Event()
    try:
        for n in nodes:
            Prober(n).report_links(n.members, every_s=30, bulk_bytes=256 * 1024, stop=stop)
        wait_for(lambda: all(len(n.members.info.links) == 2 for n in nodes), 15, "every pair probed")
        wait_for(lambda: all(len(info.links) == 2 for info in nodes[0].members.view().values()), 10,
                 "the figures to travel in heartbeats")
        view = {**nodes[0].members.view(), nodes[0].peer_id: nodes[0].members.info}
        cluster = cluster_from_members(view, MODEL, Workload())
        a, b = nodes[1].peer_id, nodes[2].peer_id
        assert cluster.rtt(a, b) == pytest.approx(view[a].links[b][0]) and cluster.rtt(a, b) < 50
    finally:
        stop.set()


def test_partitions_merge_to_one_coordinator(contributors):
    left = contributors(2)
    right = contributors(2, bootstrap=None)
    wait_for(lambda: agreed(left) and agreed(right), 8, "a coordinator in each partition")
    assert leaders(left) != leaders(right)
    right[0].connect(left[0].addrs[0])
    everyone = left + right
    wait_for(lambda: agreed(everyone), 10, "the partitions to converge")


def test_tampered_plans_are_rejected():
    me = identity.ephemeral()
    signed = plans.sign(me.key_pair, plans.SignedPlan(1, 1, me.peer_id, {"active": []}))
    assert plans.verify(signed, me.peer_id).epoch == 1
    with pytest.raises(wire.ProtocolError, match="signature"):
        plans.verify({**signed, "body": signed["body"][:-1] + b"\x00"}, me.peer_id)
    with pytest.raises(wire.ProtocolError, match="published by"):
        plans.verify(signed, identity.ephemeral().peer_id)
    with pytest.raises(wire.ProtocolError):
        plans.verify(wire.message("plan", body=b"junk", sig=b""), me.peer_id)


def test_election_state_machine_rules():
    now = [0.0]
    a = Election("A", 1.0, clock=lambda: now[0])
    b = Election("B", 1.0, clock=lambda: now[0])
    now[0] = 2.4
    assert a.tick({"A", "B"}) is None
    now[0] = 2.5
    assert a.tick({"A", "B"}) == Lease(1, "A") and b.tick({"A", "B"}) is None  # B waits 2 beats longer
    assert b.observe(Lease(1, "A"))
    assert not b.observe(Lease(1, "C"))  # same term: the smaller id keeps it
    assert b.observe(Lease(2, "C"))  # a higher term wins
    assert a.observe(Lease(2, "C")) and not a.is_leader


def test_replanning_keeps_a_good_enough_plan_and_migrates_make_before_break():
    def info(peer, layers=None, ms=1.0):
        return NodeInfo(peer=peer, memory_bytes=10**9, state="serving", layers=layers,
                        bench={"layer_ms_base": ms, "layer_ms_per_token": 0.0})

    def pipeline(*stages):
        return {"stages": [{"node": n, "start": a, "end": b, "offload_fraction": 0.0} for n, a, b in stages],
                "micro_batches": 1, "step_ms": 0, "tokens_per_s": 0}

    view = {"A": info("A", (0, 8)), "B": info("B", ms=0.9)}
    cluster = cluster_from_members(view, MODEL, Workload())
    old = [pipeline(("A", 0, 8))]
    state = PlanState(1, 1, old, old)
    current = pipelines_tokens_per_s(cluster, old)
    new = [pipeline(("B", 0, 8))]
    # 5% better: not worth moving weights
    assert next_assignment(cluster, new, current * 1.05, state, view, 0.10) == (old, old)
    # 20% better: migrate, but keep routing over the old pipeline until B has loaded its span
    active, target = next_assignment(cluster, new, current * 1.2, state, view, 0.10)
    assert (active, target) == (old, new)
    migrating = PlanState(1, 2, old, new)
    view["B"] = info("B", (0, 8), ms=0.9)
    assert next_assignment(cluster, new, current * 1.2, migrating, view, 0.10) == (new, new)
    # the old pipeline's node is gone: switch at once
    del view["A"]
    cluster = cluster_from_members(view, MODEL, cluster.workload)
    assert next_assignment(cluster, new, 1.0, PlanState(1, 2, old, old), view, 0.10) == (new, new)


def test_clients_route_over_the_active_plan_while_its_stages_load_their_next_spans():
    """Make-before-break on the client's side: a stage loading (or done loading) its target span still
    serves its active one, and its heartbeat's `spans` say so; a leaving or banned stage is skipped."""
    from beeswarm.client.swarm import find_route

    active = [{"stages": [{"node": "A", "start": 0, "end": 4}, {"node": "B", "start": 4, "end": 8}]}]
    view = {"A": NodeInfo(peer="A", state="loading", layers=(0, 4), spans=((0, 4),)),
            "B": NodeInfo(peer="B", state="serving", layers=(5, 8), spans=((4, 8), (5, 8)))}
    never = lambda peer: False  # noqa: E731
    assert [(h.peer, h.start, h.end) for h in find_route(active, view, never)] == [("A", 0, 4), ("B", 4, 8)]
    assert find_route(active, {**view, "B": NodeInfo(peer="B", state="serving", layers=(5, 8), spans=((5, 8),))},
                      never) is None  # B dropped [4, 8)
    assert find_route(active, {**view, "A": NodeInfo(peer="A", state="leaving", spans=((0, 4),))}, never) is None
    assert find_route(active, view, lambda peer: peer == "B") is None
    # the field travels in heartbeats and is checked like the rest
    wire_form = view["B"].to_wire()
    assert NodeInfo.from_wire(wire_form, "B").spans == ((4, 8), (5, 8))
    with pytest.raises(wire.ProtocolError, match="spans"):
        NodeInfo.from_wire({**wire_form, "spans": [[1, 2, 3]]}, "B")
