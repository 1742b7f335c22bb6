"""Choose the draft tree for the next round: depth K and per-depth widths, from measured figures.

A round costs `K * draft_level_s + fixed_s + per_token_s * tokens`: the draft's K levels, the
target pass around the ring (compute + one-way latencies, `C + T_ring`), and what each extra token
in the step adds (compute and transfer on every hop). It commits `1 + sum_k prod_{d<=k} hit_d(w_d)`
tokens on average, where `hit_d(w)` is the chance the target's token is among `w` candidates at
depth d, from running acceptance counts. The tuner maximises tokens per second. With every width 1
this is the closed form `(1 - a^(K+1)) / (1 - a) / (K*c_d + C + T_ring)`.

Pipelined speculation (`Tuner.plan`) keeps up to D steps in flight: while one crosses the ring, the
next hangs small trees under the likeliest places below those before it (leaves, or one more
candidate at a node not judged yet). A step whose places the walk reaches is followed one step time
Delta later instead of a ring later; one it does not reach costs a fresh round. A two-state chain
(fresh, continuing) gives the rate in closed form (`Rates.rate`): with c_f and c_c the chances that the
walk reaches a place the next step extends (from a fresh tree, from a continuation), the stationary
shares are pi_F = (1 - c_c) / (1 - c_c + c_f) and pi_C = 1 - pi_F, and

    rate = (pi_F (E_F - c_f) + pi_C (E_C - c_c)) / (pi_F T_F + pi_C Delta),  Delta = max(t_draft, T_C / D)

(a reached place's token is the next step's to verify, so it leaves the round's count). D = 1 gives the
serial rate E_F / T_F.

Pure: no torch, no networking.
"""
from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

MAX_DEPTH = 32
MAX_WIDTH = 4
MAX_TREE_NODES = 64
MAX_IN_FLIGHT = 8  # pipelined steps around the ring at once
RETRY_PIPELINED = 30  # serial plans in a row before a pipelined one is tried again
MEASURED_TRIALS = 32  # candidates judged before a pipelined plan is weighed
# Rounds shorter than this stay serial: the entry's drafting and bookkeeping for each step in flight, and
# the stages' share of two cores, ate the gain at every shorter ring in spec_bench's sweep.
MIN_RING_S = 0.2
EXPLORE = 1.05  # a pipelined plan is tried when its closed form beats serial rounds by this
HANGS = (1, 2, 4, 8)  # places (leaves, new candidates) a continuation step extends
# Acceptance before any round is measured: a draft paired with its target usually agrees about half
# the time; later candidates at a node are accepted far less often than the first.
PRIOR_FIRST, PRIOR_LATER, PRIOR_WEIGHT = 0.5, 0.15, 2.0


@dataclass(frozen=True)
class TreeShape:
    """Depth K and the number of children each node at depth d gets (widths[d-1]); all 1: a chain."""

    widths: tuple[int, ...]
    max_nodes: int = MAX_TREE_NODES
    min_path_prob: float = 0.0  # nodes less likely than this (under the draft) are not expanded

    def __post_init__(self) -> None:
        if not 1 <= len(self.widths) <= MAX_DEPTH or any(not 1 <= w <= MAX_WIDTH for w in self.widths):
            raise ValueError(f"tree shape: depth 1..{MAX_DEPTH} and widths 1..{MAX_WIDTH}, got {list(self.widths)}")

    @property
    def depth(self) -> int:
        return len(self.widths)

    @property
    def full_nodes(self) -> int:
        total, level = 0, 1
        for w in self.widths:
            level *= w
            total += level
        return total

    @property
    def nodes(self) -> int:
        """Nodes the tree may have: the full tree, capped at max_nodes."""
        return min(self.full_nodes, self.max_nodes)


