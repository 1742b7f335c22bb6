"""Data plane: an entry generating through stage servers on real nodes (push chain and client hops)."""
from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch

from beeswarm.client.dataplane import Inbox, PipelineOptions, RemotePipeline, StageBusy, StageFailed
from beeswarm.contributor.sessions import Sessions
from beeswarm.contributor.stage import StageServer
from beeswarm.generation.generate import generate
from beeswarm.generation.sampling import SamplingParams
from beeswarm.protocol import encode, ids
from beeswarm.protocol.coordinator import Stage
from beeswarm.protocol.step import CacheState, Keep, Step
from beeswarm.shard import EntryModel, Span, SpanRuntime, tensors
from helpers import reference_greedy, wait_for

SPLITS = [(0, 3), (3, 5), (5, 8)]


def pipeline(node, entry, route, **options) -> RemotePipeline:
    """A pipeline from `node` (its result inbox started on first use)."""
    if not hasattr(node, "inbox"):
        node.inbox = Inbox(node).start()
    return RemotePipeline(node, node.inbox, entry, tuple(route), PipelineOptions(**options))


@pytest.fixture
def chain(mesh, tiny_llama):
    """Three stage nodes serving the tiny model's spans, and an entry node connected to all."""
    stages = mesh(3, members=False)
    servers = []
    for node, (a, b) in zip(stages, SPLITS):
        servers.append(StageServer(node, SpanRuntime(tiny_llama, Span(a, b), dtype="float32", device="cpu")).start())
    (entry_node,) = mesh(1, members=False, bootstrap=[])
    for node in stages:
        entry_node.connect(node.addrs[0])
    for a, b in zip(stages, stages[1:]):
        a.connect(b.addrs[0])
    entry = EntryModel(tiny_llama, dtype="float32", device="cpu")
    route = tuple(Stage(node=node.peer_id, span=Span(a, b)) for node, (a, b) in zip(stages, SPLITS))
    yield entry_node, entry, route, stages, servers
    for server in servers:
        server.stop()


@pytest.mark.parametrize("mode", ["push", "hops"])
def test_greedy_through_the_swarm_equals_transformers(chain, tiny_llama, mode):
    entry_node, entry, route, _, _ = chain
    pipe = pipeline(entry_node, entry, route, mode=mode)
    for prompt in ([5, 6, 7], [100, 3, 250, 17, 9, 1, 42]):
        session = pipe.open(64)
        got = generate(lambda t, s: pipe.forward(session, t, s), prompt, 16, SamplingParams())
        pipe.close_session(session)
        assert got.tokens == reference_greedy(tiny_llama, prompt, 16)
    assert pipe.wire_bytes > 0 and pipe.raw_bytes > 0


def test_concurrent_sessions_and_compression_give_identical_tokens(chain, tiny_llama):
    entry_node, entry, route, _, servers = chain
    slow_link = pipeline(entry_node, entry, route, link_bytes_per_s=1e6)  # forces compressed frames
    # 40-token prompts: prefill frames of 10 KB, above the size where the policy starts compressing
    prompts = [[(7 * i + j) % 250 + 1 for j in range(40)] for i in range(8)]
    results = {}

    def run(i):
        try:
            session = slow_link.open(64)
            results[i] = generate(lambda t, s: slow_link.forward(session, t, s), prompts[i], 10,
                                  SamplingParams()).tokens
            slow_link.close_session(session)
        except Exception as e:  # noqa: BLE001 - reported below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, prompt in enumerate(prompts):
        assert results.get(i) == reference_greedy(tiny_llama, prompt, 10), results.get(i)
    assert slow_link.wire_bytes < slow_link.raw_bytes  # compression was on
    assert sum(s.traffic.steps for s in servers) >= 3 * 8 * 10


