"""A contributor's lifecycle: one phase, changed by one transition, which alone writes what the node announces.

The phase follows from a few facts (started, paused, the span loading, the span served, leaving, stopped),
kept together so no two threads can see them disagree: the plan listener (the node's loop), span loaders,
the dashboard's pause and resume, and leaving. Each event below is a method; all of them go through
`_move`, which derives the phase and puts it, the layers and the spans served in the heartbeat.
"""
from __future__ import annotations

import dataclasses
import enum
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from beeswarm.protocol.spans import Span


class Phase(enum.Enum):
    STARTING = "starting"  # benchmarking, joining: not in plans yet
    IDLE = "idle"  # up, no span
    LOADING = "loading"  # a span from the plan is loading (an older one, if any, keeps serving)
    SERVING = "serving"
    PAUSED = "paused"  # out of plans; a span kept finishes its sessions
    LEAVING = "leaving"
    STOPPED = "stopped"


# What peers read in the heartbeat (protocol.membership.State): a node starting up is "joining"; a stopped
# one says nothing more, so its last word stays "leaving".
ANNOUNCED = {Phase.STARTING: "joining", Phase.STOPPED: "leaving"}


@dataclass(frozen=True)
class Facts:
    started: bool = False  # node, membership, coordinator and prober are up
    paused: bool = False
    loading: Span | None = None
    span: Span | None = None  # the newest span loaded: the one the plan gave this node
    offload_fraction: float = 0.0  # of `span`'s weights, streamed from host memory
    spans: tuple[Span, ...] = ()  # every span the stage server still serves (older ones drain)
    leaving: bool = False
    stopped: bool = False

    @property
    def phase(self) -> Phase:
        if self.stopped:
            return Phase.STOPPED
        if self.leaving:
            return Phase.LEAVING
        if not self.started:
            return Phase.STARTING
        if self.paused:
            return Phase.PAUSED
        return Phase.LOADING if self.loading is not None else Phase.SERVING if self.span else Phase.IDLE


class Lifecycle:
    """Thread-safe. `announce(**fields)` puts fields in this node's heartbeat (`Membership.update`)."""

    def __init__(self, announce: Callable[..., Any]):
        self._announce = announce
        self._lock = threading.Lock()
        self._facts = Facts()

    @property
    def facts(self) -> Facts:
        return self._facts

    @property
    def phase(self) -> Phase:
        return self._facts.phase

    # events --------------------------------------------------------------------------------------------
    def started(self) -> None:
        self._move(started=True)

    def set_paused(self, paused: bool) -> bool:
        """Pause or resume; False (nothing changes) before start-up is over or once leaving."""
        with self._lock:
            if not self._facts.started or self._facts.leaving or self._facts.stopped:
                return False
            self._move_locked(paused=paused)
            return True

    def begin_load(self, span: Span) -> bool:
        """The plan gives this node `span`: True if it should be loaded now (not served, loading, paused or leaving)."""
        with self._lock:
            f = self._facts
            if span in (f.span, f.loading) or f.paused or f.leaving or f.stopped:
                return False
            self._move_locked(loading=span)
            return True

    def loaded(self, span: Span, offload_fraction: float, spans: tuple[Span, ...]) -> None:
        self._move(span=span, loading=None, offload_fraction=offload_fraction, spans=spans)

    def load_failed(self) -> None:
        self._move(loading=None)

    def serving_only(self, spans: tuple[Span, ...]) -> None:
        """The stage server now serves `spans` (the plan dropped the others); a dropped newest span is no more."""
        with self._lock:
            span = self._facts.span if self._facts.span in spans else None
            self._move_locked(spans=spans, span=span, offload_fraction=self._facts.offload_fraction if span else 0.0)

    def leave(self) -> None:
        self._move(leaving=True)

    def stopped(self) -> None:
        self._move(stopped=True)

    # the one transition --------------------------------------------------------------------------------
    def _move(self, **changes: Any) -> None:
        with self._lock:
            self._move_locked(**changes)

    def _move_locked(self, **changes: Any) -> None:
        before, after = self._facts, dataclasses.replace(self._facts, **changes)
        self._facts = after
        said = _heartbeat(after)
        if said != _heartbeat(before):
            self._announce(**said)


def _heartbeat(facts: Facts) -> dict[str, Any]:
    """The heartbeat fields a node in this state announces."""
    return {"state": ANNOUNCED.get(facts.phase, facts.phase.value), "layers": facts.span, "spans": facts.spans}
