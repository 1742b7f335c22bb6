#!/usr/bin/env python3
"""Chaos: concurrent greedy chats through a local swarm while contributors are killed, frozen and replaced.

A local swarm of tinycode contributors, each offered half the model's memory, so any two make a
pipeline and every span has spare holders (the coordinator plans one pipeline: latency objective;
the others wait to take over). `--chats` chats, each its own SwarmClient in this process, generate
greedily from a set of prompts, one generation after another; every output is compared with the
same model in one process (LocalPipeline). Meanwhile, every few seconds, a random contributor (with
probability `--bias` one of the active route's) is killed with SIGKILL or frozen with SIGSTOP and
resumed with SIGCONT after a few seconds; a killed one is replaced by a new contributor (a new
identity) a few seconds later, joining through three live contributors. At least two healthy contributors
are always left.

Reported: generations completed, wrong (tokens differ from the reference) and lost (generate raised),
recoveries (re-routes after a stage failed, each with its reason), and for every fault that hit a
generation in flight (its current route held the victim): the stall, from the fault to the token that
ends that generation's longest gap between tokens within 60 s of it, p50 / p95 / max.

    python benchmarks/chaos_bench.py [--minutes 3] [--chats 4] [--seed 0] [--json]

Contributor logs (INFO), this process's log and `timeline.jsonl` (each client's lease, plan, members,
bans once a second, contributors named by index) stay in `--logs` (a folder under /tmp by default).
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers shared with the tests
from beeswarm.client.swarm import SwarmClient
from beeswarm.contributor.local_swarm import Child, ChildFlags, LocalSwarm, budgets, threads_per_process
from beeswarm.generation.generate import generate
from beeswarm.generation.sampling import SamplingParams
from beeswarm.shard import EntryModel, checkpoint
from local_pipeline import LocalPipeline  # noqa: E402

SNIPPETS = [
    "def fibonacci(n):\n", "import os\n\ndef list_files(path):\n", "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n    print(", "def read_json(path):\n    with open(path) as f:\n",
    "# binary search\ndef search(items, target):\n", "async def fetch(url):\n", "x = [i * i for i in",
]
GREEDY = SamplingParams()
STEP_TIMEOUT_S = 30.0  # RemotePipeline's: a frozen stage is given up on after this
JOINS = 3  # live contributors a replacement joins through


# --- reference --------------------------------------------------------------------------------------
def prompts_of(model: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(checkpoint.resolve(model)))
    return [tokenizer.encode(s) for s in SNIPPETS]


def references(model: str, prompts: list[list[int]], n: int) -> list[tuple[list[int], list[float]]]:
    """Each prompt's greedy continuation in one process, with the top-1 - top-2 logit margin of every token."""
    local = LocalPipeline(model, stages=1, dtype="float32", device="cpu")
    out = []
    for ids in prompts:
        margins: list[float] = []

        def forward(t, s, session):
            logits = local.forward(session, t, s)
            top = torch.topk(logits[-1].float(), 2).values
            margins.append(float(top[0] - top[1]))
            return logits

        session = local.open(len(ids) + n)
        try:
            gen = generate(lambda t, s: forward(t, s, session), ids, n, GREEDY)
        finally:
            local.close(session)
        out.append((gen.tokens, margins))
    return out


# --- what happened ----------------------------------------------------------------------------------
@dataclass
class GenRecord:
    chat: int
    prompt: int
    start: float
    end: float = 0.0
    token_times: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    routes: list[tuple[float, tuple[str, ...]]] = field(default_factory=list)  # (when chosen, stage peers)
    failures: list[tuple[float, str]] = field(default_factory=list)  # (when, the client's warning)
    recoveries: int = 0
    error: str | None = None


@dataclass
class Fault:
    t: float
    action: str  # kill | stop
    index: int
    peer: str
    serving: bool  # in the active route (a client's view)
    coordinator: bool
    pause_s: float = 0.0


