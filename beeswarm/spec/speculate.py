"""Speculative generation: draft trees locally, verify them through the target, serially or pipelined.

Serial (one step in flight) is the classic round: a tree after the last committed token goes around
the ring, the walk commits its accepted path and the target's own next token, and the next round
starts. Pipelined, D live steps are in flight (more while the entry would otherwise idle): while one
crosses the ring, the next hangs small trees under the likeliest places below those still unverified
(leaves, or one more candidate at a node not judged yet; likeliest as the target has judged such
candidates, `tuner.Calibration`), so when the walk gets there its continuation is already on its way.
Every step's tree nodes are nodes of one growing tree whose spine is the committed sequence; the walk
judges node after node as results arrive (`verify.judge`). A step whose nodes all left the walk's
subtree is ignored when it returns, and its KV dropped by the next step's `keep`; after a miss, the
next step cancels the steps still in flight (the stages skip their compute, never their keeps). The
target's token at every node is the one plain decoding takes there (greedy: its argmax; sampling: the
draw of the generation's position-keyed noise, `sampling.Noise`), so the output is plain decoding's,
token for token, whatever the timing; the tree only decides how many of them a ring commits.

The stages' KV holds the committed tokens compacted up to `base`, then the nodes sent and not yet
judged. Each step carries a tree mask over that window: a node sees its own ancestors, so its
position is `base` plus their number (`SpanRuntime`'s windowed masks).
"""
from __future__ import annotations

import collections
import heapq
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from beeswarm.generation.generate import Generation
from beeswarm.generation.sampling import Noise, Sampling, SamplingParams, Seen, new_noise, penalize, sample
from beeswarm.spec.draft import DraftModel
from beeswarm.spec.layout import Keep, KVLayout
from beeswarm.spec.tree import MAX_CANDIDATES, ROOT, DraftTree
from beeswarm.spec.tuner import MAX_DEPTH, MAX_TREE_NODES, MIN_RING_S, CostMeter, Plan, RoundCosts, TreeShape, Tuner
from beeswarm.spec.verify import judge

REPLAN_S = 1.0  # a plan holds this long at least (planning takes a few ms), re-planned at a fresh round
# A pipelined fresh tree goes out in two steps: its first levels as soon as they are drafted, the rest under
# their leaves next. Most misses fall in the first two levels (spec_bench at 280 ms: 27 of 58 rounds), and
# their result then comes from a 7-13 row step drafted in ~9 ms rather than a 60-row one drafted in ~25 ms.
FRESH_AHEAD = 2

# (token ids, start, tree mask or None, keep (start, indices) or None) -> logits for those ids
TargetForward = Callable[[torch.Tensor, int, torch.Tensor | None, tuple[int, list[int]] | None], torch.Tensor]


class Target(Protocol):
    """A target that may take steps before earlier ones return; steps of a session run in the order sent."""

    def submit(self, ids: torch.Tensor, start: int, mask: torch.Tensor | None,
               keep: tuple[int, list[int]] | None, cancel: bool = False) -> Any:
        """Send a step; `cancel`: the steps sent before it and not run yet are not wanted (the stages compute
        none of them that they have not run yet, though their keeps still apply; the caller discards them)."""
        ...

    def collect(self, handle: Any) -> tuple[torch.Tensor, float]:
        """The step's logits, and when they arrived (perf_counter seconds)."""
        ...

    def discard(self, handle: Any) -> None:
        """The step's result is not wanted (the generation ended while it was in flight)."""
        ...


class Eager:
    """A synchronous forward as a `Target`: each step runs when submitted (one in flight is the same)."""

    def __init__(self, forward: TargetForward):
        self.forward = forward

    def submit(self, ids, start, mask, keep, cancel=False) -> tuple[torch.Tensor, float]:
        return self.forward(ids, start, mask, keep), time.perf_counter()

    def collect(self, handle: tuple[torch.Tensor, float]) -> tuple[torch.Tensor, float]:
        return handle

    def discard(self, handle: Any) -> None:
        pass


