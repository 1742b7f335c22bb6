"""The swarm at a glance, as plain data: members, layer coverage and replicas, the coordinator and plans.

`beeswarm status` fills a `StatusReport` from what a client hears on the mesh (the membership view
with each member's last heartbeat, the followed plan, the coordinator's lease) and prints it as JSON
or as a table (`commands/status.py` renders it). Pure: no networking, no torch.
"""
from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from beeswarm.protocol.coordinator import Pipeline, PlanState, assignments
from beeswarm.protocol.credits import Balance, LedgerState
from beeswarm.protocol.membership import NodeInfo
from beeswarm.protocol.spans import Span

NOT_SERVING = ("leaving", "paused")  # a paused node keeps its span for the sessions it has, but leaves the plans


@dataclass(frozen=True)
class MemberRow:
    peer: str
    role: str
    state: str
    spans: tuple[Span, ...]  # every span it announces (two while migrating)
    device: str
    tokens_per_s: float  # served lately, from its heartbeat
    busy: float  # share of the last seconds its layers computed
    heartbeat_age_s: float  # since its last heartbeat reached us
    version: str
    coordinator: bool = False
    reach: str = "unknown"  # public (others dial it), private (behind a NAT: through a relay), unknown
    addrs: tuple[str, ...] = ()  # where it is dialled (relayed ones through .../p2p-circuit/...)
    credit: Balance | None = None  # its account in the swarm's credit ledger (None: none)


@dataclass(frozen=True)
class Segment:
    """Consecutive layers served by the same members (`replicas` of them; none: a gap)."""

    span: Span
    nodes: tuple[str, ...]

    @property
    def replicas(self) -> int:
        return len(self.nodes)


@dataclass(frozen=True)
class StatusReport:
    members: tuple[MemberRow, ...]
    num_layers: int  # from the plan, else the highest layer announced (0: unknown)
    segments: tuple[Segment, ...]  # cover [0, num_layers) in order
    coordinator: str | None  # the lease holder heard from, else the plan's author
    term: int
    epoch: int
    plan: PlanState | None  # None: no plan heard

    @property
    def coverage(self) -> tuple[int, ...]:
        """Replicas of each layer."""
        return tuple(s.replicas for s in self.segments for _ in range(len(s.span)))

    @property
    def gaps(self) -> tuple[Span, ...]:
        return tuple(s.span for s in self.segments if not s.nodes)

    @property
    def complete(self) -> bool:
        """Every layer has at least one member serving it."""
        return self.num_layers > 0 and not self.gaps

    def as_json(self) -> dict[str, Any]:
        return {
            "members": [{"peer": m.peer, "role": m.role, "state": m.state, "reach": m.reach, "addrs": list(m.addrs),
                         "spans": [[s.start, s.end] for s in m.spans], "device": m.device,
                         "tokens_per_s": round(m.tokens_per_s, 2), "busy": m.busy,
                         "heartbeat_age_s": round(m.heartbeat_age_s, 2),
                         "version": m.version, "coordinator": m.coordinator, "credits": _credit_json(m.credit)}
                        for m in self.members],
            "num_layers": self.num_layers,
            "coverage": list(self.coverage),
            "spans": [{"start": s.span.start, "end": s.span.end, "replicas": s.replicas, "nodes": list(s.nodes)}
                      for s in self.segments],
            "gaps": [{"start": g.start, "end": g.end} for g in self.gaps],
            "complete": self.complete,
            "coordinator": self.coordinator, "term": self.term, "epoch": self.epoch,
            "plan": None if self.plan is None else {
                "term": self.plan.term, "epoch": self.plan.epoch, "coordinator": self.plan.coordinator,
                "objective": self.plan.objective, "quant": self.plan.quant, "migrating": self.plan.migrating(),
                "active": [_pipeline_json(p) for p in self.plan.active],
                "target": [_pipeline_json(p) for p in self.plan.target],
                "excluded": [{"node": e.node, "reason": e.reason, "until": e.until or None}
                             for e in self.plan.excluded],
                "standings": {s.node: [[c.span.start, c.span.end, c.steps] for c in s.checked]
                              for s in self.plan.standings}},
        }


