"""Model families served through one code path: transformers' own decoder-layer classes."""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

from beeswarm.shard.errors import ShardError

# model_type -> (module under transformers.models, class-name prefix)
SUPPORTED = {"llama": ("llama", "Llama"), "mistral": ("mistral", "Mistral"), "qwen2": ("qwen2", "Qwen2"),
             "qwen3": ("qwen3", "Qwen3"), "phi3": ("phi3", "Phi3"), "gemma2": ("gemma2", "Gemma2"),
             "gemma3_text": ("gemma3", "Gemma3"), "mixtral": ("mixtral", "Mixtral"),
             "qwen3_moe": ("qwen3_moe", "Qwen3Moe")}


@dataclass(frozen=True)
class Family:
    model_type: str
    decoder_layer: type
    rotary_embedding: Any  # a torch module class
    rms_norm: type

    @property
    def rotary_per_layer_type(self) -> bool:
        """Gemma 3 rotates local (sliding) and global layers with different bases: its rotary takes the type."""
        return "layer_type" in inspect.signature(self.rotary_embedding.forward).parameters


def family(config) -> Family:
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED:
        hint = " (the multimodal Gemma 3; its text-only checkpoints, gemma3_text, are)" \
            if model_type == "gemma3" else ""
        raise ShardError(f"architecture {model_type!r} is not supported{hint}; "
                         f"supported: {', '.join(sorted(SUPPORTED))}")
    name, prefix = SUPPORTED[model_type]
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    return Family(model_type, getattr(module, f"{prefix}DecoderLayer"), getattr(module, f"{prefix}RotaryEmbedding"),
                  getattr(module, f"{prefix}RMSNorm"))


class Rotary:
    """The cos/sin tables of a run of layers: one per rotary kind, computed once per step and shared."""

    def __init__(self, config, layers: range, device):
        fam = family(config)
        self.module = fam.rotary_embedding(config).to(device)
        self.kinds = [config.layer_types[i] if fam.rotary_per_layer_type else None for i in layers]

    def __call__(self, hidden, positions) -> list:
        """Per layer, the (cos, sin) pair its attention takes."""
        tables = {kind: self.module(hidden, positions, kind) if kind else self.module(hidden, positions)
                  for kind in set(self.kinds)}
        return [tables[kind] for kind in self.kinds]


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
