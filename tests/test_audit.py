"""Audits on real nodes: commitments on every step, reveals, recomputation, and evidence anyone can check.

Three stage servers on 127.0.0.1 serve the tiny model; the entry audits every step (rate 1) so a
dishonest stage is caught in its first generation. `judge` is run as a third party would: with its
own copy of the layers, trusting neither side.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import httpx
import msgspec
import pytest
import torch
from transformers import AutoTokenizer

from beeswarm.audit import DEFAULT_RATE, commitments
from beeswarm.audit.auditor import Auditor, entry_auditor
from beeswarm.audit.evidence import judge, sign_evidence, sign_verdict
from beeswarm.audit.faults import ENV, LAYER_SCALE, Fault, _token_direction
from beeswarm.audit.peer import PeerAuditService, sign_commission
from beeswarm.audit.pieces import SPOT_LAYERS
from beeswarm.audit.probation import PROBATION_STEPS, PUBLISHED_UP_TO
from beeswarm.audit.retention import LoggedStep, StepLog
from beeswarm.audit.runner import REACH_S, Candidates
from beeswarm.client.dataplane import Inbox, RemotePipeline, SentStep, SessionSteps, StageFailed
from beeswarm.contributor.local_swarm import budgets
from beeswarm.contributor.stage import StageServer
from beeswarm.generation.generate import generate
from beeswarm.generation.sampling import SamplingParams
from beeswarm.protocol import ProtocolError, RemoteError, encode, ids
from beeswarm.protocol.audit import (
    AuditAsk,
    Audited,
    AuditVerdict,
    Commission,
    Evidence,
    Reveal,
    Revealed,
    Verdict,
    commits_digest,
)
from beeswarm.protocol.coordinator import Stage
from beeswarm.protocol.rpcs import REVEAL, SESSION
from beeswarm.protocol.session import Open
from beeswarm.protocol.step import CacheState, Result, Step
from beeswarm.shard import EntryModel, Span, SpanRuntime, tensors
from beeswarm.spec.draft import DraftModel
from beeswarm.spec.speculate import speculative_generate
from beeswarm.spec.tuner import Tuner
from helpers import Seen, reference_greedy, serve, start_contributors, wait_for
from tiny_checkpoints import write_tiny_checkpoint

SPLITS = [(0, 3), (3, 5), (5, 8)]
PROMPTS = ([5, 6, 7], [100, 3, 250, 17, 9, 1, 42])


class Layers:
    """A third party's own copy of each span (what the coordinator loads to judge)."""

    def __init__(self, folder, dtype: str = "float32"):
        self.folder, self.dtype, self.loaded = folder, dtype, {}

    def __call__(self, span: Span) -> SpanRuntime:
        if span not in self.loaded:
            self.loaded[span] = SpanRuntime(self.folder, span, dtype=self.dtype, device="cpu")
        return self.loaded[span]


def no_room(span: Span) -> SpanRuntime:
    """A checker with no memory free for any layers."""
    raise MemoryError(f"layers {span} need more memory than is free")


def checked_on(steps) -> Callable[[str], dict[int, int]]:
    """A swarm's standing: every layer of each stage checked on `steps` steps (or `steps(stage)`)."""
    return lambda stage: dict.fromkeys(range(8), steps(stage) if callable(steps) else steps)


def entry_audits(node, folder, seen: Seen, rate: float, standing=0, dtype: str = "float32", **runner) -> Auditor:
    """An entry's auditor reporting to `seen`; by default it checks every audit itself with its own layers (`here`),
    else as `runner` says (candidates=..., here=None, last_resort=...)."""
    options = {"here": Layers(folder, dtype), **runner}
    auditor = entry_auditor(node, rate, standing=checked_on(standing), reporter=seen, **options)
    auditor.listen(seen)
    return auditor.start()


def swarm(mesh, folder, fault: Fault | None = None, rate: float = 1.0, standing=0, dtype: str = "float32",
          **runner):
    """Three stages (the middle one with `fault`) serving `dtype`, an entry node connected to all, its auditor
    (see `entry_audits`) and what that auditor told (`Seen`)."""
    stages = mesh(3, members=False)
    servers = [StageServer(node, SpanRuntime(folder, Span(a, b), dtype=dtype, device="cpu"),
                           fault=fault if i == 1 else None).start()
               for i, (node, (a, b)) in enumerate(zip(stages, SPLITS))]
    (entry_node,) = mesh(1, members=False, bootstrap=[])
    for node in stages:
        entry_node.connect(node.addrs[0])
    for a, b in zip(stages, stages[1:]):
        a.connect(b.addrs[0])
    seen = Seen()
    auditor = entry_audits(entry_node, folder, seen, rate, standing, dtype, **runner)
    route = tuple(Stage(node=node.peer_id, span=Span(a, b)) for node, (a, b) in zip(stages, SPLITS))
    pipe = RemotePipeline(entry_node, Inbox(entry_node).start(), EntryModel(folder, "float32", "cpu"), route,
                          auditor=auditor)
    return pipe, auditor, stages, servers, seen


def run(pipe, prompt, n=8, **forward) -> tuple[str, list[int]]:
    session = pipe.open(64)
    try:
        return session, generate(lambda t, s: pipe.forward(session, t, s, **forward), prompt, n,
                                 SamplingParams()).tokens
    finally:
        pipe.close_session(session)


