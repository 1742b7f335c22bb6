#!/usr/bin/env python3
"""Many users at once: N entries, each a process of its own behind the link emulator, on one local swarm.

Each user is what `beeswarm chat` runs (a `SwarmClient` with its own node, greedy, `--tokens` new tokens after a
prompt of its own) and every node and entry crosses the emulated links (E4: 40 ms into each, 100 Mbit/s). For each
mode and each N, a fresh swarm serves a cold round (the users' first generation, right after they joined: first
contact) and then `--runs` warm rounds, all N users asked at the same moment. Reported per round and as medians:

- aggregate tokens/s: every new token of the round over the wall time from its first request to its last token;
- per user tokens/s (new tokens over that user's own request-to-last-token time): median, worst, worst/median;
- time to first token, median and worst; in the cold round, how much it grows per user (the slope of the users'
  TTFTs in order, s/user);
- every user's tokens against transformers' greedy continuation of its prompt (exactness under load);
- steps per pass at the stages (what they batched, from each contributor's `served` event at its end);
- the entries' CPU, in cores, over the warm rounds (on a real swarm each entry is its own machine).

Modes: `spec` (the push chain, each user speculating with the draft), `plain` (the push chain, a token a
step), `hops` (back to the entry after every stage, no speculation: Petals' routing).

    python benchmarks/users_bench.py [--users 1 8 32] [--modes spec hops] [--runs 5] [--tokens 32] [--env E4]
                                     [--model tinycode] [--stages 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # helpers shared with the tests
from emulated import EmulatedSwarm  # noqa: E402

ENVS = {"E4": (100e6, 0.040), "loopback": (None, 0.0)}  # rate, one-way delay into every node (swarm_bench's E4)
PROMPT_LENGTH = 16
LOGS = Path(tempfile.gettempdir()) / "users-bench"  # each user's stderr


# --- a user: one entry process -----------------------------------------------------------------------------
def user(args: argparse.Namespace) -> None:
    """Join, say `ready`, then generate once for every `go` line on stdin; one JSON line per generation."""
    import torch

    from beeswarm.client.swarm import ClientOptions, SwarmClient
    from beeswarm.generation.sampling import SamplingParams
    from beeswarm.shard import EntryModel
    from beeswarm.spec.draft import DraftModel

    torch.set_num_threads(1)
    entry = EntryModel.load(args.model, "float32", "cpu")
    draft = DraftModel(args.draft, entry.config.vocab_size) if args.mode == "spec" else None
    client = SwarmClient.create(entry, [args.bootstrap], interval=1.0, listen=[f"/ip4/127.0.0.1/tcp/{args.listen}"],
                                announce=[f"/ip4/127.0.0.1/tcp/{args.announce}"],
                                options=ClientOptions(mode="hops" if args.mode == "hops" else "push"),
                                draft=draft).start()
    prompt = json.loads(args.prompt)
    deadline = time.monotonic() + 120
    while not client.coordinator.state.coordinator and time.monotonic() < deadline:
        time.sleep(0.1)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip() != "go":
            break
        t0 = time.time()
        try:
            out = client.generate(prompt, args.tokens, SamplingParams(), route_timeout=120)
        except Exception as e:  # noqa: BLE001 - counted as a failed generation, the user goes on
            print(json.dumps({"t0": t0, "error": f"{type(e).__name__}: {e}"}), flush=True)
            continue
        end = time.time()
        g = out.generation
        print(json.dumps({"t0": t0, "first": t0 + g.ttft_s, "end": end, "tokens": g.tokens,
                          "recoveries": out.recoveries}), flush=True)
    client.close()


# --- the parent --------------------------------------------------------------------------------------------
@dataclass
class User:
    name: str
    process: subprocess.Popen
    prompt: list[int]
    lines: list[dict] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            try:
                item = json.loads(line)
            except ValueError:
                continue
            if not isinstance(item, dict):
                continue
            with self.cond:
                self.lines.append(item)
                self.cond.notify_all()
        with self.cond:  # it exited: whoever waits for its lines stops waiting
            self.cond.notify_all()

    def wait_lines(self, n: int, timeout: float) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: len(self.lines) >= n or self.process.poll() is not None, timeout):
                raise TimeoutError(f"{self.name} printed {len(self.lines)} of {n} lines in {timeout:.0f} s")
            if len(self.lines) < n:
                raise RuntimeError(f"{self.name} exited with status {self.process.poll()}")

    def go(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write("go\n")
        self.process.stdin.flush()


def prompts(model: str, count: int, vocab: int) -> list[list[int]]:
    """A different prompt for every user: pieces of code tokenized, or spread token ids for a random model."""
    from transformers import AutoTokenizer

    from beeswarm.shard import checkpoint

    folder = checkpoint.resolve(model)  # a built-in name or a folder
    lines = [f"def f{i}(x):\n    return x * {i} + {i * 7} if x > {i} else " for i in range(count)]
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        return [tokenizer.encode(text)[:PROMPT_LENGTH] for text in lines]
    except (OSError, ValueError):
        return [[(7 * i + 13 * j) % vocab for j in range(PROMPT_LENGTH)] for i in range(count)]


def references(model: str, prompts_: list[list[int]], n: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt (the oracle every user's tokens are held to)."""
    import torch
    from transformers import AutoModelForCausalLM

    from beeswarm.shard import checkpoint

    folder = checkpoint.resolve(model)  # a built-in name or a folder
    lm = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    lm.generation_config.repetition_penalty = 1.0  # plain greedy, as the users ask (not the checkpoint's defaults)
    out = []
    with torch.no_grad():
        for ids in prompts_:
            got = lm.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(got[0, len(ids):].tolist())
    return out


