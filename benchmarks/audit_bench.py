#!/usr/bin/env python3
"""Audits: what they cost, what they catch, and how close honest recomputation comes.

Sections (all by default):
- cost: bytes of a commitment per stage per step, and CPU per step for it (digests, signing, checking).
- tolerance: the largest relative error between what stages computed batched with other sessions and
  a replay alone, honest `--dtype` on CPU (what the audit tolerance must clear), and the drift (the mean error
  vector of a session's tokens against its honest size, what the direction test must clear).
- layers: each layer run on 8 sessions' real hidden states batched and each alone, in `--dtype`: what an
  interior piece's per-layer tolerance (`audit.layers.PIECE_TOLERANCE`) must clear.
- detection: the fraction of generations (`--tokens` each) in which a stage misbehaving on a fraction f
  of its steps is caught at audit rate p, against the closed form 1 - (1 - p f)^steps.
- caught: for each dishonest mode at the default rate, generations until the entry catches it, as a
  newcomer (probation) and as a stage that starts lying after earning trust.
- honest: `--generations` honest ones in `--dtype` (8 at a time), every step audited: accusations (all false);
  then a stage adding a steady `--bias`: the share of `--bias-trials` generations caught.
- reveal: the bytes of a whole-session reveal (what a peer audit moves, stage to auditor) and the entry's
  commitments to the auditor, measured on real hidden states and scaled to 4096 wide and 2k tokens.
- pieces: audits by pieces at a Llama-3.2-1B shape (2048 wide): bytes per audit (at 2048 and 8192 wide), the
  auditor's memory for one layer, the stage's and auditors' work against serving, detection per audit.
- throughput: tokens/s, and CPU a token of every process, of 4 concurrent chats through a local swarm of 3
  contributor processes at audit rate 0 and `--rates` times the default (1 and 4 unless told; rounds in
  ABBA order; each rate against rate 0 of its round, medians), peer auditors recomputing (the
  contributors; `--audit-here`: the entry), probation on (each round's entry is new; the stages are new in
  the first round).
The in-process sections use real nodes on 127.0.0.1 and the `--model` checkpoint (tinycode by default).

    python benchmarks/audit_bench.py [--sections cost tolerance layers detection caught honest reveal pieces
                                                 throughput]
                                       [--dtype D] [--generations N] [--bias B] [--rounds N] [--rates M ...]
                                       [--audit-here] [--json]
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import msgspec
import psutil
import torch

from beeswarm.audit import DEFAULT_RATE, commitments
from beeswarm.audit.auditor import Auditor, entry_auditor
from beeswarm.audit.faults import Fault, _token_direction
from beeswarm.audit.probation import PUBLISHED_UP_TO
from beeswarm.audit.replay import drift, error_vectors, relative_error, replay
from beeswarm.client.dataplane import Inbox, RemotePipeline
from beeswarm.client.swarm import ClientOptions, SwarmClient
from beeswarm.contributor.local_swarm import LocalSwarm, threads_per_process
from beeswarm.contributor.stage import StageServer
from beeswarm.generation.generate import generate
from beeswarm.generation.sampling import SamplingParams
from beeswarm.p2p import identity
from beeswarm.p2p.node import Node, NodeConfig
from beeswarm.protocol import encode
from beeswarm.protocol.coordinator import Stage
from beeswarm.protocol.spans import even_splits
from beeswarm.protocol.step import Commit
from beeswarm.shard import EntryModel, Span, SpanRuntime, checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tiny checkpoints
GREEDY = SamplingParams()
LOCAL = ["/ip4/127.0.0.1/tcp/0"]


class Chain:
    """Three stage servers on their own nodes (the middle one with `fault`), and an entry node."""

    def __init__(self, folder: str, fault: Fault | None = None, dtype: str = "float32"):
        self.folder, self.dtype = folder, dtype
        config_layers = EntryModel(folder, "float32", "cpu").config.num_hidden_layers
        self.spans = even_splits(config_layers, 3)
        self.nodes = [Node(identity.ephemeral(), NodeConfig(listen=LOCAL)).start() for _ in range(4)]
        *stages, self.entry_node = self.nodes
        self.servers = [StageServer(node, SpanRuntime(folder, span, dtype, "cpu"),
                                    fault=fault if i == 1 else None).start()
                        for i, (node, span) in enumerate(zip(stages, self.spans))]
        for node in stages:
            self.entry_node.connect(node.addrs[0])
        for a, b in itertools.pairwise(stages):
            a.connect(b.addrs[0])
        self.route = tuple(Stage(node=n.peer_id, span=s) for n, s in zip(stages, self.spans))
        self.inbox = Inbox(self.entry_node).start()
        self.entry = EntryModel(folder, dtype, "cpu")
        self.layers: dict = {}

    def runtime_for(self, span):
        if span not in self.layers:
            self.layers[span] = SpanRuntime(self.folder, span, self.dtype, "cpu")
        return self.layers[span]

    def auditor(self, rate: float, standing: int = 0, kept: list | None = None) -> Auditor:
        """An entry auditor checking every audit with the layers loaded here, its evidence kept in `kept` (no
        coordinator here); `standing`: the steps the swarm says each layer of every stage was checked on."""
        return entry_auditor(self.entry_node, rate, standing=lambda stage: dict.fromkeys(range(1024), standing),
                             here=self.runtime_for, reporter=Kept(kept if kept is not None else [])).start()

    def pipeline(self, auditor: Auditor | None) -> RemotePipeline:
        return RemotePipeline(self.entry_node, self.inbox, self.entry, self.route, auditor=auditor)

    def close(self) -> None:
        for server in self.servers:
            server.stop()
        for node in self.nodes:
            node.stop()


class Kept:
    """The auditor's reporter here: evidence kept in a list, passes dropped."""

    def __init__(self, evidence: list):
        self.evidence = evidence

    def report(self, evidence):
        self.evidence.append(evidence)

    def vouch(self, session, commit, layers, steps) -> None:
        pass

    def drain(self, timeout: float) -> None:
        pass


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 1000) for _ in range(rng.randrange(4, 24))] for _ in range(n)]


