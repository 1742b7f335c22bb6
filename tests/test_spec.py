"""Speculative decoding: tree masks and KV compaction, exact sampling, greedy identity, the tuner."""
from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from beeswarm.generation.generate import generate
from beeswarm.generation.sampling import Noise, Sampling, SamplingParams, penalize, probabilities
from beeswarm.spec import speculate
from beeswarm.spec.draft import DraftError, DraftModel
from beeswarm.spec.layout import KVLayout
from beeswarm.spec.speculate import SpecReport, speculative_generate
from beeswarm.spec.tree import ROOT, DraftTree, grow_tree
from beeswarm.spec.tuner import (
    MAX_DEPTH,
    AcceptanceStats,
    Calibration,
    Rates,
    RoundCosts,
    TreeShape,
    Tuner,
    rate,
)
from beeswarm.spec.verify import Verdict, judge, verify
from local_pipeline import LocalPipeline
from tiny_checkpoints import write_tiny_checkpoint

PROMPT = [5, 100, 200, 33, 7, 9]
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def tinycode():
    return LocalPipeline("tinycode", stages=2, dtype="float32", device="cpu")


def draft(pipe) -> DraftModel:
    return DraftModel("tinycode-draft", pipe.entry.config.vocab_size)


def plain_logits(pipe, ids: list[int]) -> torch.Tensor:
    session = pipe.open(len(ids))
    try:
        return pipe.forward(session, torch.tensor(ids), 0)
    finally:
        pipe.close(session)


def step_mask(tree: DraftTree, pending: int) -> torch.Tensor:
    """Mask for one step of `pending` committed tokens (a causal chain) followed by every node of `tree`."""
    n = len(tree)
    mask = torch.zeros(pending + n, pending + n, dtype=torch.bool)
    mask[:pending, :pending] = torch.ones(pending, pending, dtype=torch.bool).tril()
    mask[pending:, :pending] = True
    mask[pending:, pending:] = tree.ancestors()
    return mask


def test_tree_pass_and_kv_compaction_equal_each_path_run_alone(tinycode):
    d = draft(tinycode)
    d.reset(64)
    tree = d.propose(PROMPT, TreeShape((3, 2, 2)), GREEDY)
    assert len(tree) == 3 + 6 + 12 and max(tree.depths) == 3
    pending = PROMPT[-2:]  # two committed tokens not yet in the target's cache, then the tree
    session = tinycode.open(64)
    tinycode.forward(session, torch.tensor(PROMPT[:-2]), 0)
    logits = tinycode.forward(session, torch.tensor(pending + tree.tokens), len(PROMPT) - 2, step_mask(tree, 2))
    for node in range(len(tree)):
        path = [tree.tokens[n] for n in tree.path(node)]
        alone = plain_logits(tinycode, PROMPT + path)[-1]
        torch.testing.assert_close(logits[2 + node], alone, atol=1e-4, rtol=1e-4)
    # keep one deep path; the next step sees exactly the prompt + that path
    leaf = len(tree) - 1
    kept = [0, 1] + [2 + n for n in tree.path(leaf)]
    path = [tree.tokens[n] for n in tree.path(leaf)]
    after = tinycode.forward(session, torch.tensor([42]), len(PROMPT) + len(path), keep=(len(PROMPT) - 2, kept))
    torch.testing.assert_close(after[-1], plain_logits(tinycode, PROMPT + path + [42])[-1], atol=1e-4, rtol=1e-4)
    tinycode.close(session)


@pytest.mark.parametrize("tuner", [Tuner(width=1), Tuner(depth=3, width=2), Tuner(depth=2, width=4),
                                   Tuner(costs=RoundCosts(0.001, 0.3, 0.0)), Tuner(depth=2, width=2, in_flight=4),
                                   Tuner(depth=5, width=2, in_flight=3), Tuner(in_flight=3)],
                         ids=["chain", "tree-3x2", "tree-2x4", "tuned-slow-ring", "pipelined-2x2", "pipelined-5x2",
                              "pipelined-tuned"])
