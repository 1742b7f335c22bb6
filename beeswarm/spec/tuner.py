"""Choose the draft tree for the next round: depth K and per-depth widths, from measured figures.

A round costs `K * draft_level_s + fixed_s + per_token_s * tokens`: the draft's K levels, the
target pass around the ring (compute + one-way latencies, `C + T_ring`), and what each extra token
in the step adds (compute and transfer on every hop). It commits `1 + sum_k prod_{d<=k} hit_d(w_d)`
tokens on average, where `hit_d(w)` is the chance the target's token is among `w` candidates at
depth d, from running acceptance counts. The tuner maximises tokens per second. With every width 1
this is the closed form `(1 - a^(K+1)) / (1 - a) / (K*c_d + C + T_ring)`.

Pipelined speculation (`Tuner.plan`) keeps up to D steps in flight: after a fresh round (the serial tree
F, K_F levels), each step hangs `CONTINUATION` trees under the likeliest places below the steps before it
(leaves, or one more candidate at a node not judged yet), ranked by `Calibration`. Only a miss (the
target's token not in the tree) costs a ring; between misses the walk only waits for the continuations
it needs, each a step time Delta after the one before. So per miss (`Rates.rate`), with the fresh tree's
levels one candidate wider and D - 1 continuations of K_M levels of width w_M below them (L levels in
all, widths w'_d, reach R_k = prod_{d<=k} hit_d(w'_d)):

    rate = (1 + sum_{k<=L} R_k) / (T_F + Delta * sum_{i<D} R_{K_F + (i-1) K_M}),  T_F = K_F c_d + C + T_ring

D = 1 gives the serial rate E_F / T_F. What the form leaves out (the entry's own time, the cores the
stages share) is learned by scaling it with what pipelined plans measured.

Pure: no torch, no networking.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass, field

MAX_DEPTH = 32
MAX_WIDTH = 4
MAX_TREE_NODES = 64
MAX_IN_FLIGHT = 8  # pipelined steps around the ring at once
RETRY_PIPELINED = 30  # serial plans in a row before a pipelined one is tried again
MEASURED_TRIALS = 12  # candidates judged before a pipelined plan is weighed (about 4 rounds: at 32 the
# first prompt of spec_bench ran 10 serial rounds, 3.3 s, on the 280 ms ring before its first pipelined step)
# Rounds shorter than this stay serial: the entry's drafting and bookkeeping for each step in flight, and
# the stages' share of two cores, ate the gain at 0-40 ms rings in spec_bench's sweep; with tinycode's
# distilled draft pipelining wins from 80 ms (0.2 s until then, set with a draft that missed twice as often).
MIN_RING_S = 0.1
EXPLORE = 1.05  # a pipelined plan is tried when its closed form beats serial rounds by this
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


# A continuation step: two candidates and a chain of two below each, under each of the 8 likeliest places (leaves,
# or nodes given one more candidate). On spec_bench's 280 ms ring it beat wider or narrower continuations ((3,3,1,1)
# under 2 places: 12.1 tok/s; (2,2) or (2,1) under 16: no faster than (2,1) under 8), and (2,1,1) beat (2,1) in 9
# of 10 interleaved runs (+2.7% and +4.8% in two sessions): a run of accepted tokens outruns the steps in flight less
# often. 4 live steps did as well as 6 or 8 (13.8, 13.4), for half the stages' compute and wire bytes: the tuner
# keeps at most 4 live (the entry drafts more only while nothing is due back, up to 8 in flight: 5, 6, 12 or 16
# were slower).
CONTINUATION = TreeShape((2, 1, 1))
CONTINUATION_PLACES = 8
MAX_TUNED_IN_FLIGHT = 4


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


# Upper edges of the draft-probability bins `Calibration` counts in (a small draft's softmax is flat: tinycode's
# draft gives its first candidate q ~ 0.1 where the target takes it 41% of the time, q ~ 0.26 where it does 75%).
Q_EDGES = (0.02, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
CALIBRATION_PRIOR = 2.0  # pseudo-counts at the draft's own probability, per bin


@dataclass
class Calibration:
    """How often the target takes a drafted candidate, by the draft's probability q for it and its rank among
    its node's candidates (first, second, later): what pipelined steps rank the places to extend by."""

    counts: dict[tuple[int, int], list[float]] = field(default_factory=dict)  # (rank, bin) -> [judged, taken]

    @staticmethod
    def _key(q: float, rank: int) -> tuple[int, int]:
        return min(rank, 2), bisect.bisect_left(Q_EDGES, q)

    def record(self, q: float, rank: int, taken: bool) -> None:
        count = self.counts.setdefault(self._key(q, rank), [0.0, 0.0])
        count[0] += 1
        count[1] += taken

    def chance(self, q: float, rank: int) -> float:
        """The chance the target takes this candidate, given the walk reaches its node."""
        judged, taken = self.counts.get(self._key(q, rank), (0.0, 0.0))
        return (taken + CALIBRATION_PRIOR * q) / (judged + CALIBRATION_PRIOR)


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
    """Expected tokens and rates of shapes under one snapshot of the statistics (cached: a plan weighs hundreds)."""

    def __init__(self, stats: AcceptanceStats, costs: RoundCosts):
        self.stats, self.costs, self.hits = stats, costs, stats.hits()
        self._tokens: dict[tuple[int, ...], float] = {}

    def tokens(self, shape: TreeShape) -> float:
        if shape.widths not in self._tokens:
            self._tokens[shape.widths] = expected_tokens(shape, self.stats, self.hits)
        return self._tokens[shape.widths]

    def rate(self, fresh: TreeShape, depth: int) -> float:
        """Tokens per second with `depth` steps in flight (the module's closed form); depth 1: serial rounds."""
        t_fresh = round_seconds(fresh, self.costs)
        if depth <= 1:
            return self.tokens(fresh) / t_fresh
        t_step = continuation_seconds(self.costs)
        more = CONTINUATION.depth
        # Continuations widen the likeliest nodes first (one more candidate per level of the fresh tree), then
        # extend its leaves, `more` levels per step, `depth - 1` steps behind the fresh one in the first ring.
        widths = [min(w + 1, MAX_WIDTH) for w in fresh.widths] + [CONTINUATION.widths[0]] * (more * (depth - 1))
        tokens, reach, wait = 1.0, 1.0, 0.0
        for d, w in enumerate(widths[:MAX_DEPTH]):
            if d >= fresh.depth and (d - fresh.depth) % more == 0:
                wait += reach * t_step  # the walk needs the next continuation: it arrives a step after the last
            reach *= self.hits[d][w - 1]
            tokens += reach
        return tokens / (t_fresh + wait)


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