def slope(values: list[float]) -> float:
    """Least squares slope of `values` sorted, against their rank: how much each next user waited longer."""
    ys = sorted(values)
    if len(ys) < 2:
        return 0.0
    xs = range(len(ys))
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def round_figures(every: list[dict], expected_of_every: list[list[int]]) -> dict:
    results = [r for r in every if "error" not in r]
    expected = [e for r, e in zip(every, expected_of_every) if "error" not in r]
    errors = sorted({r["error"][:160] for r in every if "error" in r})
    if not results:
        return {"users": len(every), "failed": len(every), "errors": errors, "exact": 0}
    t0, end = min(r["t0"] for r in results), max(r["end"] for r in results)
    new = [len(r["tokens"]) for r in results]
    per_user = [n / (r["end"] - r["t0"]) for n, r in zip(new, results)]
    ttft = [r["first"] - r["t0"] for r in results]
    median = statistics.median(per_user)
    return {"aggregate": round(sum(new) / (end - t0), 3), "per_user_median": round(median, 3),
            "per_user_worst": round(min(per_user), 3), "worst_over_median": round(min(per_user) / median, 3),
            "ttft_median_s": round(statistics.median(ttft), 3), "ttft_worst_s": round(max(ttft), 3),
            "ttft_slope_s_per_user": round(slope(ttft), 4),
            "exact": sum(r["tokens"] == e for r, e in zip(results, expected)), "users": len(every),
            "failed": len(every) - len(results), "errors": errors,
            "wrong": [{"user": i, "got": r["tokens"], "expected": e}
                      for i, (r, e) in enumerate(zip(every, expected_of_every))
                      if "error" not in r and r["tokens"] != e][:2],
            "recoveries": sum(r["recoveries"] for r in results)}


