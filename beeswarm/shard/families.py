"""Model families served through one code path: transformers' own decoder-layer classes."""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from beeswarm.shard.errors import ShardError

# model_type -> class-name prefix in transformers.models.<type>.modeling_<type>
SUPPORTED = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3",
             "gemma2": "Gemma2"}


@dataclass(frozen=True)
class Family:
    model_type: str
    decoder_layer: type
    rotary_embedding: type
    rms_norm: type


def family(config) -> Family:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        raise ShardError(f"architecture {model_type!r} is not supported; supported: {', '.join(sorted(SUPPORTED))}")
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    prefix = SUPPORTED[model_type]
    return Family(model_type, getattr(module, f"{prefix}DecoderLayer"), getattr(module, f"{prefix}RotaryEmbedding"),
                  getattr(module, f"{prefix}RMSNorm"))


def embedding_scale(config) -> float:
    """What the entry multiplies embeddings by: Gemma scales them by sqrt(hidden_size), others do not."""
    return float(config.hidden_size) ** 0.5 if config.model_type.startswith("gemma") else 1.0


def final_softcap(config) -> float | None:
    """Gemma 2 squashes the logits into (-cap, cap) with tanh; None: no cap."""
    return getattr(config, "final_logit_softcapping", None)


def attention_implementation(config) -> str:
    """sdpa, except where attention logits are soft-capped (Gemma 2): sdpa cannot, eager can."""
    return "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"


def sliding_window(config, layer: int) -> int | None:
    """The attention window of `layer`, or None for full attention."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return config.sliding_window if types[layer] == "sliding_attention" else None
    return getattr(config, "sliding_window", None)


def head_dim(config) -> int:
    """Width of one attention head: the config's `head_dim` when it sets one, else hidden_size / heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes_per_token_layer(config, dtype) -> int:
    """Bytes the keys and values of one token take in one layer's cache, stored in torch `dtype`."""
    return 2 * config.num_key_value_heads * head_dim(config) * dtype.itemsize
