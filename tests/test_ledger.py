"""Credits across real processes: four contributors earn what two payers' entries spend, by the swarm's signed
ledger, which a new coordinator continues when the old one is killed -9.

The independent tally is the stages' own logs: each logs, when a session ends, the layer-tokens it computed
for it and whose credit it spends (the entries decode without a draft, so every step a stage computes
comes back to its entry and is receipted).
"""
from __future__ import annotations

import base64
import collections
import json
import os
import re
import subprocess
import sys
import time

import httpx
import msgspec
import pytest

from beeswarm.client.status import SwarmObserver
from beeswarm.contributor.local_swarm import budgets
from beeswarm.credits.ledger import rank
from beeswarm.credits.receipts import sign_receipt
from beeswarm.p2p import identity
from beeswarm.protocol.credits import HandIn, Receipt, swarm_id
from beeswarm.protocol.rpcs import HAND_IN
from helpers import serve, start_contributors, wait_for

pytestmark = pytest.mark.slow  # starts beeswarm processes: not in `make test-fast`

SESSION_LOG = re.compile(r"session \w+ of \S+ closed: served (\d+) layer-tokens paid by (\S+)")


class Swarm:
    def __init__(self, model, boot, stages, logs, entries, payers, observer):
        self.model, self.boot, self.stages, self.logs = model, boot, stages, logs
        self.entries, self.payers, self.observer = entries, payers, observer

    def generate(self, url: str, prompt: str) -> None:
        body = {"model": self.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 6,
                "temperature": 0}
        deadline = time.monotonic() + 60
        while True:  # a 503 while the swarm re-plans around a killed member: asked again
            reply = httpx.post(url + "/chat/completions", json=body, timeout=60)
            if reply.status_code != 503 or time.monotonic() > deadline:
                break
            time.sleep(1)  # and asked again a second later
        assert reply.status_code == 200, reply.text

    def tally(self) -> tuple[dict[str, int], dict[str, int]]:
        """(stage -> layer-tokens served, payer -> layer-tokens spent) from the stages' own logs."""
        earned, spent = collections.Counter(), collections.Counter()
        for stage, log in self.logs.items():
            for served, payer in SESSION_LOG.findall(log.read_text()):
                earned[stage] += int(served)
                spent[payer] += int(served)
        return dict(earned), dict(spent)

    def balances_match_the_tally(self) -> bool:
        ledger = self.observer.ledger(timeout=5)
        earned, spent = self.tally()
        accounts = {b.node: (b.earned, b.spent) for b in ledger.balances}
        return bool(earned) and all(accounts.get(s, (0, 0))[0] == n for s, n in earned.items()) and \
            all(accounts.get(p, (0, 0))[1] == n for p, n in spent.items())


@pytest.fixture(scope="module")
def swarm(tiny_models, tmp_path_factory):
    model = str(tiny_models["llama"])
    tmp = tmp_path_factory.mktemp("ledger")
    (tmp / "logs").mkdir()
    env = {**os.environ, "BEESWARM_CACHE_DIR": str(tmp / "cache"), "PYTHONUNBUFFERED": "1"}
    env.pop("BEESWARM_IDENTITY", None)
    procs, observer = [], None
    try:  # half the model each: every span has a replica, so a killed coordinator leaves no gap
        stages, boot = start_contributors(procs, model, 4, budgets(model, 2)[0], env, tmp, logs=tmp / "logs")
        logs = {peer: tmp / "logs" / f"node{i}.log" for i, peer in enumerate(stages)}
        payers = [identity.ephemeral() for _ in range(2)]
        entries = []
        for i, payer in enumerate(payers):  # each entry spends its payer's credit (`--identity machine`)
            key = base64.b64encode(payer.key_pair.private_key.to_bytes()).decode()
            with open(tmp / f"serve{i}.log", "w") as log:
                proc, url = serve(model, boot, {**env, "BEESWARM_IDENTITY": key}, log, "--identity", "machine",
                                  "--no-spec")
            procs.append(proc)
            entries.append(url)
        for url in entries:
            wait_for(lambda: httpx.get(url.removesuffix("/v1") + "/health").status_code == 200, 90, "a route")
        observer = SwarmObserver.create([boot], interval=1.0).start()
        observer.wait(10)
        yield Swarm(model, boot, stages, logs, entries, payers, observer)
    finally:
        if observer is not None:
            observer.close()
        for p in procs:
            p.kill()
            p.wait()


