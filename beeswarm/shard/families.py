"""Model families served through one code path: transformers' own decoder-layer classes."""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from beeswarm.shard.errors import ShardError

# model_type -> class-name prefix in transformers.models.<type>.modeling_<type>
SUPPORTED = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}


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


def sliding_window(config, layer: int) -> int | None:
    """The attention window of `layer`, or None for full attention."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return config.sliding_window if types[layer] == "sliding_attention" else None
    return getattr(config, "sliding_window", None)
