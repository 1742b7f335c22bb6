"""The typed messages every peer speaks: value types, protocol ids, encoding and validation.

Both sides of every protocol use these types, so no package imports a peer package for a message
shape. Pure: msgspec only (no torch, no networking). One module per message family.
"""
from beeswarm.protocol.encoding import (
    CONTROL_LIMIT,
    TENSOR_LIMIT,
    Decoder,
    ErrorReply,
    Message,
    ProtocolError,
    RemoteError,
    encode,
)
from beeswarm.protocol.spans import Span

__all__ = ["CONTROL_LIMIT", "TENSOR_LIMIT", "Decoder", "ErrorReply", "Message", "ProtocolError", "RemoteError",
           "Span", "encode"]
