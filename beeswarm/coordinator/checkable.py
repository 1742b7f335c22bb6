"""Which stages of a plan nobody could check while they are on probation. Pure: no torch, no networking.

A stage's audit goes by pieces when nobody holds its whole span (`audit.pieces`): a layer is checked by a member
serving it, else by any member with room to load one layer. The room is judged by `room_for`, as a contributor's
auditor judges it (`contributor.audit_layers`): a piece must fit in half of what its memory offer leaves beside the
layers it holds. A stage on probation with a layer that no other member serves, on a plan where nobody has that
room, would have every session taken back by its entries (an unchecked audit is no pass): the coordinator plans
without it where it can (`Coordinator.plan_epoch`).

Such a stage is in every pipeline of its plan (a pipeline without it covers every layer) and every other member is
in its pipeline with under two layers to spare, so a plan without it is rare; where there is none, it stays on the
plan and entries with room of their own check it (the last resort) or route around it.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from beeswarm.coordinator.cluster import Cluster
from beeswarm.protocol.coordinator import Pipeline
from beeswarm.protocol.spans import Span


def room_for(layers: int, mem_bytes: int, layers_held: int, layer_bytes: int) -> bool:
    """A member offering `mem_bytes` and holding `layers_held` layers has room to load `layers` more to check a
    piece with: half of what its offer leaves (the contributor's auditor judges by this, `contributor.audit_layers`)."""
    return layers * layer_bytes <= max(0, mem_bytes - layers_held * layer_bytes) // 2


def unchecked_on_probation(cluster: Cluster, pipelines: Iterable[Pipeline],
                           on_probation: Callable[[str, Span], bool]) -> dict[str, str]:
    """The stages of `pipelines` on probation that no other member of `cluster` could check, with why."""
    serving: dict[str, Span] = {s.node: s.span for p in pipelines for s in p.stages}
    layer_bytes = cluster.model.layer_bytes
    roomy = {n.id for n in cluster.nodes
             if room_for(1, n.mem_bytes, len(serving[n.id]) if n.id in serving else 0, layer_bytes)}
    out: dict[str, str] = {}
    for node, span in serving.items():
        if roomy - {node} or not on_probation(node, span):
            continue
        others = {layer for other, s in serving.items() if other != node for layer in range(s.start, s.end)}
        alone = [layer for layer in range(span.start, span.end) if layer not in others]
        if alone:
            shown = ", ".join(map(str, alone[:8])) + (", ..." if len(alone) > 8 else "")
            out[node] = f"on probation, and no other member serves its layer{'s' if len(alone) > 1 else ''} " \
                        f"{shown} or has room to check {'them' if len(alone) > 1 else 'it'}"
    return out