def test_greedy_speculation_equals_plain_greedy(tinycode, tuner):
    """Serial rounds, and steps pipelined (several in flight, continuations under the likeliest leaves, the
    ones built on a miss dropped with their KV): greedy output is plain greedy's, token for token."""
    session = tinycode.open(200)
    plain = generate(lambda t, s: tinycode.forward(session, t, s), PROMPT, 60, GREEDY)
    tinycode.close(session)
    capacity = 200 + 80 * (tuner.in_flight or 1)
    session = tinycode.open(capacity)
    report = SpecReport()
    spec = speculative_generate(lambda t, s, m, k: tinycode.forward(session, t, s, m, k), draft(tinycode), PROMPT,
                                60, GREEDY, tuner, report=report, max_length=capacity,
                                max_in_flight=tuner.in_flight or 1)
    tinycode.close(session)
    assert spec.tokens == plain.tokens
    assert report.rounds < 59  # some rounds committed more than one token
    assert sum(report.accepted) + report.rounds + 1 >= 60
    assert 0 < report.acceptance_by_depth[0] <= 1
    if tuner.in_flight:
        assert max(report.in_flight) == tuner.in_flight and report.cancelled > 0
    else:
        assert set(report.in_flight) == {1} and report.cancelled == 0


def test_a_repetition_penalty_is_transformers_own_in_plain_and_speculative_greedy(tinycode):
    """Greedy tinycode loops; with a repetition penalty plain decoding equals transformers' generate with
    the same penalty, token for token, and speculating (the draft penalised per node too) changes nothing."""
    penalised = SamplingParams(repetition_penalty=1.3)
    reference = AutoModelForCausalLM.from_pretrained(str(tinycode.entry.folder), dtype=torch.float32).eval()
    with torch.no_grad():
        want = reference.generate(torch.tensor([PROMPT]), max_new_tokens=48, do_sample=False, eos_token_id=None,
                                  pad_token_id=0, repetition_penalty=1.3)[0, len(PROMPT):].tolist()
    session = tinycode.open(200)
    plain = generate(lambda t, s: tinycode.forward(session, t, s), PROMPT, 48, penalised)
    unpenalised = generate(lambda t, s: tinycode.forward(session, t, s), PROMPT, 48, GREEDY)
    tinycode.close(session)
    assert plain.tokens == want != unpenalised.tokens
    for tuner in Tuner(depth=3, width=2), Tuner(depth=3, width=2, in_flight=3):
        session = tinycode.open(500)
        spec = speculative_generate(lambda t, s, m, k: tinycode.forward(session, t, s, m, k), draft(tinycode),
                                    PROMPT, 48, penalised, tuner, max_length=500, max_in_flight=3)
        tinycode.close(session)
        assert spec.tokens == want


def test_draft_with_another_vocabulary_is_refused(tmp_path):
    other = write_tiny_checkpoint(tmp_path / "other", num_layers=1, vocab_size=100)
    with pytest.raises(DraftError, match="vocabulary of 100 tokens"):
        DraftModel(str(other), 2048)


# --- exact sampling -------------------------------------------------------------------------------
VOCAB = 5
ROUND_SHAPE = TreeShape((2, 2))
SAMPLES = 10_000
PIPELINED_SAMPLES = 1_500


CONTEXT = [1, 2]  # the tables' logits follow these tokens


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """Target and draft: two random 5-token models, logits looked up lazily for any sequence."""
    tables = []
    for seed, layers in ((0, 2), (7, 1)):
        folder = write_tiny_checkpoint(tmp_path_factory.mktemp(f"v{seed}"), num_layers=layers, seed=seed,
                                       hidden_size=32, intermediate_size=64, vocab_size=VOCAB)
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()

        @functools.cache
        def logits_after(seq: tuple[int, ...], model=model) -> torch.Tensor:
            with torch.no_grad():  # sharpen: random tiny models are nearly uniform, which would hide a biased rule
                return 4 * model(torch.tensor([seq])).logits[0, -1]
        tables.append(logits_after)
    return tables


