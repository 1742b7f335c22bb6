"""Lossless wire format for tensors (pure: numpy + zstandard, no torch, no networking).

    frame = encode(buffer, "bfloat16", (tokens, hidden), link_bytes_per_s=12.5e6)
    out = decode(frame)            # out.data, out.dtype, out.shape; raises CodecError
"""
from beeswarm.codec.frame import DEFAULT_MAX_BYTES, DTYPES, LAYOUTS, CodecError, Decoded, decode, encode_layout
from beeswarm.codec.policy import LinkCodec, choose_layout, encode, measure, warm_up

__all__ = ["CodecError", "DEFAULT_MAX_BYTES", "DTYPES", "Decoded", "LAYOUTS", "LinkCodec", "choose_layout",
           "decode", "encode", "encode_layout", "measure", "warm_up"]
