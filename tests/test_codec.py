"""Codec: bit-exact round trips, hostile frames raise only CodecError, the policy picks by link speed."""
from __future__ import annotations

import math
import random
import struct

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from beeswarm import codec
from beeswarm.codec import CodecError, frame
from beeswarm.codec.policy import LayoutSpeed

NUMPY = {"bfloat16": np.uint16, "float16": np.float16, "float32": np.float32, "int32": np.int32,
         "int64": np.int64, "uint8": np.uint8}
SPECIAL_BITS = {  # NaN payloads, signed zeros, infinities, subnormals, extremes
    "bfloat16": [0x7FC0, 0x7F81, 0xFFC1, 0x8000, 0x0000, 0x7F80, 0xFF80, 0x0001, 0x7F7F, 0xFF7F],
    "float16": [0x7E00, 0x7C01, 0xFE01, 0x8000, 0x0000, 0x7C00, 0xFC00, 0x0001, 0x7BFF],
    "float32": [0x7FC00000, 0x7F800001, 0xFFC00001, 0x80000000, 0, 0x7F800000, 0xFF800000, 1, 0x7F7FFFFF],
}


def activation(dtype: str, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32) * 3
    if dtype == "bfloat16":
        return (x.view(np.uint32) >> 16).astype(np.uint16)
    if dtype in ("float16", "float32"):
        return x.astype(NUMPY[dtype])
    return rng.integers(-(2**31), 2**31 - 1, n).astype(NUMPY[dtype]) if dtype != "uint8" else \
        rng.integers(0, 255, n).astype(np.uint8)


@st.composite
def tensors(draw):
    dtype = draw(st.sampled_from(sorted(NUMPY)))
    shape = tuple(draw(st.lists(st.integers(0, 9), min_size=0, max_size=4)))
    n = math.prod(shape)
    size = np.dtype(NUMPY[dtype]).itemsize
    raw = draw(st.binary(min_size=n * size, max_size=n * size))
    arr = np.frombuffer(raw, dtype=np.uint8).copy()
    if dtype in SPECIAL_BITS and n:
        words = arr.view({2: np.uint16, 4: np.uint32}[size])
        for i in draw(st.lists(st.integers(0, n - 1), max_size=n)):
            words[i] = draw(st.sampled_from(SPECIAL_BITS[dtype]))
    return dtype, shape, arr


@settings(max_examples=300, deadline=None)
@given(tensors(), st.sampled_from(["raw", "zstd", "planes", "auto"]))
def test_round_trip_is_bit_exact(tensor, layout):
    dtype, shape, arr = tensor
    out = codec.decode(codec.encode(arr, dtype, shape, layout=layout))
    assert (out.dtype, out.shape) == (dtype, shape)
    assert bytes(out.data) == arr.tobytes()