def continuation_seconds(costs: RoundCosts) -> float:
    """The entry's time for a continuation step, and so the least time between two: the draft's passes (the
    paths to its places, then each level for all) and its tokens' share of the links."""
    return (CONTINUATION.depth + 1) * costs.draft_level_s + \
        costs.per_token_s * CONTINUATION_PLACES * CONTINUATION.full_nodes


@dataclass
class Tuner:
    """Picks the shape with the best expected tokens per second; `depth`/`width` pin either, `in_flight` the
    steps a pipelined plan keeps in flight (pinned with a shape: that shape under the 2 likeliest leaves)."""

    stats: AcceptanceStats = field(default_factory=AcceptanceStats)
    costs: RoundCosts = field(default_factory=RoundCosts)
    calibration: Calibration = field(default_factory=Calibration)
    depth: int | None = None
    width: int | None = None
    in_flight: int | None = None
    # measured over predicted tokens/s of pipelined plans (the closed form leaves out the entry's own time
    # and how its continuations are really placed), and plans since one was last tried
    pipelined_scale: float = 1.0
    pipelined_runs: int = 0
    serial_plans: int = 0

    def measured(self) -> bool:
        """Enough candidates judged to plan from (until then: serial rounds, re-planned every round)."""
        return sum(self.stats.tried.values()) >= MEASURED_TRIALS

    def observe_pipelined(self, predicted: float, measured: float, alpha: float = 0.15) -> None:
        """A pipelined plan's rate as it ran (over a second or so: a hard stretch of text is slow whatever the
        plan, so one window moves the scale only a little)."""
        if predicted > 0:
            ratio = min(1.5, max(0.5, measured / predicted))
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
        the live steps in flight (2 to `MAX_TUNED_IN_FLIGHT`) and the fresh tree with the best rate.
        Pipelining loses on short rings (a step's draft is not much below a round), at low acceptance
        (misses come as often as serial rounds) and on slow links (every continuation's tokens cross every
        hop)."""
        fresh = self.choose()
        rates = Rates(self.stats, self.costs)
        serial = rates.rate(fresh, 1)
        best = Plan(1, fresh, fresh, 1, serial, serial)
        pinned = self.in_flight
        if max_in_flight <= 1 or pinned == 1:
            return best
        shape_pinned = self.depth is not None or self.width is not None
        if not pinned and (shape_pinned or not self.measured() or self.costs.fixed_s < MIN_RING_S):
            return best  # a pinned shape alone is a serial comparison; serial rounds until the ring and the
            # acceptance are measured, and on short rings
        # The fresh tree too is chosen for pipelining: continuations widen it, so a narrower one may do better
        shapes = [fresh] if shape_pinned else list(candidate_shapes())
        for depth in [min(pinned, max_in_flight)] if pinned else range(2, min(max_in_flight, MAX_TUNED_IN_FLIGHT) + 1):
            model, first = max(((rates.rate(shape, depth), shape) for shape in shapes), key=lambda r: r[0])
            if pinned or model * self.pipelined_scale > best.rate:
                best = Plan(depth, first, CONTINUATION, CONTINUATION_PLACES, model * self.pipelined_scale, serial,
                            model)
        if shape_pinned:
            return best
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