class Recorder(logging.Handler):
    """The clients' 'stage failed' warnings, by chat thread, timed on the monotonic clock."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.current: dict[str, GenRecord] = {}

    def emit(self, record: logging.LogRecord) -> None:
        gen = self.current.get(record.threadName)
        if gen is not None and record.getMessage().startswith("stage failed"):
            gen.failures.append((time.monotonic(), record.getMessage()))


def watch_routes(client: SwarmClient, recorder: Recorder) -> None:
    """Record each route a chat's generation takes as it is taken (wraps the client's pipeline lookup)."""
    pipeline = client._pipeline

    def wrapped(route):
        gen = recorder.current.get(threading.current_thread().name)
        if gen is not None:
            gen.routes.append((time.monotonic(), tuple(s.node for s in route)))
        return pipeline(route)

    client._pipeline = wrapped  # type: ignore[method-assign]


# --- the swarm and its chaos ------------------------------------------------------------------------
class Chaos:
    def __init__(self, swarm: LocalSwarm, observer: SwarmClient, rng: random.Random, args):
        self.swarm, self.observer, self.rng, self.args = swarm, observer, rng, args
        self.budget = budgets(args.model, 2)[0]  # half the model each: any two make a pipeline
        self.stopped: dict[int, float] = {}  # index -> when to resume
        self.killed: set[int] = set()
        self.replace_at: list[float] = []
        self.faults: list[Fault] = []
        self.events: list[dict] = []  # every action, for the JSON

    def healthy(self) -> list[Child]:
        return [c for c in self.swarm.children if c.process.poll() is None and c.index not in self.stopped
                and c.index not in self.killed and c.peer and c.addr]

    def active_route(self) -> set[str]:
        return {s.node for p in self.observer.coordinator.state.active for s in p.stages}

    def spawn(self) -> Child:
        alive = self.healthy() or [c for c in self.swarm.children if c.process.poll() is None and c.addr]
        # through JOINS of them, as a swarm publishes several bootstrap addresses: with one, a newcomer whose pick
        # was itself cut off (its own bootstrap killed as it joined) grew a second swarm the chats never met
        joins = [c.addr for c in self.rng.sample(alive, min(JOINS, len(alive)))]
        index = max(c.index for c in self.swarm.children) + 1
        child = self.swarm._spawn(index, self.budget, joins)
        self.swarm.children.append(child)
        self.events.append({"t": time.monotonic(), "action": "start", "index": index, "join": joins})
        return child

    def fault(self) -> None:
        healthy = self.healthy()
        if len(healthy) < 3:  # always leave two healthy contributors: a pipeline stays possible
            return
        serving = self.active_route()
        lease = self.observer.coordinator.lease
        pool = [c for c in healthy if c.peer in serving] if self.rng.random() < self.args.bias else []
        victim = self.rng.choice(pool or healthy)
        action = self.rng.choice(["kill", "stop"])
        pause = self.rng.uniform(*self.args.pause) if action == "stop" else 0.0
        f = Fault(time.monotonic(), action, victim.index, victim.peer or "", victim.peer in serving,
                  lease is not None and lease.leader == victim.peer, round(pause, 2))
        if action == "kill":
            victim.process.send_signal(signal.SIGKILL)
            self.killed.add(victim.index)
            self.replace_at.append(f.t + self.rng.uniform(*self.args.replace))
        else:
            victim.process.send_signal(signal.SIGSTOP)
            self.stopped[victim.index] = f.t + pause
        self.faults.append(f)
        self.events.append({"t": f.t, "action": action, "index": f.index, "peer": f.peer, "serving": f.serving,
                            "coordinator": f.coordinator, "pause_s": f.pause_s})
        print(f"  {time.strftime('%H:%M:%S')} {len(self.faults)} {action} contributor {f.index}"
              f"{' (serving)' if f.serving else ''}{' (coordinator)' if f.coordinator else ''}"
              f"{f' for {pause:.1f} s' if pause else ''}", file=sys.stderr, flush=True)

    def tick(self, now: float, faults_on: bool) -> None:
        for index, when in list(self.stopped.items()):
            if now >= when or not faults_on:
                child = next(c for c in self.swarm.children if c.index == index)
                child.process.send_signal(signal.SIGCONT)
                del self.stopped[index]
                self.events.append({"t": now, "action": "resume", "index": index})
        for when in [w for w in self.replace_at if now >= w]:
            self.replace_at.remove(when)
            self.spawn()

    def resume_all(self) -> None:
        self.tick(time.monotonic(), faults_on=False)


def snapshot(swarm: LocalSwarm, clients: list[SwarmClient], t0: float) -> dict:
    """What each client sees now (contributors named by index): lease, plan, members, bans, connections."""
    index = {c.peer: c.index for c in swarm.children if c.peer}
    name = lambda peer: index.get(peer, peer[-6:] if peer else None)  # noqa: E731
    out: dict = {"t": round(time.monotonic() - t0, 2),
                 "alive": sorted(c.index for c in swarm.children if c.process.poll() is None)}
    for i, client in enumerate(clients):
        lease, state = client.coordinator.lease, client.coordinator.state
        view = client.members.view()
        connected = set(client.node.connected_peers())
        out[f"client{i}"] = {
            "lease": [name(lease.leader), lease.term] if lease else None,
            "plan": [state.term, state.epoch, name(state.coordinator)],
            "active": [[(name(s.node), str(s.span)) for s in p.stages] for p in state.active],
            "target": [[(name(s.node), str(s.span)) for s in p.stages] for p in state.target],
            "members": {str(name(peer)): [info.state, [str(x) for x in info.spans]]
                        for peer, info in view.items() if info.role == "contributor"},
            "banned": sorted(str(name(p)) for p in index if client.node.bans.is_banned(p)),
            "unconnected": sorted(str(name(p)) for p in view if p not in connected),
        }
    return out


# --- chats ------------------------------------------------------------------------------------------
def chat_loop(i: int, client: SwarmClient, prompts: list[list[int]], args, until: float, rng: random.Random,
              recorder: Recorder, records: list[GenRecord]) -> None:
    name = threading.current_thread().name
    while time.monotonic() < until:
        p = rng.randrange(len(prompts))
        gen = GenRecord(i, p, time.monotonic())
        recorder.current[name] = gen

        def on_token(token: int, gen=gen) -> None:
            gen.token_times.append(time.monotonic())
            gen.tokens.append(token)

        try:
            out = client.generate(prompts[p], args.new_tokens, GREEDY, on_token=on_token,
                                  route_timeout=args.route_timeout)
            gen.tokens, gen.recoveries = list(out.generation.tokens), out.recoveries
        except Exception as e:  # noqa: BLE001 - a lost generation, counted and kept
            gen.error = f"{type(e).__name__}: {e}"
            gen.recoveries = len(gen.failures)
        gen.end = time.monotonic()
        recorder.current.pop(name, None)
        records.append(gen)


# --- analysis ---------------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def stall_after(g: GenRecord, t: float, horizon: float = 60.0) -> tuple[float | None, float | None]:
    """(fault -> the token that ends the generation's longest stall after the fault, that stall), in s.

    The longest gap between tokens within `horizon` of the fault (counted from the fault, not from the
    token before it) is the stall the fault caused: a token already in flight past the victim may still
    arrive just after the fault, and the next one waits for the re-route or the resume. None: no token
    came after the fault (the generation was lost)."""
    after = [x for x in g.token_times if t < x <= t + horizon]
    if not after:
        return None, None
    gaps = [(b - max(a, t), b) for a, b in zip([t, *after], after)]
    stall, end = max(gaps)
    return round(end - t, 3), round(stall, 3)


def analyse(records: list[GenRecord], faults: list[Fault], refs, t0: float) -> dict:
    completed = [g for g in records if g.error is None]
    lost = [g for g in records if g.error is not None]
    wrong = []
    for g in completed:
        expected, margins = refs[g.prompt]
        if g.tokens != expected:
            at = next((k for k, (a, b) in enumerate(zip(g.tokens, expected)) if a != b), min(len(g.tokens),
                                                                                           len(expected)))
            wrong.append({"chat": g.chat, "prompt": g.prompt, "first_difference": at,
                          "reference_margin": round(margins[at], 5) if at < len(margins) else None,
                          "recoveries": g.recoveries, "got": g.tokens, "expected": expected,
                          "failures": [m for _, m in g.failures], "start_s": round(g.start - t0, 2)})

    faulted = {f.peer: f for f in faults}
    recoveries = []
    for g in records:
        for t, message in g.failures:
            cause = next((f for f in reversed(faults) if f.peer and f.peer in message and f.t <= t and
                          (f.action == "kill" or t <= f.t + f.pause_s + STEP_TIMEOUT_S + 5)), None)
            recoveries.append({"t_s": round(t - t0, 2), "chat": g.chat, "message": message,
                               "cause": cause.action if cause else "no fault on that peer",
                               "lost": g.error is not None})
    unprovoked = [r for r in recoveries if r["cause"] == "no fault on that peer"]

    hits = []  # (fault, generation) pairs: the generation's current route held the victim
    for f in faults:
        for g in records:
            if not g.start <= f.t < g.end or sum(t <= f.t for t in g.token_times) >= len(refs[g.prompt][0]):
                continue  # not in flight (or every token already out)
            routes = [r for t, r in g.routes if t <= f.t]
            if not routes or f.peer not in routes[-1]:
                continue
            latency, stall = stall_after(g, f.t)
            rerouted = any(t > f.t and f.peer in m for t, m in g.failures)
            hits.append({"action": f.action, "serving": f.serving, "coordinator": f.coordinator,
                         "pause_s": f.pause_s, "rerouted": rerouted, "lost": g.error is not None,
                         "latency_s": latency, "stall_s": stall, "chat": g.chat, "fault_s": round(f.t - t0, 2)})
    latencies = [h["latency_s"] for h in hits if h["latency_s"] is not None]

    def summary(values: list[float]) -> dict:
        return {"n": len(values), "p50_s": pct(values, 50), "p95_s": pct(values, 95),
                "max_s": max(values) if values else None}

    gaps = [max(b - a for a, b in zip([g.start, *g.token_times], g.token_times))
            for g in records if g.recoveries and g.token_times]
    rates = [len(g.tokens) / (g.end - g.start) for g in completed if g.end > g.start]
    return {
        "generations": len(records), "completed": len(completed), "wrong": len(wrong), "lost": len(lost),
        "tokens": sum(len(g.tokens) for g in completed),
        "median_generation_tokens_per_s": round(statistics.median(rates), 2) if rates else None,
        "recoveries": len(recoveries), "recoveries_without_fault": len(unprovoked),
        "faults": {a: sum(f.action == a for f in faults) for a in ("kill", "stop")},
        "faults_on_serving": sum(f.serving for f in faults),
        "faults_on_coordinator": sum(f.coordinator for f in faults),
        "faulted_peers": len(faulted),
        "hits": len(hits), "hits_rerouted": sum(h["rerouted"] for h in hits),
        "recovery_latency": summary(latencies),
        "recovery_latency_kill": summary([h["latency_s"] for h in hits if h["action"] == "kill" and h["latency_s"]]),
        "recovery_latency_stop": summary([h["latency_s"] for h in hits if h["action"] == "stop" and h["latency_s"]]),
        "recovery_latency_rerouted": summary([h["latency_s"] for h in hits if h["rerouted"] and h["latency_s"]]),
        "max_token_gap_of_recovered_generations": summary([round(x, 3) for x in gaps]),
        "hit_details": hits, "recovery_details": recoveries, "wrong_details": wrong,
        "lost_details": [{"chat": g.chat, "prompt": g.prompt, "error": g.error, "tokens": len(g.tokens),
                          "start_s": round(g.start - t0, 2), "end_s": round(g.end - t0, 2),
                          "failures": [m for _, m in g.failures]} for g in lost],
    }


def table(result: dict) -> str:
    def s(x):
        return "-" if x is None else f"{x:.2f}"

    rl = result["recovery_latency"]
    rows = [
        ("generations completed", result["completed"]),
        ("wrong (tokens differ from the one-process reference)", result["wrong"]),
        ("lost (generate raised)", result["lost"]),
        ("signed peer records refused (\"invalid-signed-record\" in the logs)", result["invalid_signed_records"]),
        ("faults: kill -9 / SIGSTOP", f"{result['faults']['kill']} / {result['faults']['stop']}"),
        ("faults on the active route / on the coordinator",
         f"{result['faults_on_serving']} / {result['faults_on_coordinator']}"),
        ("generations in flight on a faulted stage (re-routed)", f"{result['hits']} ({result['hits_rerouted']})"),
        ("recoveries (re-routes) / of which no fault on that peer",
         f"{result['recoveries']} / {result['recoveries_without_fault']}"),
        ("fault -> end of the stall it caused, p50 / p95 / max (s)",
         f"{s(rl['p50_s'])} / {s(rl['p95_s'])} / {s(rl['max_s'])}"),
    ]
    for key, label in (("kill", "after kill -9"), ("stop", "after SIGSTOP"), ("rerouted", "re-routed only")):
        r = result[f"recovery_latency_{key}"]
        rows.append((f"  {label}: n, p50 / p95 / max (s)",
                     f"{r['n']}, {s(r['p50_s'])} / {s(r['p95_s'])} / {s(r['max_s'])}"))
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def settle(client: SwarmClient, quiet_s: float = 5.0, timeout: float = 60.0) -> None:
    """Wait until the plan a client follows has not changed for `quiet_s` (the spares' joins re-plan)."""
    deadline = time.monotonic() + timeout
    seen, since = None, time.monotonic()
    while time.monotonic() < deadline:
        state = client.coordinator.state
        now = (state.term, state.epoch)
        if now != seen:
            seen, since = now, time.monotonic()
        elif state.active and time.monotonic() - since >= quiet_s:
            return
        time.sleep(0.2)


# --- main -------------------------------------------------------------------------------------------
def invalid_records(logs: Path) -> int:
    """Lines in every log saying a peer's signed peer record was refused (an honest swarm sends none)."""
    return sum(line.count("invalid-signed-record") for f in logs.glob("*.log")
               for line in f.read_text(errors="replace").splitlines())


def run(args) -> dict:
    rng = random.Random(args.seed)
    logs = Path(args.logs or tempfile.mkdtemp(prefix="chaos-", dir="/tmp"))
    logs.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, filename=logs / "bench.log",
                        format="%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s")
    libp2p_log = logging.FileHandler(logs / "bench.log")  # py-libp2p's logger does not propagate
    libp2p_log.setLevel(logging.WARNING)
    libp2p_log.setFormatter(logging.Formatter("%(asctime)s %(threadName)s %(name)s %(levelname)s %(message)s"))
    logging.getLogger("libp2p").addHandler(libp2p_log)
    recorder = Recorder()
    logging.getLogger("beeswarm.client.swarm").addHandler(recorder)

    prompts = prompts_of(args.model)
    refs = references(args.model, prompts, args.new_tokens)
    processes = args.contributors + 1
    torch.set_num_threads(threads_per_process(processes))
    swarm = LocalSwarm(2, args.model, flags=ChildFlags(log_level="INFO"), state_dir=logs)
    clients: list[SwarmClient] = []
    records: list[GenRecord] = []
    try:
        bootstrap = swarm.start()
        swarm.wait_ready()
        entry = EntryModel.load(args.model, "float32", "cpu")
        for _ in range(args.chats if args.client_per_chat else 1):
            client = SwarmClient.create(entry, [bootstrap], interval=1.0, listen=["/ip4/127.0.0.1/tcp/0"]).start()
            watch_routes(client, recorder)
            clients.append(client)
        chaos = Chaos(swarm, clients[0], rng, args)
        while len(swarm.children) < args.contributors:
            chaos.spawn()
        deadline = time.monotonic() + 120
        while len(chaos.healthy()) < args.contributors and time.monotonic() < deadline:
            time.sleep(0.2)  # every spare has joined
        settle(clients[0])
        for client in clients:  # each has a route and warm channels
            client.generate(prompts[0], 4, GREEDY, route_timeout=args.route_timeout)
        print(f"swarm of {len(swarm.children)} contributors ready; logs in {logs}", file=sys.stderr, flush=True)

        t0 = time.monotonic()
        until = t0 + args.minutes * 60
        threads = [threading.Thread(target=chat_loop, name=f"chat-{i}", daemon=True,
                                    args=(i, clients[i % len(clients)], prompts, args, until,
                                          random.Random(args.seed * 1000 + i), recorder, records))
                   for i in range(args.chats)]
        for t in threads:
            t.start()
        next_fault, next_snapshot = t0 + rng.uniform(*args.every), t0
        timeline = open(logs / "timeline.jsonl", "w")  # noqa: SIM115 - closed below
        while time.monotonic() < until or any(t.is_alive() for t in threads):
            now = time.monotonic()
            if now >= next_snapshot:  # each client's view once a second, for explaining what went wrong
                timeline.write(json.dumps(snapshot(swarm, clients, t0)) + "\n")
                next_snapshot = now + 1.0
            if now < until:
                chaos.tick(now, faults_on=True)
                if now >= next_fault:
                    chaos.fault()
                    next_fault = now + rng.uniform(*args.every)
            else:
                chaos.resume_all()  # generations started before the end finish (or fail)
                if now > until + args.route_timeout * 2 + 60:
                    break
            time.sleep(0.05)
        timeline.close()
        result = analyse(records, chaos.faults, refs, t0)
        result.update({"minutes": args.minutes, "chats": args.chats, "seed": args.seed, "model": args.model,
                       "new_tokens": args.new_tokens, "contributors": args.contributors,
                       "contributors_started": len(swarm.children), "still_running": [t.name for t in threads
                                                                                       if t.is_alive()],
                       "logs": str(logs), "invalid_signed_records": invalid_records(logs),
                       "events": [{**e, "t": round(e["t"] - t0, 2)} for e in chaos.events],
                       "peers": {c.index: c.peer for c in swarm.children}})
        return result
    finally:
        for client in clients:
            client.close()
        for c in swarm.children:  # a frozen child cannot act on SIGTERM
            if c.process.poll() is None:
                c.process.send_signal(signal.SIGCONT)
        swarm.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=3.0)
    ap.add_argument("--chats", type=int, default=4, help="concurrent chats (4-8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print the whole result as one JSON object")
    ap.add_argument("--model", default="tinycode")
    ap.add_argument("--contributors", type=int, default=5, help="pool size kept (each holds half the model)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--every", type=float, nargs=2, default=(6.0, 14.0), metavar=("MIN", "MAX"),
                    help="seconds between faults")
    ap.add_argument("--pause", type=float, nargs=2, default=(2.0, 12.0), metavar=("MIN", "MAX"),
                    help="seconds a SIGSTOPped contributor stays frozen")
    ap.add_argument("--replace", type=float, nargs=2, default=(2.0, 6.0), metavar=("MIN", "MAX"),
                    help="seconds until a killed contributor is replaced")
    ap.add_argument("--bias", type=float, default=0.6, help="chance a fault picks a stage of the active route")
    ap.add_argument("--route-timeout", type=float, default=120.0)
    ap.add_argument("--shared-client", dest="client_per_chat", action="store_false",
                    help="one SwarmClient for every chat (default: one each)")
    ap.add_argument("--logs", default=None, help="folder for the logs (default: a new one under /tmp)")
    args = ap.parse_args()
    result = run(args)
    print(table(result))
    if result["wrong_details"] or result["lost_details"]:
        print(json.dumps({"wrong": result["wrong_details"], "lost": result["lost_details"]}, indent=1))
    if args.json:
        print(json.dumps(result, default=float))


if __name__ == "__main__":
    main()
