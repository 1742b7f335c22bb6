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
                          vocab_size: int | None = None, initializer_range: float = 0.1) -> Path:
    """Write a random `family` model with a 257-symbol byte-level tokenizer to `folder`.

    `vocab_size` below 257 makes a model for tests of sampling only: its tokenizer no longer fits.

    `max_shard_size` (e.g. "40KB") splits the weights into several files with an index.
    Weights are drawn with std `initializer_range` (0.1: hidden states differ visibly between layers; a wide model
    wants a real one's 0.02).
    """
    if family not in SUPPORTED:
        raise ValueError(f"family {family!r}: expected one of {sorted(SUPPORTED)}")
    tokenizer = byte_tokenizer()
    vocab = vocab_size or tokenizer.get_vocab_size()
    config = AutoConfig.for_model(
        family, vocab_size=vocab, hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=heads,
        num_key_value_heads=kv_heads, intermediate_size=intermediate_size, max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings, initializer_range=initializer_range, bos_token_id=0, eos_token_id=0,
        pad_token_id=None, **_family_settings(family, num_layers, hidden_size // heads, intermediate_size))
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


def _family_settings(family: str, num_layers: int, head_dim: int, intermediate_size: int) -> dict:
    """What makes each family's distinctive parts matter at tiny size."""
    if family.startswith("gemma"):
        # sliding-window and global layers alternate; a window of 8 makes the sliding ones matter (Gemma 3: with
        # rotary bases of their own)
        extra: dict[str, object] = {"sliding_window": 8, "head_dim": head_dim, "query_pre_attn_scalar": head_dim}
        if family == "gemma3_text":
            extra["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
        return extra
    if family == "mixtral":
        return {"sliding_window": None, "num_local_experts": 4, "num_experts_per_tok": 2}
    if family == "qwen3_moe":
        return {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": intermediate_size // 2,
                "decoder_sparse_step": 1, "mlp_only_layers": []}
    return {"sliding_window": None}
