"""Weight formats a swarm serves: the checkpoint's own (`none`), int8 weight-only, NF4, through torchao.

torchao (pytorch/ao) was chosen by measuring on this project's CPU against optimum-quanto and bitsandbytes
(BENCHMARKS.md "Quantized weights"): it is maintained beside torch, does int8 weight-only with per-channel
scales on CPU and CUDA, and NF4 as a tensor type that runs anywhere (on CPU it dequantizes every call: fine
for tests, slow to serve). A layer is quantized as it is loaded, one at a time, so the full-precision span is
never held. Every linear map of a decoder layer is quantized, MoE experts included (their fused 3-D tensors
are split into one nn.Linear pair per expert first: `experts.UnfusedExperts`); norms and biases keep the
checkpoint's precision (counted so in `layer_bytes`).
"""
from __future__ import annotations

import torch
from torch import nn

from beeswarm.protocol.membership import QUANT_FORMATS
from beeswarm.shard import experts
from beeswarm.shard.errors import ShardError

FORMATS = QUANT_FORMATS
NF4_BLOCK = 64  # weights per NF4 scale (QLoRA's block)
NF4_SCALER_BLOCK = 256  # NF4 scales per scale of theirs (double quantization)


def check(quant: str) -> str:
    if quant not in FORMATS:
        raise ShardError(f"quant {quant!r}: expected one of {', '.join(FORMATS)}")
    return quant


def quantize_layer(layer: nn.Module, quant: str) -> nn.Module:
    """Replace the weights of `layer`'s linear maps with `quant` ones, in place (on the layer's device)."""
    if check(quant) == "none":
        return layer
    experts.unfuse(layer)
    if quant == "int8":
        from torchao.quantization import Int8WeightOnlyConfig, quantize_

        quantize_(layer, Int8WeightOnlyConfig(set_inductor_config=False))
        return layer
    from torchao.quantization import to_nf4

    for module in _linears(layer, quant):
        module.weight = nn.Parameter(to_nf4(module.weight.detach(), NF4_BLOCK, NF4_SCALER_BLOCK),
                                     requires_grad=False)
    return layer


def _linears(layer: nn.Module, quant: str) -> list[nn.Linear]:
    """The linear maps `quant` changes. NF4 takes whole blocks of blocks (64 x 256 weights: every real model's
    matrices); a smaller one (a tiny test model's) keeps its precision."""
    found = [m for m in layer.modules() if isinstance(m, nn.Linear)]
    if quant == "nf4":
        return [m for m in found if m.weight.numel() % (NF4_BLOCK * NF4_SCALER_BLOCK) == 0]
    return found if quant == "int8" else []


def weight_bytes(layer: nn.Module, dtype: torch.dtype, quant: str) -> int:
    """Bytes `layer` (built on the meta device in full precision, compute `dtype`) takes once loaded in `quant`
    (its experts are unfused on the way, as loading does)."""
    if check(quant) != "none":
        experts.unfuse(layer)
    changed = _linears(layer, quant)
    linear = sum(m.weight.numel() for m in changed)
    rest = (sum(p.numel() for p in layer.parameters()) - linear) * dtype.itemsize
    if quant == "int8":  # one byte a weight, one float32 scale per output row
        return rest + linear + 4 * sum(m.weight.shape[0] for m in changed)
    if quant == "nf4":  # half a byte a weight, ~1 byte a block of 64 for the double-quantized scales
        return rest + linear // 2 + linear // NF4_BLOCK
    return rest


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes a (possibly quantized) tensor holds: a torchao tensor's inner tensors, not its logical size."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()