@pytest.mark.parametrize("dtype", sorted(NUMPY))
@pytest.mark.parametrize("layout", ["raw", "zstd", "planes"])
def test_large_activations_round_trip_and_header_is_small(dtype, layout):
    arr = activation(dtype, 64 * 1024 // np.dtype(NUMPY[dtype]).itemsize)
    encoded = codec.encode(arr, dtype, (4, 4, 8, arr.size // 128), layout=layout)
    assert bytes(codec.decode(encoded).data) == arr.tobytes()
    if layout == "raw":
        assert len(encoded) - arr.nbytes <= 64


def test_planes_beat_whole_buffer_zstd_on_bf16_activations():
    arr = activation("bfloat16", 256 * 1024)
    planes = len(codec.encode(arr, "bfloat16", arr.shape, layout="planes"))
    whole = len(codec.encode(arr, "bfloat16", arr.shape, layout="zstd"))
    assert arr.nbytes / planes >= 1.25
    assert planes < 0.9 * whole


def test_incompressible_planes_are_stored_raw():
    arr = np.random.default_rng(1).integers(0, 256, 200_000).astype(np.uint8)
    encoded = codec.encode(arr, "uint8", arr.shape, layout="planes")
    assert len(encoded) < arr.nbytes + 64  # stored, not expanded by zstd


def test_encode_rejects_mismatched_buffer():
    with pytest.raises(CodecError, match="buffer"):
        codec.encode(np.zeros(10, np.float32), "float32", (11,))
    with pytest.raises(CodecError, match="dtype"):
        codec.encode(np.zeros(10, np.float32), "complex64", (10,))


def _valid_frames() -> list[bytes]:
    frames = []
    for dtype in sorted(NUMPY):
        for layout in ("raw", "zstd", "planes"):
            arr = activation(dtype, 256)
            frames.append(codec.encode(arr, dtype, (16, arr.size // 16), layout=layout))
    return frames


def test_mutation_fuzz_raises_only_codec_error():
    rng = random.Random(1234)
    frames = _valid_frames()
    outcomes = {"error": 0, "ok": 0}
    for i in range(20_000):
        f = bytearray(rng.choice(frames))
        kind = i % 5
        if kind == 0:  # flip bytes
            for _ in range(rng.randint(1, 4)):
                f[rng.randrange(len(f))] = rng.randrange(256)
        elif kind == 1:  # truncate
            f = f[: rng.randrange(len(f))]
        elif kind == 2:  # append junk
            f += bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
        elif kind == 3:  # random bytes, sometimes behind a valid magic
            f = bytearray(rng.randbytes(rng.randint(0, 200)))
            if rng.random() < 0.5:
                f[:5] = frame.MAGIC + bytes([frame.VERSION])
        else:  # rewrite a header field with an extreme value
            offset = rng.choice([4, 5, 6, 7, 8, 9, 10, 12, 16, 20, 24])
            width = 4 if offset >= 12 else 1
            f[offset:offset + width] = rng.choice([0, 1, 255, 2**31, 2**32 - 1]).to_bytes(8, "little")[:width]
        try:
            codec.decode(bytes(f))
            outcomes["ok"] += 1
        except CodecError:
            outcomes["error"] += 1
    assert outcomes["error"] > 15_000  # nearly every mutation is caught (a few hit a value byte twice)


@pytest.mark.parametrize("mutate, field", [
    (lambda f: b"XXXX" + f[4:], "magic"),
    (lambda f: f[:4] + b"\x09" + f[5:], "version"),
    (lambda f: f[:5] + b"\x63" + f[6:], "dtype"),
    (lambda f: f[:6] + b"\x07" + f[7:], "layout"),
    (lambda f: f[:-1], "truncated"),
    (lambda f: f + b"\x00", "trailing"),
    (lambda f: f[:8], "header"),
    (lambda f: f[:-1] + bytes([f[-1] ^ 1]), "checksum"),
])
def test_errors_name_the_field(mutate, field):
    arr = activation("float32", 64)
    good = codec.encode(arr, "float32", (64,), layout="raw")
    with pytest.raises(CodecError, match=field):
        codec.decode(mutate(good))


def test_small_frame_cannot_cause_a_large_allocation():
    # A 48-byte frame claiming a 2^32 x 2^32 tensor is rejected before anything is allocated.
    head = struct.pack("<4sBBBBBBHI", frame.MAGIC, frame.VERSION, 3, 0, 2, 1, 0, 0, 0)
    bogus = head + struct.pack("<3I", 2**32 - 1, 2**32 - 1, 0)
    with pytest.raises(CodecError, match="limit"):
        codec.decode(bogus)
    # A zstd plane declaring more content than the shape allows.
    arr = np.zeros(4096, np.float32)
    good = bytearray(codec.encode(arr, "float32", arr.shape, layout="zstd"))
    bomb = zstandard.ZstdCompressor().compress(bytes(10_000_000))
    forged = bytes(good[:16]) + struct.pack("<2I", 4096, len(bomb)) + bomb
    with pytest.raises(CodecError, match="plane"):
        codec.decode(forged)
    with pytest.raises(CodecError, match="limit"):
        codec.decode(codec.encode(arr, "float32", arr.shape), max_bytes=1000)


# Codec figures for the policy tests (bytes/s and ratio; a slowish machine), so that their decisions do
# not depend on how fast this machine encodes: the speeds measured at start-up are not a test input.
def bf16_speeds(planes_encode: float = 250e6, zstd_encode: float = 400e6) -> dict:
    return {"bfloat16": {"raw": LayoutSpeed(4e9, 4e9, 1.0), "zstd": LayoutSpeed(zstd_encode, 500e6, 1.25),
                         "planes": LayoutSpeed(planes_encode, 600e6, 1.45)}}


SPEEDS = bf16_speeds()


def test_policy_picks_raw_on_fast_links_and_planes_on_slow_ones():
    nbytes = 512 * 1024
    # 10 Gbit/s: 0.4 ms raw against 2 ms just to encode planes; 50 Mbit/s: 84 ms raw, 61 ms as planes
    # (2.1 ms encode + 57.9 ms transfer + 0.9 ms decode), 70 ms as zstd.
    assert codec.choose_layout(nbytes, "bfloat16", 10e9 / 8, speeds=SPEEDS) == "raw"
    assert codec.choose_layout(nbytes, "bfloat16", 50e6 / 8, speeds=SPEEDS) == "planes"
    assert codec.choose_layout(1024, "bfloat16", 1e6, speeds=SPEEDS) == "raw"  # small frames go raw
    # The cost model weighs encode time against wire time: slow planes lose to zstd, both slow lose to raw.
    assert codec.choose_layout(nbytes, "bfloat16", 50e6 / 8, speeds=bf16_speeds(planes_encode=10e6)) == "zstd"
    assert codec.choose_layout(nbytes, "bfloat16", 50e6 / 8, speeds=bf16_speeds(10e6, 10e6)) == "raw"
    # No link figure: a 100 Mbit/s uplink is assumed (42 ms raw, 32 ms as planes).
    assert codec.choose_layout(nbytes, "bfloat16", None, speeds=SPEEDS) == "planes"
    # The module-level encode takes the same figures.
    arr = activation("bfloat16", nbytes // 2)
    assert codec.decode(codec.encode(arr, "bfloat16", arr.shape, link_bytes_per_s=50e6 / 8,
                                     speeds=bf16_speeds(planes_encode=10e6))).layout == "zstd"


def test_link_codec_counts_bytes_and_time():
    link = codec.LinkCodec(link_bytes_per_s=50e6 / 8, speeds=SPEEDS)
    arr = activation("bfloat16", 128 * 1024)
    for _ in range(3):
        out = link.decode(link.encode(arr, "bfloat16", arr.shape))
        assert bytes(out.data) == arr.tobytes()
        assert out.layout == "planes"
    assert link.frames == 3 and link.raw_bytes == 3 * arr.nbytes
    assert link.wire_bytes < link.raw_bytes and link.compression_ratio > 1.25
    assert link.encode_s > 0 and link.decode_s > 0
    assert (link.raw_in, link.wire_in) == (link.raw_bytes, link.wire_bytes)  # what it received: the same frames


def test_concurrent_encoders_and_decoders_are_safe():
    """Stages encode and decode from several threads at once (zstd contexts are per thread)."""
    import threading

    arr = activation("bfloat16", 64 * 1024)
    want = arr.tobytes()
    errors = []

    def work():
        for _ in range(30):
            out = codec.decode(codec.encode(arr, "bfloat16", arr.shape, layout="planes"))
            if bytes(out.data) != want:
                errors.append("mismatch")

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
