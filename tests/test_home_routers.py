"""Across home routers: real beeswarm processes on the network-namespace test bed (tests/netbed.py).

A public bootstrap on the "internet", contributors and users behind home routers that NAT and drop
unsolicited inbound, as most volunteers' and users' machines are."""
from __future__ import annotations

import os
import sys
import time

import pytest

from bed_swarm import MODEL, PROMPT, Swarm
from beeswarm.contributor.local_swarm import budgets
from beeswarm.coordinator.coordinator import UNREACHABLE
from beeswarm.p2p.reach import KEEP_S
from helpers import lines_of, read_until, reference_greedy, wait_for
from netbed import NetBed, require_netns

pytestmark = [pytest.mark.slow, pytest.mark.netns]



@pytest.fixture
def swarm(tmp_path):
    require_netns()
    env = {**os.environ, "BEESWARM_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    env.pop("BEESWARM_IDENTITY", None)
    with NetBed() as bed:
        s = Swarm(bed, tmp_path, env)
        yield s
        for proc in s.procs:
            proc.kill()


def expected_tokens(n: int) -> list[int]:
    from transformers import AutoTokenizer

    from beeswarm.shard import checkpoint

    folder = checkpoint.resolve(MODEL)
    return reference_greedy(folder, AutoTokenizer.from_pretrained(str(folder)).encode(PROMPT), n)


def test_a_user_at_home_chats_through_contributors_at_home_who_punch_a_hole_and_stay_reachable_when_idle(swarm):
    """The common case: the bootstrap is public, the contributors serving the layers and the user are each
    behind a home router (ordinary port-keeping NATs that forget a flow idle for 30 s). The stages first meet
    through the public relay, then DCUtR's simultaneous dial gives them a direct connection; 40 s without
    chats later, the swarm still serves."""
    bed = swarm.bed
    half = budgets(MODEL, 2)[0]
    boot = swarm.contribute(bed.public_host("boot"), "boot", half // 8)  # no room for a layer: it only relays
    alice, bob = (wait() for wait in [  # started together
        swarm.start(bed.behind(bed.home_router("home1", idle_timeout_s=30), "alice"), "alice", half, verbose=True),
        swarm.start(bed.behind(bed.home_router("home2", idle_timeout_s=30), "bob"), "bob", half, verbose=True)])
    carol = bed.behind(bed.home_router("home3", idle_timeout_s=30), "carol")
    reply = swarm.chat(carol, "carol")
    assert reply["tokens"] == expected_tokens(8)
    assert {s["peer"] for s in reply["route"]} == {alice, bob}
    members = {m["peer"]: m for m in swarm.status(carol)["members"]}
    assert {peer: members[peer]["reach"] for peer in (boot, alice, bob)} == \
        {boot: "public", alice: "private", bob: "private"}

    def punched() -> bool:
        logs = (swarm.logs / "alice.log").read_text() + (swarm.logs / "bob.log").read_text()
        return punched_line(bob) in logs or punched_line(alice) in logs

    wait_for(punched, 120, "a direct connection between the two home stages")
    time.sleep(40)  # longer than the routers' idle timeout without a chat: only the keepalives hold the flows
    reply = swarm.chat(carol, "carol-again")
    assert reply["tokens"] == expected_tokens(8) and {s["peer"] for s in reply["route"]} == {alice, bob}


def punched_line(peer: str) -> str:
    """What a contributor logs (at INFO) when a hole punch gave it a direct connection to `peer`."""
    return f"direct connection to {peer}, which was reached through a relay"


def expected_text(n: int) -> str:
    from transformers import AutoTokenizer

    from beeswarm.shard import checkpoint

    tokens = expected_tokens(n)
    return AutoTokenizer.from_pretrained(str(checkpoint.resolve(MODEL))).decode(tokens, skip_special_tokens=True)


def test_a_contributor_behind_a_symmetric_nat_serves_through_a_relay_and_says_its_link_stays_relayed(swarm):
    """A symmetric NAT gives every destination its own outer port: no hole can be punched through it, so the
    contributor behind it and the one at home next to it in the pipeline talk through the public relay."""
    bed = swarm.bed
    half = budgets(MODEL, 2)[0]
    swarm.contribute(bed.public_host("boot"), "boot", half // 8)
    alice, dave = (wait() for wait in [
        swarm.start(bed.behind(bed.home_router("home1"), "alice"), "alice", half, verbose=True),
        swarm.start(bed.behind(bed.home_router("carrier", symmetric=True), "dave"), "dave", half, verbose=True)])
    reply = swarm.chat(bed.public_host("user"), "user")
    assert reply["tokens"] == expected_tokens(8)
    assert {s["peer"] for s in reply["route"]} == {alice, dave}
    watcher = bed.public_host("watcher")
    wait_for(lambda: {m["peer"]: m["reach"] for m in swarm.status(watcher)["members"]}.get(dave) == "private", 60,
             "the symmetric-NAT stage to know it is private")

    def told() -> bool:
        logs = (swarm.logs / "alice.log").read_text() + (swarm.logs / "dave.log").read_text()
        return "stays relayed" in logs

    wait_for(told, 120, "a line saying the link stays relayed")
    logs = (swarm.logs / "alice.log").read_text() + (swarm.logs / "dave.log").read_text()
    assert not any(punched_line(peer) in logs for peer in (alice, dave))


def test_serve_behind_a_home_router_answers_a_client_in_the_same_home(swarm):
    bed = swarm.bed
    half = budgets(MODEL, 2)[0]
    swarm.contribute(bed.public_host("boot"), "boot", half)
    home = bed.home_router("home1")
    swarm.contribute(bed.behind(home, "alice"), "alice", half)
    server = bed.behind(home, "server")
    proc = swarm.command(server, "serve", "serve", "--join", swarm.boot, "--model", MODEL, "--host", "0.0.0.0",
                         "--port", "8000", "--json", "--heartbeat", "1")
    read_until(lines_of(proc), '{"event": "serving"', 120)
    client = bed.behind(home, "laptop")
    script = ("import openai, sys\n"
              "c = openai.OpenAI(base_url=sys.argv[1], api_key='none', max_retries=0, timeout=120)\n"
              "chunks = list(c.completions.create(model=sys.argv[2], prompt=sys.argv[3], max_tokens=8,"
              " temperature=0, stream=True))\n"
              "print(len(chunks)); print(''.join(ch.choices[0].text for ch in chunks if ch.choices), end='')\n")
    out = client.run([sys.executable, "-c", script, f"http://{server.addr}:8000/v1", MODEL, PROMPT], timeout=180,
                     env=swarm.env)
    assert out.returncode == 0, out.stderr[-3000:]
    count, text = out.stdout.split("\n", 1)
    assert int(count) > 2 and text == expected_text(8)


def test_a_generation_survives_the_relays_of_a_private_stage_going(swarm):
    """Both relays a private stage holds slots on are killed mid-generation: it takes a slot on the third
    public relay, announces it, the entry reaches it there, and the generation ends with the same tokens. (The
    stage is behind a symmetric NAT and the entry at home: no hole can be punched, so the relays carry it all.)"""
    TOKENS = 256  # noqa: N806 - long enough to be under way when the relays go
    bed = swarm.bed
    half = budgets(MODEL, 2)[0]
    swarm.contribute(bed.public_host("boot"), "boot", half, "--no-relay-service")
    waits = [swarm.start(bed.public_host(f"relay{i}"), f"relay{i}", half // 8) for i in range(3)]
    waits.append(swarm.start(bed.behind(bed.home_router("carrier", symmetric=True), "dave"), "dave", half,
                             verbose=True))
    *relays, _ = (wait() for wait in waits)
    procs = dict(zip(relays, swarm.procs[1:]))

    def held() -> set[str]:
        """The relays the stage took slots on (its log says each), less those it lost."""
        lines = (swarm.logs / "dave.log").read_text().splitlines()
        taken = [line.split("/p2p/")[1].split()[0] for line in lines if "reachable through relay" in line]
        lost = {line.split("/p2p/")[1].split()[0] for line in lines if "relay /" in line and " lost (" in line}
        return set(taken) - lost

    first = wait_for(lambda: len(held()) == 2 and held(), 90, "the private stage's two relay slots")
    user = bed.behind(bed.home_router("home2"), "user")  # private too: the two reach each other only through relays
    chat = swarm.command(user, "user", "chat", "--join", swarm.boot, "--model", MODEL, "--greedy",
                         "--no-spec", "--max-new-tokens", str(TOKENS), "--heartbeat", "1", "--prompt", PROMPT)
    out = chat.stdout.read(1)  # the first piece of text: the generation is under way
    for relay in first:
        procs[relay].kill()
    assert chat.poll() is None, "the generation ended before the relays went"
    out += chat.stdout.read()
    code = chat.wait(timeout=240)
    log = (swarm.logs / "user.log").read_text()
    assert code == 0, log[-3000:]
    assert out.strip() == expected_text(TOKENS).strip()
    assert "stage failed" in log, f"the generation never noticed the relays going: {log[-3000:]}"
    (third,) = set(relays) - first
    assert third in wait_for(lambda: third in held() and held(), 60, "a slot on the third relay")




def test_a_contributor_nobody_can_reach_is_told_why_and_left_out_of_plans(swarm):
    bed = swarm.bed
    half = budgets(MODEL, 2)[0]
    swarm.contribute(bed.public_host("boot"), "boot", budgets(MODEL, 1)[0], "--no-relay-service")  # all of it
    alice = swarm.contribute(bed.behind(bed.home_router("home1"), "alice"), "alice", half, verbose=True)
    watcher = bed.public_host("watcher")

    def excluded() -> str | None:
        plan = swarm.status(watcher)["plan"] or {}
        return next((e["reason"] for e in plan.get("excluded", []) if e["node"] == alice), None)

    try:
        wait_for(lambda: excluded() == UNREACHABLE, 60, "the plan to leave the unreachable contributor out, saying why")
    except AssertionError as e:
        raise AssertionError(f"{e}; alice's log:\n{(swarm.logs / 'alice.log').read_text()[-3000:]}") from None
    said = wait_for(lambda: (swarm.logs / "alice.log").read_text().count("nobody can reach this node"), 30,
                    "the contributor to say why nobody can reach it")
    time.sleep(KEEP_S * 2)  # (the relay slots are looked after every KEEP_S: it said it once, and not again)
    assert said == (swarm.logs / "alice.log").read_text().count("nobody can reach this node") == 1
