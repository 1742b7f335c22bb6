"""`beeswarm status`: the swarm at a glance (members, layer coverage, coordinator, plans)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from beeswarm.commands import options
from beeswarm.commands.common import UserError, required_join, swarm_secret
from beeswarm.coordinator.swarm_report import StatusReport
from beeswarm.protocol.coordinator import Pipeline

RED, RESET = "\033[31m", "\033[0m"


def add_parser(sub) -> argparse.ArgumentParser:
    status = sub.add_parser("status", help="the swarm at a glance: members, layer coverage, coordinator, plans")
    options.add_join(status, "the swarm to look at")
    status.add_argument("--json", action="store_true", help="print one JSON object (a line each with --watch)")
    status.add_argument("--watch", action="store_true", help="report again every few seconds until Ctrl-C")
    status.add_argument("--wait", type=float, default=8.0, metavar="S",
                        help="listen at most S seconds for the coordinator's plan before the first report")
    status.add_argument("--every", type=float, default=3.0, metavar="S", help="--watch: seconds between reports")
    options.add_secret(status)
    options.add_heartbeat(status)
    status.set_defaults(func=run)
    return status


def run(args) -> int:
    """The swarm at a glance: join as a client, listen until the plan is heard (or --wait), print, leave."""
    from beeswarm.client.status import SwarmObserver, Unreachable
    from beeswarm.p2p.errors import NodeError

    bootstrap, _ = required_join(args.join, "the swarm to look at")
    if args.wait <= 0 or args.every <= 0:
        raise UserError("--wait and --every must be positive")
    color = sys.stdout.isatty() and not os.environ.get("NO_COLOR")
    observer = SwarmObserver.create(bootstrap, secret=swarm_secret(args.swarm_secret_env), interval=args.heartbeat,
                                    relays=args.relay)
    try:
        observer.start()
        observer.wait(args.wait)
        try:
            observer.ledger(timeout=args.wait)  # credits per member: gossip brings the ledger only on change
        except Unreachable:
            pass  # none yet: no receipt recorded in this swarm
        while True:
            report = observer.report()
            if args.json:
                print(json.dumps(report.as_json()), flush=True)
            else:
                if args.watch and color:
                    print("\033[H\033[2J", end="")  # redraw in place
                print("\n".join(render(report, color)), flush=True)
            if not args.watch:
                return 0
            if not args.json and not color:
                print(flush=True)
            time.sleep(args.every)
    except Unreachable as e:
        raise UserError(str(e)) from None
    except NodeError as e:
        raise UserError(f"cannot join the swarm: {e}") from None
    except KeyboardInterrupt:
        return 0 if args.watch else 130
    finally:
        observer.close()


def render(report: StatusReport, color: bool = False) -> list[str]:
    """The report for people; `color`: gaps in red (for a terminal)."""
    red = (lambda text: f"{RED}{text}{RESET}") if color else (lambda text: text)  # noqa: E731
    contributors = sum(m.role == "contributor" for m in report.members)
    clients = len(report.members) - contributors
    out = [f"members: {len(report.members)} ({contributors} contributor{'s' * (contributors != 1)}, "
           f"{clients} client{'s' * (clients != 1)})"]
    if report.coordinator:
        out.append(f"coordinator: {report.coordinator}  term {report.term}  epoch {report.epoch}")
    else:
        out.append("coordinator: none heard")
    out.append("")
    credits = any(m.credit for m in report.members)  # the column once the ledger has accounts
    out.append(f"  {'peer':<14} {'role':<11} {'state':<8} {'reach':<8} {'layers':<18} {'device':<8} {'tok/s':>7} "
               f"{'busy':>5} {'heartbeat':>10}" + (f" {'credit':>12}" if credits else ""))
    for m in report.members:
        layers = " ".join(str(s) for s in m.spans) or "-"
        mark = "*" if m.coordinator else " "
        credit = (f" {m.credit.balance:>12,}" if m.credit else f" {'-':>12}") if credits else ""
        out.append(f"{mark} {short(m.peer):<14} {m.role:<11} {m.state:<8} {m.reach:<8} {layers:<18} {m.device:<8} "
                   f"{m.tokens_per_s:>7.1f} {m.busy:>5.0%} {m.heartbeat_age_s:>7.1f} s{credit}")
    out.append("")
    if not report.num_layers:
        out.append("coverage: unknown (no plan heard and no member serves a span)")
    else:
        summary = "complete" if report.complete else red(f"{sum(len(g) for g in report.gaps)} layer(s) unserved")
        out.append(f"coverage of {report.num_layers} layers: {summary}")
        for s in report.segments:
            if s.nodes:
                names = ", ".join(short(n) for n in s.nodes)
                out.append(f"  {str(s.span):<12} {s.replicas} replica{'s' if s.replicas > 1 else ''}: {names}")
            else:
                out.append(red(f"  {str(s.span):<12} GAP: no member serves these layers"))
    out.append("")
    if report.plan is None:
        out.append("plan: none heard")
        return out
    p = report.plan
    out.append(f"plan: term {p.term} epoch {p.epoch} by {short(p.coordinator)}, objective {p.objective}"
               f"{f', {p.quant} weights' if p.quant != 'none' else ''}{', migrating' if p.migrating() else ''}")
    out += [f"  active {line}" for line in _pipeline_lines(p.active)]
    if p.migrating():
        out += [f"  target {line}" for line in _pipeline_lines(p.target)]
    else:
        out.append("  target = active")
    out += [red(f"  excluded {short(e.node)} until {time.strftime('%Y-%m-%d %H:%M', time.localtime(e.until))}: "
                f"{e.reason}") if e.until else f"  left out {short(e.node)}: {e.reason}" for e in p.excluded]
    if p.standings:  # steps each layer was checked on (audit.probation): few means its sessions are audited whole
        out.append("  steps checked: " + ", ".join(
            f"{short(s.node)} " + " ".join(f"{c.span}:{c.steps}" for c in s.checked) for s in p.standings))
    return out


def short(peer: str) -> str:
    """A peer id shortened for tables: its last 8 characters (what differs between ids)."""
    return f"…{peer[-8:]}" if len(peer) > 9 else peer


def _pipeline_lines(pipelines: tuple[Pipeline, ...]) -> list[str]:
    if not pipelines:
        return ["(none)"]
    return [f"{i + 1}: " + " -> ".join(f"{short(s.node)} {s.span}" for s in p.stages) +
            f"  ({p.tokens_per_s:.1f} tok/s planned)" for i, p in enumerate(pipelines)]
