#!/usr/bin/env python3
"""Quantized weights: which library, what they cost in quality, and what they cost in speed.

Sections (all by default):
- libraries: one linear map of a 7B-class MLP (2048 -> 5632), decode (1 token) and prefill (64 tokens):
  median ms and relative output error, float32 and bfloat16 activations, for torchao (the one beeswarm
  uses) and, where installed (`pip install -e '.[compare]'`), optimum-quanto and bitsandbytes.
- quality: tinycode on its held-out files (the CPython standard library files scripts/train_tinycode.py
  holds out): bits per byte, and greedy agreement with full precision (teacher-forced, every position),
  for none, int8 and nf4 weights (every decoder layer quantized by `shard.quant`, as stages load them).
- speed: `beeswarm bench`'s per-layer figures (`layer_ms_base`, `layer_ms_per_token`, bytes) per format.
- larger: the quality section on a wider checkpoint made here (`LARGER`: 512 wide, 6 layers, 19M
  parameters, tinycode's tokenizer and data, `--larger-steps` steps; cached under the cache dir).

    python benchmarks/quant_bench.py [--sections libraries quality speed larger] [--json]
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import logging
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn
from transformers import AutoModelForCausalLM

from beeswarm.config import cache_dir
from beeswarm.shard import benchmark, checkpoint, quant
from beeswarm.shard.tokenizer import save_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from train_tinycode import read, stdlib_files, token_stream, train  # noqa: E402 - tinycode's split and loop

LARGER = dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=1408)

FORMATS = quant.FORMATS


def median_ms(fn: Callable[[], object], repeat: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _torchao(weights: str) -> Callable[[nn.Linear], nn.Module]:
    def make(linear: nn.Linear) -> nn.Module:
        wrapper = nn.Sequential(linear)
        quant.quantize_layer(wrapper, weights)
        return wrapper
    return make


def _quanto(linear: nn.Linear) -> nn.Module:
    from optimum.quanto import freeze, qint8, quantize

    wrapper = nn.Sequential(linear)
    quantize(wrapper, weights=qint8)
    freeze(wrapper)
    return wrapper


def _bnb(kind: str) -> Callable[[nn.Linear], nn.Module]:
    def make(linear: nn.Linear) -> nn.Module:
        import bitsandbytes as bnb

        w = linear.weight.data.float().clone()
        if kind == "int8":
            m = bnb.nn.Linear8bitLt(w.shape[1], w.shape[0], bias=False, has_fp16_weights=False, threshold=0.0)
            m.weight = bnb.nn.Int8Params(w, requires_grad=False, has_fp16_weights=False)
        else:
            m = bnb.nn.Linear4bit(w.shape[1], w.shape[0], bias=False, compute_dtype=linear.weight.dtype,
                                  quant_type="nf4")
            m.weight = bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4")
        return m.to("cpu")
    return make


def libraries() -> list[dict]:
    candidates: dict[str, Callable[[nn.Linear], nn.Module]] = {"torchao int8": _torchao("int8"),
                                                               "torchao nf4": _torchao("nf4")}
    if importlib.util.find_spec("optimum.quanto"):
        candidates["quanto qint8"] = _quanto
    if importlib.util.find_spec("bitsandbytes"):
        candidates["bitsandbytes int8"] = _bnb("int8")
        candidates["bitsandbytes nf4"] = _bnb("nf4")
    torch.manual_seed(0)
    base = nn.Linear(2048, 5632, bias=False).eval()
    with torch.no_grad():
        base.weight.normal_(0, 0.02)  # trained weights are near-normal; NF4's levels assume it
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        plain = copy.deepcopy(base).to(dtype)
        for tokens in (1, 64):
            x = torch.randn(tokens, 2048, dtype=dtype)
            with torch.inference_mode():
                want = base(x.float())
                for name, make in {"full precision": lambda m: m, **candidates}.items():
                    try:
                        module = make(copy.deepcopy(plain))
                        got = module(x).float()
                        row = {"library": name, "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
                               "ms": round(median_ms(lambda: module(x)), 3),
                               "rel_err": round(((got - want).norm() / want.norm()).item(), 5)}
                    except Exception as e:  # noqa: BLE001 - a library that cannot do this on CPU says so
                        row = {"library": name, "dtype": str(dtype).removeprefix("torch."), "tokens": tokens,
                               "error": str(e)[:120]}
                    rows.append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


@torch.no_grad()
def quality(model: str, windows: int, seq: int) -> dict:
    folder = checkpoint.resolve(model)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    _, held_out = stdlib_files()
    text = "\n".join(read(p) for p in held_out)
    ids = torch.tensor(tok.encode(text).ids)
    step = max(1, (len(ids) - seq - 1) // windows)
    starts = [i * step for i in range(windows)]
    batch = torch.stack([ids[s:s + seq + 1] for s in starts])
    scored_bytes = sum(len(tok.decode(batch[i, 1:].tolist()).encode()) for i in range(len(batch)))
    out, reference_argmax = {}, None
    for weights in FORMATS:
        net = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        for layer in net.model.layers:
            quant.quantize_layer(layer, weights)
        nats, argmax = 0.0, []
        for i in range(0, len(batch), 8):
            x = batch[i:i + 8]
            logits = net(input_ids=x[:, :-1]).logits
            nats += nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
            argmax.append(logits.argmax(-1))
        predicted = torch.cat(argmax)
        if reference_argmax is None:
            reference_argmax = predicted
        out[weights] = {"bits_per_byte": nats / math.log(2) / scored_bytes,
                        "greedy_agreement": round((predicted == reference_argmax).float().mean().item(), 4),
                        "next_token_accuracy": round((predicted == batch[:, 1:]).float().mean().item(), 4)}
        print(json.dumps({weights: out[weights]}), file=sys.stderr, flush=True)
    base = out["none"]["bits_per_byte"]
    for weights in FORMATS:
        out[weights]["bits_per_byte_change"] = round(out[weights]["bits_per_byte"] / base - 1, 6)
        out[weights]["bits_per_byte"] = round(out[weights]["bits_per_byte"], 5)
    return {"model": model, "tokens_scored": int(batch[:, 1:].numel()), "bytes_scored": scored_bytes, **out}


def larger_checkpoint(steps: int) -> Path:
    """A checkpoint wider than tinycode, trained here on tinycode's data (made once, then cached)."""
    folder = cache_dir() / "bench" / f"larger-{steps}"
    if (folder / "config.json").exists():
        return folder
    tok = Tokenizer.from_file(str(checkpoint.resolve("tinycode") / "tokenizer.json"))
    train_files, _ = stdlib_files()
    with contextlib.redirect_stdout(sys.stderr):  # its progress lines; stdout is the JSON
        model = train("larger", LARGER, token_stream(tok, train_files), steps, seed=3, lr=1.5e-3, batch=16)
    model.save_pretrained(str(folder))
    save_tokenizer(tok, folder, model_max_length=model.config.max_position_embeddings)
    return folder


