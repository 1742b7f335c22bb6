#!/usr/bin/env python3
"""Train `tinycode`: the small target + draft pair beeswarm ships so a fresh clone makes real text.

Both models learn from the CPython standard-library sources of the running interpreter, which
every machine has. Files whose name hashes to 0 mod 20 are held out for validation. The script is
deterministic (fixed seeds, sorted files, one thread order) and takes about 50 minutes on 2 CPU
cores (fixed step counts, so the weights do not depend on the machine's speed). It writes Hugging
Face folders (fp16 safetensors) under beeswarm/assets/tinycode/ and prints the validation loss of
each model and the draft's greedy agreement with the target.

    python scripts/train_tinycode.py [--out DIR] [--target-steps 2500] [--draft-steps 2000]

The draft it trains is on the corpus alone; the shipped draft is then taught by the target:

    python scripts/distill_draft.py --fresh 3,192 --steps 2000 --lr 3e-3 --out beeswarm/assets/tinycode/draft
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from beeswarm.shard.tokenizer import EOS, save_tokenizer, train_bpe

VOCAB = 2048
SEQ = 256
MAX_POSITIONS = 2048
TARGET = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=704)
DRAFT = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
             intermediate_size=352)
# The sampling defaults `beeswarm chat`/`demo`/`serve` take from the target's generation_config.json: chosen by
# reading samples of held-out prompts (README, "The built-in model"); the penalty stops greedy loops.
SAMPLING = dict(do_sample=True, temperature=0.6, top_p=0.9, repetition_penalty=1.3)


def stdlib_files() -> tuple[list[Path], list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "site-packages" not in p.parts and "dist-packages" not in p.parts)
    train, val = [], []
    for p in files:
        rel = str(p.relative_to(root)).encode()
        (val if int(hashlib.sha256(rel).hexdigest(), 16) % 20 == 0 else train).append(p)
    return train, val


def read(p: Path) -> str:
    return p.read_text(encoding="utf-8", errors="replace")


def token_stream(tok, files: list[Path]) -> torch.Tensor:
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for p in files:
        ids.extend(tok.encode(read(p)).ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def config(shape: dict) -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, max_position_embeddings=MAX_POSITIONS, tie_word_embeddings=True,
                       rope_theta=10000.0, bos_token_id=0, eos_token_id=0, pad_token_id=None, **shape)


@torch.no_grad()
def val_loss(model, data: torch.Tensor, batches: int = 40, batch: int = 8) -> float:
    model.eval()
    n = (len(data) - 1) // SEQ
    step = max(1, n // (batches * batch))
    starts = [i * SEQ * step for i in range(min(n, batches * batch))]
    losses = []
    for i in range(0, len(starts), batch):
        x = torch.stack([data[s:s + SEQ + 1] for s in starts[i:i + batch]])
        losses.append(model(input_ids=x[:, :-1], labels=x[:, :-1]).loss.item())
    model.train()
    return sum(losses) / len(losses)


def lr_scale(step: int, steps: int, warmup: int) -> float:
    """Linear warm-up, then cosine decay to 5% of the peak rate."""
    return min(1.0, (step + 1) / warmup) * max(0.05, 0.5 * (1 + math.cos(math.pi * step / steps)))


def train(name: str, shape: dict, data: torch.Tensor, steps: int, seed: int, lr: float,
          batch: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config(shape))
    model.train()
    params = sum(p.numel() for p in model.parameters())
    print(f"[{name}] {params / 1e6:.2f}M params, {steps} steps of {batch}x{SEQ} tokens", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.05)
    gen = torch.Generator().manual_seed(seed)
    warmup, t0 = 50, time.time()
    for step in range(steps):  # transformers shifts the labels itself: labels are the inputs
        for g in opt.param_groups:
            g["lr"] = lr * lr_scale(step, steps, warmup)
        starts = torch.randint(0, len(data) - SEQ - 1, (batch,), generator=gen)
        x = torch.stack([data[s:s + SEQ + 1] for s in starts.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16):  # ~1.9x faster than float32 on this CPU
            loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % 100 == 0:
            print(f"[{name}] step {step + 1}/{steps} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    return model


@torch.no_grad()
def greedy_agreement(target, draft, data: torch.Tensor, samples: int = 64, ctx: int = 128) -> float:
    """Share of positions where the draft's argmax equals the target's, teacher-forced on held-out text."""
    target.eval(), draft.eval()
    n = len(data) - ctx - 1
    starts = [i * (n // samples) for i in range(samples)]
    x = torch.stack([data[s:s + ctx] for s in starts])
    t = target(input_ids=x).logits.argmax(-1)
    d = draft(input_ids=x).logits.argmax(-1)
    return (t == d).float().mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "beeswarm/assets/tinycode")
    ap.add_argument("--target-steps", type=int, default=2500)
    ap.add_argument("--draft-steps", type=int, default=2000)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)

    train_files, val_files = stdlib_files()
    print(f"{len(train_files)} training files, {len(val_files)} held out", flush=True)
    tok = train_bpe((read(p) for p in train_files), VOCAB)
    train_ids, val_ids = token_stream(tok, train_files), token_stream(tok, val_files)
    print(f"{len(train_ids) / 1e6:.1f}M training tokens, {len(val_ids) / 1e6:.2f}M held out", flush=True)

    target = train("target", TARGET, train_ids, args.target_steps, seed=1, lr=2e-3, batch=16)
    draft = train("draft", DRAFT, train_ids, args.draft_steps, seed=2, lr=3e-3, batch=16)

    report = {
        "target_val_loss": round(val_loss(target, val_ids), 4),
        "draft_val_loss": round(val_loss(draft, val_ids), 4),
        "draft_greedy_agreement": round(greedy_agreement(target, draft, val_ids), 4),
        "train_tokens": len(train_ids), "val_tokens": len(val_ids),
    }
    for name, model in (("target", target), ("draft", draft)):
        folder = args.out / name
        folder.mkdir(parents=True, exist_ok=True)
        model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, **SAMPLING)
        model.half().save_pretrained(str(folder), safe_serialization=True)
        save_tokenizer(tok, folder, model_max_length=MAX_POSITIONS)
    (args.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