@dataclass
class AcceptanceStats:
    """Running counts per (depth, candidate index): how often the i-th candidate at depth d was accepted."""

    tried: dict[tuple[int, int], float] = field(default_factory=dict)
    accepted: dict[tuple[int, int], float] = field(default_factory=dict)
    constant: float | None = None  # a fixed acceptance for every depth and candidate (the closed form)

    def record(self, depth: int, candidate: int, accepted: bool) -> None:
        key = (depth, candidate)
        self.tried[key] = self.tried.get(key, 0.0) + 1
        self.accepted[key] = self.accepted.get(key, 0.0) + accepted

    def rate(self, depth: int, candidate: int, pooled: float | None = None) -> float:
        if self.constant is not None:
            return self.constant if candidate == 0 else 0.0
        # Shrink each depth's estimate towards the same candidate index at every depth.
        pooled = self.pooled(candidate) if pooled is None else pooled
        n, k = self.tried.get((depth, candidate), 0.0), self.accepted.get((depth, candidate), 0.0)
        return (k + PRIOR_WEIGHT * pooled) / (n + PRIOR_WEIGHT)

    def pooled(self, candidate: int) -> float:
        n = sum(n for (_, i), n in self.tried.items() if i == candidate)
        k = sum(k for (_, i), k in self.accepted.items() if i == candidate)
        prior = PRIOR_FIRST if candidate == 0 else PRIOR_LATER
        return (k + PRIOR_WEIGHT * prior) / (n + PRIOR_WEIGHT)

    def hits(self) -> list[list[float]]:
        """[d - 1][w - 1]: the chance one of w candidates at depth d is accepted, given the path reached
        depth d - 1 (candidates missing independently)."""
        pooled = [self.pooled(i) for i in range(MAX_WIDTH)]
        rates = [[self.rate(d, i, pooled[i]) for i in range(MAX_WIDTH)] for d in range(1, MAX_DEPTH + 1)]
        table = []
        for row in rates:
            miss, out = 1.0, []
            for r in row:
                miss *= 1.0 - r
                out.append(1.0 - miss)
            table.append(out)
        return table

    def by_depth(self) -> list[float]:
        """Measured acceptance of the path at each depth (any candidate), for reports."""
        out = []
        for d in range(1, MAX_DEPTH + 1):
            reached = self.tried.get((d, 0), 0.0)
            if not reached:
                break
            out.append(round(sum(k for (dd, _), k in self.accepted.items() if dd == d) / reached, 4))
        return out


@dataclass
class RoundCosts:
    """Seconds: one draft level, the ring's fixed part (C + T_ring), and each token a step carries."""

    draft_level_s: float = 0.002
    fixed_s: float = 0.05
    per_token_s: float = 0.0


def expected_tokens(shape: TreeShape, stats: AcceptanceStats, hits: list[list[float]] | None = None) -> float:
    """Tokens a round commits on average: the accepted path plus the target's own next token."""
    hits = hits or stats.hits()
    total, reach = 1.0, 1.0
    for d, w in enumerate(shape.widths):
        reach *= hits[d][w - 1]
        total += reach
    return total


def round_seconds(shape: TreeShape, costs: RoundCosts, pending: int = 1) -> float:
    return shape.depth * costs.draft_level_s + costs.fixed_s + costs.per_token_s * (pending + shape.nodes)


def rate(shape: TreeShape, stats: AcceptanceStats, costs: RoundCosts, hits: list[list[float]] | None = None) -> float:
    return expected_tokens(shape, stats, hits) / round_seconds(shape, costs)


def candidate_shapes(depth: int | None = None, width: int | None = None,
                     max_nodes: int = MAX_TREE_NODES) -> Iterator[TreeShape]:
    """Shapes the tuner considers: width w for the first j depths, then a chain (full trees grow fast)."""
    for k in [depth] if depth else range(1, MAX_DEPTH + 1):
        widths = [width] if width else range(1, MAX_WIDTH + 1)
        for w in widths:
            for j in ([k] if width or w == 1 else range(1, min(k, 4) + 1)):
                shape = TreeShape((w,) * j + (1,) * (k - j), max_nodes)
                if shape.full_nodes <= max_nodes or width:
                    yield shape