@dataclass
class SpecReport:
    rounds: int = 0  # steps whose results the walk used
    accepted: list[int] = field(default_factory=list)  # draft tokens accepted from each such step
    tried: list[int] = field(default_factory=list)  # candidates verification tried in each
    shapes: collections.Counter = field(default_factory=collections.Counter)
    acceptance_by_depth: list[float] = field(default_factory=list)
    steps: int = 0  # steps sent
    cancelled: int = 0  # steps none of whose nodes could still be committed when they returned
    rows_sent: int = 0  # positions the stages computed
    rows_cancelled: int = 0  # ... in cancelled steps
    in_flight: collections.Counter = field(default_factory=collections.Counter)  # live steps in flight at each send
    plan: Plan | None = None

    def as_json(self) -> dict:
        widths = self.shapes.most_common(1)[0][0] if self.shapes else ()
        return {"rounds": self.rounds,
                "accepted_per_round": round(sum(self.accepted) / max(1, self.rounds), 3),
                "acceptance_by_depth": self.acceptance_by_depth,
                "spec": {"depth": len(widths), "widths": list(widths)},
                "pipeline": {"steps": self.steps, "cancelled": self.cancelled, "rows_sent": self.rows_sent,
                             "rows_cancelled": self.rows_cancelled,
                             "in_flight": dict(sorted(self.in_flight.items())),
                             "plan": self.plan.as_json() if self.plan else None}}


@dataclass
class _Step:
    handle: Any
    rows: list[int]  # tree nodes, in row order
    sent: float
    draft_s: float
    levels: int
    dead: bool = False  # none of its nodes can be committed any more


class Flight:
    """The steps in flight to the target, oldest first (a pipelined speculation keeps several), and what their
    round trips measure. Steps return in the order sent. `clock`: seconds, the clock the target's arrival times are
    on (perf_counter, as `Target.collect` reports them)."""

    def __init__(self, target: Target, max_in_flight: int, costs: RoundCosts,
                 clock: Callable[[], float] = time.perf_counter):
        self.target, self.max_in_flight, self.costs, self.clock = target, max_in_flight, costs, clock
        self.steps: collections.deque[_Step] = collections.deque()
        self.cancelling = False  # the next step cancels those before it
        self.step_s = 0.01  # the entry's time to draft a continuation step (running average)
        self.meter = CostMeter(costs)

    def __len__(self) -> int:
        return len(self.steps)

    def send(self, tokens: torch.Tensor, rows: list[int], start: int, mask: torch.Tensor, keep: Keep | None,
             draft_s: float, levels: int, continuation: bool) -> None:
        if continuation:
            self.step_s += 0.3 * (draft_s - self.step_s)
        sent = self.clock()
        handle = self.target.submit(tokens, start, mask, keep, self.cancelling)
        self.cancelling = False
        self.steps.append(_Step(handle, rows, sent, draft_s, levels))

    def receive(self) -> tuple[_Step, torch.Tensor]:
        """Wait for the oldest step: it, and its logits."""
        step = self.steps.popleft()
        logits, arrived = self.target.collect(step.handle)
        # the step's time past its draft: the pass around the ring (and any queue behind earlier steps)
        self.meter.observe(step.draft_s, step.levels, len(step.rows), arrived - step.sent)
        return step, logits

    def until_due(self) -> float:
        """Seconds until the oldest step in flight is due back (a pass after it was sent)."""
        if not self.steps:
            return float("inf")
        step = self.steps[0]
        return step.sent + self.costs.fixed_s + self.costs.per_token_s * len(step.rows) - self.clock()

    def live(self, wanted: Callable[[int], bool]) -> int:
        """Steps whose results the walk may still use (a step none of whose rows is `wanted` is dead for good)."""
        live = 0
        for step in self.steps:
            step.dead = step.dead or not any(map(wanted, step.rows))
            live += not step.dead
        return live

    def cancel(self) -> tuple[int, int]:
        """Every step in flight can no longer be used: discarded here, dropped by the stages where it has not run
        yet (the next step says so). The steps and rows cancelled."""
        self.cancelling = self.cancelling or bool(self.steps)
        cancelled = len(self.steps), sum(len(step.rows) for step in self.steps)
        self.discard_all()
        return cancelled

    def discard_all(self) -> None:
        while self.steps:
            self.target.discard(self.steps.popleft().handle)


