#!/usr/bin/env python3
"""A mesh of N members spread over a few processes (p2p + membership + election, no model weights).

`run(members, workers, seconds)` starts `workers` processes of this script, each holding members /
workers nodes on 127.0.0.1 (the first node of the first worker is everyone's bootstrap). Every
second each worker prints one JSON line: each node's view size and the coordinator it follows, how
many of its nodes stopped, and its CPU time. Worker i joins through the first node of worker i - 1
(a swarm has several bootstrap nodes; one hub for all would be this harness's bottleneck).
Returned: when the mesh converged (every view holds
N - 1 members and all follow one coordinator), for `seconds` after that the smallest view, the
coordinators seen, nodes stopped, and the cores used. Run by tests/test_mesh.py (48 members, 15 s)
and by hand (the figures in BENCHMARKS.md: 2 minutes; `--interval` is the heartbeat, 3 s as in
`beeswarm contribute`):

    python benchmarks/mesh_procs.py [--members 48] [--workers 4] [--seconds 120] [--interval 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

LOCAL = ["/ip4/127.0.0.1/tcp/0"]


# --- a worker: K nodes in this process ------------------------------------------------------------
def worker(nodes: int, bootstrap: str | None, interval: float) -> None:
    from beeswarm.coordinator.cluster import ModelShape
    from beeswarm.coordinator.coordinator import Coordinator
    from beeswarm.coordinator.follower import PlanFollower
    from beeswarm.p2p import identity
    from beeswarm.p2p.membership import Membership
    from beeswarm.p2p.node import Node, NodeConfig
    from beeswarm.protocol.membership import NodeInfo

    model = ModelShape(num_layers=8, hidden_size=256, layer_bytes=10_000_000, kv_bytes_per_token_layer=1024)
    made: list[tuple[Node, Membership, Coordinator]] = []
    for _ in range(nodes):
        me = identity.ephemeral()
        boot = bootstrap or (made[0][0].addrs[0] if made else None)
        node = Node(me, NodeConfig(listen=LOCAL, bootstrap=[boot] if boot else []))
        members = Membership(node, NodeInfo(peer=me.peer_id, role="contributor", state="idle"), interval=interval)
        members.start()
        coordinator = Coordinator(PlanFollower(node, members, interval=interval), model)
        coordinator.start()
        node.start()
        made.append((node, members, coordinator))
        if len(made) == 1:  # the next worker joins through this one (no single hub for the whole mesh)
            print(json.dumps({"bootstrap": node.addrs[0]}), flush=True)
    print(json.dumps({"all_started": time.monotonic()}), flush=True)
    try:
        while True:
            print(json.dumps({
                "views": [len(m.view()) for _, m, _ in made],
                "connected": [len(n.connected_peers()) for n, _, _ in made],
                "linked": [bool(c.lease) and (c.lease.leader == n.peer_id or n.is_connected(c.lease.leader))
                           for n, _, c in made],
                "started": len(made),
                "leaders": [c.lease.leader if c.lease else None for _, _, c in made],
                "stopped": sum(n.failure is not None or not n.running
                               for n, _, _ in made),
                "cpu": time.process_time()}), flush=True)
            time.sleep(1.0)
    except (KeyboardInterrupt, BrokenPipeError):
        pass
    finally:
        for node, _, _ in made:
            node.stop()


# --- the parent --------------------------------------------------------------------------------------
@dataclass
class MeshRun:
    members: int
    workers: int
    started_s: float | None = None  # when every node had started, from the first worker's start
    converged_s: float | None = None  # from the first worker's start
    after_start_s: float | None = None  # converged_s - started_s
    seconds: float = 0.0  # observed after convergence
    min_view: int | None = None
    coordinators: list[str] = field(default_factory=list)  # distinct coordinators followed after convergence
    max_coordinators_at_once: int = 0
    stopped: int = 0
    workers_exited: int = 0
    exit_errors: list[str] = field(default_factory=list)  # the end of each exited worker's stderr
    cores: float = 0.0  # CPU of all workers per second of the observed window


def _reader(proc: subprocess.Popen, out: queue.Queue, index: int) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        try:
            out.put((index, json.loads(line)))
        except ValueError:
            continue


def run(members: int = 48, workers: int = 4, seconds: float = 120.0, converge_timeout: float = 60.0,
        interval: float = 3.0, verbose: bool = False) -> MeshRun:
    per = [members // workers + (i < members % workers) for i in range(workers)]
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--interval", str(interval), "--nodes"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "BEESWARM_LOG_LEVEL": "ERROR"}
    lines: queue.Queue = queue.Queue()
    procs: list[subprocess.Popen] = []
    result = MeshRun(members, workers)
    errs = [tempfile.TemporaryFile("w+") for _ in per]  # why a worker exited, if one does
    try:
        t0 = time.monotonic()
        first = subprocess.Popen(cmd + [str(per[0])], stdout=subprocess.PIPE, stderr=errs[0], text=True, env=env)
        procs.append(first)
        threading.Thread(target=_reader, args=(first, lines, 0), daemon=True).start()
        for i, n in enumerate(per[1:], start=1):
            bootstrap = None
            while bootstrap is None:
                index, msg = lines.get(timeout=60)
                bootstrap = msg.get("bootstrap") if index == i - 1 else None
            proc = subprocess.Popen(cmd + [str(n), "--bootstrap", bootstrap], stdout=subprocess.PIPE,
                                    stderr=errs[i], text=True, env=env)
            procs.append(proc)
            threading.Thread(target=_reader, args=(proc, lines, i), daemon=True).start()
        latest: dict[int, dict] = {}
        cpu_at: dict[int, float] = {}
        converged_at = None
        deadline = t0 + converge_timeout
        while True:
            try:
                index, msg = lines.get(timeout=2.0)
            except queue.Empty:
                msg = None
            if msg is not None and "views" in msg:
                latest[index] = msg
            now = time.monotonic()
            result.workers_exited = sum(p.poll() is not None for p in procs)
            if len(latest) == workers:
                views = [v for m in latest.values() for v in m["views"]]
                leaders = [x for m in latest.values() for x in m["leaders"]]
                stopped = sum(m["stopped"] for m in latest.values())
                agreed = len(set(leaders)) == 1 and leaders[0] is not None
                if verbose and msg is not None:
                    print(f"{now - t0:6.1f} s: {len(views)} nodes, views {min(views)}-{max(views)}, "
                          f"{len({x for x in leaders if x})} coordinators, {leaders.count(None)} without, "
                          f"{sum(x for m in latest.values() for x in m['linked'])} linked to theirs",
                          file=sys.stderr, flush=True)
                if result.started_s is None and len(views) == members:
                    result.started_s = round(now - t0, 2)
                if converged_at is None:
                    if len(views) == members and min(views) == members - 1 and agreed:
                        converged_at = now
                        result.converged_s = round(now - t0, 2)
                        result.after_start_s = round(result.converged_s - (result.started_s or 0.0), 2)
                        cpu_at = {i: m["cpu"] for i, m in latest.items()}
                    elif now > deadline:
                        break
                else:
                    result.min_view = min(views) if result.min_view is None else min(result.min_view, min(views))
                    distinct = {x for x in leaders if x}
                    result.max_coordinators_at_once = max(result.max_coordinators_at_once, len(distinct))
                    result.coordinators = sorted(set(result.coordinators) | distinct)
                    result.stopped = max(result.stopped, stopped)
                    result.seconds = round(now - converged_at, 1)
                    if now - converged_at >= seconds:
                        result.cores = round(sum(latest[i]["cpu"] - cpu_at[i] for i in latest) / (now - converged_at),
                                             2)
                        break
            if result.workers_exited:
                for proc, err in zip(procs, errs):
                    if proc.poll() is not None:
                        err.seek(0)
                        result.exit_errors.append(err.read()[-800:])
                break
        return result
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
        for err in errs:
            err.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--nodes", type=int, default=12, help=argparse.SUPPRESS)
    parser.add_argument("--bootstrap", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--interval", type=float, default=3.0)
    parser.add_argument("--members", type=int, default=48)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--converge-timeout", type=float, default=60.0, help="seconds the mesh may take to converge")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--verbose", action="store_true", help="the mesh's progress every second, on stderr")
    args = parser.parse_args()
    if args.worker:
        worker(args.nodes, args.bootstrap, args.interval)
        return
    result = run(args.members, args.workers, args.seconds, args.converge_timeout, args.interval, args.verbose)
    print(json.dumps(asdict(result)) if args.json else result)


if __name__ == "__main__":
    main()
