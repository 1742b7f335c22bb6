"""Weight offload: the last layers of a span live in host memory and stream to the device per pass.

Two device buffers take turns: while layer j computes in one, layer j+1's weights copy into the
other on a side CUDA stream (host memory pinned), so the copy hides behind compute. On a CPU-only
machine the same path copies host to host, which keeps it exercised and tested everywhere.
"""
from __future__ import annotations

import copy
from collections.abc import Iterator

import torch
from torch import nn

from beeswarm.shard.quant import tensor_bytes


class OffloadedLayers:
    def __init__(self, host_layers: list[nn.Module], device: torch.device):
        self.host, self.device = host_layers, device
        self.cuda = device.type == "cuda"
        if self.cuda:
            for layer in host_layers:
                for p in layer.parameters():
                    p.data = p.data.pin_memory()
        count = min(2, len(host_layers))
        self.buffers = [copy.deepcopy(host_layers[0]).to(device) for _ in range(count)] if count else []
        self.stream = torch.cuda.Stream(device) if self.cuda and count else None

    def __len__(self) -> int:
        return len(self.host)

    @property
    def host_bytes(self) -> int:
        return sum(tensor_bytes(p) for layer in self.host for p in layer.parameters())

    def _load(self, j: int, buffer: nn.Module) -> None:
        src = self.host[j]
        with torch.cuda.stream(self.stream) if self.cuda else _nothing():
            for dst, p in zip(buffer.parameters(), src.parameters(), strict=True):
                dst.data.copy_(p.data, non_blocking=self.cuda)
        # the KV cache is indexed by it
        buffer.get_submodule("self_attn").layer_idx = src.get_submodule("self_attn").layer_idx

    def layers(self) -> Iterator[nn.Module]:
        """Device modules holding each offloaded layer's weights in turn (valid until the next one)."""
        if not self.host:
            return
        side = self.stream  # set exactly when the device is cuda (and there are layers)
        self._load(0, self.buffers[0])
        for j in range(len(self.host)):
            if side is not None:
                torch.cuda.current_stream(self.device).wait_stream(side)  # layer j's weights are in
            if j + 1 < len(self.host):
                if side is not None:
                    side.wait_stream(torch.cuda.current_stream(self.device))  # layer j-1 is done with it
                self._load(j + 1, self.buffers[(j + 1) % 2])
            yield self.buffers[j % 2]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
