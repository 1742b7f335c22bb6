"""A swarm behind `beeswarm serve` at the production heartbeat, and a greedy stream through it that a fault
interrupts after a few pieces: for tests/test_faults.py and benchmarks/fault_bench.py.

Two contributors that can each hold half the model serve it (no replica); the bootstrap, which serves a
stage, holds the coordinator's lease. A third, the spare, joins after the plan is made, so it serves nothing
until a stage is lost: then the swarm re-plans and the spare loads the lost half while the stream waits.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from beeswarm.contributor.local_swarm import budgets
from beeswarm.generation.sampling import ModelDefaults
from helpers import past_probation, serve, start_contributors, wait_for
from served import KEY, Served

PRODUCTION_HEARTBEAT = 3.0
PROMPT = "def f(x):"
FAULTS = ("kill", "stop", "coordinator")  # SIGKILL a stage; SIGSTOP one (a lid closed); SIGKILL the coordinator


@dataclass(frozen=True)
class FaultedStream:
    text: str
    expected: str  # transformers' greedy text for the same prompt and length
    finish_reason: str | None
    fault_to_next_s: float  # from the fault to the next piece of text
    recoveries: int
    victim: str
    route: tuple[str, ...]  # the peers of the route that finished the stream


class FaultSwarm:
    """Start with `start()`, end with `close()` (kills every process, a stopped one too)."""

    def __init__(self, model: str, tmp: Path, heartbeat: float = PRODUCTION_HEARTBEAT):
        self.model, self.tmp, self.heartbeat = model, tmp, heartbeat
        tmp.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "BEESWARM_CACHE_DIR": str(tmp / "cache"), "PYTHONUNBUFFERED": "1", "API_KEY": KEY}
        self.env.pop("BEESWARM_IDENTITY", None)
        self.procs: list[subprocess.Popen] = []
        self.peers: dict[str, subprocess.Popen] = {}
        self.served: Served | None = None

    def start(self) -> Served:
        half = budgets(self.model, 2)[0]
        beat = self.heartbeat
        self.peers, boot = start_contributors(self.procs, self.model, 2, half, self.env, self.tmp, logs=self.tmp,
                                              heartbeat=beat)
        with open(self.tmp / "serve.log", "w") as log:  # the child keeps its own copy of the descriptor
            proc, url = serve(self.model, boot, self.env, log, "--api-key-env", "API_KEY", heartbeat=beat)
        self.procs.append(proc)
        self.served = s = Served(url, self.model, self.peers)
        wait_for(lambda: s.health()["status"] == "ok", 40 * beat, "a route through the two halves")
        spare, _ = start_contributors(self.procs, self.model, 1, half, self.env, self.tmp, join=boot, logs=self.tmp,
                                      heartbeat=beat)
        self.peers |= spare
        wait_for(lambda: s.health()["members"] >= 3, 20 * beat, "the spare in the entry's view")
        route = [hop["peer"] for hop in wait_for(lambda: past_probation(s.health, lambda: s.client.completions.create(
            model=self.model, prompt=PROMPT, max_tokens=4)), 60 * beat, "a route past probation")]  # text streams
        assert len(route) == 2 and set(spare).isdisjoint(route), f"the spare serves: {route}"
        return s

    def victim(self, fault: str) -> str:
        """The peer `fault` hits: the coordinator, or the stage that is not the coordinator."""
        health = self.served.health()
        route = [hop["peer"] for hop in health["route"]]
        coordinator = health["coordinator"]
        assert coordinator in route, f"the coordinator {coordinator} serves no stage of {route}"
        return coordinator if fault == "coordinator" else next(p for p in route if p != coordinator)

    def stream(self, fault: str, after: int = 5, max_tokens: int = 40) -> FaultedStream:
        """A greedy stream of `max_tokens`; `fault` hits its victim once `after` pieces have arrived."""
        s, victim = self.served, self.victim(fault)
        # what serve's greedy stream is: the model's own repetition penalty applies (tinycode's is 1.3)
        expected = s.reference(PROMPT, max_tokens, ModelDefaults.read(Path(self.model)).repetition_penalty or 1.0)
        pieces: list[str] = []
        extras, finish, faulted_at, next_at = None, None, None, None
        for chunk in s.client.chat.completions.create(model=self.model, messages=[{"role": "user", "content": PROMPT}],
                                                      max_tokens=max_tokens, temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
                if faulted_at is not None and next_at is None:
                    next_at = time.monotonic()
                if len(pieces) == after:
                    self.peers[victim].send_signal(signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
                    faulted_at = time.monotonic()
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
            if chunk.model_extra.get("beeswarm"):
                extras = chunk.model_extra["beeswarm"]
        assert faulted_at is not None and next_at is not None, f"the stream ended after {len(pieces)} pieces"
        assert extras is not None, "the stream's last chunk carried no beeswarm extras"
        return FaultedStream("".join(pieces), expected, finish, next_at - faulted_at, extras["recoveries"], victim,
                             tuple(hop["peer"] for hop in extras["route"]))

    def close(self) -> None:
        for p in self.procs:
            p.kill()  # SIGKILL ends a stopped process too
            p.wait()
