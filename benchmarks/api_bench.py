#!/usr/bin/env python3
"""The OpenAI-compatible API under load: requests/s, tokens/s and time to first token at 1, 4 and 8 clients.

A local swarm (`--contributors` tinycode processes, as `beeswarm swarm --local` starts them) and a
`beeswarm serve` process in front of it, both real processes on 127.0.0.1. For each level of
concurrency, that many clients each send streamed chat completions back to back for `--seconds`
(greedy, `max_tokens` fixed with vLLM's `ignore_eos`, prompts from a list of code snippets).
Reported per level: requests/s, completion tokens/s (from each stream's usage chunk), and time to
first token (the first content delta) p50 / p95, from the client's side of HTTP.

    python benchmarks/api_bench.py [--clients 1 4 8] [--seconds 30] [--max-tokens 32] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx

from beeswarm.contributor.local_swarm import LocalSwarm, beeswarm_command

SNIPPETS = ["def fibonacci(n):\n", "import os\n\ndef list_files(path):\n", "class Stack:\n    def __init__(self):\n",
            "for i in range(10):\n    print(", "def read_json(path):\n    with open(path) as f:\n",
            "# binary search\ndef search(items, target):\n", "async def fetch(url):\n", "x = [i * i for i in"]


@dataclass
class Level:
    clients: int
    seconds: float = 0.0
    requests: int = 0
    tokens: int = 0
    errors: int = 0
    ttft_s: list[float] = field(default_factory=list)

    def row(self) -> dict[str, float | int]:
        q = statistics.quantiles(self.ttft_s, n=20) if len(self.ttft_s) >= 2 else [float("nan")] * 19
        return {"clients": self.clients, "requests": self.requests, "errors": self.errors,
                "requests_per_s": round(self.requests / self.seconds, 2),
                "tokens_per_s": round(self.tokens / self.seconds, 1),
                "ttft_p50_ms": round(statistics.median(self.ttft_s) * 1000, 1) if self.ttft_s else None,
                "ttft_p95_ms": round(q[18] * 1000, 1)}


def one_request(http: httpx.Client, model: str, prompt: str, max_tokens: int) -> tuple[float, int]:
    """(seconds to the first content delta, completion tokens) of one streamed chat completion."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    t0, ttft, tokens = time.perf_counter(), None, 0
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if ttft is None and chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return (ttft if ttft is not None else time.perf_counter() - t0), tokens


def run_level(url: str, model: str, clients: int, seconds: float, max_tokens: int) -> Level:
    level, lock = Level(clients), threading.Lock()
    deadline = time.monotonic() + seconds

    def client(index: int) -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            n = index
            while time.monotonic() < deadline:
                try:
                    ttft, tokens = one_request(http, model, SNIPPETS[n % len(SNIPPETS)], max_tokens)
                except (httpx.HTTPError, RuntimeError) as e:
                    print(f"request failed: {e}", file=sys.stderr)
                    with lock:
                        level.errors += 1
                    continue
                n += clients
                with lock:
                    level.requests, level.tokens = level.requests + 1, level.tokens + tokens
                    level.ttft_s.append(ttft)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    level.seconds = time.perf_counter() - t0  # the last requests finish after the deadline: count their time
    return level


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tinycode")
    ap.add_argument("--contributors", type=int, default=3)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--draft", default=None, help="passed to serve (default: the model's paired draft)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    swarm = LocalSwarm(args.contributors, args.model)
    server = None
    try:
        bootstrap = swarm.start()
        swarm.wait_ready()
        cmd = [*beeswarm_command(), "serve", "--join", bootstrap, "--model", args.model, "--port", "0", "--json",
               "--heartbeat", "1", "--max-concurrent", str(max(args.clients))]
        server = subprocess.Popen(cmd + (["--draft", args.draft] if args.draft else []), stdout=subprocess.PIPE,
                                  text=True)
        assert server.stdout is not None
        url = json.loads(server.stdout.readline())["url"].removesuffix("/v1")
        with httpx.Client(base_url=url) as http:
            while http.get("/health").status_code != 200:
                time.sleep(0.2)
        one_request(httpx.Client(base_url=url, timeout=120), args.model, SNIPPETS[0], 4)  # warm up
        rows = []
        for clients in args.clients:
            rows.append(run_level(url, args.model, clients, args.seconds, args.max_tokens).row())
            if not args.json:
                print(rows[-1], flush=True)
        if args.json:
            print(json.dumps({"model": args.model, "contributors": args.contributors, "max_tokens": args.max_tokens,
                              "seconds": args.seconds, "levels": rows}))
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
        swarm.stop()


if __name__ == "__main__":
    main()
