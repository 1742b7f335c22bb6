#!/usr/bin/env python3
"""Membership at scale: messages per second per node as the swarm grows, and a soak of real processes.

In-process (default): for each size, N p2p nodes on 127.0.0.1 in this process (each in its own trio
thread), each with membership and a coordinator (with its plan follower) that takes part in the election
but has nothing to plan (no model, no benchmark figures), as in tests/test_mesh.py. Once every view holds
N - 1 members and all agree on one coordinator, it runs `--seconds` and reports per node per
second: heartbeats received and sent, and from gossipsub itself (counted by wrapping the router of
each node) the copies of pubsub messages received (duplicates included), the messages forwarded
(first copies handed to the router, not the node's own) and the copies sent to peers.

    python benchmarks/mesh_bench.py [--sizes 8 16 32 48] [--seconds 60] [--json]

Processes: `--processes N` real `beeswarm contribute --headless --json-events` processes (tinycode;
each offered one layer's memory, so most hold nothing: a membership and election soak, not a
serving one) and an observer node in this process (a client's membership and coordinator view). For
`--seconds` after all N are seen: whether any process exited, the coordinators over time (the lease
holder and the distinct authors of lease beats in each 3 s window), the plan epochs, each node's
heartbeat rate as the observer receives it, and each process's CPU time.

    python benchmarks/mesh_bench.py --processes 16 --seconds 90 [--json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

from beeswarm.coordinator.cluster import ModelShape
from beeswarm.coordinator.coordinator import Coordinator
from beeswarm.coordinator.follower import PlanFollower
from beeswarm.p2p import identity
from beeswarm.p2p.membership import TARGET_BEATS_PER_S, Membership
from beeswarm.p2p.node import Node, NodeConfig
from beeswarm.protocol.coordinator import LeaseBeat
from beeswarm.protocol.membership import Heartbeat, NodeInfo

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
INTERVAL = 1.0
MODEL = ModelShape(num_layers=8, hidden_size=256, layer_bytes=10_000_000, kv_bytes_per_token_layer=1024)


# --- gossipsub counters -----------------------------------------------------------------------------
@dataclass
class PubsubCounts:
    received: int = 0  # publish copies from peers (duplicates included)
    forwarded: int = 0  # first copies of others' messages handed to the router
    published: int = 0  # this node's own messages
    sent: int = 0  # publish copies written to peers (own, forwarded and IWANT replies)
    rpcs: int = 0  # RPCs queued to peers (publish and control)

    def snapshot(self) -> tuple[int, ...]:
        return self.received, self.forwarded, self.published, self.sent, self.rpcs


def count_pubsub(node: Node) -> PubsubCounts:
    """Wrap the started node's pubsub and router methods with counters (each runs on the node's thread)."""
    counts = PubsubCounts()
    pubsub = node._pubsub
    assert pubsub is not None, "start the node first"
    router, me = pubsub.router, pubsub.host.get_id()
    push_msg, publish, send_rpc = pubsub.push_msg, router.publish, router.send_rpc

    async def counted_push(forwarder, msg):
        if forwarder != me:
            counts.received += 1
        await push_msg(forwarder, msg)

    async def counted_publish(forwarder, msg):
        if forwarder == me:
            counts.published += 1
        else:
            counts.forwarded += 1
        await publish(forwarder, msg)

    def counted_send(peer, rpc, *args, **kwargs):
        counts.rpcs += 1
        counts.sent += len(rpc.publish)
        return send_rpc(peer, rpc, *args, **kwargs)

    pubsub.push_msg = counted_push
    router.publish = counted_publish
    router.send_rpc = counted_send
    return counts


def stop_all(nodes: list[Node]) -> None:
    threads = [threading.Thread(target=n.stop, daemon=True) for n in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)


def failed(node: Node) -> bool:
    return node.failure is not None or not node.running


def per_node(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 2), "min": round(min(values), 2), "max": round(max(values), 2)}


# --- in-process meshes ------------------------------------------------------------------------------
def mesh_size(n: int, seconds: float, converge_timeout: float, count: bool = True) -> dict:
    nodes: list[Node] = []
    members: dict[Node, Membership] = {}
    coords: dict[Node, Coordinator] = {}
    counts: dict[Node, PubsubCounts] = {}
    t0, cpu0 = time.monotonic(), time.process_time()
    try:
        for _ in range(n):
            me = identity.ephemeral()
            node = Node(me, NodeConfig(listen=LOCAL, bootstrap=[nodes[0].addrs[0]] if nodes else []))
            members[node] = Membership(node, NodeInfo(peer=me.peer_id), interval=INTERVAL)
            members[node].start()
            coords[node] = Coordinator(PlanFollower(node, members[node], interval=INTERVAL), MODEL)
            coords[node].start()
            node.start()
            counts[node] = count_pubsub(node) if count else PubsubCounts()
            nodes.append(node)
        started = time.monotonic() - t0

        def converged() -> bool:
            leaders = {coords[x].lease.leader if coords[x].lease else None for x in nodes}
            return all(len(members[x].view()) == n - 1 for x in nodes) and len(leaders) == 1 and None not in leaders

        deadline = time.monotonic() + converge_timeout
        while not converged() and time.monotonic() < deadline:
            time.sleep(0.05)
        # not converged in time: measure anyway (what a node receives and how complete the views are)
        convergence = time.monotonic() - t0 if converged() else None
        before = {x: (members[x].counts.beats_received, members[x].counts.beats_sent, counts[x].snapshot(),
                      members[x].counts.views_received) for x in nodes}
        w0, c0 = time.monotonic(), time.process_time()
        leaders_max, views, stopped, converged_samples = 0, [], 0, 0
        while time.monotonic() - w0 < seconds:
            time.sleep(max(0.0, min(1.0, seconds - (time.monotonic() - w0))))
            leaders_max = max(leaders_max, sum(coords[x].is_leader for x in nodes))
            views += [len(members[x].view()) for x in nodes]
            stopped = max(stopped, sum(failed(x) for x in nodes))
            converged_samples += converged()
        wall, cpu = time.monotonic() - w0, time.process_time() - c0
        after = {x: (members[x].counts.beats_received, members[x].counts.beats_sent, counts[x].snapshot(),
                     members[x].counts.views_received) for x in nodes}

        def rate(pick) -> dict:
            return per_node([(pick(after[x]) - pick(before[x])) / wall for x in nodes])

        # of the heartbeats the others sent in the window, the share each node received
        sent = {x: after[x][1] - before[x][1] for x in nodes}
        delivered = [(after[x][0] - before[x][0]) / max(1, sum(sent.values()) - sent[x]) for x in nodes]

        return {
            "members": n, "start_s": round(started, 2),
            "convergence_s": round(convergence, 2) if convergence is not None else None,
            "after_start_s": round(convergence - started, 2) if convergence is not None else None,
            "converge_timeout_s": converge_timeout, "seconds": round(wall, 1),
            "heartbeat_delivery": per_node(delivered),
            "view_size": {"median": statistics.median(views), "min": min(views), "of": n - 1},
            "converged_share_of_samples": round(converged_samples / max(1, len(views) // n), 2),
            "heartbeats_received": rate(lambda s: s[0]), "heartbeats_sent": rate(lambda s: s[1]),
            "pubsub_received": rate(lambda s: s[2][0]), "pubsub_forwarded": rate(lambda s: s[2][1]),
            "pubsub_published": rate(lambda s: s[2][2]), "pubsub_sent": rate(lambda s: s[2][3]),
            "rpcs_sent": rate(lambda s: s[2][4]), "views_received": rate(lambda s: s[3]),
            "beat_period_s": per_node([members[x].period() for x in nodes]),
            "max_coordinators": leaders_max, "nodes_stopped": stopped,
            "converged_at_end": converged(), "process_cores": round(cpu / wall, 2),
            "startup_cores": round((c0 - cpu0) / (w0 - t0), 2),
        }
    finally:
        stop_all(nodes)


def mesh_table(rows: list[dict]) -> str:
    head = ("| members | converged after (s) | views (median / min of N-1) | heartbeats received /node/s | "
            "share of sent beats received | heartbeats sent /node/s | pubsub copies received /node/s | "
            "forwarded /node/s | copies sent /node/s | coordinators (max) | cores used |\n"
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        def m(key, r=r):
            return f"{r[key]['median']:.2f} ({r[key]['min']:.2f}-{r[key]['max']:.2f})"
        conv = f"{r['convergence_s']:.1f}" if r["convergence_s"] is not None else \
            f"not in {r['converge_timeout_s']:.0f}"
        v = r["view_size"]
        lines.append(f"| {r['members']} | {conv} | {v['median']:g} / {v['min']} of {v['of']} | "
                     f"{m('heartbeats_received')} | {m('heartbeat_delivery')} | {m('heartbeats_sent')} | "
                     f"{m('pubsub_received')} | {m('pubsub_forwarded')} | {m('pubsub_sent')} | "
                     f"{r['max_coordinators']} | {r['process_cores']:.2f} |")
    return "\n".join(lines)


# --- real processes ---------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def log_events(logs: Path, since: datetime.datetime) -> dict:
    """From the contributors' logs after `since`: members dropped for silence or a lost connection,
    lease claims and step-downs, as seconds after `since` per node."""
    kinds = {"is gone": "members_dropped", "claimed coordinator lease": "lease_claims",
             "stepping down": "step_downs"}
    out: dict[str, list] = {k: [] for k in kinds.values()}
    for path in sorted(logs.glob("node*.log")):
        for line in path.read_text(errors="replace").splitlines():
            kind = next((v for k, v in kinds.items() if k in line), None)
            if kind is None:
                continue
            try:
                when = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
            except ValueError:
                continue
            if when >= since:
                out[kind].append((path.stem, round((when - since).total_seconds(), 1)))
    return out


class Observer:
    """A client's view of the swarm: membership and a plan follower, with what it hears."""

    def __init__(self, bootstrap: str):
        me = identity.ephemeral()
        self.node = Node(me, NodeConfig(listen=LOCAL, bootstrap=[bootstrap]))
        self.members = Membership(self.node, NodeInfo(peer=me.peer_id, role="client", state="serving"),
                                  interval=INTERVAL)
        self.coordinator = PlanFollower(self.node, self.members, interval=INTERVAL)
        self.beats: Counter[str] = Counter()  # heartbeats per author
        self.periods: dict[str, float] = {}
        self.lease_beats: deque[tuple[float, str, int]] = deque()  # (when, author, term)
        self.epochs: list[tuple[float, int, int, str]] = []  # (when, term, epoch, coordinator)
        on_member, on_coord = self.members._on_message, self.coordinator._on_message

        def member_message(author, msg):
            if isinstance(msg, Heartbeat):
                self.beats[author] += 1
                self.periods[author] = msg.info.beat_s
            on_member(author, msg)

        def coord_message(author, msg):
            if isinstance(msg, LeaseBeat):
                self.lease_beats.append((time.monotonic(), author, msg.term))
            on_coord(author, msg)

        # `start()` subscribes whatever these attributes hold then
        self.members._on_message = member_message  # type: ignore[method-assign]
        self.coordinator._on_message = coord_message  # type: ignore[method-assign]
        self.coordinator.listeners.append(
            lambda s: self.epochs.append((time.monotonic(), s.term, s.epoch, s.coordinator)))

    def start(self) -> Observer:
        self.members.start()
        self.coordinator.start()
        self.node.start()
        self.counts = count_pubsub(self.node)
        return self

    def beaters(self, now: float, window: float = 3.0) -> set[str]:
        return {a for t, a, _ in self.lease_beats if now - t <= window}


