#!/usr/bin/env python3
"""Distil a draft from its target: teach the draft the target's own next-token distribution.

A draft trained on the corpus alone guesses the corpus; speculation gains only where it guesses the
target, and a stronger target is harder to guess. Here the draft (started from its current weights)
minimises KL(target || draft) over every position of text batches, the target's logits computed on the
fly; the corpus is the CPython standard-library sources of the running interpreter (every machine has
them; files hashed to 0 mod 20 held out, as `train_tinycode.py` does) or the `--text` files given.
Deterministic: fixed seeds, sorted files, fixed step counts. Draft and target must share a tokenizer.

It prints, before and after: the draft's greedy agreement with the target (teacher-forced on held-out
text), draft tokens accepted per round of greedy chain speculation (`--chain` drafted tokens a round, on
held-out prompts), and the draft's milliseconds per drafted token; then writes the draft (fp16
safetensors, the target's tokenizer files copied beside it) to `--out`.

    python scripts/distill_draft.py                       # tinycode's draft, in place
    python scripts/distill_draft.py --target DIR --draft DIR --out DIR [--steps 1200] [--text FILE ...]
    python scripts/distill_draft.py --fresh 3,192 --steps 2000 --out DIR   # a larger draft, taught from the start
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from train_tinycode import greedy_agreement, lr_scale, read, stdlib_files
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from beeswarm.generation.sampling import SamplingParams
from beeswarm.spec.draft import DraftModel
from beeswarm.spec.tuner import TreeShape

ASSETS = Path(__file__).resolve().parents[1] / "beeswarm/assets/tinycode"
SEQ = 256
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def fresh_draft(target_config, shape: str, seed: int):
    """A Llama of `shape` ("LAYERS,HIDDEN"; heads of 64) with random weights, the target's vocabulary, context
    and special tokens."""
    try:
        layers, hidden = (int(x) for x in shape.split(","))
    except ValueError:
        raise SystemExit(f"error: --fresh takes LAYERS,HIDDEN (e.g. 3,192), got {shape!r}") from None
    torch.manual_seed(seed)
    heads = max(1, hidden // 64)
    config = LlamaConfig(vocab_size=target_config.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads,
                         intermediate_size=int(hidden * 2.75) // 16 * 16,
                         max_position_embeddings=target_config.max_position_embeddings, tie_word_embeddings=True,
                         bos_token_id=target_config.bos_token_id, eos_token_id=target_config.eos_token_id)
    return LlamaForCausalLM(config)


def tokens(tok, files: list[Path]) -> torch.Tensor:
    ids: list[int] = []
    for p in files:
        ids.extend(tok.encode(read(p), add_special_tokens=False))
        if tok.eos_token_id is not None:
            ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


def distil(target, draft, data: torch.Tensor, steps: int, batch: int, lr: float, seed: int) -> None:
    """`steps` AdamW steps of KL(target || draft) over every position of `batch` random windows of `data`."""
    target.eval(), draft.train()
    opt = torch.optim.AdamW(draft.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    warmup, t0 = 20, time.time()
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr * lr_scale(step, steps, warmup)
        starts = torch.randint(0, len(data) - SEQ, (batch,), generator=gen)
        x = torch.stack([data[s:s + SEQ] for s in starts.tolist()])
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            teacher = target(input_ids=x).logits.float().log_softmax(-1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            student = draft(input_ids=x).logits.float().log_softmax(-1)
        loss = F.kl_div(student.flatten(0, 1), teacher.flatten(0, 1), log_target=True, reduction="batchmean")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        if (step + 1) % 25 == 0 or step + 1 == steps:
            print(f"[distil] step {step + 1}/{steps} KL {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
    draft.eval()


@torch.no_grad()
def accepted_per_round(target, draft, prompts: list[torch.Tensor], chain: int, new_tokens: int) -> float:
    """Greedy chain speculation on `prompts`: the draft's tokens the target accepted, per round (the
    target's own token each round not counted)."""
    accepted = rounds = 0
    for prompt in prompts:
        seq = prompt.tolist()
        produced = 0
        while produced < new_tokens:
            guess: list[int] = []
            for _ in range(chain):
                guess.append(int(draft(input_ids=torch.tensor([seq + guess])).logits[0, -1].argmax()))
            verdict = target(input_ids=torch.tensor([seq + guess])).logits[0, len(seq) - 1:].argmax(-1).tolist()
            n = next((i for i, (g, t) in enumerate(zip(guess, verdict)) if g != t), chain)
            seq += guess[:n] + [verdict[n]]
            accepted, rounds, produced = accepted + n, rounds + 1, produced + n + 1
    return accepted / rounds