def one_generation(pipe: RemotePipeline, prompt: list[int], tokens: int) -> str:
    session = pipe.open(len(prompt) + tokens + 1)
    try:
        generate(lambda t, s: pipe.forward(session, t, s), prompt, tokens, GREEDY)
    finally:
        pipe.close_session(session)
    return session


# --- sections ----------------------------------------------------------------------------------------
def cost(args) -> dict:
    """Bytes and CPU of the commitments a decode step and a prefill step carry."""
    me = identity.ephemeral().peer_id
    hidden = checkpoint_hidden(args.model)
    out = {}
    for name, q in (("decode", 1), ("prefill_128", 128)):
        x, y = torch.randn(q, hidden), torch.randn(q, hidden)
        signer = identity.ephemeral()
        unsigned = Commit(stage=signer.peer_id, step=123, span=even_splits(24, 3)[1], context=b"\0" * 16,
                          input=b"\0" * 16, output=b"\0" * 16, sig=b"")
        n = 200
        t0 = time.perf_counter()
        for _ in range(n):  # what a stage adds per step: two digests, a context digest, a signature, a check
            c = commitments.sign(signer.key_pair, me, "0123456789abcdef", msgspec.structs.replace(
                unsigned, context=commitments.context(7, None, None), input=commitments.digest(x),
                output=commitments.digest(y)))
            commitments.verify(c, me, "0123456789abcdef")
        stage_us = (time.perf_counter() - t0) / n * 1e6
        out[name] = {"commit_bytes": len(encode(c)), "stage_us_per_step": round(stage_us, 1)}
    return out


def checkpoint_hidden(model: str) -> int:
    from beeswarm.shard import loader
    return int(loader.load_config(checkpoint.resolve(model, checkpoint.Parts(embed=True))).hidden_size)


