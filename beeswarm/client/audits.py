"""The entry's audit unit as a chat process builds it: who may audit whom (the coordinator's plan and the
membership), what the swarm knows was checked (the plan's standings), and the layers this machine loads to
check with (with `--audit-here`, or where no peer auditor could and they fit in half its free memory)."""
from __future__ import annotations

import logging
import threading

from beeswarm.audit.auditor import Auditor, entry_auditor
from beeswarm.audit.runner import Candidates
from beeswarm.coordinator.follower import PlanFollower
from beeswarm.p2p.membership import Membership
from beeswarm.p2p.node import Node
from beeswarm.protocol.spans import Span
from beeswarm.shard import benchmark
from beeswarm.shard.entry_model import EntryModel
from beeswarm.shard.span import SpanRuntime

log = logging.getLogger(__name__)


class EntryLayers:
    """Layers of the entry's model loaded here to check audits with, once each (the entry's dtype and device, the
    weights' format of the plan: the swarm's), only where they fit in half the memory free (the user's own work
    comes first): MemoryError otherwise."""

    def __init__(self, entry: EntryModel, plan: PlanFollower):
        self.entry, self.plan = entry, plan
        self._loaded: dict[tuple[Span, str], SpanRuntime] = {}
        self._lock = threading.Lock()

    def __call__(self, span: Span) -> SpanRuntime:
        weights = self.plan.state.quant
        with self._lock:
            if (span, weights) not in self._loaded:
                need = benchmark.layer_bytes(self.entry.config, self.entry.dtype, weights) * len(span)
                free = benchmark.free_bytes(self.entry.device)
                if need > free // 2:
                    raise MemoryError(f"layers {span} need {need / 2**20:.0f} MiB, {free / 2**20:.0f} MiB are free")
                log.info("loading layers %s (%s weights) to audit with", span, weights)
                self._loaded[span, weights] = SpanRuntime.load(self.entry.ref, span, self.entry.dtype,
                                                               self.entry.device, quant=weights)
            return self._loaded[span, weights]


def candidates(plan: PlanFollower, members: Membership, stage: str) -> Candidates:
    """Who may audit `stage`: the contributors of the coordinator's plan and membership, not excluded, with the
    spans they serve (active or loading next) and those serving none (spares). Neither the stage nor its route
    picks them."""
    state = plan.state
    excluded = {e.node for e in state.excluded}
    serving = {s.node: s.span for p in (*state.active, *state.target) for s in p.stages}
    contributors = [peer for peer, info in members.view().items()
                    if info.role == "contributor" and peer not in excluded and peer != stage]
    return Candidates(serving={p: serving[p] for p in contributors if p in serving},
                      spares=tuple(p for p in contributors if p not in serving))


def standing(plan: PlanFollower, stage: str) -> dict[int, int]:
    """Per layer, the steps the swarm knows `stage` was checked on (the plan's standings)."""
    return next((s.layers() for s in plan.state.standings if s.node == stage), {})


def entry_audits(node: Node, plan: PlanFollower, members: Membership, entry: EntryModel, rate: float,
                 here: bool = False) -> Auditor | None:
    """The auditor of an entry auditing `rate` of each stage's steps (None at 0); `here`: it checks every audit
    with layers it loads itself, not by peers."""
    if rate <= 0:
        return None
    layers = EntryLayers(entry, plan)
    return entry_auditor(node, rate, lambda stage: candidates(plan, members, stage), plan.leader,
                         lambda stage: standing(plan, stage), here=layers if here else None, last_resort=layers)
