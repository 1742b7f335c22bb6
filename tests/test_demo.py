"""`beeswarm demo` end to end: a real process, real checkpoints, output a user can check."""
from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoTokenizer

from beeswarm.generation.generate import generate
from beeswarm.generation.sampling import ModelDefaults, SamplingParams, probabilities
from beeswarm.protocol.spans import even_splits
from beeswarm.shard import checkpoint
from helpers import alive, in_terminal, reference_greedy, wait_for
from local_pipeline import LocalPipeline


def beeswarm(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([sys.executable, "-m", "beeswarm", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def test_even_splits_cover_every_layer_once():
    for layers in range(1, 20):
        for stages in range(1, layers + 1):
            spans = even_splits(layers, stages)
            assert [s.start for s in spans][0] == 0 and spans[-1].end == layers
            assert all(a.end == b.start for a, b in zip(spans, spans[1:]))
            assert max(map(len, spans)) - min(map(len, spans)) <= 1


def test_greedy_pipeline_equals_transformers_generate(tiny_llama):
    pipeline = LocalPipeline(str(tiny_llama), stages=3, dtype="float32", device="cpu")
    for prompt in ([5, 6, 7], [100, 3, 250, 17, 9, 1]):
        session = pipeline.open(64)
        ours = generate(lambda t, s: pipeline.forward(session, t, s), prompt, 24, SamplingParams())
        assert ours.tokens == reference_greedy(tiny_llama, prompt, 24)


def test_seeded_sampling_repeats_and_top_p_cuts_the_tail():
    logits = torch.tensor([4.0, 3.0, 0.0, -1.0])
    probs = probabilities(logits, SamplingParams(temperature=1.0, top_p=0.9))
    assert probs[2] == 0 and probs[3] == 0 and torch.isclose(probs.sum(), torch.tensor(1.0))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1.0, top_p=0)


def test_sampling_defaults_come_from_the_models_generation_config(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "repetition_penalty": 1.2, "eos_token_id": 0}))
    assert ModelDefaults.read(tmp_path) == ModelDefaults(0.6, 0.9, 1.2)
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot", "top_p": null')
    assert ModelDefaults.read(tmp_path) == ModelDefaults()  # unreadable: nothing said, the caller's defaults
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6,
                                                                 "top_p": 1.5, "repetition_penalty": 1.1}))
    assert ModelDefaults.read(tmp_path) == ModelDefaults(repetition_penalty=1.1)  # greedy by config; top_p > 1 is no
    params = ModelDefaults(0.6, 0.9, 1.2).sampling(None, None, None, 7, fallback=(1.0, 1.0))
    assert params == SamplingParams(0.6, 0.9, 7, 1.2)
    assert ModelDefaults(0.6, 0.9).sampling(0.0, None, None, None, fallback=(1.0, 1.0)).top_p == 1.0  # greedy
    shipped = ModelDefaults.read(checkpoint.BUILTIN["tinycode"])
    assert shipped.temperature and shipped.repetition_penalty and shipped.repetition_penalty > 1  # no greedy loops


@pytest.mark.slow
def test_demo_json_on_a_tiny_model(tiny_llama):
    out = beeswarm("demo", "--model", str(tiny_llama), "--prompt", "def f(x):", "--max-new-tokens", "12",
                   "--greedy", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) >= {"text", "tokens", "new_tokens", "seconds", "tokens_per_s"}
    assert result["new_tokens"] == len(result["tokens"]) == 12
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    assert result["text"] == tokenizer.decode(result["tokens"], skip_special_tokens=True)
    assert result["tokens"] == reference_greedy(tiny_llama, tokenizer.encode("def f(x):"), 12)


@pytest.mark.slow
def test_demo_errors_are_one_line_without_traceback(tiny_llama):
    cases = [(["--model", "no-such-model", "--prompt", "x"], "not a built-in name"),
             (["--model", str(tiny_llama), "--prompt", "x", "--max-new-tokens", "100000"], "context"),
             (["--model", str(tiny_llama)], "--prompt"),
             (["--model", str(tiny_llama), "--prompt", "x", "--temperature", "-1"], "temperature"),
             (["--model", str(tiny_llama), "--prompt", "x", "--repetition-penalty", "0"], "repetition_penalty")]
    with concurrent.futures.ThreadPoolExecutor(len(cases)) as pool:  # each is a process of its own
        outs = list(pool.map(lambda case: beeswarm("demo", *case[0]), cases))
    for (_, message), out in zip(cases, outs, strict=True):
        assert out.returncode == 2, out.stderr
        assert message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_tinycode_demo_writes_python():
    out = beeswarm("demo", "--prompt", "def fib(n):", "--max-new-tokens", "32", "--greedy", "--json")
    assert out.returncode == 0, out.stderr
    text = json.loads(out.stdout)["text"]
    # A model trained on the standard library continues a function with indented code.
    assert "\n    " in text, text


@pytest.mark.slow
def test_demo_app_on_a_terminal_stops_its_swarm_when_left(tiny_llama, tmp_path):
    """`demo` without --prompt opens the chat app beside the swarm; Ctrl-Q ends it and every child."""
    tag = f"demo-{os.getpid()}-{tmp_path.name}"  # inherited by the demo's contributor processes

    def tagged() -> list[int]:
        pids, marker = [], f"BEESWARM_TEST_TAG={tag}".encode()
        for entry in os.listdir("/proc"):
            try:
                if entry.isdigit() and marker in open(f"/proc/{entry}/environ", "rb").read():
                    pids.append(int(entry))
            except OSError:  # gone meanwhile, or not ours to read
                pass
        return [pid for pid in pids if alive(pid)]

    env = {**os.environ, "BEESWARM_TEST_TAG": tag, "BEESWARM_CONFIG_DIR": str(tmp_path / "config")}
    code, screen = in_terminal([sys.executable, "-m", "beeswarm", "demo", "--model", str(tiny_llama)], env,
                               b"Say something", b"\x11", timeout=180)
    assert code == 0 and b"Traceback" not in screen
    wait_for(lambda: not tagged(), 15, "the demo's contributors to exit")
