"""Torch tensors <-> codec frames (the codec itself stays torch-free)."""
from __future__ import annotations

import torch

from beeswarm import codec

_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "int32": torch.int32,
          "int64": torch.int64, "uint8": torch.uint8}
_NAMES = {v: k for k, v in _TORCH.items()}
# numpy has no bfloat16: move its bits as int16
_CARRIER = {torch.bfloat16: torch.int16}


def encode(tensor: torch.Tensor, link: codec.LinkCodec | None = None, layout: str = "auto") -> bytes:
    if tensor.dtype not in _NAMES:
        raise codec.CodecError(f"dtype: {tensor.dtype} has no wire form")
    t = tensor.detach().to("cpu").contiguous()
    buf = t.view(_CARRIER.get(t.dtype, t.dtype)).numpy()
    name, shape = _NAMES[tensor.dtype], tuple(t.shape)
    if link is not None:
        return link.encode(buf, name, shape, layout)
    return codec.encode(buf, name, shape, layout=layout)


def decode(frame: bytes, link: codec.LinkCodec | None = None, max_bytes: int = codec.DEFAULT_MAX_BYTES) -> torch.Tensor:
    out = link.decode(frame) if link is not None else codec.decode(frame, max_bytes=max_bytes)
    dtype = _TORCH[out.dtype]
    carrier = _CARRIER.get(dtype, dtype)
    flat = torch.frombuffer(bytearray(out.data), dtype=carrier) if len(out.data) else torch.empty(0, dtype=carrier)
    return flat.view(dtype).reshape(out.shape)