@pytest.fixture(scope="module")
def tiny_vocab_logits(tiny_models):
    """Target and draft logits after CONTEXT and every context of up to 3 tokens."""
    return [{ctx: logits_after((*CONTEXT, *ctx)) for n in range(4) for ctx in itertools.product(range(VOCAB), repeat=n)}
            for logits_after in tiny_models]




def target_logits(target, ctx: tuple[int, ...], params: SamplingParams) -> torch.Tensor:
    """The target's logits after `ctx`, penalised by the whole sequence as speculative_generate does."""
    return penalize(target[ctx], CONTEXT + list(ctx), params.repetition_penalty)


def two_tokens(target, draft_table, params, noise, verifier) -> tuple[int, int]:
    """Speculative rounds over looked-up logits until two tokens are committed."""
    ctx: tuple[int, ...] = ()
    while len(ctx) < 2:
        def path(tree: DraftTree, node: int) -> tuple[int, ...]:
            return ctx + tuple(tree.tokens[n] for n in tree.path(node)) if node != ROOT else ctx

        tree = DraftTree()
        grow_tree(tree, [(ROOT, draft_table[ctx])],
                  lambda t, nodes: torch.stack([draft_table[path(t, n)] for n in nodes]), ROUND_SHAPE, params,
                  noise, CONTEXT + list(ctx))
        ctx += tuple(verifier(tree, lambda node: target_logits(target, path(tree, node), params), params,
                              noise, len(CONTEXT) + len(ctx)).tokens(tree))
    return ctx[0], ctx[1]


def chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of a chi-square goodness-of-fit test, cells with expected < 5 pooled."""
    impossible = expected == 0
    if counts[impossible].sum() > 0:
        return 0.0
    counts, expected = counts[~impossible], expected[~impossible]
    small = expected < 5
    obs = torch.cat([counts[~small], counts[small].sum().reshape(1)]) if small.any() else counts
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)]) if small.any() else expected
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2), torch.tensor(stat / 2)))


def first_when_possible(tree, node, logits, params, noise, position, depth=1, trials=None):
    """A plausible-looking but wrong rule (a lax "typical acceptance"): take the draft's first candidate whenever the
    target's nucleus holds it, else judge as `verify` does."""
    p, first = probabilities(logits, params), (tree.candidates.get(node) or [None])[0]
    if first is not None and p[first] > 0:
        return tree.child(node, first), first
    return judge(tree, node, logits, params, noise, position, depth, trials)


def verify_first_when_possible(tree, target_logits, params, noise, position) -> Verdict:
    """`verify` with `first_when_possible` at every node."""
    verdict, node = Verdict([], 0), ROOT
    while True:
        child, token = first_when_possible(tree, node, target_logits(node), params, noise,
                                           position + len(verdict.path))
        if child is None:
            verdict.bonus = token
            return verdict
        node = child
        verdict.path.append(node)


@pytest.mark.slow  # 3 s or more: out of `make test-fast`
@pytest.mark.parametrize("verifier,exact,penalty", [(verify, True, 1.0), (verify_first_when_possible, False, 1.0),
                                                   (verify, True, 1.5)],
                         ids=["noise-keyed-draws", "wrong-rule", "repetition-penalty"])
def test_speculative_sampling_leaves_the_target_distribution(tiny_vocab_logits, verifier, exact, penalty):
    """The penalised case: the draft proposes from its own penalised distribution, each target node is
    penalised by its own path, and two tokens still follow the penalised target exactly."""
    target, draft_table = tiny_vocab_logits
    params = SamplingParams(temperature=0.9, top_p=0.9, repetition_penalty=penalty)
    counts = torch.zeros(VOCAB * VOCAB)
    for i in range(SAMPLES):
        a, b = two_tokens(target, draft_table, params, Noise(i), verifier)
        counts[a * VOCAB + b] += 1
    first = probabilities(target_logits(target, (), params), params)
    expected = torch.stack([first[a] * probabilities(target_logits(target, (a,), params), params)
                            for a in range(VOCAB)]).reshape(-1) * SAMPLES
    p = chi_square_p(counts, expected)
    assert (p > 0.01) if exact else (p < 0.01), f"chi-square p = {p:.3g}"