def test_an_honest_swarm_passes_every_audit_plain_micro_batched_and_speculative(mesh, tiny_llama, tmp_path):
    pipe, auditor, _, servers, seen = swarm(mesh, tiny_llama)
    sessions = []
    for prompt in PROMPTS:
        session, tokens = run(pipe, prompt, micro_batches=2)
        sessions.append(session)
        assert tokens == reference_greedy(tiny_llama, prompt, 8)
    # speculative generations, serial and pipelined (windowed masks, cancelled steps): tree masks, rollbacks
    # and kept paths are replayed exactly
    draft = DraftModel(str(write_tiny_checkpoint(tmp_path / "draft", "llama", num_layers=1, seed=5)),
                       pipe.entry.config.vocab_size)
    for in_flight in 1, 3:
        session = pipe.open(256)
        sessions.append(session)
        target = SessionSteps(pipe, session) if in_flight > 1 else \
            lambda t, s, mask, keep: pipe.forward(session, t, s, mask, 1, keep)
        got = speculative_generate(target, draft, list(PROMPTS[1]), 12, SamplingParams(), Tuner(in_flight=in_flight),
                                   max_length=256, max_in_flight=in_flight)
        pipe.close_session(session)
        assert got.tokens == reference_greedy(tiny_llama, list(PROMPTS[1]), 12)
    assert auditor.settle(sessions) == set(), seen.caught
    c = auditor.counts
    # every step drawn (rate 1), and one audit a stage a session, up to its last step: each checks them all
    assert c.run == 3 * len(sessions) and c.passed == c.run and c.failed == c.refused == 0, c
    assert seen.sent == [] and seen.caught == {}
    assert all(s.reveals > 0 for s in servers)


@pytest.mark.parametrize("mode", ["noise", "identity", "bias", "noise@0.3"])
def test_a_dishonest_stage_is_caught_and_the_evidence_convinces_a_third_party(mesh, tiny_llama, mode):
    name, _, fraction = mode.partition("@")
    fault = Fault(name, float(fraction or 1), _token_direction(tiny_llama, 64) if name == "bias" else None)
    pipe, auditor, stages, _, seen = swarm(mesh, tiny_llama, fault)
    cheat = stages[1].peer_id
    sessions = [run(pipe, prompt, 12)[0] for prompt in PROMPTS]
    assert auditor.settle(sessions) == {cheat}
    assert auditor.counts.failed >= 1 and set(seen.caught) == {cheat}
    evidence = seen.sent[0]
    assert evidence.accused == cheat and evidence.kind == "wrong"
    verdict = judge(evidence, Layers(tiny_llama))
    assert verdict.upheld and verdict.excluded == cheat and "recomputation" in verdict.reason
    unchecked = judge(evidence, no_room)  # a judge that cannot recompute it excludes nobody (and does not crash)
    assert unchecked.excluded == "" and "could not be checked" in unchecked.reason


def test_a_steady_nudge_under_the_per_token_tolerance_is_caught_by_its_direction(mesh, tiny_llama):
    """bfloat16's per-token tolerance is 5% (its honest rounding reaches ~1e-2): a stage nudging every token 2.5%
    the same way passed every audit. Added up over an audit's tokens, the nudge stands out of the rounding."""
    fault = Fault("bias", 1.0, _token_direction(tiny_llama, 64), scale=0.025)
    pipe, auditor, stages, _, seen = swarm(mesh, tiny_llama, fault, dtype="bfloat16")
    cheat = stages[1].peer_id
    sessions = [run(pipe, prompt, 12)[0] for prompt in PROMPTS]
    assert auditor.settle(sessions) == {cheat}
    evidence = seen.sent[0]
    assert evidence.accused == cheat and evidence.kind == "wrong"
    verdict = judge(evidence, Layers(tiny_llama, "bfloat16"))
    assert verdict.upheld and verdict.excluded == cheat and "drift" in verdict.reason


def test_honest_bfloat16_stages_batched_with_other_sessions_are_never_accused(mesh, tiny_llama, tmp_path):
    """Honest rounding differs between a stage's batched pass and the audit's replay alone; neither a token's
    error nor the direction test may take it for a lie: sessions at once (so batches form), plain and
    speculative, every step audited."""
    pipe, auditor, _, _, seen = swarm(mesh, tiny_llama, dtype="bfloat16")
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 257) for _ in range(rng.randrange(3, 20))] for _ in range(8)]
    sessions: list[str] = []
    threads = [threading.Thread(target=lambda p=p: sessions.append(run(pipe, p, 16)[0])) for p in prompts]
    for t in threads:
        t.start()
    draft = DraftModel(str(write_tiny_checkpoint(tmp_path / "draft", "llama", num_layers=1, seed=5)),
                       pipe.entry.config.vocab_size)
    session = pipe.open(256)
    sessions.append(session)
    speculative_generate(SessionSteps(pipe, session), draft, prompts[0], 16, SamplingParams(), Tuner(in_flight=3),
                         max_length=256, max_in_flight=3)
    pipe.close_session(session)
    for t in threads:
        t.join(120)
    assert len(sessions) == 9 and auditor.settle(sessions) == set(), seen.caught
    assert seen.sent == [] and auditor.counts.passed == 3 * len(sessions)


@pytest.mark.parametrize("mode", ["identity", "noise@0.5", "bias"])
def test_a_newcomer_that_lies_is_caught_in_its_first_generation_at_the_default_rate(mesh, tiny_llama, mode):
    """Probation: a stage nobody has audited (a fresh key) has its whole session audited before the generation
    returns; at the default per-step rate (which alone caught a liar only by the 4th generation or later)."""
    name, _, fraction = mode.partition("@")
    fault = Fault(name, float(fraction or 1), _token_direction(tiny_llama, 64) if name == "bias" else None)
    pipe, auditor, stages, _, seen = swarm(mesh, tiny_llama, fault, rate=DEFAULT_RATE)
    session, _ = run(pipe, PROMPTS[1], 12)
    assert auditor.settle([session]) == {stages[1].peer_id}
    assert seen.sent[0].accused == stages[1].peer_id and seen.sent[0].kind == "wrong"


