"""The coordinator's messages (`ids.COORDINATOR_TOPIC`): lease heartbeats and signed plans.

A plan assigns each node a span: `active` pipelines are what clients route over, `target` what
nodes load next (make-before-break). It travels signed: `SignedPlan.body` is the encoded `PlanState`.
"""
from __future__ import annotations

from typing import Annotated

import msgspec

from beeswarm.protocol.encoding import Message
from beeswarm.protocol.membership import Short
from beeswarm.protocol.session import PeerId
from beeswarm.protocol.spans import Span

MAX_STAGES = 256
MAX_PIPELINES = 16


class LeaseBeat(Message, frozen=True, tag="lease"):
    term: Annotated[int, msgspec.Meta(ge=0)]
    epoch: Annotated[int, msgspec.Meta(ge=0)]


class Stage(msgspec.Struct, frozen=True, kw_only=True):
    node: PeerId
    span: Span
    offload_fraction: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0


class Pipeline(msgspec.Struct, frozen=True, kw_only=True):
    stages: Annotated[tuple[Stage, ...], msgspec.Meta(min_length=1, max_length=MAX_STAGES)]
    micro_batches: Annotated[int, msgspec.Meta(ge=1)] = 1
    step_ms: float = 0.0
    tokens_per_s: float = 0.0


class Exclusion(msgspec.Struct, frozen=True):
    """A node the plan leaves out, and why. `until` (unix seconds) marks a sentence, not a planning
    figure: the coordinator upheld evidence against it (a failed audit, or a false accusation), and every
    coordinator after it keeps it out until then."""

    node: PeerId
    reason: Annotated[str, msgspec.Meta(max_length=500)]
    until: float = 0.0


Pipelines = Annotated[tuple[Pipeline, ...], msgspec.Meta(max_length=MAX_PIPELINES)]
MAX_STANDINGS = 256


MAX_RUNS = 16  # runs of layers a standing lists (a stage's layers beyond count as never checked)


class Checked(msgspec.Struct, frozen=True, array_like=True):
    """Layers `span` of a stage were each checked on `steps` steps."""

    span: Span
    steps: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)]


class Standing(msgspec.Struct, frozen=True, array_like=True):
    """What the swarm knows of a stage's honesty: the steps each of its layers was checked on (`audit.probation`),
    as runs of layers."""

    node: PeerId
    checked: Annotated[tuple[Checked, ...], msgspec.Meta(max_length=MAX_RUNS)]

    def layers(self) -> dict[int, int]:
        return {layer: c.steps for c in self.checked for layer in range(c.span.start, c.span.end)}

    def least(self, span: Span) -> int:
        """The steps every layer of `span` was checked on."""
        layers = self.layers()
        return min(layers.get(layer, 0) for layer in range(span.start, span.end))


class PlanState(msgspec.Struct, frozen=True, kw_only=True):
    """What followers act on: nodes load `target` spans; clients route over `active` pipelines."""

    term: int = 0
    epoch: int = 0
    coordinator: PeerId = ""
    objective: str = "latency"
    quant: Short = "none"  # the Quant every stage of the plan serves (audits replay in it too); str on the wire
    model: Annotated[str, msgspec.Meta(max_length=512)] = ""  # the model served, as its coordinator names it
    fingerprint: Short = ""  # of the model's config: an entry holding another model refuses to start
    active: Pipelines = ()
    target: Pipelines = ()
    excluded: Annotated[tuple[Exclusion, ...], msgspec.Meta(max_length=MAX_STAGES)] = ()
    standings: Annotated[tuple[Standing, ...], msgspec.Meta(max_length=MAX_STANDINGS)] = ()

    def migrating(self) -> bool:
        return assignments(self.target) != assignments(self.active)


class SignedPlan(Message, frozen=True, tag="plan"):
    body: Annotated[bytes, msgspec.Meta(max_length=60_000)]  # an encoded PlanState
    sig: Annotated[bytes, msgspec.Meta(max_length=128)]


class PlanRequest(Message, frozen=True, tag="plan_request"):
    """Ask the coordinator for its current signed plan (`ids.PLAN`): for a node whose lease beats show an
    epoch newer than the plan it holds, because gossip dropped the plan on its way."""


def assignments(pipelines: tuple[Pipeline, ...]) -> dict[str, Span]:
    """node -> the span it serves in `pipelines` (one per node: pipelines are disjoint)."""
    return {s.node: s.span for p in pipelines for s in p.stages}


def stages_of(pipelines: tuple[Pipeline, ...], node: str) -> list[Stage]:
    return [s for p in pipelines for s in p.stages if s.node == node]