class Rates:
    """Expected tokens, leaf reach and rates of shapes under one snapshot of the statistics (cached: a plan
    weighs a few hundred combinations)."""

    def __init__(self, stats: AcceptanceStats, costs: RoundCosts):
        self.stats, self.costs, self.hits = stats, costs, stats.hits()
        self._probs: dict[tuple[int, int], list[float]] = {}
        self._reach: dict[tuple[tuple[int, ...], int], float] = {}
        self._tokens: dict[tuple[int, ...], float] = {}

    def tokens(self, shape: TreeShape) -> float:
        if shape.widths not in self._tokens:
            self._tokens[shape.widths] = expected_tokens(shape, self.stats, self.hits)
        return self._tokens[shape.widths]

    def probs(self, depth: int, width: int) -> list[float]:
        """The chance the target's token is exactly each of `width` candidates at `depth`, likeliest first."""
        key = (depth, width)
        if key not in self._probs:
            out, miss = [], 1.0
            for i in range(width):
                r = self.stats.rate(depth, i)
                out.append(miss * r)
                miss *= 1.0 - r
            self._probs[key] = sorted(out, reverse=True)
        return self._probs[key]

    def reach(self, shape: TreeShape, top: int) -> float:
        """The chance the walk reaches one of the `top` likeliest full-depth leaves of `shape`."""
        key = (shape.widths, top)
        if key not in self._reach:
            levels = [self.probs(d, w) for d, w in enumerate(shape.widths, start=1)]
            # the `top` largest products of one factor per level, best-first
            best: list[float] = []
            heap = [(-math.prod(level[0] for level in levels), (0,) * len(levels))]
            seen = {heap[0][1]}
            while heap and len(best) < top:
                neg, idx = heapq.heappop(heap)
                best.append(-neg)
                for d in range(len(levels)):
                    nxt = idx[:d] + (idx[d] + 1,) + idx[d + 1:]
                    if nxt[d] < len(levels[d]) and nxt not in seen:
                        seen.add(nxt)
                        heapq.heappush(heap, (-math.prod(levels[k][i] for k, i in enumerate(nxt)), nxt))
            self._reach[key] = sum(best)
        return self._reach[key]

    def rate(self, fresh: TreeShape, more: TreeShape, hangs: int, depth: int) -> float:
        """Tokens per second in the steady state (the module's closed form); depth 1: serial rounds."""
        t_fresh, e_fresh = round_seconds(fresh, self.costs), self.tokens(fresh)
        if depth <= 1:
            return e_fresh / t_fresh
        t_more, t_draft = continuation_seconds(more, hangs, self.costs)
        delta = max(t_draft, t_more / depth)
        # The walk is a ring behind the drafting: the frontier the `hangs` extend spans the subtrees of every
        # step in flight, so the one the walk will take gets about a share of them.
        shared = max(1, round(hangs / min(depth, math.ceil(t_more / delta))))
        c_f, c_c = self.reach(fresh, hangs), self.reach(more, shared)
        pi_f = (1 - c_c) / (1 - c_c + c_f)
        pi_c = 1 - pi_f
        e_more = self.tokens(more)
        return (pi_f * (e_fresh - c_f) + pi_c * (e_more - c_c)) / (pi_f * t_fresh + pi_c * delta)


@dataclass(frozen=True)
class Plan:
    """How speculation runs: `depth` steps in flight (1: serial rounds), each fresh round a `fresh` tree,
    each continuation `more` trees hung under the `hangs` likeliest leaves; `rate` the predicted tokens/s."""

    depth: int
    fresh: TreeShape
    more: TreeShape
    hangs: int
    rate: float
    serial_rate: float
    model_rate: float = 0.0  # the closed form's, before `Tuner.pipelined_scale`

    def as_json(self) -> dict[str, object]:
        return {"in_flight": self.depth, "fresh": list(self.fresh.widths), "more": list(self.more.widths),
                "hangs": self.hangs, "rate": round(self.rate, 3), "serial_rate": round(self.serial_rate, 3)}


def continuation_seconds(more: TreeShape, hangs: int, costs: RoundCosts) -> tuple[float, float]:
    """A continuation step's time around the ring, and the least time between two of them (its draft: the
    paths to its places and then `more.depth` levels, each one step for all places; and its tokens' share
    of the links)."""
    tokens = hangs * more.nodes
    t_draft = (more.depth + 1) * costs.draft_level_s + costs.per_token_s * tokens
    return costs.fixed_s + costs.per_token_s * tokens, t_draft


def continuation_shapes(max_nodes: int) -> Iterator[TreeShape]:
    """Small trees a continuation hangs under a leaf: chains, or w candidates first then a chain."""
    for k in range(1, 13):
        for w, j in itertools.chain([(1, k)], ((w, j) for w in range(2, MAX_WIDTH + 1) for j in (1, 2) if j <= k)):
            shape = TreeShape((w,) * j + (1,) * (k - j), max_nodes)
            if shape.full_nodes <= max_nodes:
                yield shape


