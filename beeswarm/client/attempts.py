"""One generation through the swarm across its attempts: what was asked (`Request`), what it has so far
(`Progress`: the tokens that stand, the routes taken, what settled), how each attempt ended (`Outcome`), and
the wait while every route's stages are full (`Backoff`). `client.swarm` runs the attempts."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from beeswarm.client.dataplane import Route, StageBusy, StageFailed
from beeswarm.generation.generate import Generation
from beeswarm.generation.sampling import Noise, SamplingParams, new_noise
from beeswarm.spec.speculate import SpecReport

log = logging.getLogger(__name__)
BUSY_BACKOFF_S = (0.1, 2.0)  # first wait and cap while every route's stages are full


@dataclass
class SwarmGeneration:
    generation: Generation
    route: Route
    recoveries: int
    wire_bytes: int  # this generation's, on every route it took
    raw_bytes: int
    routes: list[Route] = field(default_factory=list)
    spec: SpecReport | None = None


@dataclass(frozen=True)
class Request:
    """What a generation was asked for: the same for each of its attempts."""
    prompt_ids: list[int]
    max_new_tokens: int
    params: SamplingParams
    stop_ids: Iterable[int]
    speculate: bool  # with the client's draft (taken for this generation)
    route_timeout: float
    on_token: Callable[[int], None] | None = None
    on_rewind: Callable[[int], None] | None = None
    on_settled: Callable[[int], None] | None = None


@dataclass
class Progress:
    """A generation across its attempts: the tokens that stand, the sampling noise, the routes taken and
    how many tokens there were when each was, its sessions, bytes, recoveries and times."""
    request: Request
    noise: Noise | None  # keyed by position: every attempt draws what the generation alone would have
    report: SpecReport | None
    tokens: list[int] = field(default_factory=list)
    routes: list[Route] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # tokens there were when each route was taken
    sessions: list[str] = field(default_factory=list)
    wire: int = 0  # bytes on every route it took
    raw: int = 0
    recoveries: int = 0
    stalls: int = 0  # failures since the last new token (a generation gives up after MAX_RECOVERIES of them)
    t0: float = field(default_factory=time.perf_counter)
    ttft: float | None = None
    held: bool = False  # a route so far had a stage on probation: its tokens are final once its audits settle
    settled: int = 0  # tokens `on_settled` was told are final
    last: float = field(init=False)  # the last token's time: closing the sessions after it is not generation time

    def __post_init__(self) -> None:
        self.last = self.t0

    @classmethod
    def start(cls, request: Request) -> Progress:
        return cls(request, new_noise(request.params), SpecReport() if request.speculate else None)

    def take(self, route: Route) -> None:
        self.routes.append(route)
        self.starts.append(len(self.tokens))

    def emit(self, token: int) -> None:
        self.last = time.perf_counter()
        if self.ttft is None:
            self.ttft = self.last - self.t0
        self.tokens.append(token)
        self.stalls = 0
        if self.request.on_token:
            self.request.on_token(token)
        if not self.held:
            self.settle()

    def settle(self) -> None:
        """Every token so far is final: no audit of a stage on probation can take it back."""
        self.held = False
        if self.settled < len(self.tokens):
            self.settled = len(self.tokens)
            if self.request.on_settled:
                self.request.on_settled(self.settled)

    def trusted(self, caught: AbstractSet[str]) -> int:
        """The tokens there were before the first route through a caught stage (all of them if none)."""
        return next((n for r, n in zip(self.routes, self.starts) if any(s.node in caught for s in r)),
                    len(self.tokens))

    def rewind(self, keep: int, caught: AbstractSet[str]) -> None:
        """Take back every token after the first `keep` (computed through `caught`)."""
        if keep < len(self.tokens):
            log.warning("taking back %d tokens computed through %s", len(self.tokens) - keep, ", ".join(caught))
            del self.tokens[keep:]
            self.settled = min(self.settled, keep)
            if self.request.on_rewind:
                self.request.on_rewind(keep)

    def finished(self) -> bool:
        tokens = self.tokens
        return bool(tokens) and tokens[-1] in set(self.request.stop_ids) or len(tokens) >= self.request.max_new_tokens

    def result(self) -> SwarmGeneration:
        gen = Generation(self.tokens, len(self.request.prompt_ids), self.ttft or 0.0, self.last - self.t0)
        return SwarmGeneration(gen, self.routes[-1], self.recoveries, self.wire, self.raw, self.routes, self.report)


@dataclass(frozen=True)
class Done:
    """The route answered until the request was met (or the caller ended it), and no audit caught a stage."""


@dataclass(frozen=True)
class Busy:
    """A stage had no room for the session: wait for room (up to the route timeout), ban nobody."""
    error: StageBusy


@dataclass(frozen=True)
class Failed:
    """A stage (`error.peer`, and why) timed out, went away or returned an error: ban it, take another route."""
    error: StageFailed


@dataclass(frozen=True)
class Caught:
    """The audits caught `stages` on a route this generation took: only its first `keep` tokens stand."""
    stages: AbstractSet[str]
    keep: int


Outcome = Done | Busy | Failed | Caught


@dataclass
class Backoff:
    """Waits while a route's stages are full: doubling from BUSY_BACKOFF_S[0] to its cap, until `timeout`
    after the first full stage."""
    timeout: float
    wait_s: float = BUSY_BACKOFF_S[0]
    until: float | None = None

    def wait(self, busy: StageBusy) -> None:
        """Sleep before the next attempt, or raise `busy` when the next would come past the deadline."""
        self.until = self.until or time.monotonic() + self.timeout
        if time.monotonic() + self.wait_s > self.until:
            raise busy
        log.info("%s; trying again in %.1f s", busy, self.wait_s)
        time.sleep(self.wait_s)
        self.wait_s = min(2 * self.wait_s, BUSY_BACKOFF_S[1])