class Speculation:
    """The tree of one generation's speculation and the walk; `flight` the steps sent, `kv` where the sent nodes
    sit in the stages' KV (`layout.KVLayout`, its capacity the target session's)."""

    def __init__(self, flight: Flight, kv: KVLayout, draft: DraftModel, sampling: Sampling, tuner: Tuner,
                 committed: list[int], commit: Callable[[int], bool], report: SpecReport):
        """`committed`: the prompt and the tokens committed so far (the last is not in the KV yet); `commit(token)`
        emits each one the walk commits, False once generation is over."""
        self.flight, self.kv, self.draft, self.sampling = flight, kv, draft, sampling
        self.tuner, self.commit, self.report = tuner, commit, report
        self.tree = DraftTree()
        self.committed = list(committed)  # every committed token; the last is `at`'s
        self.at = self.tree.add(ROOT, committed[-1])  # the walk's node: committed, its children next to judge
        self.kv.spine = {self.at}
        self.fresh = True  # the walk's node is not in the stages' KV yet (the prompt's last token, a miss's token)
        self.rows: dict[int, torch.Tensor] = {}  # the target's logits after each node whose result arrived
        self.level = {self.at: 0}  # a node's depth below the last fresh round's root (the tuner's statistics)
        self.drafted: dict[int, tuple[float, int]] = {}  # a drafted node: the draft's probability, its rank
        self.plan = tuner.plan(flight.max_in_flight)
        self.planned = (flight.clock(), len(self.committed))  # when, and the tokens committed then

    # the walk ----------------------------------------------------------------------------------
    def advance(self) -> bool:
        """Judge nodes while the target's results allow; False once generation is over."""
        seen = Seen(self.committed) if self.sampling.params.repetition_penalty != 1.0 else None
        while self.at in self.rows:
            logits = self.rows.pop(self.at)
            if seen is not None:
                logits = penalize(logits, seen, self.sampling.params.repetition_penalty)
            trials: list[tuple[int, int, bool]] = []
            child, token = judge(self.tree, self.at, logits, self.sampling.params, self.sampling.noise,
                                 len(self.committed), min(self.level[self.at] + 1, MAX_DEPTH), trials)
            for depth, candidate, ok in trials:
                self.tuner.stats.record(depth, candidate, ok)
            for node in self.tree.children(self.at):
                if node in self.drafted:
                    self.tuner.calibration.record(*self.drafted[node], self.tree.tokens[node] == token)
            self.report.tried[-1] += len(trials)
            child = child if child is not None else self.tree.child(self.at, token)
            if child is None:  # the target's own token: a new node, sent with the next step
                child = self.tree.add(self.at, token)
                self.fresh, self.level[child] = True, 0
                self.cancel()  # everything in flight was built on another outcome
            else:
                self.report.accepted[-1] += 1
            self.at = child
            self.kv.spine.add(child)
            self.committed.append(token)
            if seen is not None:
                seen = seen.plus([token])
            if not self.commit(token):
                return False
        return True

    def wanted(self, node: int) -> bool:
        """A sent node whose result the walk may still use: the walk's own, or one still committable."""
        return node == self.at or (node in self.kv.slots and self.alive(node))

    def alive(self, node: int) -> bool:
        """Still committable: below the walk's node."""
        depth = self.tree.depths[self.at]
        if self.tree.depths[node] <= depth:
            return False
        while self.tree.depths[node] > depth:
            node = self.tree.parents[node]
        return node == self.at

    # steps -------------------------------------------------------------------------------------
    def fill(self) -> None:
        """A fresh round when the walk's node is not sent yet (at the start, after a miss), then continuations
        until `plan.depth` live steps are in flight, and more while the entry would idle."""
        if self.fresh:
            if self.flight.clock() - self.planned[0] >= REPLAN_S or not self.tuner.measured():
                self.replan()
            fresh = self.plan.fresh
            if self.plan.depth > 1 and fresh.depth > FRESH_AHEAD:
                ahead = TreeShape(fresh.widths[:FRESH_AHEAD], fresh.max_nodes, fresh.min_path_prob)
                if self.send([(self.at, None)], ahead):
                    sent = self.flight.steps[-1].rows
                    leaves = [n for n in sent if n not in self.tree.dists]
                    each = max(1, (fresh.nodes - len(sent) + 1) // max(1, len(leaves)))  # the whole tree's budget
                    rest = TreeShape(fresh.widths[FRESH_AHEAD:], each, fresh.min_path_prob)
                    self.send([(leaf, None) for leaf in leaves], rest)
            else:
                self.send([(self.at, None)], fresh)
        while self.live_steps() < self.plan.depth and not self.result_due() or self.idle():
            hangs = self.frontier(self.plan.hangs)
            if not hangs or not self.send(hangs, self.plan.more):
                return

    def result_due(self) -> bool:
        """The oldest step's result is due before another step could be drafted: take it first (it may be a miss,
        and then the fresh round cannot wait; else the next places are chosen knowing it). Only on a ring long
        enough to pipeline (`MIN_RING_S`): on a short one a result is due after every step, and waiting for
        each would keep fewer steps in flight than the plan; a synchronous target has every result at once."""
        return (not isinstance(self.flight.target, Eager) and self.tuner.costs.fixed_s >= MIN_RING_S
                and self.flight.until_due() <= self.flight.step_s)

    def idle(self) -> bool:
        """Time for one more continuation before the oldest step in flight is due back: drafting it then delays
        nothing the walk waits for, and covers deeper (up to `max_in_flight` steps; a pinned number in flight is
        kept exactly)."""
        return (self.plan.depth > 1 and bool(self.flight) and len(self.flight) < self.flight.max_in_flight
                and self.tuner.in_flight is None and self.flight.until_due() > 2 * self.flight.step_s)

    def live_steps(self) -> int:
        """Steps in flight whose results the walk may still use: the plan's depth counts only those, so a step
        hung under a branch the walk left is replaced at once rather than when it returns."""
        return self.flight.live(self.wanted)

    def replan(self, again: bool = True) -> None:
        """Plan again from what the statistics say now; a pipelined plan's measured rate calibrates the next."""
        (t0, n0), now = self.planned, self.flight.clock()
        if self.plan.depth > 1 and now - t0 >= REPLAN_S / 2:
            self.tuner.observe_pipelined(self.plan.model_rate, (len(self.committed) - n0) / (now - t0))
        if again:
            self.plan, self.planned = self.tuner.plan(self.flight.max_in_flight), (now, len(self.committed))

    def frontier(self, count: int) -> list[tuple[int, int | None]]:
        """The `count` likeliest places (under the draft) to speculate further below the walk's node: a leaf no
        step extends yet (node, None), or a node not judged yet that gets one more candidate (node, token).

        Best first: a place is never likelier than its node, nor a node than its parent, so the search stops
        once no node left could beat the `count` places found (the subtree holds hundreds of nodes)."""
        chance = self.tuner.calibration.chance
        best: list[tuple[float, int, int, int | None]] = []  # a min-heap of the places kept: chance, tie, node, token
        nodes = [(-1.0, self.at)]  # a max-heap of nodes to look at, by the chance the walk reaches them
        while nodes and (len(best) < count or -nodes[0][0] > best[0][0]):
            minus_p, node = heapq.heappop(nodes)
            children = self.tree.children(node)
            place: tuple[float, int | None] | None = None
            if node not in self.tree.dists:
                place = -minus_p, None
            elif len(self.tree.candidates[node]) < MAX_CANDIDATES:
                untried = self.tree.untried(node)
                if untried is not None:
                    token, q = untried
                    place = -minus_p * chance(q, len(children)), token
            if place is not None:
                entry = (place[0], -node, node, place[1])
                (heapq.heappush if len(best) < count else heapq.heappushpop)(best, entry)
            for c in children:
                if c in self.kv.slots:
                    heapq.heappush(nodes, (minus_p * chance(*self.drafted[c]), c))
        return [(node, token) for _, _, node, token in sorted(best, reverse=True)]

    def widen(self, node: int, token: int) -> int | None:
        """One more candidate at `node`: `token`, the next it ranks (`DraftTree.untried`); its new child."""
        self.tree.candidates[node].append(token)
        if self.tree.child(node, token) is not None:
            return None
        return self.add_drafted(node, token, float(self.tree.dists[node][token]))

    def add_drafted(self, parent: int, token: int, q: float) -> int:
        """A drafted node: its draft probability `q` and rank among its parent's children (what `Calibration`
        judges it by), and its depth below the last fresh root."""
        node = self.tree.add(parent, token)
        self.drafted[node] = q, len(self.tree.children(parent)) - 1
        self.level[node] = self.level[parent] + 1
        return node

    def send(self, hangs: list[tuple[int, int | None]], shape: TreeShape) -> bool:
        """One step: trees drafted under `hangs` (a new candidate first where one is named), and the walk's node
        first when it is not in the stages' KV yet."""
        t0 = self.flight.clock()  # the entry's time for a step: the draft, and the bookkeeping around it
        keep, window = self.compact()
        rows = [self.at] if self.fresh else []
        budget = len(hangs) * (MAX_TREE_NODES + 1)
        if self.kv.capacity is not None:
            budget = min(budget, self.kv.capacity - self.kv.end - len(rows))
        under = []
        for hang, token in hangs:
            if token is not None:  # a new candidate first, then a tree under it
                new = self.widen(hang, token) if budget > 1 else None
                if new is None:
                    continue
                hang = new
                rows.append(hang)
                budget -= 1
            under.append(hang)
        budget = min(budget, len(under) * shape.nodes)
        if under and budget > 0:
            forest, _ = self.draft.propose_many(self.committed, [self.path_tokens(h) for h in under],
                                                TreeShape(shape.widths, budget, shape.min_path_prob),
                                                self.sampling.params, self.sampling.noise)
            rows += self.graft(forest)
        if not rows:
            return False
        col = {node: j for j, node in enumerate(window + rows)}
        seen_rows, seen_cols = [], []  # each row sees its ancestors in the window
        for i, node in enumerate(rows):
            while node in col:
                seen_rows.append(i)
                seen_cols.append(col[node])
                node = self.tree.parents[node]
        mask = torch.zeros(len(rows), len(col), dtype=torch.bool)
        mask[seen_rows, seen_cols] = True
        self.report.in_flight[self.live_steps() + 1] += 1
        self.flight.send(torch.tensor([self.tree.tokens[n] for n in rows]), rows, self.kv.place(rows), mask, keep,
                         self.flight.clock() - t0, shape.depth + 1, continuation=not self.fresh)
        self.fresh = False
        self.report.steps += 1
        self.report.rows_sent += len(rows)
        self.report.shapes[shape.widths] += 1
        return True

    def graft(self, forest: DraftTree) -> list[int]:
        """Add the trees `propose_many` drafted (its first nodes are paths to them, already here); the new nodes."""
        ids, new = {ROOT: self.at}, []
        for i, (token, parent) in enumerate(zip(forest.tokens, forest.parents, strict=True)):
            found = self.tree.child(ids[parent], token)
            if found is None:
                found = self.add_drafted(ids[parent], token, float(forest.dists[parent][token]))
                new.append(found)
            ids[i] = found
        for node, cands in forest.candidates.items():
            into = ids[node]
            self.tree.candidates[into], self.tree.dists[into] = list(cands), forest.dists[node]
            self.tree.ranked[into] = forest.ranked[node]
        return new

    def path_tokens(self, node: int) -> list[int]:
        """Tokens after the walk's node down to `node`."""
        out = []
        while node != self.at:
            out.append(self.tree.tokens[node])
            node = self.tree.parents[node]
        return out[::-1]

    def compact(self) -> tuple[tuple[int, list[int]] | None, list[int]]:
        """The keep for the next step (committed nodes to `base`, then live ones; the rest dropped) and the
        live nodes in their new order: the next step's window."""
        keep, live, forgotten = self.kv.compact(self.at, self.alive)
        for node in forgotten:
            self.drafted.pop(node, None), self.level.pop(node, None)
        kept = set(live) | {self.at}
        for node in [n for n in self.tree.candidates if n not in kept]:
            del self.tree.candidates[node], self.tree.dists[node], self.tree.ranked[node]  # never judged: free them
        self.rows = {n: r for n, r in self.rows.items() if n in kept}
        return keep, live

    def receive(self) -> None:
        """Wait for the oldest step in flight and keep the results the walk may still need."""
        step, logits = self.flight.receive()
        wanted = [i for i, node in enumerate(step.rows) if self.wanted(node)]
        if not wanted:
            self.report.cancelled += 1
            self.report.rows_cancelled += len(step.rows)
        else:
            self.report.rounds += 1
            self.report.accepted.append(0)
            self.report.tried.append(0)
        for i in wanted:
            self.rows[step.rows[i]] = logits[i]

    def cancel(self) -> None:
        steps, rows = self.flight.cancel()
        self.report.cancelled += steps
        self.report.rows_cancelled += rows


def speculative_generate(target: TargetForward | Target, draft: DraftModel, prompt_ids: list[int],
                         max_new_tokens: int, params: SamplingParams, tuner: Tuner | None = None,
                         stop_ids: Iterable[int] = (), on_token: Callable[[int], None] | None = None,
                         noise: Noise | None = None, report: SpecReport | None = None,
                         max_length: int | None = None, max_in_flight: int = 1,
                         prefill: Callable[[torch.Tensor], torch.Tensor] | None = None) -> Generation:
    """Like `generate`, speculating: each target pass commits the accepted draft path plus a token of its own.

    `target`: a forward function (one step at a time) or a `Target` taking up to `max_in_flight` steps at
    once (the tuner decides how many, from 1); `max_length`: the target session's capacity, trees shrink to
    fit what is left of it; `prefill(ids)`: the prompt's logits (default: one step of the target).
    """
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    target = Eager(target) if callable(target) else target
    tuner = tuner or Tuner()
    report = report if report is not None else SpecReport()
    stop = set(stop_ids)
    tokens: list[int] = []
    t0 = time.perf_counter()

    def commit(token: int) -> bool:
        """Emit a token; False once the budget or a stop id ends the generation."""
        tokens.append(token)
        if on_token:
            on_token(token)
        return token not in stop and len(tokens) < max_new_tokens

    noise = noise if noise is not None else new_noise(params)
    ids = torch.tensor(prompt_ids)
    logits = prefill(ids) if prefill is not None else target.collect(target.submit(ids, 0, None, None))[0]
    going = commit(sample(logits[-1], params, noise, len(prompt_ids), prompt_ids)) if max_new_tokens > 0 else False
    ttft = time.perf_counter() - t0
    draft.reset(len(prompt_ids) + max_new_tokens + 2 * (max_in_flight + 1) * (MAX_TREE_NODES + 2))
    spec = Speculation(Flight(target, max_in_flight, tuner.costs), KVLayout(len(prompt_ids), capacity=max_length),
                        draft, Sampling(params, noise), tuner, list(prompt_ids) + tokens, commit, report)
    try:
        while going:
            spec.fill()
            spec.receive()
            going = spec.advance()
    finally:
        spec.flight.discard_all()
    spec.replan(again=False)
    report.plan = spec.plan
    report.acceptance_by_depth = tuner.stats.by_depth()
    draft.close()
    return Generation(tokens, len(prompt_ids), ttft, time.perf_counter() - t0)