@pytest.mark.parametrize("mode", ["noise@0.3"])  # (nobody recomputes: how it lies changes nothing here)
def test_a_newcomer_nobody_can_check_has_its_tokens_taken_back_not_shown(mesh, tiny_llama, mode):
    """A newcomer serving a span no member can load (no auditor answers, the entry loads none): its audits come back
    unchecked, and unchecked is no pass. The stage is named with the caught ones (its tokens do not stand) and
    routes avoid it, though it is neither banned nor accused: nothing proves it lied."""
    name, _, fraction = mode.partition("@")
    fault = Fault(name, float(fraction or 1), _token_direction(tiny_llama, 64) if name == "bias" else None)
    pipe, auditor, stages, _, seen = swarm(mesh, tiny_llama, fault, rate=DEFAULT_RATE, here=None)  # nobody checks
    newcomer = stages[1].peer_id
    auditor.book.standing = checked_on(lambda stage: 0 if stage == newcomer else 2 * PROBATION_STEPS)
    session, _ = run(pipe, PROMPTS[1], 12)
    assert auditor.settle([session]) == {newcomer}
    assert seen.unverified == [newcomer] and auditor.counts.unchecked >= 1 and auditor.counts.failed == 0
    assert seen.sent == [] and seen.caught == {} and not pipe.node.bans.is_banned(newcomer)


