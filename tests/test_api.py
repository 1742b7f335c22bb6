"""`beeswarm serve` driven by the official `openai` client: real contributor processes, real HTTP.

One swarm for the module: four contributors that can each hold half the model (so a killed stage has
a replica) and a `serve` process in front of them, with an API key and --max-concurrent 8.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

from beeswarm.contributor.local_swarm import budgets
from helpers import lines_of, past_probation, read_until, serve, start_contributors, wait_for
from served import KEY, Served

pytestmark = pytest.mark.slow  # starts beeswarm processes: not in `make test-fast`

PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def served(tiny_models, tmp_path_factory):
    model = str(tiny_models["llama"])
    tmp = tmp_path_factory.mktemp("api")
    env = {**os.environ, "BEESWARM_CACHE_DIR": str(tmp / "cache"), "PYTHONUNBUFFERED": "1", "API_KEY": KEY}
    env.pop("BEESWARM_IDENTITY", None)
    procs: list = []
    try:
        peers, boot = start_contributors(procs, model, 4, budgets(model, 2)[0], env, tmp)
        with open(tmp / "serve.log", "w") as log:  # the child keeps its own copy of the descriptor
            proc, url = serve(model, boot, env, log, "--api-key-env", "API_KEY", "--max-concurrent", "8")
        procs.append(proc)
        s = Served(url, model, peers)
        wait_for(lambda: s.health()["status"] == "ok", 90, "a route through the swarm")
        yield s
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_chat_and_legacy_completions_return_what_greedy_chat_returns(served):
    expected = served.reference(PROMPT, 12)
    messages = [{"role": "user", "content": PROMPT}]
    whole = served.client.chat.completions.create(model=served.model, messages=messages, max_tokens=12,
                                                  temperature=0)
    assert whole.choices[0].message.content == expected and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == len(served.tokenizer.encode(PROMPT))
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    assert whole.model_extra["beeswarm"]["route"]  # beeswarm's extras ride along, ignored by the client

    chunks = list(served.client.chat.completions.create(model=served.model, messages=messages, max_tokens=12,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])

    legacy = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=12, temperature=0)
    assert legacy.choices[0].text == expected and legacy.usage.completion_tokens == 12
    streamed = "".join(c.choices[0].text for c in served.client.completions.create(
        model=served.model, prompt=PROMPT, max_tokens=12, temperature=0, stream=True))
    assert streamed == expected

    penalised = served.client.completions.create(model=served.model, prompt=PROMPT, max_tokens=12, temperature=0,
                                                 extra_body={"repetition_penalty": 1.5})
    assert penalised.choices[0].text == served.reference(PROMPT, 12, repetition_penalty=1.5)

    models = served.client.models.list().data
    assert [(m.id, m.owned_by) for m in models] == [(served.model, "beeswarm")]


def test_seed_repeats_sampled_output_and_stop_cuts_it(served):
    def sampled(seed: int) -> str:
        return served.client.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": "hello"}], max_tokens=10, temperature=1.0,
            seed=seed).choices[0].message.content

    assert sampled(7) == sampled(7)

    expected = served.reference(PROMPT, 12)
    at = next(i for i in range(2, len(expected)) if expected[i] not in "\ufffd" and expected.index(expected[i]) == i)
    stop = expected[at]
    out = served.client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": PROMPT}],
                                                max_tokens=12, temperature=0, stop=[stop, "never appears"])
    assert out.choices[0].message.content == expected[:at] and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 12


def test_concurrent_streams_are_all_exact_and_served_at_once(served):
    """Eight streams at once are each exact and are served side by side, not one after another (how much
    faster that is than in sequence is api_bench.py's figure)."""
    expected = served.reference(PROMPT, 16)

    def stream() -> tuple[str, float, float]:
        text, first = "", None
        for c in served.client.chat.completions.create(model=served.model, max_tokens=16, temperature=0,
                                                       messages=[{"role": "user", "content": PROMPT}], stream=True):
            if c.choices and c.choices[0].delta.content:
                first = first if first is not None else time.monotonic()
                text += c.choices[0].delta.content
        return text, first or time.monotonic(), time.monotonic()

    assert [stream()[0] for _ in range(8)] == [expected] * 8
    results: list[tuple[str, float, float]] = []
    threads = [threading.Thread(target=lambda: results.append(stream())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert [text for text, _, _ in results] == [expected] * 8
    # served at once: some stream had its first token before another had its last
    spans = sorted((first, last) for _, first, last in results)
    assert any(spans[i + 1][0] < spans[i][1] for i in range(len(spans) - 1)), spans


def test_every_error_has_openais_shape_and_status(served):
    chat = "/v1/chat/completions"
    ok = {"model": served.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}

    def error(response: httpx.Response, status: int, param: str | None = None) -> dict:
        assert response.status_code == status, response.text
        body = response.json()["error"]
        assert body["message"] and body["type"] and "Traceback" not in body["message"]
        if param is not None:
            assert body["param"] == param
        return body

    error(served.http.post(chat, content=b"{not json"), 400)
    error(served.http.post(chat, json={"model": served.model}), 400, "messages")
    error(served.http.post(chat, json={**ok, "temperature": "hot"}), 400, "temperature")
    error(served.http.post(chat, json={**ok, "n": 2}), 400, "n")
    error(served.http.post(chat, json={**ok, "messages": [{"role": "wizard", "content": "x"}]}), 400,
          "messages[0].role")
    assert error(served.http.post(chat, json={**ok, "model": "gpt-9"}), 404, "model")["code"] == "model_not_found"
    too_long = {**ok, "messages": [{"role": "user", "content": "x " * 5000}]}
    assert error(served.http.post(chat, json=too_long), 400)["code"] == "context_length_exceeded"
    error(httpx.post(served.url + "/chat/completions", json=ok), 401)
    error(httpx.get(served.url + "/models", headers={"Authorization": "Bearer wrong"}), 401)
    with pytest.raises(openai.NotFoundError):
        served.client.chat.completions.create(model="gpt-9", messages=ok["messages"])
    error(served.http.get("/v1/nothing-here"), 404)


def test_dropped_streams_free_their_sessions_and_a_ninth_request_gets_429(served):
    # 8 x 200 tokens take seconds here (more on a loaded machine); 8 sessions of 209 positions fit the
    # stages' KV budgets (start_contributors gives each room for 2048)
    body = {"model": served.model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 200,
            "temperature": 0, "stream": True, "ignore_eos": True}
    held = []
    try:
        for _ in range(8):  # --max-concurrent 8: eight streams in progress
            response = served.http.send(served.http.build_request("POST", "/v1/chat/completions", json=body),
                                        stream=True)
            assert response.status_code == 200
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))  # under way
            held.append((response, lines))
        refused = served.http.post("/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2})
        assert refused.status_code == 429, (served.health(), [list(it)[:6] for _, it in held[:2]])
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "rate_limit_error"
        try:  # (the stages' session counts come with their heartbeats, a second apart)
            wait_for(lambda: all(s["sessions"] >= 1 for s in served.health()["route"]), 10, "sessions on the stages")
        except AssertionError:
            print("/health when they did not show:", served.health())
            raise
    finally:
        for response, _ in held:
            response.close()  # the client goes away mid-stream
    wait_for(lambda: served.health()["active_requests"] == 0, 15, "the server to end the dropped generations")
    wait_for(lambda: all(s["sessions"] == 0 for s in served.health()["route"]), 10,
             "every stage to drop the sessions")


def test_a_stream_survives_a_stage_killed_mid_answer(served):
    """Last in the module: it kills a contributor (its replica takes over). 160 tokens: pieces come 15 ms apart
    here, and 40 of them (as this once asked) ended 0.35 s after the fifth, before a loaded test's kill landed
    (3 runs in 8 failed)."""
    expected = served.reference(PROMPT, 160)
    route = wait_for(lambda: past_probation(served.health, lambda: served.client.completions.create(
        model=served.model, prompt=PROMPT, max_tokens=4)), 120, "a route past probation")  # to stream as it goes
    victim = route[-1]["peer"]
    pieces, extras = [], None
    for chunk in served.client.chat.completions.create(model=served.model, messages=[{"role": "user",
                                                                                      "content": PROMPT}],
                                                       max_tokens=160, temperature=0, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            pieces.append(chunk.choices[0].delta.content)
            if len(pieces) == 5:
                served.peers[victim].send_signal(signal.SIGKILL)
        if chunk.model_extra.get("beeswarm"):
            extras = chunk.model_extra["beeswarm"]
    assert "".join(pieces) == expected  # no gap, no repeat
    assert extras is not None and extras["recoveries"] >= 1, (f"killed {victim} after 5 of {len(pieces)} pieces",
                                                              extras and extras["route"])
    assert victim not in {hop["peer"] for hop in extras["route"]}


def test_no_swarm_is_a_503_with_retry_after(tiny_llama, tmp_path):
    env = {**os.environ, "BEESWARM_CACHE_DIR": str(tmp_path / "cache")}
    dead = "/ip4/127.0.0.1/tcp/9/p2p/12D3KooWAszDEyisVSUZDkfPgeREA65HdCw96RSxMmEo5aNkhYwN"  # nobody listens
    proc, url = serve(str(tiny_llama), dead, env, subprocess.DEVNULL)
    try:
        response = httpx.post(url + "/chat/completions", timeout=60,
                              json={"model": str(tiny_llama), "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 503 and int(response.headers["retry-after"]) > 0
        assert response.json()["error"]["code"] == "no_route"
        assert httpx.get(url.removesuffix("/v1") + "/health").json()["status"] == "no_route"
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


# the pure parts: request bodies and stop strings ---------------------------------------------------------
@pytest.mark.parametrize("body, param", [
    (b"{}", "model"),
    (b'{"model": "m", "messages": []}', "messages"),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', None),
    (b'{"model": "m", "messages": [{"role": "user"}], "stop": ["a", "b", "c", "d", "e"]}', "stop"),
    (b'{"model": "m", "messages": [{"role": "user"}], "top_p": 0}', "top_p"),
    (b'{"model": "m", "messages": [{"role": "user"}], "logprobs": true}', "logprobs"),
    (b'{"model": "m", "messages": [{"role": "user"}], "frequency_penalty": 0.5}', "frequency_penalty"),
    (b'{"model": "m", "messages": [{"role": "user"}], "stream_options": {"include_usage": true}}', "stream_options"),
])
def test_malformed_chat_bodies_name_the_field(body, param):
    from beeswarm.api.schema import ApiError, ChatRequest, parse

    with pytest.raises(ApiError) as e:
        request = parse(body, ChatRequest)
        request.messages[0].text("messages[0]")  # content parts are checked when the prompt is built
    assert e.value.status == 400
    if param is not None:
        assert e.value.param == param


def test_bodies_clients_send_are_accepted():
    from beeswarm.api.schema import ApiError, ChatRequest, CompletionRequest, parse

    chat = parse(b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, '
                 b'{"type": "text", "text": "b"}]}], "temperature": null, "max_tokens": null, "n": 1, '
                 b'"stop": "x", "some_new_field": {"ignored": true}}', ChatRequest)
    assert isinstance(chat, ChatRequest) and chat.messages[0].text("m") == "ab" and chat.stops == ["x"]
    assert chat.limit is None and chat.temperature is None
    for prompt in (b'"text"', b'["text"]', b"[1, 2, 3]"):
        legacy = parse(b'{"model": "m", "prompt": ' + prompt + b"}", CompletionRequest)
        assert isinstance(legacy, CompletionRequest) and legacy.limit == 16  # OpenAI's default for this endpoint
    for prompt in (b'["a", "b"]', b'["a", 1]', b"[]"):
        with pytest.raises(ApiError):
            parse(b'{"model": "m", "prompt": ' + prompt + b"}", CompletionRequest)


def test_stop_strings_are_cut_and_never_streamed_in_part():
    from beeswarm.api.stops import StopText

    stops = StopText(["END", "\n\n"])
    streamed = [stops.push(piece) for piece in ["ab", "cE", "N", "x", " \n", "\nzz"]]
    assert streamed == ["ab", "c", "", "ENx", " ", ""] and stops.hit and stops.flush() == ""
    stops = StopText(["END"])
    assert [stops.push(p) for p in ["aE", "ND", "more"]] == ["a", "", ""] and stops.hit
    stops = StopText(["END"])
    assert stops.push("xEN") == "x" and stops.flush() == "EN"  # no stop came: the held tail was text


@pytest.mark.slow
def test_serve_takes_the_swarms_model_and_refuses_another(tiny_models, tmp_path):
    """`serve --join` a multiaddr without --model takes the model the swarm's plan names (its completions work, in
    that model's tokens); given another model it refuses at start, naming both, instead of a 500 on every request."""
    import sys

    model, other = str(tiny_models["qwen2"]), str(tiny_models["llama"])
    env = {**os.environ, "BEESWARM_CACHE_DIR": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    env.pop("BEESWARM_IDENTITY", None)
    procs: list = []
    try:
        _, boot = start_contributors(procs, model, 1, budgets(model, 1)[0], env, tmp_path)
        refused = subprocess.run([sys.executable, "-m", "beeswarm", "serve", "--join", boot, "--model", other,
                                  "--port", "0", "--heartbeat", "1"], capture_output=True, text=True, timeout=180,
                                 env=env)
        assert refused.returncode == 2, refused.stderr[-3000:]
        assert f"this swarm serves {model}" in refused.stderr and f"--model {other} is another model" in \
            refused.stderr
        with open(tmp_path / "serve.log", "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "beeswarm", "serve", "--join", boot, "--port", "0",
                                     "--json", "--heartbeat", "1"], stdout=subprocess.PIPE, stderr=log, text=True,
                                    env=env)
            procs.append(proc)
            line, _ = read_until(lines_of(proc), '{"event": "serving"', 180)
        url = json.loads(line)["url"]
        reply = httpx.post(url + "/completions", timeout=120, json={"model": model, "prompt": "def f(x):",
                                                                  "max_tokens": 6, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == Served(url, model, {}).reference("def f(x):", 6)
    finally:
        for p in procs:
            p.kill()
