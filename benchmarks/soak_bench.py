#!/usr/bin/env python3
"""Soak: one long-running bootstrap and coordinator under a churn of thousands of distinct peers.

The node under test is a real `Contributor` (what `beeswarm contribute` runs) in this process: the
swarm's first node, so its bootstrap and coordinator, serving tinycode. Around it, all real
processes on 127.0.0.1, each peer a fresh identity:
- every `--period` s a group of `--group` bare peers (tests/vanishing_peers.py) dial it and are
  killed with -9 once connected (a crashed laptop, a dropped Wi-Fi);
- every `--period` s two `status --join` clients: one killed with -9 after 2.5 s, one left to finish
  and exit politely;
- `--contributors` contributors, each offered half the model, so they are planned and serve; every
  `--replace-every` s the oldest is replaced: killed with -9 and SIGINT (a polite leave) in turn.
Every `--sample-every` s one JSON line: the node's file descriptors, RSS, threads and what it holds
per peer (`Node.stats()`: connections, peerstore, inbound slots, trio tasks; members, ban records,
probe figures), and a newcomer's time to connect (a fresh identity each time). At the end, each
figure's median over the second quarter of the run against the last quarter: flat means no growth
once warm. `--plot` draws the curves (matplotlib, the `bench` extra).

    python benchmarks/soak_bench.py [--minutes 120] [--period 10] [--group 8] [--contributors 2]
        [--replace-every 60] [--sample-every 30] [--out soak.jsonl] [--plot soak.png] [--json]
        [--trace-memory]
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from beeswarm import logs as beeswarm_logs
from beeswarm.contributor.contributor import Contributor, ContributorOptions
from beeswarm.contributor.local_swarm import beeswarm_command, budgets
from beeswarm.contributor.status import Event
from beeswarm.p2p import identity
from beeswarm.p2p.node import Node, NodeConfig

LOCAL = "/ip4/127.0.0.1/tcp/0"
VANISHING = Path(__file__).resolve().parents[1] / "tests" / "vanishing_peers.py"
FLAT = ("fds", "rss_mb", "threads", "connections", "known_peers", "inbound_slots", "tasks", "members", "bans",
        "probes", "handshake_ms", "py_heap_mb")


@dataclass
class Churn:
    """The processes around the node under test, started and ended on schedule."""
    addr: str
    env: dict[str, str]
    logs: Path
    contributor_memory: int
    peers_started: int = 0
    contributors: list[subprocess.Popen] = field(default_factory=list)
    kills: int = 0
    polite: int = 0
    _reaping: list[tuple[float, subprocess.Popen, int]] = field(default_factory=list)  # (when, process, signal)

    def spawn(self, argv: list[str], name: str, **kw: object) -> subprocess.Popen:
        self.peers_started += 1
        env = {**self.env, "BEESWARM_CONFIG_DIR": str(self.logs / "state" / f"{name}{self.peers_started}")}
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, **kw)  # type: ignore[call-overload]

    def vanishing_group(self, n: int) -> None:
        proc = self.spawn([sys.executable, str(VANISHING), self.addr, str(n)], "group", stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True)
        self.peers_started += n - 1
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:  # (its only line says all are connected)
            if proc.stdout is not None and proc.stdout.readline().startswith("connected"):
                break
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        self.kills += n

    def status_clients(self) -> None:
        status = [*beeswarm_command(), "status", "--join", self.addr, "--json"]
        killed = self.spawn(status, "status", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        polite = self.spawn([*status, "--wait", "1"], "status", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._reaping += [(time.monotonic() + 2.5, killed, signal.SIGKILL), (time.monotonic() + 60, polite, 0)]

    def contributor(self) -> None:
        argv = [*beeswarm_command(), "contribute", "--headless", "--model", "tinycode", "--join", self.addr,
                "--listen", LOCAL, "--max-memory", str(self.contributor_memory)]
        with open(self.logs / f"contributor{self.peers_started + 1}.log", "w") as log:  # the child keeps its own
            self.contributors.append(self.spawn(argv, "contributor", stdout=subprocess.DEVNULL, stderr=log))

    def replace_oldest(self) -> None:
        oldest = self.contributors.pop(0)
        how = signal.SIGKILL if (self.kills + self.polite) % 2 == 0 else signal.SIGINT
        oldest.send_signal(how)
        self._reaping.append((time.monotonic() + 15, oldest, signal.SIGKILL))
        self.kills += how == signal.SIGKILL
        self.polite += how == signal.SIGINT
        self.contributor()

    def reap(self, everything: bool = False) -> None:
        now, left = time.monotonic(), []
        for when, proc, sig in self._reaping:
            if proc.poll() is not None:
                continue
            if everything or now >= when:
                if sig:
                    proc.send_signal(sig)
                    self.kills += sig == signal.SIGKILL
                else:
                    self.polite += 1  # it did not finish in time: ended here instead
                    proc.kill()
                proc.wait()
            else:
                left.append((when, proc, sig))
        self._reaping = left
        if everything:
            for proc in self.contributors:
                proc.kill()
                proc.wait()


def handshake_ms(addr: str) -> float | None:
    """How long a newcomer (a fresh identity) takes to connect; None if it cannot within 10 s."""
    node = Node(identity.ephemeral(), NodeConfig(listen=[LOCAL])).start()
    try:
        began = time.perf_counter()
        node.connect(addr, timeout=10.0)
        return (time.perf_counter() - began) * 1e3
    except Exception:  # noqa: BLE001 - the failure this benchmark looks for
        return None
    finally:
        node.stop()


def sample(contributor: Contributor, churn: Churn, began: float) -> dict[str, object]:
    me = psutil.Process()
    stats = contributor.node.stats()
    return {"t_s": round(time.monotonic() - began, 1), "peers_started": churn.peers_started, "kills": churn.kills,
            "polite": churn.polite, "fds": me.num_fds() if hasattr(me, "num_fds") else me.num_handles(),
            "rss_mb": round(me.memory_info().rss / 2**20, 1), "threads": me.num_threads(), **asdict(stats),
            "members": len(contributor.members.view()),
            "connected_others": len(set(contributor.node.connected_peers()) - set(contributor.members.view())),
            "bans": len(contributor.node.bans),
            "probes": len(contributor.prober.all()), "handshake_ms": handshake_ms(churn.addr),
            "serving": contributor.lifecycle.facts.span is not None,
            "py_heap_mb": round(tracemalloc.get_traced_memory()[0] / 2**20, 1) if tracemalloc.is_tracing() else None}


def heap_growth(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, top: int = 15) -> list[str]:
    """Where the Python heap grew between two snapshots: the sites that allocated most, net."""
    return [str(stat) for stat in after.compare_to(before, "traceback")[:top] if stat.size_diff > 0]


def flatness(rows: list[dict[str, object]]) -> dict[str, dict[str, float]]:
    """Each figure's median over the second quarter of the run and over the last quarter."""
    q = max(1, len(rows) // 4)
    out = {}
    for key in FLAT:
        early = [float(r[key]) for r in rows[q:2 * q] if r.get(key) is not None]  # type: ignore[arg-type]
        late = [float(r[key]) for r in rows[-q:] if r.get(key) is not None]  # type: ignore[arg-type]
        if early and late:
            out[key] = {"second_quarter": statistics.median(early), "last_quarter": statistics.median(late)}
    return out


def plot(rows: list[dict[str, object]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("file descriptors, threads", ("fds", "threads")),
              ("RSS, traced Python heap (MB)", ("rss_mb", "py_heap_mb")),
              ("trio tasks", ("tasks",)), ("connections, peerstore, inbound slots, members",
                                          ("connections", "known_peers", "inbound_slots", "members")),
              ("newcomer's time to connect (ms)", ("handshake_ms",)),
              ("peers started (cumulative)", ("peers_started",))]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.2 * len(panels)), sharex=True)
    minutes = [float(r["t_s"]) / 60 for r in rows]  # type: ignore[arg-type]
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            ax.plot(minutes, [r.get(key) if r.get(key) is not None else float("nan") for r in rows], label=key)
        ax.set_title(title, fontsize=9)
        ax.set_ylim(bottom=0)
        if len(keys) > 1:
            ax.legend(fontsize=7, loc="upper left")
    axes[-1].set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=120.0)
    ap.add_argument("--period", type=float, default=10.0, help="seconds between churn rounds")
    ap.add_argument("--group", type=int, default=8, help="bare peers killed with -9 each round")
    ap.add_argument("--contributors", type=int, default=2)
    ap.add_argument("--replace-every", type=float, default=60.0)
    ap.add_argument("--sample-every", type=float, default=30.0)
    ap.add_argument("--out", type=Path, default=None, help="JSON lines, one per sample")
    ap.add_argument("--plot", type=Path, default=None)
    ap.add_argument("--logs", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--trace-memory", action="store_true",
                    help="trace Python allocations (slower): the heap in each sample, and where it grew after warm-up")
    args = ap.parse_args()
    if args.trace_memory:
        tracemalloc.start(4)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="soak-"))
    logs.mkdir(parents=True, exist_ok=True)
    node_log = open(logs / "node.log", "w")  # noqa: SIM115 - open for the whole run
    beeswarm_logs.setup(logging.INFO, stream=node_log)  # py-libp2p's records too, repeats summarised
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    half = budgets("tinycode", 2)[0]
    addrs: list[str] = []

    def said(event: Event) -> None:
        if event.kind == "addr":
            addrs.append(event.fields["addr"])

    contributor = Contributor.create(identity.ephemeral(), ContributorOptions(listen=[LOCAL], max_memory=half),
                                     say=said)
    runner = threading.Thread(target=contributor.run, name="node-under-test", daemon=True)
    runner.start()
    while not addrs:
        if not runner.is_alive():
            raise SystemExit("the node under test did not start: see " + str(logs / "node.log"))
        time.sleep(0.2)
    churn = Churn(addrs[0], env, logs, half)
    for _ in range(args.contributors):
        churn.contributor()
    began = time.monotonic()
    end = began + args.minutes * 60
    next_sample = next_replace = began
    rows: list[dict[str, object]] = []
    warm: tracemalloc.Snapshot | None = None
    out = open(args.out, "w") if args.out else None  # noqa: SIM115
    try:
        while time.monotonic() < end:
            round_began = time.monotonic()
            if round_began >= next_sample:
                rows.append(sample(contributor, churn, began))
                next_sample += args.sample_every
                if out is not None:
                    out.write(json.dumps(rows[-1]) + "\n")
                    out.flush()
                if not args.json:
                    print(json.dumps(rows[-1]), flush=True)
                if args.trace_memory and warm is None and round_began - began >= args.minutes * 15:
                    warm = tracemalloc.take_snapshot()  # the end of the first quarter: warm-up over
            if round_began >= next_replace + args.replace_every:
                churn.replace_oldest()
                next_replace = round_began
            churn.status_clients()
            churn.vanishing_group(args.group)
            churn.reap()
            time.sleep(max(0.0, args.period - (time.monotonic() - round_began)))
    finally:
        grown = heap_growth(warm, tracemalloc.take_snapshot()) if warm is not None else []
        churn.reap(everything=True)
        contributor.stop()
        runner.join(30)
        if out is not None:
            out.close()
    summary = {"minutes": args.minutes, "samples": len(rows), "peers_started": churn.peers_started,
               "kills": churn.kills, "polite": churn.polite,
               "newcomers_refused": sum(r["handshake_ms"] is None for r in rows), "flatness": flatness(rows),
               "heap_growth_after_warmup": grown, "logs": str(logs)}
    if args.plot:
        plot(rows, args.plot)
    print(json.dumps(summary, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