def test_honest_newcomers_pass_probation_then_are_audited_less_and_the_swarms_standing_counts(mesh, tiny_llama):
    pipe, auditor, stages, _, seen = swarm(mesh, tiny_llama, rate=DEFAULT_RATE, rng=random.Random(7))
    # (the draws, fixed: the counts below are exact, not likely)
    sessions_needed = -(-PROBATION_STEPS // 16)  # 16 steps a session: every session of every stage audited whole
    for n in range(1, sessions_needed + 1):
        assert all(auditor.on_probation(s.node, s.span) for s in pipe.route)
        session, _ = run(pipe, PROMPTS[n % 2], 16)
        assert auditor.settle([session]) == set()
        assert auditor.counts.passed == 3 * n and auditor.counts.failed == 0
        assert auditor.counts.layers_checked == 8 * n  # every layer of the three spans
    assert not any(auditor.on_probation(s.node, s.span) for s in pipe.route)
    # each pass went to the coordinator with the stage's own signed word on the entry's session, every layer of
    # its span checked on all 16 steps
    assert all(commitments.verify(commit, pipe.node.peer_id, session) and layers == (commit.span,) and steps == 16
               for session, commit, layers, steps in seen.vouched)
    before = auditor.counts.run
    sessions = [run(pipe, PROMPTS[n % 2], 6)[0] for n in range(10)]
    assert auditor.settle(sessions) == set()
    # 30 were they still on probation; each pass now halves the chance of the next (about 3 each in 10 sessions)
    assert auditor.counts.run - before <= 15
    # a new entry, told by the swarm (the plan's standings) that the stages' layers were checked on many steps: no
    # probation, and a whole audit as rare as the per-step rate
    pipe, auditor, _, _, seen = swarm(mesh, tiny_llama, rate=1e-9, standing=PUBLISHED_UP_TO, rng=random.Random(7))
    assert not any(auditor.on_probation(s.node, s.span) for s in pipe.route)
    assert auditor.settle([run(pipe, PROMPTS[0], 6)[0]]) == set() and auditor.counts.run == 0


def peer_auditors(mesh, folder, stages, entry_node, count: int, kind=PeerAuditService) -> list[PeerAuditService]:
    """`count` contributors' audit services (their own copies of the layers), linked to the stages and the entry."""
    services = []
    for node in mesh(count, members=False, bootstrap=[]):
        for peer in (*stages, entry_node):
            node.connect(peer.addrs[0])
        service = kind(node, Layers(folder))
        service.start()
        services.append(service)
    return services


def test_an_entry_without_layers_audits_through_peers_and_a_lax_auditor_is_caught_by_a_second(mesh, tiny_llama):
    """The entry recomputes nothing: it commissions peer auditors. The first, lax, passes the noisy newcomer without
    checking; probation has a second auditor check it, which catches the stage; the lax auditor's signed pass is
    then evidence against it. A third party upholds both."""
    pipe, auditor, stages, _, seen = swarm(mesh, tiny_llama, Fault("noise"), rate=DEFAULT_RATE)
    lax, honest = peer_auditors(mesh, tiny_llama, stages, pipe.node, 2)
    lax.lax = True
    auditor.runner.here = None  # as `chat` and `serve` by default: no span loaded here
    # the lax one drawn first (it serves every layer; the honest one, a spare, loads what it checks)
    auditor.runner.candidates = lambda stage: Candidates({lax.node.peer_id: Span(0, 8)}, (honest.node.peer_id,))
    observed: list = []
    observe = auditor.observe
    auditor.observe = lambda session, commits: (observed.extend(commits), observe(session, commits))
    cheat = stages[1].peer_id
    session, _ = run(pipe, PROMPTS[1], 12)
    assert auditor.settle([session]) == {cheat}
    assert auditor.counts.failed == 1 and auditor.counts.auditors_caught == 1 and auditor.counts.unchecked == 0
    assert lax.audits >= 1 and honest.audits >= 1  # the honest stages were audited by peers too, and passed
    assert auditor.counts.passed >= 2
    against = {ev.accused: ev for ev in seen.sent}
    assert against[cheat].accuser == honest.node.peer_id and against[cheat].session_entry == pipe.node.peer_id
    upheld = judge(against[cheat], Layers(tiny_llama))
    assert upheld.upheld and upheld.excluded == cheat
    false_pass = against[lax.node.peer_id]
    assert false_pass.kind == "false_pass" and false_pass.verdict.passed
    verdict = judge(false_pass, Layers(tiny_llama))
    assert verdict.upheld and verdict.excluded == lax.node.peer_id and "false_pass" in verdict.reason
    # the same pass against an honest stage's commitments convicts its accuser instead
    honest_stage = stages[0].peer_id
    honest_commits = tuple(c for c in observed if c.stage == honest_stage)
    wrongly = msgspec.structs.replace(false_pass, commits=honest_commits)
    assert judge(sign_evidence(pipe.node.identity.key_pair, wrongly), Layers(tiny_llama)).excluded == pipe.node.peer_id


def holding(runtime: SpanRuntime) -> Callable[[Span], SpanRuntime]:
    """A member's audit layers: those it serves, as a view of any piece of them; nothing else fits."""
    def runtime_for(piece: Span) -> SpanRuntime:
        if not (runtime.span.start <= piece.start and piece.end <= runtime.span.end):
            raise MemoryError(f"layers {piece} do not fit beside {runtime.span}")
        return runtime.view(piece)
    return runtime_for


def whole_model_newcomer(mesh, folder, fault: Fault | None, dtype: str = "float32", spot_here: bool = False,
                         rate: float = DEFAULT_RATE, **audits):
    """The case nobody could check before: a newcomer serving every layer (no member can load them all), beside
    members serving pieces (SPLITS), each auditing with the layers it serves; the entry loads none (`spot_here`:
    it checks a piece nobody else can, the last resort). `audits`: the entry auditor's standing=, rng=."""
    (newcomer,) = mesh(1, members=False)
    server = StageServer(newcomer, SpanRuntime(folder, Span(0, 8), dtype=dtype, device="cpu"), fault=fault).start()
    (entry_node,) = mesh(1, members=False, bootstrap=[])
    entry_node.connect(newcomer.addrs[0])
    members = {}
    for node in mesh(len(SPLITS), members=False, bootstrap=[]):
        span = Span(*SPLITS[len(members)])
        PeerAuditService(node, holding(SpanRuntime(folder, span, dtype=dtype, device="cpu"))).start()
        for peer in (newcomer, entry_node):
            node.connect(peer.addrs[0])
        members[node.peer_id] = span
    seen = Seen()
    auditor = entry_audits(entry_node, folder, seen, rate, dtype=dtype, here=None,
                           last_resort=Layers(folder, dtype) if spot_here else None,
                           candidates=lambda stage: Candidates(members), **audits)
    route = (Stage(node=newcomer.peer_id, span=Span(0, 8)),)
    pipe = RemotePipeline(entry_node, Inbox(entry_node).start(), EntryModel(folder, "float32", "cpu"), route,
                          auditor=auditor)
    return pipe, auditor, server, seen


@pytest.mark.parametrize("mode", ["noise@0.3", "identity", "bias", "layer"])
def test_a_whole_model_newcomer_is_checked_layer_by_layer_by_members_serving_pieces_and_caught(mesh, tiny_llama,
                                                                                                mode):
    """Its audits came back "unchecked" and its tokens reached the user. Now it signs its layer boundaries and each
    piece is checked by a member serving it: caught in its first generation, whichever way it lies, and the
    evidence (one piece's reveal, the signed boundaries) convinces a third party holding only that piece."""
    name, _, fraction = mode.partition("@")
    fault = Fault(name, float(fraction or 1), _token_direction(tiny_llama, 64) if name == "bias" else None)
    pipe, auditor, server, seen = whole_model_newcomer(mesh, tiny_llama, fault)
    session, _ = run(pipe, PROMPTS[1], 12)
    assert auditor.settle([session]) == {server.node.peer_id}
    assert auditor.counts.failed == 1 and auditor.counts.unchecked == 0 and not seen.unverified
    evidence = seen.sent[0]
    assert evidence.accused == server.node.peer_id and evidence.kind in ("wrong", "contradiction"), evidence.detail
    if evidence.kind == "wrong":
        assert evidence.piece is not None and evidence.boundaries is not None and len(evidence.piece) < 8
        only_piece = Layers(tiny_llama)
        verdict = judge(evidence, only_piece)
        assert verdict.upheld and verdict.excluded == server.node.peer_id, verdict.reason
        assert set(only_piece.loaded) == {evidence.piece}  # it recomputed that piece, nothing more
    if name == "layer":  # its replay repeats the lie: only the piece holding the bad layer shows it
        assert evidence.kind == "wrong" and evidence.piece == Span(3, 5)


def test_a_trusted_stage_lying_in_one_layer_is_found_by_spot_checks_and_its_honest_layers_pass(mesh, tiny_llama):
    """Past probation each audit spot-checks SPOT_LAYERS of the 8 layers, drawn after the stage signed its
    boundaries: a stage that lies consistently in one layer (its replay too) passes the audits that miss it and
    is caught by the first that draws it; nobody is accused before."""
    pipe, auditor, server, seen = whole_model_newcomer(mesh, tiny_llama, Fault("layer", scale=LAYER_SCALE), rate=1.0,
                                                       standing=10 * PROBATION_STEPS, rng=random.Random(3))
    liar = server.node.peer_id
    for n in range(1, 13):  # P(no draw of layer 4 in 12 audits) = (6/8)^12 = 3%; this seed draws it
        session, _ = run(pipe, PROMPTS[n % 2], 4)
        if auditor.settle([session]) == {liar}:
            break
        assert seen.sent == [] and not seen.caught
    assert seen.caught.keys() == {liar} and seen.sent[0].piece == Span(4, 5), n
    assert auditor.counts.passed == n - 1 and auditor.counts.layers_checked == SPOT_LAYERS * (n - 1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_honest_whole_model_newcomer_passes_every_layer_by_pieces_and_earns_its_standing(mesh, tiny_llama, dtype,
                                                                                            tmp_path):
    """Honest, batched with other sessions and speculating: every piece within its tolerance and the pieces within
    the span's together; no accusation, its tokens stand, and every layer counts the steps it was checked on."""
    pipe, auditor, server, seen = whole_model_newcomer(mesh, tiny_llama, None, dtype)
    sessions: list[str] = []
    threads = [threading.Thread(target=lambda p=p: sessions.append(run(pipe, p, 12)[0])) for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    draft = DraftModel(str(write_tiny_checkpoint(tmp_path / "draft", "llama", num_layers=1, seed=5)),
                       pipe.entry.config.vocab_size)
    session = pipe.open(256)
    sessions.append(session)
    got = speculative_generate(SessionSteps(pipe, session), draft, list(PROMPTS[1]), 12, SamplingParams(),
                               Tuner(in_flight=3), max_length=256, max_in_flight=3)
    pipe.close_session(session)
    if dtype == "float32":
        assert got.tokens == reference_greedy(tiny_llama, list(PROMPTS[1]), 12)
    assert len(sessions) == 3 and auditor.settle(sessions) == set(), seen.caught
    assert seen.sent == [] and auditor.counts.passed == 3 and auditor.counts.layers_checked == 3 * 8
    assert {layers for _, _, layers, _ in seen.vouched} == {tuple(Span(*s) for s in SPLITS)}
    assert auditor.book.checks(server.node.peer_id, Span(0, 8)) == sum(steps for *_, steps in seen.vouched)


def test_a_piece_nobody_serves_is_spot_checked_by_the_entry_as_a_last_resort(mesh, tiny_llama):
    """Members serve layers 0-5 only: layers 5-8 go to the entry's own layers, one at a time (the last resort);
    a liar in them is caught all the same. The members asked for those layers answer they have no room, and are
    not asked again: the audit waits out no rounds (it waited 4 s a piece for them: a swarm of members with no
    room to spare served 9 s generations, every one of them waiting for its audits)."""
    pipe, auditor, server, seen = whole_model_newcomer(mesh, tiny_llama, Fault("noise"), spot_here=True)
    everyone = auditor.runner.candidates
    auditor.runner.candidates = lambda stage: Candidates({p: s for p, s in everyone(stage).serving.items()
                                                          if s.end <= 5})
    pauses: list[float] = []
    auditor.runner.sleep = pauses.append
    session, _ = run(pipe, PROMPTS[0], 6)
    assert auditor.settle([session]) == {server.node.peer_id}
    assert seen.sent[0].piece == Span(7, 8) and seen.sent[0].accuser == pipe.node.peer_id
    assert pauses == []


class AccusingAuditor(PeerAuditService):
    """A lying auditor: it fetches the stage's reveal and says it recomputes wrong, without recomputing."""

    def _audit(self, ask: AuditAsk) -> Audited:
        c, key, me = ask.commission, self.node.identity.key_pair, self.node.peer_id
        revealed = self.node.request(c.stage, REVEAL, Reveal(session=c.session, step=c.step, commission=c),
                                     timeout=30)
        verdict = sign_verdict(key, AuditVerdict(auditor=me, entry=c.entry, stage=c.stage, session=c.session,
                                                 step=c.step, passed=False, commits=commits_digest(ask.commits),
                                                 detail="made up"))
        return Audited(verdict, sign_evidence(key, Evidence(
            kind="wrong", accused=c.stage, accuser=me, entry=c.entry, session=c.session, span=ask.commits[0].span,
            commits=ask.commits, revealed=revealed, detail="made up")))


def test_an_auditor_that_accuses_honest_stages_is_convicted_and_they_are_cleared_at_the_entry(mesh, tiny_llama):
    """The accusations act at once (the stages are caught here); the verdict on each finds it false, convicts the
    auditor, and clears the stage at the entry: not caught, so its tokens stand and its receipts are given."""
    pipe, auditor, stages, _, seen = swarm(mesh, tiny_llama, rate=DEFAULT_RATE)
    (liar,) = peer_auditors(mesh, tiny_llama, stages, pipe.node, 1, kind=AccusingAuditor)
    auditor.runner.here = None
    auditor.runner.candidates = lambda stage: Candidates(spares=(liar.node.peer_id,))

    def coordinator(evidence: Evidence) -> Verdict:  # what the coordinator answers: `judge`'s verdict
        judged = judge(evidence, Layers(tiny_llama))
        return Verdict(excluded=judged.excluded, reason=judged.reason[:500])

    seen.verdict = coordinator
    session, tokens = run(pipe, PROMPTS[1], 8)
    assert tokens == reference_greedy(tiny_llama, PROMPTS[1], 8)
    assert auditor.settle([session]) == set()  # newcomers, each audited whole, each accused, each cleared
    assert set(seen.cleared) == {s.peer_id for s in stages} and "false accusation" in next(iter(seen.cleared.values()))
    assert [v.excluded for v in auditor.verdicts] == [liar.node.peer_id] * 3
    assert pipe.node.bans.is_banned(liar.node.peer_id) and auditor.counts.auditors_caught == 3


def test_an_auditor_that_cannot_reach_the_stage_leaves_the_audit_to_another_and_accuses_nobody(mesh, tiny_llama):
    """A contributor drawn as auditor as it joins, before its view brought it the stages' addresses, cannot reach
    them: no refusal of theirs (it was taken for one: the stages were caught, their tokens taken back, the route
    left with no stage to serve it). It says it cannot, and the next auditor checks them."""
    pipe, auditor, stages, _, seen = swarm(mesh, tiny_llama, rate=DEFAULT_RATE)
    (newcomer_node,) = mesh(1, members=False, bootstrap=[])
    newcomer_node.connect(pipe.node.addrs[0])  # it knows the entry that commissions it, none of the stages
    newcomer = PeerAuditService(newcomer_node, Layers(tiny_llama))
    newcomer.start()
    (honest,) = peer_auditors(mesh, tiny_llama, stages, pipe.node, 1)
    auditor.runner.here = None  # the newcomer drawn first
    auditor.runner.candidates = lambda stage: Candidates({newcomer.node.peer_id: Span(0, 8)}, (honest.node.peer_id,))
    session, tokens = run(pipe, PROMPTS[1], 8)
    assert tokens == reference_greedy(tiny_llama, PROMPTS[1], 8)
    assert auditor.settle([session]) == set(), seen.caught
    assert auditor.counts.refused == 0 and seen.sent == [] and newcomer.audits >= 1
    assert honest.audits >= 3  # the three newcomers on probation, each audited whole


class LinkLostAuditor(PeerAuditService):
    """An auditor whose link to the stages broke: it reports each audit as the stage's refusal."""

    def _audit(self, ask: AuditAsk) -> Audited:
        c, key, me = ask.commission, self.node.identity.key_pair, self.node.peer_id
        verdict = sign_verdict(key, AuditVerdict(auditor=me, entry=c.entry, stage=c.stage, session=c.session,
                                                 step=c.step, passed=False, commits=commits_digest(ask.commits),
                                                 detail="refused"))
        return Audited(verdict, sign_evidence(key, Evidence(
            kind="refused", accused=c.stage, accuser=me, entry=c.entry, session=c.session, span=ask.commits[0].span,
            commits=ask.commits, detail="the stream to it broke")))


def test_a_refusal_the_coordinator_finds_unfounded_clears_the_stage_at_the_entry(mesh, tiny_llama):
    """A peer auditor reports a refusal; the coordinator asks the stage itself, which reveals, and its work checks
    out: nobody is excluded (the auditor may have lost its link). The entry clears the stage: its tokens stand
    (they were taken back, and the stage kept failing the route's steps with the old reason)."""
    pipe, auditor, stages, servers, seen = swarm(mesh, tiny_llama, rate=DEFAULT_RATE)
    (lost,) = peer_auditors(mesh, tiny_llama, stages, pipe.node, 1, kind=LinkLostAuditor)
    judge_node = lost.node  # connected to every stage; plays the coordinator

    def ask(stage, entry, session, step, piece=None):
        return judge_node.request(stage, REVEAL, Reveal(session=session, step=step, entry=entry, piece=piece))

    def coordinator(evidence: Evidence) -> Verdict:
        judged = judge(evidence, Layers(tiny_llama), ask_reveal=ask)
        return Verdict(excluded=judged.excluded, reason=judged.reason[:500])

    for server in servers:
        server.chain.coordinator = lambda: judge_node.peer_id
    auditor.runner.here = None
    auditor.runner.candidates = lambda stage: Candidates(spares=(lost.node.peer_id,))
    seen.verdict = coordinator
    session, tokens = run(pipe, PROMPTS[1], 8)
    assert auditor.settle([session]) == set(), seen.caught
    assert set(seen.cleared) == {s.peer_id for s in stages} and "checks out" in next(iter(seen.cleared.values()))
    assert [v.excluded for v in auditor.verdicts] == [""] * 3 and auditor.counts.auditors_caught == 0
    assert not pipe.node.bans.is_banned(lost.node.peer_id)
    session, again = run(pipe, PROMPTS[1], 8)  # the route serves on, through the stages cleared
    assert again == tokens == reference_greedy(tiny_llama, PROMPTS[1], 8)


@pytest.mark.parametrize("on_probation", [False, True], ids=["established", "on-probation"])
def test_a_stage_that_died_mid_session_is_blamed_for_no_reveal_only_on_probation(mesh, tiny_llama, on_probation):
    """A crash is no lie: an established stage that failed during the session (the entry went on without it)
    and cannot reveal it is left unchecked, not caught, so the text already shown stands. A stage on probation
    is not trusted either: its tokens were held back, and are taken back (tried again for REACH_S first, then
    unverified: no ban, no evidence)."""
    standing = 0 if on_probation else 100
    pipe, auditor, stages, servers, seen = swarm(mesh, tiny_llama, rate=1.0, standing=standing)
    pauses: list[float] = []
    auditor.runner.sleep = pauses.append
    session = pipe.open(64)
    generate(lambda t, s: pipe.forward(session, t, s), list(PROMPTS[0]), 4, SamplingParams())
    dead = stages[1].peer_id
    auditor.gone(session, dead)  # as SwarmClient does when a step on it fails
    servers[1].stop()
    stages[1].stop()
    pipe.close_session(session)  # its audits are drawn: the dead stage's reveal cannot come
    assert auditor.settle([session]) == ({dead} if on_probation else set())
    c = auditor.counts
    assert (c.refused, c.unchecked) == (0, 1) and c.passed == 2 and seen.sent == [], c
    assert set(seen.unverified) == ({dead} if on_probation else set()) and not seen.caught
    assert sum(pauses) >= REACH_S if on_probation else pauses == []


def test_a_stage_banned_here_a_moment_for_a_lost_link_is_audited_once_it_can_be_reached(mesh, tiny_llama):
    """A stage whose link broke mid-generation is banned here for a few seconds (the route is made again around
    or through it); its audit starting meanwhile took the ban for its refusal: the honest stage was caught, its
    256 tokens taken back and the reply generated again after "[a stage was caught computing wrong]". The
    audit waits for the link, and the stage passes."""
    pipe, auditor, stages, servers, seen = swarm(mesh, tiny_llama, rate=1.0)
    session = pipe.open(64)
    tokens = generate(lambda t, s: pipe.forward(session, t, s), list(PROMPTS[0]), 6, SamplingParams()).tokens
    lost = stages[1].peer_id
    pipe.node.bans.strike(lost, "connection lost", severe=True)  # as SwarmClient's fail-over does
    auditor.runner.sleep = lambda s: pipe.node.bans.lift(lost)  # the ban runs out while the audit waits
    pipe.close_session(session)
    assert auditor.settle([session]) == set(), seen.caught
    assert auditor.counts.refused == 0 and auditor.counts.passed == 3 and seen.sent == []
    assert tokens == reference_greedy(tiny_llama, PROMPTS[0], 6)


def test_a_stage_reveals_to_an_auditor_only_with_its_entrys_signed_commission(mesh, tiny_llama):
    pipe, auditor, stages, _, seen = swarm(mesh, tiny_llama, rate=0.0)
    (service,) = peer_auditors(mesh, tiny_llama, stages, pipe.node, 1)
    session, _ = run(pipe, PROMPTS[0], 4)
    stage = stages[1].peer_id

    def ask(commission) -> Revealed:
        return service.node.request(stage, REVEAL, Reveal(session=session, step=0, commission=commission))

    signed = sign_commission(pipe.node.identity.key_pair, Commission(
        entry=pipe.node.peer_id, auditor=service.node.peer_id, stage=stage, session=session, step=0))
    assert ask(signed).stage == stage
    forged = sign_commission(service.node.identity.key_pair, msgspec.structs.replace(signed, sig=b""))
    for bad in (forged, msgspec.structs.replace(signed, step=1), msgspec.structs.replace(signed, auditor=stage)):
        with pytest.raises(RemoteError, match="commission"):
            ask(bad)
    with pytest.raises(RemoteError, match="only a session's entry"):
        service.node.request(stage, REVEAL, Reveal(session=session, step=0, entry=pipe.node.peer_id))


def test_a_false_or_forged_accusation_is_evidence_against_its_accuser(mesh, tiny_llama):
    pipe, auditor, stages, _, seen = swarm(mesh, tiny_llama, rate=0.0)
    honest = stages[1].peer_id
    commits: list = []
    auditor.observe = lambda session, step_commits: commits.extend(c for c in step_commits if c.stage == honest)
    session, _ = run(pipe, list(PROMPTS[0]), 6)
    me = pipe.node
    revealed = me.request(honest, REVEAL, Reveal(session=session, step=commits[-1].step))
    accusation = Evidence(kind="wrong", accused=honest, accuser=me.peer_id, session=session, span=Span(3, 5),
                          commits=tuple(commits), revealed=revealed)
    layers = Layers(tiny_llama)

    false = judge(sign_evidence(me.identity.key_pair, accusation), layers)
    assert not false.upheld and false.excluded == me.peer_id and "recomputation" in false.reason
    # a doctored commitment, a doctored reveal, another session's reveal: each convicts the accuser
    forged = msgspec.structs.replace(commits[0], output=bytes(16))
    doctored = msgspec.structs.replace(revealed, steps=(msgspec.structs.replace(
        revealed.steps[0], output=tensors.encode(torch.zeros(len(PROMPTS[0]), 64))),) + revealed.steps[1:])
    for bad in (msgspec.structs.replace(accusation, commits=(forged, *commits[1:])),
                msgspec.structs.replace(accusation, revealed=doctored, kind="contradiction"),
                msgspec.structs.replace(accusation, session="another")):
        verdict = judge(sign_evidence(me.identity.key_pair, bad), layers)
        assert not verdict.upheld and verdict.excluded == me.peer_id, verdict
    with pytest.raises(ProtocolError, match="not signed"):
        judge(accusation, layers)  # unsigned: nobody's word
    # nobody else may see a session's activations
    with pytest.raises(RemoteError, match="not kept"):
        stages[0].request(honest, REVEAL, Reveal(session=session, step=commits[-1].step))


def test_a_refusal_is_judged_by_asking_the_stage_again(mesh, tiny_llama):
    """A stage that refuses its entry's reveal is excluded if it refuses the coordinator too; one that answers
    the coordinator is judged on its answer (the entry may just have lost its link), and nobody else may ask."""
    pipe, auditor, stages, servers, seen = swarm(mesh, tiny_llama)
    refuser, judge_node = stages[1], stages[2]  # the last stage plays the coordinator
    servers[1].chain.coordinator = lambda: judge_node.peer_id
    servers[1].step_log.max_bytes = 0  # keeps nothing: every reveal refused
    session, _ = run(pipe, list(PROMPTS[0]), 6)
    assert auditor.settle([session]) == {refuser.peer_id} and auditor.counts.refused >= 1
    evidence = next(e for e in seen.sent if e.kind == "refused")
    assert evidence.accused == refuser.peer_id

    def ask(stage, entry, session, step, piece=None):
        return judge_node.request(stage, REVEAL, Reveal(session=session, step=step, entry=entry, piece=piece))

    verdict = judge(evidence, Layers(tiny_llama), ask_reveal=ask)
    assert verdict.upheld and verdict.excluded == refuser.peer_id and "refused" in verdict.reason
    # the same stage keeping its steps again: it answers the coordinator, and nobody is excluded
    servers[1].step_log.max_bytes = 1 << 30
    seen.caught.clear()
    auditor.book.rate = 0.0
    commits: list = []
    auditor.observe = lambda _, step_commits: commits.extend(c for c in step_commits if c.stage == refuser.peer_id)
    session, _ = run(pipe, list(PROMPTS[1]), 6)
    claim = sign_evidence(pipe.node.identity.key_pair, Evidence(
        kind="refused", accused=refuser.peer_id, accuser=pipe.node.peer_id, session=session, span=Span(3, 5),
        commits=tuple(commits)))
    verdict = judge(claim, Layers(tiny_llama), ask_reveal=ask)
    assert not verdict.upheld and verdict.excluded == "", verdict
    # a coordinator with no room for the span: the reveal answers the charge (it failed as "internal error")
    verdict = judge(claim, no_room, ask_reveal=ask)
    assert not verdict.upheld and verdict.excluded == "" and "not recomputed" in verdict.reason, verdict
    with pytest.raises(RemoteError, match="only a session's entry"):  # a third node asking for the entry
        stages[0].request(refuser.peer_id, REVEAL, Reveal(session=session, step=commits[-1].step,
                                                          entry=pipe.node.peer_id))


def test_a_stage_does_not_compute_a_step_its_predecessor_did_not_commit_to(mesh, tiny_llama):
    """Only the previous hop may send a session's steps, and its commitment must come with them: a stage
    that lets an uncommitted step through would sign for it and take the blame."""
    pipe, _, stages, _, seen = swarm(mesh, tiny_llama, rate=0.0)
    entry, liar, session = pipe.node, stages[0], "s1"
    entry.request(stages[1].peer_id, SESSION, Open(session=session, max_length=16, prev=liar.peer_id,
                                                      span=Span(3, 5)))
    hidden = torch.randn(2, 64)
    step = Step(entry=entry.peer_id, session=session, step=0, start=0, frame=tensors.encode(hidden),
                expect=CacheState(0, 0))
    pipe.inbox.expect((session, 0))
    liar.open_channel(stages[1].peer_id, ids.STEP).send(encode(step))
    got = pipe.inbox.wait((session, 0), 10)
    assert got is not None
    sender, reply, _ = got
    assert sender == stages[1].peer_id and reply.culprit == liar.peer_id and "commitment" in reply.error
    # and an entry takes no result without every stage's commitment
    sent = SentStep(commitments.context(0, None, None), commitments.digest(hidden), 0, 2)
    with pytest.raises(StageFailed, match="0 commitments"):
        pipe.check_commits(session, 0, pipe.route, sent, Result(session=session, step=0, frame=b""), hidden)


def test_a_stage_keeps_open_sessions_and_drops_ended_ones_oldest_first():
    now = [0.0]
    log = StepLog(retain_s=60, max_bytes=3 * 1024, clock=lambda: now[0])
    step = LoggedStep(0, 0, None, None, torch.zeros(1, 128), torch.zeros(1, 128))  # 1 KiB
    for key in ("a", "b", "c", "d"):
        log.record(key, step)
    assert all(log.upto(k, 0) for k in "abcd")  # over budget, but open sessions are never dropped
    log.end("b")
    log.end("a")
    assert log.upto("b", 0) is None and log.upto("a", 0)  # the first to end goes first
    now[0] = 61.0
    log.end("c")
    assert log.upto("a", 0) is None and log.upto("c", 0) and log.upto("d", 0)  # "a" outlived retention


def status(boot: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-m", "beeswarm", "status", "--join", boot, "--json", "--heartbeat", "1"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.slow
def test_a_lying_newcomer_holding_a_span_nobody_else_can_hold_is_caught_excluded_swarm_wide_and_the_reply_stays_honest(
        tiny_models, tmp_path):
    """A newcomer with room for the whole model joins an honest bootstrap with room for a third of it (new keys
    all), is given more layers than any other member can hold (all of them, or all the bootstrap does not serve),
    and returns its input unchanged; two more honest contributors join, each with room for a third. A stream from
    `serve` at the default audit rate streams transformers' greedy text and nothing else: the newcomer's session is
    checked layer by layer by members loading one layer each (its audits used to come back "unchecked" and its
    tokens reached the user). The coordinator's plan excludes it with the reason, counts the honest stages' passed
    audits and credits their work, and the liar forfeits."""
    model = str(tiny_models["llama"])
    env = {**os.environ, "BEESWARM_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    env.pop("BEESWARM_IDENTITY", None)
    procs: list = []
    third = budgets(model, 3)[0]

    def looked() -> dict:
        time.sleep(1)  # each look is a `status` process joining the mesh: not back to back
        return status(boot, env)

    try:
        _, boot = start_contributors(procs, model, 1, third, env, tmp_path, logs=tmp_path)  # it cannot plan alone
        newcomer, _ = start_contributors(procs, model, 1, budgets(model, 1)[0], env, tmp_path, join=boot,
                                         extra_env={1: {ENV: "identity"}}, logs=tmp_path)
        (cheat,) = newcomer

        def held_by_the_newcomer() -> int:
            """The layers of the first route the newcomer serves."""
            stages = ((looked()["plan"] or {}).get("active") or [{"stages": []}])[0]["stages"]
            return sum(s["end"] - s["start"] for s in stages if s["node"] == cheat)

        wait_for(lambda: held_by_the_newcomer() > 3, 90, "the newcomer serving more than another member can hold")
        start_contributors(procs, model, 2, third, env, tmp_path, join=boot, logs=tmp_path)
        wait_for(lambda: sum(m["role"] == "contributor" and m["state"] != "leaving" for m in looked()["members"])
                 == 4, 90, "the four contributors in the swarm's view")
        prompt = "def f(x):"
        tokenizer = AutoTokenizer.from_pretrained(model)
        with open(tmp_path / "serve.log", "w") as log:
            proc, url = serve(model, boot, env, log)
        procs.append(proc)
        # streamed, as the web app does: the text of tokens through a stage on probation waits for its audits
        with httpx.stream("POST", url + "/completions", timeout=240, json={
                "model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert not [e for e in events if "error" in e], events
        expected = reference_greedy(model, tokenizer.encode(prompt), 16)
        assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == \
            tokenizer.decode(expected, skip_special_tokens=True)  # never a lying token, nothing taken back
        reply = next(e["beeswarm"] for e in events if "beeswarm" in e)
        assert reply["audits"]["failed"] >= 1 and reply["recoveries"] >= 1, reply
        assert reply["audits"]["unchecked"] == 0  # the entry loads no layers: contributors audited
        assert cheat not in [s["peer"] for s in reply["route"]]
        sentenced = wait_for(lambda: [e for e in status(boot, env)["plan"]["excluded"] if e["until"]], 60,
                             "the coordinator's sentence in the plan")
        assert [e["node"] for e in sentenced] == [cheat] and "audit" in sentenced[0]["reason"]
        honest = {s["peer"] for s in reply["route"]}

        def standings() -> dict | None:
            known = (status(boot, env)["plan"] or {}).get("standings", {})
            return known if known.keys() >= honest else None

        assert cheat not in wait_for(standings, 60, "the honest stages' passed audits in the plan")

        def credits() -> dict | None:  # the cheat forfeits; the stages that served the reply hold its receipts
            shown = {m["peer"]: m["credits"] or {} for m in status(boot, env)["members"]}
            paid = all(shown.get(peer, {}).get("earned", 0) > 0 for peer in honest)
            return shown if shown.get(cheat, {}).get("forfeited") and paid else None

        assert wait_for(credits, 60, "the cheat's credit forfeited and the honest stages' receipts")[cheat] \
            ["balance"] == 0
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_member_checks_layers_one_at_a_time_within_its_memory_offer(tiny_llama):
    """A spare offering room for three layers loads one layer at a time to check a newcomer's pieces (in half of
    what its offer leaves); the oldest it keeps make room for the next (it declined the third once two were kept,
    and the entry checked the rest itself), while a piece that could never fit is declined without dropping them."""
    from beeswarm.contributor.audit_layers import AuditLayers
    from beeswarm.contributor.contributor import model_shape

    layer = model_shape(str(tiny_llama), "cpu", "float32").layer_bytes
    layers = AuditLayers(str(tiny_llama), "float32", "cpu", "none", 3 * layer, lambda: layer, dict)
    for i in range(8):
        assert layers(Span(i, i + 1)).span == Span(i, i + 1)
    kept = layers(Span(7, 8))
    with pytest.raises(MemoryError):
        layers(Span(0, 2))  # two layers want 4 layers of offer
    assert layers(Span(7, 8)) is kept
