"""Small helpers shared by the tests."""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from beeswarm.protocol.audit import Evidence, Verdict

LOCAL = ["/ip4/127.0.0.1/tcp/0"]
INTERVAL = 1.0  # membership and election heartbeat in tests


def wait_for(cond, timeout: float, what: str):
    """Poll `cond` until it returns something truthy; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


async def until(pilot, cond, timeout: float = 90.0, what: str = "the app") -> None:
    """`wait_for` inside a Textual pilot test: the app keeps running while `cond` is polled."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await pilot.pause(0.05)


def threads_left(before: set, timeout: float = 15.0) -> list[str]:
    """Names of threads started since `before` that are still alive after up to `timeout` seconds.

    asyncio_N threads are left out: the test's own event loop's executor, closed with the loop."""
    def left() -> list[str]:
        return [t.name for t in threading.enumerate() if t not in before and t.is_alive()
                and not t.name.startswith("asyncio_")]

    deadline = time.monotonic() + timeout
    while left() and time.monotonic() < deadline:
        time.sleep(0.1)
    return left()


def reference_greedy(folder, prompt_ids: list[int], n: int, **options) -> list[int]:
    """transformers' own greedy continuation of `prompt_ids` on the checkpoint in `folder` (the oracle);
    `options`: more of `generate`'s (repetition_penalty)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0, **options)
    return out[0, len(prompt_ids):].tolist()


def lines_of(proc):
    """Yield the process's stdout lines from a background reader (so reads never block the test)."""
    q: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [q.put(line.rstrip()) for line in proc.stdout], daemon=True).start()
    return q


def read_until(q, prefix, timeout):
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        try:
            line = q.get(timeout=0.2)
        except queue.Empty:
            continue
        seen.append(line)
        if line.startswith(prefix):
            return line, seen
    raise AssertionError(f"no {prefix!r} line within {timeout} s; saw {seen}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is as good as gone
        with open(f"/proc/{pid}/status") as f:
            return "State:\tZ" not in f.read()
    except OSError:
        return False


def in_terminal(argv: list[str], env: dict, shown: bytes, keys: bytes, timeout: float = 120) -> tuple[int, bytes]:
    """Run `argv` on a pseudo-terminal of its own; once `shown` is on screen type `keys`; wait for the exit.

    Returns (exit code, everything written to the terminal). Fails if `shown` never appears."""
    import pty
    import select

    pid, fd = pty.fork()
    if pid == 0:  # the child
        os.execve(argv[0], argv, {**env, "TERM": "xterm-256color"})
    seen, deadline, typed = b"", time.monotonic() + timeout, False
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    seen += os.read(fd, 65536)
                except OSError:  # the terminal closed: the program has exited
                    break
            if not typed and shown in seen:
                os.write(fd, keys)
                typed = True
        else:
            os.kill(pid, 9)
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    assert typed, f"{shown!r} never shown; the terminal's last output: {seen[-2000:]!r}"
    return os.waitstatus_to_exitcode(status), seen


def start_contributors(procs: list, model, n: int, max_memory: int, env: dict, tmp_path, join: str | None = None,
                       extra_env: dict[int, dict] | None = None, logs=None, heartbeat: float = INTERVAL
                       ) -> tuple[dict, str]:
    """`n` headless `contribute` processes on 127.0.0.1, each offering `max_memory` bytes, the first the
    bootstrap (or all joining `join`); each is added to `procs` as it starts (the caller kills them, even
    after a failure here); `extra_env[i]`: more environment for the i-th; `logs`: a folder for their logs
    (`node<i>.log`, INFO); `heartbeat`: the swarm's interval (production's is 3 s). Returns (peer id ->
    process, in the order started; the bootstrap address). Those joining a bootstrap start at once, side by
    side (each spends seconds importing torch)."""
    import subprocess
    import sys

    def start(i: int, boot: str | None):
        cmd = [sys.executable, "-m", "beeswarm", *(["--log-level", "INFO"] if logs else []), "contribute",
               "--headless", "--model", str(model), "--listen", "/ip4/127.0.0.1/tcp/0", "--max-memory",
               str(max_memory), "--heartbeat", str(heartbeat), *(["--join", boot] if boot else [])]
        with open(logs / f"node{i}.log", "w") if logs else open(os.devnull, "w") as err:  # the child keeps a copy
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                    env={**env, **(extra_env or {}).get(i, {}),
                                         "BEESWARM_CONFIG_DIR": str(tmp_path / f"node{i}")})
        procs.append(proc)
        return proc, lines_of(proc)

    peers, first, boot = {}, len(procs), join
    if boot is None:
        proc, q = start(first, None)
        peers[read_until(q, "peer ", 60)[0].split()[1]] = proc
        boot = read_until(q, "addr ", 10)[0].split()[1]
        first += 1
    started = [start(i, boot) for i in range(first, len(procs) + n - len(peers))]
    for proc, q in started:
        peers[read_until(q, "peer ", 90)[0].split()[1]] = proc
    return peers, boot


def serve(model: str, join: str, env: dict, log, *extra: str, heartbeat: float = INTERVAL):
    """A `beeswarm serve` process (its log in the file `log`) and the API's base URL."""
    import json
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "beeswarm", "--log-level", "INFO", "serve", "--join", join,
                             "--model", model, "--port", "0", "--json", "--heartbeat", str(heartbeat), *extra],
                            stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    line, _ = read_until(lines_of(proc), '{"event": "serving"', 120)
    return proc, json.loads(line)["url"]


def past_probation(health, generate) -> list[dict] | None:
    """The route `serve`'s /health shows (`health()`) once it has no stage on probation; while it has, one more
    generation through it (`generate()`), which is one more audit passed. A route through stages on probation
    streams its text only once their audits pass (test_audit): for `wait_for`, by tests that need text to stream
    as it is generated. No route (a re-plan under way) is not past probation: a test read its victim from the
    next /health and found no stage."""
    route = health()["route"]
    if not route:
        return None
    if any(hop["on_probation"] for hop in route):
        generate()
        return None
    return route


class Seen:
    """What the entry's audit unit told the world, kept: evidence sent (the coordinator answers with `verdict`),
    passes vouched, and the stages caught, cleared and left unverified (its reporter and its listener)."""

    def __init__(self):
        self.sent: list[Evidence] = []
        self.vouched: list[tuple] = []  # (session, commit, layers, steps)
        self.caught: dict[str, str] = {}
        self.cleared: dict[str, str] = {}
        self.unverified: list[str] = []
        self.verdict = lambda evidence: None

    def report(self, evidence: Evidence) -> Verdict | None:
        self.sent.append(evidence)
        return self.verdict(evidence)

    def vouch(self, session, commit, layers, steps) -> None:
        self.vouched.append((session, commit, layers, steps))

    def drain(self, timeout: float) -> None:
        pass

    def on_caught(self, stage: str, why: str) -> None:
        self.caught[stage] = why

    def on_cleared(self, stage: str, why: str) -> None:
        self.cleared[stage] = why

    def on_unverified(self, stage: str, why: str) -> None:
        self.unverified.append(stage)