def series(args: argparse.Namespace, mode: str, n: int, prompts_: list[list[int]],
           expected: list[list[int]]) -> dict:
    rate, delay = ENVS[args.env]
    names = tuple(f"u{i}" for i in range(n))
    emulated = EmulatedSwarm(args.model, args.stages, entries=names)
    emulated.set_links({name: delay for name in emulated.names}, rate)
    users: list[User] = []
    try:
        emulated.start()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "BEESWARM_LOG_LEVEL": "ERROR", "PYTHONUNBUFFERED": "1"}
        for i, name in enumerate(names):
            real, proxy = emulated.ports(name)
            cmd = [sys.executable, __file__, "--user", "--mode", mode, "--model", args.model, "--draft", args.draft,
                   "--bootstrap", str(emulated.bootstrap), "--listen", str(real), "--announce", str(proxy),
                   "--tokens", str(args.tokens), "--prompt", json.dumps(prompts_[i])]
            with open(LOGS / f"{mode}-{n}-{name}.log", "w") as log_file:  # (the child holds its own descriptor)
                process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                                           text=True, env=env)
            emulated.register(name, process.pid)  # (it dials nobody for seconds: torch and the model load first)
            users.append(User(name, process, prompts_[i]))
            threading.Thread(target=users[-1].read, daemon=True).start()
        for u in users:
            u.wait_lines(1, 300)
        rounds, cpu = [], 0.0
        for r in range(args.runs + 1):  # round 0: cold, the users' first contact with the stages
            if r == 1:
                cpu0, wall0 = sum(_cpu(u) for u in users), time.monotonic()
            for u in users:
                u.go()
            for u in users:
                u.wait_lines(r + 2, 600)
            rounds.append(round_figures([u.lines[r + 1] for u in users], expected[:n]))
            print(f"{mode} x{n} round {r}: {rounds[-1]}", file=sys.stderr, flush=True)
        if args.runs:
            cpu = (sum(_cpu(u) for u in users) - cpu0) / (time.monotonic() - wall0)
    finally:
        for u in users:
            if u.process.stdin:
                u.process.stdin.close()
        for u in users:
            try:
                u.process.wait(20)
            except subprocess.TimeoutExpired:
                u.process.kill()
        emulated.stop(grace=60)  # each contributor's `served` event comes as it leaves
    served = [json.loads(line) for c in emulated.swarm.children for line in _drain(c.lines)
              if line.startswith('{"event": "served"')]
    steps, passes = sum(s["steps"] for s in served), sum(s["passes"] for s in served)
    warm = [x for x in rounds[1:] if "aggregate" in x] or [x for x in rounds if "aggregate" in x]
    keys = ("aggregate", "per_user_median", "per_user_worst", "worst_over_median", "ttft_median_s", "ttft_worst_s")
    return {"mode": mode, "users": n, "cold": rounds[0],
            "median": {k: round(statistics.median(x[k] for x in warm), 3) if warm else None for k in keys},
            "rounds": rounds[1:], "exact": sum(x["exact"] for x in rounds), "generations": n * len(rounds),
            "failed": sum(x["failed"] for x in rounds),
            "steps_per_pass": round(steps / max(1, passes), 3), "stage_steps": steps, "stage_passes": passes,
            "entry_cores": round(cpu, 3)}


def _cpu(u: User) -> float:
    try:
        t = psutil.Process(u.process.pid).cpu_times()
        return t.user + t.system
    except psutil.Error:
        return 0.0


def _drain(lines: queue.Queue) -> list[str]:
    """What a stopped child printed, to its end."""
    out = []
    while True:
        try:
            line = lines.get(timeout=10)
        except queue.Empty:
            return out
        if line is None:
            return out
        out.append(line)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--user", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="spec", help=argparse.SUPPRESS)
    ap.add_argument("--bootstrap", help=argparse.SUPPRESS)
    ap.add_argument("--listen", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--announce", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--prompt", help=argparse.SUPPRESS)
    ap.add_argument("--users", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--modes", nargs="+", default=["spec", "hops"], choices=["spec", "plain", "hops"])
    ap.add_argument("--runs", type=int, default=5, help="warm rounds after the cold one (medians over them)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--env", choices=sorted(ENVS), default="E4")
    ap.add_argument("--model", default="tinycode", help="a built-in name or a checkpoint folder")
    ap.add_argument("--draft", default="tinycode-draft")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="also write the results to this JSON file")
    args = ap.parse_args()
    if args.user:
        user(args)
        return
    from beeswarm.shard import checkpoint
    from beeswarm.shard.loader import load_config

    vocab = int(load_config(checkpoint.resolve_config(args.model)).vocab_size)
    prompts_ = prompts(args.model, max(args.users), vocab)
    expected = references(args.model, prompts_, args.tokens)
    LOGS.mkdir(exist_ok=True)
    rows = [series(args, mode, n, prompts_, expected) for mode in args.modes for n in args.users]
    result = {"env": args.env, "model": args.model, "stages": args.stages, "tokens": args.tokens,
              "runs": args.runs, "date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if args.json:
        print(json.dumps(result))
        return
    print("| mode | users | aggregate tok/s | per user median / worst | worst/median | TTFT median / worst | "
          "cold TTFT slope | steps a pass | entry cores | exact | failed |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        m = r["median"]
        print(f"| {r['mode']} | {r['users']} | {m['aggregate']} | {m['per_user_median']} / {m['per_user_worst']} | "
              f"{m['worst_over_median']} | {m['ttft_median_s']} / {m['ttft_worst_s']} s | "
              f"{r['cold'].get('ttft_slope_s_per_user')} s/user | {r['steps_per_pass']} | {r['entry_cores']} | "
              f"{r['exact']}/{r['generations']} | {r['failed']} |")


if __name__ == "__main__":
    main()
