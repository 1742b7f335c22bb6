"""Many users at once, exactly: concurrent speculative sessions through real stage servers."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from beeswarm.audit.auditor import entry_auditor
from beeswarm.client.dataplane import Inbox, RemotePipeline, SessionSteps
from beeswarm.contributor.stage import StageServer
from beeswarm.generation.generate import generate
from beeswarm.generation.sampling import Noise, SamplingParams
from beeswarm.protocol.coordinator import Stage
from beeswarm.protocol.spans import even_splits
from beeswarm.shard import EntryModel, SpanRuntime, checkpoint
from beeswarm.spec.draft import DraftModel
from beeswarm.spec.speculate import SpecReport, speculative_generate
from beeswarm.spec.tuner import MAX_TREE_NODES, Tuner

pytestmark = pytest.mark.slow  # a swarm of real nodes, 8 users at once: `make test` only

USERS = 8
TOKENS = 16


class Gate(threading.Event):
    """Set: passes go through. Clear: a pass waits for it inside the layers (`held` says one does)."""

    def __init__(self):
        super().__init__()
        self.held = threading.Event()
        self.set()

    def hold(self) -> None:
        self.held.clear()
        self.clear()


class GatedLayer(torch.nn.Module):
    """A decoder layer that, while `gate` is clear, waits for it before computing: its pass is a long one."""

    def __init__(self, layer: torch.nn.Module, gate: Gate):
        super().__init__()
        self.layer, self.gate = layer, gate

    def forward(self, *args, **kwargs):
        if not self.gate.is_set():
            self.gate.held.set()
            self.gate.wait(30)
        return self.layer(*args, **kwargs)


class ComputeBound(SpanRuntime):
    """A span whose every batched pass takes `pass_s` longer: a stage slower than its entries (a real model's
    compute), so steps queue behind each other and cancels land on queued ones. While `gate` is clear, a pass
    waits for it inside its first layer: the stage is busy, and what arrives queues."""

    pass_s = 0.02

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = Gate()
        self.layers[0] = GatedLayer(self.layers[0], self.gate)

    def step(self, inputs):
        time.sleep(self.pass_s)  # a pass's compute, on purpose: a stage slow enough for steps to queue
        return super().step(inputs)


@pytest.fixture(scope="module")
def tinycode_swarm():
    from beeswarm.p2p import identity
    from beeswarm.p2p.node import Node, NodeConfig
    from helpers import LOCAL, Seen

    folder = checkpoint.resolve("tinycode")
    entry = EntryModel(folder, dtype="float32", device="cpu")
    spans = even_splits(entry.config.num_hidden_layers, 3)
    nodes = [Node(identity.ephemeral(), NodeConfig(listen=LOCAL, bootstrap=[])) for _ in range(len(spans) + 1)]
    for node in nodes:
        node.start()
    *stages, entry_node = nodes
    runtimes = [ComputeBound(folder, span, dtype="float32", device="cpu") for span in spans]
    servers = [StageServer(node, runtime).start() for node, runtime in zip(stages, runtimes)]
    for server, runtime in zip(servers, runtimes):
        server.runtime_gate = runtime.gate
    for node in stages:
        entry_node.connect(node.addrs[0])
    for a, b in zip(stages, stages[1:]):
        a.connect(b.addrs[0])
    route = tuple(Stage(node=node.peer_id, span=span) for node, span in zip(stages, spans))
    # every step audited, recomputed here: what a stage applies for a cancelled step, its reveal and the replay
    # must apply too, or honest stages get accused
    layers = {span: SpanRuntime(folder, span, dtype="float32", device="cpu") for span in spans}
    seen = Seen()
    auditor = entry_auditor(entry_node, 1.0, here=layers.__getitem__, reporter=seen)
    auditor.listen(seen)
    auditor.start()
    pipe = RemotePipeline(entry_node, Inbox(entry_node).start(), entry, route, auditor=auditor)
    yield pipe, folder, servers, seen
    pipe.close()
    for server in servers:
        server.stop()
    for node in nodes:
        node.stop()


def speculate(pipe: RemotePipeline, draft: DraftModel, prompt: list[int], params: SamplingParams, in_flight: int,
              seed: int | None, report: SpecReport, sessions: list[str] | None = None) -> list[int]:
    """One user's generation: its own session, draft and sampling noise."""
    max_length = len(prompt) + TOKENS + in_flight * (MAX_TREE_NODES + 1)
    session = pipe.open(max_length)
    if sessions is not None:
        sessions.append(session)
    try:
        target = SessionSteps(pipe, session) if in_flight > 1 else \
            (lambda t, s, m, k: pipe.forward(session, t, s, m, keep=k))
        tuner = Tuner(depth=3, width=2, in_flight=in_flight if in_flight > 1 else None)
        return speculative_generate(target, draft, prompt, TOKENS, params, tuner,
                                    noise=Noise(seed) if seed is not None else None,
                                    report=report, max_length=max_length, max_in_flight=in_flight,
                                    prefill=lambda ids: pipe.forward(session, ids, 0)).tokens
    finally:
        pipe.close_session(session)


def prompts() -> list[list[int]]:
    return [[(37 * i + 11 * j) % 2000 + 5 for j in range(6 + i)] for i in range(USERS)]


