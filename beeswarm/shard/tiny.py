"""Deterministic tiny random checkpoints in Hugging Face format, for tests and benchmarks."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from beeswarm.shard.families import SUPPORTED
from beeswarm.shard.tokenizer import byte_tokenizer, save_tokenizer


def write_tiny_checkpoint(folder: Path, family: str = "llama", num_layers: int = 4, hidden_size: int = 64,
                          heads: int = 4, kv_heads: int = 2, intermediate_size: int = 128, seed: int = 0,
                          tie_word_embeddings: bool = False, max_shard_size: str | None = None,
                          dtype: torch.dtype = torch.float32, max_positions: int = 512,
                          vocab_size: int | None = None) -> Path:
    """Write a random `family` model with a 257-symbol byte-level tokenizer to `folder`.

    `vocab_size` below 257 makes a model for tests of sampling only: its tokenizer no longer fits.

    `max_shard_size` (e.g. "40KB") splits the weights into several files with an index.
    Weights are drawn with std 0.1 so hidden states differ visibly between layers.
    """
    if family not in SUPPORTED:
        raise ValueError(f"family {family!r}: expected one of {sorted(SUPPORTED)}")
    tokenizer = byte_tokenizer()
    vocab = vocab_size or tokenizer.get_vocab_size()
    # Gemma 2 alternates sliding-window and global layers: a window of 8 makes the sliding ones matter
    extra = {"sliding_window": 8, "head_dim": hidden_size // heads, "query_pre_attn_scalar": hidden_size // heads} \
        if family == "gemma2" else {"sliding_window": None}
    config = AutoConfig.for_model(
        family, vocab_size=vocab, hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate_size, max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings, initializer_range=0.1, bos_token_id=0, eos_token_id=0,
        pad_token_id=None, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if family == "qwen2":  # qwen2 has q/k/v biases, initialised to zero: make them matter
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, 0.1)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(folder), **kwargs)
    save_tokenizer(tokenizer, folder, model_max_length=max_positions)
    return folder