def processes(n: int, seconds: float, model: str) -> dict:
    from beeswarm.contributor.local_swarm import ChildFlags, LocalSwarm, budgets

    logs = Path(tempfile.mkdtemp(prefix="mesh-processes-", dir="/tmp"))
    swarm = LocalSwarm(n, model, flags=ChildFlags(heartbeat=INTERVAL, log_level="INFO"), state_dir=logs)
    from beeswarm.contributor.contributor import model_shape

    layer = budgets(model, min(n, model_shape(model).num_layers))[0]  # one layer's share each (n >= layers)
    observer = None
    t0 = time.monotonic()
    try:
        first = swarm._spawn(0, layer, None)
        swarm.children.append(first)
        while first.addr is None:
            if first.process.poll() is not None or time.monotonic() - t0 > 180:
                raise RuntimeError(f"the first contributor did not start; see {logs}/node0.log")
            time.sleep(0.1)
        for i in range(1, n):
            swarm.children.append(swarm._spawn(i, layer, first.addr))
        observer = Observer(first.addr).start()
        peers_up = lambda: sum(c.peer is not None for c in swarm.children)  # noqa: E731
        deadline = time.monotonic() + 600
        while len(observer.members.view()) < n or observer.coordinator.lease is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the observer saw {len(observer.members.view())} of {n} members "
                                   f"({peers_up()} processes up) within 600 s; logs in {logs}")
            time.sleep(0.2)
        all_seen = time.monotonic() - t0
        print(f"  all {n} members seen after {all_seen:.1f} s; soaking {seconds:.0f} s", file=sys.stderr, flush=True)
        pids = {c.index: c.process.pid for c in swarm.children}
        cpu0 = {i: cpu_seconds(p) for i, p in pids.items()}
        beats0, counts0, epochs0 = Counter(observer.beats), observer.counts.snapshot(), len(observer.epochs)
        w0, since = time.monotonic(), datetime.datetime.now()
        timeline, exits, leaders, max_beaters, min_view = [], {}, [], 0, n
        while time.monotonic() - w0 < seconds:
            time.sleep(1.0)
            now = time.monotonic()
            lease = observer.coordinator.lease
            beaters = observer.beaters(now)
            max_beaters = max(max_beaters, len(beaters))
            view = len(observer.members.view())
            min_view = min(min_view, view)
            leader = lease.leader if lease else None
            if not leaders or leaders[-1] != leader:
                leaders.append(leader)
            state = observer.coordinator.state
            timeline.append({"t": round(now - w0, 1), "leader": leader[-6:] if leader else None,
                             "term": lease.term if lease else None, "lease_beaters_3s": len(beaters),
                             "view": view, "plan": [state.term, state.epoch]})
            for c in swarm.children:
                if c.index not in exits and c.process.poll() is not None:
                    exits[c.index] = {"t": round(now - w0, 1), "status": c.process.returncode}
        wall = time.monotonic() - w0
        per_author = {a: (observer.beats[a] - beats0[a]) / wall for a in observer.beats}
        peers = {c.peer: c.index for c in swarm.children}
        cpu = {i: (cpu_seconds(p) or 0) - (cpu0[i] or 0) for i, p in pids.items()}
        counts = [(b - a) / wall for a, b in zip(counts0, observer.counts.snapshot())]
        state = observer.coordinator.state
        events = log_events(logs, since)
        return {
            "members_dropped_in_logs": len(events["members_dropped"]),
            "last_member_dropped_s": max((t for _, t in events["members_dropped"]), default=None),
            "lease_claims_in_logs": events["lease_claims"], "step_downs_in_logs": events["step_downs"],
            "processes": n, "seconds": round(wall, 1), "all_seen_after_s": round(all_seen, 1),
            "exited": exits, "still_running": sum(c.process.poll() is None for c in swarm.children),
            "leaders_seen": [x[-6:] if x else None for x in leaders], "leader_changes": max(0, len(leaders) - 1),
            "max_lease_beaters_3s": max_beaters, "min_view": min_view,
            "plan_epochs_during": [(round(t - w0, 1), term, epoch) for t, term, epoch, _ in observer.epochs[epochs0:]],
            "plan_at_end": [state.term, state.epoch], "plan_epochs_before": len(observer.epochs[:epochs0]),
            "observer_heartbeats_per_node_per_s": per_node([per_author.get(p, 0.0) for p in peers]),
            "observer_heartbeats_total_per_s": round(sum(per_author.get(p, 0.0) for p in peers), 2),
            "announced_beat_s": per_node([observer.periods.get(p, 0.0) for p in peers]),
            "observer_pubsub_per_s": dict(zip(("received", "forwarded", "published", "sent", "rpcs"),
                                              (round(c, 2) for c in counts))),
            "cpu_cores_per_process": per_node([v / wall for v in cpu.values()]),
            "cpu_cores_total": round(sum(cpu.values()) / wall, 2),
            "rss_mb_per_process": per_node([rss_mb(p) or 0.0 for p in pids.values()]),
            "serving": sorted((c.index, str(c.span)) for c in swarm.children if c.span),
            "logs": str(logs), "timeline": timeline,
        }
    finally:
        if observer is not None:
            observer.node.stop()
        swarm.stop()