CONTINUATIONS = {hangs: tuple(continuation_shapes(MAX_TREE_NODES // hangs)) for hangs in HANGS}


@dataclass
class Tuner:
    """Picks the shape with the best expected tokens per second; `depth`/`width` pin either, `in_flight` the
    steps a pipelined plan keeps in flight (pinned with a shape: that shape under the 2 likeliest leaves)."""

    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    costs: RoundCosts = field(default_factory=RoundCosts)
    depth: int | None = None
    width: int | None = None
    in_flight: int | None = None
    # measured over predicted tokens/s of pipelined plans (the closed form leaves out the entry's own time
    # and how its continuations are really placed), and plans since one was last tried
    pipelined_scale: float = 1.0
    pipelined_runs: int = 0
    serial_plans: int = 0

    def observe_pipelined(self, predicted: float, measured: float, alpha: float = 0.3) -> None:
        """A pipelined plan's rate as it ran."""
        if predicted > 0:
            ratio = min(2.0, max(0.05, measured / predicted))
            self.pipelined_scale += alpha * (ratio - self.pipelined_scale)
            self.pipelined_runs += 1

    def choose(self) -> TreeShape:
        hits = self.stats.hits()
        best = max(candidate_shapes(self.depth, self.width), key=lambda s: rate(s, self.stats, self.costs, hits))
        if self.link_bound():
            # Transfer dominates: skip expanding nodes the draft itself finds unlikely.
            return TreeShape(best.widths, best.max_nodes, min_path_prob=0.02)
        return best

    def link_bound(self) -> bool:
        return self.costs.per_token_s * MAX_TREE_NODES > self.costs.fixed_s

    def plan(self, max_in_flight: int = MAX_IN_FLIGHT, margin: float = 1.05) -> Plan:
        """Serial rounds of the best tree, or pipelined steps when the closed form says they win by `margin`:
        the most steps in flight that still shorten the time between them, and the continuation (trees and
        how many leaves they hang under) with the best rate. Pipelining loses on short rings (Delta is not
        much below a round), at low acceptance (continuations are rarely reached) and on slow links (every
        continuation's tokens cross every hop)."""
        fresh = self.choose()
        rates = Rates(self.stats, self.costs)
        serial = rates.rate(fresh, fresh, 1, 1)
        best = Plan(1, fresh, fresh, 1, serial, serial)
        pinned = self.in_flight
        if pinned is not None and (self.depth is not None or self.width is not None):
            d = min(pinned, max_in_flight)
            model = rates.rate(fresh, fresh, 2, d)
            return Plan(d, fresh, fresh, 2, model * self.pipelined_scale, serial, model)
        if max_in_flight <= 1 or pinned == 1 or self.depth is not None or self.width is not None:
            return best  # a pinned shape alone is a serial comparison
        if not pinned and (sum(self.stats.tried.values()) < MEASURED_TRIALS or self.costs.fixed_s < MIN_RING_S):
            return best  # serial rounds until the ring and the acceptance are measured, and on short rings
        if pinned:
            best = Plan(pinned, fresh, fresh, 1, 0.0, serial)
        for hangs in HANGS:
            for more in CONTINUATIONS[hangs]:
                t_more, t_draft = continuation_seconds(more, hangs, self.costs)
                depth = min(pinned or max(2, math.ceil(t_more / max(t_draft, 1e-6))), max_in_flight)
                for first in fresh, more:  # a shallower fresh tree is reached, and continued, more often
                    model = rates.rate(first, more, hangs, depth)
                    if model * self.pipelined_scale > best.rate:
                        best = Plan(depth, first, more, hangs, model * self.pipelined_scale, serial, model)
        # On where it wins as measured; tried where the closed form says it at least breaks even and nothing
        # is measured yet, and again now and then (acceptance changes with the text, and the scale learns only
        # while pipelining runs).
        wins = best.rate >= margin * serial or pinned
        worth_trying = best.model_rate >= EXPLORE * serial and \
            (self.pipelined_runs == 0 or self.serial_plans >= RETRY_PIPELINED)
        if best.depth > 1 and (wins or worth_trying):
            self.serial_plans = 0
            return best
        self.serial_plans += 1
        return Plan(1, fresh, fresh, 1, serial, serial)


@dataclass
class CostMeter:
    """Running estimates of RoundCosts from measured rounds (exponential averages, recent fit)."""

    costs: RoundCosts = field(default_factory=RoundCosts)
    alpha: float = 0.3
    window: int = 32
    _passes: list[tuple[int, float]] = field(default_factory=list)
    _measured: bool = False

    def observe(self, draft_s: float, levels: int, tokens: int, pass_s: float) -> None:
        """One round: the draft's time over `levels` levels, and the target pass of `tokens` tokens."""
        self._passes = (self._passes + [(tokens, pass_s)])[-self.window:]
        self.costs.per_token_s = self._slope()
        fixed = max(0.0, pass_s - self.costs.per_token_s * tokens)
        level = draft_s / max(1, levels)
        if not self._measured:
            self.costs.fixed_s, self.costs.draft_level_s, self._measured = fixed, level, True
        else:
            self.costs.fixed_s += self.alpha * (fixed - self.costs.fixed_s)
            self.costs.draft_level_s += self.alpha * (level - self.costs.draft_level_s)

    def _slope(self) -> float:
        """Least-squares seconds per token over recent passes; 0 until their sizes differ enough."""
        xs = [x for x, _ in self._passes]
        if len(xs) < 4 or max(xs) - min(xs) < 8:
            return self.costs.per_token_s
        mx = sum(xs) / len(xs)
        my = sum(y for _, y in self._passes) / len(xs)
        sxx = sum((x - mx) ** 2 for x in xs)
        sxy = sum((x - mx) * (y - my) for x, y in self._passes)
        return max(0.0, sxy / sxx)
