"""`beeswarm status`: the report from a membership view and a plan (pure), and the command on a real swarm."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from beeswarm.commands.status import render
from beeswarm.coordinator.swarm_report import report
from beeswarm.protocol.coordinator import Pipeline, PlanState, Stage
from beeswarm.protocol.membership import NodeInfo
from beeswarm.protocol.spans import Span
from helpers import lines_of, read_until

A, B, C, D, E = (f"12D3KooW{x * 44}" for x in "ABCDE")


def member(peer, *spans, role="contributor", state="serving", load=0.0):
    return NodeInfo(peer=peer, role=role, state=state, spans=spans, layers=spans[0] if spans else None, load=load)


def plan(*pipelines, target=None, epoch=3):
    active = tuple(Pipeline(stages=tuple(Stage(node=n, span=s) for n, s in p), tokens_per_s=40.0) for p in pipelines)
    return PlanState(term=2, epoch=epoch, coordinator=A, active=active,
                     target=active if target is None else tuple(Pipeline(stages=tuple(Stage(node=n, span=s)
                                                                                      for n, s in p))
                                                                for p in target))


def test_coverage_replicas_and_a_gap_from_what_members_announce():
    view = {A: member(A, Span(0, 4), load=12.5), B: member(B, Span(4, 8)), C: member(C, Span(0, 4)),
            D: member(D, Span(8, 12), state="loading"),  # announced while loading its next span: counts
            E: member(E, role="client")}
    ages = {A: 0.4, B: 1.2, C: 2.0, D: 0.1, E: 0.0}
    r = report(view, ages, plan([(A, Span(0, 4)), (B, Span(4, 8)), (D, Span(8, 16))]), coordinator=A, term=2, epoch=3)
    assert r.num_layers == 16  # from the plan: layers nobody announces are a gap
    assert r.coverage == (2,) * 4 + (1,) * 8 + (0,) * 4
    assert [(s.span, s.nodes) for s in r.segments] == [(Span(0, 4), (A, C)), (Span(4, 8), (B,)),
                                                       (Span(8, 12), (D,)), (Span(12, 16), ())]
    assert r.gaps == (Span(12, 16),) and not r.complete
    assert [m.peer for m in r.members] == [A, C, B, D, E]  # contributors by first layer, then clients
    assert r.members[0].coordinator and r.members[0].tokens_per_s == 12.5 and r.members[1].heartbeat_age_s == 2.0
    data = r.as_json()
    assert json.loads(json.dumps(data)) == data
    assert data["gaps"] == [{"start": 12, "end": 16}] and data["complete"] is False
    assert data["spans"][0] == {"start": 0, "end": 4, "replicas": 2, "nodes": [A, C]}
    assert data["plan"]["active"][0]["stages"][2] == {"node": D, "start": 8, "end": 16, "offload_fraction": 0.0}
    assert data["coordinator"] == A and data["term"] == 2 and data["epoch"] == 3
    plain, colored = "\n".join(render(r)), "\n".join(render(r, color=True))
    assert "GAP" in plain and "\033[" not in plain
    assert "\033[31m  [12, 16)" in colored and colored.count("\033[31m") == 2  # the gap and the summary


def test_paused_and_leaving_members_do_not_cover_and_a_full_swarm_is_complete():
    view = {A: member(A, Span(0, 2)), B: member(B, Span(2, 4)), C: member(C, Span(2, 4), state="paused"),
            D: member(D, Span(0, 4), state="leaving")}
    r = report(view, {}, plan([(A, Span(0, 2)), (B, Span(2, 4))]))
    assert r.complete and r.coverage == (1, 1, 1, 1)
    assert r.coordinator == A and (r.term, r.epoch) == (2, 3)  # no lease heard: the plan's author stands in
    assert "complete" in "\n".join(render(r))


def test_without_a_plan_the_layers_come_from_the_members():
    r = report({A: member(A, Span(0, 3)), B: member(B, Span(5, 8))}, {}, PlanState())
    assert r.plan is None and r.coordinator is None and r.num_layers == 8
    assert r.gaps == (Span(3, 5),)
    assert report({}, {}, None).num_layers == 0 and not report({}, {}, None).complete
    text = "\n".join(render(report({}, {}, None)))
    assert "plan: none heard" in text and "coordinator: none heard" in text
    # the last span's holder gone and no complete plan left: the layers earlier plans showed still count
    survivors = {A: member(A, Span(0, 3)), B: member(B, Span(3, 6))}
    assert report(survivors, {}, PlanState()).complete  # what the announced spans alone would say
    after_loss = report(survivors, {}, PlanState(), num_layers=8)
    assert after_loss.gaps == (Span(6, 8),) and not after_loss.complete


def test_migration_shows_both_plans():
    p = plan([(A, Span(0, 4))], target=[[(A, Span(0, 2)), (B, Span(2, 4))]])
    r = report({A: member(A, Span(0, 4), Span(0, 2)), B: member(B, Span(2, 4))}, {}, p)
    assert r.as_json()["plan"]["migrating"] is True and r.coverage == (1, 1, 2, 2)
    text = "\n".join(render(r))
    assert "migrating" in text and "target 1:" in text


@pytest.fixture
def env(tmp_path):
    e = {**os.environ, "BEESWARM_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    e.pop("BEESWARM_IDENTITY", None)
    return e


@pytest.mark.slow
def test_status_json_on_a_two_process_local_swarm(tiny_llama, env):
    swarm = subprocess.Popen([sys.executable, "-m", "beeswarm", "swarm", "--local", "2", "--model", str(tiny_llama),
                              "--json"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        _, seen = read_until(lines_of(swarm), '{"event": "ready"', 60)
        events = [json.loads(line) for line in seen]
        bootstrap = next(e["addr"] for e in events if e["event"] == "bootstrap")
        peers = {e["peer"] for e in events if e["event"] == "contributor"}
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "beeswarm", "status", "--join", bootstrap, "--json",
                              "--heartbeat", "1"], capture_output=True, text=True, timeout=30, env=env)
        took = time.monotonic() - t0
        assert out.returncode == 0, out.stderr[-3000:]
        status = json.loads(out.stdout)
        assert {m["peer"] for m in status["members"] if m["role"] == "contributor"} == peers
        assert status["num_layers"] == 8 and status["complete"] and status["gaps"] == []
        assert min(status["coverage"]) >= 1 and status["spans"][0]["start"] == 0 and status["spans"][-1]["end"] == 8
        assert status["coordinator"] in peers and status["term"] >= 1 and status["epoch"] >= 1
        assert status["plan"]["coordinator"] == status["coordinator"] and status["plan"]["active"]
        assert all(m["heartbeat_age_s"] < 10 and m["state"] == "serving" for m in status["members"]
                   if m["role"] == "contributor")
        assert took < 20, f"status took {took:.1f} s"  # it stops listening once the plan and its nodes are heard
    finally:
        swarm.send_signal(signal.SIGTERM)
        swarm.wait(30)