def tolerance(args) -> dict:
    """Honest stages batch concurrent sessions; the replay runs each alone. How far apart do they land, per token
    and as a direction held over a session's tokens (`replay.drift`: the mean error's norm, and that over rms /
    sqrt(n), its honest size)?"""
    chain = Chain(args.model, dtype=args.dtype)
    try:
        pipe = chain.pipeline(None)
        sessions: list[str] = []
        threads = [threading.Thread(target=lambda p=p: sessions.append(one_generation(pipe, p, args.tokens)))
                   for p in prompts(8, seed=1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        errors, drifts = [], []
        for server in chain.servers:
            for session in sessions:
                key = f"{chain.entry_node.peer_id}/{session}"
                log = server.step_log._logs.get(key)
                if log is None:
                    continue
                outs = replay(chain.runtime_for(server.spans[0]), log.steps)
                errors += [relative_error(s.output, o) for s, o in zip(log.steps, outs, strict=True)]
                drifts.append(drift(torch.cat([error_vectors(s.output.to(o.dtype), o)
                                               for s, o in zip(log.steps, outs, strict=True)])))
        batched = sum(s.traffic.steps for s in chain.servers)
        return {"dtype": args.dtype, "steps_compared": len(errors), "max_relative_error": max(errors),
                "median_relative_error": statistics.median(errors), "stage_steps": batched,
                "sessions_compared": len(drifts), "max_drift": max(d for d, _ in drifts),
                "max_drift_z": round(max(z for _, z in drifts), 2),
                "median_drift_z": round(statistics.median(z for _, z in drifts), 2)}
    finally:
        chain.close()


def layer_tolerance(args) -> dict:
    """What an interior piece's tolerance (`audit.layers.PIECE_TOLERANCE`, per layer) must clear: each layer of the
    model run on 8 sessions' real hidden states batched together and each alone, a prefill then 8 decode steps, in
    `--dtype`: the largest relative error per token, over layers and steps."""
    from beeswarm.shard.span import StepInput

    folder = checkpoint.resolve(args.model)
    entry = EntryModel(folder, args.dtype, "cpu")
    n = entry.config.num_hidden_layers
    full = SpanRuntime(folder, Span(0, n), args.dtype, "cpu")
    errors: list[float] = []
    for layer in range(n):
        batched, alone = full.view(Span(layer, layer + 1)), full.view(Span(layer, layer + 1))
        tracer = full.view(Span(0, n))
        sessions = prompts(8, seed=40 + layer)
        inputs = []
        for i, prompt in enumerate(sessions):  # the real hidden states entering `layer`, prefill and 8 steps
            sid = f"t{layer}.{i}"
            tracer.open(sid, len(prompt) + 9)
            tokens = prompt + list(range(7, 15))
            hidden = entry.embed(torch.tensor(tokens))
            traced = tracer.trace(StepInput(sid, hidden, 0))
            inputs.append(hidden if layer == 0 else traced[layer - 1])
            tracer.close(sid)
            for runtime in (batched, alone):
                runtime.open(sid, len(tokens))
        lengths = [len(p) for p in sessions]
        for k in range(9):  # the prefill, then one token a step
            parts = [(h[:q], 0) if k == 0 else (h[q + k - 1:q + k], q + k - 1) for h, q in zip(inputs, lengths)]
            outs = batched.step([StepInput(f"t{layer}.{i}", x, start) for i, (x, start) in enumerate(parts)])
            for i, (x, start) in enumerate(parts):
                ref = alone.step_one(f"t{layer}.{i}", x, start)
                errors.append(relative_error(outs[i], ref))
    return {"dtype": args.dtype, "layers": n, "tokens_compared": len(errors), "max_relative_error": max(errors),
            "median_relative_error": statistics.median(errors)}


def pieces_at_scale(args) -> dict:
    """Audits by pieces on a Llama-3.2-1B-shaped model (2048 wide, 8192 MLP, 32 heads, 8 KV heads; random weights,
    2 layers made, each costing what any of the 16 would): one session of `--reveal-tokens` (a prefill of 64, then
    a token a step) served through the layers, then an audit of it as a 16-layer span would have it: the stage's
    replay of its span (`replay.trace`) and signed boundaries, one piece's reveal, a spot check of one layer by a
    member that loads it. Bytes are measured at 2048 wide and scaled to 8192 (the codec's ratio held); times are
    this CPU's, per layer, and the cost is each side's work against the serving work of the same session."""
    import tempfile

    from beeswarm.audit import layers as layer_audit
    from beeswarm.audit.evidence import read_reveal
    from beeswarm.audit.pieces import SPOT_LAYERS
    from beeswarm.audit.pieces import detection as found_by
    from beeswarm.audit.replay import trace
    from beeswarm.audit.retention import LoggedStep
    from beeswarm.protocol import Decoder
    from beeswarm.protocol.audit import Revealed
    from tiny_checkpoints import write_tiny_checkpoint

    span_layers, wide, tokens, prefill = 16, 2048, args.reveal_tokens, 64
    dtype = getattr(torch, args.dtype)
    process = psutil.Process()
    with tempfile.TemporaryDirectory() as tmp:
        folder = write_tiny_checkpoint(Path(tmp) / "1b", num_layers=2, hidden_size=wide, heads=32, kv_heads=8,
                                       intermediate_size=8192, max_positions=tokens + 8, initializer_range=0.02,
                                       dtype=dtype)
        entry = EntryModel(folder, args.dtype, "cpu")
        served = SpanRuntime(folder, Span(0, 2), args.dtype, "cpu")
        served.open("s", tokens)
        ids = [random.Random(0).randrange(1, 256) for _ in range(tokens)]
        steps, start, serve_s = [], 0, 0.0
        with torch.inference_mode():
            for step, chunk in enumerate([ids[:prefill]] + [[t] for t in ids[prefill:]]):
                x = entry.embed(torch.tensor(chunk))
                t0 = time.perf_counter()
                y = served.step_one("s", x, start)
                serve_s += time.perf_counter() - t0
                steps.append(LoggedStep(step, start, None, None, x.clone(), y.clone()))
                start += len(chunk)
            t0 = time.perf_counter()
            traced = trace(served, steps)  # the stage, asked for its boundaries
            trace_s = time.perf_counter() - t0
        signer = identity.ephemeral()
        boundaries = layer_audit.sign_boundaries(signer.key_pair, signer.peer_id, "entry", "s", Span(0, 2), steps,
                                                 traced)
        boundaries_16 = msgspec.structs.replace(boundaries, inner=boundaries.inner * (span_layers - 1))
        t0 = time.perf_counter()
        revealed = layer_audit.reveal_piece(signer.key_pair, signer.peer_id, "entry", "s", Span(0, 2), Span(0, 1),
                                            steps, traced)
        reveal_encode_s = time.perf_counter() - t0
        reveal_wire = len(encode(revealed))
        del served, traced
        rss0 = process.memory_info().rss
        t0 = time.perf_counter()
        piece = read_reveal(Decoder(Revealed, limit=1 << 34).decode(encode(revealed)), "entry", 1 << 34)
        decode_s = time.perf_counter() - t0
        reveal_raw = sum(s.input.nbytes + s.output.nbytes for s in piece)
        t0 = time.perf_counter()
        layer = SpanRuntime(folder, Span(0, 1), args.dtype, "cpu")  # a spot check by a member with room for it
        load_s = time.perf_counter() - t0
        with torch.inference_mode():
            t0 = time.perf_counter()
            outputs = replay(layer, piece)
            replay_s = time.perf_counter() - t0
        auditor_bytes = process.memory_info().rss - rss0
        error = max(relative_error(a, s.output) for a, s in zip(outputs, piece, strict=True))
    per_layer_serve, per_layer_trace = serve_s / 2, trace_s / 2
    scale = 8192 / wide
    stage_share = per_layer_trace / per_layer_serve  # its whole span replayed, per layer served
    spot_share = SPOT_LAYERS * (replay_s + decode_s) / (span_layers * per_layer_serve)
    cover_share = (replay_s + decode_s) / per_layer_serve  # every layer checked once
    drawn = 1 - (1 - DEFAULT_RATE) ** len(steps)  # the chance a session of this length has a step drawn, a stage
    return {
        "dtype": args.dtype, "tokens": tokens, "steps": len(steps),
        "serve_s_per_layer": round(per_layer_serve, 2), "stage_trace_s_per_layer": round(per_layer_trace, 2),
        "piece_reveal_encode_s": round(reveal_encode_s, 2), "auditor_decode_s": round(decode_s, 2),
        "auditor_load_layer_s": round(load_s, 2), "auditor_replay_s_one_layer": round(replay_s, 2),
        "honest_error_one_layer": error,
        "bytes": {
            "boundaries_16_layers": len(encode(boundaries_16)),
            "commitments_to_auditor": len(steps) * 179,
            "piece_reveal_2048_wide": reveal_wire, "piece_reveal_raw_2048_wide": reveal_raw,
            "piece_reveal_8192_wide": round(reveal_wire * scale),
            "stage_trace_memory_16_layers_2048": (span_layers - 1) * tokens * wide * torch.finfo(dtype).bits // 8,
            "stage_trace_memory_16_layers_8192": round((span_layers - 1) * tokens * wide * scale
                                                       * torch.finfo(dtype).bits // 8),
        },
        "auditor_memory_bytes_one_layer_loaded": auditor_bytes,
        "cost_vs_serving": {
            "session_drawn_at_default_rate": round(drawn, 4),
            "stage_replays_its_span": round(stage_share, 3),
            "auditors_spot_check_past_probation": round(spot_share, 3),
            "auditors_cover_on_probation_with_second_opinion": round(2 * cover_share, 3)},
        "detection_per_audit_single_layer_liar": {"past_probation_spot": found_by(SPOT_LAYERS, span_layers),
                                                  "on_probation_cover": 1.0},
    }


def detection(args) -> dict:
    """Generations caught / generations, per (rate, fraction), vs the closed form."""
    rows = []
    for fraction in (1.0, 0.25):
        chain = Chain(args.model, Fault("noise", fraction))
        try:
            for rate in (DEFAULT_RATE, 4 * DEFAULT_RATE):
                caught = 0
                for prompt in prompts(args.trials, seed=2):
                    auditor = chain.auditor(rate)
                    pipe = chain.pipeline(auditor)
                    session = one_generation(pipe, prompt, args.tokens)
                    caught += bool(auditor.settle([session]))
                    auditor.close()
                    pipe.close()
                steps = args.tokens  # per stage: one prefill step + (tokens - 1) decode steps
                rows.append({"rate": rate, "fraction": fraction, "generations": args.trials,
                             "caught": caught, "measured": round(caught / args.trials, 3),
                             "closed_form": round(1 - (1 - rate * fraction) ** steps, 3), "steps": steps})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
        finally:
            chain.close()
    return {"rows": rows}


def caught_after(args) -> dict:
    """Generations until an entry auditing at the default rate catches each mode (median of trials): a newcomer
    (a fresh key: probation audits its sessions whole), and a stage that lies only after earning trust (its
    standing past probation: the per-step draws alone)."""
    out = {}
    direction = _token_direction(checkpoint.resolve(args.model), checkpoint_hidden(args.model))
    for mode in ("noise", "identity", "bias", "noise@0.25"):
        name, _, fraction = mode.partition("@")
        chain = Chain(args.model, Fault(name, float(fraction or 1), direction if name == "bias" else None))
        out[mode] = {}
        try:
            for who, standing in (("newcomer", 0), ("trusted", PUBLISHED_UP_TO)):
                counts = []
                for trial in range(args.caught_trials):
                    auditor = chain.auditor(DEFAULT_RATE, standing)
                    pipe = chain.pipeline(auditor)
                    for n, prompt in enumerate(prompts(1000, seed=100 + trial), start=1):
                        if auditor.settle([one_generation(pipe, prompt, args.tokens)]):
                            counts.append(n)
                            break
                    auditor.close()
                    pipe.close()
                out[mode][who] = {"generations_until_caught": counts, "median": statistics.median(counts)}
                print(json.dumps({mode: {who: out[mode][who]}}), file=sys.stderr, flush=True)
        finally:
            chain.close()
    return out


def honest(args) -> dict:
    """Honest stages in `--dtype`: `--generations` generations 8 at a time (so the stages batch them), every step
    audited and recomputed alone: any accusation (a token over the tolerance, or a drift) is a false one. Then the
    middle stage adding a steady `--bias` (of each token's norm, the same way): the share of generations caught."""
    direction = _token_direction(checkpoint.resolve(args.model), checkpoint_hidden(args.model))
    chain = Chain(args.model, dtype=args.dtype)
    try:
        accused: list = []
        auditor = chain.auditor(1.0, PUBLISHED_UP_TO, accused)
        pipe = chain.pipeline(auditor)
        done = 0
        while done < args.generations:
            sessions: list[str] = []
            threads = [threading.Thread(target=lambda p=p: sessions.append(one_generation(pipe, p, args.tokens)))
                       for p in prompts(min(8, args.generations - done), seed=1000 + done)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            auditor.settle(sessions)
            done += len(sessions)
        out = {"dtype": args.dtype, "generations": done, "audits_passed": auditor.counts.passed,
               "accusations": len(accused), "details": sorted({e.detail[:100] for e in accused})[:5]}
        auditor.close()
        pipe.close()
    finally:
        chain.close()
    print(json.dumps({"honest": out}), file=sys.stderr, flush=True)
    chain = Chain(args.model, Fault("bias", 1.0, direction, args.bias), dtype=args.dtype)
    try:
        caught = 0
        for prompt in prompts(args.bias_trials, seed=7):
            auditor = chain.auditor(1.0, PUBLISHED_UP_TO)
            pipe = chain.pipeline(auditor)
            caught += bool(auditor.settle([one_generation(pipe, prompt, args.tokens)]))
            auditor.close()
            pipe.close()
        out["bias"] = {"scale": args.bias, "generations": args.bias_trials, "caught": caught}
    finally:
        chain.close()
    return out


def reveal_bytes(args) -> dict:
    """What a peer audit of a whole session costs on the wire: the stage's reveal (its inputs and outputs, every
    step, in the codec's lossless frames) to the auditor, and the commitments the entry hands the auditor. The
    ratio is measured on the `--model`'s real hidden states of a `--reveal-tokens` session (a prefill of 64
    tokens, then one decode step a token) and applied to a 4096-wide bf16 model."""

    from transformers import AutoTokenizer

    import beeswarm
    from beeswarm.audit.evidence import reveal
    from beeswarm.audit.retention import LoggedStep

    entry = EntryModel.load(args.model, "float32", "cpu")
    before, span = even_splits(entry.config.num_hidden_layers, 3)[:2]  # the middle stage's reveal
    runtimes = [SpanRuntime.load(args.model, s, "float32", "cpu") for s in (before, span)]
    tokenizer = AutoTokenizer.from_pretrained(str(entry.folder))
    text = "".join(p.read_text() for p in sorted(Path(beeswarm.__file__).parent.rglob("*.py")))
    ids = (tokenizer.encode(text) or [1]) * args.reveal_tokens
    ids = ids[:args.reveal_tokens]  # source code, as tinycode writes it
    steps, session, start, prefill = [], "s", 0, 64
    for r in runtimes:
        r.open(session, args.reveal_tokens)
    with torch.inference_mode():
        for step, chunk in enumerate([ids[:prefill]] + [[t] for t in ids[prefill:]]):
            x = runtimes[0].step_one(session, entry.embed(torch.tensor(chunk)), start)
            y = runtimes[1].step_one(session, x, start)
            steps.append(LoggedStep(step, start, None, None, x.to(torch.bfloat16), y.to(torch.bfloat16)))
            start += len(chunk)
    signer = identity.ephemeral()
    t0 = time.perf_counter()
    revealed = reveal(signer.key_pair, signer.peer_id, "entry", session, steps)
    encode_s = time.perf_counter() - t0
    wire = len(encode(revealed))
    raw = sum(s.input.numel() + s.output.numel() for s in steps) * 2
    ratio = wire / raw
    commit = len(encode(Commit(stage=signer.peer_id, step=1, span=span, context=b"\0" * 16, input=b"\0" * 16,
                               output=b"\0" * 16, sig=b"\0" * 64)))
    tokens, wide = 2048, 4096
    raw_4096 = 2 * tokens * wide * 2
    decode_steps = tokens - prefill + 1
    return {"model_hidden": entry.config.hidden_size, "tokens": args.reveal_tokens, "steps": len(steps),
            "wire_bytes": wire, "raw_bf16_bytes": raw, "ratio": round(ratio, 3), "encode_s": round(encode_s, 3),
            "at_4096_wide_2048_tokens": {
                "reveal_raw_bytes": raw_4096, "reveal_wire_bytes": round(raw_4096 * ratio),
                "reveal_s_at_100_mbit": round(raw_4096 * ratio * 8 / 100e6, 2),
                "commitments_to_auditor_bytes": decode_steps * commit}}


def throughput(args) -> dict:
    """4 concurrent chats for `--seconds` per rate, rates interleaved over `--rounds`."""
    torch.set_num_threads(threads_per_process(4))
    swarm = LocalSwarm(3, args.model)
    rates = [0.0, *(m * DEFAULT_RATE for m in args.rates)]
    figures: dict[float, list[float]] = {r: [] for r in rates}
    cpu_ms: dict[float, list[float]] = {r: [] for r in rates}  # CPU of every process (stages, auditors, entry) a token
    audits: dict[float, int] = dict.fromkeys(rates, 0)
    unchecked: dict[float, int] = dict.fromkeys(rates, 0)
    try:
        bootstrap = swarm.start()
        swarm.wait_ready()
        entry = EntryModel.load(args.model, "float32", "cpu")
        for n in range(args.rounds):
            for rate in rates if n % 2 == 0 else rates[::-1]:  # ABBA: the machine's drift cancels in the ratios
                client = SwarmClient.create(entry, [bootstrap], interval=1.0, listen=LOCAL,
                                            options=ClientOptions(audit_rate=rate,
                                                                  audit_here=args.audit_here)).start()
                try:
                    client.route(60)
                    client.generate([1, 2, 3], 4, GREEDY)
                    tokens = []
                    processes = [psutil.Process()] + [psutil.Process(c.process.pid) for c in swarm.children]
                    cpu0 = [cpu_s(p) for p in processes]
                    stop = time.monotonic() + args.seconds
                    t0 = time.perf_counter()

                    def chat(seed: int) -> None:
                        for p in prompts(10_000, seed=seed):
                            if time.monotonic() > stop:
                                return
                            tokens.append(len(client.generate(p, args.tokens, GREEDY).generation.tokens))

                    threads = [threading.Thread(target=chat, args=(s,)) for s in range(4)]
                    for t in threads:
                        t.start()
                    for t in threads:
                        t.join()
                    figures[rate].append(sum(tokens) / (time.perf_counter() - t0))
                    by_process = [(cpu_s(p) - c0) * 1000 / sum(tokens) for p, c0 in zip(processes, cpu0)]
                    cpu_ms[rate].append(sum(by_process))
                    audits[rate] += client.audits.run
                    unchecked[rate] += client.audits.unchecked
                finally:
                    client.close()
                print(json.dumps({"rate": rate, "tokens_per_s": round(figures[rate][-1], 2),
                                  "cpu_ms_per_token": round(cpu_ms[rate][-1], 2),
                                  "entry_and_contributors": [round(x, 2) for x in by_process]}),
                      file=sys.stderr, flush=True)
    finally:
        swarm.stop()
    base = figures[0.0]
    # the machine drifts between rounds: compare each rate with rate 0 of the same round
    # and in CPU: what the audits take from the swarm's compute, whoever does it (stage, auditor, entry), which
    # the wall clock of a saturated 2-core machine measures only loosely
    return {str(r): {"tokens_per_s": round(statistics.median(v), 2), "runs": [round(x, 2) for x in v],
                     "vs_no_audits_same_round": round(statistics.median(x / b for x, b in zip(v, base)), 3),
                     "cpu_ms_per_token": [round(x, 2) for x in cpu_ms[r]],
                     "cpu_cost_same_round": round(statistics.median(
                         x / b - 1 for x, b in zip(cpu_ms[r], cpu_ms[0.0])), 3),
                     "audits_run": audits[r], "unchecked": unchecked[r]}
            for r, v in figures.items()}


def cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


SECTIONS = {"cost": cost, "tolerance": tolerance, "layers": layer_tolerance, "detection": detection,
            "caught": caught_after,
            "honest": honest, "reveal": reveal_bytes, "pieces": pieces_at_scale, "throughput": throughput}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tinycode")
    parser.add_argument("--dtype", default="float32", help="tolerance, honest: the stages' dtype")
    parser.add_argument("--generations", type=int, default=1000, help="honest: generations")
    parser.add_argument("--bias", type=float, default=0.025, help="honest: the steady nudge to catch")
    parser.add_argument("--bias-trials", type=int, default=50, help="honest: generations with the nudge")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per generation")
    parser.add_argument("--trials", type=int, default=200, help="generations per detection cell")
    parser.add_argument("--caught-trials", type=int, default=5)
    parser.add_argument("--reveal-tokens", type=int, default=2048)
    parser.add_argument("--audit-here", action="store_true", help="throughput: the entry recomputes, not peers")
    parser.add_argument("--seconds", type=float, default=30.0, help="per throughput run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rates", type=float, nargs="*", default=[1, 4],
                        help="throughput: the audit rates beside 0, in multiples of the default")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    args.model = str(checkpoint.resolve(args.model))
    results = {name: SECTIONS[name](args) for name in args.sections}
    print(json.dumps(results) if args.json else json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
