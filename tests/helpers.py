"""Small helpers shared by the tests."""
from __future__ import annotations

import os
import queue
import threading
import time

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


def reference_greedy(folder, prompt_ids: list[int], n: int) -> list[int]:
    """transformers' own greedy continuation of `prompt_ids` on the checkpoint in `folder` (the oracle)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
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
