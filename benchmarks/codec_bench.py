#!/usr/bin/env python3
"""Codec benchmark on real hidden states: compression ratio and single-core encode/decode speed.

Hidden states are captured from the tinycode target (or --model) after several layers, for 1, 16
and 512 tokens of held-out standard-library source, in bf16, fp16 and fp32.

    python benchmarks/codec_bench.py [--model tinycode] [--repeat 20] [--json]
"""
from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time

import torch

from beeswarm import codec
from beeswarm.shard import EntryModel, Span, SpanRuntime, checkpoint

TOKEN_COUNTS = (1, 16, 512)
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def sample_text(tokens_needed: int, tokenizer) -> list[int]:
    # This very module's source plus the codec's: real Python that tinycode has not trained on.
    text = inspect.getsource(codec.frame) + inspect.getsource(codec.policy)
    while len(text) < 8 * tokens_needed:
        text += text
    return tokenizer.encode(text[: 8 * tokens_needed])[:tokens_needed]


def capture(model: str, tokens: int) -> dict[int, torch.Tensor]:
    """Hidden states (tokens, hidden) after every layer, in float32."""
    from transformers import AutoTokenizer

    folder = checkpoint.resolve(model)
    entry = EntryModel(folder, dtype="float32", device="cpu")
    layers = entry.config.num_hidden_layers
    ids = torch.tensor(sample_text(tokens, AutoTokenizer.from_pretrained(str(folder))))
    hidden, out = entry.embed(ids), {}
    for layer in range(layers):
        span = SpanRuntime(folder, Span(layer, layer + 1), dtype="float32", device="cpu")
        span.open("bench", tokens)
        hidden = span.step_one("bench", hidden, 0)
        out[layer] = hidden.clone()
    return out


def as_bytes(tensor: torch.Tensor) -> bytes:
    if tensor.dtype == torch.bfloat16:
        tensor = tensor.view(torch.int16)
    return tensor.contiguous().numpy().tobytes()


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def run(model: str, repeat: int) -> list[dict]:
    rows = []
    for tokens in TOKEN_COUNTS:
        states = capture(model, tokens)
        picks = sorted({0, len(states) // 2, len(states) - 1})
        for dtype, torch_dtype in DTYPES.items():
            buffers = [as_bytes(states[layer].to(torch_dtype)) for layer in picks]
            shape = tuple(states[0].shape)
            for layout in ("raw", "zstd", "planes"):
                raw = sum(len(b) for b in buffers)
                frames = [codec.encode_layout(b, dtype, shape, layout) for b in buffers]
                enc = sum(timed(lambda b=b: codec.encode_layout(b, dtype, shape, layout), repeat) for b in buffers)
                dec = sum(timed(lambda f=f: codec.decode(f), repeat) for f in frames)
                for f, b in zip(frames, buffers):
                    assert bytes(codec.decode(f).data) == b
                rows.append({"layout": layout, "dtype": dtype, "tokens": tokens, "bytes": raw // len(buffers),
                             "ratio": round(raw / sum(map(len, frames)), 3),
                             "encode_mb_s": round(raw / enc / 1e6, 1), "decode_mb_s": round(raw / dec / 1e6, 1)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tinycode")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = run(args.model, args.repeat)
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{'layout':8} {'dtype':9} {'tokens':>6} {'bytes':>8} {'ratio':>6} {'enc MB/s':>9} {'dec MB/s':>9}")
    for r in rows:
        print(f"{r['layout']:8} {r['dtype']:9} {r['tokens']:>6} {r['bytes']:>8} {r['ratio']:>6.3f} "
              f"{r['encode_mb_s']:>9.0f} {r['decode_mb_s']:>9.0f}")


if __name__ == "__main__":
    main()
