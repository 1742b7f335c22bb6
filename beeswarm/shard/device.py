"""Device and dtype choice: `auto` picks CUDA when present."""
from __future__ import annotations

import torch

from beeswarm import codec
from beeswarm.shard.errors import ShardError

# The one torch name <-> dtype table: every dtype a codec frame carries, under the codec's name for it.
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, name) for name in codec.DTYPES}
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}
# The dtypes a model may run in.
DTYPES = {name: TORCH_DTYPES[name] for name in ("float32", "float16", "bfloat16")}


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise ShardError(f"device {device!r}: expected auto, cpu or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ShardError(f"device {device!r}: CUDA is not available on this machine")
    return resolved


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | None = None) -> torch.dtype:
    """`auto`: bfloat16 on CUDA, float32 on CPU (half-precision matmuls are slow on most CPUs)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device is not None and device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ShardError(f"dtype {dtype!r}: expected auto or one of {', '.join(DTYPES)}")
    return DTYPES[dtype]