def test_hostile_steps_get_errors_and_other_sessions_keep_working(chain, tiny_llama, mesh):
    entry_node, entry, route, stages, _ = chain
    pipe = pipeline(entry_node, entry, route)
    good = pipe.open(32)
    first = generate(lambda t, s: pipe.forward(good, t, s), [1, 2, 3], 4, SamplingParams()).tokens

    with pytest.raises(StageFailed, match="past max_length"):
        pipe.forward(pipe.open(8), torch.arange(12), 0)
    failed = pipe.open(8)
    with pytest.raises(StageFailed, match="tree mask: .* above the 1-byte limit"):  # a window before position 0
        pipe.forward(failed, torch.tensor([1]), 0, tree_mask=torch.ones(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="a step of it failed"):  # its cache is in no state the entry can name
        pipe.forward(failed, torch.tensor([1]), 0)
    with pytest.raises(ValueError, match="not open on this pipeline"):
        pipe.forward("no-such-session", torch.tensor([1]), 0)
    bad = pipe.open(8)
    # wrong shape and dtype, garbage, and a frame that is not a frame, straight onto the first stage
    # Well-formed steps with wrong contents get error replies (no strike: the entry's own session).
    channel = entry_node.open_channel(route[0].node, ids.STEP)
    step = Step(entry=entry_node.peer_id, session=bad, step=10**6, start=0, frame=tensors.encode(torch.zeros(1, 64)),
                expect=CacheState(0, 0))
    # a step expecting a cache the session's is not in (a step before it lost): refused, nothing run
    pipe.inbox.expect((bad, 7))
    channel.send(encode(msgspec.structs.replace(step, step=7, expect=CacheState(12, 1))))
    _, refused, _ = pipe.inbox.wait((bad, 7), 10)
    assert refused.stale and "expects a cache of 12 positions after 1 keeps" in refused.error
    for frame in (tensors.encode(torch.zeros(2, 3)), tensors.encode(torch.zeros(2, 64, dtype=torch.int64)), b"junk"):
        channel.send(encode(msgspec.structs.replace(step, frame=frame)))
    channel.send(encode(msgspec.structs.replace(step, keep=Keep(0, (99,)))))  # a kept node out of range
    # Malformed ones (garbage, a bad keep, an oversized keep) from another peer: struck, then banned.
    (evil,) = mesh(1, members=False, bootstrap=[])
    evil.connect(stages[0].addrs[0])
    hostile = evil.open_channel(route[0].node, ids.STEP)
    raw = msgspec.msgpack.decode(encode(step))
    # a step that would cancel the good session's later steps: only that session's previous hop may
    for body in (msgspec.msgpack.encode({**raw, "session": good, "step": 10**9, "cancel": True}),
                 b"\xff" * 100, msgspec.msgpack.encode({**raw, "keep": "garbage"}),
                 msgspec.msgpack.encode({**raw, "keep": [0, list(range(5000))]})):
        hostile.send(body)
    wait_for(lambda: stages[0].bans.is_banned(evil.peer_id), 5, "the hostile peer to be banned")
    # the good session carries on where it was
    more = generate(lambda t, s: pipe.forward(good, t, s), [1, 2, 3] + first, 4, SamplingParams()).tokens
    assert first + more == reference_greedy(tiny_llama, [1, 2, 3], 8)


def test_micro_batched_prefill_equals_one_batch(chain, tiny_llama):
    entry_node, entry, route, _, _ = chain
    pipe = pipeline(entry_node, entry, route)
    prompt = torch.tensor([(13 * i) % 250 + 1 for i in range(23)])
    whole, cut = pipe.open(32), pipe.open(32)
    torch.testing.assert_close(pipe.forward(cut, prompt, 0, micro_batches=4), pipe.forward(whole, prompt, 0),
                               atol=1e-5, rtol=0)
    # the sessions carry on identically after the chunked prefill
    nxt = torch.tensor([7])
    torch.testing.assert_close(pipe.forward(cut, nxt, 23), pipe.forward(whole, nxt, 23), atol=1e-5, rtol=0)


def test_sessions_expire_when_idle_and_need_memory(mesh, tiny_llama):
    (stage_node,) = mesh(1, members=False)
    runtime = SpanRuntime(tiny_llama, Span(0, 8), dtype="float32", device="cpu")
    now = [0.0]
    server = StageServer(stage_node, runtime, Sessions(runtime.kv_bytes(100), idle_timeout_s=0.4,
                                                         clock=lambda: now[0])).start()
    (entry_node,) = mesh(1, members=False, bootstrap=[])
    entry_node.connect(stage_node.addrs[0])
    pipe = pipeline(entry_node, EntryModel(tiny_llama, dtype="float32", device="cpu"),
                    [Stage(node=stage_node.peer_id, span=Span(0, 8))])
    with pytest.raises(StageBusy, match="no memory for a session of 200 tokens"):  # full, not faulty
        pipe.open(200)
    session = pipe.open(60)
    pipe.forward(session, torch.tensor([1, 2, 3]), 0)
    with pytest.raises(StageBusy, match="no memory"):
        pipe.open(60)  # 60 + 60 > 100 tokens' worth
    now[0] += 1.0  # idle past the timeout: the session is closed (within a tick of the stage's loop)
    wait_for(lambda: not server.sessions, 5, "the idle session to expire")
    with pytest.raises(StageFailed, match="unknown session"):
        pipe.forward(session, torch.tensor([4]), 3)
    pipe.open(60)


def test_a_session_refused_by_a_later_stage_is_closed_on_the_earlier_ones(mesh, tiny_llama):
    first, second = mesh(2, members=False)
    servers = [StageServer(first, SpanRuntime(tiny_llama, Span(0, 4), dtype="float32", device="cpu")).start()]
    runtime = SpanRuntime(tiny_llama, Span(4, 8), dtype="float32", device="cpu")
    servers.append(StageServer(second, runtime, Sessions(runtime.kv_bytes(10))).start())
    (entry_node,) = mesh(1, members=False, bootstrap=[])
    for node in (first, second):
        entry_node.connect(node.addrs[0])
    first.connect(second.addrs[0])
    pipe = pipeline(entry_node, EntryModel(tiny_llama, dtype="float32", device="cpu"),
                    [Stage(node=first.peer_id, span=Span(0, 4)), Stage(node=second.peer_id, span=Span(4, 8))])
    with pytest.raises(StageBusy):
        pipe.open(50)
    assert not servers[0].sessions  # nothing left holding the first stage's memory until it idles out
    for server in servers:
        server.stop()


def test_concurrent_opens_share_the_memory_budget_exactly(mesh, tiny_llama):
    """Sixteen entries' sessions opened at once: exactly the budget's worth succeed, the rest are refused."""
    (stage_node,) = mesh(1, members=False)
    runtime = SpanRuntime(tiny_llama, Span(0, 8), dtype="float32", device="cpu")
    StageServer(stage_node, runtime, Sessions(runtime.kv_bytes(50) * 5)).start()
    (entry_node,) = mesh(1, members=False, bootstrap=[])
    entry_node.connect(stage_node.addrs[0])
    pipe = pipeline(entry_node, EntryModel(tiny_llama, dtype="float32", device="cpu"),
                    [Stage(node=stage_node.peer_id, span=Span(0, 8))])
    outcomes: list[str] = []

    def open_one():
        try:
            pipe.open(50)
            outcomes.append("opened")
        except StageFailed as e:
            outcomes.append(str(e))

    threads = [threading.Thread(target=open_one) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes.count("opened") == 5
    assert all("no memory" in o for o in outcomes if o != "opened"), outcomes


def test_a_span_the_plan_drops_drains_its_sessions_before_it_is_freed(mesh, tiny_llama):
    """A migration's end: the old span serves the sessions in flight to their end, and no new ones."""
    (stage_node,) = mesh(1, members=False)
    old, new = Span(0, 8), Span(0, 4)
    server = StageServer(stage_node, SpanRuntime(tiny_llama, old, dtype="float32", device="cpu")).start()
    server.add(SpanRuntime(tiny_llama, new, dtype="float32", device="cpu"))
    (entry_node,) = mesh(1, members=False, bootstrap=[])
    entry_node.connect(stage_node.addrs[0])
    pipe = pipeline(entry_node, EntryModel(tiny_llama, dtype="float32", device="cpu"),
                    [Stage(node=stage_node.peer_id, span=old)])
    prompt = [5, 6, 7]
    session = pipe.open(64)
    tokens: list[int] = []

    def forward(t, s):
        if len(tokens) == 4:  # mid-generation: the plan moves on to the new span
            server.keep_only({new})
            assert server.spans == (new,)
        return pipe.forward(session, t, s)

    got = generate(forward, prompt, 12, SamplingParams(), on_token=tokens.append)
    assert got.tokens == reference_greedy(tiny_llama, prompt, 12)  # the session in flight went on to its end
    with pytest.raises(StageBusy, match="not layers"):
        pipe.open(64)  # no new session on a draining span (and no fault of the stage's)
    assert old in server.runtimes
    pipe.close_session(session)
    assert old not in server.runtimes and server.spans == (new,)  # its last session ended: freed
    server.stop()


def test_a_stage_that_stops_beating_fails_the_waiting_step_at_once_and_may_come_back(chain, tiny_llama):
    """A frozen stage (SIGSTOP: its connection stays up) is known by its silence; the entry fails the step
    then instead of after the 30 s step timeout, and routes through it again once it beats again."""
    entry_node, entry, route, stages, servers = chain
    pipe = pipeline(entry_node, entry, route)
    session = pipe.open(64)
    pipe.forward(session, torch.tensor([5, 6, 7]), 0)
    servers[1].pause()  # frozen; its node stays connected
    threading.Timer(0.5, pipe.lose, (stages[1].peer_id, "stopped beating")).start()
    t0 = time.monotonic()
    with pytest.raises(StageFailed, match="stopped beating") as e:
        pipe.forward(session, torch.tensor([8]), 3)
    assert e.value.peer == stages[1].peer_id and time.monotonic() - t0 < 10  # not the 30 s step timeout
    servers[1].resume()
    pipe.found(stages[1].peer_id)  # it beats again
    session = pipe.open(64)
    got = generate(lambda t, s: pipe.forward(session, t, s), [5, 6, 7], 8, SamplingParams())
    assert got.tokens == reference_greedy(tiny_llama, [5, 6, 7], 8)