def ms_per_token(folder: Path, vocab: int, prompts: list[torch.Tensor], chain: int) -> float:
    """Milliseconds per drafted token as beeswarm drafts (`DraftModel.propose`, a greedy chain of `chain`),
    the median over 8 rounds on each prompt."""
    draft, times = DraftModel(str(folder), vocab), []
    for prompt in prompts:
        seq = prompt.tolist()
        draft.reset(len(seq) + 16)
        for _ in range(8):
            t0 = time.perf_counter()
            tree = draft.propose(seq, TreeShape((1,) * chain), SamplingParams())
            times.append((time.perf_counter() - t0) * 1000 / chain)
            seq = seq + [tree.tokens[0]]
    draft.close()
    return statistics.median(times)


def held_out_prompts(val: torch.Tensor) -> list[torch.Tensor]:
    stride = len(val) // 9
    return [val[i * stride:i * stride + 48] for i in range(1, 9)]


def measure(target, draft, val: torch.Tensor, chain: int) -> dict[str, float]:
    return {"greedy_agreement": round(greedy_agreement(target, draft, val), 4),
            "accepted_per_round": round(accepted_per_round(target, draft, held_out_prompts(val), chain, 48), 3)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, default=ASSETS / "target", help="the target's checkpoint folder")
    ap.add_argument("--draft", type=Path, default=ASSETS / "draft", help="the draft to start from")
    ap.add_argument("--out", type=Path, help="where to write the distilled draft (default: over --draft)")
    ap.add_argument("--fresh", metavar="LAYERS,HIDDEN", help="start from random weights of a Llama of this shape "
                    "(the target's vocabulary and context) instead of --draft's, which is then only compared")
    ap.add_argument("--text", type=Path, nargs="*", help="text files to distil on (default: the stdlib sources)")
    ap.add_argument("--steps", type=int, default=1200, help="optimizer steps (default 1200: ~10 min on 2 "
                    "cores for tinycode)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--chain", type=int, default=4, help="drafted tokens per round when measuring acceptance")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(str(args.target))
    target = AutoModelForCausalLM.from_pretrained(str(args.target), torch_dtype=torch.float32)
    vocab = target.config.vocab_size
    draft = AutoModelForCausalLM.from_pretrained(str(args.draft), torch_dtype=torch.float32)
    if vocab != draft.config.vocab_size:
        print(f"error: the draft's vocabulary ({draft.config.vocab_size}) is not the target's ({vocab}): a draft "
              "must share its target's tokenizer", file=sys.stderr)
        return 2
    student = fresh_draft(target.config, args.fresh, args.seed) if args.fresh else draft
    if args.text:
        files = sorted(args.text)
        train_files, val_files = files[1:] or files, files[:1]
    else:
        train_files, val_files = stdlib_files()
    train_ids, val_ids = tokens(tok, train_files), tokens(tok, val_files)
    print(f"{len(train_ids) / 1e6:.1f}M tokens to distil on, {len(val_ids) / 1e6:.2f}M held out", flush=True)

    before = measure(target, draft, val_ids, args.chain)
    before["draft_ms_per_token"] = round(ms_per_token(args.draft, vocab, held_out_prompts(val_ids), args.chain), 2)
    before["parameters"] = sum(p.numel() for p in draft.parameters())
    print("before:", json.dumps(before), flush=True)
    t0 = time.time()
    distil(target, student, train_ids, args.steps, args.batch, args.lr, args.seed)
    minutes = (time.time() - t0) / 60
    after = measure(target, student, val_ids, args.chain)

    out = args.out or args.draft
    out.mkdir(parents=True, exist_ok=True)
    student.generation_config = target.generation_config  # the target's sampling defaults, as tinycode's pair has
    student.half().save_pretrained(str(out), safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (args.target / name).exists() and (args.target / name).resolve() != (out / name).resolve():
            shutil.copy(args.target / name, out / name)
    after["draft_ms_per_token"] = round(ms_per_token(out, vocab, held_out_prompts(val_ids), args.chain), 2)
    after["parameters"] = sum(p.numel() for p in student.parameters())
    report = {"steps": args.steps, "batch": args.batch, "seq": SEQ, "minutes": round(minutes, 1),
              "fresh": args.fresh, "chain": args.chain, "before": before, "after": after}
    (out / "distill.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