# --- tuner ----------------------------------------------------------------------------------------
def test_calibration_says_how_often_the_target_takes_a_candidate():
    """Before anything is judged a candidate is worth the draft's own probability; then what was judged, per
    probability bin and rank."""
    calibration = Calibration()
    assert calibration.chance(0.1, 0) == pytest.approx(0.1)
    for k in range(200):
        calibration.record(0.1, 0, k < 80)
        calibration.record(0.1, 1, k < 10)
    assert calibration.chance(0.1, 0) == pytest.approx(0.4, abs=0.01)
    assert calibration.chance(0.1, 1) == pytest.approx(0.05, abs=0.01)
    assert calibration.chance(0.5, 0) == pytest.approx(0.5)  # another bin: nothing judged there


class CountingTarget(speculate.Eager):
    """A synchronous target that counts the steps sent and not collected yet."""

    def __init__(self, forward):
        super().__init__(forward)
        self.outstanding = self.most = 0

    def submit(self, ids, start, mask, keep, cancel=False):
        self.outstanding += 1
        self.most = max(self.most, self.outstanding)
        return super().submit(ids, start, mask, keep, cancel)

    def collect(self, handle):
        self.outstanding -= 1
        return super().collect(handle)

    def discard(self, handle):
        self.outstanding -= 1


def test_pipelined_steps_rank_places_by_what_the_target_took_and_replace_dead_steps(tinycode):
    """The walk counts how often the target took each candidate, by its rank and the draft's q (what pipelined
    steps rank places by): greedy takes one candidate a node, first ones mostly, third ones rarely, and a second
    candidate is worth less than a first one the draft gave the same q. A step hung under a branch the walk left
    frees its place in flight at once, so more steps are out than the plan keeps live."""
    capacity = 900
    session = tinycode.open(capacity)
    target = CountingTarget(lambda t, s, m, k: tinycode.forward(session, t, s, m, k))
    tuner, report = Tuner(depth=2, width=2, in_flight=4), SpecReport()
    speculative_generate(target, draft(tinycode), PROMPT, 60, GREEDY, tuner, report=report, max_length=capacity,
                         max_in_flight=4)
    tinycode.close(session)

    def taken(rank: int) -> tuple[float, float]:
        judged, took = map(sum, zip(*(c for (r, _), c in tuner.calibration.counts.items() if r == rank),
                                    strict=True))
        return judged, took / judged
    judged, share = taken(0)
    assert judged >= 20 and share > 0.5
    assert taken(2)[1] < 0.1  # third candidates: rarely
    assert tuner.calibration.chance(0.3, 1) < tuner.calibration.chance(0.3, 0)
    assert max(report.in_flight) == 4 and target.most > 4


