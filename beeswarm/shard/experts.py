"""Mixture-of-experts checkpoints: one tensor per expert on disk, one 3-D tensor per kind in transformers' layers.

transformers 5 fuses a layer's experts into `mlp.experts.gate_up_proj` (experts, 2 * inner, hidden) and
`mlp.experts.down_proj` (experts, hidden, inner), and converts checkpoints as it loads a whole model. A stage
loads one layer at a time from the files, so it does the same conversion here, for that layer only.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

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


class UnfusedExperts(nn.Module):
    """A MoE layer's experts as one nn.Linear pair per expert, so a weight format quantizes them as it does every
    linear map (torchao takes nn.Linear, not transformers' fused 3-D tensors). Same computation as transformers'
    eager experts loop: each expert runs on the tokens routed to it, weighted, summed."""

    def __init__(self, fused: Any):  # transformers' experts module of the family
        super().__init__()
        self.num_experts, self.act_fn = fused.num_experts, fused.act_fn
        # each expert's matrix its own tensor (a view of the fused one would tie formats' storage to it)
        self.gate_up = nn.ModuleList(_linear(w.clone()) for w in fused.gate_up_proj.detach())
        self.down = nn.ModuleList(_linear(w.clone()) for w in fused.down_proj.detach())

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in top_k_index.unique().tolist():
            token, slot = torch.where(top_k_index == e)
            gate, up = self.gate_up[e](hidden_states[token]).chunk(2, dim=-1)
            routed = self.down[e](self.act_fn(gate) * up) * top_k_weights[token, slot, None]
            out.index_add_(0, token, routed.to(out.dtype))
        return out


def _linear(weight: torch.Tensor) -> nn.Linear:
    with torch.device("meta"):
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def fused_experts(layer: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, experts) for each fused experts module in `layer` (MoE layers: one)."""
    return [(parent, name, child) for parent in layer.modules() for name, child in parent.named_children()
            if isinstance(w := getattr(child, "gate_up_proj", None), nn.Parameter) and w.dim() == 3]


def unfuse(layer: nn.Module) -> nn.Module:
    """Replace `layer`'s fused experts with `UnfusedExperts` (the same weights), in place."""
    for parent, name, fused in fused_experts(layer):
        setattr(parent, name, UnfusedExperts(fused))
    return layer