def all_at_once(pipe, params, in_flight, drafts, seeds, sessions=None) -> tuple[list, list[SpecReport]]:
    results: list = [None] * USERS
    reports = [SpecReport() for _ in range(USERS)]

    def user(i: int) -> None:
        try:
            results[i] = speculate(pipe, drafts[i], prompts()[i], params, in_flight, seeds[i], reports[i], sessions)
        except Exception as e:  # noqa: BLE001 - asserted below
            results[i] = e

    threads = [threading.Thread(target=user, args=(i,)) for i in range(USERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(240)
    return results, reports


@pytest.mark.slow
@pytest.mark.parametrize("in_flight", [1, 3], ids=["serial", "pipelined"])
def test_concurrent_speculative_users_each_get_plain_greedy(tinycode_swarm, in_flight):
    """Eight users speculate at once through one compute-bound swarm, round after round: every generation is
    transformers' greedy continuation, token for token. Pipelined, misses cancel steps queued at the stages."""
    from helpers import reference_greedy
    pipe, folder, servers, seen = tinycode_swarm
    drafts = [DraftModel("tinycode-draft", 2048) for _ in range(USERS)]
    sessions: list[str] = []
    for rounds in range(min(in_flight, 2)):  # (pipelined, where cancels land on queued steps: two rounds)
        results, reports = all_at_once(pipe, SamplingParams(), in_flight, drafts, [None] * USERS, sessions)
        for i, prompt in enumerate(prompts()):
            expected = reference_greedy(folder, prompt, TOKENS, repetition_penalty=1.0)
            assert results[i] == expected, f"user {i}, round {rounds}"
    if in_flight > 1:
        assert sum(r.cancelled for r in reports) > 0
    assert_audits_pass(pipe, sessions)


def assert_audits_pass(pipe: RemotePipeline, sessions: list[str]) -> None:
    """Every stage's reveal of each session, replayed, matches what it committed to: nobody accused."""
    auditor = pipe.auditor
    assert auditor.settle(sessions, timeout=120) == set()
    assert auditor.counts.failed == auditor.counts.refused == 0 and auditor.counts.passed > 0


@pytest.mark.slow
def test_concurrent_sampling_users_each_get_the_plain_answer_of_their_seed(tinycode_swarm):
    """Sampling at a fixed seed: each user's tokens, speculated in a crowd with steps pipelined and cancelled, equal
    the same seed's plain token-by-token sampling through the same stages alone."""
    pipe, _, _, _ = tinycode_swarm
    params = SamplingParams(temperature=0.8, top_p=0.95)
    seeds = list(range(100, 100 + USERS))
    alone = []
    for prompt, seed in zip(prompts(), seeds):
        session = pipe.open(len(prompt) + TOKENS)
        alone.append(generate(lambda t, s: pipe.forward(session, t, s), prompt, TOKENS, params,
                              noise=Noise(seed)).tokens)
        pipe.close_session(session)
    drafts = [DraftModel("tinycode-draft", 2048) for _ in range(USERS)]
    together, reports = all_at_once(pipe, params, 3, drafts, seeds)
    assert together == alone
    assert sum(r.cancelled for r in reports) > 0 and sum(map(sum, (r.accepted for r in reports))) > 0


def test_a_cancelled_step_queued_at_a_stage_keeps_the_cache_edits_it_carried(tinycode_swarm):
    """A step that compacts the KV (its keep) is cancelled while it waits behind another session's step: the stage
    computes nothing for it but still applies its keep, so the cancelling step runs on exactly the cache the entry
    assumed, and its logits are those of the committed sequence run plainly."""
    pipe, folder, servers, seen = tinycode_swarm
    first, gate = servers[0], servers[0].runtime_gate
    prompt = prompts()[3]
    n = len(prompt)
    session, other = pipe.open(64), pipe.open(64)
    try:
        x0 = int(pipe.forward(session, torch.tensor(prompt), 0)[-1].argmax())
        pipe.forward(other, torch.tensor(prompt), 0)
        a, b, c, y = 17, 23, 31, 45
        # a tree: x0, then a and b both under it; the walk takes x0 and b
        tree = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
        pipe.collect(session, pipe.submit(session, torch.tensor([x0, a, b]), n, tree))
        gate.hold()  # the first stage is busy with another session's step...
        blocker = pipe.submit(other, torch.tensor([x0]), n)
        assert gate.held.wait(10), "the first stage never took the other session's step"
        # ...while this session's next step (keeping x0 and b, then c under b) and a step that cancels it (the
        # target's token after b was y, not c) queue behind it
        late = pipe.submit(session, torch.tensor([c]), n + 2, None, (n, [0, 2]))
        cancelling = pipe.submit(session, torch.tensor([y]), n + 2, None, None, cancel=True)
        from helpers import wait_for
        wait_for(lambda: first.queued == 2, 10, "both steps to queue at the first stage")
        gate.set()
        pipe.discard(session, late)
        got = pipe.collect(session, cancelling)[0][-1]
        pipe.collect(other, blocker)
    finally:
        gate.set()
        pipe.close_session(session)
        pipe.close_session(other)
    check = pipe.open(64)
    try:
        expected = pipe.forward(check, torch.tensor(prompt + [x0, b, y]), 0)[-1]
    finally:
        pipe.close_session(check)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert_audits_pass(pipe, [session, other, check])  # the held step replayed as the stages applied it


def test_a_long_pass_never_holds_up_session_opens_or_a_plan_change(tinycode_swarm):
    """While a stage's layers run a long pass (a big prefill, an audit's replay), a new user's session still opens,
    and a plan change (in the node's loop) still goes through: neither waits for the layers."""
    pipe, _, servers, _ = tinycode_swarm
    first, gate = servers[0], servers[0].runtime_gate
    busy = pipe.open(64)
    gate.hold()
    try:
        step = pipe.submit(busy, torch.tensor(prompts()[0]), 0)
        assert gate.held.wait(10), "the first stage never started the long pass"
        t0 = time.monotonic()
        other = pipe.open(64)
        first.keep_only(set(first.spans))
        assert time.monotonic() - t0 < 5, "a session open or a plan change waited for the layers"
    finally:
        gate.set()
    pipe.collect(busy, step)
    pipe.close_session(busy)
    pipe.close_session(other)
