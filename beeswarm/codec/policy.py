"""Adaptive layout choice: compress only when the transfer time saved exceeds the time spent.

The codec's own speed and ratio per layout are measured once per dtype on a synthetic activation
(cached); a caller may pass its own figures instead (`speeds`: tests, for decisions that do not
depend on the machine). A `LinkCodec` refines the ratio from the frames it really sends and keeps
per-link counters. For a frame of n bytes on a link of B bytes/s the cost of a layout is
n/encode_speed + n/(ratio*B) + n/decode_speed, and the cheapest layout wins.
"""
from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from beeswarm.codec import frame
from beeswarm.codec.frame import Decoded

if TYPE_CHECKING:
    from beeswarm.codec.frame import BytesLike

SMALL_FRAME = 4096
_CALIBRATION_ELEMENTS = 1 << 17  # 256 KB of bf16: ~20 ms to calibrate all layouts
# With no link figure, assume a typical home uplink (100 Mbit/s).
DEFAULT_LINK_BYTES_PER_S = 100e6 / 8


@dataclass(frozen=True)
class LayoutSpeed:
    encode_bytes_per_s: float
    decode_bytes_per_s: float
    ratio: float  # raw bytes / wire bytes


def _synthetic_activation(dtype: str) -> bytes:
    """Hidden-state-like values: mostly unit Gaussian with a few large outliers, as real residuals have."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(_CALIBRATION_ELEMENTS).astype(np.float32)
    x[rng.integers(0, len(x), len(x) // 256)] *= 40
    if dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    if dtype == "float16":
        return x.astype(np.float16).tobytes()
    if dtype == "float32":
        return x.tobytes()
    return rng.integers(0, 50_000, _CALIBRATION_ELEMENTS).astype(np.dtype(dtype)).tobytes()


def _best_time(fn: Callable[[], object], repeat: int = 3) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return max(best, 1e-9)


@functools.cache
def measure(dtype: str) -> dict[str, LayoutSpeed]:
    """Speed and ratio of every layout on this machine for `dtype` (~20 ms, once per process and dtype).

    Servers call it at start (`warm_up`) so the first request does not pay for it.
    """
    raw = _synthetic_activation(dtype)
    shape = (len(raw) // frame.itemsize(dtype),)
    out = {}
    for layout in frame.LAYOUTS:
        encoded = frame.encode_layout(raw, dtype, shape, layout)
        enc = _best_time(lambda: frame.encode_layout(raw, dtype, shape, layout))
        dec = _best_time(lambda: frame.decode(encoded))
        out[layout] = LayoutSpeed(len(raw) / enc, len(raw) / dec, len(raw) / len(encoded))
    return out


def warm_up(dtypes: Iterable[str] = ("float32", "bfloat16", "float16")) -> None:
    for dtype in dtypes:
        measure(dtype)


# Codec figures per dtype, then per layout: what `measure` returns for each dtype.
Speeds = Mapping[str, Mapping[str, LayoutSpeed]]


def layout_speeds(dtype: str, speeds: Speeds | None = None) -> Mapping[str, LayoutSpeed]:
    """The figures for `dtype`: from `speeds` when it has them, else measured on this machine."""
    if speeds is not None and dtype in speeds:
        return speeds[dtype]
    return measure(dtype)


def choose_layout(nbytes: int, dtype: str, link_bytes_per_s: float | None,
                  ratios: dict[str, float] | None = None, speeds: Speeds | None = None) -> str:
    """The layout with the least encode + transfer + decode time for a frame of `nbytes`.

    `speeds` (dtype -> layout -> LayoutSpeed) replaces the measured figures for the dtypes it has."""
    if nbytes < SMALL_FRAME:
        return "raw"
    link = link_bytes_per_s or DEFAULT_LINK_BYTES_PER_S
    best, best_s = "raw", nbytes / link
    for layout, speed in layout_speeds(dtype, speeds).items():
        if layout == "raw":
            continue
        ratio = (ratios or {}).get(layout, speed.ratio)
        seconds = nbytes / speed.encode_bytes_per_s + nbytes / (ratio * link) + nbytes / speed.decode_bytes_per_s
        if seconds < best_s:
            best, best_s = layout, seconds
    return best


def encode(buffer: BytesLike, dtype: str, shape: tuple[int, ...], layout: str = "auto",
           link_bytes_per_s: float | None = None, speeds: Speeds | None = None) -> bytes:
    """Encode a tensor's bytes into a frame; `layout="auto"` asks the policy for this link."""
    if layout == "auto":
        layout = choose_layout(frame.byte_view(buffer).nbytes, dtype, link_bytes_per_s, speeds=speeds)
    return frame.encode_layout(buffer, dtype, shape, layout)


@dataclass
class LinkCodec:
    """The codec for one link: picks layouts from its bandwidth and counts what it moved both ways.

    Thread-safe; `link_bytes_per_s` may be updated as probes report new figures. `speeds` (dtype ->
    layout -> LayoutSpeed) replaces the measured codec figures for the dtypes it has.
    """

    link_bytes_per_s: float | None = None
    max_bytes: int = frame.DEFAULT_MAX_BYTES
    speeds: Speeds | None = None
    raw_bytes: int = 0  # sent: before encoding
    wire_bytes: int = 0  # sent: as framed
    raw_in: int = 0  # received: decoded
    wire_in: int = 0  # received: as framed
    frames: int = 0
    encode_s: float = 0.0
    decode_s: float = 0.0
    _ratios: dict[tuple[str, str], float] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def encode(self, buffer: BytesLike, dtype: str, shape: tuple[int, ...], layout: str = "auto") -> bytes:
        """A frame in `layout` (auto: the policy's choice for this link), counted."""
        nbytes = frame.byte_view(buffer).nbytes
        if layout == "auto":
            ratios = {name: r for (d, name), r in self._ratios.items() if d == dtype}
            layout = choose_layout(nbytes, dtype, self.link_bytes_per_s, ratios, self.speeds)
        t = time.perf_counter()
        out = frame.encode_layout(buffer, dtype, shape, layout)
        elapsed = time.perf_counter() - t
        with self._lock:
            if layout != "raw" and nbytes:
                seen = nbytes / len(out)
                old = self._ratios.get((dtype, layout), seen)
                self._ratios[(dtype, layout)] = 0.8 * old + 0.2 * seen
            self.raw_bytes += nbytes
            self.wire_bytes += len(out)
            self.frames += 1
            self.encode_s += elapsed
        return out

    def decode(self, data: BytesLike) -> Decoded:
        t = time.perf_counter()
        out = frame.decode(data, max_bytes=self.max_bytes)
        elapsed = time.perf_counter() - t
        with self._lock:
            self.decode_s += elapsed
            self.raw_in += out.data.nbytes
            self.wire_in += frame.byte_view(data).nbytes
        return out

    @property
    def compression_ratio(self) -> float:
        return self.raw_bytes / self.wire_bytes if self.wire_bytes else 1.0
