"""Framing on streams: a u32 big-endian length, then the body (a message or a tensor frame).

Every frame's declared length is checked against the reader's limit before its body is read.
What a body holds is `beeswarm.protocol`'s business.
"""
from __future__ import annotations

import struct
from typing import Any

from beeswarm.protocol import ProtocolError

_LEN = struct.Struct(">I")


class FrameReader:
    """Reads frames from one stream through a buffer: one `stream.read` per frame, not two or more."""

    CHUNK = 256 * 1024

    def __init__(self, stream: Any, limit: int):
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


async def read_frame(stream: Any, limit: int) -> bytes:
    """One frame from a stream read only for it (streams carrying many frames keep a FrameReader)."""
    return await FrameReader(stream, limit).expect()


async def write_frame(stream: Any, body: bytes) -> None:
    await stream.write(_LEN.pack(len(body)) + body)