def test_a_pipelined_fresh_tree_sends_its_first_levels_ahead_and_the_places_are_the_likeliest(tinycode):
    """After a miss the walk most often misses again in the fresh tree's first levels: those go out as a step of
    their own as soon as they are drafted (small, so back sooner), the deeper levels under all its leaves next.
    The continuations' places, found best first, are the likeliest of all the places under the walk's node."""
    session = tinycode.open(400)

    def forward(t, s, m, k):
        return tinycode.forward(session, t, s, m, k)
    first = int(forward(torch.tensor(PROMPT), 0, None, None)[-1].argmax())
    the_draft = draft(tinycode)
    the_draft.reset(400)
    tuner = Tuner(depth=5, width=2, in_flight=3)
    spec = speculate.Speculation(speculate.Flight(speculate.Eager(forward), 3, tuner.costs),
                                 KVLayout(len(PROMPT), capacity=400), the_draft, Sampling(GREEDY, None), tuner,
                                 PROMPT + [first], lambda token: True, SpecReport())
    spec.fill()
    (ahead, rest, _continuation), tree = spec.flight.steps, spec.tree  # three in flight, as pinned
    tinycode.close(session)

    def below(node: int) -> int:
        return tree.depths[node] - tree.depths[spec.at]
    assert ahead.rows[0] == spec.at and max(map(below, ahead.rows)) == speculate.FRESH_AHEAD
    assert len(ahead.rows) <= 1 + 2 + 4
    leaves = [n for n in ahead.rows if below(n) == speculate.FRESH_AHEAD]
    assert len(leaves) == 4
    assert {below(n) for n in rest.rows} == {3, 4, 5}
    assert {tree.parents[n] for n in rest.rows if below(n) == 3} == set(leaves)

    chance = tuner.calibration.chance  # every place, searched exhaustively
    places, stack = [], [(spec.at, 1.0)]
    while stack:
        node, p = stack.pop()
        children = tree.children(node)
        if node not in tree.dists:
            places.append(p)
        elif len(tree.candidates[node]) < speculate.MAX_CANDIDATES and tree.untried(node) is not None:
            places.append(p * chance(tree.untried(node)[1], len(children)))
        stack += [(c, p * chance(*spec.drafted[c])) for c in children if c in spec.kv.slots]

    def reach(node: int) -> float:
        p = 1.0
        while node != spec.at:
            p, node = p * chance(*spec.drafted[node]), tree.parents[node]
        return p
    found = spec.frontier(6)
    values = [reach(n) * (1.0 if t is None else chance(float(tree.dists[n][t]), len(tree.children(n))))
              for n, t in found]
    assert len(places) > 20 and len(found) == 6
    assert values == pytest.approx(sorted(places, reverse=True)[:6])


@pytest.mark.parametrize("a,best", [(0.6, 6), (0.7, 8), (0.8, 12), (0.9, 21)])
def test_tuner_chain_depth_matches_the_closed_form(a, best):
    stats, costs = AcceptanceStats(constant=a), RoundCosts(draft_level_s=0.005, fixed_s=0.033 + 0.280)
    chosen = Tuner(stats, costs, width=1).choose()
    closed = [(1 - a ** (k + 1)) / (1 - a) / (k * 0.005 + 0.313) for k in range(1, 33)]
    assert chosen.widths == (1,) * chosen.depth
    assert chosen.depth == best or rate(chosen, stats, costs) >= 0.995 * max(closed)
    assert rate(chosen, stats, costs) == pytest.approx(closed[chosen.depth - 1])


def test_tuner_widens_trees_on_a_slow_ring_and_narrows_them_on_a_thin_link():
    stats = AcceptanceStats()
    for _ in range(200):  # first candidate accepted half the time, the second a third of the rest
        stats.record(1, 0, True), stats.record(1, 0, False), stats.record(1, 1, True), stats.record(1, 1, False)
        stats.record(1, 1, False)
    slow_ring = Tuner(stats, RoundCosts(0.001, 0.3, 0.0)).choose()
    thin_link = Tuner(stats, RoundCosts(0.001, 0.3, 0.02)).choose()
    assert max(slow_ring.widths) > 1
    assert thin_link.nodes < slow_ring.nodes and thin_link.min_path_prob > 0


class TableTarget:
    """The target as a logits table behind the stages' KV rules: a row sees every position before the window,
    the window positions its mask marks, and its own ancestors in the step; `keep` compacts first. Steps run
    when submitted, in order, as a push chain runs them, however many are in flight."""

    def __init__(self, logits_after: Callable[[tuple[int, ...]], torch.Tensor], prompt: list[int]):
        self.logits_after, self.kv = logits_after, list(prompt)

    def submit(self, ids, start, mask, keep, cancel=False):
        if keep is not None:
            self.kv[keep[0]:] = [self.kv[keep[0] + i] for i in keep[1]]
        del self.kv[start:]
        new = ids.tolist()
        window = self.kv[start - (mask.shape[1] - len(new)):] + new if mask is not None else None
        rows = []
        for i in range(len(new)):
            if mask is None:
                seq = self.kv + new[:i + 1]
            else:
                seq = self.kv[:start - (mask.shape[1] - len(new))] + [t for t, m in zip(window, mask[i]) if m]
            rows.append(self.logits_after(tuple(seq)))
        self.kv += new
        return torch.stack(rows), 0.0

    def collect(self, handle):
        return handle

    def discard(self, handle):
        pass


