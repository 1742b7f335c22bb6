"""Build a span's modules: skeleton on the meta device, then only the span's tensors materialized."""
from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
from torch import nn
from transformers import AutoConfig

from beeswarm.shard import checkpoint, experts, quant
from beeswarm.shard.errors import ShardError
from beeswarm.shard.families import attention_implementation, family

log = logging.getLogger(__name__)


def load_config(folder: Path):
    try:
        config = AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError, KeyError) as e:
        raise ShardError(f"{folder}: cannot read config.json ({e})") from None
    family(config)  # fail early, naming the supported architectures
    config._attn_implementation = attention_implementation(config)
    if experts.count(config):
        config._experts_implementation = "grouped_mm"  # what transformers picks for a whole model: one kernel for all
    return config


ModuleT = TypeVar("ModuleT", bound=nn.Module)


def _materialize(module: ModuleT, prefix: str, tensors: dict[str, torch.Tensor], dtype, device) -> ModuleT:
    state = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
    module.load_state_dict(state, strict=True, assign=True)
    return module.to(device=device, dtype=dtype).eval().requires_grad_(False)


def build_layers(folder: Path, config, start: int, end: int, dtype, device, weights: str = "none",
                 on_layer: Callable[[int], None] = lambda done: None) -> nn.ModuleList:
    """transformers decoder layers [start, end) holding only their own weights, quantized to `weights` (a
    `quant.FORMATS`) as each is loaded; `on_layer(n)` after each."""
    if not 0 <= start < end <= config.num_hidden_layers:
        raise ShardError(f"span [{start}, {end}) is out of range: the model has layers [0, {config.num_hidden_layers})")
    cls = family(config).decoder_layer
    files = checkpoint.weight_map(folder)
    built = nn.ModuleList()
    for i in range(start, end):  # a layer at a time: host memory holds one layer's tensors, not the span's
        with torch.device("meta"):
            layer = cls(config, layer_idx=i)
        layer = _materialize(layer, "", _layer_tensors(folder, files, config, layer, i), dtype, device)
        built.append(quant.quantize_layer(layer, weights))
        on_layer(len(built))
    log.info("loaded layers [%d, %d) of %s (weights: %s)", start, end, folder, weights)
    return built


def _layer_tensors(folder: Path, files: dict[str, str], config, layer: nn.Module, i: int) -> dict[str, torch.Tensor]:
    """Layer `i`'s state dict from the files: names as the layer has them, experts fused where stored apart."""
    prefix, kind, count = f"model.layers.{i}.", config.model_type, experts.count(config)
    sources = {name: [prefix + name] if prefix + name in files else
               [prefix + n for n in experts.source_names(kind, name, count)] for name in layer.state_dict()}
    read = checkpoint.read_tensors(folder, files, [n for names in sources.values() for n in names])
    stripped = {name[len(prefix):]: t for name, t in read.items()}
    return {name: stripped[name] if names == [prefix + name] else experts.assemble(kind, name, count, stripped)
            for name, names in sources.items()}


def build_entry_parts(folder: Path, config, dtype, device) -> tuple[nn.Embedding, nn.Module, nn.Linear]:
    """Embedding, final norm and LM head (tied to the embedding when the config says so)."""
    fam = family(config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    tensors = checkpoint.read_tensors(folder, checkpoint.weight_map(folder), names)
    with torch.device("meta"):
        embed = nn.Embedding(config.vocab_size, config.hidden_size)
        norm = fam.rms_norm(config.hidden_size, eps=config.rms_norm_eps)
        head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    embed = _materialize(embed, "model.embed_tokens.", tensors, dtype, device)
    norm = _materialize(norm, "model.norm.", tensors, dtype, device)
    if tied:
        head.weight = embed.weight
        head = head.to(device=device)
    else:
        head = _materialize(head, "lm_head.", tensors, dtype, device)
    return embed, norm, head
