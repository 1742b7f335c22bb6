"""Device benchmark: how fast this machine runs one decoder layer of a model, and how much it holds.

Measures, with random weights of the model's layer shape on the chosen device: `layer_ms_base`
and `layer_ms_per_token` (a least-squares line over decode and prefill token counts), free device
memory, host memory for offload, and pinned host-to-device bandwidth on CUDA. Results are cached
per (model shape, device, dtype) in the cache dir. These are the planner's per-node inputs.
"""
from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import psutil
import torch

from beeswarm.config import cache_dir
from beeswarm.shard import checkpoint, quant
from beeswarm.shard.device import resolve_device, resolve_dtype
from beeswarm.shard.families import Rotary, family, kv_bytes_per_token_layer
from beeswarm.shard.loader import load_config

log = logging.getLogger(__name__)

TOKEN_COUNTS = (1, 4, 16, 64, 256)


@dataclass(frozen=True)
class BenchResult:
    model: str
    device: str
    dtype: str
    quant: str
    num_layers: int
    hidden_size: int
    layer_bytes: int
    kv_bytes_per_token_layer: int
    layer_ms_base: float
    layer_ms_per_token: float
    mem_bytes: int
    host_mem_bytes: int
    offload_gbps: float | None
    cached: bool = False


def layer_bytes(config, dtype: torch.dtype, weights: str = "none") -> int:
    """Bytes of one decoder layer in compute `dtype`, its linear maps' weights in format `weights` (`shard.quant`):
    the real layer class, so a MoE layer counts every expert."""
    with torch.device("meta"):
        layer = family(config).decoder_layer(config, layer_idx=0)
    return quant.weight_bytes(layer, dtype, weights)


def host_available_bytes() -> int:
    """Host memory available to new allocations without swapping."""
    return psutil.virtual_memory().available


def free_bytes(device: torch.device) -> int:
    """Memory free for new weights on `device` now (host memory on CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return host_available_bytes()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_layer(layer, rotary, config, device, dtype, tokens: int, repeat: int) -> float:
    hidden = torch.randn(1, tokens, config.hidden_size, device=device, dtype=dtype)
    positions = torch.arange(tokens, device=device)[None]
    rope = rotary(hidden, positions)[0]
    times = []
    with torch.inference_mode():
        for i in range(repeat + 2):
            _sync(device)
            t = time.perf_counter()
            layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=rope)
            _sync(device)
            if i >= 2:  # warm-up runs excluded
                times.append((time.perf_counter() - t) * 1e3)
    return min(times)  # the machine's capability; the median would count other processes' noise


def _offload_gbps(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    src = torch.empty(256 * 2**20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty_like(src, device=device)
    dst.copy_(src, non_blocking=True)
    _sync(device)
    t = time.perf_counter()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    _sync(device)
    return round(5 * src.numel() / (time.perf_counter() - t) / 1e9, 2)


def _cache_key(config, device: torch.device, dtype: torch.dtype, weights: str) -> str:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    shape = {k: getattr(config, k, None) for k in ("model_type", "hidden_size", "intermediate_size",
                                                    "num_attention_heads", "num_key_value_heads", "head_dim",
                                                    "num_local_experts", "num_experts", "num_experts_per_tok",
                                                    "moe_intermediate_size")}
    text = json.dumps([shape, name, str(dtype), weights, torch.__version__], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def run(model: str = checkpoint.DEFAULT_MODEL, device="auto", dtype="auto", refresh: bool = False,
        repeat: int = 7, progress: Callable[[str], None] = lambda s: None,
        on_step: Callable[[int, int], None] = lambda done, total: None, weights: str = "none") -> BenchResult:
    """`progress` gets lines to show; `on_step(done, total)` counts the measurements (for a progress bar);
    `weights`: the format the layer is timed and counted in (`shard.quant`)."""
    folder = checkpoint.resolve_config(model)
    config = load_config(folder)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    cache_file = cache_dir() / "bench" / f"{_cache_key(config, dev, dt, quant.check(weights))}.json"
    if cache_file.exists() and not refresh:
        try:
            cached = BenchResult(**{**json.loads(cache_file.read_text()), "cached": True, "model": model})
            progress(f"using cached figures from {cache_file} (--refresh to measure again)")
            on_step(1, 1)
            return replace_memory(cached, dev)
        except (ValueError, TypeError):
            log.warning("ignoring unreadable benchmark cache %s", cache_file)
    progress(f"benchmarking one {config.model_type} layer (hidden {config.hidden_size}) on {dev} in "
             f"{str(dt).removeprefix('torch.')}" + (f", {weights} weights" if weights != "none" else ""))
    torch.manual_seed(0)
    with torch.device(dev):
        layer = quant.quantize_layer(family(config).decoder_layer(config, layer_idx=0).to(dtype=dt).eval(), weights)
        rotary = Rotary(config, range(1), dev)
    points = []
    for i, tokens in enumerate(TOKEN_COUNTS):
        ms = _time_layer(layer, rotary, config, dev, dt, tokens, repeat)
        points.append((tokens, ms))
        progress(f"  [{i + 1}/{len(TOKEN_COUNTS)}] {tokens:>4} tokens: {ms:.3f} ms")
        on_step(i + 1, len(TOKEN_COUNTS) + 1)
    slope, intercept = statistics.linear_regression([p[0] for p in points], [p[1] for p in points])
    progress("measuring memory" + (" and host-to-device bandwidth" if dev.type == "cuda" else ""))
    result = BenchResult(
        model=model, device=str(dev), dtype=str(dt).removeprefix("torch."), quant=weights,
        num_layers=config.num_hidden_layers, hidden_size=config.hidden_size,
        layer_bytes=layer_bytes(config, dt, weights),
        kv_bytes_per_token_layer=kv_bytes_per_token_layer(config, dt),
        layer_ms_base=round(max(intercept, 1e-4), 5), layer_ms_per_token=round(max(slope, 0.0), 6),
        mem_bytes=0, host_mem_bytes=0, offload_gbps=_offload_gbps(dev))
    del layer
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    cache_file.write_text(json.dumps(asdict(result)))
    result = replace_memory(result, dev)
    on_step(len(TOKEN_COUNTS) + 1, len(TOKEN_COUNTS) + 1)
    return result


def replace_memory(result: BenchResult, device: torch.device) -> BenchResult:
    """Memory is measured fresh every time: it changes with what else runs."""
    from dataclasses import replace

    host = host_available_bytes()
    if device.type == "cuda":
        return replace(result, mem_bytes=free_bytes(device), host_mem_bytes=int(host))
    # On CPU the same memory holds the weights and serves as "host" memory: count it once.
    return replace(result, mem_bytes=int(host), host_mem_bytes=0)