class TableDraft:
    """The draft as a logits table (`DraftModel.propose` over looked-up logits)."""

    def __init__(self, logits_after: Callable[[tuple[int, ...]], torch.Tensor]):
        self.logits_after = logits_after

    def reset(self, max_length):
        pass

    def close(self):
        pass

    def propose_many(self, committed, paths, shape, params, noise=None):
        tree = DraftTree()
        ends = [tree.insert(path) for path in paths]

        def level(tree, nodes):
            return torch.stack([self.logits_after(tuple(committed + tree.path_tokens(n))) for n in nodes])
        roots = [(end, self.logits_after(tuple(committed + tree.path_tokens(end)))) for end in dict.fromkeys(ends)]
        grow_tree(tree, roots, level, shape, params, noise, committed)
        return tree, ends


@pytest.mark.slow  # (14-28 s each: thousands of pipelined rounds)
@pytest.mark.parametrize("exact", [True, False], ids=["noise-keyed-draws", "wrong-rule"])
def test_pipelined_sampling_leaves_the_target_distribution(tiny_models, exact, monkeypatch):
    """Three steps in flight, trees hung under the two likeliest leaves of those before: three tokens (the
    first drawn from the prompt's logits, two through pipelined steps) follow the target exactly, and a
    wrong rule is caught."""
    if not exact:
        monkeypatch.setattr(speculate, "judge", first_when_possible)
    target, draft_table = tiny_models
    params = SamplingParams(temperature=0.9, top_p=0.9)
    counts = torch.zeros(VOCAB ** 3)
    report = SpecReport()
    for i in range(PIPELINED_SAMPLES):
        out = speculative_generate(TableTarget(target, CONTEXT), TableDraft(draft_table), CONTEXT, 3, params,
                                   Tuner(depth=1, width=2, in_flight=3), noise=Noise(1000 + i), report=report,
                                   max_in_flight=3)
        a, b, c = out.tokens
        counts[(a * VOCAB + b) * VOCAB + c] += 1
    assert max(report.in_flight) == 3 and report.cancelled > 0  # continuations were sent, and some dropped

    def dist(ctx: tuple[int, ...]) -> torch.Tensor:
        return probabilities(target(tuple(CONTEXT) + ctx), params)
    expected = torch.stack([dist(())[a] * dist((a,))[b] * dist((a, b)) for a in range(VOCAB)
                            for b in range(VOCAB)]).reshape(-1) * PIPELINED_SAMPLES
    p = chi_square_p(counts, expected)
    assert (p > 0.01) if exact else (p < 0.01), f"chi-square p = {p:.3g}"


def stats_at(a: float, later: float = 0.3) -> AcceptanceStats:
    """Acceptance measured at every depth: the first candidate `a` of the time, each later one `later`."""
    stats = AcceptanceStats()
    for d in range(1, MAX_DEPTH + 1):
        for i, rate_i in enumerate((a, later, later, later)):
            for k in range(100):
                stats.record(d, i, k < 100 * rate_i)
    return stats


