"""Framing and message encoding on streams: u32 length + msgpack map with a type and a version.

Nothing a peer sends is executed or unpickled: msgpack yields only plain data (ext types are
refused), every frame is size-checked before it is read, and `expect` checks the fields a handler
uses before the handler sees the message.
"""
from __future__ import annotations

import struct
from typing import Any

import msgpack

CONTROL_LIMIT = 64 * 1024
TENSOR_LIMIT = 256 * 1024 * 1024
VERSION = 1
_LEN = struct.Struct(">I")


class ProtocolError(Exception):
    """A peer sent something malformed, oversized or unexpected."""


class RemoteError(Exception):
    """The peer answered a request with an error reply."""


def _no_ext(code: int, data: bytes):
    raise ProtocolError(f"msgpack extension type {code} is not accepted")


def pack(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes, limit: int = CONTROL_LIMIT) -> dict[str, Any]:
    if len(data) > limit:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the {limit}-byte limit")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True, ext_hook=_no_ext)
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 - msgpack raises many types on garbage
        raise ProtocolError(f"undecodable message ({type(e).__name__})") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str) or msg.get("v") != VERSION:
        raise ProtocolError("message is not a map with a string type 't' and version 'v' = 1")
    return msg


def message(kind: str, **fields: Any) -> dict[str, Any]:
    return {"t": kind, "v": VERSION, **fields}


def error(text: str) -> dict[str, Any]:
    return message("error", error=text[:1000])


def expect(msg: dict[str, Any], kind: str | tuple[str, ...], **fields: type | tuple[type, ...]) -> dict[str, Any]:
    """Check the type and the named fields' types; raise ProtocolError naming what is wrong."""
    kinds = (kind,) if isinstance(kind, str) else kind
    if msg.get("t") not in kinds:
        raise ProtocolError(f"unexpected message type {msg.get('t')!r}, expected {'/'.join(kinds)}")
    for name, typ in fields.items():
        value = msg.get(name)
        if not isinstance(value, typ) or (isinstance(value, bool) and bool not in (typ if isinstance(typ, tuple) else (typ,))):
            raise ProtocolError(f"field {name!r} of {msg['t']!r} is missing or not {getattr(typ, '__name__', typ)}")
    return msg


class FrameReader:
    """Reads frames from one stream through a buffer: one `stream.read` per frame, not two or more."""

    CHUNK = 256 * 1024

    def __init__(self, stream, limit: int):
        self.stream, self.limit = stream, limit
        self._buf = bytearray()

    async def _fill(self, n: int, what: str) -> bool:
        while len(self._buf) < n:
            chunk = await self.stream.read(max(self.CHUNK, n - len(self._buf)))
            if not chunk:
                if not self._buf and what == "header":
                    return False
                raise ProtocolError(f"stream ended inside a frame {what} ({len(self._buf)} of {n} bytes)")
            self._buf += chunk
        return True

    async def next(self) -> bytes | None:
        """The next frame's body, or None when the peer closed the stream between frames."""
        if not await self._fill(_LEN.size, "header"):
            return None
        (length,) = _LEN.unpack_from(self._buf)
        if length > self.limit:
            raise ProtocolError(f"frame of {length} bytes exceeds the {self.limit}-byte limit")
        await self._fill(_LEN.size + length, "body")
        body = bytes(self._buf[_LEN.size:_LEN.size + length])
        del self._buf[:_LEN.size + length]
        return body

    async def expect(self) -> bytes:
        body = await self.next()
        if body is None:
            raise ProtocolError("stream ended before a frame")
        return body


async def read_frame(stream, limit: int) -> bytes:
    """One frame from a stream read only for it (streams carrying many frames keep a FrameReader)."""
    return await FrameReader(stream, limit).expect()


async def write_frame(stream, body: bytes) -> None:
    await stream.write(_LEN.pack(len(body)) + body)