def speed(model: str) -> dict:
    out = {}
    for weights in FORMATS:
        r = benchmark.run(model, "cpu", "float32", refresh=True, weights=weights)
        out[weights] = {"layer_bytes": r.layer_bytes, "layer_ms_base": r.layer_ms_base,
                        "layer_ms_per_token": r.layer_ms_per_token}
        print(json.dumps({weights: out[weights]}), file=sys.stderr, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sections", nargs="+", default=["libraries", "quality", "speed", "larger"],
                    choices=["libraries", "quality", "speed", "larger"])
    ap.add_argument("--larger-steps", type=int, default=200, help="larger: training steps (batch 16 x 256)")
    ap.add_argument("--model", default="tinycode")
    ap.add_argument("--windows", type=int, default=128, help="quality: held-out windows scored")
    ap.add_argument("--seq", type=int, default=256, help="quality: tokens per window")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    logging.getLogger("torchao").setLevel(logging.ERROR)
    results: dict = {}
    if "libraries" in args.sections:
        results["libraries"] = libraries()
    if "quality" in args.sections:
        results["quality"] = quality(args.model, args.windows, args.seq)
    if "speed" in args.sections:
        results["speed"] = speed(args.model)
    if "larger" in args.sections:
        results["larger"] = quality(str(larger_checkpoint(args.larger_steps)), args.windows, args.seq)
    print(json.dumps(results, indent=None if args.json else 2))


if __name__ == "__main__":
    main()