def test_pipelined_plans_on_long_rings_at_good_acceptance_and_serial_rounds_elsewhere():
    """The closed form with one step in flight is the serial rate; the tuner keeps steps in flight on a long
    ring when the draft is good, and serial rounds on a short ring, at poor acceptance (once measured), or
    once pipelined plans measured slower than their closed form said."""
    costs = RoundCosts(draft_level_s=0.002, fixed_s=0.3, per_token_s=0.0)
    good = stats_at(0.8)
    tree = Tuner(good, costs).choose()
    assert Rates(good, costs).rate(tree, 1) == pytest.approx(rate(tree, good, costs))
    long_ring = Tuner(good, costs).plan()
    assert long_ring.depth > 1 and long_ring.rate >= 1.05 * long_ring.serial_rate
    assert Tuner(good, RoundCosts(0.002, 0.004, 0.0)).plan().depth == 1  # short ring: a step is barely a draft
    poor = Tuner(stats_at(0.2, 0.05), costs)  # the next outcome is rarely covered: tried once at most
    tried = poor.plan()
    assert tried.rate < 1.05 * tried.serial_rate
    poor.observe_pipelined(tried.model_rate, tried.model_rate)
    assert poor.plan().depth == 1
    measured_slower = Tuner(good, costs)
    for _ in range(10):
        measured_slower.observe_pipelined(long_ring.model_rate, 0.8 * long_ring.serial_rate)
    assert measured_slower.plan().depth == 1


def test_a_steps_keep_moves_the_committed_nodes_to_the_front_then_the_live_ones_and_drops_the_rest():
    """The layout the entry assumes of every stage's KV: 5 committed tokens, then one step of nodes 0..3 (0 the
    walk's node, 0 -> 1 -> 2 and 0 -> 3). The walk commits 1; only 2 is still committable."""
    kv = KVLayout(5, capacity=16)
    kv.spine = {0}
    assert kv.place([0, 1, 2, 3]) == 5 and kv.end == 9
    kv.spine.add(1)
    keep, live, forgotten = kv.compact(1, alive=lambda node: node == 2)
    assert keep == (5, [0, 1, 2]) and live == [2] and forgotten == [0, 3]  # 0 and 1 are in base now
    assert (kv.base, kv.slots, kv.end, kv.spine) == (7, {2: 7}, 8, {1})
    # nothing moved since: the next step carries no keep (the stages compact nothing)
    assert kv.compact(1, alive=lambda node: True) == (None, [2], [])
    assert kv.place([4]) == 8


class _Recorded:
    """A target that records what it was sent and answers only when asked to, on `clock`."""

    def __init__(self, clock):
        self.sent, self.discarded, self.clock = [], [], clock

    def submit(self, ids, start, mask, keep, cancel=False):
        self.sent.append((ids.tolist(), start, keep, cancel))
        return len(self.sent) - 1

    def collect(self, handle):
        return torch.full((len(self.sent[handle][0]), 4), float(handle)), self.clock()

    def discard(self, handle):
        self.discarded.append(handle)


def test_steps_in_flight_come_back_oldest_first_and_a_cancel_rides_with_the_next_step_only():
    now = [100.0]
    target = _Recorded(lambda: now[0])
    costs = Tuner().costs
    flight = speculate.Flight(target, 3, costs, clock=lambda: now[0])
    mask = torch.ones(1, 1, dtype=torch.bool)
    assert flight.until_due() == float("inf")
    for i in range(3):
        flight.send(torch.tensor([i]), [i], 5 + i, mask, None, 0.001, 1, continuation=i > 0)
        now[0] += 0.01
    # the oldest is due a pass after it was sent: the ring's fixed cost and one row's
    assert flight.until_due() == pytest.approx(costs.fixed_s + costs.per_token_s - 0.03)
    step, logits = flight.receive()
    assert step.rows == [0] and float(logits[0, 0]) == 0.0 and len(flight) == 2
    assert flight.live(lambda node: node == 2) == 1  # the step of node 1 is dead for good
    assert flight.live(lambda node: True) == 1
    assert flight.cancel() == (2, 2) and target.discarded == [1, 2] and len(flight) == 0
    flight.send(torch.tensor([7]), [7], 8, mask, (5, [0]), 0.001, 1, continuation=False)
    flight.send(torch.tensor([8]), [8], 9, mask, None, 0.001, 1, continuation=True)
    assert [cancel for *_, cancel in target.sent] == [False, False, False, True, False]
    assert flight.cancel() == (2, 2) and flight.cancel() == (0, 0)
    flight.send(torch.tensor([9]), [9], 8, mask, None, 0.001, 1, continuation=False)
    assert target.sent[-1][-1] is True  # one cancel flag however many cancels came before the step
