"""Byte-plane transforms: split elements into planes by byte significance, and back.

Floats are rotated left by one bit first (as ZipNN does) so the sign moves to the lowest byte and
the exponent fills the top byte alone: the exponent plane then compresses well and the sign's
entropy joins the mantissa plane, which is stored as it is anyway. Wire order is little-endian.
Planes are cut and joined with whole-array shifts, which numpy runs at memory speed (a strided
transpose is 4x slower).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

_UINT: dict[int, np.dtype[np.unsignedinteger]] = {
    1: np.dtype("u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def split(data: memoryview, itemsize: int, rotate: bool) -> list[npt.NDArray[np.uint8]]:
    """itemsize uint8 arrays: plane i holds byte i (least significant first) of every element."""
    words = np.frombuffer(data, dtype=_UINT[itemsize])
    if rotate:
        bits = itemsize * 8
        words = (words << 1) | (words >> (bits - 1))
    return [(words >> (8 * i)).astype(np.uint8) if i else words.astype(np.uint8) for i in range(itemsize)]


def merge(planes: Sequence[bytes | memoryview], itemsize: int, rotate: bool) -> npt.NDArray[np.uint8]:
    """Inverse of `split`: a flat uint8 array of the original element bytes."""
    kind = _UINT[itemsize]
    words = np.frombuffer(planes[0], dtype=np.uint8).astype(kind)
    for i in range(1, itemsize):
        words |= np.frombuffer(planes[i], dtype=np.uint8).astype(kind) << kind.type(8 * i)
    if rotate:
        bits = itemsize * 8
        low = words >> kind.type(1)
        words <<= kind.type(bits - 1)
        words |= low
    return words.view(np.uint8)
