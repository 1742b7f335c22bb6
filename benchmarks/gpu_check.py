#!/usr/bin/env python3
"""Every path that needs CUDA, in a few minutes, as one table: run it on any machine with a GPU.

Rows (each: ok or FAILED, a figure, the seconds it took):
- bench: the device benchmark a contributor runs (ms per layer, memory, host-to-device offload GB/s).
- offload: a span with half its layers offloaded (pinned host memory, streamed on a side stream) gives the
  outputs of the same span held whole on the device, and what streaming costs per pass.
- int8, nf4: spans in each weight format on the device against the same format on the CPU in float32.
- swarm: a local swarm of 3 contributor processes on the device and a greedy `chat` through it give
  transformers' own greedy tokens on that device and dtype.
`--device cpu` runs the same rows on the CPU (the suite does, so the script never rots).

    python benchmarks/gpu_check.py [--device cuda] [--model tinycode] [--json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from beeswarm.audit.replay import relative_error, tolerance
from beeswarm.contributor.local_swarm import ChildFlags, LocalSwarm, beeswarm_command
from beeswarm.shard import Span, SpanRuntime, benchmark, checkpoint
from beeswarm.shard.device import resolve_device, resolve_dtype
from beeswarm.shard.errors import ShardError
from beeswarm.shard.loader import load_config

PROMPT = "def fibonacci(n):"
TOKENS = 16


@dataclass
class Row:
    check: str
    ok: bool
    figure: str
    seconds: float


def timed(name: str, check: Callable[[], tuple[bool, str]]) -> Row:
    t0 = time.perf_counter()
    try:
        ok, figure = check()
    except Exception as e:  # noqa: BLE001 - a failed check is a row, the others still run
        ok, figure = False, f"{type(e).__name__}: {e}"[:300]
    return Row(name, ok, figure, round(time.perf_counter() - t0, 1))


def hidden_states(model: str, device: torch.device, dtype: torch.dtype, n: int = 24) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(n, load_config(checkpoint.resolve(model)).hidden_size, dtype=dtype, device=device)


def run_span(runtime: SpanRuntime, hidden: torch.Tensor, repeat: int = 1) -> tuple[torch.Tensor, float]:
    """The span's output for `hidden` as a prefill, and its median ms over `repeat` passes."""
    times, out = [], hidden
    for i in range(repeat):
        runtime.open(f"check{i}", hidden.shape[0])
        t0 = time.perf_counter()
        out = runtime.step_one(f"check{i}", hidden, 0)
        if runtime.device.type == "cuda":
            torch.cuda.synchronize(runtime.device)
        times.append((time.perf_counter() - t0) * 1e3)
        runtime.close(f"check{i}")
    return out, sorted(times)[len(times) // 2]


def check_bench(model: str, device: str) -> tuple[bool, str]:
    r = benchmark.run(model, device=device, refresh=True)
    offload = f", offload {r.offload_gbps:.1f} GB/s" if r.offload_gbps else ""
    return r.layer_ms_base > 0 and r.mem_bytes > 0, \
        f"{r.layer_ms_base:.3f} ms/layer + {r.layer_ms_per_token * 1e3:.1f} us/token, " \
        f"{r.mem_bytes / 2**30:.1f} GiB free{offload} ({r.dtype})"


def check_offload(model: str, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    folder = checkpoint.resolve(model)
    layers = load_config(folder).num_hidden_layers
    hidden = hidden_states(model, device, dtype)
    whole, ms_whole = run_span(SpanRuntime(folder, Span(0, layers), dtype=dtype, device=device), hidden, 5)
    half, ms_half = run_span(SpanRuntime(folder, Span(0, layers), dtype=dtype, device=device,
                                         offload_fraction=0.5), hidden, 5)
    error = relative_error(half.float(), whole.float())
    return error <= tolerance(dtype), f"error {error:.1e}; {ms_whole:.2f} ms held, {ms_half:.2f} ms half offloaded"


def check_quant(model: str, quant: str, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    folder = checkpoint.resolve(model)
    span = Span(0, 2)
    hidden = hidden_states(model, device, dtype)
    got, ms = run_span(SpanRuntime(folder, span, dtype=dtype, device=device, quant=quant), hidden, 5)
    reference, _ = run_span(SpanRuntime(folder, span, dtype=torch.float32, device="cpu", quant=quant),
                            hidden.float().cpu())
    error = relative_error(got.float().cpu(), reference)
    return error <= tolerance(dtype), f"error {error:.1e} against the CPU; {ms:.2f} ms for 2 layers"


def reference_tokens(model: str, device: torch.device, dtype: torch.dtype) -> list[int]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = str(checkpoint.resolve(model))
    ids = AutoTokenizer.from_pretrained(folder).encode(PROMPT)
    lm = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    with torch.no_grad():
        out = lm.generate(torch.tensor([ids], device=device), max_new_tokens=TOKENS, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(ids):].tolist()


def check_swarm(model: str, device: str, dtype: torch.dtype) -> tuple[bool, str]:
    swarm = LocalSwarm(3, model, flags=ChildFlags(device=device))
    try:
        boot = swarm.start()
        swarm.wait_ready()
        t0 = time.perf_counter()
        out = subprocess.run([*beeswarm_command(), "chat", "--join", boot, "--model", model, "--device", device,
                              "--greedy", "--no-spec", "--json", "--max-new-tokens", str(TOKENS), "--prompt", PROMPT],
                             capture_output=True, text=True, timeout=300)
        seconds = time.perf_counter() - t0
    finally:
        swarm.stop()
    if out.returncode != 0:
        return False, f"chat failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}"
    tokens = json.loads(out.stdout)["tokens"]
    expected = reference_tokens(model, resolve_device(device), dtype)
    same = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
    if same is not None or len(tokens) != len(expected):
        return False, f"tokens differ from transformers' at position {same}"
    return True, f"{len(tokens)} tokens equal transformers' ({seconds:.1f} s for the chat, 3 stages)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    ap.add_argument("--model", default="tinycode")
    ap.add_argument("--json", action="store_true", help="print the rows as one JSON object")
    args = ap.parse_args()
    try:
        device = resolve_device(args.device)
    except ShardError as e:
        sys.exit(f"{e}: run with --device cpu to check the same paths on the CPU")
    dtype = resolve_dtype("auto", device)
    rows = [timed("bench", lambda: check_bench(args.model, args.device)),
            timed("offload", lambda: check_offload(args.model, device, dtype)),
            *(timed(q, lambda q=q: check_quant(args.model, q, device, dtype)) for q in ("int8", "nf4")),
            timed("swarm", lambda: check_swarm(args.model, args.device, dtype))]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    if args.json:
        print(json.dumps({"device": name, "torch": torch.__version__, "dtype": str(dtype),
                          "rows": [asdict(r) for r in rows]}))
    else:
        print(f"{name}, torch {torch.__version__}, {dtype}")
        for r in rows:
            print(f"{r.check:<8} {'ok' if r.ok else 'FAILED':<7} {r.seconds:>6.1f} s  {r.figure}")
    sys.exit(0 if all(r.ok for r in rows) else 1)


if __name__ == "__main__":
    main()
