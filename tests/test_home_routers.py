"""Across home routers: real beeswarm processes on the network-namespace test bed (tests/netbed.py).

A public bootstrap on the "internet", contributors and users behind home routers that NAT and drop
unsolicited inbound, as most volunteers' and users' machines are."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from beeswarm.contributor.local import budgets
from helpers import lines_of, read_until, reference_greedy
from netbed import Host, NetBed, require_netns

pytestmark = [pytest.mark.slow, pytest.mark.netns]

MODEL = "tinycode"
PORT = 4001  # each host has its own namespace, so every node can listen on the same port
PROMPT = "def fibonacci(n):"


@dataclass
class Swarm:
    """beeswarm processes on the bed's hosts, their logs under `logs`."""
    bed: NetBed
    logs: Path
    env: dict[str, str]
    boot: str | None = None
    procs: list[subprocess.Popen] = field(default_factory=list)

    def command(self, host: Host, name: str, *argv: str) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "w")  # noqa: SIM115 - the process writes it while it runs
        proc = host.popen([sys.executable, "-m", "beeswarm", *argv], stdout=subprocess.PIPE, stderr=log, text=True,
                          env={**self.env, "BEESWARM_CONFIG_DIR": str(self.logs / name)})
        self.procs.append(proc)
        return proc

    def contribute(self, host: Host, name: str, memory: int, *extra: str) -> str:
        """A headless contributor on `host`; returns its peer id (the first is the swarm's bootstrap)."""
        argv = ["contribute", "--headless", "--model", MODEL, "--listen", f"/ip4/0.0.0.0/tcp/{PORT}",
                "--max-memory", str(memory), "--heartbeat", "1", *extra]
        proc = self.command(host, name, *argv, *(["--join", self.boot] if self.boot else []))
        peer = read_until(lines_of(proc), "peer ", 90)[0].split()[1]
        if self.boot is None:
            self.boot = f"/ip4/{host.addr}/tcp/{PORT}/p2p/{peer}"
        return peer

    def chat(self, host: Host, name: str, tokens: int = 8, timeout: float = 240) -> dict:
        assert self.boot is not None
        out = host.run([sys.executable, "-m", "beeswarm", "chat", "--join", self.boot, "--model", MODEL, "--greedy",
                        "--no-spec", "--json", "--max-new-tokens", str(tokens), "--heartbeat", "1",
                        "--prompt", PROMPT], timeout=timeout, env={**self.env,
                                                                  "BEESWARM_CONFIG_DIR": str(self.logs / name)})
        (self.logs / f"{name}.log").write_text(out.stderr)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)

    def status(self, host: Host) -> dict:
        assert self.boot is not None
        out = host.run([sys.executable, "-m", "beeswarm", "status", "--join", self.boot, "--json"], timeout=120,
                       env=self.env)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout)


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


def test_a_user_at_home_chats_through_contributors_at_home(swarm):
    """The common case: the bootstrap is public, the contributors serving the layers and the user are
    each behind their own home router."""
    bed = swarm.bed
    half = budgets(MODEL, 2)[0]
    boot = swarm.contribute(bed.public_host("boot"), "boot", half // 8)  # no room for a layer: it only relays
    alice = swarm.contribute(bed.behind(bed.home_router("home1"), "alice"), "alice", half)
    bob = swarm.contribute(bed.behind(bed.home_router("home2"), "bob"), "bob", half)
    carol = bed.behind(bed.home_router("home3"), "carol")
    reply = swarm.chat(carol, "carol")
    assert reply["tokens"] == expected_tokens(8)
    assert {s["peer"] for s in reply["route"]} == {alice, bob}
    members = {m["peer"]: m for m in swarm.status(carol)["members"]}
    assert {peer: members[peer]["reach"] for peer in (boot, alice, bob)} == \
        {boot: "public", alice: "private", bob: "private"}
