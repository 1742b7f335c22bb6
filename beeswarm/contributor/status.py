"""What a contributor shows about itself: start-up progress and a snapshot of its state, as plain data.

The dashboard renders these; `Contributor.status()` fills them. No networking or torch here.
"""
from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from beeswarm.protocol.spans import Span


@dataclass(frozen=True)
class Event:
    """Something a contributor reports: `text` for people, `json()` for a process that reads its output."""

    kind: str  # peer | addr | serving | paused | resumed | rebenched | served (at the end: steps and passes)
    text: str
    fields: dict[str, Any] = field(default_factory=dict)

    def json(self) -> str:
        return json.dumps({"event": self.kind, **self.fields})


@dataclass(frozen=True)
class Progress:
    """One phase's progress bar: the benchmark, a link probe, a file download, the span's loading."""

    key: str  # "bench", "probe <peer>", "download <file>", "load"
    label: str
    done: float = 0.0
    total: float | None = None  # None: not known yet
    unit: str = ""  # "B": bytes, shown with a rate
    started: float = field(default_factory=time.monotonic)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.error is not None or (self.total is not None and self.done >= self.total)

    @property
    def rate(self) -> float | None:
        """Units per second since the phase started."""
        elapsed = time.monotonic() - self.started
        return self.done / elapsed if self.done and elapsed > 0 else None


@dataclass(frozen=True)
class PeerRow:
    peer: str
    role: str
    layers: Span | None
    device: str
    tokens_per_s: float  # what the peer served lately (from its heartbeat)
    rtt_ms: float | None  # measured from this node (None: not probed yet)
    up_mbps: float | None
    state: str
    me: bool = False
    reach: str = "unknown"


@dataclass(frozen=True)
class ShardFigures:
    layers: Span | None
    offload_fraction: float
    memory_budget: int  # bytes this node offers
    memory_used: int  # resident weights + KV caches allocated


@dataclass(frozen=True)
class ServingFigures:
    sessions: int = 0
    steps: int = 0
    tokens: int = 0
    tokens_per_s: float = 0.0  # over the last few seconds
    history: tuple[float, ...] = ()  # tokens/s once a second, oldest first (for a sparkline)
    raw_in: int = 0
    wire_in: int = 0
    raw_out: int = 0
    wire_out: int = 0
    reveals: int = 0  # audits of this stage it answered
    kept_bytes: int = 0  # steps kept for audits' reveals
    excluded: str = ""  # why the coordinator keeps this node out of plans (evidence against it), if it does
    credit: int | None = None  # its balance in the swarm's ledger, layer-tokens (None: no account yet)
    receipts: int = 0  # receipts entries gave it
    receipts_waiting: int = 0  # of them, not handed in to a coordinator yet

    @property
    def compression_ratio(self) -> float:
        wire = self.wire_in + self.wire_out
        return (self.raw_in + self.raw_out) / wire if wire else 1.0


@dataclass(frozen=True)
class ContributorStatus:
    peer: str
    swarm: str
    model: str
    private: bool
    state: str  # starting | idle | loading | serving | paused | leaving | stopped
    coordinator: str | None = None
    term: int = 0
    epoch: int = 0
    addrs: tuple[str, ...] = ()
    peers: tuple[PeerRow, ...] = ()
    shard: ShardFigures | None = None
    serving: ServingFigures = ServingFigures()
    progress: tuple[Progress, ...] = ()


HISTORY = 120  # seconds of tokens/s kept


class ServingMeter:
    """What a stage served, sampled about once a second: tokens/s (the last HISTORY samples kept) and the share of the
    time it computed."""

    def __init__(self) -> None:
        self._tokens, self._compute = RateMeter(), RateMeter()
        self.history: deque[float] = deque(maxlen=HISTORY)
        self.busy = 0.0

    def sample(self, tokens: int, compute_s: float, now: float | None = None) -> None:
        self.history.append(self._tokens.add(tokens, now))
        self.busy = min(1.0, self._compute.add(compute_s, now))

    @property
    def load(self) -> float:
        """Tokens/s now."""
        return self.history[-1] if self.history else 0.0


class RateMeter:
    """A counter's rate (tokens per second, compute seconds per second) over a sliding window of samples."""

    def __init__(self, window_s: float = 5.0):
        self.window_s = window_s
        self._samples: list[tuple[float, float]] = []

    def add(self, count: float, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        self._samples.append((now, count))
        while len(self._samples) > 2 and self._samples[1][0] < now - self.window_s:
            self._samples.pop(0)
        (t0, c0), (t1, c1) = self._samples[0], self._samples[-1]
        return (c1 - c0) / (t1 - t0) if t1 > t0 else 0.0