def _credit_json(b: Balance | None) -> dict[str, Any] | None:
    if b is None:
        return None
    return {"balance": b.balance, "earned": b.earned, "spent": b.spent, "forfeited": b.forfeited,
            "last_hour": {"earned": b.hour[0], "spent": b.hour[1]}, "last_day": {"earned": b.day[0], "spent": b.day[1]}}


def _pipeline_json(p: Pipeline) -> dict[str, Any]:
    return {"stages": [{"node": s.node, "start": s.span.start, "end": s.span.end,
                        "offload_fraction": s.offload_fraction} for s in p.stages],
            "micro_batches": p.micro_batches, "step_ms": p.step_ms, "tokens_per_s": p.tokens_per_s}


def _segments(num_layers: int, serving: Mapping[str, tuple[Span, ...]]) -> tuple[Segment, ...]:
    """[0, num_layers) cut where the set of members serving a layer changes."""
    holders = [tuple(sorted(peer for peer, spans in serving.items() if any(s.start <= layer < s.end for s in spans)))
               for layer in range(num_layers)]
    out, start = [], 0
    for nodes, run in itertools.groupby(holders):
        length = len(list(run))
        out.append(Segment(Span(start, start + length), nodes))
        start += length
    return tuple(out)


def report(view: Mapping[str, NodeInfo], heartbeat_ages: Mapping[str, float], plan: PlanState | None = None,
           coordinator: str | None = None, term: int = 0, epoch: int = 0,
           ledger: LedgerState | None = None, num_layers: int = 0) -> StatusReport:
    """The report from a membership view, each member's seconds since its last heartbeat, the plan
    followed (None or an empty `PlanState`: none heard), the coordinator's lease (`coordinator`,
    `term`, `epoch`; None: none heard, the plan's author then stands in), the credit ledger followed and the
    model's layers as earlier plans showed them (`num_layers`, 0: unknown).

    Coverage counts what members announce serving (contributors not leaving or paused), not what the
    plan assigns: a planned node that has not loaded its span yet leaves a gap."""
    if plan is not None and not plan.coordinator:
        plan = None
    if coordinator is None and plan is not None:
        coordinator, term, epoch = plan.coordinator, plan.term, plan.epoch
    serving = {peer: info.spans or ((info.layers,) if info.layers else ())
               for peer, info in view.items() if info.role == "contributor" and info.state not in NOT_SERVING}
    planned = list(assignments(plan.active).values()) + list(assignments(plan.target).values()) if plan else []
    announced = [s for spans in serving.values() for s in spans]
    # at least the layers an earlier plan showed: after a loss no complete plan may be left, and the spans still
    # announced can end short of the model's last layer
    num_layers = max([num_layers, *(s.end for s in planned or announced)])
    credits = {b.node: b for b in ledger.balances} if ledger else {}
    members = tuple(MemberRow(peer=peer, role=info.role, state=info.state,
                              spans=info.spans or ((info.layers,) if info.layers else ()), device=info.device,
                              tokens_per_s=info.load, busy=info.busy,
                              heartbeat_age_s=max(0.0, heartbeat_ages.get(peer, 0.0)),
                              version=info.version, coordinator=peer == coordinator, reach=info.reach,
                              addrs=info.addrs, credit=credits.get(peer))
                    for peer, info in sorted(view.items(), key=lambda kv: _order(kv[1])))
    return StatusReport(members, num_layers, _segments(num_layers, serving), coordinator, term, epoch, plan)


def _order(info: NodeInfo) -> tuple[int, int, str]:
    """Contributors first, by the first layer they serve; then clients."""
    first = min((s.start for s in info.spans), default=info.layers.start if info.layers else 1 << 30)
    return (info.role != "contributor", first, info.peer)
