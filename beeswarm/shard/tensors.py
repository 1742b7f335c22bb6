"""Torch tensors <-> codec frames (the codec itself stays torch-free)."""
from __future__ import annotations

import torch

from beeswarm import codec
from beeswarm.protocol import ProtocolError
from beeswarm.shard.device import DTYPE_NAMES, TORCH_DTYPES

# numpy has no bfloat16: move its bits as int16
_CARRIER = {torch.bfloat16: torch.int16}


def encode(tensor: torch.Tensor, link: codec.LinkCodec | None = None, layout: str = "auto") -> bytes:
    if tensor.dtype not in DTYPE_NAMES:
        raise codec.CodecError(f"dtype: {tensor.dtype} has no wire form")
    t = tensor.detach().to("cpu").contiguous()
    buf = t.view(_CARRIER.get(t.dtype, t.dtype)).numpy()
    name, shape = DTYPE_NAMES[tensor.dtype], tuple(t.shape)
    if link is not None:
        return link.encode(buf, name, shape, layout)
    return codec.encode(buf, name, shape, layout=layout)


def decode(frame: bytes, link: codec.LinkCodec | None = None, max_bytes: int = codec.DEFAULT_MAX_BYTES) -> torch.Tensor:
    out = link.decode(frame) if link is not None else codec.decode(frame, max_bytes=max_bytes)
    dtype = TORCH_DTYPES[out.dtype]
    carrier = _CARRIER.get(dtype, dtype)
    flat = torch.frombuffer(bytearray(out.data), dtype=carrier) if len(out.data) else torch.empty(0, dtype=carrier)
    return flat.view(dtype).reshape(out.shape)


def encode_mask(mask: torch.Tensor | None) -> bytes | None:
    """A tree mask as a raw uint8 frame (None: no mask)."""
    return None if mask is None else encode(mask.to(torch.uint8), layout="raw")


def decode_mask(data: bytes | None, q: int, start: int) -> torch.Tensor | None:
    """The bool tree mask of a step of q tokens at `start`: (q, w) with q <= w <= q + start (the step's own
    columns, after up to `start` cached positions before them); raises ProtocolError on anything else."""
    if data is None:
        return None
    try:
        mask = decode(data, max_bytes=q * (q + start))
    except codec.CodecError as e:
        raise codec.CodecError(f"tree mask: {e}") from None
    if mask.dtype != torch.uint8 or mask.dim() != 2 or mask.shape[0] != q or not q <= mask.shape[1] <= q + start:
        raise ProtocolError(f"tree mask must be uint8 ({q}, {q}..{q + start})")
    return mask.bool()