def processes_summary(r: dict) -> str:
    def m(key):
        return f"{r[key]['median']:.2f} (min {r[key]['min']:.2f}, max {r[key]['max']:.2f})"

    epochs = ", ".join(f"{term}/{epoch} at {t:.0f} s" for t, term, epoch in r["plan_epochs_during"]) or "none"
    rows = [
        ("processes, soak", f"{r['processes']}, {r['seconds']:.0f} s (all seen after {r['all_seen_after_s']:.0f} s)"),
        ("exited during the soak", json.dumps(r["exited"]) if r["exited"] else "none"),
        ("coordinators seen (lease holder), changes", f"{r['leaders_seen']}, {r['leader_changes']}"),
        ("most lease-beat authors in a 3 s window", r["max_lease_beaters_3s"]),
        ("plan term/epoch at the end; new epochs during the soak",
         f"{r['plan_at_end'][0]}/{r['plan_at_end'][1]}; {epochs}"),
        ("smallest view (members seen by the observer)", r["min_view"]),
        ("members dropped in the contributors' logs; the last at",
         f"{r['members_dropped_in_logs']}; {r['last_member_dropped_s']} s"),
        ("lease claims in the logs (node, s)", r["lease_claims_in_logs"] or "none"),
        ("heartbeats/s from each node at the observer", m("observer_heartbeats_per_node_per_s")),
        ("heartbeats/s received by the observer, total", r["observer_heartbeats_total_per_s"]),
        ("announced heartbeat period (s)", m("announced_beat_s")),
        ("observer pubsub per s", json.dumps(r["observer_pubsub_per_s"])),
        ("CPU cores per process", m("cpu_cores_per_process")),
        ("CPU cores, all processes", r["cpu_cores_total"]),
        ("RSS per process (MB)", m("rss_mb_per_process")),
        ("serving (index, layers)", r["serving"]),
        ("logs", r["logs"]),
    ]
    width = max(len(label) for label, _ in rows)
    return "\n".join(f"{label:<{width}}  {value}" for label, value in rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 16, 32, 48])
    ap.add_argument("--seconds", type=float, default=None, help="run per size after convergence (default 60; "
                    "90 with --processes)")
    ap.add_argument("--converge-timeout", type=float, default=60.0,
                    help="then measure anyway, reporting how complete the views are")
    ap.add_argument("--processes", type=int, default=None, metavar="N", help="soak N contributor processes instead")
    ap.add_argument("--model", default="tinycode", help="with --processes")
    ap.add_argument("--no-pubsub-counts", action="store_true", help="leave gossipsub unwrapped (heartbeats only)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.processes:
        result = processes(args.processes, args.seconds or 90.0, args.model)
        print(processes_summary(result))
        if args.json:
            print(json.dumps(result))
        return
    rows = []
    for n in args.sizes:
        row = mesh_size(n, args.seconds or 60.0, args.converge_timeout, not args.no_pubsub_counts)
        print(json.dumps(row), file=sys.stderr, flush=True)
        rows.append(row)
        time.sleep(3)  # let the stopped nodes' sockets go
    print(mesh_table(rows))
    print(f"target: about {TARGET_BEATS_PER_S:.0f} heartbeats received per node per second at any size")
    if args.json:
        print(json.dumps(rows))


if __name__ == "__main__":
    main()