def test_every_balance_is_what_the_stages_logged_serving_each_payer(swarm):
    for i in range(3):
        for url in swarm.entries:
            swarm.generate(url, f"def f{i}(x):")
    wait_for(swarm.balances_match_the_tally, 30, "the ledger's balances to equal the stages' own tally")
    earned, spent = swarm.tally()
    assert set(spent) == {p.peer_id for p in swarm.payers}  # each entry spent its payer's credit
    assert sum(earned.values()) == sum(spent.values()) > 0
    ledger = swarm.observer.ledger(timeout=5)
    assert ledger.coordinator in swarm.stages and ledger.seq >= len(swarm.stages)

    payer = swarm.payers[0].peer_id  # `beeswarm credits` reads the same from the swarm
    out = subprocess.run([sys.executable, "-m", "beeswarm", "credits", "--join", swarm.boot, "--peer", payer, "--json"],
                         capture_output=True, text=True, timeout=60)
    shown = json.loads(out.stdout)
    assert shown["spent"] == spent[payer] and shown["earned"] == 0 and shown["balance"] == -spent[payer], out.stderr
    assert shown["last_hour"]["spent"] == spent[payer] and shown["rank"] == rank(ledger, payer)


def test_a_coordinator_killed_between_generations_loses_and_doubles_nothing(swarm):
    wait_for(swarm.balances_match_the_tally, 30, "the ledger to hold every receipt so far")
    before = swarm.observer.ledger(timeout=5)
    swarm.stages[before.coordinator].kill()  # -9: its ledger lives on in its followers
    for i in range(2):
        for url in swarm.entries:
            swarm.generate(url, f"def g{i}(y):")
    wait_for(lambda: swarm.observer.ledger(timeout=5).coordinator not in ("", before.coordinator)
             and swarm.balances_match_the_tally(), 60, "a new coordinator's ledger to equal the tally")
    after = swarm.observer.ledger(timeout=5)
    assert (after.term, after.seq) > (before.term, before.seq) and after.seq >= before.seq  # continued
    # the stages handed in again what the killed coordinator had recorded lately: refused as counted, not doubled
    assert any("already counted the receipt" in log.read_text() for log in swarm.logs.values())
    # the killed coordinator's earnings so far (none, if no route went through it) live on unchanged
    earned = [{b.node: b.earned for b in ledger.balances}.get(before.coordinator, 0) for ledger in (before, after)]
    assert earned[0] == earned[1]


def test_forged_foreign_and_unearned_receipts_are_refused_and_the_ledger_says_why(swarm):
    """The test's own node (a client: no benchmark) hands in receipts naming itself as their stage, signed by a
    payer of its own. (Replays: the stages' receipts handed in again after the coordinator's kill, above.)"""
    observer, payer = swarm.observer, identity.ephemeral()
    me = observer.node.peer_id

    def receipt(session: str, swarm_name: str = swarm_id("beeswarm", swarm.model)) -> Receipt:
        return sign_receipt(payer.key_pair, Receipt(swarm_name, payer.peer_id, payer.peer_id, me, session, 30, 10,
                                                    time.time()))

    forged = msgspec.structs.replace(receipt("forged"), prefill=10**6)  # more than the payer signed for
    foreign = receipt("foreign", swarm_id("beeswarm", "another-model"))
    unearned = receipt("unearned")  # well signed, but this node serves nothing and says of no capacity
    reply = observer.node.request(observer.coordinator.leader(), HAND_IN,
                                  HandIn(receipts=(forged, foreign, unearned)), timeout=10)
    assert reply.refused[0].startswith("forged")
    assert reply.refused[1].startswith("a receipt for another swarm")
    assert reply.refused[2].startswith("the stage's capacity is unknown")
    assert me not in {b.node for b in observer.ledger(timeout=5).balances}
