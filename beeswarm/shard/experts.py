"""Mixture-of-experts checkpoints: one tensor per expert on disk, one 3-D tensor per kind in transformers' layers.

transformers 5 fuses a layer's experts into `mlp.experts.gate_up_proj` (experts, 2 * inner, hidden) and
`mlp.experts.down_proj` (experts, hidden, inner), and converts checkpoints as it loads a whole model. A stage
loads one layer at a time from the files, so it does the same conversion here, for that layer only.
"""
from __future__ import annotations

import torch

# family -> fused name (under model.layers.<i>.) -> the per-expert names it is made of ("{e}": the expert),
# stacked per name, then concatenated along dim 1 in this order (gate before up)
PER_EXPERT = {
    "mixtral": {
        "mlp.experts.gate_up_proj": ("block_sparse_moe.experts.{e}.w1.weight",
                                     "block_sparse_moe.experts.{e}.w3.weight"),
        "mlp.experts.down_proj": ("block_sparse_moe.experts.{e}.w2.weight",),
    },
    "qwen3_moe": {
        "mlp.experts.gate_up_proj": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
        "mlp.experts.down_proj": ("mlp.experts.{e}.down_proj.weight",),
    },
}
RENAMED = {"mixtral": {"mlp.gate.weight": "block_sparse_moe.gate.weight"}}  # the router


def count(config) -> int:
    """Experts per MoE layer (0 for a dense model)."""
    return int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0)


def source_names(model_type: str, name: str, experts: int) -> list[str]:
    """The names in the files that the layer's tensor `name` is made of (itself when the family stores it as is)."""
    if name in RENAMED.get(model_type, {}):
        return [RENAMED[model_type][name]]
    templates = PER_EXPERT.get(model_type, {}).get(name, ())
    return [t.format(e=e) for t in templates for e in range(experts)] or [name]


def assemble(model_type: str, name: str, experts: int, read: dict[str, torch.Tensor]) -> torch.Tensor:
    """The layer's tensor `name` from what `source_names` named (`read`: those names -> tensors)."""
    templates = PER_EXPERT.get(model_type, {}).get(name)
    if templates is None:
        return read[source_names(model_type, name, experts)[0]]
    return torch.cat([torch.stack([read[t.format(e=e)] for e in range(experts)]) for t in templates], dim=1)
