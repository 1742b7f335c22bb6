"""Real contributor processes on 127.0.0.1: a local swarm, a chat through it, failover after kill -9."""
from __future__ import annotations

import functools
import http.server
import json
import os
import signal
import subprocess
import sys
import threading

import pytest
from transformers import AutoTokenizer

from beeswarm.client.swarm import SwarmClient
from beeswarm.contributor.local_swarm import budgets
from beeswarm.generation.sampling import SamplingParams
from beeswarm.shard import EntryModel
from beeswarm.spec.draft import DraftModel
from beeswarm.spec.tuner import Tuner
from helpers import alive, lines_of, read_until, reference_greedy, start_contributors, wait_for
from tiny_checkpoints import write_tiny_checkpoint

pytestmark = pytest.mark.slow  # starts beeswarm processes: not in `make test-fast`


@pytest.fixture
def env(tmp_path):
    e = {**os.environ, "BEESWARM_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    e.pop("BEESWARM_IDENTITY", None)
    return e


def test_local_swarm_serves_a_chat_joined_by_url_and_stops_cleanly(tiny_llama, env, tmp_path):
    swarm = subprocess.Popen([sys.executable, "-m", "beeswarm", "swarm", "--local", "3", "--model", str(tiny_llama)],
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    try:
        q = lines_of(swarm)
        _, seen = read_until(q, "ready", 120)
        descriptor = next(line.split()[1] for line in seen if line.startswith("descriptor "))
        contributors = [line for line in seen if line.startswith("contributor ")]
        assert len(contributors) == 3  # the plan spans every process
        spans = sorted(tuple(int(x) for x in line.split("[")[1].rstrip(")").split(", ")) for line in contributors)
        assert spans[0][0] == 0 and spans[-1][1] == 8 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        pids = [int(line.split()[3]) for line in contributors]

        # serve the descriptor over HTTP and join through the URL, as a volunteer would from a link
        handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=os.path.dirname(descriptor))
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        url = f"http://127.0.0.1:{server.server_port}/{os.path.basename(descriptor)}"
        tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
        try:
            # the tiny model has no paired draft: plain decoding; then a draft of our own (same tokenizer)
            draft = write_tiny_checkpoint(tmp_path / "draft", num_layers=1, seed=5)
            for prompt, extra in (("def f(x):", []), ("hello", ["--draft", str(draft), "--spec-width", "2"])):
                chat = subprocess.run([sys.executable, "-m", "beeswarm", "chat", "--join", url, "--model",
                                       str(tiny_llama), "--prompt", prompt, "--max-new-tokens", "12", "--greedy",
                                       "--json", "--heartbeat", "1", *extra], capture_output=True, text=True,
                                      timeout=120, env=env)
                assert chat.returncode == 0, chat.stderr
                result = json.loads(chat.stdout)
                assert result["tokens"] == reference_greedy(tiny_llama, tokenizer.encode(prompt), 12), chat.stderr
                if extra:
                    assert 1 <= result["rounds"] <= 11 and result["spec"]["widths"][0] == 2
                    assert len(result["acceptance_by_depth"]) >= 1
                else:
                    assert result["spec"] is None and result["rounds"] is None
                route = [(h["start"], h["end"]) for h in result["route"]]  # may differ from the first plan:
                assert route[0][0] == 0 and route[-1][1] == 8  # measured links can move the spans
                assert all(a[1] == b[0] for a, b in zip(route, route[1:]))
                # (a plan that moves spans right after `ready` may cost a recovery: the tokens above stay exact)
                assert result["wire_bytes"] > 0 and result["raw_bytes"] > 0
            bad = subprocess.run([sys.executable, "-m", "beeswarm", "chat", "--join", url + ".missing",
                                  "--prompt", "x"], capture_output=True, text=True, timeout=60, env=env)
            assert bad.returncode == 2 and "HTTP 404" in bad.stderr
        finally:
            server.shutdown()
    finally:
        swarm.send_signal(signal.SIGTERM)
        swarm.wait(30)
    wait_for(lambda: not any(alive(p) for p in pids), 15, "every contributor to exit")


def test_generation_survives_a_killed_stage(tiny_llama, env, tmp_path):
    """Four contributors, each able to hold half the model; kill -9 a serving one mid-generation."""
    procs: list = []
    try:
        peers, boot = start_contributors(procs, tiny_llama, 4, budgets(str(tiny_llama), 2)[0], env, tmp_path)
        entry = EntryModel(tiny_llama, dtype="float32", device="cpu")
        client = SwarmClient.create(entry, [boot], interval=1.0, listen=["/ip4/127.0.0.1/tcp/0"]).start()
        try:
            first_route = client.route(90)
            prompt = [3, 14, 15, 92, 65]
            killed = []

            def on_token(_):
                if len(killed) == 0 and len(seen_tokens) == 4:
                    victim = first_route.stages[-1].node
                    peers[victim].send_signal(signal.SIGKILL)
                    killed.append(victim)
                seen_tokens.append(_)

            seen_tokens: list[int] = []
            out = client.generate(prompt, 24, SamplingParams(), on_token=on_token, route_timeout=90)
        finally:
            client.close()
        assert killed and out.recoveries >= 1
        assert out.generation.tokens == reference_greedy(tiny_llama, prompt, 24)
        assert killed[0] not in {s.node for s in out.route}
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize("families", [("qwen3", "phi3"), ("gemma2", "gemma3_text"), ("mixtral", "qwen3_moe")],
                         ids="+".join)
def test_newer_families_through_a_three_process_swarm_equal_transformers(tiny_models, families, env, tmp_path):
    """Each family added after the first three: `swarm --local 3` (two families' swarms at once, to share the
    waiting), then greedy generations plain, speculating with a random draft of the same vocabulary, and (the
    first of each pair) with three speculative steps in flight, token for token transformers' `generate`."""
    swarms = {family: subprocess.Popen([sys.executable, "-m", "beeswarm", "swarm", "--local", "3", "--model",
                                        str(tiny_models[family])], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                       text=True, env=env) for family in families}
    draft = str(write_tiny_checkpoint(tmp_path / "draft", num_layers=1, seed=5))  # llama, the same 257 tokens
    prompt = [3, 14, 15, 92, 65]
    try:
        for family, swarm in swarms.items():
            model = tiny_models[family]
            _, seen = read_until(lines_of(swarm), "ready", 120)
            boot = next(line.split()[1] for line in seen if line.startswith("bootstrap "))
            assert sum(line.startswith("contributor ") for line in seen) == 3
            expected = reference_greedy(model, prompt, 12)
            entry = EntryModel(model, dtype="float32", device="cpu")
            client = SwarmClient.create(entry, [boot], interval=1.0, listen=["/ip4/127.0.0.1/tcp/0"],
                                        draft=DraftModel(draft, entry.config.vocab_size)).start()
            try:
                modes = [(False, None), (True, None)] + [(True, 3)] * (family == families[0])  # one per pair
                for speculate, in_flight in modes:
                    client.speculate, client.drafting.tuner = speculate, Tuner(in_flight=in_flight)
                    out = client.generate(prompt, 12, SamplingParams(), route_timeout=90)
                    assert out.generation.tokens == expected, (family, speculate, in_flight)
                    assert (out.spec is not None) == speculate
                    if in_flight:  # steps pipelined through the stages' nodes
                        assert out.spec is not None and max(out.spec.in_flight) == in_flight
            finally:
                client.close()
    finally:
        for swarm in swarms.values():
            swarm.send_signal(signal.SIGTERM)
        for swarm in swarms.values():
            swarm.wait(30)
